"""CuPy, Numba and RMM allocating from gpumem's pool beside torch, on a GPU: live bytes per library,
one cap over all, the OOM path (cache released, callbacks run, the library's own error, the pool
still working after), reuse across libraries on one stream and on two streams (with a check that an
early reuse would fail), DLPack lifetime both ways. Each test runs in a fresh Python process
(gpumem must become torch's allocator before CUDA starts).

Run: pytest -m gpu tests/gpu/test_integrations_gpu.py"""
import importlib.util
import subprocess
import sys
import textwrap

import pytest
from _run import clean_env

# numba-cuda (0.30 and older) registers an overload of np.row_stack, which NumPy 2.5 removed: every
# kernel launch then fails with AttributeError (NVIDIA/numba-cuda#907, not fixed upstream). The
# GPU machine has that pair; np.row_stack was an alias of np.vstack, so it is put back before
# numba loads. gpumem itself does not touch numpy.
NUMPY_COMPAT = """
import numpy
if not hasattr(numpy, "row_stack"):
    numpy.row_stack = numpy.vstack
"""

PRELUDE = """
import gc, os, sys
import gpumem, gpumem._torch as gt
import torch
assert gt.is_active(), gt.status_line()
MiB = 1 << 20
dev = torch.device("cuda")

def lib(name, key="current"):
    return gpumem.stats(0)[f"gpumem.library.{name}.{key}"]

def pool_allocated():
    return gpumem.stats(0)["allocated_bytes.all.current"]

def libraries_sum():
    return sum(lib(n) for n in ("torch", "cupy", "numba", "rmm"))
"""



def cupy_prelude(kind="auto"):
    """PRELUDE with CuPy allocating from gpumem (kind: "auto", "c" or "python", as use()'s)."""
    return PRELUDE + f"""
import cupy
import gpumem.cupy
gpumem.cupy.use({kind!r})
assert gpumem.cupy.path() == {kind!r} or {kind!r} == "auto", gpumem.cupy.path()
"""


CUPY = cupy_prelude()
KINDS = pytest.mark.parametrize("kind", ["c", "python"])


_IMPORTABLE = {}


def need(module, package):
    """Skips the test, saying why, when `module` is not installed or does not import (checked in a
    child process: importing a CUDA library here could start CUDA in pytest's own process)."""
    if module not in _IMPORTABLE:
        if importlib.util.find_spec(module) is None:
            _IMPORTABLE[module] = f"{package} is not installed on this machine"
        else:
            r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                               timeout=300)
            tail = (r.stderr.strip().splitlines() or [""])[-1]
            _IMPORTABLE[module] = "" if r.returncode == 0 else f"{package} does not import here: {tail}"
    if _IMPORTABLE[module]:
        pytest.skip(_IMPORTABLE[module])


