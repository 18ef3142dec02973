"""Under a cap or a limit the pool makes room by releasing cached pages, the large arenas' before the
small ones' (pool_release.cpp, release_cached_units), whatever order the arenas were made in: a small
arena's free pages are what small requests soon need again, and a large block cannot be lent them
(another region), so it would wait for them to drain. These tests check the order and docs/benchmarks.md's
figures for allocfree's requests at tight limits."""
import re

import pytest

from gpumem import _C
from gpumem.replay import replay
from pool_model import GiB, MiB, ROOT, allocfree_trace


def reserved(pool, which):
    return pool.stats()["reserved_bytes"][which]["current"]


@pytest.mark.parametrize("kind", ["vmm", "segments"])
def test_room_is_made_from_the_large_arenas_before_the_small_one_made_first(kind):
    """The small arena is made first and caches 4 MiB, the large one caches 16 MiB; at a limit of what
    is reserved, 16 MiB on another stream (a new arena) must come from released pages: all of them
    from the large arena, and the small arena keeps its pages."""
    pool = _C.Pool(_C.SimulatedDevice(kind, 1 * GiB))
    smalls = [pool.allocate(MiB) for _ in range(4)]
    large = pool.allocate(16 * MiB)
    for address in smalls + [large]:
        pool.free(address)
    small_cached = reserved(pool, "small_pool")
    assert small_cached >= 4 * MiB
    pool.set_limit(reserved(pool, "all"))
    other = pool.allocate(16 * MiB, stream=1)
    assert reserved(pool, "small_pool") == small_cached
    assert reserved(pool, "all") <= small_cached + 16 * MiB
    pool.validate()
    pool.free(other)
    again = [pool.allocate(MiB) for _ in range(4)]  # the small requests find their pages still there
    assert reserved(pool, "small_pool") == small_cached
    for address in again:
        pool.free(address)
    pool.set_limit(None)
    pool.trim()
    assert reserved(pool, "all") == 0
    pool.validate()


def test_small_pages_go_back_once_the_large_arenas_have_none():
    """The order is a preference, not a fence: when the large arenas have no whole free page left,
    room comes from the small arena's."""
    pool = _C.Pool(_C.SimulatedDevice("vmm", 1 * GiB))
    smalls = [pool.allocate(MiB) for _ in range(4)]
    large = pool.allocate(16 * MiB)
    for address in smalls:
        pool.free(address)
    pool.set_limit(reserved(pool, "all"))
    other = pool.allocate(4 * MiB, stream=1)
    assert reserved(pool, "small_pool") == 0
    assert reserved(pool, "large_pool") == 20 * MiB
    pool.validate()
    for address in (large, other):
        pool.free(address)


# allocfree's seven seeds (tests/pool_model.py, allocfree_trace), three passes each in one pool at a
# limit of F x the peak live bytes, the device 100 operations behind: units created + released, waits
# and OOMs summed over the seeds (the last pass's). docs/benchmarks.md's "Release order" paragraph quotes
# them.
RELEASE_ORDER_AT_LIMIT = {1.01: (372, 27, 0), 1.02: (837, 34, 0), 1.03: (25, 4, 0)}


def test_allocfree_at_tight_limits_are_the_records(tmp_path):
    traces = [allocfree_trace(tmp_path, seed) for seed in range(7)]
    peaks = [replay(t).peak_live_bytes for t in traces]
    record = (ROOT / "docs" / "benchmarks.md").read_text()
    for factor, expected in RELEASE_ORDER_AT_LIMIT.items():
        runs = [replay(t, passes=3, limit=int(factor * p), device_lag=100) for t, p in zip(traces, peaks)]
        found = (sum(r.physical_units for r in runs), sum(r.waits for r in runs), sum(r.ooms for r in runs))
        assert found == expected, f"at {factor}x"
        units, waits, ooms = expected
        assert re.search(rf"at {factor:.2f}x [^|]*\*\*{units:,} / {waits} / {ooms}\*\*", record), \
            f"docs/benchmarks.md: 'Release order' does not quote {expected} at {factor:.2f}x"
