"""gpumem as PyTorch's CUDA allocator, on a GPU. Each test runs a fresh Python process, because
gpumem must be registered before CUDA starts. Run: pytest -m gpu tests/gpu/test_torch_bridge_gpu.py"""
import subprocess
import sys
import textwrap

import pytest
from _run import clean_env

PRELUDE = """
import gc, os, sys, pickle, tempfile
import gpumem, gpumem._torch as gt
import torch
assert gt.is_active(), gt.status_line()
MiB = 1 << 20
dev = torch.device("cuda")
"""


def run(body, env=None, prelude=PRELUDE, timeout=540):
    full = clean_env(**(env or {}))
    code = textwrap.dedent(prelude) + textwrap.dedent(body) + "\nprint('DONE')\n"
    r = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0 and "DONE" in r.stdout, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


@pytest.mark.gpu
def test_stats_apis_tell_the_truth():
    run("""
    s0 = gt.stats(0)
    a0 = torch.cuda.memory_allocated()
    x = torch.empty(64 * MiB, dtype=torch.uint8, device=dev)
    assert torch.cuda.memory_allocated() - a0 == 64 * MiB
    st = torch.cuda.memory_stats()
    assert st["allocated_bytes.all.current"] == gt.stats(0)["allocated_bytes.all.current"]
    assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()
    assert torch.cuda.max_memory_allocated() >= 64 * MiB
    assert torch.cuda.max_memory_reserved() >= torch.cuda.memory_reserved()
    assert "gpumem.cap_bytes" in gt.stats(0) and "gpumem.largest_free_bytes" in gt.stats(0)
    assert "Allocated memory" in torch.cuda.memory_summary()
    del x
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
    free, total = torch.cuda.mem_get_info()
    assert 0 < free <= total
    """)


@pytest.mark.gpu
def test_empty_cache_returns_memory():
    run("""
    x = torch.empty(2048 * MiB, dtype=torch.uint8, device=dev); x.fill_(1)
    torch.cuda.synchronize()
    del x
    before, _ = torch.cuda.mem_get_info()
    torch.cuda.empty_cache()
    after, _ = torch.cuda.mem_get_info()
    assert torch.cuda.memory_reserved() < 64 * MiB, torch.cuda.memory_reserved()
    assert after - before >= 1024 * MiB, (before, after)
    """, env={"GPUMEM_CONF": "release:lazy"})


@pytest.mark.gpu
def test_memory_fraction_enforced_and_oom_is_torch_oom():
    run("""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.25)
    assert abs(torch.cuda.get_per_process_memory_fraction() - 0.25) < 1e-3 if hasattr(torch.cuda, "get_per_process_memory_fraction") else True
    try:
        torch.empty(int(total * 0.3), dtype=torch.uint8, device=dev)
        raise SystemExit("no OOM beyond the fraction")
    except torch.cuda.OutOfMemoryError as e:
        assert "gpumem" in str(e), str(e)
        # the text Lightning and Accelerate look for to recognise an OOM
        assert str(e).startswith("CUDA out of memory. "), str(e)
    y = torch.ones(16 * MiB, device=dev)   # the next step runs
    assert float(y.sum()) == 16 * MiB
    """)


@pytest.mark.gpu
def test_cap_below_usage_raises_and_frees_nothing():
    # gpumem's own cap refuses a value below the live bytes; torch's fraction accepts it, as PyTorch
    # does: live tensors stay, new memory is refused until the fraction is raised again.
    run("""
    x = torch.ones(256 * MiB, dtype=torch.uint8, device=dev)
    try:
        gpumem._bridge.set_cap(0, 64 * MiB); raise SystemExit("no error")
    except ValueError as e:
        assert "live" in str(e) or "below" in str(e), str(e)
    torch.cuda.set_per_process_memory_fraction(0.0001)
    assert torch.cuda.get_per_process_memory_fraction() == 0.0001
    try:
        torch.empty(64 * MiB, dtype=torch.uint8, device=dev); raise SystemExit("no OOM under the fraction")
    except torch.cuda.OutOfMemoryError as e:
        assert str(e).startswith("CUDA out of memory. Tried to allocate 64.00 MiB."), str(e)
    torch.cuda.set_per_process_memory_fraction(1.0)
    assert int(x.sum()) == 256 * MiB   # (the sum's result needs new memory too)
    y = torch.empty(64 * MiB, dtype=torch.uint8, device=dev)
    gpumem._bridge.validate(0)
    """)


