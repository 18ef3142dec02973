"""The benchmarks run from a clone of this repository alone, without a GPU as far as they can: every
script in bench/ answers --help from any folder, the workloads import and list without CUDA (and without
torch), each workload's code runs a tiny step on the CPU and reports the figures compare_allocators.py
tabulates, and compare_allocators.py makes its table from whatever a workloads file prints.
Nothing here measures anything: the figures need the GPU machine (tools/gpu_session.sh)."""
import gzip
import json
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
BENCH = ROOT / "bench"
SCRIPTS = ["compare_allocators.py", "soak.py", "batch_size_bench.py", "compile_bench.py", "workloads.py",
           "pressure.py", "pressure_workloads.py", "fsdp_bench.py", "mixed_pipeline.py", "report_bench.py",
           "growth_cost.py", "record_trace.py", "remap_at_cap.py", "lockstep.py", "vmm_unit_costs.py", "host_cost.py"]


def run(args, cwd, **kw):
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=120, **kw)


def test_bench_holds_benchmarks_and_tools_the_test_tooling():
    py = {p.name for p in BENCH.glob("*.py")}
    assert py == set(SCRIPTS) | {"models.py", "batch_size_workloads.py"}, py
    assert {p.name for p in (ROOT / "tools").iterdir()} >= {
        "compute_sanitizer.sh", "sanitizer_summary.py", "sanitizer_frames_check.py", "gpu_session.sh"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_from_any_folder(script, tmp_path):
    r = run([BENCH / script, "--help"], cwd=tmp_path)
    if r.returncode != 0 and "No module named 'torch'" in r.stderr:
        pytest.skip(f"{script} needs torch to start")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: " + script), r.stdout[:200]


def test_workloads_import_and_list_without_cuda_or_torch(tmp_path):
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(BENCH)!r})
        import workloads
        assert "torch" not in sys.modules, "importing workloads imported torch"
        print(json.dumps({{name: list(w.figures) for name, w in workloads.WORKLOADS.items()}}))
        print(json.dumps(list(workloads.ALLOCATORS)))
    """)
    r = run(["-c", code], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    figures, allocators = map(json.loads, r.stdout.splitlines())
    assert figures == {"allocfree": ["us_per_alloc"], "varlen": ["step_ms", "frag_ratio"],
                       "resnet": ["step_ms", "frag_ratio"]}
    assert allocators == ["native", "expandable", "async", "gpumem"]
    r = run([BENCH / "workloads.py", "--list"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [line.split()[0] for line in r.stdout.splitlines()] == ["allocfree", "varlen", "resnet"]


def test_workload_without_cuda_says_so(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the workload would run for real")
    r = run([BENCH / "workloads.py", "varlen", "native"], cwd=tmp_path)
    assert r.returncode == 1 and "needs a CUDA GPU" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def workloads():
    pytest.importorskip("torch")
    sys.path.insert(0, str(BENCH))
    try:
        import workloads as w

        yield w
    finally:
        sys.path.remove(str(BENCH))


TINY = {
    "allocfree": dict(n=300),
    "varlen": dict(steps=2, tokens=64, lengths=(16, 32), vocab=128, d=32, layers=1, heads=2),
    "resnet": dict(steps=1, warmup=1, batch=2, image=32),
}


@pytest.mark.parametrize("name", list(TINY))
def test_each_workload_runs_tiny_on_the_cpu(workloads, name):
    w = workloads.WORKLOADS[name]
    result = w.run(device="cpu", **TINY[name])
    # frag_ratio comes from torch's CUDA allocator statistics, after the run (workloads.main)
    for figure in set(w.figures) - {"frag_ratio"}:
        assert result[figure] > 0, result


def test_models(workloads):
    import torch

    models = workloads.models()
    assert workloads.GPT is models.GPT
    net = models.resnet50()
    assert sum(p.numel() for p in net.parameters()) == 25_557_032  # torchvision's ResNet-50
    with torch.no_grad():
        assert net(torch.randn(1, 3, 64, 64)).shape == (1, 1000)
    if not torch.cuda.is_available():
        assert models.cudagraph_tree_counts(torch) == (None, None)


def test_varlen_shapes_keep_the_token_budget(workloads):
    import random

    rng = random.Random(0)
    for _ in range(100):
        batch, seq = workloads.varlen_shape(rng, 16384)
        assert seq in workloads.SEQ_LENGTHS and abs(batch * seq - 16384) < 3 * seq


def test_compare_allocators_tabulates_a_workloads_file(tmp_path):
    fake = tmp_path / "fake_workloads.py"
    fake.write_text(textwrap.dedent("""
        import json, sys
        workload, allocator = sys.argv[1], sys.argv[2]
        scale = {"native": 1.0, "expandable": 1.1, "async": 1.2, "gpumem": 0.9}[allocator]
        print("noise on stdout")
        print(json.dumps(dict(workload=workload, allocator=allocator, us_per_alloc=2.0 * scale,
                              step_ms=10.0 * scale, frag_ratio=1.5 if allocator == "native" else 1.01)))
    """))
    r = run([BENCH / "compare_allocators.py", "--workloads", fake, "--rounds", "1"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in r.stdout.splitlines()
            if re.match(r"(allocfree|varlen|resnet) ", line)}
    assert set(rows) == {("allocfree", "us_per_alloc"), ("varlen", "step_ms"), ("varlen", "frag_ratio"),
                         ("resnet", "step_ms"), ("resnet", "frag_ratio")}
    assert rows[("allocfree", "us_per_alloc")] == ["2.000", "2.200", "2.400", "1.800", "0.900"]
    assert rows[("varlen", "frag_ratio")][-1] == "1.000"
    summary = json.loads(r.stdout.splitlines()[-1])
    assert summary["errors"] == {}
    assert summary["summary"]["resnet.step_ms"]["gpumem_over_best"] == pytest.approx(0.9)


def test_vmm_unit_costs_without_a_driver_says_so_and_checks_its_arguments(tmp_path):
    if any(Path(d, "libcuda.so.1").exists() for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")):
        pytest.skip("this machine has a CUDA driver: the bench would measure")
    r = run([BENCH / "vmm_unit_costs.py", "--units", "4", "--repeats", "1"], cwd=tmp_path)
    assert r.returncode == 2 and "needs the CUDA driver (libcuda.so.1)" in r.stderr, r.stderr
    r = run([BENCH / "vmm_unit_costs.py", "--units", "0"], cwd=tmp_path)
    assert r.returncode == 2 and "--units and --repeats must be at least 1" in r.stderr
    r = run([BENCH / "vmm_unit_costs.py", "--unit-mib", "two"], cwd=tmp_path)
    assert r.returncode == 2 and "--unit-mib must be whole MiB" in r.stderr


def test_host_cost_without_a_gpu_says_so_and_checks_its_arguments(tmp_path):
    r = run([BENCH / "host_cost.py", "--pairs", "10"], cwd=tmp_path)
    if r.returncode == 0:
        pytest.skip("this machine has a GPU: the bench measured")
    assert r.returncode == 2 and "host_cost: needs a CUDA GPU" in r.stderr, r.stderr
    r = run([BENCH / "host_cost.py", "--sizes", "1,x"], cwd=tmp_path)
    assert r.returncode == 2 and "--sizes must be whole bytes" in r.stderr
    r = run([BENCH / "host_cost.py", "--live", "0"], cwd=tmp_path)
    assert r.returncode == 2 and "must be at least 1" in r.stderr


def test_vmm_unit_costs_saved_run_gives_the_readmes_table():
    """The README's table of unit costs is the saved H100 run's rows, rounded to 0.1 us."""
    rows = json.loads((BENCH / "results" / "vmm-unit-costs-2026-11-28" / "h100.json").read_text())["rows"]
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("**What a unit costs the driver**"):]
    table = table[:re.search(r"A\s+unit's\s+cost\s+does\s+not\s+depend", table).start()]  # lines rewrap
    how = {"per unit": "one per unit", "whole run": "access and unmap once over the run",
           "whole run, busy": "as above, ~41 ms of work queued on the device"}
    def cells(r):  # a row's five costs as the table prints them
        return " | ".join(f"{r[k]:.1f}" for k in ("create", "map", "access", "unmap", "release"))

    quoted = 0
    for r in rows:
        if r["how"] not in how or (r["how"] == "whole run, busy" and r["unit_mib"] != 8):
            continue
        assert f"| {r['unit_mib']} MiB | {how[r['how']]} | {cells(r)} |" in table, (r, cells(r))
        quoted += 1
    assert quoted == 5
    assert all(r["whole_unmap_accepted"] for r in rows if r["how"].startswith("whole run"))
    short = {("h100_1unit.json", "per unit"): "| 1 | one call each |",
             ("h100_1unit.json", "per unit, busy"): "| 1 | as above, ~40 ms of work queued on the device |",
             ("h100_16units.json", "per unit"): "| 16 | one per unit |",
             ("h100_16units.json", "whole run"): "| 16 | access and unmap once over the run |"}
    for (name, how_), label in short.items():
        saved = json.loads((BENCH / "results" / "vmm-unit-costs-2026-11-28" / name).read_text())
        assert saved["gpu"] == "NVIDIA H100 80GB HBM3"
        (r,) = [r for r in saved["rows"] if r["how"] == how_]
        assert f"{label} {cells(r)} |" in table, (name, how_, cells(r))


def test_host_cost_saved_run_gives_the_records_table():
    """The host-time table of docs/benchmarks.md is the saved H100 run's medians, rounded to whole ns."""
    rows = json.loads((BENCH / "results" / "host-cost-2026-11-28" / "h100.json").read_text())["rows"]
    record = (ROOT / "docs" / "benchmarks.md").read_text()
    table = record[record.index("**The host's time per tensor**"):]
    table = table[:table.index("native and expandable_segments run the same code")]
    assert [r["allocator"] for r in rows] == ["native", "expandable", "async", "gpumem"]
    for r in rows:
        cells = " | ".join(f"{round(r[kind][size]):,}" for size in ("512", "65536", "1048576", "8388608")
                           for kind in ("single", "churn"))
        assert f"| {r['allocator']} | {cells} |" in table, (r["allocator"], cells)


