"""The pool on the simulated device: a randomized test against a reference model, with the invariant
checker after every operation, and every kind of bad input. allocate_at, limits and the segment
observer: tests/test_pool_placement.py."""
import random

import pytest

from gpumem import _C
from pool_model import GiB, MiB, Model, flat, hole_then_larger, random_size, run_threads


@pytest.mark.parametrize("kind, stitch", [("vmm", False), ("segments", False), ("vmm", True)])
@pytest.mark.parametrize("release", ["high_water", "lazy"])
@pytest.mark.parametrize("seed", [1, 2])
def test_randomized_operations_keep_every_invariant(kind, stitch, release, seed):
    rng = random.Random(seed)
    device = _C.SimulatedDevice(kind, 4 * GiB)
    device.set_auto_complete(False)
    pool = _C.Pool(device, release=release, stitch=stitch)
    other = _C.Pool(_C.SimulatedDevice(kind, 1 * GiB), device=1)
    foreign = other.allocate(4096)
    m = Model(pool, device)
    streams = [0, 7, 9]
    freed = []
    counts = {"oom": 0, "bad": 0}
    for step in range(2500):
        op = rng.random()
        if op < 0.45:
            size = random_size(rng)
            stream = rng.choice(streams)
            try:
                ptr = pool.allocate(size, stream)
            except _C.OutOfMemoryError as e:
                counts["oom"] += 1
                assert "out of memory" in str(e) and "tried to allocate" in str(e)
            else:
                assert ptr not in m.live
                m.live[ptr] = (size, stream)
        elif op < 0.8 and m.live:
            ptr = rng.choice(list(m.live))
            del m.live[ptr]
            pool.free(ptr)
            freed.append(ptr)
        elif op < 0.85 and m.live:
            ptr = rng.choice(list(m.live))
            pool.record_stream(ptr, rng.choice(streams))
        elif op < 0.88:
            device.complete(rng.choice(streams))
            pool.process_events()
        elif op < 0.9:
            pool.trim()
        elif op < 0.91:
            # Memory outside the pool comes and goes (another process): the pool learns the device's
            # room when a map is refused and forgets it when it retries.
            device.held_elsewhere = rng.choice([0, rng.randint(0, 4 * GiB - device.used_bytes)])
        elif op < 0.92:
            # A cap between what is live and the whole device.
            active = flat(pool.stats(), "active_bytes")
            cap = rng.choice([0, max(active, 64 * MiB) + rng.randint(0, 2 * GiB)])
            pool.set_cap(-(-cap // (2 * MiB)) * 2 * MiB)
        else:
            # Bad input: each is refused and changes nothing.
            counts["bad"] += 1
            before = pool.stats()
            choices = ["foreign", "wrong_device", "negative", "absurd"]
            stale = [p for p in freed if p not in m.live]  # freed and not handed out again
            choices += ["double"] * bool(stale) + ["interior"] * bool(m.live)
            bad = rng.choice(choices)
            with pytest.raises(ValueError):
                if bad == "double":
                    pool.free(rng.choice(stale))
                elif bad == "foreign":
                    pool.free(0xDEAD000)
                elif bad == "interior":
                    pool.free(next(iter(m.live)) + 256)
                elif bad == "wrong_device":
                    pool.free(foreign)
                elif bad == "negative":
                    pool.allocate(-1)
                else:
                    pool.allocate(1 << 60)
            after = pool.stats()
            for key in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes"):
                assert flat(after, key) == flat(before, key)
        m.check()
    for ptr in list(m.live):
        pool.free(ptr)
    m.live.clear()
    device.complete_all()
    pool.process_events()
    pool.trim()
    m.check()
    assert flat(pool.stats(), "reserved_bytes") == 0
    assert device.used_bytes == 0
    assert counts["bad"] > 50


def test_zero_bytes_is_null_and_free_of_null_is_a_no_op():
    pool = _C.Pool(_C.SimulatedDevice("vmm", GiB))
    assert pool.allocate(0) == 0
    pool.free(0)
    assert flat(pool.stats(), "allocation") == 0
    pool.validate()


def test_larger_than_capacity_is_an_oom_with_figures_and_pool_still_works():
    device = _C.SimulatedDevice("vmm", GiB)
    pool = _C.Pool(device)
    keep = pool.allocate(100 * MiB)
    with pytest.raises(_C.OutOfMemoryError) as e:
        pool.allocate(2 * GiB)
    msg = str(e.value)
    assert "2.00 GiB" in msg and "100.00 MiB held by live tensors" in msg and "largest free block" in msg
    assert isinstance(e.value, MemoryError)
    s = pool.stats()
    assert s["num_ooms"] == 1 and s["num_alloc_retries"] == 1
    p = pool.allocate(200 * MiB)
    pool.free(p)
    pool.free(keep)
    pool.validate()


def test_alignment_and_small_requests_do_not_share_pages_with_large_blocks():
    pool = _C.Pool(_C.SimulatedDevice("vmm", 8 * GiB))
    small = [pool.allocate(1000) for _ in range(100)]
    large = pool.allocate(64 * MiB)
    assert all(p % 512 == 0 for p in small)
    s = pool.stats()
    assert s["allocated_bytes"]["small_pool"]["current"] == 100 * 1024
    assert s["allocated_bytes"]["large_pool"]["current"] == 64 * MiB
    # Small blocks are packed together: 100 KiB of them stay within one page.
    lo, hi = min(small), max(small) + 1024
    assert hi - lo <= 2 * MiB
    assert not (lo <= large < hi)
    for p in small + [large]:
        pool.free(p)
    pool.validate()


def test_block_freed_on_a_stream_is_reused_at_once_there_but_not_on_another_until_its_event():
    device = _C.SimulatedDevice("vmm", 4 * GiB)
    device.set_auto_complete(False)
    pool = _C.Pool(device)
    a = pool.allocate(8 * MiB, 1)
    pool.free(a)
    assert pool.allocate(8 * MiB, 1) == a  # same stream: reused at once
    pool.record_stream(a, 2)
    pool.free(a)
    assert flat(pool.stats(), "active_bytes") == 8 * MiB  # waits for stream 2
    b = pool.allocate(8 * MiB, 1)
    assert b != a
    device.complete(2)
    pool.process_events()
    assert flat(pool.stats(), "active_bytes") == 8 * MiB  # only b now
    assert pool.allocate(8 * MiB, 1) == a
    pool.validate()


@pytest.mark.parametrize("kind", ["vmm", "segments"])
def test_out_of_memory_first_waits_for_blocks_other_streams_still_use(kind):
    """A block freed after record_stream() stays pending until the other stream's work is done. When a
    request finds no room, the pool waits for those events and gives the blocks back before it
    releases its cache and retries, as PyTorch's allocator synchronises its outstanding events first
    (synchronize_and_free_events): the request then fits where the pending block was, instead of
    failing with nothing live (it did before)."""
    device = _C.SimulatedDevice(kind, 1 * GiB)
    device.set_auto_complete(False)
    pool = _C.Pool(device)
    a = pool.allocate(600 * MiB, 0)
    pool.record_stream(a, 7)
    pool.free(a)
    assert flat(pool.stats(), "active_bytes") == 600 * MiB  # pending on stream 7
    b = pool.allocate(600 * MiB, 0)
    stats = pool.stats()
    assert stats["num_ooms"] == 0 and stats["num_alloc_retries"] == 1
    assert flat(stats, "active_bytes") == 600 * MiB  # b only: a went back to the pool
    # The same after the out-of-memory callbacks: a block they free with record_stream() is waited for.
    c_holder = []

    def free_with_record_stream():
        if c_holder:
            pool.record_stream(c_holder[0], 9)
            pool.free(c_holder.pop())

    pool.free(b)
    pool.trim()
    c_holder.append(pool.allocate(600 * MiB, 0))
    pool.add_oom_callback(free_with_record_stream)
    d = pool.allocate(600 * MiB, 0)
    assert pool.stats()["num_ooms"] == 0 and not c_holder
    pool.free(d)
    pool.validate()


def test_vmm_returns_free_pages_in_the_middle():
    device = _C.SimulatedDevice("vmm", 4 * GiB, 2 * MiB)
    pool = _C.Pool(device, release="lazy", page_size=2 * MiB, stitch=False)  # the release mechanism alone
    a = pool.allocate(100 * MiB)
    b = pool.allocate(100 * MiB)
    c = pool.allocate(100 * MiB)
    pool.free(b)  # a hole between two live blocks
    reserved = flat(pool.stats(), "reserved_bytes")
    released = pool.trim()
    assert released >= 98 * MiB
    assert flat(pool.stats(), "reserved_bytes") == reserved - released == device.used_bytes
    pool.free(a)
    pool.free(c)
    pool.trim()
    assert device.used_bytes == 0
    pool.validate()


def test_high_water_policy_reuses_cached_pages_instead_of_growing():
    device = _C.SimulatedDevice("vmm", 4 * GiB, 2 * MiB)
    pool = _C.Pool(device, release="high_water", page_size=2 * MiB)
    keep = pool.allocate(300 * MiB)
    big = pool.allocate(600 * MiB)
    tail = pool.allocate(300 * MiB)
    pool.free(big)  # 600 MiB cached between two live blocks
    peak = flat(pool.stats(), "reserved_bytes", "peak")
    # 700 MiB does not fit the hole: the pool unmaps the hole's pages before mapping new ones, so
    # reserved ends within the release slack (0.5% of the live peak) of what live data needs.
    x = pool.allocate(700 * MiB)
    live_peak = 1300 * MiB
    assert flat(pool.stats(), "reserved_bytes", "peak") <= max(peak, live_peak * 1.005) + 4 * MiB
    for p in (keep, tail, x):
        pool.free(p)
    pool.validate()


def test_after_trim_the_high_water_policy_follows_the_new_phase():
    """trim() (empty_cache) starts the live high water again from the live bytes: a later phase whose
    blocks leave a hole releases it before growing past its own high water, not past the earlier
    phase's peak (Pool::forget_high_water; 168 MiB reserved here before, for 104 live)."""
    device = _C.SimulatedDevice("vmm", 8 * GiB)
    pool = _C.Pool(device, release="high_water", stitch=False)  # the policy alone
    pool.free(pool.allocate(512 * MiB))  # the earlier phase, higher than everything after it
    assert pool.trim() == 512 * MiB
    _, sep, c = hole_then_larger(pool)  # a hole the 96 MiB block does not fit
    assert flat(pool.stats(), "reserved_bytes") == device.used_bytes == 104 * MiB  # the hole went back
    for p in (sep, c):
        pool.free(p)
    pool.validate()


def test_lazy_policy_keeps_the_cache_until_memory_runs_short_then_unmaps_holes():
    # 1 GiB device: the hole between two live blocks is cached until a request needs the memory.
    device = _C.SimulatedDevice("vmm", 1 * GiB, 2 * MiB)
    pool = _C.Pool(device, release="lazy", page_size=2 * MiB, stitch=False)  # the release mechanism alone
    keep = pool.allocate(300 * MiB)
    big = pool.allocate(400 * MiB)
    tail = pool.allocate(200 * MiB)
    pool.free(big)
    assert flat(pool.stats(), "reserved_bytes") >= 900 * MiB  # still cached
    # 500 MiB fits nowhere contiguous and the device has only ~124 MiB left: the hole's pages are
    # unmapped and mapped again at the end of the address range, instead of an OOM.
    x = pool.allocate(500 * MiB)
    assert flat(pool.stats(), "reserved_bytes") <= 1 * GiB
    assert pool.stats()["num_ooms"] == 0
    for p in (keep, tail, x):
        pool.free(p)
    pool.validate()


def test_a_refused_map_teaches_the_pool_the_devices_room_and_it_asks_again_when_that_binds():
    """Memory held outside the pool (another process, a library's cudaMalloc) leaves it less than the
    device's total. Once the device has refused a map, the pool keeps under what it then had, releasing
    its cached pages before it maps instead of being refused and emptying its whole cache every time;
    when the memory outside goes away, the pool asks the device again before the learned room makes it
    release anything, and grows, with no retry and no cached page given back."""
    device = _C.SimulatedDevice("vmm", 4 * GiB, 2 * MiB)
    device.held_elsewhere = 4 * GiB - 1 * GiB  # 1 GiB left to the pool
    pool = _C.Pool(device, release="lazy", page_size=2 * MiB, stitch=False)  # the release mechanism alone
    keep = pool.allocate(400 * MiB)
    hole = pool.allocate(300 * MiB)
    tail = pool.allocate(200 * MiB)
    pool.free(hole)
    # 400 MiB fit nowhere contiguous and the device has 124 MiB left: refused, then the fallback (the
    # whole cache back to the device, and a retry).
    a = pool.allocate(400 * MiB)
    assert pool.stats()["num_alloc_retries"] == 1
    pool.free(a)
    pool.free(keep)
    # 1000 MiB reserved, 200 MiB of it live. 500 MiB at the start of the range need 100 MiB more:
    # the pool knows it has 1 GiB, so it releases cached pages first, and is not refused.
    b = pool.allocate(500 * MiB)
    assert pool.stats()["num_alloc_retries"] == 1
    assert flat(pool.stats(), "reserved_bytes") <= 1 * GiB
    # The memory outside goes away: 2 GiB more than the learned room fit at once, the cache kept.
    released_before = pool.stats()["reserved_bytes"]["all"]["freed"]
    device.held_elsewhere = 0
    big = pool.allocate(2 * GiB)
    stats = pool.stats()
    assert stats["num_alloc_retries"] == 1 and stats["num_ooms"] == 0
    assert stats["reserved_bytes"]["all"]["freed"] == released_before  # nothing given back for it
    assert flat(stats, "reserved_bytes") > 2 * GiB
    for p in (tail, b, big):
        pool.free(p)
    pool.validate()
    assert pool.trim() > 0 and device.used_bytes == 0


def test_a_driver_error_while_asking_the_devices_room_keeps_the_room_known_before():
    """Learning the device's room is an optimisation: a device that cannot say how much is free (a
    driver error in cuMemGetInfo) must not turn an allocation that fits, or an out-of-memory, into
    another error."""
    device = _C.SimulatedDevice("vmm", 4 * GiB, 2 * MiB)
    device.held_elsewhere = 3 * GiB  # 1 GiB left to the pool
    pool = _C.Pool(device, release="lazy", page_size=2 * MiB, stitch=False)  # the release mechanism alone
    keep = pool.allocate(400 * MiB)
    hole = pool.allocate(300 * MiB)
    tail = pool.allocate(200 * MiB)
    pool.free(hole)
    a = pool.allocate(400 * MiB)  # refused: the room is learned, then the retry
    assert pool.stats()["num_alloc_retries"] == 1
    pool.free(a)
    pool.free(keep)
    device.set_fault_plan(fail_free_query=True)
    b = pool.allocate(500 * MiB)  # the learned room binds: asking fails, the room known before serves
    assert pool.stats()["num_alloc_retries"] == 1 and pool.stats()["num_ooms"] == 0
    with pytest.raises(_C.OutOfMemoryError, match="device free unknown"):
        pool.allocate(600 * MiB)  # more than the device has: an out-of-memory, not a driver error
    device.set_fault_plan()
    c = pool.allocate(8 * MiB)  # the pool works on after the out-of-memory, its accounting exact
    assert flat(pool.stats(), "active_bytes") == 708 * MiB
    for p in (tail, b, c):
        pool.free(p)
    pool.validate()
    assert pool.trim() > 0 and device.used_bytes == 0


def test_the_out_of_memory_message_says_how_much_of_the_device_is_held_outside_the_pool():
    """On a shared device the pool runs out before any cap: the message says what the device's other
    users hold (total - free - what the pool reserved), so the user knows the memory is not the pool's."""
    device = _C.SimulatedDevice("vmm", 4 * GiB, 2 * MiB)
    device.held_elsewhere = 3 * GiB
    pool = _C.Pool(device)
    keep = pool.allocate(512 * MiB)
    with pytest.raises(_C.OutOfMemoryError) as e:
        pool.allocate(768 * MiB)
    msg = str(e.value)
    assert "3.00 GiB of the device held outside gpumem" in msg, msg
    assert "512.00 MiB held by live tensors" in msg, msg
    device.held_elsewhere = 0  # nothing outside: nothing said
    with pytest.raises(_C.OutOfMemoryError) as e:
        pool.allocate(4 * GiB)
    assert "held outside gpumem" not in str(e.value), str(e.value)
    pool.free(keep)
    pool.validate()
    assert pool.trim() > 0 and device.used_bytes == 0


def test_an_out_of_memory_the_caller_may_still_serve_is_counted_by_the_caller():
    """allocate(count_oom=False) raises as before but leaves num_ooms alone (the bridge borrows from
    MemPool(use_on_oom=True) then, and PyTorch counts only allocations that finally fail); count_oom()
    counts it when the caller could not serve it either. The pool works on, its accounting exact."""
    device = _C.SimulatedDevice("vmm", GiB)
    pool = _C.Pool(device)
    keep = pool.allocate(100 * MiB)
    with pytest.raises(_C.OutOfMemoryError, match="tried to allocate 2.00 GiB"):
        pool.allocate(2 * GiB, count_oom=False)
    s = pool.stats()
    assert s["num_ooms"] == 0 and s["num_alloc_retries"] == 1
    pool.count_oom()
    assert pool.stats()["num_ooms"] == 1
    with pytest.raises(_C.OutOfMemoryError):
        pool.allocate(2 * GiB)
    assert pool.stats()["num_ooms"] == 2
    p = pool.allocate(200 * MiB, count_oom=False)
    pool.free(p)
    pool.free(keep)
    pool.validate()
    assert flat(pool.stats(), "active_bytes") == 0


def test_cap_is_enforced_and_a_cap_below_live_bytes_is_refused():
    pool = _C.Pool(_C.SimulatedDevice("segments", 4 * GiB), cap=512 * MiB)
    a = pool.allocate(300 * MiB)
    with pytest.raises(_C.OutOfMemoryError, match="cap 512.00 MiB"):
        pool.allocate(300 * MiB)
    with pytest.raises(ValueError, match="live tensors already hold"):
        pool.set_cap(100 * MiB)
    assert pool.cap == 512 * MiB
    pool.set_cap(0)
    b = pool.allocate(300 * MiB)
    pool.free(a)
    pool.free(b)
    pool.validate()


def test_oom_callback_runs_before_failing_and_can_free_memory():
    pool = _C.Pool(_C.SimulatedDevice("vmm", GiB))
    held = [pool.allocate(700 * MiB)]

    def release():
        while held:
            pool.free(held.pop())

    cid = pool.add_oom_callback(release)
    p = pool.allocate(700 * MiB)  # fits only after the callback freed the first block
    assert not held
    pool.free(p)
    pool.remove_oom_callback(cid)
    assert pool.stats()["num_ooms"] == 0
    pool.validate()


def test_stats_peaks_reset_and_shape_matches_torch():
    pool = _C.Pool(_C.SimulatedDevice("vmm", GiB))
    p = pool.allocate(10 * MiB)
    pool.free(p)
    s = pool.stats()
    assert flat(s, "allocated_bytes", "peak") == 10 * MiB
    assert flat(s, "allocated_bytes", "allocated") == 10 * MiB == flat(s, "allocated_bytes", "freed")
    pool.reset_peak_stats()
    assert flat(pool.stats(), "allocated_bytes", "peak") == 0
    expected = {"allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
                "active_bytes", "inactive_split_bytes", "requested_bytes", "num_alloc_retries", "num_ooms",
                "num_sync_all_streams", "num_device_alloc", "num_device_free", "oversize_allocations",
                "oversize_segments", "max_split_size"}
    assert set(s) == expected


def test_snapshot_lists_regions_and_blocks():
    pool = _C.Pool(_C.SimulatedDevice("vmm", GiB))
    p = pool.allocate(3 * MiB)
    snap = pool.snapshot()
    blocks = [b for r in snap for b in r["blocks"] if b["state"] == "active_allocated"]
    assert [b["address"] for b in blocks] == [p]
    assert blocks[0]["requested_size"] == 3 * MiB
    assert all(r["total_size"] >= r["reserved_size"] > 0 for r in snap)
    pool.free(p)


def test_pool_is_thread_safe():
    device = _C.SimulatedDevice("vmm", 8 * GiB)
    pool = _C.Pool(device)

    def work(seed):
        rng = random.Random(seed)
        mine = []
        for _ in range(3000):
            if mine and rng.random() < 0.5:
                pool.free(mine.pop(rng.randrange(len(mine))))
            else:
                mine.append(pool.allocate(rng.randint(1, 4 * MiB), seed % 3))
        for p in mine:
            pool.free(p)

    run_threads(work)
    pool.validate()
    assert flat(pool.stats(), "allocated_bytes") == 0


def test_bad_constructor_arguments_are_clear():
    with pytest.raises(ValueError, match="page_size"):
        _C.SimulatedDevice("vmm", GiB, 1000)
    with pytest.raises(ValueError, match="'vmm' or 'segments'"):
        _C.SimulatedDevice("paged", GiB)
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        _C.SimulatedDevice("vmm", -5)
    with pytest.raises(ValueError, match="release must be 'lazy' or 'high_water'"):
        _C.Pool(_C.SimulatedDevice("vmm", GiB), release="sometimes")
