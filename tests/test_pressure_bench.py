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
from pressure_workloads import (  # noqa: E402
    ALLOCATORS, GPUMEM_CONF, WORKLOADS, ballast_bytes, gpumem_conf, rmm_figures, steady_figures)


def run(*args, script="pressure.py"):
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=300)


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path):
    r = run("--dry-run", "--workloads", "moe,bert", "--allocators", "native,gpumem", "--json", tmp_path / "x.json")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "device cuda; workloads moe, bert; allocators native, gpumem"
    assert ("moe: uncapped alone x2, 2 passes over the steps each (native first: P); 1.05x P alone x2, 2 passes "
            "over the steps each; bisection") in r.stdout
    assert "up to 8 trials at once, 1 pass each" in r.stdout  # a search trial: one pass
    assert not (tmp_path / "x.json").exists()
    r = run("--dry-run", "--workloads", "moe", "--allocators", "expandable,gpumem", "--passes", "1")
    assert "moe: uncapped alone x2, 1 pass each (expandable first: P); 1.05x P alone x2, 1 pass each" in r.stdout
    r = run("--dry-run", "--device", "cpu", "--workloads", "bert", "--repeats", "3")
    assert "bert: uncapped alone x3, 2 passes over the steps each (native only: no allocator on the CPU)" \
        in r.stdout.splitlines(), r.stdout


