"""The A/B run behind docs/benchmarks.md's "Release order" GPU figures (one H100, 2026-12-06): allocfree at
1.01x / 1.02x / 1.03x the uncapped native run's peak allocated bytes, three passes a run, this tree's
gpumem (installed as usual) against a second build given by --old-site, two runs each, alternating.

The second build was the same tree with the change reversed, installed beside the first:

    git diff 4256d9e fa9604a -- csrc/core/pool_release.cpp > release_order.patch
    cp -r . /tmp/oldsrc && (cd /tmp/oldsrc && patch -R -p1 < release_order.patch)
    python3 -m pip install --no-build-isolation --no-deps --target /tmp/oldsite /tmp/oldsrc
    python3 bench/results/release-order-2026-12-06/ab_builds.py --old-site /tmp/oldsite

Prints each run's OOMs, step times and device calls a steady step (bench/pressure_workloads.py's JSON).
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
KEYS = ("ooms", "steady_ooms", "step_ms", "steady_step_ms", "pass_step_ms", "steady_device_allocs",
        "steady_device_frees", "max_reserved", "steady_max_reserved")


def run(allocator, fraction=None, site=None):
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = site + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, str(ROOT / "bench/pressure_workloads.py"), "allocfree", allocator, "--passes", "3"]
    if fraction:
        cmd += ["--fraction", f"{fraction:.6f}"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        print("FAILED", cmd, done.stderr[-2000:])
        return {}
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-site", required=True, help="where the second build is installed (pip --target)")
    args = ap.parse_args()
    for name, site in (("new", None), ("old", args.old_site)):  # which gpumem each side imports
        env = dict(os.environ)
        if site:
            env["PYTHONPATH"] = site + os.pathsep + env.get("PYTHONPATH", "")
        found = subprocess.run([sys.executable, "-c", "import gpumem; print(gpumem.__file__)"], env=env,
                               capture_output=True, text=True)
        print(name, found.stdout.strip())
    base = run("native")
    peak, total = base["max_allocated"], base["total_bytes"]
    print("native uncapped max_allocated", peak, "total", total, "step_ms", base.get("step_ms"),
          "steady", base.get("steady_step_ms"))
    for factor in (1.01, 1.02, 1.03):
        for rep in range(2):
            for site in (None, args.old_site):
                figures = run("gpumem", factor * peak / total, site)
                name = "packed(old)" if site else "large-first"
                print(f"F={factor} rep={rep} {name}", json.dumps({k: figures.get(k) for k in KEYS}), flush=True)


if __name__ == "__main__":
    main()