@pytest.mark.gpu
def test_driver_time_counts_the_maps_unmaps_and_waits_of_a_capped_step():
    # Under a cap the pool maps and unmaps pages every round (two 30 MiB holes between live blocks
    # cannot hold the 50 MiB block, and mapping it passes the cap): driver_time() counts each kind,
    # waits as the pool's own counter does, and the host time they took.
    run("""
    t0 = gpumem.driver_time()
    assert set(t0) == {"map", "unmap", "segment", "wait", "event"}, t0
    st0 = torch.cuda.memory_stats()
    gpumem.set_cap(96 * MiB)
    side = torch.cuda.Stream()
    for i in range(10):
        a1 = torch.empty(30 * MiB, dtype=torch.uint8, device=dev).fill_(1)
        l1 = torch.empty(8 * MiB, dtype=torch.uint8, device=dev).fill_(1)
        a2 = torch.empty(30 * MiB, dtype=torch.uint8, device=dev).fill_(1)
        l2 = torch.empty(8 * MiB, dtype=torch.uint8, device=dev).fill_(1)
        a2.record_stream(side)    # a free the device may not have reached: an event
        del a1, a2
        c = torch.empty(50 * MiB, dtype=torch.uint8, device=dev).fill_(3)
        del c, l1, l2
    torch.cuda.synchronize()
    t1 = gpumem.driver_time()
    st1 = torch.cuda.memory_stats()
    d = {k: (t1[k]["calls"] - t0[k]["calls"], t1[k]["ms"] - t0[k]["ms"]) for k in t1}
    print(d)
    assert d["map"][0] > 0 and d["map"][1] > 0, d
    assert d["unmap"][0] > 0 and d["unmap"][1] > 0, d   # the cap made room
    assert d["event"][0] > 0, d
    assert d["wait"][0] == st1["num_sync_all_streams"] - st0["num_sync_all_streams"], (d, st1)
    assert d["segment"] == (0, 0.0), d
    assert all(ms >= 0 for _, ms in d.values()), d
    gpumem.validate()
    """, env={"GPUMEM_CONF": "release:lazy,upstream:vmm"})


CYCLES_HOLD_MEMORY = """
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(0.2)
class Holder: pass
gc.disable()
for _ in range(2):   # each cycle holds a tensor; only gc.collect frees them
    h = Holder(); h.me = h; h.t = torch.empty(int(total * 0.08), dtype=torch.uint8, device=dev)
    del h
"""


@pytest.mark.gpu
def test_oom_runs_gc_collect_for_cycles_with_gc_on_oom():
    run(CYCLES_HOLD_MEMORY + """
z = torch.empty(int(total * 0.1), dtype=torch.uint8, device=dev)   # needs the cycles collected
""", env={"GPUMEM_CONF": "gc_on_oom:true"})


@pytest.mark.gpu
def test_oom_does_not_collect_by_default_as_pytorchs_allocator():
    """PyTorch's allocator fails without collecting; so does gpumem by default: the cycles' tensors
    stay alive, the allocation raises, and after a collect the same allocation is served."""
    run(CYCLES_HOLD_MEMORY + """
try:
    torch.empty(int(total * 0.1), dtype=torch.uint8, device=dev)
    raise AssertionError("served: something collected the cycles")
except torch.cuda.OutOfMemoryError:
    pass
assert gc.collect() >= 2
z = torch.empty(int(total * 0.1), dtype=torch.uint8, device=dev)
gpumem.validate()
""")