@pytest.mark.parametrize("args, message", [
    (["--workloads", "moe,nope"], "unknown workload(s) ['nope']"),
    (["--allocators", "native,jemalloc"], "unknown allocator(s) ['jemalloc']"),
    (["--allocators", "native,gpumem+"], "unknown allocator(s) ['gpumem+']"),
    (["--allocators", "native,async+stitch:false"], "unknown allocator(s) ['async+stitch:false']"),
    (["--tolerance", "0"], "--tolerance must be in (0, 1)"),
    (["--jobs", "0"], "--jobs must be at least 1"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--passes", "0"], "--passes must be at least 1"),
    (["--allocators", "native,gpumem", "--release-slack", "0.03"],
     "--release-slack applies to gpumem_hw, which --allocators does not name"),
    (["--release-slack", "1.5"], "argument --release-slack: must be in [0, 1], got 1.5"),
    (["--release-slack", "nan"], "argument --release-slack: must be in [0, 1], got nan"),
    (["--release-slack", "lots"], "argument --release-slack: must be a fraction in [0, 1], got 'lots'"),
    (["--bound", "device", "--allocators", "native,rmm"], "--bound device: rmm is bounded by its pool's"),
    (["--bound", "sky"], "argument --bound: invalid choice: 'sky'"),
])
def test_bad_arguments_are_refused(args, message):
    r = run("--dry-run", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_a_gpumem_configuration_with_keys_is_run_with_its_configuration():
    """gpumem+KEY:VALUE (as bench/lockstep.py takes them): in the plan, and its workers run it (the
    worker turns the name into GPUMEM_CONF, pressure_workloads.gpumem_conf)."""
    args = pressure.parse_args(["--workloads", "ckpt",
                                "--allocators", "native,gpumem,gpumem+ends_by_page:true"])
    assert args.allocators == ["native", "gpumem", "gpumem+ends_by_page:true"]
    assert "allocators native, gpumem, gpumem+ends_by_page:true" in pressure.plan(args)
    runner = pressure.Runner(args)
    runner.peak["ckpt"], runner.total = 1 << 30, 80 << 30
    cmd = runner.command(pressure.Trial("ckpt", "gpumem+ends_by_page:true", 1.05, stop_on_oom=True))
    assert cmd[2:4] == ["ckpt", "gpumem+ends_by_page:true"], cmd
    assert gpumem_conf("gpumem+ends_by_page:true") == "release:lazy,stitch:true,ends_by_page:true"


def test_the_release_slack_goes_to_gpumem_hw_workers_only():
    """--release-slack: in the plan, and on the command line of gpumem_hw's workers, no one else's."""
    args = pressure.parse_args(["--workloads", "bert", "--allocators", "native,gpumem,gpumem_hw",
                                "--release-slack", "0.03"])
    assert pressure.plan(args).splitlines()[0].endswith("gpumem_hw (gpumem_hw: release_slack 0.03)")
    runner = pressure.Runner(args)
    runner.peak["bert"], runner.total = 1 << 30, 80 << 30
    for allocator in ("native", "gpumem", "gpumem_hw"):
        for cap in (None, 1.05):
            cmd = runner.command(pressure.Trial("bert", allocator, cap, stop_on_oom=cap is not None))
            assert ("--release-slack" in cmd) == (allocator == "gpumem_hw"), cmd
            if allocator == "gpumem_hw":
                assert cmd[cmd.index("--release-slack") + 1] == "0.03"
    plain = pressure.Runner(pressure.parse_args(["--workloads", "bert", "--allocators", "gpumem_hw"]))
    assert "--release-slack" not in plain.command(pressure.Trial("bert", "gpumem_hw", None, False))


def test_the_device_bound_goes_to_capped_workers_one_trial_at_a_time(tmp_path):
    """--bound device: in the plan, on every capped worker's command line (not the uncapped runs'),
    never rmm (not even where it imports), and a --resume only from a run under the same bound (a file
    without "bound" ran under the fraction)."""
    args = pressure.parse_args(["--workloads", "bert", "--allocators", "native,async,gpumem", "--bound", "device",
                                "--jobs", "4"])
    assert args.bound == "device" and not args.rmm_auto and args.jobs == 1
    assert "caps bound the device's memory" in pressure.plan(args)
    runner = pressure.Runner(args)
    runner.peak["bert"], runner.total = 1 << 30, 80 << 30
    for allocator in args.allocators:
        capped = runner.command(pressure.Trial("bert", allocator, 1.05, stop_on_oom=True))
        assert capped[capped.index("--bound") + 1] == "device" and "--fraction" in capped
        assert "--bound" not in runner.command(pressure.Trial("bert", allocator, None, False))
    plain = pressure.Runner(pressure.parse_args(["--workloads", "bert"]))
    plain.peak["bert"], plain.total = 1 << 30, 80 << 30
    assert plain.args.bound == "fraction"
    assert "--bound" not in plain.command(pressure.Trial("bert", "native", 1.05, True))
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(dict(args=dict(quick=False, device="cuda"), results={})))
    r = run("--dry-run", "--bound", "device", "--resume", earlier)
    assert r.returncode == 2 and "its run had bound='fraction', this one 'device'" in r.stderr, r.stderr
    assert run("--dry-run", "--resume", earlier).returncode == 0


def test_the_ballast_leaves_the_allocator_the_bound_or_says_why_it_cannot():
    GiB = 1 << 30
    assert ballast_bytes(free=70 * GiB, held=2 * GiB, bound=10 * GiB) == 62 * GiB
    assert ballast_bytes(free=8 * GiB, held=2 * GiB, bound=10 * GiB) == 0
    with pytest.raises(ValueError, match="holds 11,811,160,064 bytes after the warm-up pass"):
        ballast_bytes(free=70 * GiB, held=11 * GiB, bound=10 * GiB)
    with pytest.raises(ValueError, match="less than the 8,589,934,592 the bound leaves the allocator"):
        ballast_bytes(free=7 * GiB, held=2 * GiB, bound=10 * GiB)


def test_reserved_over_cap_keeps_the_highest_of_the_passing_capped_runs():
    """res/cap: an allocator whose passing runs held more of the device than the cap shows it (PyTorch's
    cudaMallocAsync under a fraction); uncapped, failed and erroneous runs do not count."""
    runner = pressure.Runner(pressure.parse_args(["--workloads", "bert"]))
    runner.peak["bert"], runner.total = 1000, 100_000
    row = {}
    for cap, result in ((None, dict(ooms=0, max_reserved=5000)),
                        (1.05, dict(ooms=0, max_reserved=1100)),    # 1100 / 1050
                        (1.01, dict(ooms=0, max_reserved=1111)),    # 1111 / 1010: 1.1, the highest
                        (1.00, dict(ooms=1, max_reserved=3000)),    # failed
                        (1.02, dict(ooms=0, error="x", max_reserved=3000))):
        t = pressure.Trial("bert", "async", cap, cap is not None)
        t.result = result
        pressure.note_reserved_over_cap(row, t, runner)
    assert row["reserved_over_cap"] == pytest.approx(1111 / 1010)
    line = [x for x in pressure.table({"bert": dict(rows=[dict(row, allocator="async")])}).splitlines()
            if x.startswith("bert")][0]
    assert line.split()[-1] == "1.1000"


def test_every_workload_runs_tiny_on_the_cpu(tmp_path):
    out = tmp_path / "cpu.json"
    r = run("--device", "cpu", "--json", out)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert list(doc["results"]) == list(WORKLOADS)
    for w in WORKLOADS:
        row = doc["results"][w]["rows"][0]
        assert row["error"] is None and row["uncapped_ooms"] == 0 and row["uncapped_step_ms"] > 0, (w, row)
        # The timed runs' second pass (--passes 2 by default): a steady step time, its own OOM count, no
        # device calls (the CPU has no allocator to count them).
        assert row["uncapped_steady_step_ms"] > 0 and row["uncapped_steady_ooms"] == 0, (w, row)
        assert row["uncapped_steady_device_allocs"] is None, (w, row)
    assert "0-OOM cap" in r.stdout and "ms free st" in r.stdout


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
    steady = native["uncapped_steady_step_ms_runs"]
    assert len(steady) == 3 and all(t > 0 for t in steady), native
    assert native["uncapped_steady_step_ms"] == sorted(steady)[1]
    assert native["uncapped_ooms_runs"] == [0, 0, 0] and native["uncapped_steady_ooms_runs"] == [0, 0, 0]
    assert [t["allocator"] for t in doc["trials"]] == ["native"] * 3
    assert all(t["passes"] == 2 and t["steady_step_ms"] > 0 for t in doc["trials"]), doc["trials"]


def worker(*args):
    r = run(*args, "--device", "cpu", "--tiny", script="pressure_workloads.py")
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_passes_add_steady_figures_and_leave_the_first_pass_as_it_was():
    """One pass: the figures as before, no steady ones. Two: the same first pass (its steps, OOMs, peaks
    and step-time definition) plus the steady pass's time. The workload's first step on the CPU pays
    one-time costs too, so the steady pass is the faster (here by far: tiny steps)."""
    one, two = worker("bert", "none"), worker("bert", "none", "--passes", "2")
    assert one["passes"] == 1 and one["steady_step_ms"] is None and one["steady_ooms"] is None
    assert two["passes"] == 2 and two["steady_step_ms"] > 0 and two["steady_ooms"] == 0
    for key in ("steps", "ooms", "first_oom_step", "oom", "device_short", "total_bytes", "device"):
        assert one[key] == two[key], key
    assert one["step_ms"] > 0 and two["step_ms"] > 0
    three = worker("allocfree", "none", "--passes", "3", "--quick")
    assert three["steps"] == 3 and three["passes"] == 3  # steps: of one pass
    assert three["steady_step_ms"] > 0 and three["steady_ooms"] == 0
    r = run("allocfree", "none", "--device", "cpu", "--tiny", "--passes", "0", script="pressure_workloads.py")
    assert r.returncode == 2 and "--passes must be at least 1, got 0" in r.stderr


def test_each_pass_has_its_own_step_time_and_the_slack_is_checked():
    """pass_step_ms: one mean step per pass (whether a remapping policy settles as shapes repeat), the
    first equal to step_ms. --release-slack belongs to gpumem_hw and must be a fraction."""
    three = worker("allocfree", "none", "--passes", "3", "--quick")
    per_pass = three["pass_step_ms"]
    assert len(per_pass) == 3 and all(t > 0 for t in per_pass), per_pass
    assert per_pass[0] == pytest.approx(three["step_ms"])
    assert three["steady_step_ms"] == pytest.approx(sum(per_pass[1:]) / 2)
    assert three["release_slack"] is None
    assert three["pass_driver_ms"] == [None, None, None] and three["ballast_freed_after"] is None
    for args in (["--ballast-freed-after", "1", "--passes", "3"],  # no --bound device
                 ["--bound", "device", "--fraction", "0.5", "--ballast-freed-after", "3", "--passes", "3"]):
        r = run("allocfree", "none", "--device", "cpu", "--tiny", *args, script="pressure_workloads.py")
        assert r.returncode == 2 and "--ballast-freed-after K needs --bound device and 1 <= K < --passes" \
            in r.stderr, (args, r.stderr)
    only_hw = "--release-slack applies to gpumem_hw only"
    for args, message in ((["none", "--release-slack", "0.03"], only_hw),
                          (["gpumem", "--release-slack", "0.03"], only_hw),
                          (["gpumem_hw", "--release-slack", "-0.1"],
                           "argument --release-slack: must be in [0, 1], got -0.1")):
        r = run("allocfree", *args, "--device", "cpu", "--tiny", script="pressure_workloads.py")
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)


