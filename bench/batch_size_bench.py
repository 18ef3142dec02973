"""gpumem's batch-size and length search against Lightning's finder (power, binsearch) and Accelerate's
decorator, on five kinds of loop (bench/batch_size_workloads.py):

    python bench/batch_size_bench.py                         # all five workloads (~7 min on an H100)
    python bench/batch_size_bench.py --models resnet,gpt     # some of them
    python bench/batch_size_bench.py --finders gpumem --skip-truth   # gpumem and its fresh checks only

Workloads: resnet (CNN training), gpt (transformer training), bert (encoder inference), gen (decoder
generation with a KV cache, the whole generation per step), seqlen (the largest sequence length at
batch 4: gpumem.find_max_length; Lightning and Accelerate search the length as their "batch size").
Each runs under a memory fraction of the GPU (``--fraction`` overrides the workload's own, 3-5 %), so
the models are small and the steps fast.

For each workload every finder runs in its own subprocess (a clean GPU), one after the other; its
time is the finder call alone.  Then, in fresh processes run side by side (each under the same
fraction, so they cannot disturb one another's limit): each answer runs 3 steps ("fits fresh") and
``--long-steps`` steps (default 200), and the fresh-process maximum (the largest size whose 3 steps
fit) is found by bisection, starting from the bracket the answers give.  Columns: size, % of the
fresh-process maximum, seconds, trials, fits fresh, the long run, reserved after <= before (in the
finder's process).  Targets (gpumem): >= 98 % and <= 100 % of the maximum, fits fresh, the long run
without OOM, reserved after <= before, faster than Lightning's power scaling.  One JSON line at the
end (``{"bench": "batch_size", ...}``).

Options: --allocator gpumem (default) / native: whose allocator every subprocess uses;
--finders (gpumem, lightning_power, lightning_binsearch, accelerate, gpumem_decorator);
--skip-truth (no bisection), --skip-fresh (no fresh checks), --parallel N (fresh processes at once).
"""
import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
ALL_MODELS = ["resnet", "gpt", "bert", "gen", "seqlen"]
DEFAULT_FINDERS = ["gpumem", "lightning_power", "lightning_binsearch", "accelerate"]
ALL_FINDERS = DEFAULT_FINDERS + ["gpumem_decorator"]


# ----------------------------------------------------------------------------- child side


def start_cuda(allocator, fraction):
    if allocator == "gpumem":
        import gpumem  # noqa: F401  registers gpumem's allocator before CUDA starts
        import torch
    else:
        import torch

        torch.cuda.init()  # CUDA first: PyTorch's own allocator stays in place
        import gpumem  # noqa: F401
    torch.cuda.set_device(0)
    torch.cuda.set_per_process_memory_fraction(fraction)
    return torch


def child(a):
    torch = start_cuda(a.allocator, a.fraction)
    import gc

    import gpumem
    from batch_size_workloads import Workload

    w = Workload(a.models)
    out = {"finder": a.child}
    if a.child == "fits":
        try:
            w.steps(a.batch, a.steps)
            ok = True
        except Exception as e:  # noqa: BLE001  only out-of-memory means "does not fit"
            if not gpumem.is_oom_error(e):
                raise
            ok = False
        out.update(batch=a.batch, steps=a.steps, fits=ok)
    else:
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        t0 = time.perf_counter()
        try:
            if a.child == "gpumem":
                res = w.gpumem()
                batch, trials = res.size, len(res.trials)
                out.update(failed_trials=sum(not t.fits for t in res.trials), spread=res.spread_bytes,
                           trial_sizes=[(t.batch_size, t.outcome, t.phase, t.peak_bytes, t.reserved_bytes)
                                        for t in res.trials])
            elif a.child == "accelerate":
                batch, trials = w.accelerate(w.accelerate_start)
            elif a.child == "gpumem_decorator":
                batch, trials = w.gpumem_decorator(w.accelerate_start)
            else:
                batch, trials = w.lightning(a.child.split("_")[1])
        except RuntimeError as e:  # Accelerate's "No executable batch size found, reached zero."
            if "reached zero" not in str(e):
                raise
            batch, trials = 0, None
        seconds = time.perf_counter() - t0
        gc.collect()
        torch.cuda.synchronize()
        out.update(batch=batch, trials=trials, seconds=seconds, reserved_before=before,
                   reserved_after=torch.cuda.memory_reserved())
    print("RESULT " + json.dumps(out), flush=True)


