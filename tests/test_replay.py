"""Trace replay: the CLI, the Python API, and malformed traces."""
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

import gpumem
from gpumem.replay import bundled_traces, reference_ratios


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "gpumem", *args], capture_output=True, text=True, timeout=300)


def test_bundled_traces_beat_the_best_pytorch_allocator():
    # Deterministic: the simulated device makes the same decisions every run.
    refs = reference_ratios()
    for path in bundled_traces():
        report = gpumem.replay(path)
        best = min(v for k, v in refs[report.workload].items())
        assert report.ooms == 0
        assert report.peak_live_bytes > 0
        assert 1.0 <= report.fragmentation < best, (report.workload, report.fragmentation, best)


def test_cli_prints_the_comparison_table_and_progress():
    r = run_cli("replay")
    assert r.returncode == 0, r.stderr
    assert "gpt_varlen" in r.stdout and "resnet50" in r.stdout
    assert "1.359 / 1.011 / 1.030" in r.stdout  # PyTorch's figures beside gpumem's
    assert "replaying:" in r.stderr


def test_cli_json_and_segments_upstream(tmp_path):
    r = run_cli("replay", "--json", "--upstream", "segments", str(bundled_traces()[1]))
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["upstream"] == "segments" and row["fragmentation"] >= 1.0 and row["ns_per_pair"] > 0


def test_small_capacity_reports_ooms_instead_of_crashing():
    r = run_cli("replay", "--json", "--capacity", "2GiB", str(bundled_traces()[1]))
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert row["ooms"] > 0 and "out of memory" in row["first_oom"]


@pytest.mark.parametrize(
    "body, line, words",
    [
        ("a 1 100 0\nx 2\n", 2, "expected 'a <id> <bytes> <stream>'"),
        ("a 1 -100 0\n", 1, "size is not a non-negative integer"),
        ("a 1 100\n", 1, "stream is not"),
        ("a 1 100 0\na 1 5 0\n", 2, "allocated twice"),
        ("a 1 100 0\nf 2\n", 2, "never allocated"),
        ("a 1 100 0\nf 1\nf 1\n", 3, "freed twice"),
        ("a 1 100 0 junk\n", 1, "unexpected text"),
        ("a 1 99999999999999999999999 0\n", 1, "size is not"),
        ("# only a header\n", 0, "no allocations"),
    ],
)
def test_malformed_traces_name_the_file_and_line(tmp_path, body, line, words):
    path = tmp_path / "bad.trace"
    path.write_text(body)
    with pytest.raises(ValueError) as e:
        gpumem.replay(path)
    msg = str(e.value)
    assert words in msg
    if line:
        assert f"{path}:{line}:" in msg
    r = run_cli("replay", str(path))
    assert r.returncode == 1 and words in r.stderr and "Traceback" not in r.stderr


def test_gzip_and_plain_give_the_same_result(tmp_path):
    src = bundled_traces()[1]
    plain = tmp_path / "plain.trace"
    plain.write_bytes(gzip.decompress(src.read_bytes()))
    a, b = gpumem.replay(src), gpumem.replay(plain)
    assert (a.peak_live_bytes, a.peak_reserved_bytes) == (b.peak_live_bytes, b.peak_reserved_bytes)


def test_missing_file_and_bad_capacity_are_clear(tmp_path):
    r = run_cli("replay", str(tmp_path / "nope.trace"))
    assert r.returncode == 1 and "no such trace file" in r.stderr
    r = run_cli("replay", "--capacity", "lots")
    assert r.returncode == 2 and "not a size" in r.stderr
    r = run_cli("replay", "--page-size", "3MiB")
    assert r.returncode == 2 and "not a multiple of 2MiB" in r.stderr and "Traceback" not in r.stderr


def test_page_sizes_change_the_trade_off_and_bad_ones_are_refused():
    small = gpumem.replay(bundled_traces()[1], page_size=2 << 20)
    large = gpumem.replay(bundled_traces()[1], page_size=32 << 20)
    assert small.ooms == large.ooms == 0
    assert small.upstream_calls > large.upstream_calls  # bigger pages: fewer driver calls
    # ...and far fewer physical allocations (uncapped, each unit is made once and none released):
    # the driver's cost goes by units, whatever their size.
    assert small.physical_units >= large.physical_units * 4 > 0
    with pytest.raises(ValueError, match="not a multiple of the device's 2.00 MiB granularity"):
        gpumem.replay(bundled_traces()[1], page_size=3 << 20)


