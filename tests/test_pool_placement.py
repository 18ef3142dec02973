"""The pool on the simulated device, continued: allocate_at (placing a block at a given address, for
CUDA-graph checkpoints), try_free, the limit beside the cap, and the segment observer; a randomized
test against the reference model of tests/pool_model.py with the invariant checker after every
operation."""
import random
import sys

import pytest

from gpumem import _C
from pool_model import GiB, MiB, Model, flat, random_size, run_threads


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
                free = [b for b in r["blocks"] if b["state"] == "inactive"]
                lo, n = (r["address"], r["total_size"])
                if free and rng.random() < 0.5:  # inside a free block: mostly succeeds
                    b = rng.choice(free)
                    lo, n = b["address"], b["size"]
                address = lo + rng.randrange(0, max(1, n // 512)) * 512
                size = rng.randint(1, min(8 * MiB, lo + n - address))
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
            if name.startswith("span_"):  # snapshot()'s entries: test_segment_observer_spans_*
                continue
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
    totals = {"map": 0, "unmap": 0, "span_added": 0, "span_removed": 0}

    def observer(name, address, size, stream):
        with lock:
            totals[name] += size

    pool.set_segment_observer(observer)

    def work(seed):
        rng = random.Random(seed)
        mine = []
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

    run_threads(work, hang="deadlock between the observer and the pool's lock")
    pool.set_segment_observer(None)
    pool.validate()
    assert totals["map"] - totals["unmap"] == pool.reserved_bytes == device.used_bytes


@pytest.mark.parametrize("kind", ["vmm", "segments"])
def test_segment_observer_spans_are_the_snapshot_and_go_before_their_memory(kind):
    # What NCCL registers (through the torch bridge's trace trackers): span_added / span_removed keep
    # a set equal to snapshot()'s regions, and a span goes before any of its memory is unmapped.
    device = _C.SimulatedDevice(kind, 2 * GiB)
    pool = _C.Pool(device, release="high_water")
    spans = {}
    problems = []

    def observer(name, address, size, stream):
        overlapping = [a for a, n in spans.items() if a < address + size and address < a + n]
        if name == "span_added":
            if overlapping:
                problems.append(("added over a span", address, size))
            spans[address] = size
        elif name == "span_removed":
            if spans.pop(address, None) != size:
                problems.append(("removed what was not added", address, size))
        elif name in ("unmap", "segment_free") and overlapping:
            problems.append((name + " under a span", address, size))

    pool.set_segment_observer(observer)
    rng = random.Random(9)
    live = []
    for _ in range(300):
        op = rng.random()
        try:
            if op < 0.4 or not live:
                live.append(pool.allocate(rng.randint(1, 60 * MiB), rng.choice([0, 3])))
            elif op < 0.85:
                pool.free(live.pop(rng.randrange(len(live))))
            else:
                pool.trim()
        except _C.OutOfMemoryError:
            pass
        assert not problems
        assert spans == {r["address"]: r["total_size"] for r in pool.snapshot()}
    for p in live:
        pool.free(p)
    pool.trim()
    assert spans == {} and pool.reserved_bytes == 0


@pytest.mark.parametrize("ends_by_page", [False, True])
@pytest.mark.parametrize("release", ["lazy", "high_water"])
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_randomized_near_the_cap_single_pages_keep_every_invariant(release, seed, ends_by_page):
    """A large arena with 8 MiB groups of 2 MiB pages under a tight cap: blocks of 1-40 MiB allocated
    and freed at random on two streams, trims and cap changes, with validate() and the model after
    every operation. Near the cap the pool maps single pages (seen as large-pool reserved bytes that
    are not whole groups); the simulated device refuses any unmap of part of a physical allocation,
    so every release must give back whole units; at the end the device is empty. With the option
    ends_by_page the blocks' end groups go page by page as well."""
    rng = random.Random(seed)
    device = _C.SimulatedDevice("vmm", 1 * GiB)
    pool = _C.Pool(device, release=release, page_size=8 * MiB, cap=200 * MiB, ends_by_page=ends_by_page)
    m = Model(pool, device)
    single_pages_seen = ooms = 0
    for step in range(1500):
        op = rng.random()
        if op < 0.55 or not m.live:
            size = rng.randint(1, 40 * MiB) if rng.random() < 0.8 else rng.randint(1, 1 * MiB)
            stream = rng.choice([0, 0, 0, 7])
            try:
                m.live[pool.allocate(size, stream)] = (size, stream)
            except _C.OutOfMemoryError:
                ooms += 1
        elif op < 0.97:
            address = rng.choice(list(m.live))
            pool.free(address)
            del m.live[address]
        elif op < 0.985:
            pool.trim()
        else:
            live = flat(pool.stats(), "active_bytes")
            pool.set_cap(max(live + 2 * MiB, rng.randint(150, 260) * MiB))
        m.check()
        large = pool.stats()["reserved_bytes"]["large_pool"]["current"]
        single_pages_seen += large % (8 * MiB) != 0
    assert single_pages_seen > 0, "no single page was ever mapped near the cap"
    assert ooms > 0, "the cap never bound: the test did not test the tight case"
    for address in list(m.live):
        pool.free(address)
    m.live.clear()
    pool.trim()
    m.check()
    assert device.used_bytes == 0


@pytest.mark.parametrize("option", [False, True])
@pytest.mark.parametrize("bound", [None, "limit", "cap"])
def test_ends_by_page_under_a_bound_a_blocks_ends_go_page_by_page(bound, option):
    """Two 9 MiB blocks side by side in a large arena (8 MiB groups of 2 MiB pages): the first covers
    group 0 and touches one page of group 1, which it shares with the second. With the option
    ends_by_page and under a cap or a limit that is not roomy, group 1 is mapped page by page, so once
    the second block is freed its pages there go back to the device and the first block pins 10 MiB;
    otherwise (no bound, or the option off) whole groups are mapped (a quarter of the driver's units)
    and the first block pins 16 MiB."""
    device = _C.SimulatedDevice("vmm", 1 * GiB)
    pool = _C.Pool(device, page_size=8 * MiB, cap=64 * MiB if bound == "cap" else 0, ends_by_page=option)
    if bound == "limit":
        pool.set_limit(64 * MiB)
    _two_blocks_the_second_freed(pool, device, by_page=option and bound is not None)


def _two_blocks_the_second_freed(pool, device, by_page):
    """Two 9 MiB blocks side by side, the second freed and the cache trimmed: group 1 (shared) went page
    by page or not, the first block pins 10 or 16 MiB; then nothing is left."""
    a = pool.allocate(9 * MiB)
    b = pool.allocate(9 * MiB)
    assert b == a + 9 * MiB
    unit = device.physical_unit_at  # (physical allocation, offset in it)
    assert unit(a)[0] == unit(a + 6 * MiB)[0]  # group 0, covered whole: one group unit either way
    assert (unit(a + 8 * MiB)[0] != unit(a + 10 * MiB)[0]) == by_page
    pool.free(b)
    pool.trim()
    assert pool.reserved_bytes == (10 * MiB if by_page else 16 * MiB)
    pool.free(a)
    pool.trim()
    pool.validate()
    assert pool.reserved_bytes == 0 and device.used_bytes == 0


@pytest.mark.parametrize("early, bound_mib, by_page", [
    (0.1, 256, True),    # live high water 9 MiB, then 18 MiB: below 10% of the bound, ends by page
    (0.0, 256, False),   # the option off
    (0.1, 64, False),    # 9 MiB is above 10% of the bound: whole groups
    (0.5, 64, True),     # ... below half of it
])
def test_early_ends_by_page_the_first_blocks_ends_go_page_by_page(early, bound_mib, by_page):
    """early_ends_by_page (0.1 by default): under a limit, blocks mapped while the live high water is
    below that fraction of the bound map their end groups page by page, as ends_by_page does for every
    block: the two 9 MiB blocks above, under limits of 256 and 64 MiB."""
    device = _C.SimulatedDevice("vmm", 1 * GiB)
    pool = _C.Pool(device, page_size=8 * MiB, early_ends_by_page=early)
    pool.set_limit(bound_mib * MiB)
    _two_blocks_the_second_freed(pool, device, by_page)


def test_early_ends_by_page_is_refused_outside_0_1():
    device = _C.SimulatedDevice("vmm", 1 * GiB)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="early_ends_by_page must be in"):
            _C.Pool(device, early_ends_by_page=bad)


@pytest.mark.parametrize("option, fits", [(False, False), (True, True)])
def test_a_recorded_ddp_step_at_a_limit_of_1_01x_its_peak_live_bytes(option, fits):
    """bench/traces/ddp_mlp: the last rank's step of tests/gpu/dist_batch_size.py's uneven DDP run (a
    29 M-parameter MLP with AdamW, 124 MiB activations), device 100 operations behind. Mapping whole
    8 MiB groups at the blocks' ends, it needs 1.0183x its peak live bytes under a limit; with
    ends_by_page 1.0056x."""
    from pathlib import Path

    import gpumem

    trace = Path(__file__).resolve().parents[1] / "bench" / "traces" / "ddp_mlp.trace.gz"
    peak = gpumem.replay(trace).peak_live_bytes
    at_limit = gpumem.replay(trace, limit=int(1.01 * peak), device_lag=100, ends_by_page=option)
    assert (at_limit.ooms == 0) == fits, at_limit.first_oom
    assert at_limit.peak_reserved_bytes <= int(1.01 * peak)
