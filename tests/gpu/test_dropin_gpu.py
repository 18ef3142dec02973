"""gpumem as a drop-in for PyTorch's CUDA allocator: every place where torch reaches into its allocator
(storage deleters, cudagraph-tree checkpoints, memory fraction, OOM errors, memory history and the
viewers, snapshots, CUDA IPC) behaves as it does with PyTorch's own allocator. Every test is marked
``gpu``:

    python -m pytest -m gpu tests/gpu/test_dropin_gpu.py -q

Each scenario of tests/gpu/dropin_scenarios.py runs in a fresh process, because gpumem must become
torch's allocator before CUDA starts (in pytest's own process, which allocator is in charge depends on
which GPU test touched CUDA first). Each runs twice: with PyTorch's own allocator first (if that run
fails, the test's expectation does not hold for this torch, and the failure says so), then with
gpumem; the two runs' observations are compared where gpumem must match PyTorch exactly.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass, field

import pytest
from _run import clean_env, finish, start

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the GPU machine with -m gpu)", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "dropin_scenarios.py")
with open(os.path.join(HERE, "dropin_process.py")) as _f:  # names, without importing (it imports gpumem)
    NOCRASH = re.findall(r"^def nocrash_(\w+)\(", _f.read(), flags=re.M)
IPC_SUM = float(1000 * 999 // 2)


@dataclass
class Run:
    allocator: str
    scenario: str
    rc: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool
    facts: dict = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return "ALIVE" in self.stdout.splitlines()

    def describe(self) -> str:
        return (f"{self.allocator} run of {self.scenario}: rc {self.rc}, {self.seconds:.1f} s"
                + (" (killed: timeout)" if self.timed_out else "")
                + f"\n--- stdout:\n{self.stdout[-4000:]}\n--- stderr:\n{self.stderr[-8000:]}")


def run(allocator: str, scenario: str, timeout: float = 300) -> Run:
    t0 = time.monotonic()
    proc = start([sys.executable, SCRIPT, scenario], clean_env(GPUMEM_DROPIN_ALLOCATOR=allocator))
    # on timeout the scenario's whole process group is killed (spawned children too)
    out, err, timed_out = finish(proc, timeout)
    r = Run(allocator, scenario, proc.returncode, out, err, time.monotonic() - t0, timed_out)
    for line in out.splitlines():
        if line.startswith("FACTS "):
            r.facts = json.loads(line[len("FACTS "):])
    return r


def both(scenario: str, timeout: float = 300):
    """Run with PyTorch's allocator, then gpumem; both must pass the scenario's own checks."""
    native = run("native", scenario, timeout)
    assert native.rc == 0 and native.alive, (
        "PyTorch's own allocator fails this scenario too, so the expectation is wrong for this torch "
        "version:\n" + native.describe())
    gpumem = run("gpumem", scenario, timeout)
    assert gpumem.rc == 0 and gpumem.alive, gpumem.describe()
    print(f"\n{scenario}: native {native.seconds:.1f} s, gpumem {gpumem.seconds:.1f} s")
    return native.facts, gpumem.facts


@pytest.mark.gpu
def test_storage_deleters_are_the_allocators_raw_deleter():
    """torch._C._has_Standard_Deleter is True for a plain tensor, a tensor made in CUDA graph capture
    (private pool) and one made under torch.cuda.use_mem_pool(MemPool()): cudagraph trees asserts it,
    and setCheckpointPoolState swaps exactly that deleter."""
    n, g = both("deleters")
    assert g["standard_deleter"] == n["standard_deleter"]


@pytest.mark.gpu
def test_checkpoint_restore_like_pytorch():
    """_cuda_getCheckpointState of a graph pool; the outputs die; _cuda_setCheckpointPoolState(state,
    [], []) puts the same blocks back, active_allocated at the same addresses and sizes (snapshot),
    memory_allocated as before; the graph replays into them; raw_delete frees them one by one;
    _cuda_checkPoolLiveAllocations agrees at every step."""
    n, g = both("checkpoint_restore")
    assert g["restored_blocks"] == n["restored_blocks"]


@pytest.mark.gpu
def test_checkpoint_restore_frees_blocks_allocated_after_it():
    """Blocks a second graph allocated in the pool after the checkpoint are freed by the restore (their
    storages passed as stale lose their deleters: deleting the tensors frees nothing twice)."""
    n, g = both("checkpoint_frees_later_blocks")
    assert g["freed_by_restore"] == n["freed_by_restore"]


@pytest.mark.gpu
def test_memory_fraction():
    """get is 1.0 at start; set(0.0) then get is 0.0 and every allocation (1 B .. 64 MiB) raises
    torch.cuda.OutOfMemoryError; set/get round-trips 27 values to within one byte of the device (as
    PyTorch, which keeps the cap in bytes); invalid values raise the exception types PyTorch raises
    (ValueError / TypeError from torch's wrapper, whatever PyTorch's C++ raises for NaN and direct
    torch._C._cuda_setMemoryFraction calls) and leave the fraction unchanged."""
    n, g = both("fraction")
    assert g["fraction_zero"] == n["fraction_zero"]
    assert g["invalid"] == n["invalid"], f"gpumem {g['invalid']} vs PyTorch {n['invalid']}"


@pytest.mark.gpu
def test_oom_messages_and_recovery():
    """800000000 GiB: OutOfMemoryError 'CUDA out of memory. Tried to allocate 800000000.00 GiB. GPU 0
    has a total capacity of ...'; over 1 EB: '... Tried to allocate more than 1EB memory'; just over
    the free device memory: PyTorch's opening sentence ('... of which X is free.'), then (gpumem)
    gpumem's figures. A tensor made before keeps its data; the next allocation works; num_ooms counts
    the OOMs as PyTorch counts them."""
    n, g = both("oom_text")
    for case, nc in n["cases"].items():
        gc_ = g["cases"][case]
        assert gc_["kind"] == nc["kind"] == "OutOfMemoryError", (case, gc_, nc)
        assert gc_["num_ooms_delta"] == nc["num_ooms_delta"], (
            f"{case}: num_ooms +{gc_['num_ooms_delta']} with gpumem, +{nc['num_ooms_delta']} with PyTorch")
    assert g["cases"]["just over free"]["mentions_gpumem"]


@pytest.mark.gpu
def test_memory_history_and_viewers():
    """_record_memory_history('all', context='all', stacks='all'): _snapshot() holds the C++ frame
    '::rand' and the Python frame of the allocating function; _set_memory_metadata('x') tags the next
    allocation's trace event (user_metadata); empty_cache() after a free records segment_free or
    segment_unmap with 'empty_cache' among its frames; trace_plot / segment_plot give HTML, segsum and
    trace parse the snapshot."""
    n, g = both("history")
    assert g["metadata_api"] == n["metadata_api"]
    assert {"alloc", "free_requested", "free_completed"} <= set(g["actions"]), g["actions"]


@pytest.mark.gpu
def test_profiler_memory_events():
    """torch.profiler.profile(profile_memory=True, with_stack=True) sees the CUDA allocations, and
    torch.cuda._memory_viz._profile_to_snapshot(prof) names this file and the allocating function."""
    n, g = both("profiler")
    assert g["cuda_memory_events"] > 0


@pytest.mark.gpu
def test_snapshot_segments_add_up():
    """Every block of torch.cuda.memory_snapshot() has a state in {active_allocated,
    active_pending_free, inactive}; a segment's blocks sum to its total_size; allocated_size (and
    active_size) is the sum of its active_allocated (active) blocks; memory_allocated() and
    memory_reserved() are the sums over the segments; every live tensor starts an active_allocated
    block (main pool, graph pool, MemPool). A block freed while a side stream still uses it shows as
    active_pending_free when it does with PyTorch's allocator."""
    n, g = both("segments")
    if n["pending_free_seen"]:
        assert g["pending_free_seen"], "a record_stream'd block freed early is not shown as active_pending_free"