def test_truncated_gzip_is_reported(tmp_path):
    data = bundled_traces()[1].read_bytes()
    path = tmp_path / "cut.trace.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.trace.gz"):
        gpumem.replay(path)


def test_min_capacity_is_the_lowest_capacity_with_no_oom():
    """The tight case on the CPU: the bracket [failed_below, ratio] holds the edge, within the tolerance;
    the capacity found replays with 0 OOMs and the one below it does not; a pool limit on a full-size
    device (what set_per_process_memory_fraction sets on a GPU) agrees with the capacity."""
    from gpumem.replay import min_capacity

    path = bundled_traces()[1]
    m = min_capacity(path)
    peak = m.peak_live_bytes
    assert m.workload == "resnet50" and not m.non_monotone
    assert 1.0 <= m.failed_below < m.ratio <= 1.01  # the target: 0 OOMs at <= 1.01x peak live
    assert (m.ratio - m.failed_below) <= 0.0025 + 1e-9
    assert m.capacity_bytes == round(m.ratio * peak)
    assert gpumem.replay(path, capacity=m.capacity_bytes).ooms == 0
    below = int(m.failed_below * peak)
    assert gpumem.replay(path, capacity=below).ooms > 0
    # Under a limit the pool does not stitch: the limit agrees with the capacity found without it.
    lazy = min_capacity(path, stitch=False)
    assert gpumem.replay(path, limit=lazy.capacity_bytes).ooms == 0
    assert gpumem.replay(path, limit=int(lazy.failed_below * peak)).ooms > 0
    # A finer tolerance narrows the bracket around the same edge.
    fine = min_capacity(path, tolerance=0.0005)
    assert fine.ratio - fine.failed_below <= 0.0005 + 1e-9
    assert m.failed_below <= fine.failed_below and fine.ratio <= m.ratio


def test_min_capacity_by_limit_bisects_the_pools_limit_on_a_full_size_device():
    """bound="limit": the lowest limit (what a memory fraction sets) with 0 OOMs, the device at its
    default size; the limit found replays with 0 OOMs and the one below it does not."""
    from gpumem.replay import min_capacity

    path = bundled_traces()[1]
    m = min_capacity(path, bound="limit")
    assert 1.0 <= m.failed_below < m.ratio <= 1.01 and not m.non_monotone
    assert gpumem.replay(path, limit=m.capacity_bytes).ooms == 0
    assert gpumem.replay(path, limit=int(m.failed_below * m.peak_live_bytes)).ooms > 0


def test_min_capacity_refuses_what_it_chooses_itself():
    from gpumem.replay import min_capacity

    with pytest.raises(ValueError, match="bound must be 'capacity', 'limit' or 'device'"):
        min_capacity(bundled_traces()[1], bound="fraction")
    with pytest.raises(ValueError, match="tolerance"):
        min_capacity(bundled_traces()[1], tolerance=0)
    with pytest.raises(ValueError, match="chooses the capacity"):
        min_capacity(bundled_traces()[1], capacity=1 << 30)
    with pytest.raises(ValueError, match="chooses the capacity"):
        min_capacity(bundled_traces()[1], bound="device", held_elsewhere=1 << 30)


