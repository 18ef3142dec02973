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
import gc
import json
import os
import random
import re
import sys
import traceback

from dropin_common import (  # noqa: E402  (the allocator is chosen there, before torch starts)
    MiB, DEV, FACTS, GPUMEM, start, std_deleter, warm, pool_blocks, live_check, exc_name, torch,
    try_gib, _captured,
)
from dropin_process import NOCRASH, _usable, scenario_ipc, scenario_ipc_collect_on_oom  # noqa: E402,F401

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



def scenario_mempool_oom():
    """Under a fraction with room for one 1 GiB tensor, 1 GiB freed in the default pool stays cached
    there; a 1 GiB tensor made inside torch.cuda.use_mem_pool then fits only if the MemPool's
    out-of-memory retry gives the default pool's cache back (recent PyTorch versions do, outside graph
    capture). Records what happened; the test says what each allocator must do."""
    start()
    total = torch.cuda.get_device_properties(DEV).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 1536 * MiB) / total)
    a = torch.full((256 * MiB,), 1.0, device="cuda")  # 1 GiB of float32
    torch.cuda.synchronize()
    del a
    fact: dict = dict(cached_before=torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
    pool = torch.cuda.MemPool()
    fact["mempool"], fact["num_ooms_delta"] = try_gib(2.0, pool)
    c = torch.full((64 * MiB,), 3.0, device="cuda")  # the default pool works on
    assert float(c[-1]) == 3.0
    del c, pool
    gc.collect()
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
    FACTS["mempool_oom"] = fact


def scenario_mempool_lends_on_oom():
    """A MemPool(use_on_oom=True) holds 1 GiB cached; under a fraction with room for one 1 GiB tensor
    (the MemPool's included), a 1 GiB tensor of the default pool borrows that memory. The allocation
    succeeds, so PyTorch does not count it in num_ooms; records the count for the test to compare."""
    start()
    total = torch.cuda.get_device_properties(DEV).total_memory
    pool = torch.cuda.MemPool(use_on_oom=True)
    with torch.cuda.use_mem_pool(pool):
        a = torch.full((256 * MiB,), 1.0, device="cuda")  # 1 GiB of float32
    torch.cuda.synchronize()
    del a
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 256 * MiB) / total)
    fact: dict = {}
    fact["borrow"], fact["num_ooms_delta"] = try_gib(2.0)
    torch.cuda.set_per_process_memory_fraction(1.0)
    del pool
    gc.collect()
    torch.cuda.empty_cache()
    FACTS["mempool_lends"] = fact


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

