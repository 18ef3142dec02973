"""gpumem against PyTorch's allocators on the live workloads of bench/workloads.py, one process per
(workload, allocator), several rounds interleaved so drift hits every allocator alike.

    python bench/compare_allocators.py [--rounds 2] [--only varlen resnet] [--workloads PATH]

--workloads runs another workloads file of the same command line (WORKLOAD ALLOCATOR, one JSON line
out), e.g. ../shared/bench/workloads.py, the one docs/benchmarks.md's earlier figures were measured with.

Prints a table (median over rounds) with gpumem's ratio to the best PyTorch allocator, then one JSON
line. A second check runs the varlen workload with gpumem in-process and compares gpumem's reserved
bytes with the device's own view (cudaMemGetInfo, minus what was in use before the first allocation).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from workloads import ALLOCATORS, WORKLOADS  # noqa: E402  bench/workloads.py (imports no torch)

FIGURES = {name: w.figures for name, w in WORKLOADS.items()}

AGREEMENT = r"""
import json, sys
import gpumem
sys.path.insert(0, {bench!r})
import workloads
workloads = workloads.load({script!r})
import torch
torch.empty(1, device="cuda")
torch.cuda.synchronize()
free0, total = torch.cuda.mem_get_info()
baseline = total - free0 - torch.cuda.memory_reserved()
workloads.varlen(steps=20)
torch.cuda.synchronize()
rows = []
for phase in ("after training", "after empty_cache"):
    if phase == "after empty_cache":
        torch.cuda.empty_cache(); torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    rows.append(dict(phase=phase, device_used_minus_baseline=total - free - baseline,
                     gpumem_reserved=torch.cuda.memory_reserved()))
print(json.dumps(dict(agreement=rows, stats_segment=torch.cuda.memory_stats()["segment.all.current"])))
"""


def run(cmd, timeout=600):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    line = next((l for l in reversed(r.stdout.splitlines()) if l.startswith("{")), None)
    if r.returncode != 0 or line is None:
        return {"error": (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]}
    return json.loads(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=str(HERE / "workloads.py"),
                    help="the workloads file to run (default: bench/workloads.py)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=list(FIGURES), choices=list(FIGURES), help="workloads to run")
    args = ap.parse_args()
    script = str(Path(args.workloads).resolve())
    results: dict = {}
    for rnd in range(args.rounds):
        for w in args.only:
            for a in ALLOCATORS:
                row = run([sys.executable, script, w, a])
                print(f"round {rnd + 1}: {w:9s} {a:10s} {json.dumps(row)}", file=sys.stderr, flush=True)
                results.setdefault((w, a), []).append(row)
    summary = {}
    print(f"\n{'workload':9s} {'figure':13s} " + " ".join(f"{a:>11s}" for a in ALLOCATORS) + "  gpumem/best-torch")
    for w in args.only:
        for fig in FIGURES[w]:
            med = {}
            for a in ALLOCATORS:
                vals = [r[fig] for r in results[(w, a)] if fig in r]
                med[a] = statistics.median(vals) if vals else None
            torch_vals = [v for a, v in med.items() if a != "gpumem" and v is not None]
            best = min(torch_vals) if torch_vals else None
            ratio = med["gpumem"] / best if med["gpumem"] and best else None
            summary[f"{w}.{fig}"] = dict(med, gpumem_over_best=ratio)
            cells = " ".join(f"{v:11.3f}" if v is not None else f"{'error':>11s}" for v in med.values())
            print(f"{w:9s} {fig:13s} {cells}  {ratio:.3f}" if ratio else f"{w:9s} {fig:13s} {cells}  n/a")
    errors = {f"{w}/{a}": r["error"] for (w, a), rows in results.items() for r in rows if "error" in r}
    agreement = run([sys.executable, "-c", AGREEMENT.format(bench=str(HERE), script=script)])
    print("\ngpumem reserved vs the device's own view (varlen, 20 steps):")
    for row in agreement.get("agreement", []):
        diff = row["device_used_minus_baseline"] - row["gpumem_reserved"]
        print(f"  {row['phase']:18s} device {row['device_used_minus_baseline'] / 2**20:10.1f} MiB   "
              f"gpumem {row['gpumem_reserved'] / 2**20:10.1f} MiB   difference {diff / 2**20:8.1f} MiB")
    if "error" in agreement:
        print(f"  error: {agreement['error']}")
    print(json.dumps(dict(summary=summary, errors=errors, agreement=agreement)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