def test_cli_min_capacity_table_json_and_refusal():
    r = run_cli("replay", "--min-capacity", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "min capacity GiB" in r.stdout and "gpt_varlen" in r.stdout and "resnet50" in r.stdout
    r = run_cli("replay", "--min-capacity", "--json", "--page-size", "2MiB", str(bundled_traces()[0]))
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert row["workload"] == "gpt_varlen" and 1.0 < row["ratio"] <= 1.01 and row["replays"] > 2
    r = run_cli("replay", "--min-capacity", "--capacity", "20GiB")
    assert r.returncode == 2 and "drop --capacity" in r.stderr


# ----------------------------------------------------------------------------- a device running behind


MiB = 1 << 20


def _hole_then_larger(tmp_path):
    """Two 24 MiB blocks, the first freed, then a 30 MiB one that does not fit its hole: under a 64 MiB
    device the pool must give the hole's pages back, one operation after their block was freed."""
    path = tmp_path / "hole.trace"
    path.write_text(f"a 1 {24 * MiB} 0\na 2 {24 * MiB} 0\nf 1\na 3 {30 * MiB} 0\nf 2\nf 3\n")
    return path


def test_a_lagging_device_makes_the_pool_wait_for_pages_it_still_uses(tmp_path):
    """With the device behind the host, pages freed a moment ago are still in use: taking them for
    another block under the cap is a wait, and the model counts it; with no lag nothing is ever waited
    for. The outcome is the same either way (no OOM, the device never over its capacity)."""
    path = _hole_then_larger(tmp_path)
    now = gpumem.replay(path, capacity=64 * MiB)
    lagged = gpumem.replay(path, capacity=64 * MiB, device_lag=50)
    assert now.waits == 0 and now.device_lag == 0
    assert lagged.waits == 1 and lagged.device_lag == 50
    # The mark for the hole's pages is recorded when the cap needs them: the wait is for all 50
    # operations the device is behind.
    assert lagged.waited_operations == 50 and now.waited_operations == 0
    assert now.ooms == lagged.ooms == 0
    assert lagged.peak_reserved_bytes <= 64 * MiB
    # Uncapped, nothing is given back: nothing to wait for, however far behind the device runs.
    assert gpumem.replay(path, device_lag=50).waits == 0


def test_events_complete_by_the_clock_on_a_lagging_device():
    """The high-water policy releases without waiting: the released pages drain until the device's
    clock has passed their mark (`lag` host steps), and only then go back. (On another stream, so that
    they are not lent to the new block, which would keep them reserved either way.)"""
    dev = gpumem.SimulatedDevice("vmm", capacity=1 << 30)
    dev.lag = 3
    assert dev.lag == 3
    pool = gpumem.Pool(dev, release="high_water", page_size=2 * MiB)
    a = pool.allocate(64 * MiB, stream=0)
    pool.free(a)
    b = pool.allocate(16 * MiB, stream=0)  # maps nothing: it takes the start of a's mapped pages
    c = pool.allocate(80 * MiB, stream=1)  # past the live high water: a's other pages start draining
    draining = pool.reserved_bytes
    assert draining >= pool.allocated_bytes + 48 * MiB  # still mapped: the device has not passed the mark
    dev.advance()
    d = pool.allocate(2 * MiB, stream=1)  # polls the marks: one step is not enough
    assert pool.reserved_bytes >= draining
    for _ in range(2):
        dev.advance()
    e = pool.allocate(2 * MiB, stream=1)  # three steps: the mark has completed, the pages go back
    assert pool.reserved_bytes < draining - 40 * MiB
    assert dev.waits == 0
    for p in (b, c, d, e):
        pool.free(p)
    pool.validate()
    with pytest.raises(TypeError):
        dev.lag = -1


def test_the_driver_time_model_and_the_lag_on_a_recorded_trace():
    """bench/traces/fbs_bert (3 equal BERT steps) at 1.05x its peak live bytes: on a device 100
    operations behind, the pool waits, the waits are those the GPU showed (13 a step at a0ea530); the
    modelled driver time is the per-unit cost of every unit call; uncapped, each unit is created and
    mapped once."""
    # stitch=False: the mechanism of the pool without stitching (the default before 2026-11-27).
    from gpumem.replay import DRIVER_US_PER_UNIT, modelled_driver_ms

    trace = Path(__file__).resolve().parents[1] / "bench" / "traces" / "fbs_bert.trace.gz"
    uncapped = gpumem.replay(trace, device_lag=100, stitch=False)
    assert uncapped.waits == 0 and uncapped.ooms == 0
    per_unit = (DRIVER_US_PER_UNIT["create"] + DRIVER_US_PER_UNIT["map"]) / 1e3
    assert uncapped.driver_ms == pytest.approx(uncapped.physical_units * per_unit)
    capped = gpumem.replay(trace, capacity=int(1.05 * uncapped.peak_live_bytes), device_lag=100, stitch=False)
    assert capped.ooms == 0 and capped.waits >= 20  # 40 before pages released for a block were lent to it
    assert capped.driver_ms > 3 * uncapped.driver_ms  # remapping at the cap: units unmapped and mapped again
    assert modelled_driver_ms(1, 1, 1, 1) == pytest.approx(sum(DRIVER_US_PER_UNIT.values()) / 1e3)
    assert gpumem.replay(trace, upstream="segments", stitch=False).driver_ms is None


def test_cli_device_lag_adds_the_waits_and_refuses_a_negative_lag(tmp_path):
    path = _hole_then_larger(tmp_path)
    r = run_cli("replay", "--quiet", "--capacity", "64MiB", "--device-lag", "50", str(path))
    assert r.returncode == 0, r.stderr
    assert "running 50 operations behind" in r.stdout and "waits" in r.stdout
    r = run_cli("replay", "--json", "--capacity", "64MiB", "--device-lag", "50", str(path))
    row = json.loads(r.stdout)
    assert row["waits"] == 1 and row["device_lag"] == 50
    r = run_cli("replay", "--device-lag", "-1", str(path))
    assert r.returncode == 2 and "--device-lag -1 is negative" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(ValueError, match="device_lag"):
        gpumem.replay(path, device_lag=-5)


def test_later_passes_give_the_steady_state_at_the_cap():
    """passes=N replays a trace N times in one pool (a later epoch), as the GPU's steady steps at a 1.05x
    limit: varlen makes no device call once its shapes repeat; BERT inference remaps the same every
    later pass, a small part of the first's units and without a wait once its live high water has
    settled (whole groups under a roomy bound; before that rule it remapped most of the first pass's
    units and waited every pass, as the GPU showed at c1df721); uncapped, nothing is mapped again."""
    # stitch=False, park_lent=False: the mechanism of the pool without stitching and without parking
    # (the defaults before 2026-11-27 and 2026-11-28; tests/test_park_lent.py has bert with parking).
    traces = Path(__file__).resolve().parents[1] / "bench" / "traces"
    for name in ("varlen", "bert"):
        path = traces / f"{name}.trace.gz"
        first = gpumem.replay(path, stitch=False)
        limit = int(1.05 * first.peak_live_bytes)
        one, two, three = (gpumem.replay(path, limit=limit, device_lag=100, passes=n, stitch=False,
                                         park_lent=False) for n in (1, 2, 3))
        assert one.passes == 1 and two.passes == 2 and three.passes == 3
        assert one.upstream_calls > 0 and one.physical_units > 0 and one.ooms == 0
        for later in (two, three):  # peaks over every pass: the same steps, the same peak live
            assert later.peak_live_bytes == first.peak_live_bytes and later.ooms == 0
            assert later.peak_reserved_bytes <= limit
        if name == "varlen":
            assert two.upstream_calls == 0 and two.physical_units == 0
            assert two.driver_ms == 0 and two.waits == 0
        else:  # the same remapping every later pass, a small part of the first's, and no wait
            assert (two.upstream_calls, two.physical_units, two.waits) == \
                (three.upstream_calls, three.physical_units, three.waits)
            assert 0 < two.physical_units < one.physical_units // 4
            assert one.waits > 0 and two.waits == 0
        steady = gpumem.replay(path, passes=2, stitch=False)
        assert steady.upstream_calls == 0 and steady.mapped_bytes == 0 and steady.driver_ms == 0
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="passes"):
            gpumem.replay(traces / "varlen.trace.gz", passes=bad)


