"""The pool's stitch option (GPUMEM_CONF stitch:true, core/pool_alias.cpp) on the simulated device:
new pages past the live high water backed by free blocks' units, their old positions parked and
handed back without a driver call, unmapped where their unit is in use, and all of it given back.
The randomized test with the invariant checker runs with the option too (tests/test_pool.py)."""
import gzip
import random
from pathlib import Path

import pytest

import gpumem
from gpumem import _C
from pool_model import GiB, MiB, flat, hole_then_larger

ROOT = Path(__file__).resolve().parents[1]


def _pool(stitch):
    device = _C.SimulatedDevice("vmm", 8 * GiB)
    return device, _C.Pool(device, stitch=stitch)


def _reserved(pool):
    return flat(pool.stats(), "reserved_bytes")


def _hole_then_larger(stitch):
    """64 MiB freed between live blocks, then a 96 MiB block that does not fit in the hole."""
    device, pool = _pool(stitch)
    return (device, pool, *hole_then_larger(pool))


def test_a_block_past_the_high_water_is_backed_by_the_free_hole_not_new_memory():
    device, pool, a, sep, c = _hole_then_larger(stitch=False)
    assert _reserved(pool) == device.used_bytes == 168 * MiB  # the hole stays cached, 96 MiB new
    device, pool, a, sep, c = _hole_then_larger(stitch=True)
    # The hole's eight 8 MiB units back the block's first 64 MiB: reserved is what is live.
    assert _reserved(pool) == device.used_bytes == 104 * MiB
    assert device.aliased_units == 8
    assert {device.physical_unit_at(c + i * 8 * MiB)[0] for i in range(8)} == \
        {device.physical_unit_at(a + i * 8 * MiB)[0] for i in range(8)}
    assert pool.largest_free_block() == 0  # the hole is parked: no memory of its own


def test_a_block_back_in_the_hole_takes_its_units_back_without_a_driver_call():
    """The hole's units back c; c freed, a block in the hole takes them back (no map, no unmap), and a
    block where c was finds them in use: its parked pages are unmapped and backed anew."""
    device, pool, a, sep, c = _hole_then_larger(stitch=True)
    maps, unmaps, used = device.unit_maps, device.unit_unmaps, device.used_bytes
    units_under_c = [device.physical_unit_at(c + i * 8 * MiB) for i in range(8)]
    pool.free(c)
    # allocate_at, as a CUDA-graph checkpoint restore does; allocate() would take the mapped free
    # block where c was (Pool::fewest_unmapped_fit counts parked pages as unmapped).
    again = pool.allocate_at(a, 64 * MiB)
    pool.validate()
    assert (device.unit_maps, device.unit_unmaps, device.used_bytes) == (maps, unmaps, used)
    assert _reserved(pool) == 104 * MiB
    assert [device.physical_unit_at(again + i * 8 * MiB) for i in range(8)] == units_under_c
    # Where the 96 MiB block was, its first 64 MiB are parked now, on units the live block holds: a
    # block there needs them unmapped and new memory (no unit backs two live blocks).
    c2 = pool.allocate(96 * MiB)
    pool.validate()
    assert c2 == c
    assert device.unit_unmaps == unmaps + 8
    assert _reserved(pool) == device.used_bytes == 168 * MiB
    units = {device.physical_unit_at(p) for p in range(c2, c2 + 96 * MiB, 2 * MiB)}
    assert not units & {device.physical_unit_at(p) for p in range(a, a + 64 * MiB, 2 * MiB)}


def test_everything_goes_back_to_the_device_with_parked_positions():
    device, pool, a, sep, c = _hole_then_larger(stitch=True)
    pool.free(c)
    pool.free(sep)
    assert pool.trim() > 0
    pool.validate()
    assert _reserved(pool) == device.used_bytes == 0  # the parked mappings went with their owners
    device, pool, a, sep, c = _hole_then_larger(stitch=True)
    del pool  # with blocks live and positions parked: the destructor unmaps every mapping
    assert device.used_bytes == 0


def test_after_trim_a_phase_below_the_old_peak_stitches_again():
    """trim() (empty_cache) starts the live high water again from the live bytes: a phase after it
    that stays below the phase before's peak still stitches (Pool::forget_high_water). Kept, the old
    peak would let the new phase map fresh pages up to it first (here 168 MiB reserved for 104 live;
    the GPU stitch test's training after its tensors: reserved 1.18x allocated)."""
    device, pool = _pool(stitch=True)
    pool.free(pool.allocate(512 * MiB))  # the phase before, higher than everything after it
    assert pool.trim() == 512 * MiB
    _, sep, c = hole_then_larger(pool)
    # The hole's units back c, as in a fresh pool (test_a_block_past_the_high_water_...).
    assert _reserved(pool) == device.used_bytes == 104 * MiB
    assert device.aliased_units == 8
    pool.free(c)
    pool.free(sep)
    assert pool.trim() == 104 * MiB
    pool.validate()