@pytest.mark.gpu
def test_cuda_graph_capture_replay_and_graphed_callables():
    run("""
    s = torch.cuda.Stream()
    x = torch.randn(1024, device=dev)
    with torch.cuda.stream(s):
        for _ in range(3): y = x * 2 + 1
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x * 2 + 1
        tmp = torch.empty(4 * MiB, device=dev); del tmp   # freed during capture
    x.copy_(torch.arange(1024, device=dev, dtype=torch.float32))
    g.replay(); torch.cuda.synchronize()
    assert torch.equal(y, torch.arange(1024, device=dev, dtype=torch.float32) * 2 + 1)
    junk = [torch.full((1 << 20,), 7.0, device=dev) for _ in range(8)]  # must not reuse graph memory
    g.replay(); torch.cuda.synchronize()
    assert torch.equal(y, torch.arange(1024, device=dev, dtype=torch.float32) * 2 + 1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    inp = torch.randn(16, 64, device=dev, requires_grad=True)
    ref = model(inp).detach().clone()
    gm = torch.cuda.make_graphed_callables(model, (inp,))
    out = gm(inp); out.sum().backward()
    assert torch.allclose(out, ref, atol=1e-5)
    del g, y, out, gm; gc.collect(); torch.cuda.synchronize(); torch.cuda.empty_cache()
    gpumem._bridge.validate(0)
    """)


@pytest.mark.gpu
def test_torch_compile_reduce_overhead():
    run("""
    def f(a, b): return (a @ b).relu() + 1
    cf = torch.compile(f, mode="reduce-overhead")
    a = torch.randn(256, 256, device=dev); b = torch.randn(256, 256, device=dev)
    for _ in range(5):
        out = cf(a, b)
    assert torch.allclose(out, f(a, b), atol=1e-3)
    """)


@pytest.mark.gpu
def test_record_stream_protects_side_stream_use():
    run("""
    side = torch.cuda.Stream()
    n = 32 * MiB // 4
    bad = 0
    for it in range(20):
        a = torch.full((n,), 1.0, device=dev)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)   # keep the side stream busy
            res = a * 2
        a.record_stream(side)
        del a                                 # without record_stream the block could be reused now
        b = torch.full((n,), 5.0, device=dev) # would overwrite a's memory too early
        torch.cuda.synchronize()
        bad += int((res != 2.0).sum())
    assert bad == 0, bad
    """)


@pytest.mark.gpu
def test_an_oom_first_waits_for_blocks_a_busy_side_stream_still_uses():
    """Under a fraction that holds one 1 GiB tensor, a tensor freed after record_stream() on a side stream
    still busy is pending; the next 1 GiB request must wait for the side stream and reuse that memory,
    as PyTorch's allocator does (synchronize_and_free_events before it gives its cache back), not fail
    with nothing live. The side stream's result is intact."""
    run("""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((1536 * MiB) / total)
    side = torch.cuda.Stream()
    a = torch.full((256 * MiB,), 1.0, device=dev)       # 1 GiB of float32
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)                   # keep the side stream busy
        total_a = a.sum()
    a.record_stream(side)
    del a
    b = torch.full((256 * MiB,), 2.0, device=dev)       # fits only where a was
    torch.cuda.synchronize()
    assert float(total_a) == 256 * MiB, float(total_a)
    assert float(b[-1]) == 2.0
    assert torch.cuda.memory_stats()["num_ooms"] == 0
    """)


@pytest.mark.gpu
def test_cudnn_benchmark_conv():
    run("""
    torch.backends.cudnn.benchmark = True
    conv = torch.nn.Conv2d(3, 16, 3, padding=1).cuda()
    x = torch.randn(8, 3, 64, 64, device=dev)
    for _ in range(3):
        y = conv(x); y.sum().backward()
    torch.cuda.synchronize()
    """)