@pytest.mark.gpu
def test_cuda_ipc_never_hangs():
    """A CUDA tensor sent to a spawned child (as a Process argument and through a Queue) either
    arrives with the right values, or the sender gets an error within 10 s that mentions gpumem.
    A hang (the 60 s limit) fails."""
    native = run("native", "ipc", timeout=60)
    assert native.rc == 0 and native.alive, (
        "CUDA IPC fails with PyTorch's own allocator too (machine problem?):\n" + native.describe())
    for case, res in native.facts["ipc"].items():
        assert res["outcome"] == "received" and res["value"] == IPC_SUM, (case, res)
    r = run("gpumem", "ipc", timeout=60)
    assert not r.timed_out, "CUDA IPC hangs with gpumem:\n" + r.describe()
    assert r.rc == 0 and r.alive, r.describe()
    for case, res in r.facts["ipc"].items():
        if res["outcome"] == "received":
            assert res["value"] == IPC_SUM, (case, res)
        else:
            assert res["outcome"] == "sender_error", f"{case}: {res}"
            assert res["seconds"] < 10, f"{case}: the error came after {res['seconds']} s"
            assert "gpumem" in res["message"], f"{case}: the error does not say gpumem is why: {res['message']}"
    print(f"\nCUDA IPC with gpumem: {r.facts['ipc']}")