def test_the_slack_reaches_gpumem_through_its_configuration(monkeypatch):
    """gpumem_hw with a slack sets GPUMEM_CONF before gpumem is imported (the worker imports it next;
    without CUDA the import only reports that it is not torch's allocator)."""
    import pressure_workloads as pw

    monkeypatch.delenv("GPUMEM_CONF", raising=False)
    pw.select_allocator("gpumem_hw", None, 0.03)
    assert pw.os.environ["GPUMEM_CONF"] == "release:high_water,stitch:false,release_slack:0.03"
    pw.select_allocator("gpumem_hw", None)
    assert pw.os.environ["GPUMEM_CONF"] == "release:high_water,stitch:false"


def test_allocfree_passes_repeat_the_same_requests_and_survive_a_lost_step():
    """allocfree on the CPU (real torch tensors): every pass holds what the first did (at most
    ALLOCFREE_LIVE tensors after each step; a later pass does not keep the last pass's tensors alive,
    which under a 1.05x cap ran pass 2 out of memory), and a step whose tensors were never made (it ran
    out of memory at its first request) does not break the steps after it, which free some of them."""
    import random

    import torch

    import pressure_workloads as pw

    pw.DEVICE = torch.device("cpu")
    steps, _, step = pw.make_workload("allocfree", torch, tiny=True)
    most = []
    for _ in range(2):
        for i in range(steps):
            step(i)
            most.append(len(step.live))
    assert max(most) == pw.ALLOCFREE_LIVE and most[:steps] == most[steps:], most
    sizes, frees = pw.allocfree_plan(random.Random(0), True)  # make_workload's seed 0: the same plan
    chunk = len(sizes) // steps
    lost = range(chunk, 2 * chunk)  # step 1's tensors, never made
    assert any(f in lost for f in frees[2 * chunk:3 * chunk])  # step 2 frees some of them
    steps, _, step = pw.make_workload("allocfree", torch, tiny=True)
    step(0)
    step(2)  # step 1 lost: its tensors were never made
    assert all(j not in step.live for j in lost) and len(step.live) <= pw.ALLOCFREE_LIVE


