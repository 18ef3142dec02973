"""bench/pressure.py and bench/growth_cost.py without a GPU: the plans they print, every workload's code
run tiny on the CPU through the same driver and worker processes, the cap search against runs whose
outcome is known (a threshold cap, as a deterministic workload has), and how RMM's figures are read
from either of its statistics shapes. The caps and times themselves need the GPU machine
(tools/pressure_gpu.sh)."""
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import pressure  # noqa: E402  (imports no torch)
from pressure_workloads import ALLOCATORS, GPUMEM_CONF, WORKLOADS, rmm_figures  # noqa: E402


def run(*args, script="pressure.py"):
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=300)


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path):
    r = run("--dry-run", "--workloads", "moe,bert", "--allocators", "native,gpumem", "--json", tmp_path / "x.json")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "device cuda; workloads moe, bert; allocators native, gpumem"
    assert "moe: uncapped alone x2 (native first: P); 1.05x P alone x2; bisection" in r.stdout
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--workloads", "moe,nope"], "unknown workload(s) ['nope']"),
    (["--allocators", "native,jemalloc"], "unknown allocator(s) ['jemalloc']"),
    (["--tolerance", "0"], "--tolerance must be in (0, 1)"),
    (["--jobs", "0"], "--jobs must be at least 1"),
    (["--repeats", "0"], "--repeats must be at least 1"),
])
def test_bad_arguments_are_refused(args, message):
    r = run("--dry-run", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_every_workload_runs_tiny_on_the_cpu(tmp_path):
    out = tmp_path / "cpu.json"
    r = run("--device", "cpu", "--json", out)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert list(doc["results"]) == list(WORKLOADS)
    for w in WORKLOADS:
        row = doc["results"][w]["rows"][0]
        assert row["error"] is None and row["uncapped_ooms"] == 0 and row["uncapped_step_ms"] > 0, (w, row)
    assert "0-OOM cap" in r.stdout


def test_repeats_time_the_runs_again_and_keep_the_median(tmp_path):
    out = tmp_path / "cpu.json"
    r = run("--device", "cpu", "--workloads", "allocfree", "--allocators", "native,gpumem", "--repeats", "3",
            "--json", out)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    native = doc["results"]["allocfree"]["rows"][0]  # on the CPU only the first allocator runs (no allocator)
    runs = native["uncapped_step_ms_runs"]
    assert len(runs) == 3 and all(t > 0 for t in runs), native
    assert native["uncapped_step_ms"] == sorted(runs)[1]
    assert [t["allocator"] for t in doc["trials"]] == ["native"] * 3


def search_until_done(threshold, tolerance=0.0025, per_round=4, first=None, ceiling=6.0):
    """Rounds of proposals answered by `cap >= threshold`; returns the search and the rounds taken."""
    s = pressure.Search(tolerance, ceiling)
    if first is not None:
        s.record(first, first >= threshold)
    rounds = 0
    while not s.done():
        points = s.propose(per_round)
        assert points and len(points) <= per_round and not set(points) & set(s.trials)
        for k in points:
            s.record(k, k >= threshold)
        rounds += 1
        assert rounds < 40
    return s, rounds


@pytest.mark.parametrize("threshold", [1.0, 1.0013, 1.0321, 1.049, 1.05, 1.2, 1.77, 4.46])
def test_search_finds_the_threshold_to_the_tolerance(threshold):
    s, rounds = search_until_done(threshold, first=1.05)
    r = s.result()
    assert r["converged"] and not r["non_monotone"]
    assert threshold <= r["lowest_cap"] <= threshold + 0.0025 + 1e-9
    assert r["highest_failing"] < threshold
    assert rounds <= 8, rounds


def test_search_below_the_floor_and_above_the_ceiling():
    s, _ = search_until_done(0.5, first=1.05)
    assert s.result()["lowest_cap"] == pressure.FLOOR and s.result()["highest_failing"] is None
    s, _ = search_until_done(9.0, first=1.05, ceiling=3.0)
    assert s.result()["lowest_cap"] is None and s.result()["highest_failing"] == 3.0


def test_search_reports_an_outcome_not_monotone_in_the_cap():
    s = pressure.Search(0.0025, 5.0)
    s.record(1.02, True)
    s.record(1.05, False)
    assert s.non_monotone() and s.bracket() == (None, 1.02)


def test_table_shows_ratios_to_the_best_pytorch_allocator():
    rows = [dict(allocator="native", lowest_cap=1.20, highest_failing=1.19, converged=True, uncapped_step_ms=10.0,
                 capped_step_ms=12.0, capped_ooms=0, reserved_over_allocated=1.4),
            dict(allocator="expandable", lowest_cap=1.04, highest_failing=1.0375, converged=True,
                 uncapped_step_ms=9.0, capped_step_ms=10.0, capped_ooms=0, reserved_over_allocated=1.02),
            dict(allocator="gpumem", lowest_cap=1.0075, highest_failing=1.005, converged=True,
                 uncapped_step_ms=9.09, capped_step_ms=9.5, capped_ooms=0, reserved_over_allocated=1.01)]
    text = pressure.table({"moe": dict(rows=rows)})
    gpumem = next(line for line in text.splitlines() if line.startswith("moe       gpumem"))
    assert gpumem.split()[2:] == ["1.0075", "0.969", "9.1", "1.010", "9.5", "0", "0.950", "1.010"], gpumem


def test_both_gpumem_policies_are_allocators_of_the_benchmark():
    assert {"gpumem", "gpumem_hw"} <= set(ALLOCATORS)
    assert GPUMEM_CONF == {"gpumem": "release:lazy", "gpumem_hw": "release:high_water"}
    r = run("--dry-run", "--workloads", "varlen")
    assert r.returncode == 0, r.stderr
    assert "allocators native, expandable, async, gpumem, gpumem_hw (+rmm if it imports)" in r.stdout
    assert "gpumem_hw: release:high_water" in " ".join(run("--help").stdout.split())


@dataclass
class Statistics:
    """RMM 26.x's rmm.statistics.Statistics: the adaptor's counts as attributes (RMM cannot run here)."""
    current_bytes: int
    current_count: int
    peak_bytes: int
    peak_count: int
    total_bytes: int
    total_count: int


class Adaptor:
    def __init__(self, counts):
        self.allocation_counts = counts


class PoolResource:
    def __init__(self, size):
        self._size = size

    def pool_size(self):
        return self._size


@pytest.mark.parametrize("counts", [
    Statistics(10, 1, 7 << 30, 9, 99 << 30, 40),                       # RMM 26.x
    dict(current_bytes=10, current_count=1, peak_bytes=7 << 30, peak_count=9, total_bytes=99 << 30,
         total_count=40),                                               # RMM before 26.x
])
def test_rmm_figures_read_either_statistics_shape(counts):
    figures = rmm_figures(Adaptor(counts), PoolResource(8 << 30))
    assert figures == dict(max_allocated=7 << 30, max_reserved=8 << 30)
    # An RMM whose pool cannot say its size: no reserved figure rather than a wrong one.
    assert rmm_figures(Adaptor(counts), object()) == dict(max_allocated=7 << 30, max_reserved=None)


def test_growth_cost_plans_and_runs_tiny_on_the_cpu(tmp_path):
    r = run("--dry-run", script="growth_cost.py")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("device cuda; allocators native, expandable, gpumem, gpumem_hw, gpumem_noipc, "
                               "gpumem_p20: (a) grow"), r.stdout
    r = run("--dry-run", "--allocators", "native,tcmalloc", script="growth_cost.py")
    assert r.returncode == 2 and "unknown allocator(s) ['tcmalloc']" in r.stderr
    out = tmp_path / "g.json"
    r = run("--device", "cpu", "--json", out, script="growth_cost.py")
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    res = doc["results"]["none"]
    assert [g["bytes"] for g in res["grow"]] == [64 << 10, 256 << 10, 1 << 20, 4 << 20]
    assert all(g["alloc_ms"] > 0 for g in res["grow"])
    steps = [r for r in res["varlen"] if r["pass_"] == 1]
    assert len(steps) >= 2 and [r for r in res["varlen"] if r["pass_"] == 2] != []
    assert all(r["length"] in (32, 64) and r["ms"] > 0 for r in res["varlen"])
    assert doc["map"] is None
    assert "(c) gpumem's map path" in r.stdout and "not run (no CUDA device)" in r.stdout
