"""torch.compile(mode="reduce-overhead") (cudagraph trees) with changing input shapes, gpumem against
PyTorch's own allocator. Every test is marked ``gpu``:

    python -m pytest -m gpu tests/gpu/test_compile_gpu.py -q

tests/gpu/compile_scenario.py runs all scenarios (training with the batch alternating between two
sizes and cycling through four, backward only, no_grad inference, training with dynamic=True, and two
chained-module scenarios in which cudagraph trees restores checkpoints; 50 steps each) in one process per run, so the import and compile warm-up is paid once per run: a first
native run (it fills a fresh inductor cache the later runs share), then a second native run and the
gpumem run side by side. The two native runs tell how much two runs of the same program differ on
this machine; gpumem's values must differ from native's by no more than that (see
``allowed_difference``).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

import pytest
from _run import clean_env, finish, start

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the GPU machine with -m gpu)", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "compile_scenario.py")
SCENARIOS = ["train_alternating", "train_cycling", "backward_only", "inference", "train_dynamic",
             "chained_inference", "train_chained"]
# Scenarios in which cudagraph trees must restore the allocator to a checkpoint (a graph recorded
# below one that was replayed); the others record every new shape as a new root, with no restore.
RESTORE_SCENARIOS = {"chained_inference", "train_chained"}
STEPS = 50
RUN_TIMEOUT = 330  # seconds per run; the file as a whole stays under 6 minutes on an H100

# When the two native runs agree bit for bit, cudagraph replay of the same kernels on the same data
# should give gpumem identical results; this only leaves room for a kernel that picks another code path
# for another pointer alignment.
BITWISE_NATIVE_RTOL = 1e-5
# The least tolerance when the native runs differ: relative to the value.
MIN_RTOL = 1e-6


def allowed_difference(native_a, native_b):
    """Per-value tolerance for gpumem's run, from two native runs of the same values.

    * Both native runs bitwise equal: |gpumem - native| <= BITWISE_NATIVE_RTOL * |native|.
    * Otherwise: spread = the largest |native_a - native_b| over the whole run; each value may differ
      from the nearer native run by max(spread, MIN_RTOL * |native|).
    """
    flat_a = [v for row in native_a for v in row]
    flat_b = [v for row in native_b for v in row]
    spread = max((abs(x - y) for x, y in zip(flat_a, flat_b)), default=0.0)
    if spread == 0.0:
        return 0.0, [BITWISE_NATIVE_RTOL * abs(v) for v in flat_a]
    return spread, [max(spread, MIN_RTOL * abs(v)) for v in flat_a]


def _start(allocator, cache_dir):
    env = clean_env(CUBLAS_WORKSPACE_CONFIG=":4096:8", TORCHINDUCTOR_DETERMINISTIC="1",
                    TORCHINDUCTOR_CACHE_DIR=str(cache_dir), PYTHONHASHSEED="0")
    return start([sys.executable, SCRIPT, "--allocator", allocator, "--steps", str(STEPS)], env)


def _finish(proc, deadline):
    # on timeout the run's whole process group is killed (inductor's compile workers too)
    out, err, timed_out = finish(proc, max(1.0, deadline - time.monotonic()))
    if timed_out:
        err += f"\n[test] killed after {RUN_TIMEOUT} s"
    header, rows = None, {}
    for line in out.splitlines():
        if line.startswith("ALLOCATOR "):
            header = json.loads(line[len("ALLOCATOR "):])
        elif line.startswith("SCENARIO "):
            row = json.loads(line[len("SCENARIO "):])
            rows[row["name"]] = row
    return dict(rc=proc.returncode, header=header, rows=rows, stderr_tail=err[-6000:])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = tmp_path_factory.mktemp("inductor_cache")
    t0 = time.monotonic()
    native_a = _finish(_start("native", cache), time.monotonic() + RUN_TIMEOUT)
    procs = {"native_b": _start("native", cache), "gpumem": _start("gpumem", cache)}
    deadline = time.monotonic() + RUN_TIMEOUT
    out = {"native_a": native_a, **{k: _finish(p, deadline) for k, p in procs.items()}}
    print(f"\ncompile runs: {time.monotonic() - t0:.0f} s")
    for k, r in out.items():
        for name, row in r["rows"].items():
            print(f"  {k:9s} {name:18s} {row.get('seconds')} s  graphs={row.get('recorded_graphs')} "
                  f"restores={row.get('checkpoint_restores')} skips={row.get('cudagraph_skips')} "
                  f"leak={row.get('leak_bytes')}" + ("  ERROR" if "error" in row else ""))
    return out


def _row(runs, which, name):
    r = runs[which]
    assert r["header"] is not None, f"{which}: no output (rc {r['rc']}):\n{r['stderr_tail']}"
    row = r["rows"].get(name)
    assert row is not None, f"{which}: scenario {name} did not report (rc {r['rc']}):\n{r['stderr_tail']}"
    assert "error" not in row, f"{which}: {name} failed:\n{row['error']}"
    return row


@pytest.mark.gpu
def test_allocators_are_the_ones_claimed(runs):
    for which in ("native_a", "native_b", "gpumem"):
        assert runs[which]["header"] is not None, f"{which}: no output:\n{runs[which]['stderr_tail']}"
    g = runs["gpumem"]["header"]
    assert g["gpumem_active"], g["status"]
    assert g["backend"] != "native", g  # torch.cuda.memory.get_allocator_backend() names gpumem's
    for which in ("native_a", "native_b"):
        assert runs[which]["header"]["backend"] == "native", runs[which]["header"]
        assert not runs[which]["header"]["gpumem_active"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", SCENARIOS)
def test_values_match_native(runs, name):
    a, b, g = (_row(runs, w, name) for w in ("native_a", "native_b", "gpumem"))
    assert a["sizes"] == b["sizes"] == g["sizes"] and len(a["sizes"]) == STEPS
    assert len(set(a["sizes"])) >= 2, "the scenario must change shapes"
    spread, tol = allowed_difference(a["values"], b["values"])
    flat_a = [v for row in a["values"] for v in row]
    flat_b = [v for row in b["values"] for v in row]
    flat_g = [v for row in g["values"] for v in row]
    assert len(flat_g) == len(flat_a) == len(flat_b)
    assert all(math.isfinite(v) for v in flat_a + flat_b + flat_g)
    width = len(a["values"][0])
    worst = max(min(abs(z - x), abs(z - y)) for x, y, z in zip(flat_a, flat_b, flat_g))
    print(f"\n{name}: native-native spread {spread:.3g}, gpumem's largest difference {worst:.3g}")
    bad = []
    for i, (x, y, z, t) in enumerate(zip(flat_a, flat_b, flat_g, tol)):
        d = min(abs(z - x), abs(z - y))
        if d > t:
            bad.append(f"step {i // width} value {i % width}: gpumem {z!r} native {x!r} / {y!r} "
                       f"(difference {d:.3g} > allowed {t:.3g})")
    assert not bad, (f"{name}: gpumem differs from PyTorch's allocator beyond the native-native spread "
                     f"{spread:.3g} in {len(bad)} of {len(flat_a)} values:\n" + "\n".join(bad[:10]))


@pytest.mark.gpu
@pytest.mark.parametrize("name", SCENARIOS)
def test_cudagraph_trees_did_the_same_work(runs, name):
    """CUDA graphs were really used (no skips), and gpumem made cudagraph trees record and restore
    checkpoints exactly as often as PyTorch's allocator did (a failed restore or a pool check that
    disagrees shows up as extra recordings or skips)."""
    a, g = _row(runs, "native_a", name), _row(runs, "gpumem", name)
    assert a["cudagraph_skips"] == 0, f"native run skipped CUDA graphs in {name}: the scenario is wrong"
    assert g["cudagraph_skips"] == 0, f"gpumem run skipped CUDA graphs {g['cudagraph_skips']} times"
    if a["recorded_graphs"] is None:
        pytest.skip("this torch's cudagraph tree internals could not be read")
    assert a["recorded_graphs"] > 0
    if name in RESTORE_SCENARIOS:
        assert a["checkpoint_restores"], f"native run restored no checkpoint in {name}: the scenario is wrong"
    assert g["recorded_graphs"] == a["recorded_graphs"], (g["recorded_graphs"], a["recorded_graphs"])
    assert g["checkpoint_restores"] == a["checkpoint_restores"], (g["checkpoint_restores"],
                                                                  a["checkpoint_restores"])
    assert g["unique_graphs"] == a["unique_graphs"]


@pytest.mark.gpu
def test_no_leak_after_compiled_runs(runs):
    """After each scenario (model, optimizer and compiled function deleted, torch._dynamo.reset(),
    gc.collect(), cuBLAS workspaces released) torch.cuda.memory_allocated() is back at its value
    before the scenario in the gpumem run. Should PyTorch's own allocator itself keep bytes (blocks of
    a graph pool that outlive the trees), gpumem may keep no more than it does."""
    for name in SCENARIOS:
        a, g = _row(runs, "native_a", name), _row(runs, "gpumem", name)
        allowed = max(0, a["leak_bytes"])
        assert g["leak_bytes"] <= allowed, (
            f"{name}: memory_allocated {g['allocated_before']} before, {g['allocated_after']} after "
            f"with gpumem (+{g['leak_bytes']} bytes); PyTorch's allocator: +{a['leak_bytes']}")
        assert g.get("validate") == "ok"