def test_out_of_memory_errors_of_torch_libraries_and_rmm_count_as_oom_steps():
    """What a capped run counts as an OOM step (and goes on) rather than an error that ends it: RMM's
    pool at its maximum size raises a RuntimeError of its own (the text of an H100 run at 1.05x)."""
    import torch

    from pressure_workloads import is_oom

    rmm = ("std::bad_alloc: out_of_memory: RMM failure at:/__w/rmm/rmm/cpp/src/mr/detail/"
           "pool_memory_resource_impl.cpp:73: Maximum pool size exceeded (failed to allocate 1.201172 GiB): "
           "Not enough room to grow, current/max/try size = 2.922531 GiB, 3.563375 GiB, 1.201172 GiB")
    assert is_oom(RuntimeError(rmm))
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."))
    assert is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert not is_oom(RuntimeError("shape '[2, 3]' is invalid for input of size 7"))
    assert not is_oom(KeyError(3872))


def a_pass(ooms=0, seconds=0.5, calls=(0, 0), oom="", driver=None):
    return dict(ooms=ooms, first_oom=0 if ooms else None, oom=oom, seconds=seconds, calls=calls,
                driver=driver)


def test_steady_figures_of_the_later_passes():
    """The bookkeeping of passes 2..N (what a GPU run's OOMs and counters make of them)."""
    assert steady_figures([], 1, 10) == dict(steady_step_ms=None, steady_ooms=None, steady_oom="",
                                             steady_device_allocs=None, steady_device_frees=None,
                                             steady_driver_ms=None, steady_wait_ms=None,
                                             steady_driver_ms_by_kind=None)
    # Two later passes of 10 timed steps: the mean over both, device calls per step.
    f = steady_figures([a_pass(seconds=0.5, calls=(4, 2)), a_pass(seconds=0.3, calls=(0, 0))], 3, 10)
    assert f["steady_step_ms"] == pytest.approx(40.0) and f["steady_ooms"] == 0
    assert f["steady_device_allocs"] == pytest.approx(0.2) and f["steady_device_frees"] == pytest.approx(0.1)
    # OOM steps of a pass that went on: counted, and the pass still timed (as the first pass's are).
    f = steady_figures([a_pass(ooms=2, seconds=1.0, oom="CUDA out of memory")], 2, 10)
    assert f["steady_ooms"] == 2 and f["steady_step_ms"] == pytest.approx(100.0)
    assert f["steady_oom"] == "CUDA out of memory"
    # A later pass stopped at an OOM (--stop-on-oom): no steady time, nor calls; its OOM counted.
    f = steady_figures([a_pass(ooms=1, seconds=None, calls=None)], 2, 10)
    assert f["steady_step_ms"] is None and f["steady_ooms"] == 1 and f["steady_device_allocs"] is None
    # The first pass stopped the run: no later pass ran, so nothing steady is known.
    f = steady_figures([], 2, 10)
    assert f["steady_step_ms"] is None and f["steady_ooms"] is None
    # An allocator that does not count device calls (async, rmm): no calls, the time still.
    f = steady_figures([a_pass(calls=None)], 2, 10)
    assert f["steady_device_allocs"] is None and f["steady_step_ms"] == pytest.approx(50.0)
    assert f["steady_driver_ms"] is None and f["steady_wait_ms"] is None  # not gpumem: not timed
    # gpumem's driver and wait time (ms over each pass): per timed step over both passes.
    f = steady_figures([a_pass(driver=dict(map=8.0, unmap=4.0, event=0.0, wait=3.0)),
                        a_pass(driver=dict(map=5.0, unmap=2.0, event=1.0, wait=1.0))], 3, 10)
    assert f["steady_driver_ms"] == pytest.approx(1.0) and f["steady_wait_ms"] == pytest.approx(0.2)
    assert f["steady_driver_ms_by_kind"] == pytest.approx(dict(map=0.65, unmap=0.3, event=0.05))
    # one pass stopped early: no driver figures
    f = steady_figures([a_pass(driver=dict(map=1.0, wait=3.0)), a_pass(driver=None)], 3, 10)
    assert f["steady_driver_ms"] is None and f["steady_wait_ms"] is None


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


