"""The pool on the simulated device: a randomized test against a reference model, with the invariant
checker after every operation, and every kind of bad input."""
import random
import sys

import pytest

from gpumem import _C

MiB = 1 << 20
GiB = 1 << 30


def flat(stats, key, which="current"):
    return stats[key]["all"][which]


class Model:
    """What a correct pool must agree with: live blocks, their sizes, nothing overlapping."""

    def __init__(self, pool, device):
        self.pool, self.device = pool, device
        self.live = {}  # address -> (requested, stream)

    def check(self):
        self.pool.validate()
        s = self.pool.stats()
        assert flat(s, "allocation") == len(self.live)
        assert flat(s, "requested_bytes") == sum(r for r, _ in self.live.values())
        rounded = sum(-(-r // 512) * 512 for r, _ in self.live.values())
        assert flat(s, "allocated_bytes") == rounded
        # Every byte the device handed out is accounted as reserved: nothing leaks.
        assert self.device.used_bytes == flat(s, "reserved_bytes")
        cap = self.pool.cap
        if cap:
            assert flat(s, "reserved_bytes") <= cap or flat(s, "active_bytes") > 0
        spans = sorted((a, -(-r // 512) * 512) for a, (r, _) in self.live.items())
        for (a, n), (b, _) in zip(spans, spans[1:]):
            assert a + n <= b, "live blocks overlap"
        for a, _ in spans:
            assert a % 512 == 0


def random_size(rng):
    kind = rng.random()
    if kind < 0.5:
        return rng.randint(1, 1 * MiB)  # small pool
    if kind < 0.9:
        return rng.randint(1 * MiB + 1, 64 * MiB)
    return rng.randint(64 * MiB, 600 * MiB)


@pytest.mark.parametrize("kind", ["vmm", "segments"])
@pytest.mark.parametrize("release", ["high_water", "lazy"])
@pytest.mark.parametrize("seed", [1, 2])
def test_randomized_operations_keep_every_invariant(kind, release, seed):
    rng = random.Random(seed)
    device = _C.SimulatedDevice(kind, 4 * GiB)
    device.set_auto_complete(False)
    pool = _C.Pool(device, release=release)
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


def test_vmm_returns_free_pages_in_the_middle():
    device = _C.SimulatedDevice("vmm", 4 * GiB, 2 * MiB)
    pool = _C.Pool(device, release="lazy", page_size=2 * MiB)
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


def test_lazy_policy_keeps_the_cache_until_memory_runs_short_then_unmaps_holes():
    # 1 GiB device: the hole between two live blocks is cached until a request needs the memory.
    device = _C.SimulatedDevice("vmm", 1 * GiB, 2 * MiB)
    pool = _C.Pool(device, release="lazy", page_size=2 * MiB)
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
    import threading

    device = _C.SimulatedDevice("vmm", 8 * GiB)
    pool = _C.Pool(device)
    errors = []

    def work(seed):
        rng = random.Random(seed)
        mine = []
        try:
            for _ in range(3000):
                if mine and rng.random() < 0.5:
                    pool.free(mine.pop(rng.randrange(len(mine))))
                else:
                    mine.append(pool.allocate(rng.randint(1, 4 * MiB), seed % 3))
            for p in mine:
                pool.free(p)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
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


def _round(n):
    return -(-n // 512) * 512


@pytest.mark.parametrize("kind", ["vmm", "segments"])
@pytest.mark.parametrize("release", ["high_water", "lazy"])
@pytest.mark.parametrize("seed", [3, 4])
def test_randomized_allocate_at_free_and_limits_keep_every_invariant(kind, release, seed):
    """allocate / free / allocate_at (at freed addresses and at random addresses in regions) / set_limit,
    with validate() and a model of live blocks checked after every operation."""
    rng = random.Random(seed)
    device = _C.SimulatedDevice(kind, 2 * GiB)
    pool = _C.Pool(device, release=release)
    m = Model(pool, device)
    recently_freed = []  # (address, requested size), the last 16 frees
    counts = {"at_ok": 0, "at_freed_ok": 0, "at_refused": 0, "at_oom": 0, "oom": 0}

    def overlaps_live(address, size):
        return any(a < address + size and address < a + _round(r) for a, (r, _) in m.live.items())

    def live_fingerprint():
        s = pool.stats()
        figures = [s[k]["all"][w] for k in ("allocation", "active", "allocated_bytes", "active_bytes",
                                            "requested_bytes") for w in ("current", "peak", "allocated", "freed")]
        return figures, sorted(m.live)

    def allocate_at(address, size, expect_free):
        before = live_fingerprint()
        try:
            assert pool.allocate_at(address, size) == address
        except ValueError as e:
            counts["at_refused"] += 1
            msg = str(e)
            assert "nothing was changed" in msg
            # Only a segment given back to the device makes a freed address leave every region; a
            # range free of live blocks may still run past its region's end (a freed block enlarged).
            vanished = kind == "segments" and "outside every region" in msg
            past_end = "runs past the end" in msg
            if expect_free:
                assert vanished or past_end, msg
            else:
                assert vanished or past_end or "overlaps the live block" in msg, msg
            assert live_fingerprint() == before
            return False
        except _C.OutOfMemoryError as e:
            counts["at_oom"] += 1
            assert expect_free and kind == "vmm", str(e)  # only pages to map can fail
            assert "tried to allocate" in str(e) and "at 0x" in str(e)
            assert live_fingerprint() == before
            return False
        assert expect_free, f"allocate_at({address:#x}, {size}) over a live block succeeded"
        m.live[address] = (size, None)
        return True

    for step in range(1500):
        op = rng.random()
        if op < 0.35:
            size = random_size(rng) if rng.random() < 0.7 else rng.randint(1, 64 * 1024)
            try:
                ptr = pool.allocate(size, rng.choice([0, 7]))
            except _C.OutOfMemoryError:
                counts["oom"] += 1
            else:
                assert ptr not in m.live
                m.live[ptr] = (size, None)
        elif op < 0.6 and m.live:
            ptr = rng.choice(list(m.live))
            size, _ = m.live.pop(ptr)
            pool.free(ptr)
            recently_freed.append((ptr, size))
            del recently_freed[:-16]
        elif op < 0.8 and recently_freed:
            ptr, size = rng.choice(recently_freed)
            if rng.random() < 0.3:
                size = rng.randint(1, 2 * size)  # the same start, another size
            if allocate_at(ptr, size, not overlaps_live(ptr, _round(size))):
                counts["at_freed_ok"] += 1
        elif op < 0.9:
            regions = pool.snapshot()
            if regions:
                r = rng.choice(regions)
                address = r["address"] + rng.randrange(0, max(1, r["total_size"] // 512)) * 512
                size = rng.randint(1, min(8 * MiB, r["address"] + r["total_size"] - address))
                # Free exactly when the range lies inside one inactive block of the snapshot.
                expect_free = any(b["state"] == "inactive" and b["address"] <= address and
                                  address + _round(size) <= b["address"] + b["size"] for b in r["blocks"])
                assert expect_free == (not overlaps_live(address, _round(size)))
                if allocate_at(address, size, expect_free):
                    counts["at_ok"] += 1
        elif op < 0.95:
            reserved = pool.reserved_bytes
            limit = rng.choice([None, None, 0, rng.randint(0, 2 * reserved + 1), reserved + rng.randint(0, GiB)])
            pool.set_limit(limit)
            assert pool.limit == limit
            assert pool.effective_cap == min(device.total_bytes, GiB * 2 if limit is None else limit)
            if limit is not None and pool.reserved_bytes > limit:
                assert pool.reserved_bytes <= reserved  # released what it could
            if limit == 0:
                with pytest.raises(_C.OutOfMemoryError, match="limit 0 B"):
                    pool.allocate(1)
        else:
            pool.trim()
        m.check()
        assert pool.allocated_bytes == flat(pool.stats(), "allocated_bytes")
        assert pool.reserved_bytes == flat(pool.stats(), "reserved_bytes")
        for ptr, (size, _) in m.live.items():
            assert pool.allocation_size(ptr) == _round(size)
        for ptr, _ in recently_freed:
            if ptr not in m.live:
                assert pool.allocation_size(ptr) == 0 and pool.live_block(ptr) is None
    pool.set_limit(None)
    for ptr in list(m.live):
        assert pool.try_free(ptr)
        assert not pool.try_free(ptr)
    m.live.clear()
    pool.trim()
    m.check()
    assert device.used_bytes == 0
    assert counts["at_freed_ok"] > 20 and counts["at_ok"] > 10 and counts["at_refused"] > 10, counts


def test_allocate_at_round_trip_and_refusals_through_the_binding():
    device = _C.SimulatedDevice("vmm", 4 * GiB)
    pool = _C.Pool(device, release="lazy")
    blocks = [(pool.allocate(size), size) for size in (1000, 3 * MiB, 200 * 1024, 40 * MiB, 512)]
    before = pool.stats()
    for ptr, _ in blocks:
        pool.free(ptr)
    for ptr, size in reversed(blocks):
        assert pool.allocate_at(ptr, size) == ptr
        assert pool.live_block(ptr) == {"address": ptr, "size": _round(size), "requested_size": size,
                                        "state": "active_allocated"}
    after = pool.stats()
    for key in ("allocation", "allocated_bytes", "requested_bytes", "active_bytes", "reserved_bytes", "segment"):
        assert flat(after, key) == flat(before, key)
    pool.validate()
    ptr = blocks[1][0]
    with pytest.raises(ValueError, match="overlaps the live block"):
        pool.allocate_at(ptr + 512, 512)
    with pytest.raises(ValueError, match="not a multiple of 512"):
        pool.allocate_at(ptr + 1, 512)
    with pytest.raises(ValueError, match="outside every region"):
        pool.allocate_at(0xDEAD000, 512)
    with pytest.raises(ValueError, match="must be positive"):
        pool.allocate_at(ptr, 0)
    with pytest.raises(ValueError, match=">= 0"):
        pool.allocate_at(ptr, -1)
    assert pool.try_free(ptr) and not pool.try_free(ptr) and not pool.try_free(0xDEAD000)
    assert pool.live_block(ptr) is None
    pool.validate()


def test_limit_is_separate_from_the_cap_and_accepts_anything():
    device = _C.SimulatedDevice("segments", 4 * GiB)
    pool = _C.Pool(device, cap=GiB)
    assert pool.limit is None and pool.effective_cap == GiB
    a = pool.allocate(100 * MiB)
    pool.set_limit(0)  # below live: accepted, unlike set_cap
    assert pool.limit == 0 and pool.effective_cap == 0 and pool.cap == GiB
    with pytest.raises(_C.OutOfMemoryError, match="limit 0 B"):
        pool.allocate(512)
    pool.set_limit(512 * MiB)
    assert pool.effective_cap == 512 * MiB
    with pytest.raises(_C.OutOfMemoryError):
        pool.allocate(450 * MiB)
    pool.set_limit(None)
    b = pool.allocate(450 * MiB)
    with pytest.raises(ValueError):
        pool.set_limit(-1)
    with pytest.raises(TypeError):
        pool.set_limit(0.5)
    pool.free(a)
    pool.free(b)
    pool.validate()


@pytest.mark.parametrize("kind", ["vmm", "segments"])
def test_segment_observer_reports_every_change_of_reserved(kind, monkeypatch):
    device = _C.SimulatedDevice(kind, 2 * GiB)
    pool = _C.Pool(device, release="lazy")
    events = []
    pool.set_segment_observer(lambda *e: events.append(e))
    rng = random.Random(5)
    live = []
    net = 0
    for _ in range(400):
        op = rng.random()
        try:
            if op < 0.5 or not live:
                live.append(pool.allocate(rng.randint(1, 80 * MiB), rng.choice([0, 3])))
            elif op < 0.85:
                pool.free(live.pop(rng.randrange(len(live))))
            elif op < 0.92:
                pool.trim()
            else:
                pool.set_limit(rng.choice([None, rng.randint(0, GiB)]))
        except _C.OutOfMemoryError:
            pass
        for name, address, size, stream in events:
            assert name in (("map", "unmap") if kind == "vmm" else ("segment_alloc", "segment_free"))
            assert address > 0 and size > 0 and stream in (0, 3)
            net += size if name in ("map", "segment_alloc") else -size
        events.clear()
        assert net == pool.reserved_bytes == device.used_bytes
    # An observer that calls back into the pool gets a RuntimeError (reported as unraisable), not a
    # deadlock; one that raises leaves the pool consistent.
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    pool.set_segment_observer(lambda *e: pool.stats())
    pool.set_limit(None)
    for p in live:
        pool.free(p)
    live = [pool.allocate(300 * MiB)]
    assert seen and isinstance(seen[0], RuntimeError) and "must not call into a pool" in str(seen[0])
    pool.set_segment_observer(None)
    pool.free(live.pop())
    pool.trim()
    assert not events and pool.reserved_bytes == device.used_bytes == 0
    pool.validate()


def test_segment_observer_with_threads_does_not_deadlock():
    import threading

    device = _C.SimulatedDevice("vmm", 8 * GiB, 2 * MiB)
    pool = _C.Pool(device, release="high_water", page_size=2 * MiB)
    lock = threading.Lock()
    totals = {"map": 0, "unmap": 0}

    def observer(name, address, size, stream):
        with lock:
            totals[name] += size

    pool.set_segment_observer(observer)
    errors = []

    def work(seed):
        rng = random.Random(seed)
        mine = []
        try:
            for _ in range(1500):
                r = rng.random()
                if mine and r < 0.45:
                    pool.free(mine.pop(rng.randrange(len(mine))))
                elif r < 0.5:
                    pool.trim()
                elif r < 0.55:
                    pool.stats()
                else:
                    mine.append(pool.allocate(rng.randint(1, 16 * MiB), seed % 2))
            for p in mine:
                pool.free(p)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "deadlock between the observer and the pool's lock"
    assert not errors
    pool.set_segment_observer(None)
    pool.validate()
    assert totals["map"] - totals["unmap"] == pool.reserved_bytes == device.used_bytes
