"""bench/lockstep.py without a GPU: its workers (bench/pressure_workloads.py --lockstep) take turns and
end when told, the driver runs every round and keeps to its budget, and the comparison pairs each
round's passes and leaves out those with OOM steps. The step times themselves need the GPU machine."""
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import lockstep  # noqa: E402  (imports no torch)


def ratio_of(table: str, allocator: str) -> str:
    """The median per-round ratio that a printed table gives `allocator` (its row's fourth column)."""
    return next(line.split()[3] for line in table.splitlines() if line.split()[:1] == [allocator])


def run(*args, script="lockstep.py", stdin=None):
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=300, input=stdin)


def test_a_lockstep_worker_runs_one_pass_per_line_and_stops_at_the_end_of_its_input():
    r = run("bert", "none", "--device", "cpu", "--tiny", "--passes", "3", "--lockstep",
            script="pressure_workloads.py", stdin="go\ngo\n")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    passes = [json.loads(x[5:]) for x in lines if x.startswith("PASS ")]
    assert len(passes) == 2  # two lines, two passes; the third waited for a line that never came
    assert all(p["step_ms"] > 0 and p["ooms"] == 0 for p in passes)
    final = json.loads(lines[-1])
    assert len(final["pass_step_ms"]) == 2 and final["pass_step_ms"][1] == pytest.approx(passes[1]["step_ms"])