# ----------------------------------------------------------------------------- driver


def run_child(a, model, fraction, what, batch=None, steps=3):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", what, "--models", model, "--fraction",
           str(fraction), "--allocator", a.allocator, "--steps", str(steps)]
    if batch is not None:
        cmd += ["--batch", str(batch)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-5000:])
        raise SystemExit(f"{model}: child {what} {batch or ''} failed (rc {p.returncode})")
    r = json.loads(lines[-1][7:])
    r["process_seconds"] = time.perf_counter() - t0
    if what.startswith("gpumem"):
        sys.stderr.write("".join(line + "\n" for line in p.stderr.splitlines() if "gpumem." in line))
    return r


class Fresh:
    """fits(size, steps) in fresh processes, several at once; results cached."""

    def __init__(self, a, model, fraction):
        self.a, self.model, self.fraction = a, model, fraction
        self.known = {}  # (size, steps) -> bool
        self.runs, self.seconds = 0, 0.0
        self.parallel = max(1, min(a.parallel, int(0.9 / fraction)))

    def run(self, jobs):
        jobs = [j for j in dict.fromkeys(jobs) if j not in self.known and j[0] > 0]
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(self.parallel) as ex:
            futs = {ex.submit(run_child, self.a, self.model, self.fraction, "fits", b, n): (b, n) for b, n in jobs}
            for f in cf.as_completed(futs):
                b, n = futs[f]
                self.known[(b, n)] = bool(f.result()["fits"])
                print(f"  fresh process, size {b}, {n} steps: {'fits' if self.known[(b, n)] else 'OOM'}",
                      file=sys.stderr, flush=True)
        self.runs += len(jobs)
        self.seconds += time.perf_counter() - t0

    def fits(self, b, n=3):
        if b <= 0:
            return True
        return self.known.get((b, n))

    def true_max(self):
        """Largest size whose 3 steps fit: k-ary bisection from the bracket of what is known."""
        def bracket():
            ok = [b for (b, n), v in self.known.items() if n == 3 and v]
            bad = [b for (b, n), v in self.known.items() if n == 3 and not v]
            hi = min(bad) if bad else None
            lo = max([b for b in ok if hi is None or b < hi], default=0)
            return lo, hi

        lo, hi = bracket()
        while hi is None:  # nothing failed yet: grow
            self.run([(max(lo + 1, int(lo * f)), 3) for f in (1.1, 1.5, 2, 4)])
            lo, hi = bracket()
        while hi - lo > 1:
            k = min(self.parallel, hi - lo - 1)
            self.run([(lo + (hi - lo) * (i + 1) // (k + 1), 3) for i in range(k)])
            lo, hi = bracket()
        return lo


def bench_model(a, model):
    from batch_size_workloads import SPECS

    fraction = a.fraction or SPECS[model][1]
    print(f"\n== {model}: fraction {fraction}, allocator {a.allocator}", file=sys.stderr, flush=True)
    res = {}
    for f in a.finder_list:
        res[f] = run_child(a, model, fraction, f)
        print(f"  {f}: size {res[f]['batch']} in {res[f]['seconds']:.1f} s ({res[f]['trials']} trials)",
              file=sys.stderr, flush=True)
    fresh = Fresh(a, model, fraction)
    true_max = None
    if not a.skip_fresh:
        jobs = []
        for r in res.values():
            jobs += [(r["batch"], 3), (r["batch"], a.long_steps)]
        if not a.skip_truth and "gpumem" in res:
            g = res["gpumem"]["batch"]
            jobs.append((int(g / 0.98) + 1, 3))  # >= 98 %: this one must not fit
        fresh.run(jobs)
        if not a.skip_truth:
            true_max = fresh.true_max()
        for r in res.values():
            r["fits_fresh"] = fresh.fits(r["batch"])
            r["long_run"] = fresh.fits(r["batch"], a.long_steps)
    for r in res.values():
        r["pct_of_max"] = round(100.0 * r["batch"] / true_max, 1) if true_max else None
        r["reserved_ok"] = r["reserved_after"] <= r["reserved_before"]
    targets = None
    if "gpumem" in res:
        g = res["gpumem"]
        targets = {
            "at_least_98pct": None if true_max is None else g["pct_of_max"] >= 98.0,
            "not_above_max": None if true_max is None else g["batch"] <= true_max,
            "fits_fresh": g.get("fits_fresh"),
            f"{a.long_steps}_steps_fresh": g.get("long_run"),
            "reserved_after_le_before": g["reserved_ok"],
            "faster_than_lightning_power": (g["seconds"] < res["lightning_power"]["seconds"])
            if "lightning_power" in res else None,
        }
    yn = lambda v: "-" if v is None else ("yes" if v else "NO")  # noqa: E731
    print(f"\n{model} ({SPECS[model][0]}, fraction {fraction}, {a.allocator} allocator): fresh-process max "
          f"{true_max if true_max else 'not measured'} ({fresh.runs} fresh runs, {fresh.seconds:.0f} s)")
    print(f"{'finder':20s}{'size':>7s}{'% max':>7s}{'seconds':>9s}{'trials':>7s}{'fresh':>7s}"
          f"{str(a.long_steps) + ' steps':>11s}{'reserved after<=before':>24s}")
    for f, r in res.items():
        pct = "-" if r["pct_of_max"] is None else f"{r['pct_of_max']:.1f}"
        print(f"{f:20s}{r['batch']:>7d}{pct:>7s}{r['seconds']:>9.2f}{str(r['trials']):>7s}"
              f"{yn(r.get('fits_fresh')):>7s}{yn(r.get('long_run')):>11s}{yn(r['reserved_ok']):>24s}")
    if targets:
        print("targets (gpumem): " + ", ".join(f"{k}={v}" for k, v in targets.items()), flush=True)
    setup = {"model": model, "kind": SPECS[model][0], "fraction": fraction, "allocator": a.allocator,
             "true_max": true_max, "fresh_runs": fresh.runs, "finders": res, "targets": targets}
    # Each workload's figures as soon as they exist: a run cut short keeps what it measured.
    print(json.dumps({"bench": "batch_size_setup", **setup}), flush=True)
    return setup


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(ALL_MODELS), help="comma-separated: " + ", ".join(ALL_MODELS))
    ap.add_argument("--finders", default=",".join(DEFAULT_FINDERS), help="comma-separated: " + ", ".join(ALL_FINDERS))
    ap.add_argument("--fraction", type=float, default=None, help="memory fraction (default: the workload's)")
    ap.add_argument("--allocator", choices=["native", "gpumem"], default="gpumem")
    ap.add_argument("--long-steps", type=int, default=200, help="steps of the long fresh run (default 200)")
    ap.add_argument("--parallel", type=int, default=6, help="fresh processes at once (default 6)")
    ap.add_argument("--skip-truth", action="store_true")
    ap.add_argument("--skip-fresh", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    a.finder_list = [f.strip() for f in a.finders.split(",") if f.strip()]
    bad = [m for m in models if m not in ALL_MODELS] + [f for f in a.finder_list if f not in ALL_FINDERS]
    if bad:
        ap.error(f"unknown: {', '.join(bad)}")
    t0 = time.perf_counter()
    out = [bench_model(a, m) for m in models]
    print(json.dumps({"bench": "batch_size", "seconds": round(time.perf_counter() - t0, 1), "setups": out}))


if __name__ == "__main__":
    main()
