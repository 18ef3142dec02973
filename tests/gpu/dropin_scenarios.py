"""Drop-in scenarios: PyTorch's allocator API with gpumem as torch's CUDA allocator, each in a fresh
process so that gpumem really is the allocator (it must be registered before CUDA starts).
Run by tests/gpu/test_dropin_gpu.py once with gpumem and once with PyTorch's own allocator:

    GPUMEM_DROPIN_ALLOCATOR=gpumem|native python tests/gpu/dropin_scenarios.py SCENARIO

The allocator is chosen at import (from the environment), so the children torch.multiprocessing
spawns, which import this file again, use the same one. A scenario checks what must hold with either
allocator (a failed check raises AssertionError: exit status 1) and prints ``FACTS {json}`` (what it
observed, for the test to compare gpumem's observations with PyTorch's), then ``ALIVE``.
``nocrash_*`` scenarios catch every exception of the call they try and record its type.
"""
from __future__ import annotations

import faulthandler
import gc
import json
import os
import random
import re
import sys
import threading
import time
import traceback

faulthandler.enable()  # a crash prints the Python line it happened on (stderr)
ALLOCATOR = os.environ.get("GPUMEM_DROPIN_ALLOCATOR", "gpumem")
if ALLOCATOR == "gpumem":
    os.environ.pop("GPUMEM_DISABLE", None)
    import gpumem  # noqa: F401  first: gpumem becomes torch's CUDA allocator before CUDA starts
    import gpumem._torch as _gt
else:
    os.environ["GPUMEM_DISABLE"] = "1"  # in case anything imports gpumem
    _gt = None
import torch  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
DEV = 0
FACTS: dict = {}
GPUMEM = ALLOCATOR == "gpumem"


def start():
    """Start CUDA and check that the allocator is the one claimed."""
    torch.cuda.init()
    FACTS["backend"] = torch.cuda.memory.get_allocator_backend()
    if GPUMEM:
        assert _gt.is_active(), _gt.status_line()
        assert FACTS["backend"] != "native", FACTS["backend"]
    else:
        assert FACTS["backend"] == "native", FACTS["backend"]


def std_deleter(t) -> bool:
    """Whether the tensor's storage deleter is the current allocator's raw_deleter (what cudagraph
    trees assert for the storages it hands back deleters to)."""
    return bool(torch._C._has_Standard_Deleter(t.untyped_storage()._cdata))