@pytest.mark.parametrize("bound", ["cap", "limit"])
def test_a_pool_under_a_cap_or_a_limit_does_not_stitch(bound):
    """Under a bound the pool releases cached pages to fit anyway, and stitching fitted less there
    (docs/benchmarks.md, "Stitching under a bound"): the hole stays cached and the block gets new memory."""
    device = _C.SimulatedDevice("vmm", 8 * GiB)
    pool = _C.Pool(device, stitch=True, cap=GiB if bound == "cap" else 0)
    if bound == "limit":
        pool.set_limit(GiB)
    hole_then_larger(pool)
    assert _reserved(pool) == device.used_bytes == 168 * MiB
    assert device.aliased_units == 0
    if bound == "limit":  # lifted: the next block past the high water is stitched from the hole
        pool.set_limit(None)
        pool.allocate(80 * MiB)
        pool.validate()
        assert device.aliased_units == 8


def test_positions_parked_before_a_limit_was_set_are_taken_back_or_unmapped_as_before():
    device, pool, a, sep, c = _hole_then_larger(stitch=True)
    pool.set_limit(GiB)
    maps, unmaps = device.unit_maps, device.unit_unmaps
    pool.free(c)
    again = pool.allocate_at(a, 64 * MiB)  # the hole takes its units back: no driver call
    pool.validate()
    assert (device.unit_maps, device.unit_unmaps) == (maps, unmaps)
    c2 = pool.allocate(96 * MiB)  # where c was, parked on the hole's units: unmapped, new memory
    pool.validate()
    assert c2 == c and device.unit_unmaps == unmaps + 8
    units = {device.physical_unit_at(p) for p in range(c2, c2 + 96 * MiB, 2 * MiB)}
    assert not units & {device.physical_unit_at(p) for p in range(again, again + 64 * MiB, 2 * MiB)}
    assert _reserved(pool) == device.used_bytes == 168 * MiB
    for block in (again, sep, c2):
        pool.free(block)
    pool.trim()
    pool.validate()
    assert _reserved(pool) == device.used_bytes == 0


def test_a_limited_replay_is_the_same_with_and_without_the_option():
    trace = ROOT / "bench" / "traces" / "bert.trace.gz"
    live = gpumem.replay(trace).peak_live_bytes
    reports = [gpumem.replay(trace, device_lag=100, limit=int(1.011 * live), stitch=s) for s in (False, True)]
    assert reports[0].ooms == reports[1].ooms == 0
    assert reports[0].upstream_calls == reports[1].upstream_calls
    assert reports[0].peak_reserved_bytes == reports[1].peak_reserved_bytes


def test_the_option_reaches_the_pool_from_the_configuration_string():
    assert gpumem.parse_config("stitch:false")["stitch"] is False
    assert gpumem.parse_config("")["stitch"] is True  # the default
    with pytest.raises(ValueError, match="stitch='often' is not valid; accepted: true, false"):
        gpumem.parse_config("stitch:often")


@pytest.mark.parametrize("slack, reserved_mib, aliased", [(0.6, 104, 8), (0.62, 168, 0), (1.0, 168, 0)])
def test_new_memory_up_to_the_slack_above_the_live_high_water_then_stitched(slack, reserved_mib, aliased):
    """The 96 MiB block takes the live bytes to 104 MiB; mapping it whole would reserve 168 MiB, 61.5%
    above: stitched at a slack of 0.6, new memory at 0.62 and above (option stitch_slack)."""
    device = _C.SimulatedDevice("vmm", 8 * GiB)
    pool = _C.Pool(device, stitch_slack=slack)
    hole_then_larger(pool)
    assert _reserved(pool) == device.used_bytes == reserved_mib * MiB
    assert device.aliased_units == aliased


def test_the_stitch_slack_reaches_the_pool_and_bad_values_are_refused():
    assert gpumem.parse_config("")["stitch_slack"] == 0.01  # the default
    assert gpumem.parse_config("stitch_slack:0.015")["stitch_slack"] == 0.015
    for bad in ("-0.1", "1.5", "nan", "some"):
        with pytest.raises(ValueError, match=f"stitch_slack='{bad}' is not valid; accepted: a fraction in"):
            gpumem.parse_config(f"stitch_slack:{bad}")
    with pytest.raises(ValueError, match="stitch_slack must be in \\[0, 1\\], got -0.1"):
        _C.Pool(_C.SimulatedDevice("vmm", GiB), stitch_slack=-0.1)
    with pytest.raises(ValueError, match="stitch_slack must be in"):
        gpumem.replay(ROOT / "bench" / "traces" / "bert.trace.gz", stitch_slack=2.0)


