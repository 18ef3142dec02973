"""gpumem.find_batch_size against Lightning's batch-size finder (power and binsearch modes).

    python bench/batch_size_bench.py                      # GPT, then the CNN (about 5-6 min on an H200)
    python bench/batch_size_bench.py --models gpt         # the issue's setup only
    python bench/batch_size_bench.py --skip-lightning --skip-truth   # gpumem + its fresh check only

Setups (each finder sees the same process setup; ``--fraction`` of the GPU via
``torch.cuda.set_per_process_memory_fraction``, default 0.25):

  gpt  the 12-layer d=1024 transformer of bench/models.py (217M parameters; the varlen workload's),
       sequence 1024, AdamW, bf16 autocast, cross-entropy over the 32000-way logits.
  cnn  a ResNet-18-shaped CNN (BatchNorm, 11M parameters), 3x128x128 images, 1000
       classes, AdamW, bf16 autocast: a different model, to show the probe is not tuned.

"Fits" means 3 training steps in a fresh process without OOM.  In one call of this
script, each finder runs in its own subprocess (so each starts from a clean GPU), one
after the other, and its time is the finder call alone (model construction and process
start excluded).  Each returned size is then checked with 3 more steps in the finder's
own process and with 3 steps in a fresh process; the fresh-process true maximum is
found by a fresh-process search that starts its bracket at the answer of gpumem_step (below).
gpumem appears twice: ``gpumem_step`` is given the benchmark's own step through
``step_fn`` (the step that defines "fits"); ``gpumem`` uses its built-in step, which keeps
the model's output alive through backward as hand-written loops do, so it plans for more
memory per sample than the benchmark's step needs (for the GPT, the bf16 logits).
Prints a table per setup and one JSON line at the end (``{"bench": "batch_size", ...}``).

Options: --allocator gpumem registers gpumem's allocator in every subprocess (default:
PyTorch's own); --skip-lightning, --skip-truth (no true-max search), --skip-fresh (no
fresh-process checks at all), --margin (gpumem's safety margin).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SEQ = 1024
VOCAB = 32000


# ----------------------------------------------------------------------------- setups (child side)


def start_cuda(allocator, fraction):
    if allocator == "gpumem":
        import gpumem  # noqa: F401  registers gpumem's allocator before CUDA starts
        import torch
    else:
        import torch

        torch.cuda.init()  # CUDA first: PyTorch's own allocator stays in place
    torch.cuda.set_device(0)
    torch.cuda.set_per_process_memory_fraction(fraction)
    return torch


def build(kind):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    if kind == "gpt":
        from models import GPT  # bench/models.py, beside this script

        return GPT(vocab=VOCAB)

    def block(i, o, stride):
        return nn.Sequential(
            nn.Conv2d(i, o, 3, stride, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True),
            nn.Conv2d(o, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True))

    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    chans = [64, 64, 128, 256, 512]
    for i in range(4):
        layers += [block(chans[i], chans[i + 1], 1 if i == 0 else 2), block(chans[i + 1], chans[i + 1], 1)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000)]
    return nn.Sequential(*layers)


def make_batch(kind, b):
    import torch

    if kind == "gpt":
        ids = torch.randint(0, VOCAB, (b, SEQ), device="cuda")
        return ids, ids
    return torch.randn(b, 3, 128, 128, device="cuda"), torch.randint(0, 1000, (b,), device="cuda")


def loss_of(kind, out, target):
    import torch.nn.functional as F

    if kind == "gpt":
        return F.cross_entropy(out.flatten(0, 1), target.flatten())
    return F.cross_entropy(out, target)


def train_step(kind, net, opt, b):
    """One step as Lightning's training_step runs it: the output is dropped once the loss exists."""
    import torch

    x, y = make_batch(kind, b)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss_of(kind, net(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def train_steps(kind, net, b, steps=3):
    """The definition of "fits": `steps` steps of a fresh AdamW, bf16 autocast."""
    import torch

    opt = torch.optim.AdamW(net.parameters())
    for _ in range(steps):
        train_step(kind, net, opt, b)
    torch.cuda.synchronize()
    del opt


def fits_here(kind, net, b):
    import gc

    import torch

    try:
        net.cuda()  # Lightning's tuner can leave the model on the CPU when it restores its checkpoint
        train_steps(kind, net, b)
        ok = True
    except torch.cuda.OutOfMemoryError:
        ok = False
    gc.collect()
    torch.cuda.empty_cache()
    return ok


def child(a):
    torch = start_cuda(a.allocator, a.fraction)
    if a.allocator != "gpumem":
        import gpumem  # noqa: F401  (after CUDA: does not replace the allocator)
    net = build(a.model).cuda()
    out = {"finder": a.child}
    if a.child == "fits":
        torch.cuda.reset_peak_memory_stats()
        out.update(batch=a.batch, fits=fits_here(a.model, net, a.batch),
                   peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved())
    else:
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        t0 = time.perf_counter()
        if a.child.startswith("gpumem"):
            res = gpumem_find(a, net)
            batch = res.batch_size
            out.update(trials=len(res.trials), failed_trials=sum(not t.fits for t in res.trials),
                       predicted_peak=res.predicted_peak_bytes, measured_peak=res.measured_peak_bytes,
                       bytes_per_sample=res.bytes_per_sample, target_bytes=res.target_bytes,
                       trial_sizes=[(t.batch_size, t.outcome) for t in res.trials])
        else:
            batch, ntrials = lightning_find(a.model, net, a.child.split("_")[1])
            out.update(trials=ntrials)
        seconds = time.perf_counter() - t0
        torch.cuda.synchronize()
        after = torch.cuda.memory_reserved()
        out.update(batch=batch, seconds=seconds, reserved_before=before, reserved_after=after,
                   fits_same_process=fits_here(a.model, net, batch))
    print("RESULT " + json.dumps(out), flush=True)


def gpumem_find(a, net):
    """gpumem.find_batch_size as the finder a.child names: gpumem_step gets the benchmark's own step
    (the one "fits" is defined by) through step_fn; gpumem uses its built-in step."""
    import torch

    import gpumem

    if a.child == "gpumem_step":
        opt = torch.optim.AdamW(net.parameters())
        return gpumem.find_batch_size(net, step_fn=lambda b: train_step(a.model, net, opt, b),
                                      optimizer=opt, margin=a.margin)
    kw = dict(dtype=torch.long, input_range=(0, VOCAB)) if a.model == "gpt" else {}
    shape = (SEQ,) if a.model == "gpt" else (3, 128, 128)
    return gpumem.find_batch_size(net, shape, autocast=torch.bfloat16, optimizer=torch.optim.AdamW,
                                  loss_fn=lambda o, x: loss_of(a.model, o, x if a.model == "gpt" else
                                                               torch.randint(0, 1000, (x.shape[0],),
                                                                             device="cuda")),
                                  margin=a.margin, **kw)


def lightning_find(kind, net, mode):
    import torch
    from torch.utils.data import DataLoader, Dataset

    try:
        import lightning.pytorch as pl
        from lightning.pytorch.tuner import Tuner
    except ImportError:  # the older package name
        import pytorch_lightning as pl
        from pytorch_lightning.tuner import Tuner

    class Indices(Dataset):
        """Only indices travel through the loader; the batch is made on the GPU (no loader cost)."""

        def __len__(self):
            return 10 ** 7

        def __getitem__(self, i):
            return i

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net
            self.batch_size = 2
            self.trials = 0

        def train_dataloader(self):
            self.trials += 1
            return DataLoader(Indices(), batch_size=self.batch_size, num_workers=0)

        def training_step(self, idx, _):
            x, y = make_batch(kind, idx.shape[0])
            return loss_of(kind, self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    lm = LM()
    with tempfile.TemporaryDirectory() as d:
        trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_epochs=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=d)
        size = Tuner(trainer).scale_batch_size(lm, mode=mode, steps_per_trial=3, init_val=2, max_trials=25)
    return int(size), lm.trials


# ----------------------------------------------------------------------------- driver


def run_child(a, what, batch=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", what, "--models", a.cur_model,
           "--fraction", str(a.fraction), "--allocator", a.allocator, "--margin", str(a.margin)]
    if batch is not None:
        cmd += ["--batch", str(batch)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-5000:])
        raise SystemExit(f"child {what} {batch} failed (rc {p.returncode})")
    r = json.loads(lines[-1][7:])
    r["process_seconds"] = time.perf_counter() - t0
    if what.startswith("gpumem"):
        sys.stderr.write("".join(l + "\n" for l in p.stderr.splitlines() if "find_batch_size" in l))
    return r


class Fresh:
    """Fresh-process fits(b), cached, with monotone inference (b <= a known fit fits)."""

    def __init__(self, a):
        self.a, self.known, self.runs, self.seconds = a, {}, 0, 0.0

    def infer(self, b):
        if b in self.known:
            return self.known[b]
        if any(ok and k >= b for k, ok in self.known.items()):
            return True
        if any(not ok and k <= b for k, ok in self.known.items()):
            return False
        return None

    def __call__(self, b, force=False):
        v = None if force else self.infer(b)
        if v is None:
            r = run_child(self.a, "fits", b)
            self.runs += 1
            self.seconds += r["process_seconds"]
            v = self.known[b] = bool(r["fits"])
            print(f"  fresh process, batch {b}: {'fits' if v else 'OOM'} ({r['process_seconds']:.0f} s)",
                  file=sys.stderr, flush=True)
        return v

    def true_max(self, start):
        """Largest fitting b: gallop from `start`, then bisect."""
        if self(start):
            lo, step = start, 1
            while self(lo + step):
                lo += step
                step *= 2
            hi = lo + step
        else:
            hi, step = start, 1
            while hi - step >= 1 and not self(hi - step):
                hi -= step
                step *= 2
            lo = max(0, hi - step)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self(mid):
                lo = mid
            else:
                hi = mid
        return lo


def bench_model(a):
    print(f"\n== {a.cur_model}: fraction {a.fraction}, allocator {a.allocator}", file=sys.stderr, flush=True)
    # gpumem_step: find_batch_size given the benchmark's own step (step_fn), the step whose fit
    # defines the true maximum. gpumem: its built-in step, which keeps the model's output alive
    # through backward as hand-written loops do, so it needs more memory per sample than this step.
    gpumem_finders = ["gpumem_step", "gpumem"]
    finders = gpumem_finders + ([] if a.skip_lightning else ["lightning_power", "lightning_binsearch"])
    res = {}
    for f in finders:
        res[f] = run_child(a, f)
        print(f"  {f}: batch {res[f]['batch']} in {res[f]['seconds']:.1f} s", file=sys.stderr, flush=True)
    fresh = Fresh(a)
    true_max = None
    if not a.skip_fresh:
        for f in gpumem_finders:
            res[f]["fits_fresh"] = fresh(res[f]["batch"], force=True)
        if not a.skip_truth:
            true_max = fresh.true_max(res["gpumem_step"]["batch"])
        for f in finders[len(gpumem_finders):]:
            res[f]["fits_fresh"] = fresh(res[f]["batch"])
    for f in finders:
        r = res[f]
        r["pct_of_true_max"] = round(100.0 * r["batch"] / true_max, 1) if true_max else None
    targets = {}
    for f in gpumem_finders:
        g = res[f]
        targets[f] = {
            "fits_same_process": g["fits_same_process"],
            "fits_fresh_process": g.get("fits_fresh"),
            "at_least_97pct_of_true_max": (g["pct_of_true_max"] >= 97.0) if true_max else None,
            "faster_than_lightning_power": (g["seconds"] < res["lightning_power"]["seconds"])
            if "lightning_power" in res else None,
            "reserved_after_le_before": g["reserved_after"] <= g["reserved_before"],
        }
    # table
    GiB = float(1 << 30)
    print(f"\n{a.cur_model} (fraction {a.fraction}, {a.allocator} allocator): fresh-process true max "
          f"{true_max if true_max else 'not measured'} ({fresh.runs} fresh runs, {fresh.seconds:.0f} s)")
    print(f"{'finder':22s}{'batch':>7s}{'% max':>8s}{'seconds':>9s}{'trials':>8s}{'same':>6s}{'fresh':>7s}"
          f"{'reserved before':>17s}{'after':>10s}")
    for f in finders:
        r = res[f]
        yn = lambda v: "-" if v is None else ("yes" if v else "NO")  # noqa: E731
        pct = "-" if r["pct_of_true_max"] is None else f"{r['pct_of_true_max']:.1f}"
        print(f"{f:22s}{r['batch']:>7d}{pct:>8s}{r['seconds']:>9.2f}{r.get('trials', 0):>8d}"
              f"{yn(r['fits_same_process']):>6s}{yn(r.get('fits_fresh')):>7s}"
              f"{r['reserved_before'] / GiB:>13.2f} GiB{r['reserved_after'] / GiB:>6.2f} GiB")
    for f, t in targets.items():
        print(f"targets ({f}): " + ", ".join(f"{k}={v}" for k, v in t.items()), flush=True)
    return {"model": a.cur_model, "fraction": a.fraction, "allocator": a.allocator, "true_max": true_max,
            "fresh_runs": fresh.runs, "finders": res, "targets": targets}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt,cnn", help="comma-separated: gpt, cnn")
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--allocator", choices=["native", "gpumem"], default="native")
    ap.add_argument("--margin", type=float, default=0.02)
    ap.add_argument("--skip-lightning", action="store_true")
    ap.add_argument("--skip-truth", action="store_true")
    ap.add_argument("--skip-fresh", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        a.model = a.models
        return child(a)
    t0 = time.perf_counter()
    out = []
    for m in a.models.split(","):
        a.cur_model = m.strip()
        out.append(bench_model(a))
    print(json.dumps({"bench": "batch_size", "seconds": round(time.perf_counter() - t0, 1), "setups": out}))


if __name__ == "__main__":
    main()