def table_rows():
    return [dict(allocator="native", lowest_cap=1.20, highest_failing=1.19, converged=True, uncapped_step_ms=10.0,
                 uncapped_steady_step_ms=5.0, capped_step_ms=12.0, capped_steady_step_ms=6.0, capped_ooms=0,
                 capped_steady_ooms=0, capped_steady_device_allocs=0.0, capped_steady_device_frees=0.0,
                 reserved_over_allocated=1.4),
            dict(allocator="expandable", lowest_cap=1.04, highest_failing=1.0375, converged=True,
                 uncapped_step_ms=9.0, uncapped_steady_step_ms=5.5, capped_step_ms=10.0, capped_steady_step_ms=8.0,
                 capped_ooms=0, capped_steady_ooms=1, capped_steady_device_allocs=1.5,
                 capped_steady_device_frees=2.0, reserved_over_allocated=1.02),
            dict(allocator="gpumem", lowest_cap=1.0075, highest_failing=1.005, converged=True,
                 uncapped_step_ms=9.09, uncapped_steady_step_ms=5.2, capped_step_ms=9.5, capped_steady_step_ms=6.4,
                 capped_ooms=0, capped_steady_ooms=0, capped_steady_device_allocs=0.25,
                 capped_steady_device_frees=0.5, uncapped_steady_driver_ms=0.0, uncapped_steady_wait_ms=0.0,
                 capped_steady_driver_ms=1.234, capped_steady_wait_ms=0.5, reserved_over_allocated=1.01)]


def table_line(text, start):
    return next(line for line in text.splitlines() if line.startswith(start)).split()


def test_table_shows_ratios_to_the_best_pytorch_allocator():
    """First pass and steady side by side, each with its own ratios: to the best PyTorch allocator's
    uncapped figure of the same pass (native's steady 5.0 is the best steady, expandable's 9.0 the best
    first pass) and to expandable's at 1.05x of the same pass."""
    text = pressure.table({"moe": dict(rows=table_rows())})
    header = text.splitlines()[0]
    for a, b in [("ms free", "ms free st"), ("ms @1.05", "ms @1.05 st"), ("vs exp", "vs exp st")]:
        assert f" {a} " in header and f" {b} " in header, header
    assert table_line(text, "moe       gpumem")[2:] == [
        "1.0075", "0.969", "9.1", "1.010", "5.2", "1.040", "9.5", "0", "0.950", "6.4", "0", "0.800", "0.8",
        "0.00/0.00", "1.23/0.50", "1.010", "-"]  # res/cap: no reserved_over_cap in these rows
    assert table_line(text, "moe       native")[-4:-2] == ["-", "-"]  # not gpumem: no driver time
    assert table_line(text, "moe       expandable")[10:15] == ["1.000", "8.0", "1", "1.000", "3.5"]