def test_memory_held_outside_the_pool_bounds_it_and_when_it_goes_the_pool_grows_into_the_room():
    """held_elsewhere: the rest of the device is taken by memory outside the pool, which learns where the
    device ends only when a map is refused. BERT inference at 1.05x its peak live bytes then remaps
    every later pass, as under a limit of 1.05x; once that memory goes back (elsewhere_freed_after=1),
    the pool asks the device again when the room it learned would make it release cached pages, and
    grows instead: the third pass maps nothing. (Before the pool asked again, it kept remapping under
    the room it had learned: the same units every pass, freed memory or not.) The lowest room with 0
    OOMs (bound="device") is within 2% of the peak, as the lowest limit is."""
    # stitch=False, park_lent=False: the mechanism of the pool without stitching and without parking
    # (the defaults before 2026-11-27 and 2026-11-28).
    from gpumem.replay import DEFAULT_CAPACITY, min_capacity

    path = Path(__file__).resolve().parents[1] / "bench" / "traces" / "bert.trace.gz"
    peak = gpumem.replay(path, stitch=False).peak_live_bytes
    outside = DEFAULT_CAPACITY - int(1.05 * peak)
    held = gpumem.replay(path, held_elsewhere=outside, device_lag=100, passes=3, stitch=False,
                         park_lent=False)
    limited = gpumem.replay(path, limit=int(1.05 * peak), device_lag=100, passes=3, stitch=False,
                            park_lent=False)
    assert held.ooms == 0 and held.peak_reserved_bytes <= int(1.05 * peak)
    assert held.physical_units > 0 and held.driver_ms > 0
    # The learned room: no allocation had to give the whole cache back and retry; with no room at all
    # (the device holding exactly the peak live bytes) each step that cannot fit retries, then fails.
    assert held.retries == 0
    full = gpumem.replay(path, held_elsewhere=DEFAULT_CAPACITY - peak, device_lag=100, stitch=False)
    assert full.ooms > 0 and full.retries >= full.ooms
    assert (held.physical_units, held.waits) == (limited.physical_units, limited.waits)
    freed = gpumem.replay(path, held_elsewhere=outside, elsewhere_freed_after=1, device_lag=100, passes=3,
                          stitch=False, park_lent=False)
    assert freed.ooms == 0 and freed.peak_reserved_bytes > int(1.05 * peak)
    assert freed.mapped_bytes == 0 and freed.physical_units == 0 and freed.driver_ms == 0
    m = min_capacity(path, bound="device", device_lag=100, stitch=False)
    assert 1.0 <= m.failed_below < m.ratio <= 1.02
    for bad in (-1, True, DEFAULT_CAPACITY + 1, 1.5):
        with pytest.raises(ValueError, match="held_elsewhere"):
            gpumem.replay(path, held_elsewhere=bad)
    for bad in (0, 3, True):
        with pytest.raises(ValueError, match="elsewhere_freed_after"):
            gpumem.replay(path, held_elsewhere=outside, elsewhere_freed_after=bad, passes=3)


