"""The two CUDA upstreams on a real GPU: allocate, write, read back, free, and trim() visibly returns
memory to the device (cuMemGetInfo)."""
import pytest

from gpumem import _C

MiB = 1 << 20


class DeviceArray:
    """A zero-copy view of raw device memory for torch (CUDA array interface)."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes // 4,), "typestr": "<f4", "data": (ptr, False),
                                         "version": 3, "strides": None}


def view(ptr, nbytes):
    import torch

    return torch.as_tensor(DeviceArray(ptr, nbytes), device="cuda")


@pytest.fixture(scope="module")
def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.cuda.init()
    return torch


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["vmm", "segments"])
def test_allocate_write_read_free_and_trim_returns_memory(torch_cuda, kind):
    torch = torch_cuda
    if kind == "vmm" and not _C.cuda_vmm_supported(0):
        pytest.skip("device without virtual memory management")
    upstream = _C.cuda_upstream(kind, 0)
    pool = _C.Pool(upstream, release="lazy")
    # Load the kernels the checks use first: module loading takes device memory the pool never sees.
    warm = torch.ones(1024, device="cuda")
    assert torch.all(warm.fill_(2.0) == 2.0).item()
    torch.cuda.synchronize()
    free_before = upstream.free_bytes
    sizes = [1000, 512 * 1024, 3 * MiB, 64 * MiB, 256 * MiB]
    ptrs = [pool.allocate(n) for n in sizes]
    for i, (p, n) in enumerate(zip(ptrs, sizes)):
        t = view(p, n - n % 4)
        t.fill_(float(i + 1))
    torch.cuda.synchronize()
    # Measured before the checks below allocate comparison results (from torch's allocator).
    used = free_before - upstream.free_bytes
    reserved = pool.stats()["reserved_bytes"]["all"]["current"]
    assert reserved >= sum(sizes)
    assert abs(used - reserved) <= 4 * MiB, (used, reserved)  # the device agrees with the pool
    for i, (p, n) in enumerate(zip(ptrs, sizes)):
        t = view(p, n - n % 4)
        assert torch.all(t == float(i + 1)).item(), f"block {i} lost its data"
    pool.validate()
    for p in ptrs:
        pool.free(p)
    released = pool.trim()
    torch.cuda.empty_cache()  # the comparison results above were cached by torch's allocator
    torch.cuda.synchronize()
    assert released == reserved
    assert pool.stats()["reserved_bytes"]["all"]["current"] == 0
    assert upstream.free_bytes >= free_before - 4 * MiB, "trim() did not give the memory back"


@pytest.mark.gpu
def test_vmm_returns_a_free_page_between_live_blocks(torch_cuda):
    if not _C.cuda_vmm_supported(0):
        pytest.skip("device without virtual memory management")
    upstream = _C.cuda_upstream("vmm", 0)
    pool = _C.Pool(upstream, release="lazy")
    a, b, c = (pool.allocate(128 * MiB) for _ in range(3))
    view(a, 128 * MiB).fill_(1.0)
    view(c, 128 * MiB).fill_(3.0)
    pool.free(b)
    torch_cuda.cuda.synchronize()
    before = upstream.free_bytes
    released = pool.trim()
    assert released >= 124 * MiB
    assert upstream.free_bytes - before >= 124 * MiB
    assert torch_cuda.all(view(a, 128 * MiB) == 1.0).item() and torch_cuda.all(view(c, 128 * MiB) == 3.0).item()
    pool.free(a)
    pool.free(c)
    pool.trim()


@pytest.mark.gpu
def test_cuda_oom_is_an_out_of_memory_error_and_the_pool_recovers(torch_cuda):
    upstream = _C.cuda_upstream("vmm" if _C.cuda_vmm_supported(0) else "segments", 0)
    pool = _C.Pool(upstream)
    with pytest.raises(_C.OutOfMemoryError, match="out of memory"):
        pool.allocate(upstream.total_bytes + (1 << 30))
    p = pool.allocate(8 * MiB)
    pool.free(p)
    pool.trim()
    pool.validate()


@pytest.mark.gpu
def test_record_stream_waits_for_the_side_stream(torch_cuda):
    torch = torch_cuda
    upstream = _C.cuda_upstream("vmm" if _C.cuda_vmm_supported(0) else "segments", 0)
    pool = _C.Pool(upstream)
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    p = pool.allocate(64 * MiB, main.cuda_stream)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keep the side stream busy
    pool.record_stream(p, side.cuda_stream)
    pool.free(p)
    q = pool.allocate(64 * MiB, main.cuda_stream)
    assert q != p, "a block still in use on the side stream was handed out again"
    side.synchronize()
    pool.process_events()
    r = pool.allocate(64 * MiB, main.cuda_stream)
    assert r == p
    pool.free(q)
    pool.free(r)
    pool.validate()


@pytest.mark.gpu
def test_a_block_maps_from_pages_still_draining_on_its_stream_in_stream_order(torch_cuda):
    """High-water release while the GPU is behind: the freed block's pages are still in use by queued
    work, and the next block of the stream maps them at once (map_from) instead of new memory; the
    queued work still reads the old data, the new block's writes come after it, and once the old
    address is unmapped the new block keeps its memory."""
    torch = torch_cuda
    if not _C.cuda_vmm_supported(0):
        pytest.skip("device without virtual memory management")
    upstream = _C.cuda_upstream("vmm", 0)
    pool = _C.Pool(upstream, release="high_water")
    main = torch.cuda.current_stream()
    warm = torch.ones(1024, device="cuda")
    assert warm.sum().item() == 1024  # kernels loaded before the figures below
    torch.cuda.synchronize()
    a = pool.allocate(64 * MiB, main.cuda_stream)
    b = pool.allocate(64 * MiB, main.cuda_stream)
    view(a, 64 * MiB).fill_(1.0)
    view(b, 64 * MiB).fill_(2.0)
    torch.cuda.synchronize()
    free_before = upstream.free_bytes
    torch.cuda._sleep(500_000_000)  # the device runs behind the host from here
    total_of_a = view(a, 64 * MiB).sum()  # a's last use, queued behind the sleep
    behind = torch.cuda.Event()
    behind.record(main)
    pool.free(a)
    c = pool.allocate(96 * MiB, main.cuda_stream)  # past the high water: a's pages go back
    st = pool.stats()
    assert not behind.query(), "the sleep ended before the checks: the test proves nothing"
    assert st["num_sync_all_streams"] == 0, "the allocation waited for the device"
    assert st["reserved_bytes"]["all"]["current"] == 160 * MiB  # b and c: a's 64 MiB moved to c
    assert free_before - upstream.free_bytes <= 32 * MiB + 4 * MiB  # only c's last 32 MiB are new
    view(c, 96 * MiB).fill_(5.0)  # queued after a's last use
    assert total_of_a.item() == 16 * MiB, "a's data changed before its last use"
    torch.cuda.synchronize()
    pool.process_events()  # a's old address is unmapped now; c keeps the memory
    pool.validate()
    assert torch.all(view(c, 96 * MiB) == 5.0).item() and torch.all(view(b, 64 * MiB) == 2.0).item()
    assert pool.stats()["reserved_bytes"]["all"]["current"] == 160 * MiB
    pool.free(b)
    pool.free(c)
    pool.trim()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    assert upstream.free_bytes >= free_before + 64 * MiB - 4 * MiB, "the memory did not go back"


class OutsideMemory:
    """Device memory taken outside the pool with the driver's own cuMemAlloc (another library's
    allocation), in the current context."""

    def __init__(self, nbytes):
        import ctypes

        self._cuda = ctypes.CDLL("libcuda.so.1")
        self._ptr = ctypes.c_uint64(0)
        rc = self._cuda.cuMemAlloc_v2(ctypes.byref(self._ptr), ctypes.c_size_t(nbytes))
        assert rc == 0, f"cuMemAlloc_v2({nbytes}) failed: {rc}"

    def free(self):
        if self._ptr.value:
            assert self._cuda.cuMemFree_v2(self._ptr) == 0
            self._ptr.value = 0


@pytest.mark.gpu
def test_the_pool_learns_the_devices_room_from_a_refusal_and_grows_again_when_memory_outside_goes(torch_cuda):
    """Memory held outside the pool leaves it 1 GiB of the device. A refused map teaches the pool that
    room (a retry, the cache released); allocations near it still succeed (the device's last few MiB,
    which it reports free but may refuse, can cost another retry: not asserted). When the memory
    outside is freed, the pool asks the device again before the learned room would make it release
    anything: 2 GiB more fit with no retry and no cached page given back. The data of every block
    survives."""
    torch = torch_cuda
    if not _C.cuda_vmm_supported(0):
        pytest.skip("device without virtual memory management")
    GiB = 1 << 30
    upstream = _C.cuda_upstream("vmm", 0)
    pool = _C.Pool(upstream, release="lazy", page_size=2 * MiB, stitch=False)  # the room alone
    warm = torch.ones(1024, device="cuda")
    assert torch.all(warm.fill_(2.0) == 2.0).item()
    torch.cuda.synchronize()
    outside = OutsideMemory(upstream.free_bytes - 1 * GiB)
    try:
        keep = pool.allocate(400 * MiB)
        hole = pool.allocate(300 * MiB)
        tail = pool.allocate(200 * MiB)
        view(tail, 200 * MiB).fill_(7.0)
        pool.free(hole)
        a = pool.allocate(400 * MiB)  # fits nowhere mapped, the device has ~124 MiB left: refused, retried
        assert pool.stats()["num_alloc_retries"] == 1
        pool.free(a)
        pool.free(keep)
        b = pool.allocate(500 * MiB)  # near the learned room: cached pages released first
        assert pool.stats()["num_ooms"] == 0
        view(b, 500 * MiB).fill_(3.0)
        retries = pool.stats()["num_alloc_retries"]
        released = pool.stats()["reserved_bytes"]["all"]["freed"]
        outside.free()
        big = pool.allocate(2 * GiB)
        stats = pool.stats()
        assert stats["num_alloc_retries"] == retries and stats["num_ooms"] == 0
        assert stats["reserved_bytes"]["all"]["freed"] == released
        view(big, 2 * GiB).fill_(5.0)
        torch.cuda.synchronize()
        assert torch.all(view(tail, 200 * MiB) == 7.0).item()
        assert torch.all(view(b, 500 * MiB) == 3.0).item()
        assert torch.all(view(big, 2 * GiB) == 5.0).item()
        for p in (tail, b, big):
            pool.free(p)
        pool.validate()
        torch.cuda.synchronize()
        assert pool.trim() > 0 and pool.stats()["reserved_bytes"]["all"]["current"] == 0
    finally:
        outside.free()