def test_workers_take_turns_through_every_round_on_the_cpu(tmp_path):
    out = tmp_path / "ls.json"
    r = run("--device", "cpu", "--workloads", "bert,allocfree", "--allocators", "gpumem,native",
            "--rounds", "3", "--json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    for w in ("bert", "allocfree"):
        group = data[w]["uncapped"]["group"]
        assert list(group) == ["native", "gpumem"]  # native first: its first pass gives P
        for a, v in group.items():
            assert v["error"] is None and len(v["rounds"]) == 4, (w, a)
            assert all(p["step_ms"] > 0 for p in v["rounds"])
            assert len(v["final"]["pass_step_ms"]) == 4  # the worker's own record of the same passes
        assert data[w]["uncapped"]["cut"] is False
        s = data[w]["uncapped"]["summary"]
        assert s["compared_rounds"] == 3 and s["reference"] == "native"
        assert len(s["allocators"]["gpumem"]["ratios"]) == 3
        assert f"{w} uncapped: 3 rounds compared; reference native" in r.stdout
    assert "round 0 (first pass, not compared)" in r.stderr and "round 3:" in r.stderr


def test_a_run_cut_short_leaves_every_round_it_finished(tmp_path):
    """--json is written again after every round: a run killed mid-group (a GPU call's time limit) leaves
    the rounds it finished, the group marked cut, and --from-json prints them, saying so."""
    import time

    out = tmp_path / "ls.json"
    proc = subprocess.Popen([sys.executable, str(BENCH / "lockstep.py"), "--device", "cpu", "--workloads",
                             "allocfree", "--allocators", "native,gpumem", "--rounds", "10000", "--budget-s",
                             "300", "--json", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        rounds = 0
        while rounds < 4 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            try:
                group = json.loads(out.read_text())["allocfree"]["uncapped"]["group"]
                rounds = len(group["native"]["rounds"])
            except (FileNotFoundError, json.JSONDecodeError, KeyError):
                pass  # not written yet (the file is renamed into place whole: never half written)
        assert rounds >= 4, "no rounds written while the run went on"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    saved = json.loads(out.read_text())["allocfree"]["uncapped"]
    assert saved["cut"] is True and saved["group"]["gpumem"]["final"] == {}
    n = len(saved["group"]["native"]["rounds"])
    assert n >= 4 and len(saved["group"]["gpumem"]["rounds"]) == n
    r = run("--from-json", str(out))
    assert r.returncode == 0, r.stderr
    assert f"allocfree uncapped (cut short): {n - 1} rounds compared" in r.stdout


def test_the_budget_ends_a_group_after_one_compared_round_and_the_workers_exit_cleanly(tmp_path):
    out = tmp_path / "ls.json"
    r = run("--device", "cpu", "--workloads", "moe", "--allocators", "native,expandable", "--rounds", "50",
            "--budget-s", "0.001", "--json", str(out))
    assert r.returncode == 0, r.stderr
    group = json.loads(out.read_text())["moe"]["uncapped"]["group"]
    for v in group.values():
        assert v["error"] is None and len(v["rounds"]) == 2
        assert len(v["final"]["pass_step_ms"]) == 2  # told to stop: 2 of its 51 passes, then its JSON line
    assert "budget of 0 s spent after 1 compared rounds" in r.stderr


@pytest.mark.parametrize("first_pass", ["turns", "together"])
def test_round_0_runs_in_turns_or_every_first_pass_at_once(tmp_path, first_pass):
    out = tmp_path / "ls.json"
    r = run("--device", "cpu", "--workloads", "bert", "--allocators", "native,gpumem,expandable",
            "--rounds", "2", "--first-pass", first_pass, "--json", str(out))
    assert r.returncode == 0, r.stderr
    group = json.loads(out.read_text())["bert"]["uncapped"]["group"]
    first = [group[a]["rounds"][0] for a in ("native", "gpumem", "expandable")]
    # sent: when the driver gave the worker its turn; collected: when it read the pass's figures.
    if first_pass == "together":  # every worker had its turn before the first pass was read
        assert max(p["sent"] for p in first) < min(p["collected"] for p in first)
    else:  # each had its turn once the one before had been read
        assert all(b["sent"] > a["collected"] for a, b in zip(first, first[1:]))
    for r in (1, 2):  # the compared rounds take turns either way
        turns = sorted((group[a]["rounds"][r] for a in group), key=lambda p: p["sent"])
        assert all(b["sent"] > a["collected"] for a, b in zip(turns, turns[1:]))
    assert json.loads(out.read_text())["bert"]["uncapped"]["summary"]["compared_rounds"] == 2


def test_a_gpumem_configuration_with_added_keys_is_a_worker_of_its_own(tmp_path):
    from pressure_workloads import gpumem_conf

    assert gpumem_conf("gpumem+stitch_slack:0.015+page_size:2MiB") == \
        "release:lazy,stitch:true,stitch_slack:0.015,page_size:2MiB"
    assert gpumem_conf("gpumem_nostitch") == "release:lazy,stitch:false"
    assert gpumem_conf("native+stitch_slack:0.1") is None and gpumem_conf("gpumem+") is None
    out = tmp_path / "ls.json"
    r = run("--device", "cpu", "--workloads", "bert", "--allocators", "native,gpumem,gpumem+stitch_slack:0.02",
            "--rounds", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    group = json.loads(out.read_text())["bert"]["uncapped"]["group"]
    assert list(group) == ["native", "gpumem", "gpumem+stitch_slack:0.02"]
    assert "gpumem+stitch_slack:0.02" in r.stdout
    bad = run("bert", "gpumem+", "--device", "cpu", "--tiny", script="pressure_workloads.py")
    assert bad.returncode == 2 and "nor gpumem+KEY:VALUE" in bad.stderr


def test_saved_runs_are_merged_round_by_round_and_bad_files_refused(tmp_path):
    files = []
    for i, rounds in enumerate((2, 3)):
        files.append(tmp_path / f"run{i}.json")
        r = run("--device", "cpu", "--workloads", "allocfree", "--allocators", "native,expandable,gpumem",
                "--rounds", str(rounds), "--json", str(files[-1]))
        assert r.returncode == 0, r.stderr
    runs = [json.loads(f.read_text())["allocfree"]["uncapped"]["group"] for f in files]
    merged = lockstep.merge_groups(runs)
    for a in ("native", "expandable", "gpumem"):  # the first run's round 0, then 2 + 3 compared rounds
        assert merged[a]["rounds"] == runs[0][a]["rounds"] + runs[1][a]["rounds"][1:]
    s = lockstep.summarize(merged, capped=False, reference="expandable")
    assert s["compared_rounds"] == 5 and s["reference"] == "expandable"
    assert s["allocators"]["gpumem"]["ratio_rounds"] == 5
    r = run("--from-json", *map(str, files), "--reference", "expandable")
    assert r.returncode == 0, r.stderr
    assert "allocfree uncapped (2 runs merged): 5 rounds compared; reference expandable" in r.stdout
    (tmp_path / "bad.json").write_text("[1, 2]")
    (tmp_path / "cut.json.gz").write_bytes(b"\x1f\x8b\x08\x00")
    for bad, words in ((tmp_path / "missing.json", "No such file"), (tmp_path / "bad.json", "not a lockstep"),
                       (tmp_path / "cut.json.gz", "cut.json.gz:")):
        r = run("--from-json", str(files[0]), str(bad))
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run("--from-json", str(files[0]), "--reference", "async")
    assert r.returncode == 2 and "reference 'async' is not among" in r.stderr
    r = run("--allocators", "native,gpumem", "--reference", "expandable")
    assert r.returncode == 2 and "--reference expandable is not among --allocators" in r.stderr


def test_the_records_pooled_figures_come_from_the_saved_runs():
    """docs/benchmarks.md, "More rounds" and "stitch_slack": the GPU runs' files give the figures it
    quotes."""
    saved = Path(__file__).resolve().parents[1] / "bench" / "results" / "lockstep-2026-11-27"
    r = run("--from-json", *(str(saved / f"ckpt_call{i}.json.gz") for i in (2, 3, 4)), "--reference", "expandable")
    assert r.returncode == 0, r.stderr
    assert "ckpt uncapped (3 runs merged): 69 rounds compared" in r.stdout
    assert any(line.split()[:4] == ["gpumem", "108.46", "0", "1.0180"] for line in r.stdout.splitlines())
    r = run("--from-json", *(str(saved / f"ckpt_call{i}.json.gz") for i in (3, 4)), "--reference", "expandable")
    assert any(line.split()[:4] == ["gpumem+stitch_slack:0.02", "107.20", "0", "1.0075"]
               for line in r.stdout.splitlines()), r.stdout
    r = run("--from-json", *(str(saved / f"generate_call{i}.json.gz") for i in (1, 2)))
    assert any(line.split()[:4] == ["gpumem", "472.75", "0", "0.9858"] for line in r.stdout.splitlines())


def test_the_early_ends_by_page_figures_come_from_the_saved_runs():
    """docs/benchmarks.md, "early_ends_by_page": ckpt at 1.05x over expandable_segments (1.035 with the
    default, 1.047 with the rule off) and bert (0.798, 0.847), from the saved runs of that GPU call."""
    saved = Path(__file__).resolve().parents[1] / "bench" / "results" / "early-ends-2026-11-27"
    r = run("--from-json", str(saved / "ckpt_call5.json.gz"), "--reference", "expandable")
    assert r.returncode == 0, r.stderr
    capped = r.stdout.split("ckpt at 1.05x")[1].splitlines()
    assert any(line.split()[:4] == ["gpumem", "99.96", "0", "1.0350"] for line in capped), r.stdout
    assert any(line.split()[:4] == ["gpumem+early_ends_by_page:0", "102.94", "0", "1.0473"] for line in capped)
    r = run("--from-json", str(saved / "bert_call4.json.gz"))
    capped = r.stdout.split("bert at 1.05x")[1].splitlines()
    assert any(line.split()[:4] == ["gpumem", "22.37", "0", "0.7978"] for line in capped), r.stdout
    pressure = json.loads(gzip.decompress((saved / "pressure_call4.json.gz").read_bytes()))
    caps = {w: {row["allocator"]: row["lowest_cap"] for row in result["rows"]}
            for w, result in pressure["results"].items()}
    assert caps["ckpt"]["gpumem"] == 1.0089 and caps["ckpt"]["gpumem+early_ends_by_page:0"] == 1.01
    assert caps["bert"]["gpumem"] == 1.0085 and caps["bert"]["gpumem+early_ends_by_page:0"] == 1.01


def test_the_driver_fit_of_the_saved_ckpt_runs():
    """At 1.05x the step over expandable_segments' follows gpumem's driver time (the fit in
    docs/benchmarks.md); uncapped it does not."""
    saved = BENCH / "results"
    r = run("--from-json", str(saved / "early-ends-2026-11-27" / "ckpt_call5.json.gz"), "--reference", "expandable")
    assert r.returncode == 0, r.stderr
    uncapped, capped = r.stdout.split("ckpt at 1.05x")
    assert ("  gpumem: step - expandable's = -2.56 ms + 0.55 x (driver + wait ms a step), r 0.61, 14 rounds"
            in capped.splitlines()), capped
    assert ("  gpumem+early_ends_by_page:0: step - expandable's = -5.03 ms + 0.78 x (driver + wait ms a step), "
            "r 0.91, 14 rounds" in capped.splitlines())
    assert "  gpumem: step - expandable's = +1.60 ms + 0.46 x (driver + wait ms a step), r 0.26, 13 rounds" in uncapped
    r = run("--from-json", str(saved / "lockstep-2026-11-27" / "ckpt_call2.json.gz"), "--reference", "expandable")
    assert "  gpumem: step - expandable's = -1.86 ms + 0.70 x (driver + wait ms a step), r 0.61, 17 rounds" in r.stdout
    record = (BENCH.parent / "docs" / "benchmarks.md").read_text()
    record = record[record.index("**What ckpt's difference follows**"):][:2000]
    for quoted in ("| **-2.56 ms + 0.55 x, r 0.61** (14) |", "| **-5.03 ms + 0.78 x, r 0.91** (14) |",
                   "| +1.60 ms + 0.46 x, r 0.26 (13 rounds) |", "| -1.86 ms + 0.70 x, r 0.61 (17) |"):
        assert quoted in record, quoted


def test_the_driver_fit_is_the_least_squares_line_of_the_rounds():
    def rounds(*ms_driver_wait):
        return [dict(step_ms=ms, ooms=0, device_calls=1.0, driver_ms=d, wait_ms=w) for ms, d, w in ms_driver_wait]
    ref = [dict(step_ms=ms, ooms=0, device_calls=None, driver_ms=None) for ms in (50, 100, 100, 100, 100)]
    group = {
        "expandable": dict(rounds=ref, error=None, final={}),
        # step - 100 = -2 + 0.5 (driver + wait), exactly: r 1
        "gpumem": dict(rounds=rounds((50, 0, 0), (99, 2, 0), (100, 3, 1), (101, 6, 0), (102, 7, 1)),
                       error=None, final={}),
    }
    fit = lockstep.summarize(group, capped=True)["allocators"]["gpumem"]["driver_fit"]
    assert fit["intercept_ms"] == pytest.approx(-2) and fit["slope"] == pytest.approx(0.5)
    assert fit["r"] == pytest.approx(1) and fit["rounds"] == 4
    assert "gpumem: step - expandable's = -2.00 ms + 0.50 x (driver + wait ms a step), r 1.00, 4 rounds" in (
        lockstep.table("w", "at 1.05x", lockstep.summarize(group, capped=True)))
    assert lockstep.summarize(group, capped=True)["allocators"]["expandable"].get("driver_fit") is None
    same = dict(group, gpumem=dict(rounds=rounds(*[(100, 3, 0)] * 5), error=None, final={}))
    assert lockstep.summarize(same, capped=True)["allocators"]["gpumem"]["driver_fit"] is None  # no spread
    few = {a: dict(v, rounds=v["rounds"][:3]) for a, v in group.items()}
    assert lockstep.summarize(few, capped=True)["allocators"]["gpumem"]["driver_fit"] is None  # 2 rounds


def passes(*ms_and_ooms):
    return [dict(step_ms=ms, ooms=ooms, device_calls=None, driver_ms=None) for ms, ooms in ms_and_ooms]


def test_the_summary_pairs_rounds_and_leaves_out_the_passes_with_oom_steps():
    group = {
        "native": dict(rounds=passes((50, 0), (9, 3), (9, 3), (9, 3)), error=None, final={}),
        "expandable": dict(rounds=passes((50, 0), (10, 0), (20, 0), (12, 1)), error=None, final={}),
        "gpumem": dict(rounds=passes((50, 0), (10.5, 0), (19, 0), (11, 0)), error=None, final={}),
    }
    s = lockstep.summarize(group, capped=True)
    assert s["reference"] == "expandable" and s["compared_rounds"] == 3
    g = s["allocators"]["gpumem"]
    # Round 3: expandable had an OOM step, so gpumem's pass there is compared with nothing.
    assert g["ratios"] == pytest.approx([1.05, 0.95]) and g["ratio_rounds"] == 2
    assert g["median_ms"] == 11 and g["ooms_per_pass"] == 0
    assert "ratio" not in s["allocators"]["native"]  # OOM steps in every round: no time to compare
    assert s["allocators"]["native"]["ooms_per_pass"] == 3
    # Uncapped the reference is the fastest PyTorch allocator over its rounds without OOM steps.
    assert lockstep.summarize(group, capped=False)["reference"] == "expandable"
    table = lockstep.table("moe", "at 1.05x", s)
    assert "target: median ratio <= 1.00" in table
    row = next(x for x in table.splitlines() if x.startswith("gpumem"))
    assert row.split()[3:8] == ["1.0000", "0.9750", "1.0250", "2", "met"]  # the median of 1.05 and 0.95
    row = next(x for x in table.splitlines() if x.startswith("native"))
    assert row.split()[2] == "3" and " - " in row


def test_a_worker_that_failed_leaves_its_rounds_out_and_is_reported():
    group = {
        "native": dict(rounds=passes((50, 0), (10, 0), (10, 0)), error=None, final={}),
        "gpumem": dict(rounds=[*passes((50, 0), (10, 0)), None], error="exited (code 1): boom", final={}),
    }
    s = lockstep.summarize(group, capped=False)
    assert s["compared_rounds"] == 1 and s["allocators"]["gpumem"]["ratios"] == [1.0]
    assert "exited (code 1): boom" in lockstep.table("bert", "uncapped", s)


@pytest.mark.parametrize("args, message", [
    (["--allocators", "gpumem"], "two or more distinct"),
    (["--allocators", "gpumem,gpumem"], "two or more distinct"),
    (["--allocators", "gpumem,gpumem_hw"], "needs a PyTorch allocator"),
    (["--allocators", "native,rmm"], "two or more distinct"),
    (["--allocators", "native,gpumem+"], "two or more distinct"),
    (["--allocators", "native,async+stitch_slack:0.1"], "two or more distinct"),
    (["--allocators", "expandable,gpumem", "--cap", "1.05"], "needs native"),
    (["--cap", "9"], "0.5 <= K <= 4"),
    (["--workloads", "nope"], "unknown workload"),
    (["--rounds", "0"], "at least 1"),
])
def test_bad_arguments_are_refused(args, message):
    r = run(*args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_the_park_lent_figures_come_from_the_saved_runs():
    """docs/benchmarks.md, "park_lent": at 1.05x over expandable_segments ckpt 0.9944 off / 0.9701 on, bert
    0.8593 / 0.7945, from the saved runs of that GPU call, and the record (docs/benchmarks.md) quotes them."""
    saved = BENCH / "results" / "park-lent-2026-11-28"
    quoted = {}
    for workload in ("ckpt", "bert"):
        r = run("--from-json", str(saved / f"{workload}.json.gz"))
        assert r.returncode == 0, r.stderr
        capped = r.stdout.split(f"{workload} at 1.05x")[1].splitlines()
        rows = {line.split()[0]: line.split() for line in capped if line.startswith("gpumem")}
        quoted[workload] = (rows["gpumem"][3], rows["gpumem+park_lent:true"][3])
    assert quoted == {"ckpt": ("0.9944", "0.9701"), "bert": ("0.8593", "0.7945")}
    record = (BENCH.parent / "docs" / "benchmarks.md").read_text()
    section = record[record.index("**park_lent: what a step at 1.05x remaps"):][:6000]
    for workload, (off, on) in quoted.items():
        assert f"| {off} (" in section and f"/ **{on}** (" in section, workload


def test_the_packed_small_figures_come_from_the_saved_runs():
    """docs/benchmarks.md, "Packed small arenas": allocfree in lockstep on one H100, gpumem over the reference
    0.9456 uncapped and 0.8914 at 1.05x, and the pressure search's lowest fractions, from the saved
    runs, quoted by docs/benchmarks.md."""
    saved = BENCH / "results" / "packed-small-2026-12-06"
    r = run("--from-json", str(saved / "allocfree_lockstep.json.gz"))
    assert r.returncode == 0, r.stderr
    uncapped, capped = r.stdout.split("allocfree at 1.05x")
    ratio = {"uncapped": ratio_of(uncapped, "gpumem"), "1.05x": ratio_of(capped, "gpumem")}
    assert ratio == {"uncapped": "0.9456", "1.05x": "0.8914"}
    with gzip.open(saved / "allocfree_pressure.json.gz", "rt") as f:
        rows = json.load(f)["results"]["allocfree"]["rows"]
    lowest = {row["allocator"]: row["lowest_cap"] for row in rows}
    record = (BENCH.parent / "docs" / "benchmarks.md").read_text()
    section = record[record.index("**Packed small arenas**"):][:9000]
    for figure in ratio.values():
        assert f"**{figure}**" in section
    for allocator, cap in lowest.items():
        assert f"{cap:.4f}" in section, allocator


def test_the_release_order_figures_come_from_the_saved_runs():
    """docs/benchmarks.md, "Release order": allocfree's device allocations a steady step at 1.01x / 1.02x /
    1.03x, packed pool against large arenas first, the two builds in lockstep (0.8174 at 1.02x, 1.0573
    uncapped where they run the same code), and ckpt uncapped in lockstep (1.0053 over native, 1.0067 over
    expandable_segments), from the saved runs, quoted by docs/benchmarks.md."""
    saved = BENCH / "results" / "release-order-2026-12-06"
    allocs = {}
    for line in (saved / "allocfree_ab.log").read_text().splitlines():
        if line.startswith("F="):
            factor, _, variant, figures = line.split(" ", 3)
            allocs.setdefault((factor[2:], variant), set()).add(json.loads(figures)["steady_device_allocs"])
    assert all(len(runs) == 1 for runs in allocs.values())  # the same in both runs of each
    record = (BENCH.parent / "docs" / "benchmarks.md").read_text()
    section = " ".join(record[record.index("**Release order**"):][:9000].split())  # lines joined
    for factor in ("1.01", "1.02", "1.03"):
        (old,), (new,) = allocs[(factor, "packed(old)")], allocs[(factor, "large-first")]
        assert new < old / 4
        quoted = f"{new:.1f}" if new >= 1 else f"{new:.2f}"
        assert f"at {factor}x {old:.1f} -> **{quoted}**" in section, factor
    ratios = {}
    for reference in ("native", "expandable"):
        r = run("--from-json", str(saved / "ckpt_uncapped_lockstep.json.gz"), "--reference", reference)
        assert r.returncode == 0, r.stderr
        ratios[reference] = ratio_of(r.stdout, "gpumem")
    assert ratios == {"native": "1.0053", "expandable": "1.0067"}
    assert "**1.0053**" in section and "expandable_segments 1.0067" in section
    earlier = BENCH / "results" / "lockstep-2026-11-27"
    r = run("--from-json", str(saved / "ckpt_uncapped_lockstep.json.gz"),
            *(str(earlier / f"ckpt_call{i}.json.gz") for i in (2, 3, 4)), "--reference", "expandable")
    assert "ckpt uncapped (4 runs merged): 86 rounds compared" in r.stdout
    assert any(line.split()[:4] == ["gpumem", "107.13", "0", "1.0157"] for line in r.stdout.splitlines())
    assert "86 rounds: 1.0157" in section and "the four runs pooled 1.0157 over expandable, 86" in record
    r = run("--from-json", str(saved / "allocfree_ab_lockstep.json.gz"), "--reference", "gpumem@/tmp/before")
    assert r.returncode == 0, r.stderr
    uncapped, capped = r.stdout.split("allocfree at 1.02x")
    same_pool, large_first = ratio_of(uncapped, "gpumem"), ratio_of(capped, "gpumem")
    assert (same_pool, large_first) == ("1.0573", "0.8174")
    assert f"**{large_first}**" in section and f"ratio is {same_pool}" in section


def test_a_json_path_ending_in_gz_is_written_gzipped_and_read_back(tmp_path):
    """--json x.json.gz writes gzip (it wrote plain JSON under that name, which --from-json refused)."""
    out = tmp_path / "ls.json.gz"
    r = run("--device", "cpu", "--workloads", "allocfree", "--allocators", "native,gpumem", "--rounds", "1",
            "--json", str(out))
    assert r.returncode == 0, r.stderr
    with gzip.open(out, "rt") as f:
        assert json.load(f)["allocfree"]["uncapped"]["summary"]["compared_rounds"] == 1
    r = run("--from-json", str(out))
    assert r.returncode == 0, r.stderr
    assert "allocfree uncapped: 1 rounds compared; reference native" in r.stdout


def test_the_gc_default_stops_ckpt_figures_come_from_the_saved_runs():
    """docs/benchmarks.md, "Step times in lockstep": ckpt uncapped on one H200 at 6af2891 (1.0057 over native,
    19 rounds) and pooled with the H100 run of fa9604a (the same pool: 1.0055, 36 rounds)."""
    h200 = BENCH / "results" / "gc-default-2026-12-06" / "ckpt_uncapped_lockstep_h200.json.gz"
    h100 = BENCH / "results" / "release-order-2026-12-06" / "ckpt_uncapped_lockstep.json.gz"
    r = run("--from-json", str(h200))
    assert r.returncode == 0, r.stderr
    assert "ckpt uncapped: 19 rounds compared; reference native" in r.stdout
    assert ratio_of(r.stdout, "gpumem") == "1.0057"
    r = run("--from-json", str(h100), str(h200))
    assert r.returncode == 0, r.stderr
    assert "ckpt uncapped (2 runs merged): 36 rounds compared" in r.stdout
    assert ratio_of(r.stdout, "gpumem") == "1.0055"
    record = " ".join((BENCH.parent / "docs" / "benchmarks.md").read_text().split())
    assert "H200, 6af2891, 19 rounds: **1.0057**" in record and "36 rounds: **1.0055**" in record


def saved_peer_comparison(folder, name, record_marker):
    """A peer-kit comparison saved under bench/results/FOLDER: its text, its PEER SUMMARY line and its REAL
    REGRESSIONS section, after checking that the record (docs/benchmarks.md) quotes that line, word for word,
    in the paragraph that starts with `record_marker`."""
    saved = (BENCH / "results" / folder / name).read_text()
    line = next(x for x in saved.splitlines() if x.startswith("PEER SUMMARY:"))
    real = saved.split("== REAL REGRESSIONS")[1].split("\n==")[0]
    record = (BENCH.parent / "docs" / "benchmarks.md").read_text()
    at = record.index(record_marker)
    assert f"```\n{line}\n```" in record[at:at + 1500]
    return saved, line, real


def test_the_records_peer_line_at_6af2891_is_the_saved_comparisons():
    """docs/benchmarks.md, "PyTorch's own allocator tests": the PEER SUMMARY line quoted for 6af2891 is the
    last line of the comparison saved from that run, and its one real regression is the one the record
    names."""
    _, line, real = saved_peer_comparison("gc-default-2026-12-06", "peer_compare_h200.txt",
                                          "At 6af2891 (`gc_on_oom` off by default")
    assert "REGRESSIONS 11 (real 1, native-internal 10)" in line
    assert "test_allocated_in_middle_of_segment" in real and "limited_memory" not in real


def test_the_records_peer_line_at_89f74cc_is_the_saved_comparisons():
    """docs/benchmarks.md, "PyTorch's own allocator tests": the PEER SUMMARY line quoted for 89f74cc (one
    H100) is the last line of the comparison saved from that run: one real regression, the one the record
    names, and no test that fails with PyTorch's allocator and passes with gpumem."""
    saved, line, real = saved_peer_comparison("slot-fallback-2026-12-06", "peer_compare_h100.txt",
                                              "At 89f74cc (the pool fixes of the fuzz runs")
    assert "device=NVIDIA H100" in saved and "allocator_backend=gpumem" in saved
    assert "REGRESSIONS 10 (real 1, native-internal 9) | reverse 0" in line
    assert "test_allocated_in_middle_of_segment" in real


def test_the_records_peer_line_at_fa1e1ec_and_its_cascade_are_the_saved_runs():
    """docs/benchmarks.md, "PyTorch's own allocator tests": the PEER SUMMARY line quoted for fa1e1ec (one
    H100) is the saved comparison's, and the saved pair run shows the one real regression passing alone and
    failing only after the native-internal test before it, at the counts the record gives."""
    saved, line, real = saved_peer_comparison("verify-2026-12-06b", "peer_compare_h100.txt",
                                              "At fa1e1ec (the release walk of 08f4b9b")
    assert "device=NVIDIA H100" in saved and "allocator_backend=gpumem" in saved
    assert "REGRESSIONS 10 (real 1, native-internal 9) | reverse 0" in line
    assert "test_allocated_in_middle_of_segment" in real
    alone, pair = (BENCH / "results" / "verify-2026-12-06b" / "peer_cascade_h100.txt").read_text().split("\n\n")
    assert "test_allocated_in_middle_of_segment PASSED" in alone and "1 tests: 1 passed" in alone
    assert pair.index("test_allocate_in_thread_to_pool FAILED") < pair.index("test_allocated_in_middle_of_segment FAILED")
    assert "Expected 4 but got 2." in pair and "Expected 0 but got 2." in pair and "Expected 2 but got 0." in pair


def test_the_records_peer_line_on_the_final_pool_is_the_saved_comparison():
    """docs/benchmarks.md, "PyTorch's own allocator tests": the PEER SUMMARY line quoted for the final pool
    (4268269's build, one H100, 2026-12-07) is the saved comparison's last line: the same one real
    regression, the cascade, and no test that fails with PyTorch's allocator and passes with gpumem."""
    saved, line, real = saved_peer_comparison("verify-2026-12-07", "peer_compare_h100.txt",
                                              "On the final pool (the build of 4268269")
    assert "device=NVIDIA H100" in saved and "allocator_backend=gpumem" in saved
    assert "REGRESSIONS 10 (real 1, native-internal 9) | reverse 0" in line and "incomplete 0" in line
    assert "test_allocated_in_middle_of_segment" in real and "Expected 2 but got 0." in real
