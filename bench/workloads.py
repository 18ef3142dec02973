"""The live GPU workloads that compare CUDA allocators under PyTorch, one process per run.

    python bench/workloads.py WORKLOAD ALLOCATOR     # runs it, prints one JSON line
    python bench/workloads.py --list                 # the workloads and the figures each reports

WORKLOAD   allocfree  torch.empty + free from Python, sizes mixed as in training   us_per_alloc
           varlen     transformer training, sequence length changing every step     step_ms, frag_ratio
           resnet     ResNet-50 training at one fixed shape                          step_ms, frag_ratio
ALLOCATOR  native | expandable | async (PyTorch's, through PYTORCH_CUDA_ALLOC_CONF) | gpumem

The allocator is chosen before CUDA starts, so each run is its own process; bench/compare_allocators.py
runs every (workload, allocator) pair and tabulates the figures. The JSON line holds the workload's
figures, torch's peak allocated and reserved bytes (max_allocated_gib, max_reserved_gib; frag_ratio is
reserved / allocated) and the device's own peak (peak_used_gib: cudaMemGetInfo after each step).

The module imports without torch or CUDA (torch is imported when a workload runs), so the other
benchmarks take the model, the allocator choice and the training step from here:

    import workloads
    workloads.select_allocator("gpumem")   # before CUDA starts
    workloads.WORKLOADS["varlen"].run(steps=20)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ALLOCATORS = ("native", "expandable", "async", "gpumem")
# PyTorch's own allocators, as PYTORCH_CUDA_ALLOC_CONF selects them
TORCH_ALLOC_CONF = {"native": "", "expandable": "expandable_segments:True",
                    "async": "backend:cudaMallocAsync"}
# varlen: sequence lengths drawn per step; the batch keeps about `tokens` tokens per step
SEQ_LENGTHS = (128, 256, 384, 512, 768, 1024, 1536, 2048)
GiB = float(1 << 30)


def select_allocator(name: str) -> None:
    """Make `name` torch's CUDA allocator; call it before anything starts CUDA."""
    if name not in ALLOCATORS:
        raise SystemExit(f"unknown allocator {name!r}; expected one of {', '.join(ALLOCATORS)}")
    if name == "gpumem":
        import gpumem  # registers itself as torch's CUDA allocator

        import torch
        if torch.cuda.is_available() and not gpumem.is_active():
            # A figure labelled gpumem must never come from PyTorch's allocator.
            raise SystemExit(f"gpumem is not torch's allocator: {gpumem.status_line()}")
    else:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = TORCH_ALLOC_CONF[name]


def models():
    """bench/models.py, beside this file, wherever this file was imported from."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import models as m

    return m


def __getattr__(name):
    if name == "GPT":  # workloads.GPT, as bench/soak.py reads it from any workloads file
        return models().GPT
    raise AttributeError(name)


def load(path: str | None = None):
    """The workloads module at `path` (a .py file, or a folder holding workloads.py); this one for None.
    Another file (say ../shared/bench/workloads.py) may import torch: select the allocator first."""
    if path is None:
        return sys.modules[__name__]
    if os.path.isdir(path):
        path = os.path.join(path, "workloads.py")
    path = os.path.abspath(path)
    if path == os.path.abspath(__file__):
        return sys.modules[__name__]
    spec = importlib.util.spec_from_file_location("workloads_under_test", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"no workloads module at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- measuring


class Meter:
    """Wall time between synchronisations of the device, and the device's own peak of memory in use."""

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.peak_used = 0
        self.t0 = None

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def start(self):
        self.sync()
        self.t0 = time.perf_counter()

    def seconds(self):
        self.sync()
        return time.perf_counter() - self.t0

    def sample(self):
        """After a step: the device's memory in use (cudaMemGetInfo), all processes and CUDA's own."""
        if self.cuda:
            free, total = self.torch.cuda.mem_get_info(self.device)
            self.peak_used = max(self.peak_used, total - free)

    def step_figures(self, steps):
        return dict(step_ms=1000 * self.seconds() / steps,
                    peak_used_gib=self.peak_used / GiB if self.cuda else None)