def test_cli_passes_reports_the_last_pass_and_refuses_fewer_than_one(tmp_path):
    path = _hole_then_larger(tmp_path)
    r = run_cli("replay", "--quiet", "--passes", "3", str(path))
    assert r.returncode == 0, r.stderr
    assert "3 passes (calls and waits: the last one's)" in r.stdout
    row = json.loads(run_cli("replay", "--json", "--passes", "2", str(path)).stdout)
    assert row["passes"] == 2 and row["upstream_calls"] == 0
    r = run_cli("replay", "--passes", "0", str(path))
    assert r.returncode == 2 and "--passes 0 is below 1" in r.stderr and "Traceback" not in r.stderr


def test_cli_stitch_slack_changes_the_bundled_replay_and_bad_values_are_refused():
    """More slack stitches less: gpt_varlen's peak reserved rises (docs/benchmarks.md, "stitch_slack": 1.0098
    at the default 0.01, 1.0197 at 0.02)."""
    default, roomier = (json.loads(run_cli("replay", "--json", *extra).stdout.splitlines()[0])
                        for extra in ((), ("--stitch-slack", "0.02")))
    assert default["workload"] == roomier["workload"] == "gpt_varlen"
    assert default["peak_live_bytes"] == roomier["peak_live_bytes"]
    assert roomier["peak_reserved_bytes"] > default["peak_reserved_bytes"]
    table = run_cli("replay", "--quiet", "--stitch-slack", "0.02")
    assert table.returncode == 0 and "stitch slack 0.02," in table.stdout
    for bad in ("1.5", "-0.1", "nan"):
        r = run_cli("replay", "--stitch-slack", bad)
        assert r.returncode == 2 and "is not a fraction in [0, 1]" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("replay", "--min-capacity", "--stitch-slack", "0.02")
    assert r.returncode == 2 and "not to --min-capacity" in r.stderr