def test_a_larger_stitch_slack_trades_reserved_bytes_for_driver_calls_in_steady_passes():
    """ckpt's steady passes (device 100 operations behind): 1% stitches positions whose units are then
    busy when a block lands there (hundreds of calls a pass); 1.5% leaves room enough that the steady
    passes barely map (docs/benchmarks.md, "stitch_slack"), for a higher peak reserved."""
    trace = ROOT / "bench" / "traces" / "ckpt.trace.gz"
    default = gpumem.replay(trace, device_lag=100, passes=4)
    roomier = gpumem.replay(trace, device_lag=100, passes=4, stitch_slack=0.015)
    assert default.ooms == roomier.ooms == 0
    assert roomier.upstream_calls * 10 < default.upstream_calls
    assert default.peak_reserved_bytes <= roomier.peak_reserved_bytes <= 1.03 * roomier.peak_live_bytes


@pytest.mark.parametrize("trace, lazy_at_least, stitched_at_most", [
    (ROOT / "bench" / "traces" / "bert.trace.gz", 1.2, 1.02),
    (ROOT / "bench" / "traces" / "varlen.trace.gz", 1.1, 1.01),
    (ROOT / "python" / "gpumem" / "traces" / "gpt_varlen.trace.gz", 1.01, 1.01),
])
def test_stitched_replays_stay_near_their_live_bytes(trace, lazy_at_least, stitched_at_most):
    """On a device 100 operations behind the host, uncapped: lazy keeps the holes its varying shapes
    leave; stitched, the peak reserved stays within 1-2% of the peak live bytes (README: Stitching)."""
    gzip.open(trace).read(1)  # a readable trace, not a Git LFS pointer
    lazy = gpumem.replay(trace, device_lag=100, stitch=False)
    stitched = gpumem.replay(trace, device_lag=100)  # the default
    assert lazy.ooms == stitched.ooms == 0
    assert lazy.fragmentation > lazy_at_least
    assert stitched.fragmentation <= stitched_at_most
    assert stitched.peak_live_bytes == lazy.peak_live_bytes


# At the device's own end (no cap or limit, so the pool stitches), a lent draining block beside the
# block being mapped can reach its mark while the pool makes room for that block, and is parked where
# it lies. Its group, counted as wholly unmapped (parked pages are holes), was then mapped whole over
# the parked mapping: "page mapped twice" on the simulated device, a refused cuMemMap on a GPU (an
# allocation failing with a driver error instead of fitting or raising an OOM). 37 of 4,000 replays
# of the bench traces at 1.00-1.06x their peak live bytes, devices 0-1,000 operations behind, failed
# so; these three among them.
@pytest.mark.parametrize("name, lag, factor, passes", [
    ("fbs_gen", 100, 1.0, 1), ("fbs_gen", 20, 1.035, 1), ("fbs_bert", 1000, 1.05, 2)])
def test_a_group_with_parked_pages_is_never_mapped_whole(name, lag, factor, passes):
    trace = ROOT / "bench" / "traces" / f"{name}.trace.gz"
    live = gpumem.replay(trace).peak_live_bytes
    report = gpumem.replay(trace, capacity=int(factor * live), device_lag=lag, passes=passes)
    assert report.peak_reserved_bytes <= report.capacity_bytes
    if factor > 1.0:
        assert report.ooms == 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_replays_near_the_device_end_never_fail_but_with_an_oom(seed):
    """Randomized over the bench traces: a device of 1.00-1.06x a trace's peak live bytes, 0-1,000
    operations behind, one or two passes. The simulated device refuses what a GPU's driver would (a
    page mapped twice, an unmap of what is not mapped): any error but an OOM fails the replay."""
    rng = random.Random(seed)
    traces = sorted((ROOT / "bench" / "traces").glob("fbs_*.trace.gz"))
    traces += [ROOT / "bench" / "traces" / f"{name}.trace.gz" for name in ("bert", "varlen")]
    live = {trace: gpumem.replay(trace).peak_live_bytes for trace in traces}
    for _ in range(40):
        trace = rng.choice(traces)
        factor = 1.0 + rng.randrange(25) * 0.0025
        lag, passes = rng.choice([0, 20, 100, 1000]), rng.choice([1, 2])
        report = gpumem.replay(trace, capacity=int(factor * live[trace]), device_lag=lag, passes=passes)
        assert report.peak_reserved_bytes <= report.capacity_bytes, (trace.name, factor, lag, passes)