def test_table_prints_a_dash_for_figures_a_result_lacks():
    """A result without steady figures (one pass, or a JSON written before them), or without the capped
    run (an error), prints '-' in those columns, not a crash, and keeps the figures it has."""
    rows = table_rows()
    for r in rows:
        for k in [k for k in r if "steady" in k]:
            del r[k]
    del rows[2]["capped_step_ms"], rows[2]["capped_ooms"]
    text = pressure.table({"moe": dict(rows=rows)})
    assert table_line(text, "moe       gpumem")[2:] == [
        "1.0075", "0.969", "9.1", "1.010", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "1.010", "-"]
    assert table_line(text, "moe       native")[2:9] == ["1.2000", "1.154", "10.0", "1.111", "-", "-", "12.0"]


def test_every_gpumem_configuration_is_an_allocator_of_the_benchmark():
    assert {"gpumem", "gpumem_nostitch", "gpumem_hw"} <= set(ALLOCATORS)
    assert GPUMEM_CONF == {"gpumem": "release:lazy,stitch:true", "gpumem_nostitch": "release:lazy,stitch:false",
                           "gpumem_hw": "release:high_water,stitch:false"}
    r = run("--dry-run", "--workloads", "varlen")
    assert r.returncode == 0, r.stderr
    assert "allocators native, expandable, async, gpumem, gpumem_nostitch, gpumem_hw (+rmm if it imports)" in r.stdout
    assert ("gpumem_nostitch: release:lazy,stitch:false; gpumem_hw: release:high_water,stitch:false"
            in " ".join(run("--help").stdout.split()))


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


# ----------------------------------------------------------------------------- --resume


class ThresholdRunner(pressure.Runner):
    """A trial passes at caps from `threshold` up, as a deterministic workload's run does; nothing is
    started (the trials themselves need the GPU machine)."""

    def __init__(self, args, threshold):
        super().__init__(args)
        self.threshold, self.tried = threshold, []

    def parallel(self, trials):
        for t in trials:
            self.tried.append((t.allocator, t.cap))
            t.result = dict(ooms=0 if t.cap >= self.threshold else 1)
            self.log.append(dict(t.result, workload=t.workload, allocator=t.allocator, cap=t.cap))


def earlier_run(tmp_path, quick=False):
    """An earlier call's JSON: bert's native search cut off with its bracket (1.05, 1.2], gpumem's done,
    expandable's never started (its capped run failed); moe measured in full."""
    rows = [dict(allocator="native", uncapped_step_ms=30.0, lowest_cap=1.2, highest_failing=1.05,
                 converged=False, trials={"1.0500": False, "1.2000": True}),
            dict(allocator="gpumem", uncapped_step_ms=31.0, lowest_cap=1.0075, highest_failing=1.005,
                 converged=True, trials={"1.0050": False, "1.0075": True, "1.0500": True}),
            dict(allocator="expandable", uncapped_step_ms=29.0, capped_error="boom")]
    doc = dict(args=dict(quick=quick, device="cuda"),
               results=dict(bert=dict(peak_allocated=10 << 30, total_bytes=80 << 30, rounds=2, rows=rows),
                            moe=dict(peak_allocated=5 << 30, total_bytes=80 << 30, rounds=3,
                                     rows=[dict(allocator="native", lowest_cap=1.1, converged=True,
                                                trials={"1.1000": True})])),
               trials=[dict(workload="bert", allocator="native", cap=1.2, ooms=0)])
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(doc))
    return path