def run(body, prelude=CUPY, env=None, timeout=540):
    code = NUMPY_COMPAT + textwrap.dedent(prelude) + textwrap.dedent(body) + "\nprint('DONE')\n"
    r = subprocess.run([sys.executable, "-c", code], env=clean_env(**(env or {})), capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0 and "DONE" in r.stdout, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


# ---- CuPy -----------------------------------------------------------------------------------------

@pytest.mark.gpu
@KINDS
def test_cupy_live_bytes_are_counted_apart_from_torchs(kind):
    need("cupy", "cupy")
    run(prelude=cupy_prelude(kind), body="""
    t0, c0 = lib("torch"), lib("cupy")
    x = cupy.ones(16 * MiB, dtype=cupy.float32)          # 64 MiB
    t = torch.ones(8 * MiB, dtype=torch.float32, device=dev)  # 32 MiB
    assert lib("cupy") - c0 == 64 * MiB, lib("cupy")
    assert lib("torch") - t0 == 32 * MiB, lib("torch")
    assert lib("cupy", "allocations") >= 1
    assert pool_allocated() == libraries_sum(), (pool_allocated(), libraries_sum())
    assert torch.cuda.memory_allocated() == pool_allocated()   # torch's view: the pool's totals
    assert "gpumem.library.cupy.current" not in torch.cuda.memory_stats()  # torch's keys only
    s = str(gpumem.summary())
    assert "by library" in s and "cupy" in s and "torch" in s, s
    assert float(x.sum()) == 16 * MiB
    del x
    assert lib("cupy") == c0 and lib("cupy", "peak") >= 64 * MiB
    torch.cuda.reset_peak_memory_stats()
    assert lib("cupy", "peak") == lib("cupy") and lib("torch", "peak") == lib("torch")
    gpumem.validate()
    gpumem.cupy.unuse()
    y = cupy.ones(1024)                                    # CuPy's own pool again
    assert lib("cupy") == c0
    """)


@pytest.mark.gpu
def test_cupy_takes_the_c_path_with_cupys_current_stream():
    need("cupy", "cupy")
    run("""
    # The GPU machine's CuPy exports its current-stream function and passes C errors on.
    assert gpumem.cupy.c_path_problem() == "", gpumem.cupy.c_path_problem()
    assert gpumem.cupy.path() == "c"
    fn = cupy.cuda.get_allocator()
    assert type(fn.__self__).__name__ == "CFunctionAllocator", fn
    c0 = lib("cupy")

    def segment_stream(ptr):
        # The stream of the pool region (arena) holding ptr, from the snapshot gpumem gives torch.
        for seg in torch.cuda.memory_snapshot():
            for b in seg["blocks"]:
                if b["address"] <= ptr < b["address"] + b["size"] and b["state"] == "active_allocated":
                    return seg["stream"]
        raise AssertionError(f"{ptr:#x} is in no allocated block of the snapshot")

    x = cupy.ones(4 * MiB, dtype=cupy.uint8)
    assert type(x.data.mem).__name__ == "CFunctionAllocatorMemory", type(x.data.mem)
    assert lib("cupy") - c0 == 4 * MiB
    assert segment_stream(x.data.ptr) == cupy.cuda.get_current_stream().ptr
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        y = cupy.ones(8 * MiB, dtype=cupy.uint8)           # CuPy's current stream: side
        assert int(y.sum()) == 8 * MiB
    assert side.ptr != 0 and segment_stream(y.data.ptr) == side.ptr
    ptr = y.data.ptr
    side.synchronize()
    del y                                                  # back to side's arena...
    with side:
        z = cupy.empty(8 * MiB, dtype=cupy.uint8)          # ...reused at once by side's next block
    assert z.data.ptr == ptr, (hex(z.data.ptr), hex(ptr))
    del z
    e = cupy.empty(0, dtype=cupy.uint8)                    # size 0: no block, as CuPy's own pool
    assert e.data.ptr == 0 and lib("cupy") - c0 == 4 * MiB
    # A block outlives the allocator that made it (unuse drops it): freed without it.
    gpumem.cupy.unuse()
    del fn
    gc.collect()
    assert lib("cupy") - c0 == 4 * MiB
    del x
    assert lib("cupy") == c0
    assert pool_allocated() == libraries_sum()
    gpumem.validate()
    """, prelude=cupy_prelude("c"))


@pytest.mark.gpu
def test_cupy_python_path_can_be_chosen_and_switched():
    need("cupy", "cupy")
    run("""
    assert gpumem.cupy.path() == "python"
    fn = cupy.cuda.get_allocator()
    assert fn.__name__ == "gpumem_cupy_malloc", fn
    c0 = lib("cupy")
    x = cupy.ones(MiB, dtype=cupy.uint8)
    assert type(x.data.mem).__name__ == "UnownedMemory"
    gpumem.cupy.use("c")                                   # switches, not stacked
    assert gpumem.cupy.path() == "c"
    y = cupy.ones(MiB, dtype=cupy.uint8)
    assert type(y.data.mem).__name__ == "CFunctionAllocatorMemory"
    assert lib("cupy") - c0 == 2 * MiB
    gpumem.cupy.unuse()                                    # CuPy's own pool, not the Python path
    assert not gpumem.cupy.is_used()
    own = cupy.ones(MiB, dtype=cupy.uint8)
    assert type(own.data.mem).__name__ not in ("UnownedMemory", "CFunctionAllocatorMemory")
    assert lib("cupy") - c0 == 2 * MiB
    with gpumem.cupy.using("c"):
        z = cupy.ones(MiB, dtype=cupy.uint8)
    assert lib("cupy") - c0 == 3 * MiB
    del x, y, z
    assert lib("cupy") == c0
    """, prelude=cupy_prelude("python"))


@pytest.mark.gpu
def test_cupy_and_torch_reuse_each_others_blocks_on_one_stream():
    need("cupy", "cupy")
    run("""
    x = cupy.empty(64 * MiB, dtype=cupy.uint8)
    ptr = x.data.ptr
    cupy.cuda.get_current_stream().synchronize()
    reserved = gpumem.stats(0)["reserved_bytes.all.current"]
    del x                                                  # back to the pool...
    t = torch.empty(64 * MiB, dtype=torch.uint8, device=dev)
    assert t.data_ptr() == ptr, (hex(t.data_ptr()), hex(ptr))   # ...and torch's next block
    assert gpumem.stats(0)["reserved_bytes.all.current"] == reserved
    tp = t.data_ptr()
    del t
    y = cupy.empty(64 * MiB, dtype=cupy.uint8)
    assert y.data.ptr == tp                                 # and the reverse
    with gpumem.cupy.using():                               # the scoped form, nested: same pool
        z = cupy.zeros(10)
    assert lib("cupy") >= 64 * MiB + 512
    """)


@pytest.mark.gpu
def test_one_cap_and_one_fraction_cover_torch_and_cupy():
    need("cupy", "cupy")
    run("""
    gpumem.set_cap(1024 * MiB)
    t = torch.empty(700 * MiB, dtype=torch.uint8, device=dev)
    try:
        cupy.empty(600 * MiB, dtype=cupy.uint8)
        raise AssertionError("CuPy went past the cap torch's tensor shares")
    except cupy.cuda.memory.OutOfMemoryError as e:
        assert e._size == 600 * MiB and e._limit == 1024 * MiB, (e._size, e._limit)
    del t
    x = cupy.empty(600 * MiB, dtype=cupy.uint8)           # fits once torch let go
    try:
        torch.empty(600 * MiB, dtype=torch.uint8, device=dev)
        raise AssertionError("torch went past the cap CuPy's array shares")
    except torch.cuda.OutOfMemoryError:
        pass
    del x
    gpumem.set_cap(0)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.05)
    try:
        cupy.empty(int(total * 0.06), dtype=cupy.uint8)
        raise AssertionError("CuPy went past torch's memory fraction")
    except cupy.cuda.memory.OutOfMemoryError:
        pass
    torch.cuda.set_per_process_memory_fraction(1.0)
    y = cupy.empty(int(total * 0.06), dtype=cupy.uint8)
    gpumem.validate()
    """)


@pytest.mark.gpu
@KINDS
def test_cupy_oom_releases_the_cache_runs_gc_then_raises_cupys_error(kind):
    # gc_on_oom:true, as CuPy's own pool collects before it raises (gpumem's default is PyTorch's: no
    # collect).
    need("cupy", "cupy")
    run(prelude=cupy_prelude(kind), body="""
    gpumem.set_cap(1024 * MiB)
    # Cached memory on another stream's arena: only released memory can serve CuPy's request.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        c = torch.empty(900 * MiB, dtype=torch.uint8, device=dev)
    side.synchronize()
    del c
    frees = gpumem.stats(0)["num_device_free"]
    x = cupy.empty(900 * MiB, dtype=cupy.uint8)            # served after releasing the cache
    assert gpumem.stats(0)["num_device_free"] > frees       # (the side stream's pages went back)
    assert gpumem.stats(0)["reserved_bytes.all.current"] <= 1024 * MiB
    del x
    # Memory only a garbage collection frees: a reference cycle holding a torch tensor.
    gc.disable()
    class Node: pass
    a, b = Node(), Node(); a.b, b.a = b, a
    a.t = torch.empty(800 * MiB, dtype=torch.uint8, device=dev)
    del a, b
    collected = []
    gc.callbacks.append(lambda phase, info: collected.append(phase))
    y = cupy.empty(800 * MiB, dtype=cupy.uint8)            # served after the OOM callback's gc
    assert "start" in collected, collected
    del y
    ooms, retries = gpumem.stats(0)["num_ooms"], gpumem.stats(0)["num_alloc_retries"]
    collected.clear()
    try:
        cupy.empty(2048 * MiB, dtype=cupy.uint8)
        raise AssertionError("no OutOfMemoryError")
    except cupy.cuda.memory.OutOfMemoryError as e:
        assert "gpumem" in str(e.__cause__), e.__cause__
        assert e._size == 2048 * MiB and e._limit == 1024 * MiB, (e._size, e._limit)
    assert gpumem.stats(0)["num_ooms"] == ooms + 1
    assert gpumem.stats(0)["num_alloc_retries"] > retries  # the cache was released, then...
    assert "start" in collected, collected                   # ...gc ran, before the error
    assert lib("cupy", "ooms") == 1
    gc.enable()
    # Everything still works after the error.
    z = cupy.ones(100 * MiB, dtype=cupy.uint8)
    t = torch.ones(100 * MiB, dtype=torch.uint8, device=dev)
    assert int(z.sum()) == 100 * MiB and int(t.sum()) == 100 * MiB
    gpumem.validate()
    """, env={"GPUMEM_CONF": "gc_on_oom:true"})


# The early-reuse check: a kernel queued on stream A reads buffer X after a long spin; X is freed
# (every Python reference dropped) while it waits. Under a cap that leaves no room for a second X, the
# other library's allocation on stream B must take X's memory: the pool has to wait for A before it
# hands it over. Were X reused at once, B's fill (queued on B, not ordered after A) would overwrite it
# before A's kernel reads it, and the sum would be wrong.
REUSE = """
N = 256 * MiB
gpumem.set_cap(N + 48 * MiB)
SPIN = 1_500_000_000                                        # ~1 s of clock cycles on an H100
stream_a, stream_b = {make_a}, {make_b}
"""


@pytest.mark.gpu
def test_cupy_block_freed_on_stream_a_is_not_reused_by_torch_on_stream_b_too_early():
    need("cupy", "cupy")
    run(prelude=CUPY + REUSE.format(make_a="cupy.cuda.Stream(non_blocking=True)",
                                    make_b="torch.cuda.Stream()"), body="""
    with stream_a:
        x = cupy.ones(N // 4, dtype=cupy.int32)            # CuPy's block, on stream A
    a_torch = torch.cuda.ExternalStream(stream_a.ptr)
    xt = torch.from_dlpack(x)
    with torch.cuda.stream(a_torch):
        torch.cuda._sleep(SPIN)                             # A: spin, then read X
        total = xt.sum(dtype=torch.int32)  # int32: an int64 sum copies X
    del xt, x                                               # X freed while A's kernels wait
    assert lib("cupy") == 0
    with torch.cuda.stream(stream_b):
        y = torch.zeros(N // 4, dtype=torch.int32, device=dev)  # needs X's memory (the cap)
    torch.cuda.synchronize()
    assert int(total) == N // 4, f"A read {int(total)}, not {N // 4}: X was reused before A was done"
    assert lib("torch") >= N
    gpumem.validate()
    """)


@pytest.mark.gpu
def test_torch_block_freed_on_stream_b_is_not_reused_by_cupy_on_stream_a_too_early():
    need("cupy", "cupy")
    run(prelude=CUPY + REUSE.format(make_a="cupy.cuda.Stream(non_blocking=True)",
                                    make_b="torch.cuda.Stream()"), body="""
    with torch.cuda.stream(stream_b):
        x = torch.ones(N // 4, dtype=torch.int32, device=dev)   # torch's block, on stream B
        torch.cuda._sleep(SPIN)
        total = x.sum(dtype=torch.int32)  # int32: an int64 sum copies X (the cap)
    del x
    with stream_a:
        y = cupy.zeros(N // 4, dtype=cupy.int32)            # needs X's memory (the cap)
    torch.cuda.synchronize(); stream_a.synchronize()
    assert int(total) == N // 4, f"B read {int(total)}, not {N // 4}: X was reused before B was done"
    assert int(y.sum()) == 0
    gpumem.validate()
    """)


@pytest.mark.gpu
@KINDS
def test_dlpack_memory_goes_back_only_when_both_sides_dropped_it(kind):
    need("cupy", "cupy")
    run(prelude=cupy_prelude(kind), body="""
    # torch -> CuPy
    t0 = lib("torch")
    t = torch.full((16 * MiB,), 3, dtype=torch.float32, device=dev)
    c = cupy.from_dlpack(t)
    del t
    gc.collect()
    assert lib("torch") - t0 == 64 * MiB                    # CuPy still holds torch's block
    assert float(c.sum()) == 3 * 16 * MiB
    del c
    gc.collect()
    assert lib("torch") == t0
    # CuPy -> torch
    c0 = lib("cupy")
    c = cupy.full(16 * MiB, 5, dtype=cupy.float32)
    t = torch.from_dlpack(c)
    del c
    gc.collect()
    assert lib("cupy") - c0 == 64 * MiB                     # torch still holds CuPy's block
    assert float(t.sum()) == 5 * 16 * MiB
    del t
    gc.collect()
    assert lib("cupy") == c0
    assert pool_allocated() == libraries_sum()
    gpumem.validate()
    """)


# ---- Numba ----------------------------------------------------------------------------------------

NUMBA_BODY = """
import numpy as np
from numba import cuda
from numba.cuda.cudadrv.driver import CudaAPIError

@cuda.jit
def fill(a, v):
    i = cuda.grid(1)
    if i < a.size:
        a[i] = v

assert type(cuda.current_context().memory_manager).__name__ == "GpumemNumbaMemoryManager"
n0 = lib("numba")
d = cuda.device_array(16 * MiB, dtype=np.float32)
assert lib("numba") - n0 == 64 * MiB, lib("numba")
fill[(16 * MiB + 255) // 256, 256](d, 2.0)
assert float(d.copy_to_host().sum()) == 2.0 * 16 * MiB
free, total = cuda.current_context().get_memory_info()
assert 0 < free <= total
t = torch.as_tensor(d, device=dev)                          # CUDA array interface: shared memory
assert float(t.sum()) == 2.0 * 16 * MiB
del d
assert lib("numba") - n0 == 64 * MiB                        # torch's view holds it
del t
gc.collect()
assert lib("numba") == n0
assert pool_allocated() == libraries_sum()
gpumem.set_cap(512 * MiB)
try:
    cuda.device_array(1024 * MiB, dtype=np.uint8)
    raise AssertionError("no out-of-memory error")
except CudaAPIError as e:
    assert "OUT_OF_MEMORY" in str(e.code), e.code
assert lib("numba", "ooms") == 1
e = cuda.device_array(64 * MiB, dtype=np.uint8)            # still works
gpumem.validate()
"""


@pytest.mark.gpu
def test_numba_plugin_selected_by_environment_variable():
    need("numba", "numba-cuda")
    run(NUMBA_BODY, prelude=PRELUDE, env={"NUMBA_CUDA_MEMORY_MANAGER": "gpumem.numba"})


@pytest.mark.gpu
def test_numba_plugin_selected_by_use():
    need("numba", "numba-cuda")
    run("import gpumem.numba\ngpumem.numba.use()\n" + NUMBA_BODY, prelude=PRELUDE)


# ---- RMM ------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_rmm_resource_draws_from_the_pool():
    need("rmm", "rmm")
    run("""
    import rmm
    import gpumem.rmm
    mr = gpumem.rmm.use()
    assert rmm.mr.get_current_device_resource() is mr
    r0 = lib("rmm")
    buf = rmm.DeviceBuffer(size=64 * MiB)
    assert lib("rmm") - r0 == 64 * MiB
    ptr = buf.ptr
    del buf
    assert lib("rmm") == r0
    t = torch.empty(64 * MiB, dtype=torch.uint8, device=dev)
    assert t.data_ptr() == ptr                               # RMM's block, reused by torch
    del t
    s = rmm.pylibrmm.stream.Stream()                         # a stream of its own
    buf = rmm.DeviceBuffer(size=8 * MiB, stream=s)
    del buf                                                  # freed on that stream
    gpumem.set_cap(256 * MiB)
    try:
        rmm.DeviceBuffer(size=512 * MiB)
        raise AssertionError("no out-of-memory error")
    except MemoryError:
        pass
    assert lib("rmm", "ooms") == 1
    ok = rmm.DeviceBuffer(size=16 * MiB)
    assert pool_allocated() == libraries_sum()
    gpumem.validate()
    """, prelude=PRELUDE)
