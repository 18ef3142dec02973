"""The host's time per `torch.empty` + free, with each allocator: what an allocator adds to every tensor
a step makes, whether or not the GPU hides it.

Each allocator runs in a process of its own (torch picks its allocator once per process): a warm-up,
then for each size `--rounds` rounds of `--pairs` pairs of `x = torch.empty(size, device="cuda"); del x`,
timed on the host with nothing queued on the device; the figure is the median round, in ns per pair.
A second loop keeps `--live` tensors alive and frees them in a shuffled order (the same for every
allocator), so that the pool's free lists and merges do work, as in a training step.

    python bench/host_cost.py                                  # native, expandable, gpumem
    python bench/host_cost.py --allocators native,gpumem --sizes 512,1048576 --json out.json

Allocator names are bench/pressure_workloads.py's (native, expandable, async, gpumem, gpumem+KEY:VALUE
...). Needs a CUDA GPU: without one it says so and exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure(allocator: str, sizes: list[int], pairs: int, rounds: int, live: int) -> dict:
    """In this process: make `allocator` torch's and time the loops; returns the figures."""
    sys.path.insert(0, str(HERE))
    from pressure_workloads import select_allocator

    select_allocator(allocator, None)
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    out = {"allocator": allocator, "gpu": torch.cuda.get_device_name(), "single": {}, "churn": {}}
    order = list(range(live))
    random.Random(0).shuffle(order)
    for size in sizes:
        for _ in range(pairs):  # warm-up: the sizes' first blocks, the caches
            x = torch.empty(size, dtype=torch.uint8, device="cuda")
            del x
        per_round = []
        for _ in range(rounds):
            t0 = time.perf_counter_ns()
            for _ in range(pairs):
                x = torch.empty(size, dtype=torch.uint8, device="cuda")
                del x
            per_round.append((time.perf_counter_ns() - t0) / pairs)
        out["single"][str(size)] = statistics.median(per_round)
        per_round = []
        batches = max(1, pairs // live)  # of `live` tensors each: about `pairs` pairs in all
        for _ in range(rounds):
            held = [None] * live
            t0 = time.perf_counter_ns()
            for _ in range(batches):
                for i in range(live):
                    held[i] = torch.empty(size, dtype=torch.uint8, device="cuda")
                for i in order:
                    held[i] = None
            per_round.append((time.perf_counter_ns() - t0) / (batches * live))
        out["churn"][str(size)] = statistics.median(per_round)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--allocators", default="native,expandable,gpumem")
    ap.add_argument("--sizes", default="512,65536,1048576,8388608", help="bytes per tensor, comma-separated")
    ap.add_argument("--pairs", type=int, default=20000, help="allocate + free pairs per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--live", type=int, default=64, help="tensors alive at once in the churn loop")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes must be whole bytes, comma-separated, got {args.sizes!r}")
    if min(sizes) < 1 or args.pairs < 1 or args.rounds < 1 or args.live < 1:
        ap.error("--sizes, --pairs, --rounds and --live must be at least 1")
    keys = [str(size) for size in sizes]  # the workers' figures are keyed by these (" 512", "0512": "512")
    if args.worker:
        print(json.dumps(measure(args.worker, sizes, args.pairs, args.rounds, args.live)))
        return 0
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        print("host_cost: needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    results = []
    for name in args.allocators.split(","):
        cmd = [sys.executable, __file__, "--worker", name, "--sizes", ",".join(keys), "--pairs", str(args.pairs),
               "--rounds", str(args.rounds), "--live", str(args.live)]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "GPUMEM_CONF")}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            print(f"{name}: failed (exit {r.returncode}):\n{r.stderr[-2000:]}", file=sys.stderr)
            return 1
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"{results[0]['gpu']}: ns per torch.empty + free, median of {args.rounds} rounds "
          f"(single: one tensor at a time; churn: {args.live} alive, freed shuffled)")
    print(f"{'allocator':<28}" + "".join(f"{'single ' + s:>16}{'churn ' + s:>16}" for s in keys))
    for r in results:
        print(f"{r['allocator']:<28}" + "".join(f"{r['single'][s]:16.0f}{r['churn'][s]:16.0f}" for s in keys))
    line = json.dumps({"rows": results})
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