@pytest.mark.gpu
def test_an_oom_first_collects_memory_shared_over_cuda_ipc():
    """A 1 GiB tensor shared with a child process and dropped on both sides stays in torch's sent-data
    limbo until cuda_ipc_collect; under a fraction with room for one such tensor the next 1 GiB
    allocation fits with PyTorch's allocator (it runs torch's free-memory callbacks before failing),
    so it must with gpumem, with no OOM counted and the new tensor's data right."""
    n, g = both("ipc_collect_on_oom", timeout=120)
    assert n["ipc_collect"]["next"]["outcome"] == "fits", (
        f"PyTorch's allocator does not collect here, so the expectation is wrong: {n['ipc_collect']}")
    if g["ipc_collect"]["child_sum"]["outcome"] != "received":
        pytest.fail(f"the tensor did not reach the child with gpumem: {g['ipc_collect']}")
    assert g["ipc_collect"]["child_sum"]["value"] == n["ipc_collect"]["child_sum"]["value"], (g, n)
    assert g["ipc_collect"]["next"] == {"outcome": "fits", "last": 2.0}, g["ipc_collect"]
    assert g["ipc_collect"]["num_ooms_delta"] == n["ipc_collect"]["num_ooms_delta"] == 0, (g, n)


@pytest.mark.gpu
def test_a_mempool_that_runs_out_takes_back_the_default_pools_cache():
    """1 GiB cached in the default pool, a fraction with room for one 1 GiB tensor: a 1 GiB tensor
    made inside use_mem_pool must fit with gpumem (its MemPool retry gives the default pool's cache
    back, as recent PyTorch versions do outside graph capture), with no OOM counted. PyTorch's own
    outcome on this torch is printed, not required (older versions skip that release while any
    MemPool is in use)."""
    n, g = both("mempool_oom", timeout=120)
    assert g["mempool_oom"]["cached_before"] >= 1024 * 1024 * 1024, g
    assert g["mempool_oom"]["mempool"] == {"outcome": "fits", "last": 2.0}, g["mempool_oom"]
    assert g["mempool_oom"]["num_ooms_delta"] == 0, g["mempool_oom"]
    print(f"\nPyTorch's allocator here: {n['mempool_oom']['mempool']['outcome']}")


@pytest.mark.gpu
def test_an_allocation_a_mempool_lends_to_is_not_counted_as_an_oom():
    """The default pool runs out and a MemPool(use_on_oom=True) lends its cached 1 GiB: the tensor is
    made, as with PyTorch's allocator, and num_ooms changes as PyTorch's does (it counts only
    allocations that finally fail)."""
    n, g = both("mempool_lends_on_oom", timeout=120)
    assert n["mempool_lends"]["borrow"]["outcome"] == "fits", (
        f"PyTorch's allocator does not lend here, so the expectation is wrong: {n['mempool_lends']}")
    assert g["mempool_lends"]["borrow"] == {"outcome": "fits", "last": 2.0}, g["mempool_lends"]
    assert g["mempool_lends"]["num_ooms_delta"] == n["mempool_lends"]["num_ooms_delta"], (g, n)


@pytest.mark.gpu
@pytest.mark.parametrize("case", NOCRASH)
def test_calls_never_kill_the_process(case):
    """Each call raises or succeeds, but the process lives on (prints ALIVE, exits 0) and CUDA stays
    usable wherever it does with PyTorch's allocator. Cases: fraction 0.0 then allocate; fraction NaN
    (torch's wrapper lets it through to the allocator) then allocate; delete a
    foreign pointer, an interior pointer, a pointer twice; caching_allocator_alloc(0); restore a
    checkpoint of a released pool, a bad state or unknown pool ids; an unknown skip action for
    _record_memory_history; empty_cache() during CUDA graph capture."""
    native = run("native", "nocrash_" + case, timeout=120)
    g = run("gpumem", "nocrash_" + case, timeout=120)
    print(f"\n{case}: PyTorch's allocator: rc {native.rc} {json.dumps(native.facts)}\n"
          f"{case}: gpumem:                rc {g.rc} {json.dumps(g.facts)}")
    assert g.alive and g.rc == 0, g.describe()
    if native.alive and native.facts.get("usable_after"):
        assert g.facts.get("usable_after"), f"CUDA is unusable after {case} with gpumem only:\n{g.describe()}"