def _mib(nbytes):
    """Whole MiB with thousands separators, as the record quotes the soak's memory."""
    return f"{nbytes // MiB:,}"


def _saved_soak(saved):
    """gpumem's and native's soak runs saved in `saved`, and `bench/soak.py --compare`'s verdict on them;
    gpumem's run on an H100 with no creep, the losses bitwise identical."""
    runs = {n: json.loads((saved / f"soak_{n}.json").read_text()) for n in ("gpumem", "native")}
    g, n = runs["gpumem"], runs["native"]
    assert g["device"].startswith("NVIDIA H100") and (g["allocator"], n["allocator"]) == ("gpumem", "native")
    assert not g["crept"] and g["growth_after_minute1"] == 0
    r = run([BENCH / "soak.py", "--compare", saved / "soak_gpumem.json", saved / "soak_native.json"], ROOT)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["identical"] and result["same_shapes"]
    return g, n, result


def test_the_records_soak_figures_at_89f74cc_are_the_saved_runs():
    """docs/benchmarks.md, "Earlier the same day, the pool of 89f74cc": the soak's steps, reserved MiB and the
    bitwise comparison come from the two runs saved beside the peer comparison (bench/soak.py --compare)."""
    g, n, result = _saved_soak(BENCH / "results" / "slot-fallback-2026-12-06")
    assert result["steps_compared"] == 453
    record = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    at = record.index("Earlier the same day, the pool of 89f74cc")
    section = record[at:at + 2000]
    assert f"{len(g['loss_hex']):,} steps with gpumem, reserved {_mib(g['reserved_minute1_peak'])} MiB" in section
    assert _mib(g["reserved_last_window_peak"]) == _mib(g["reserved_minute1_peak"])
    assert f"up to {_mib(n['reserved_minute1_peak'])} MiB" in section
    assert f"({_mib(n['reserved_last_window_peak'])} MiB in its last window)" in section
    assert f"over the {result['steps_compared']} steps both ran" in section


