"""torch.compile(mode="reduce-overhead") training step time, gpumem against PyTorch's own allocator.

    python bench/compile_bench.py [--rounds 5] [--steps 100] [--warmup 30]
                                  [--d-model 1024] [--layers 4] [--batches 16 12] [--seq 256]

One process per (round, allocator): the script runs itself with ``--worker native|gpumem`` (gpumem is
imported first in its worker, so it is torch's allocator; the native worker never imports it), rounds
interleaved (native first in odd rounds, gpumem first in even ones) so drift hits both alike. A worker
builds bench/models.py's GPT (d_model 1024, 4 layers, 16 heads, vocabulary 8192 by default), compiles
it with mode="reduce-overhead" (cudagraph trees), and trains with AdamW under bf16 autocast, the batch
alternating between two sizes (as an epoch whose last batch is smaller would, every other step). After
--warmup steps (compilation, the recompile for the second shape, the CUDA graph recordings of both
sizes) it times --steps steps, each ended by torch.cuda.synchronize(), with time.perf_counter.

Prints a table (median ms per step over the rounds, per allocator), the ratio gpumem / native (the
issue's target: within 2 %, i.e. <= 1.02), then one JSON line. Progress goes to stderr. Needs only
this checkout and a CUDA build of torch (gpumem installed for the gpumem worker).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = 1.02


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="worker processes per allocator (default 5)")
    ap.add_argument("--steps", type=int, default=100, help="timed steps per worker (default 100)")
    ap.add_argument("--warmup", type=int, default=30, help="untimed steps first (default 30)")
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batches", type=int, nargs=2, default=[16, 12], metavar=("B1", "B2"),
                    help="the two batch sizes the steps alternate between (default 16 12)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="autocast dtype (default bf16)")
    ap.add_argument("--dynamic", action="store_true", help="torch.compile(..., dynamic=True)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per worker before it is killed")
    ap.add_argument("--worker", choices=["native", "gpumem"], help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- worker


def worker(args) -> int:
    if args.worker == "gpumem":
        os.environ.pop("GPUMEM_DISABLE", None)
        import gpumem  # noqa: F401  first: torch's CUDA allocator from here on
        import gpumem._torch as gt
        import torch

        if not gt.is_active():
            print(json.dumps({"allocator": "gpumem", "error": gt.status_line()}))
            return 1
    else:
        os.environ["GPUMEM_DISABLE"] = "1"
        import torch
    import torch.nn.functional as F

    sys.path.insert(0, HERE)
    from models import GPT, cudagraph_tree_counts

    torch.cuda.init()
    backend = torch.cuda.memory.get_allocator_backend()
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    model = GPT(vocab=args.vocab, d=args.d_model, layers=args.layers, heads=args.heads).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cmodel = torch.compile(model, mode="reduce-overhead", dynamic=True if args.dynamic else None)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, args.vocab, (b, args.seq), device="cuda", generator=gen) for b in args.batches]

    def step(i):
        ids = batches[i % 2]
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            logits = cmodel(ids)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t0
    recorded = cudagraph_tree_counts(torch)[0]
    times = []
    for i in range(args.warmup, args.warmup + args.steps):
        t = time.perf_counter()
        loss = step(i)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    recorded_after = cudagraph_tree_counts(torch)[0]
    print(json.dumps(dict(
        allocator=args.worker, backend=backend, torch=torch.__version__, device=torch.cuda.get_device_name(0),
        step_ms_median=statistics.median(times), step_ms_mean=statistics.fmean(times),
        step_ms_min=min(times), warmup_s=round(warmup_s, 1), final_loss=float(loss.item()),
        recorded_graphs=recorded,
        recordings_while_timed=(recorded_after - recorded) if None not in (recorded, recorded_after) else None,
        max_reserved_mib=round(torch.cuda.max_memory_reserved() / 2**20, 1),
        max_allocated_mib=round(torch.cuda.max_memory_allocated() / 2**20, 1))))
    return 0


# ----------------------------------------------------------------------------- driver


def run_worker(args, allocator):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", allocator, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--d-model", str(args.d_model), "--layers", str(args.layers),
           "--heads", str(args.heads), "--vocab", str(args.vocab), "--seq", str(args.seq),
           "--batches", *map(str, args.batches), "--dtype", args.dtype] + (["--dynamic"] if args.dynamic else [])
    env = dict(os.environ)
    env.pop("GPUMEM_DISABLE", None)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"allocator": allocator, "error": f"timed out after {args.timeout} s"}
    line = next((x for x in reversed(r.stdout.splitlines()) if x.startswith("{")), None)
    if r.returncode != 0 or line is None:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:] or ["no output"]
        return {"allocator": allocator, "error": " | ".join(tail)}
    return json.loads(line)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    results = {"native": [], "gpumem": []}
    for rnd in range(args.rounds):
        order = ["native", "gpumem"] if rnd % 2 == 0 else ["gpumem", "native"]
        for allocator in order:
            row = run_worker(args, allocator)
            results[allocator].append(row)
            if "error" in row:
                print(f"round {rnd + 1}/{args.rounds} {allocator:6s} ERROR {row['error']}", file=sys.stderr, flush=True)
            else:
                print(f"round {rnd + 1}/{args.rounds} {allocator:6s} {row['step_ms_median']:8.3f} ms/step "
                      f"(mean {row['step_ms_mean']:.3f}, warm-up {row['warmup_s']} s, graphs {row['recorded_graphs']}, "
                      f"recorded while timed {row['recordings_while_timed']})", file=sys.stderr, flush=True)
    summary = {}
    for allocator, rows in results.items():
        ok = [r for r in rows if "error" not in r]
        summary[allocator] = dict(
            rounds=len(ok), errors=[r["error"] for r in rows if "error" in r],
            step_ms_median=statistics.median(r["step_ms_median"] for r in ok) if ok else None,
            step_ms_per_round=[round(r["step_ms_median"], 3) for r in ok],
            max_reserved_mib=max((r["max_reserved_mib"] for r in ok), default=None),
            recordings_while_timed=[r["recordings_while_timed"] for r in ok],
            backend=ok[0]["backend"] if ok else None)
    n, g = summary["native"]["step_ms_median"], summary["gpumem"]["step_ms_median"]
    ratio = g / n if n and g else None
    first = next((r for rows in results.values() for r in rows if "error" not in r), {})
    print(f"\nreduce-overhead training step, GPT d={args.d_model} layers={args.layers} seq={args.seq} "
          f"batches {args.batches[0]}/{args.batches[1]} {args.dtype}, {args.steps} timed steps x {args.rounds} rounds"
          f" on {first.get('device', '?')} (torch {first.get('torch', '?')})")
    print(f"{'allocator':10s} {'median ms/step':>15s} {'per round':>40s} {'max reserved MiB':>17s}")
    for allocator, s in summary.items():
        med = f"{s['step_ms_median']:15.3f}" if s["step_ms_median"] is not None else f"{'error':>15s}"
        per = " ".join(f"{v:.2f}" for v in s["step_ms_per_round"])
        print(f"{allocator:10s} {med} {per:>40s} {str(s['max_reserved_mib']):>17s}")
    if ratio is not None:
        verdict = "within" if ratio <= TARGET else "OUTSIDE"
        print(f"gpumem / native: {ratio:.4f} ({verdict} the {100 * (TARGET - 1):.0f} % target)")
    else:
        print("gpumem / native: n/a (a worker failed)")
    print(json.dumps(dict(config={k: v for k, v in vars(args).items() if k != "worker"}, summary=summary,
                          gpumem_over_native=ratio, target=TARGET,
                          within_target=ratio is not None and ratio <= TARGET)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