def test_resume_goes_on_from_each_bracket_and_keeps_the_rest(tmp_path):
    path = earlier_run(tmp_path)
    args = pressure.parse_args(["--workloads", "bert", "--resume", str(path)])
    runner = ThresholdRunner(args, threshold=1.1234)
    res = pressure.resume("bert", args.earlier["results"]["bert"], runner, args, deadline=float("inf"))
    rows = {r["allocator"]: r for r in res["rows"]}
    native = rows["native"]
    assert native["converged"] and 1.1234 <= native["lowest_cap"] <= 1.1234 + 0.0025 + 1e-9
    assert native["uncapped_step_ms"] == 30.0  # the earlier timed figures stay
    assert native["trials"]["1.0500"] is False and native["trials"]["1.2000"] is True  # and its trials
    tried = {a for a, _ in runner.tried}
    assert tried == {"native"}  # gpumem's search was done, expandable's never started
    assert all(1.05 < cap < 1.2 for _, cap in runner.tried)  # inside the earlier bracket only
    assert rows["gpumem"]["lowest_cap"] == 1.0075 and rows["expandable"]["capped_error"] == "boom"
    assert res["rounds"] > 2 and res["resumed"] == 1 and res["peak_allocated"] == 10 << 30
    assert runner.peak["bert"] == 10 << 30 and runner.total == 80 << 30


def test_resume_plan_chaining_and_refusals(tmp_path):
    path = earlier_run(tmp_path)
    r = run("--dry-run", "--workloads", "bert,ckpt", "--resume", path)
    assert r.returncode == 0, r.stderr
    assert f"bert: resumed from {path} (P and timed runs kept); searches left: native, to 0.0025 P" \
        in r.stdout
    assert "ckpt: uncapped alone" in r.stdout  # a workload the earlier run lacks: measured from the start
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = run("--dry-run", "--resume", bad)
    assert r.returncode == 2 and "not a JSON file written by --json" in r.stderr
    assert "Traceback" not in r.stderr
    r = run("--dry-run", "--quick", "--resume", path)
    assert r.returncode == 2 and "its run had quick=False, this one True" in r.stderr
    r = run("--dry-run", "--resume", tmp_path / "missing.json")
    assert r.returncode == 2 and "missing.json" in r.stderr


def test_resume_on_the_cpu_keeps_the_earlier_workloads_in_the_new_json(tmp_path):
    """Chained calls (the path CI can run): bert measured, then moe with --resume of the first JSON; the
    second JSON holds both, and the first call's trials."""
    first, second = tmp_path / "1.json", tmp_path / "2.json"
    r = run("--device", "cpu", "--workloads", "bert", "--json", first)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run("--device", "cpu", "--workloads", "moe", "--resume", first, "--json", second)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(second.read_text())
    assert set(doc["results"]) == {"bert", "moe"}
    assert doc["results"]["bert"] == json.loads(first.read_text())["results"]["bert"]
    assert len(doc["trials"]) == len(json.loads(first.read_text())["trials"]) + 1
    assert doc["args"]["resume"] == str(first) and "earlier" not in doc["args"]


# ----------------------------------------------------------------------------- device-short reruns


class ShortDeviceRunner(pressure.Runner):
    """Every trial's worker is a real process that reports the device short of memory (what a trial
    meets when the device's end, not its cap, stops it); the processes started are counted."""

    def __init__(self, args):
        super().__init__(args)
        self.total, self.starts = 80 << 30, []

    def command(self, t):
        return [sys.executable, "-c", "import json, time; time.sleep(0.5); "
                "print(json.dumps(dict(ooms=1, device_short=True)))"]

    def _start(self, t):
        self.starts.append(t.cap)
        return super()._start(t)


def short_trials(runner, caps):
    runner.peak["bert"] = 1 << 30
    return [pressure.Trial("bert", "gpumem", cap, True, 1) for cap in caps]


def test_a_trial_short_of_device_memory_beside_others_runs_again_alone():
    runner = ShortDeviceRunner(pressure.parse_args(["--workloads", "bert", "--jobs", "2"]))
    trials = short_trials(runner, [1.0, 1.01])
    runner.parallel(trials)
    assert sorted(runner.starts) == [1.0, 1.0, 1.01, 1.01]  # both ran together, then each alone
    assert all(t.result["device_short"] for t in trials) and len(runner.log) == 4


def test_a_trial_short_of_device_memory_that_ran_alone_is_not_run_again():
    # --bound device runs one trial at a time: a device short of memory is the bound itself
    args = pressure.parse_args(["--workloads", "bert", "--bound", "device"])
    assert args.jobs == 1
    runner = ShortDeviceRunner(args)
    runner.parallel(short_trials(runner, [1.0, 1.01]))
    assert runner.starts == [1.0, 1.01] and len(runner.log) == 2