def test_the_records_soak_and_suite_on_todays_pool_are_the_saved_runs():
    """docs/benchmarks.md, "Reliability on the GPU, today's pool": the 8-minute soak's steps, reserved and
    peak MiB, peak reserved over peak allocated and the bitwise comparison come from the runs saved in
    verify-2026-12-06c, and the suite's counts from the pytest logs saved beside them."""
    saved = BENCH / "results" / "verify-2026-12-06c"
    g, n, result = _saved_soak(saved)
    assert round(g["seconds"] / 60) == 8 and result["steps_compared"] == n["steps"] == 917
    record = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    at = record.index("Reliability on the GPU, today's pool")
    section = record[at:record.index("Earlier the same day, the pool of 89f74cc")]
    assert f"{g['steps']:,} steps with gpumem, reserved {_mib(g['reserved_minute1_peak'])} MiB at minute 1" in section
    assert g["reserved_last_window_peak"] == g["reserved_minute1_peak"]
    assert (f"peak reserved {_mib(g['peak_reserved'])} MiB over peak allocated {_mib(g['peak_allocated'])} MiB, "
            f"**{g['peak_reserved'] / g['peak_allocated']:.4f}**") in section
    assert (f"up to {_mib(n['reserved_minute1_peak'])} MiB in its first minute "
            f"({_mib(n['reserved_last_window_peak'])} MiB in its last window)") in section
    assert (f"peak reserved {_mib(n['peak_reserved'])} MiB over {_mib(n['peak_allocated'])} MiB, "
            f"{n['peak_reserved'] / n['peak_allocated']:.4f}") in section
    assert f"over the {result['steps_compared']} steps both ran" in section
    for log, told in (("suite_part2_rest.log", "34 passed"), ("suite_part3.log", "25 passed, 3 skipped")):
        last = (saved / log).read_text().strip().splitlines()[-1]
        assert re.search(rf"= {told} in [0-9.]+s", last), (log, last)
        assert told in section


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_session_names_its_phases(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "tools" / "gpu_session.sh")], cwd=tmp_path, capture_output=True,
                       text=True, env=dict(os.environ, OUT=str(tmp_path)), timeout=60)
    assert r.returncode == 2
    phases = re.findall(r"tools/gpu_session\.sh (\S+)", r.stdout)
    assert phases == ["build", "suite", "suite-part", "sanitizer", "compare", "mixed", "batch", "ddp",
                      "soak-start", "soak-collect", "report", "peer"]
    assert ".carry" not in (ROOT / "tools" / "gpu_session.sh").read_text()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("kit", [None, "no-such-folder"])