@pytest.mark.gpu
def test_snapshot_and_dump_snapshot():
    run("""
    torch.cuda.memory._record_memory_history(max_entries=1000)
    x = torch.empty(8 * MiB, dtype=torch.uint8, device=dev)
    y = torch.empty(3 * MiB, dtype=torch.uint8, device=dev); del y
    snap = torch.cuda.memory._snapshot()
    assert snap["segments"], snap
    seg = snap["segments"][0]
    for k in ("address", "total_size", "allocated_size", "stream", "segment_type", "blocks"):
        assert k in seg, k
    addrs = [b["address"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert x.data_ptr() in addrs
    actions = {e["action"] for t in snap["device_traces"] for e in t}
    assert {"alloc", "free_completed"} <= actions, actions
    path = os.path.join(tempfile.mkdtemp(), "snap.pickle")
    torch.cuda.memory._dump_snapshot(path)
    with open(path, "rb") as f:
        loaded = pickle.load(f)
    assert "segments" in loaded and "device_traces" in loaded
    torch.cuda.memory._record_memory_history(enabled=None)
    assert torch.cuda.memory_snapshot()
    """)


@pytest.mark.gpu
def test_multi_gpu_pools():
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run("""
    a = torch.ones(16 * MiB, device="cuda:0")
    torch.cuda.set_device(1)
    b = torch.ones(16 * MiB, device="cuda:1")
    assert torch.cuda.memory_allocated(1) >= 64 * MiB and torch.cuda.memory_allocated(0) >= 64 * MiB
    c = b.to("cuda:0") + a
    assert float(c.sum()) == 2 * 16 * MiB
    del b; torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated(1) == 0
    """)


@pytest.mark.gpu
def test_disable_leaves_torch_allocator():
    run("""
    import gpumem, gpumem._torch as gt, torch
    assert not gt.is_active() and "GPUMEM_DISABLE" in gt.status_line()
    x = torch.ones(10, device="cuda")
    assert torch.cuda.memory_allocated() > 0
    assert torch.cuda.memory.get_allocator_backend() == "native"
    """, env={"GPUMEM_DISABLE": "1"}, prelude="")


@pytest.mark.gpu
def test_bad_conf_raises_at_import():
    full = clean_env(GPUMEM_CONF="cap:banana")
    r = subprocess.run([sys.executable, "-c", "import gpumem"], env=full, capture_output=True, text=True)
    assert r.returncode != 0 and "cap" in r.stderr.splitlines()[-1]


@pytest.mark.gpu
def test_pool_after_cuda_init_allocates_from_gpumem():
    r = run("""
    import warnings, torch
    MiB = 1 << 20
    torch.ones(1, device="cuda")               # CUDA starts before gpumem
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        import gpumem, gpumem._torch as gt
    assert not gt.is_active()
    assert any("gpumem.pool" in str(x.message) for x in w), [str(x.message) for x in w]
    assert "initialized before" in gt.status_line()
    before = gt.stats(0)["reserved_bytes.all.current"]
    with gpumem._torch.pool() as p:
        t = torch.ones(32 * MiB, device="cuda")
    assert gt.stats(0)["reserved_bytes.all.current"] - before >= 128 * MiB
    assert float(t.sum()) == 32 * MiB
    """, prelude="")


@pytest.mark.gpu
@pytest.mark.parametrize("ipc", ["true", "false"])
def test_ipc_key_decides_whether_tensors_can_be_shared(ipc):
    """ipc:true (the default) creates pages exportable as file descriptors: a tensor's storage gives a
    gpumem IPC handle. ipc:false creates plain pages, which work as memory but sharing raises, naming
    the key."""
    run(f"""
    t = torch.arange(64 * MiB // 4, device="cuda", dtype=torch.float32)
    assert float(t[-1]) == 64 * MiB // 4 - 1
    storage = t.untyped_storage()
    if "{ipc}" == "true":
        handle = storage._share_cuda_()[1]
        assert b"gpumem-ipc:1:" in handle, handle
    else:
        try:
            storage._share_cuda_()
        except RuntimeError as e:
            assert "ipc:false" in str(e), str(e)
        else:
            raise AssertionError("a tensor of an ipc:false pool was shared")
    """, env={"GPUMEM_CONF": f"ipc:{ipc}"})