def test_a_gpumem_name_with_a_build_directory_runs_that_build(tmp_path):
    """`gpumem@DIR` (and a configuration with keys, `gpumem+stitch_slack:0.02@DIR`): the worker imports
    the gpumem package installed in DIR, not the one installed here, so that two builds of the pool
    take turns in one lockstep run; a DIR with no gpumem package is refused before anything starts."""
    import shutil

    import gpumem

    build = tmp_path / "other-build"
    shutil.copytree(Path(gpumem.__file__).parent, build / "gpumem")  # a real build, copied
    from pressure_workloads import is_allocator, split_build

    assert split_build(f"gpumem+stitch_slack:0.02@{build}") == ("gpumem+stitch_slack:0.02", str(build))
    assert gpumem_conf(f"gpumem+stitch_slack:0.02@{build}") == GPUMEM_CONF["gpumem"] + ",stitch_slack:0.02"
    assert is_allocator(f"gpumem@{build}") and is_allocator(f"gpumem_hw@{build}")
    assert not is_allocator(f"gpumem@{tmp_path / 'missing'}") and not is_allocator(f"native@{build}")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import pressure_workloads as w; "
            "w.select_allocator(sys.argv[2], None); import gpumem; print(gpumem.__file__)")
    found = subprocess.run([sys.executable, "-c", code, str(BENCH), f"gpumem@{build}"], capture_output=True,
                           text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip().splitlines()[-1] == str(build / "gpumem" / "__init__.py")
    r = run("--allocators", f"native,gpumem,gpumem@{tmp_path / 'missing'}", script="lockstep.py")
    assert r.returncode == 2 and f"gpumem@{tmp_path / 'missing'}" in r.stderr
    r = run("allocfree", f"gpumem@{tmp_path / 'missing'}", script="pressure_workloads.py")
    assert r.returncode == 2 and "holds a gpumem package" in r.stderr


def test_the_table_names_each_workloads_page_floor():
    """Under the rows, each workload's P and its page floor: P rounded up to whole 2 MiB pages, / P. On
    allocfree's saved GPU run (P 986,985,472 B, 941.3 MiB) that is 471 pages, 1.0008x: no allocator
    whose reserved memory the cap bounds in whole pages goes below it, whatever its placement."""
    P = 986_985_472
    assert pressure.page_floor(P) == 471 * (2 << 20) / P
    assert pressure.page_floor(4 << 20) == 1.0 and pressure.page_floor((4 << 20) + 1) > 1.49
    assert pressure.page_floor(None) is None and pressure.page_floor(0) is None
    text = pressure.table({"allocfree": dict(peak_allocated=P, rows=table_rows())})
    assert "allocfree: P 941.3 MiB; page floor 1.0008x (471 pages of 2 MiB, every page full)" in text
    assert "page floor" not in pressure.table({"moe": dict(rows=table_rows())}).splitlines()[-2]


def test_the_records_page_floor_of_allocfree_is_the_saved_runs():
    """docs/benchmarks.md, the packed small arenas' GPU figures: allocfree's page floor and the pages that
    cudaMallocAsync's and gpumem's caps come to are those of the saved search."""
    import gzip
    saved = json.load(gzip.open(BENCH / "results" / "packed-small-2026-12-06" / "allocfree_pressure.json.gz"))
    res = saved["results"]["allocfree"]
    P, rows = res["peak_allocated"], {r["allocator"]: r for r in res["rows"]}
    pages = lambda cap: cap * P / (2 << 20)  # noqa: E731
    record = " ".join((BENCH.parent / "docs" / "benchmarks.md").read_text().split())
    assert (f"P is {P / (1 << 20):.1f} MiB, which takes at least {-(-P // (2 << 20))} pages of 2 MiB, the "
            f"**page floor** of {pressure.page_floor(P):.4f}x") in record
    assert f"cudaMallocAsync's passing {rows['async']['lowest_cap']} is {pages(rows['async']['lowest_cap']):.1f} pages'" in record
    g = rows["gpumem"]
    assert (f"gpumem passes at {g['lowest_cap']} ({pages(g['lowest_cap']):.1f} pages) and fails at "
            f"{g['highest_failing']} ({pages(g['highest_failing']):.1f})") in record
    assert int(pages(g["lowest_cap"])) == -(-P // (2 << 20)) + 1 > pages(g["highest_failing"])