def test_gpu_session_peer_says_what_kit_it_needs(tmp_path, kit):
    env = dict(os.environ, OUT=str(tmp_path))
    env.pop("KIT", None)
    if kit is not None:
        env["KIT"] = str(tmp_path / kit)
    r = subprocess.run(["bash", str(ROOT / "tools" / "gpu_session.sh"), "peer"], cwd=tmp_path, capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 3 and "KIT=DIR, a copy of ../shared/torch_tests" in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_suite_parts_hold_every_gpu_test_file_once(tmp_path):
    listed = []
    for part in ("1", "2", "3"):
        r = subprocess.run(["bash", str(ROOT / "tools" / "gpu_session.sh"), "suite-part", part], cwd=tmp_path,
                           capture_output=True, text=True, env=dict(os.environ, OUT=str(tmp_path), LIST="1"),
                           timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        listed += r.stdout.split()
    every = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "gpu").glob("test_*.py"))
    assert sorted(listed) == every  # a new GPU test file joins a part; none runs twice
    r = subprocess.run(["bash", str(ROOT / "tools" / "gpu_session.sh"), "suite-part", "4"], cwd=tmp_path,
                       capture_output=True, text=True, env=dict(os.environ, OUT=str(tmp_path), LIST="1"), timeout=60)
    assert r.returncode == 2 and "1, 2 or 3" in r.stdout


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("setsid") is None, reason="needs bash, setsid")
@pytest.mark.parametrize("gpus", [1, 2])
def test_gpu_session_soak_runs_the_reference_after_gpumem_on_one_gpu(tmp_path, gpus):
    """soak-start with a stand-in python3 (it answers the GPU count and logs each soak run's start and
    end): with two GPUs the native reference runs on the last one alongside gpumem's run; with one, after
    it (side by side on one H100 the reference's cache ran gpumem's run out of memory, 2026-12-06)."""
    shim = tmp_path / "bin"
    shim.mkdir()
    log = tmp_path / "calls"
    (shim / "python3").write_text(textwrap.dedent(f"""\
        #!/bin/bash
        if [ "$1" = "-c" ]; then echo {gpus}; exit 0; fi
        echo "start $CUDA_VISIBLE_DEVICES $3" >> {log}; sleep 0.5; echo "end $CUDA_VISIBLE_DEVICES $3" >> {log}
        """))
    (shim / "python3").chmod(0o755)
    soak = tmp_path / "soak"
    env = dict(os.environ, OUT=str(tmp_path / "out"), SOAK=str(soak), MINUTES="1.5",
               PATH=f"{shim}:{os.environ['PATH']}")
    r = subprocess.run(["bash", str(ROOT / "tools" / "gpu_session.sh"), "soak-start"], cwd=tmp_path,
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and "soak started" in r.stdout and "collect after" in r.stdout, r.stdout + r.stderr
    assert not r.stderr, r.stderr
    for _ in range(100):
        if (soak / "gpumem.done").exists() and (soak / "native.done").exists():
            break
        time.sleep(0.1)
    calls = log.read_text().splitlines()
    if gpus == 1:
        assert calls == ["start 0 gpumem", "end 0 gpumem", "start 0 native", "end 0 native"]
    else:
        assert sorted(calls) == ["end 0 gpumem", "end 1 native", "start 0 gpumem", "start 1 native"]
        assert calls.index("start 1 native") < calls.index("end 0 gpumem")  # alongside


def test_fsdp_bench_compare_reads_every_rank_and_flags_differing_losses(tmp_path):
    def write(name, allocator, ms, losses_by_rank, reserved):
        for rank, losses in enumerate(losses_by_rank):
            path = tmp_path / (f"{name}.json" if rank == 0 else f"{name}.rank{rank}.json")
            path.write_text(json.dumps(dict(
                allocator=allocator, rank=rank, world_size=len(losses_by_rank), steps=len(losses),
                median_step_ms=ms, max_reserved=reserved, max_allocated=reserved // 2,
                reserved_growth_after_warmup=0, flat=True, loss_hex=[float.hex(x) for x in losses])))

    write("native", "native", 100.0, [[2.0, 1.5, 1.25], [2.5, 1.75, 1.0]], 3 << 30)
    write("gpumem", "gpumem", 101.0, [[2.0, 1.5, 1.25], [2.5, 1.75, 1.0]], 2 << 30)
    write("odd", "gpumem", 99.0, [[2.0, 1.5, 1.25], [2.5, 1.5, 1.0]], 2 << 30)
    r = run([BENCH / "fsdp_bench.py", "--compare", "native.json", "gpumem.json"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.splitlines()[-1])
    assert result["losses_identical"] is True
    gp = [row for row in result["rows"] if row["allocator"] == "gpumem"]
    assert [row["rank"] for row in gp] == [0, 1] and {row["step_time_ratio"] for row in gp} == {1.01}
    assert {row["max_reserved_mib"] for row in gp} == {2048.0}
    r = run([BENCH / "fsdp_bench.py", "--compare", "native.json", "odd.json"], cwd=tmp_path)
    assert r.returncode == 1
    assert "DIFFER@1" in r.stdout  # rank 1, step 1


def test_mixed_pipeline_sizes_span_the_range_and_repeat():
    sys.path.insert(0, str(BENCH))
    try:
        import mixed_pipeline
    finally:
        sys.path.remove(str(BENCH))
    GiB = 1 << 30
    got = mixed_pipeline.sizes(24, 1.0, 0)
    assert len(got) == 24 and got == mixed_pipeline.sizes(24, 1.0, 0)  # same seed, same run
    flat = [s for pair in got for s in pair]
    assert all(0.1 * GiB - 4096 <= s <= 6 * GiB and s % 4096 == 0 for s in flat)
    assert max(flat) / min(flat) > 10  # sizes that vary, so that caching pools fragment
    assert max(s for pair in mixed_pipeline.sizes(24, 0.25, 0) for s in pair) <= 1.5 * GiB


def test_remap_at_cap_replays_a_recorded_trace_and_skips_a_malformed_one(tmp_path):
    """bench/remap_at_cap.py on the recorded BERT-inference trace (3 equal steps): the cap makes the pool
    map more than uncapped, no OOM at 1.02x, and the lowest 0-OOM capacity lies between 1.0x and 1.02x;
    a malformed trace is named on stderr and the others still run."""
    bad = tmp_path / "bad.trace"
    bad.write_text("a 0 512 0\nf 7\n")
    trace = BENCH / "traces" / "fbs_bert.trace.gz"
    r = run([BENCH / "remap_at_cap.py", "--json", bad, trace], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "bad.trace" in r.stderr
    (row,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert row["trace"] == "fbs_bert"
    assert row["x1.02"]["ooms"] == 0 and row["x1.05"]["ooms"] == 0
    assert row["x1.02"]["mapped_bytes"] > row["uncapped"]["mapped_bytes"]
    assert 1.0 < row["min_capacity"] < 1.02


def test_remap_at_cap_counts_the_waits_on_a_lagging_device(tmp_path):
    """--device-lag: the replays run on a device 100 operations behind; the JSON row gives, per cap, the
    waits and the operations the device still had to run for them (never more than the lag per wait)
    and the modelled driver time; uncapped without stitching, nothing is given back, so nothing is
    waited for (stitched, a block landing on a parked position whose memory is busy waits for it)."""
    trace = BENCH / "traces" / "fbs_bert.trace.gz"
    r = run([BENCH / "remap_at_cap.py", "--json", "--device-lag", "100", "--no-stitch", trace], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (row,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert row["device_lag"] == 100 and row["uncapped"]["waits"] == 0
    for cap in ("x1.02", "x1.05"):
        c = row[cap]
        assert c["ooms"] == 0 and c["waits"] > 0
        assert 0 < c["waited_operations"] <= 100 * c["waits"]
        assert c["driver_ms"] > row["uncapped"]["driver_ms"] > 0
    r = run([BENCH / "remap_at_cap.py", "--device-lag", "-3", trace], cwd=tmp_path)
    assert r.returncode == 2 and "--device-lag -3: -3 is negative" in r.stderr


def test_remap_at_cap_under_a_limit_remaps_whole_groups_once_the_pool_has_settled(tmp_path):
    """--bound limit: 1.02x and 1.05x are limits on a full-size device, as a memory fraction on the GPU.
    On the BERT-inference trace's third pass the live high water has long settled, so under the roomy
    1.05x limit the pool remaps whole 8 MiB groups and no longer gives pages back every step: far fewer
    physical units and no wait, where the same 1.05x as the device's capacity (no bound the user set)
    still remaps single pages; 1.02x is within 2% of the high water: both remap the same bytes there.
    early_ends_by_page off: it acts under a limit and not under the device's capacity (not a bound the
    user set), so at 1.02x the two would differ by the first blocks' end pages alone."""
    trace = BENCH / "traces" / "fbs_bert.trace.gz"
    rows = {}
    for bound in ("capacity", "limit"):
        r = run([BENCH / "remap_at_cap.py", "--json", "--no-stitch", "--device-lag", "100", "--passes", "3",
                 "--early-ends-by-page", "0", "--bound", bound, trace], cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        (rows[bound],) = [json.loads(line) for line in r.stdout.splitlines()]
        assert rows[bound]["bound"] == bound and rows[bound]["x1.05"]["ooms"] == 0
    limit, capacity = rows["limit"], rows["capacity"]
    assert capacity["x1.05"]["waits"] > 0 and limit["x1.05"]["waits"] == 0
    assert limit["x1.05"]["physical_units"] * 10 < capacity["x1.05"]["physical_units"]
    assert limit["x1.02"]["mapped_bytes"] == capacity["x1.02"]["mapped_bytes"] > 0
    assert 1.0 < limit["min_capacity"] < 1.02


def test_remap_at_cap_with_memory_held_outside_the_pool(tmp_path):
    """--bound device: 1.02x and 1.05x leave the pool that much of a full-size device, the rest held
    outside it; no OOM, and the table names its last column "min room". --elsewhere-freed-after 1: that
    memory goes back after the first pass, and the third maps nothing at 1.05x (the pool grows into the
    room instead of remapping under what it had learned); the option is refused without --bound device
    or outside the passes."""
    trace = BENCH / "traces" / "bert.trace.gz"
    rows = {}
    for extra in ([], ["--elsewhere-freed-after", "1"]):
        r = run([BENCH / "remap_at_cap.py", "--json", "--no-stitch", "--device-lag", "100", "--passes", "3", "--bound",
                 "device", *extra, trace], cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        (rows[bool(extra)],) = [json.loads(line) for line in r.stdout.splitlines()]
    held, freed = rows[False], rows[True]
    assert held["bound"] == "device" and held["elsewhere_freed_after"] is None
    assert held["x1.05"]["ooms"] == 0 and held["x1.05"]["physical_units"] > 0 and held["x1.05"]["retries"] == 0
    assert freed["elsewhere_freed_after"] == 1 and freed["x1.05"]["ooms"] == 0
    assert freed["x1.05"]["mapped_bytes"] == 0 and freed["x1.05"]["driver_ms"] == 0
    assert 1.0 < held["min_capacity"] < 1.02
    table = run([BENCH / "remap_at_cap.py", "--bound", "device", trace], cwd=tmp_path)
    assert table.returncode == 0 and table.stdout.splitlines()[0].endswith("min room")
    for bad, said in ((["--elsewhere-freed-after", "1", "--passes", "3"], "applies to --bound device"),
                      (["--bound", "device", "--elsewhere-freed-after", "3", "--passes", "3"],
                       "a pass from 1 to --passes - 1 (2)")):
        r = run([BENCH / "remap_at_cap.py", *bad, trace], cwd=tmp_path)
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_remap_at_cap_takes_high_waters_slack(tmp_path):
    """--release high_water --release-slack S: the replays run with that slack (fbs_bert's uncapped
    reserved / live bytes stay within it, where lazy keeps 1.32x); the slack without high_water, or
    outside [0, 1], is refused."""
    trace = BENCH / "traces" / "fbs_bert.trace.gz"
    r = run([BENCH / "remap_at_cap.py", "--json", "--release", "high_water", "--release-slack", "0.03",
             trace], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (row,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert row["release"] == "high_water" and row["release_slack"] == 0.03
    assert 1.0 < row["uncapped"]["fragmentation"] <= 1.035, row["uncapped"]
    for args, message in ((["--release-slack", "0.03"], "--release-slack applies to --release high_water"),
                          (["--release", "high_water", "--release-slack", "2"],
                           "argument --release-slack: must be in [0, 1], got 2.0")):
        r = run([BENCH / "remap_at_cap.py", *args, trace], cwd=tmp_path)
        assert r.returncode == 2 and message in r.stderr, r.stderr


def test_remap_at_cap_gives_a_row_per_lag_and_the_last_pass(tmp_path):
    """--device-lag 20,100 --passes 2: one row per lag, each the second pass of the trace in one pool
    (uncapped without stitching, nothing is mapped again; capped, no OOM), the lowest capacity a single
    pass's; a lag list that is not numbers, or passes below 1, is one line on stderr."""
    trace = BENCH / "traces" / "fbs_bert.trace.gz"
    r = run([BENCH / "remap_at_cap.py", "--json", "--no-stitch", "--device-lag", "20,100", "--passes", "2", trace],
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["device_lag"] for row in rows] == [20, 100] and {row["passes"] for row in rows} == {2}
    for row in rows:
        assert row["uncapped"]["mapped_bytes"] == 0 and row["uncapped"]["driver_ms"] == 0
        assert row["x1.02"]["ooms"] == 0 and row["x1.02"]["mapped_bytes"] > 0
        assert 1.0 < row["min_capacity"] < 1.02
    table = run([BENCH / "remap_at_cap.py", "--device-lag", "20,100", trace], cwd=tmp_path)
    assert table.returncode == 0 and [ln.split()[:2] for ln in table.stdout.splitlines()[1:]] == [
        ["fbs_bert", "20"], ["fbs_bert", "100"]]
    bad_trace = tmp_path / "bad.trace"
    bad_trace.write_text("a 0 512 0\nf 7\n")
    r = run([BENCH / "remap_at_cap.py", "--json", "--device-lag", "20,100", bad_trace, trace], cwd=tmp_path)
    assert r.returncode == 0 and r.stderr.count("bad.trace:2:") == 1  # said once, not once per lag
    assert [json.loads(line)["device_lag"] for line in r.stdout.splitlines()] == [20, 100]
    for bad, said in ((["--device-lag", "20,x"], "whole numbers"), (["--passes", "0"], "at least 1")):
        r = run([BENCH / "remap_at_cap.py", *bad, trace], cwd=tmp_path)
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr


def test_record_trace_converts_a_memory_history_snapshot():
    """bench/record_trace.py's conversion: allocs numbered in order, frees of blocks allocated before the
    recording left out, streams numbered by first use, the peak of live bytes."""
    sys.path.insert(0, str(BENCH))
    try:
        import record_trace
    finally:
        sys.path.remove(str(BENCH))
    events = [dict(action="free_completed", addr=0x10, size=512, stream=0),  # allocated before recording
              dict(action="alloc", addr=0x100, size=1024, stream=7),
              dict(action="segment_alloc", addr=0x0, size=2 << 20, stream=7),
              dict(action="alloc", addr=0x500, size=4096, stream=9),
              dict(action="free_requested", addr=0x100, size=1024, stream=7),
              dict(action="free_completed", addr=0x100, size=1024, stream=7),
              dict(action="alloc", addr=0x100, size=512, stream=7)]
    lines, allocations, peak = record_trace.snapshot_to_trace({"device_traces": [events]})
    assert lines == ["a 0 1024 0", "a 1 4096 1", "f 0", "a 2 512 0"]
    assert allocations == 3 and peak == 5120


def test_record_trace_writes_allocfree_from_its_seeded_requests_without_a_gpu(tmp_path):
    """allocfree's trace needs no GPU: the workload's own random plan, replayed in order, never more
    than ALLOCFREE_LIVE + 1 tensors alive, each freed once, the last ALLOCFREE_LIVE at the end (the
    bench's next pass drops them first, so that a replay's later passes make every tensor again, as
    the bench's do, where a tensor never freed is one made once); gpumem's replay reads it."""
    out = tmp_path / "af.trace.gz"
    r = run([BENCH / "record_trace.py", "allocfree", out], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    sys.path.insert(0, str(BENCH))
    try:
        import pressure_workloads as pw
    finally:
        sys.path.remove(str(BENCH))
    sizes, _ = pw.allocfree_plan(random.Random(0), False)
    lines = [ln.split() for ln in gzip.open(out, "rt") if not ln.startswith("#")]
    allocs = [ln for ln in lines if ln[0] == "a"]
    assert [int(a[2]) for a in allocs] == [-(-s // 512) * 512 for s in sizes]
    alive, most, freed = set(), 0, set()
    for ln in lines:
        if ln[0] == "a":
            alive.add(ln[1])
        else:
            assert ln[1] in alive and ln[1] not in freed
            alive.remove(ln[1])
            freed.add(ln[1])
        most = max(most, len(alive))
    assert most == pw.ALLOCFREE_LIVE + 1 and not alive and len(freed) == len(sizes)
    assert all(ln[0] == "f" for ln in lines[-pw.ALLOCFREE_LIVE:])  # the survivors, after the last allocation
    gpumem = pytest.importorskip("gpumem")
    report = gpumem.replay(out)
    assert report.allocations == len(sizes) and report.ooms == 0 and report.fragmentation >= 1.0
    # A folder that does not exist is refused before anything is recorded, in one line.
    r = run([BENCH / "record_trace.py", "allocfree", tmp_path / "missing" / "af.trace.gz"], cwd=tmp_path)
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_record_trace_writes_allocfree_with_another_seed(tmp_path):
    """--seed N: the requests allocfree makes with that seed (docs/benchmarks.md's "Packed small arenas"
    replays seven), its header naming the seed; refused for the workloads recorded on the GPU."""
    sys.path.insert(0, str(BENCH))
    try:
        import record_trace
    finally:
        sys.path.remove(str(BENCH))
    traces = {}
    for seed in (None, 0, 3):
        out = tmp_path / f"af{seed}.trace"
        r = run([BENCH / "record_trace.py", "allocfree", out] + ([] if seed is None else ["--seed", str(seed)]),
                cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        header, *body = out.read_text().splitlines()
        assert f"seed {0 if seed is None else seed}," in header
        traces[seed] = body
    assert traces[None] == traces[0] != traces[3]
    assert traces[3] == record_trace.allocfree_trace(3)[0]
    r = run([BENCH / "record_trace.py", "varlen", tmp_path / "v.trace", "--seed", "3"], cwd=tmp_path)
    assert r.returncode == 2 and "--seed is allocfree's" in r.stderr and "Traceback" not in r.stderr