def warm(x):
    """Run a kernel once outside capture (lazy module loading must not happen inside a capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        (x * 2 + 1).sum()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def pool_blocks(pool, state="active_allocated"):
    """{address: size} of the blocks of the given state in the segments of a private pool."""
    out = {}
    for seg in torch.cuda.memory_snapshot():
        if tuple(seg.get("segment_pool_id", (0, 0))) != tuple(pool):
            continue
        for b in seg["blocks"]:
            if b["state"] == state:
                out[b["address"]] = b["size"]
    return out


def live_check(pool, ptrs) -> bool:
    return bool(torch._C._cuda_checkPoolLiveAllocations(DEV, tuple(pool), set(ptrs)))


def exc_name(e: BaseException) -> str:
    return type(e).__name__


# ----------------------------------------------------------------------------- storage deleters


def scenario_deleters():
    start()
    seen = {}
    a = torch.randn(1000, device="cuda")
    big = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    seen["normal_small"], seen["normal_large"] = std_deleter(a), std_deleter(big)

    x = torch.arange(4096, dtype=torch.float32, device="cuda")
    warm(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x * 2 + 1
        z = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    seen["graph_small"], seen["graph_large"] = std_deleter(y), std_deleter(z)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2 + 1)

    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        m = torch.randn(1000, device="cuda")
        mb = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    seen["mempool_small"], seen["mempool_large"] = std_deleter(m), std_deleter(mb)
    FACTS["standard_deleter"] = seen
    bad = [k for k, v in seen.items() if not v]
    assert not bad, f"storage deleter is not the allocator's raw_deleter for: {bad}"

    # the deleters free: memory_allocated drops by what the tensors held
    before = torch.cuda.memory_allocated()
    del a, big, y, z, m, mb
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() < before - 64 * MiB
    del g, pool
    gc.collect()


# ----------------------------------------------------------------------------- checkpoints


def _capture_outputs(x, pool=None):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        outs = [x * 2, x + 1, torch.empty(3 * MiB, dtype=torch.uint8, device="cuda"),
                (x * 3).repeat(1024)]  # 16 MiB
    torch.cuda.synchronize()
    return g, outs


def _captured():
    """x, and a graph of _capture_outputs(x) in a private pool of its own: (x, g, outs, pool)."""
    x = torch.arange(4096, dtype=torch.float32, device="cuda")
    warm(x)
    g, outs = _capture_outputs(x)
    return x, g, outs, tuple(g.pool())


def scenario_checkpoint_restore():
    """getCheckpointState / setCheckpointPoolState / raw_delete / checkPoolLiveAllocations as
    cudagraph trees use them when it re-records a path."""
    start()
    x, g, outs, pool = _captured()
    ptrs = [o.data_ptr() for o in outs]
    assert live_check(pool, ptrs), "checkPoolLiveAllocations: the graph's outputs are the pool's live blocks"
    assert not live_check(pool, ptrs[:-1]), "checkPoolLiveAllocations must see a missing pointer"
    state = torch._C._cuda_getCheckpointState(DEV, pool)
    before = pool_blocks(pool)
    assert set(before) == set(ptrs), (sorted(before), sorted(ptrs))
    allocated_before = torch.cuda.memory_allocated()

    del outs
    gc.collect()
    torch.cuda.synchronize()
    assert pool_blocks(pool) == {}, pool_blocks(pool)
    assert live_check(pool, [])

    torch._C._cuda_setCheckpointPoolState(DEV, state, [], [])
    after = pool_blocks(pool)
    assert after == before, f"restored blocks {after} != checkpointed {before}"
    assert live_check(pool, ptrs)
    assert torch.cuda.memory_allocated() == allocated_before, (torch.cuda.memory_allocated(), allocated_before)
    g.replay()  # writes into the restored blocks: their memory must be mapped
    torch.cuda.synchronize()

    for i, p in enumerate(ptrs):
        torch._C._cuda_cudaCachingAllocator_raw_delete(p)
        rest = ptrs[i + 1:]
        assert set(pool_blocks(pool)) == set(rest), (i, sorted(pool_blocks(pool)), sorted(rest))
        assert live_check(pool, rest)
    FACTS["restored_blocks"] = len(before)
    del g
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def scenario_checkpoint_frees_later_blocks():
    """A block allocated in the pool after the checkpoint (a second graph recorded into the same pool)
    is freed by the restore; its tensor, passed as a stale storage, no longer frees it when it dies."""
    start()
    x, g, outs, pool = _captured()
    ptrs = [o.data_ptr() for o in outs]
    state = torch._C._cuda_getCheckpointState(DEV, pool)
    before = pool_blocks(pool)

    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, pool=pool):
        late = [x * 5, torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")]
    torch.cuda.synchronize()
    late_ptrs = [t.data_ptr() for t in late]
    assert not set(late_ptrs) & set(ptrs)
    assert live_check(pool, ptrs + late_ptrs)

    del outs
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_setCheckpointPoolState(DEV, state, [t.untyped_storage()._cdata for t in late], [])
    after = pool_blocks(pool)
    assert after == before, f"after restore {after}, checkpointed {before}"
    assert live_check(pool, ptrs)
    allocated = torch.cuda.memory_allocated()
    del late  # their deleters were removed by the restore: nothing is freed twice
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    for p in ptrs:
        torch._C._cuda_cudaCachingAllocator_raw_delete(p)
    assert pool_blocks(pool) == {} and live_check(pool, [])
    FACTS["freed_by_restore"] = len(late_ptrs)
    del g, g2
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    t = torch.ones(MiB, device="cuda")  # the allocator still works
    assert float(t.sum()) == MiB


# ----------------------------------------------------------------------------- memory fraction


def scenario_fraction():
    start()
    total = torch.cuda.get_device_properties(DEV).total_memory
    FACTS["initial"] = torch.cuda.get_per_process_memory_fraction()
    assert FACTS["initial"] == 1.0

    torch.cuda.set_per_process_memory_fraction(0.0)
    assert torch.cuda.get_per_process_memory_fraction() == 0.0
    ooms = {}
    for n in (1, 512, MiB, 64 * MiB):
        try:
            torch.empty(n, dtype=torch.uint8, device="cuda")
            ooms[n] = "allocated"
        except torch.cuda.OutOfMemoryError as e:
            ooms[n] = "OutOfMemoryError"
            assert str(e).startswith("CUDA out of memory."), str(e)
    FACTS["fraction_zero"] = {str(k): v for k, v in ooms.items()}
    assert all(v == "OutOfMemoryError" for v in ooms.values()), ooms
    assert torch.empty(0, device="cuda").numel() == 0  # no bytes, no allocation
    torch.cuda.set_per_process_memory_fraction(1.0)
    t = torch.ones(MiB, device="cuda")
    assert float(t.sum()) == MiB
    del t
    torch.cuda.empty_cache()

    # round trips: PyTorch keeps the cap in whole bytes, so get() may differ by up to 1 byte / total
    rng = random.Random(1234)
    values = [0.5, 0.25, 1 / 3, 0.999999, 1e-3, 1.0, 0.0] + [rng.random() for _ in range(20)]
    worst = 0.0
    for f in values:
        torch.cuda.set_per_process_memory_fraction(f)
        got = torch.cuda.get_per_process_memory_fraction()
        assert isinstance(got, float)
        worst = max(worst, abs(got - f) * total)
        assert abs(got - f) * total <= 1.0 + 1e-6, f"set {f!r}, got {got!r}"
    FACTS["round_trip_worst_bytes"] = worst
    torch.cuda.set_per_process_memory_fraction(0.5)

    # invalid values: the same exception type as PyTorch's, and the fraction unchanged
    invalid = {}
    cases = {
        "python:-0.1": lambda: torch.cuda.set_per_process_memory_fraction(-0.1),
        "python:1.5": lambda: torch.cuda.set_per_process_memory_fraction(1.5),
        "python:int 1": lambda: torch.cuda.set_per_process_memory_fraction(1),
        "python:nan": lambda: torch.cuda.set_per_process_memory_fraction(float("nan")),
        "c++:1.5": lambda: torch._C._cuda_setMemoryFraction(1.5, DEV),
        "c++:-0.5": lambda: torch._C._cuda_setMemoryFraction(-0.5, DEV),
    }
    for name, call in cases.items():
        try:
            call()
            invalid[name] = "no error"
        except Exception as e:  # noqa: BLE001  recorded, compared with PyTorch's
            invalid[name] = exc_name(e)
            got = torch.cuda.get_per_process_memory_fraction()
            assert abs(got - 0.5) * total <= 1.0 + 1e-6, f"{name} raised but changed the fraction to {got}"
        torch.cuda.set_per_process_memory_fraction(0.5)
    FACTS["invalid"] = invalid
    assert invalid["python:-0.1"] == invalid["python:1.5"] == "ValueError", invalid
    assert invalid["python:int 1"] == "TypeError", invalid
    torch.cuda.set_per_process_memory_fraction(1.0)


# ----------------------------------------------------------------------------- OOM text


OOM_PREFIX = re.compile(r"^CUDA out of memory\. Tried to allocate [0-9.]+ (bytes|KiB|MiB|GiB)\. GPU 0 has a "
                        r"total capacity of [0-9.]+ (MiB|GiB) of which [0-9.]+ (bytes|KiB|MiB|GiB) is free\.")


def scenario_oom_text():
    start()
    keep = torch.full((MiB,), 3.0, device="cuda")
    cases = {}

    def attempt(name, nbytes):
        n0 = torch.cuda.memory_stats().get("num_ooms", 0)
        try:
            torch.empty(nbytes, dtype=torch.int8, device="cuda")
            msg, kind = None, "allocated"
        except torch.cuda.OutOfMemoryError as e:
            msg, kind = str(e), "OutOfMemoryError"
        except Exception as e:  # noqa: BLE001  the wrong type: recorded, then failed below
            msg, kind = str(e), exc_name(e)
        cases[name] = dict(kind=kind, message=(msg or "")[:2000],
                           num_ooms_delta=torch.cuda.memory_stats().get("num_ooms", 0) - n0,
                           mentions_gpumem="gpumem" in (msg or ""))
        assert kind == "OutOfMemoryError", f"{name}: {kind}: {msg}"
        assert msg.startswith("CUDA out of memory."), msg
        assert float(keep.sum()) == 3.0 * MiB, "a tensor made before the OOM lost its data"
        t = torch.ones(4 * MiB, device="cuda")  # the next allocation works
        assert float(t.sum()) == 4 * MiB
        return msg

    msg = attempt("800000000 GiB", 1024 ** 3 * 800000000)
    assert "Tried to allocate 800000000.00 GiB. GPU 0 has a total capacity of" in msg, msg
    msg = attempt("over 1 EB", 1 << 61)
    assert "Tried to allocate more than 1EB memory" in msg, msg
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    msg = attempt("just over free", free + torch.cuda.memory_reserved() + 256 * MiB)
    assert OOM_PREFIX.match(msg), msg
    if GPUMEM:
        assert "gpumem" in msg, f"the message should go on with gpumem's figures: {msg}"
    assert cases["800000000 GiB"]["num_ooms_delta"] >= 1 and cases["just over free"]["num_ooms_delta"] >= 1, cases
    FACTS["cases"] = cases


# ----------------------------------------------------------------------------- history and viewers


def history_rand_site():
    return torch.rand(128, 128, device="cuda")


def profile_alloc_site():
    return torch.ones(256, 1024, device="cuda")


def scenario_history():
    start()
    torch.cuda.memory._record_memory_history("all", context="all", stacks="all")
    t = history_rand_site()
    has_metadata = hasattr(torch.cuda.memory, "_set_memory_metadata")
    FACTS["metadata_api"] = has_metadata
    if has_metadata:
        torch.cuda.memory._set_memory_metadata("x")
        u = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        torch.cuda.memory._set_memory_metadata("")
    big = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    del big
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    ss = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(None)

    text = json.dumps(ss, default=str)
    assert "::rand" in text, "no C++ frame of rand in the snapshot (stacks='all')"
    assert "history_rand_site" in text, "the Python frame of the allocating function is missing"
    traces = ss["device_traces"][DEV]
    actions = sorted({e["action"] for e in traces})
    FACTS["actions"] = actions
    allocs = [e for e in traces if e["action"] == "alloc" and e["addr"] == t.data_ptr()]
    assert allocs, "no alloc trace event at the tensor's address"
    assert any("history_rand_site" in f.get("name", "") for f in allocs[-1]["frames"]), allocs[-1]["frames"]
    if has_metadata:
        meta = [e.get("user_metadata") for e in traces if e["action"] == "alloc" and e["addr"] == u.data_ptr()]
        FACTS["user_metadata"] = meta
        assert meta and meta[-1] == "x", meta
        assert allocs[-1].get("user_metadata", "") == "", allocs[-1].get("user_metadata")
    released = [e for e in traces if e["action"] in ("segment_free", "segment_unmap")]
    assert released, f"empty_cache() after a free left no segment_free/segment_unmap event: {actions}"
    names = [f.get("name", "") for e in released for f in e.get("frames", [])]
    assert any("empty_cache" in n for n in names), names[:50]

    html = torch.cuda._memory_viz.trace_plot(ss)
    assert isinstance(html, str) and "<html" in html.lower()
    html = torch.cuda._memory_viz.segment_plot(ss)
    assert isinstance(html, str) and "<html" in html.lower()
    torch.cuda._memory_viz.segsum(ss)  # raises on segments whose blocks do not add up
    torch.cuda._memory_viz.trace(ss)


def scenario_profiler():
    start()
    torch.ones(1, device="cuda")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, profile_memory=True, with_stack=True,
                                record_shapes=True) as prof:
        t = profile_alloc_site()
        t2 = t * 2
        del t2
    ss = torch.cuda._memory_viz._profile_to_snapshot(prof)
    cuda_events = ss["device_traces"][DEV]
    FACTS["cuda_memory_events"] = len(cuda_events)
    assert cuda_events, "the profiler saw no CUDA memory event"
    text = json.dumps(cuda_events, default=str)
    assert os.path.basename(__file__) in text, text[:2000]
    assert "profile_alloc_site" in text, text[:2000]
    assert any(e["action"] == "alloc" and e["addr"] == t.data_ptr() for e in cuda_events)
    html = torch.cuda._memory_viz.profile_plot(prof)
    assert isinstance(html, str) and "<html" in html.lower()


# ----------------------------------------------------------------------------- snapshot segments


def check_segments(segs, where):
    states = {"active_allocated", "active_pending_free", "inactive"}
    total_alloc = total_reserved = 0
    for i, seg in enumerate(segs):
        blocks = seg["blocks"]
        assert blocks, f"{where}: segment {i} has no blocks"
        for b in blocks:
            assert b["state"] in states, (where, b["state"])
            assert b["size"] > 0, (where, b)
        assert sum(b["size"] for b in blocks) == seg["total_size"], (where, i, seg["total_size"],
                                                                     [b["size"] for b in blocks])
        alloc = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        assert seg["allocated_size"] == alloc, (where, i, seg["allocated_size"], alloc)
        if "active_size" in seg:
            active = sum(b["size"] for b in blocks if b["state"] != "inactive")
            assert seg["active_size"] == active, (where, i, seg["active_size"], active)
        for b in blocks:
            if b["state"] == "active_allocated" and "requested_size" in b:
                assert 0 < b["requested_size"] <= b["size"], (where, b)
        total_alloc += alloc
        total_reserved += seg["total_size"]
    return total_alloc, total_reserved


def scenario_segments():
    start()
    sizes = [1, 511, 512, 4096, MiB, MiB + 1, 3 * MiB, 25 * MiB, 100 * MiB]
    ts = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    del ts[1::2]
    x = torch.arange(4096, dtype=torch.float32, device="cuda")
    warm(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gy = x * 2
        gz = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
    mp = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(mp):
        m = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
    # a block freed while a side stream still uses it: "active_pending_free" until that work is done
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    p = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        p.add_(1)
    p.record_stream(side)
    del p
    segs = torch.cuda.memory_snapshot()
    FACTS["pending_free_seen"] = any(b["state"] == "active_pending_free" for s in segs for b in s["blocks"])
    alloc, reserved = check_segments(segs, "with a pending free")
    assert alloc == torch.cuda.memory_allocated(), (alloc, torch.cuda.memory_allocated())
    assert reserved == torch.cuda.memory_reserved(), (reserved, torch.cuda.memory_reserved())
    live = [t.data_ptr() for t in ts] + [gy.data_ptr(), gz.data_ptr(), m.data_ptr()]
    starts = {b["address"] for s in segs for b in s["blocks"] if b["state"] == "active_allocated"}
    assert set(live) <= starts, "a live tensor is not an active_allocated block of the snapshot"
    torch.cuda.synchronize()
    full = torch.cuda.memory._snapshot()
    check_segments(full["segments"], "_snapshot")
    torch.cuda._memory_viz.segsum(full)
    del ts, gy, gz, m, g
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    alloc, reserved = check_segments(torch.cuda.memory_snapshot(), "after freeing")
    assert alloc == torch.cuda.memory_allocated() and reserved == torch.cuda.memory_reserved()
    del mp


# ----------------------------------------------------------------------------- CUDA IPC

IPC_N = 1000
IPC_SUM = float(IPC_N * (IPC_N - 1) // 2)
IPC_WAIT = 20.0  # seconds per case for the child's answer


def _ipc_child_args(t, results):
    try:
        results.put(("ok", float(t.sum().item())))
    except Exception as e:  # noqa: BLE001
        results.put(("error", f"{exc_name(e)}: {e}"))


def _ipc_child_queue(q, results):
    try:
        t = q.get(timeout=IPC_WAIT + 5)
        results.put(("ok", float(t.sum().item())))
        del t
    except Exception as e:  # noqa: BLE001
        results.put(("error", f"{exc_name(e)}: {e}"))


def _ipc_outcome(results, t0, feeder_errors=()):
    """Wait for the child's answer, or for a pickling error of the queue's feeder thread (the sender's
    error when sending through a Queue), and describe what happened."""
    deadline = t0 + IPC_WAIT
    while time.monotonic() < deadline:
        if feeder_errors:
            return dict(outcome="sender_error", seconds=round(time.monotonic() - t0, 2), message=feeder_errors[0])
        try:
            kind, value = results.get(timeout=0.2)
        except Exception:  # noqa: BLE001  queue.Empty
            continue
        if kind == "ok":
            return dict(outcome="received", value=value, seconds=round(time.monotonic() - t0, 2))
        return dict(outcome="child_error", message=value, seconds=round(time.monotonic() - t0, 2))
    return dict(outcome="hang", seconds=round(time.monotonic() - t0, 2))


def _stop(p):
    if p is not None and p.pid is not None:
        p.join(2)
        if p.is_alive():
            p.terminate()
            p.join(2)


def scenario_ipc():
    """A CUDA tensor sent to a spawned child, as a Process argument and through a Queue. Each case
    either arrives with the right values or fails on the sender's side; it must never hang."""
    import torch.multiprocessing as tmp

    start()
    ctx = tmp.get_context("spawn")
    t = torch.arange(IPC_N, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    result = {}

    # 1: the tensor as an argument of the child (pickled by Process.start())
    results = ctx.Queue()
    p = None
    t0 = time.monotonic()
    try:
        p = ctx.Process(target=_ipc_child_args, args=(t, results))
        p.start()
        result["process_args"] = _ipc_outcome(results, t0)
    except Exception as e:  # noqa: BLE001
        result["process_args"] = dict(outcome="sender_error", seconds=round(time.monotonic() - t0, 2),
                                      message=f"{exc_name(e)}: {e}")
    _stop(p)

    # 2: through a Queue: put() hands the tensor to a feeder thread, which pickles it; a pickling error
    # there never reaches put()'s caller, so the queue's error hook reports it here
    q, results = ctx.Queue(), ctx.Queue()
    feeder_errors: list = []
    q._on_queue_feeder_error = lambda e, obj: feeder_errors.append(f"{exc_name(e)}: {e}")
    p = ctx.Process(target=_ipc_child_queue, args=(q, results))
    p.start()
    t0 = time.monotonic()
    try:
        q.put(t)
        result["queue"] = _ipc_outcome(results, t0, feeder_errors)
    except Exception as e:  # noqa: BLE001
        result["queue"] = dict(outcome="sender_error", seconds=round(time.monotonic() - t0, 2),
                               message=f"{exc_name(e)}: {e}")
    _stop(p)
    FACTS["ipc"] = result
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------- calls that must not kill


def _try(name, call):
    try:
        r = call()
        FACTS[name] = dict(result="ok", value=repr(r)[:200])
    except Exception as e:  # noqa: BLE001  an exception is fine; dying is not
        FACTS[name] = dict(result=exc_name(e), message=str(e)[:500])


def _usable():
    try:
        t = torch.ones(MiB, device="cuda")
        FACTS["usable_after"] = float(t.sum().item()) == MiB
    except Exception as e:  # noqa: BLE001
        FACTS["usable_after"] = False
        FACTS["usable_after_error"] = f"{exc_name(e)}: {str(e)[:300]}"


def nocrash_fraction_zero_then_allocate():
    start()
    torch.cuda.set_per_process_memory_fraction(0.0)
    _try("allocate", lambda: torch.empty(MiB, device="cuda"))
    torch.cuda.set_per_process_memory_fraction(1.0)


def nocrash_fraction_nan_then_allocate():
    start()
    _try("set_nan", lambda: torch.cuda.set_per_process_memory_fraction(float("nan")))
    _try("get", lambda: torch.cuda.get_per_process_memory_fraction())
    _try("allocate", lambda: float(torch.ones(MiB, device="cuda").sum()))
    torch.cuda.set_per_process_memory_fraction(1.0)


def nocrash_delete_foreign_pointer():
    start()
    keep = torch.ones(MiB, device="cuda")
    _try("delete", lambda: torch.cuda.caching_allocator_delete(12345))
    assert float(keep.sum()) == MiB


def nocrash_delete_interior_pointer():
    start()
    t = torch.ones(MiB, device="cuda")
    _try("delete", lambda: torch.cuda.caching_allocator_delete(t.data_ptr() + 512))
    t.fill_(2.0)
    assert float(t.sum()) == 2 * MiB


def nocrash_double_delete():
    start()
    p = torch.cuda.caching_allocator_alloc(MiB)
    torch.cuda.caching_allocator_delete(p)
    _try("second_delete", lambda: torch.cuda.caching_allocator_delete(p))


def nocrash_alloc_zero():
    start()
    _try("alloc_zero", lambda: torch.cuda.memory.caching_allocator_alloc(0))
    if FACTS["alloc_zero"]["result"] == "ok":
        p = int(FACTS["alloc_zero"]["value"])
        _try("delete_zero", lambda: torch.cuda.caching_allocator_delete(p))


def nocrash_checkpoint_of_released_pool():
    start()
    x, g, outs, pool = _captured()
    state = torch._C._cuda_getCheckpointState(DEV, pool)
    del outs, g  # the pool goes away
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    g2, outs2 = _capture_outputs(x)  # another pool
    _try("restore", lambda: torch._C._cuda_setCheckpointPoolState(DEV, state, [], []))
    del outs2, g2


def nocrash_checkpoint_bad_state():
    start()
    _try("restore_none", lambda: torch._C._cuda_setCheckpointPoolState(DEV, None, [], []))
    _try("checkpoint_unknown_pool", lambda: torch._C._cuda_getCheckpointState(DEV, (987654, 321)))
    _try("live_unknown_pool", lambda: torch._C._cuda_checkPoolLiveAllocations(DEV, (987654, 321), set()))


def nocrash_history_unknown_skip_action():
    start()
    _try("record", lambda: torch.cuda.memory._record_memory_history(
        "all", context="all", stacks="python", skip_actions=["no_such_action"]))
    t = torch.ones(MiB, device="cuda")
    del t
    _try("snapshot", lambda: len(torch.cuda.memory._snapshot()["device_traces"]))
    _try("stop", lambda: torch.cuda.memory._record_memory_history(None))


def nocrash_empty_cache_during_capture():
    start()
    x = torch.arange(4096, dtype=torch.float32, device="cuda")
    warm(x)
    junk = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    del junk  # something cached to release

    def capture():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x * 2
            torch.cuda.empty_cache()
            z = y + 1
        g.replay()
        torch.cuda.synchronize()
        return bool(torch.equal(z, x * 2 + 1))

    _try("capture", capture)


NOCRASH = {name[len("nocrash_"):]: fn for name, fn in list(globals().items()) if name.startswith("nocrash_")}
SCENARIOS = {name[len("scenario_"):]: fn for name, fn in list(globals().items()) if name.startswith("scenario_")}


def main(argv) -> int:
    if len(argv) != 1 or (argv[0] not in SCENARIOS and argv[0] not in ("nocrash_" + n for n in NOCRASH)):
        print(f"usage: {sys.argv[0]} SCENARIO, one of: {', '.join(list(SCENARIOS) + ['nocrash_' + n for n in NOCRASH])}",
              file=sys.stderr)
        return 2
    name = argv[0]
    if name.startswith("nocrash_"):
        try:
            NOCRASH[name[len("nocrash_"):]]()
        except Exception as e:  # noqa: BLE001  the setup of the case failed: recorded, not a crash
            FACTS["setup_error"] = f"{exc_name(e)}: {e}\n{traceback.format_exc()}"
        _usable()
    else:
        SCENARIOS[name]()
    print("FACTS " + json.dumps(FACTS, default=str), flush=True)
    print("ALIVE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