def varlen_shape(rng: random.Random, tokens: int, lengths=SEQ_LENGTHS):
    """(batch, sequence length) of one varlen step: a length from `lengths`, and about `tokens` tokens."""
    seq = rng.choice(lengths)
    return max(1, tokens // seq + rng.randint(-2, 2)), seq


def lm_step(model, opt, ids):
    """One training step of a language model on `ids` (targets = ids), bf16 autocast; returns the
    detached loss. The logits are gone when it returns."""
    import torch
    import torch.nn.functional as F

    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        logits = model(ids)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), ids.view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


# ----------------------------------------------------------------------------- the workloads


def allocfree(n=20000, keep=32, device="cuda", seed=1):
    """`n` torch.empty calls of sizes mixed as in training (256 B to 64 MiB), at most `keep` tensors
    alive (a random one freed per allocation past that): the allocator's cost per call from Python."""
    import torch

    rng = random.Random(seed)
    sizes = [rng.choice((256, 4 << 10, 64 << 10, 1 << 20, 8 << 20, 64 << 20)) for _ in range(n)]
    meter = Meter(device)
    for size in sizes[:200]:  # warm-up: the allocator's first segments, freed at once
        torch.empty(size, dtype=torch.uint8, device=device)
    live = []
    meter.start()
    for size in sizes:
        live.append(torch.empty(size, dtype=torch.uint8, device=device))
        if len(live) > keep:
            del live[rng.randrange(len(live))]
    return dict(us_per_alloc=1e6 * meter.seconds() / n)


def varlen(steps=60, tokens=16384, device="cuda", seed=0, lengths=SEQ_LENGTHS, **gpt):
    """GPT training (bench/models.py, 217M parameters by default; `gpt` overrides vocab, d, layers,
    heads) with AdamW and bf16 autocast, the sequence length drawn anew every step: the shapes change
    every step, which is what fragments a caching allocator."""
    import torch

    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = models().GPT(**gpt).to(device)
    vocab = model.head.out_features
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    meter = Meter(device)
    meter.start()
    for _ in range(steps):
        batch, seq = varlen_shape(rng, tokens, lengths)
        lm_step(model, opt, torch.randint(0, vocab, (batch, seq), device=device))
        meter.sample()
    return meter.step_figures(steps)


def resnet(steps=30, batch=128, image=224, warmup=5, device="cuda"):
    """ResNet-50 training (bench/models.py) at one shape, channels-last, SGD with momentum, bf16
    autocast; `warmup` untimed steps first (cuDNN's algorithm choice)."""
    import torch
    import torch.nn.functional as F

    model = models().resnet50().to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(batch, 3, image, image, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=device)
    meter = Meter(device)
    for i in range(warmup + steps):
        if i == warmup:
            meter.start()
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        meter.sample()
    return meter.step_figures(steps)


@dataclass(frozen=True)
class Workload:
    run: Callable[..., dict]
    figures: tuple  # the keys of run()'s result (or of the JSON line) that compare_allocators tabulates
    what: str


WORKLOADS = {
    "allocfree": Workload(allocfree, ("us_per_alloc",), "torch.empty + free from Python, mixed sizes"),
    "varlen": Workload(varlen, ("step_ms", "frag_ratio"), "GPT training, a new sequence length every step"),
    "resnet": Workload(resnet, ("step_ms", "frag_ratio"), "ResNet-50 training at one shape"),
}


# ----------------------------------------------------------------------------- one run


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", nargs="?", choices=list(WORKLOADS))
    ap.add_argument("allocator", nargs="?", choices=ALLOCATORS)
    ap.add_argument("--list", action="store_true", help="print the workloads and their figures, then exit")
    args = ap.parse_args(argv)
    if not args.list and (args.workload is None or args.allocator is None):
        ap.error("WORKLOAD and ALLOCATOR are required (or --list)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for name, w in WORKLOADS.items():
            print(f"{name:10s} {', '.join(w.figures):20s} {w.what}")
        return 0
    select_allocator(args.allocator)  # before torch starts CUDA
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("workloads.py needs a CUDA GPU")
    torch.empty(1, device="cuda")  # CUDA's context and the allocator's start stay out of the figures
    result = dict(workload=args.workload, allocator=args.allocator)
    result.update(WORKLOADS[args.workload].run())
    try:
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        result.update(max_allocated_gib=allocated / GiB, max_reserved_gib=reserved / GiB,
                      frag_ratio=reserved / allocated)
    except RuntimeError as e:  # an allocator without statistics
        result["stats_error"] = str(e).splitlines()[0]
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
