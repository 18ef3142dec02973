"""The workloads of bench/pressure.py and the one-run worker it starts, one process per run.

    python bench/pressure_workloads.py WORKLOAD ALLOCATOR [--fraction F] [--stop-on-oom] [--quick]
                                       [--passes N] [--release-slack S] [--bound fraction|device]
                                       [--lockstep]
    python bench/pressure_workloads.py WORKLOAD none --device cpu --tiny     # the code path, on the CPU

Prints one JSON line: OOM steps, step time, torch's peak allocated / reserved bytes, the device's
total. Each workload is a fixed sequence of steps drawn from a seeded generator before the first step,
so every allocator sees the same shapes in the same order; each takes a few seconds on an H100.

WORKLOAD   allocfree  torch.empty + free from Python, sizes 256 B to 64 MiB, at most 32 alive
           varlen     GPT training, a new sequence length (and batch) every step
           resnet     ResNet-50 training at one shape
           vit        ViT training (patch embedding + encoder) at one shape
           moe        mixture-of-experts training: top-2 routing by a frozen router, so each expert's
                      batch size depends on the data and changes every step
           bert       BERT-like encoder inference, batch size and sequence length new every step
           generate   autoregressive generation, the KV cache grown by one token per decode step
                      (torch.cat: a new, larger cache every token), prompt and batch new per request
           ckpt       LLaMA-style training (RMSNorm, SwiGLU, SDPA) with activation checkpointing,
                      a new sequence length every step
ALLOCATOR  native | expandable | async (PyTorch's, PYTORCH_CUDA_ALLOC_CONF) | gpumem (the defaults,
           release:lazy,stitch:true: new pages past the live high water backed by free cached pages'
           memory while no cap is set) | gpumem_nostitch (release:lazy,stitch:false: the defaults
           before stitching) | gpumem_hw (release:high_water,stitch:false: cached pages released
           before reserving past the live high water) | rmm (RAPIDS RMM's pool through
           rmm_torch_allocator, capped by its maximum pool size) | none (CPU only) | a gpumem name with
           GPUMEM_CONF keys added after '+' (gpumem+stitch_slack:0.02: gpumem's configuration and
           stitch_slack:0.02; bench/lockstep.py runs such workers beside the others), any gpumem name
           with @DIR: the gpumem package installed in DIR (another build: pip install --target DIR)

--fraction F caps the run with torch.cuda.set_per_process_memory_fraction(F) (rmm: a pool of at most
F * total bytes). A step that raises an out-of-memory error counts as one OOM step and the run goes on
with the next step; --stop-on-oom ends the run at the first (what a bisection needs to know).

--passes N runs the whole step list N times in the one process. Every step of the first pass meets
its shapes for the first time and pays their one-time costs (cuBLAS heuristics, kernels loaded,
workspaces), whatever the allocator; passes 2..N meet the same shapes again, as the epochs of a real
run do. The first pass's figures keep their meaning whatever N is: step_ms (the mean from the warm-up
steps on), ooms, first_oom_step, max_allocated / max_reserved (its peaks: what a cap is measured
against). Passes 2..N add steady_step_ms (the mean over the same steps of each), steady_ooms (their
OOM steps, apart from `ooms`: the lowest passing cap is defined by one pass, so only the first
pass's OOMs decide it), steady_device_allocs / steady_device_frees (num_device_alloc /
num_device_free of the allocator's statistics per timed step: 0 when the allocator maps nothing once
the shapes repeat; None for async and rmm, whose statistics do not count them) and
steady_max_allocated / steady_max_reserved (the peaks over every pass). With --stop-on-oom an OOM in
any pass ends the run, and the pass it ended has no step time. pass_step_ms lists each pass's mean
step: whether a policy that remaps (gpumem_hw) settles as the shapes repeat.

--lockstep makes the run one of several taking turns on the GPU (bench/lockstep.py starts them): it
waits for a line on stdin before each pass and prints that pass's figures as a `PASS {json}` line after
it, so that the passes of all the allocators compared follow each other closely in time.

--release-slack S (gpumem_hw only) sets gpumem's release_slack: how far reserved may exceed the live
high water (gpumem's default 0.005).

--bound device --fraction F bounds the device's memory itself instead: the allocator runs uncapped,
with F * total bytes of the device left to it. The worker runs the step list once first (unmeasured:
kernels loaded, library handles and workspaces made, none of them the allocator's choice), empties
the allocator's cache (torch.cuda.empty_cache), then takes all the device's free memory beyond
F * total minus what the allocator still holds (the model, its optimizer state) with one cuMemAlloc
of its own (a "ballast", outside every allocator), resets the peaks and runs the measured passes.
Every allocator then meets the same physical wall: a cap that PyTorch's cudaMallocAsync backend does
not give, as set_per_process_memory_fraction bounds its live bytes only (torch counts requested
bytes against the fraction, while the driver's pool under it reserves more: allocfree at 1.0011x
ran with 1.22x the cap reserved, H100, the 36c944b search). bound_bytes in the JSON is the memory the
allocator had: what it held plus what the ballast left free. --ballast-freed-after K gives the ballast
back after pass K: memory outside the allocator freed mid-run, which it may then use (pass_step_ms and
pass_driver_ms, gpumem's driver time per step of each pass, show whether it stops remapping).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ALLOCATORS = ("native", "expandable", "async", "gpumem", "gpumem_nostitch", "gpumem_hw", "rmm")
TORCH_ALLOC_CONF = {"native": "", "expandable": "expandable_segments:True", "async": "backend:cudaMallocAsync"}
# gpumem's defaults and the two configurations before them; set explicitly, so a GPUMEM_CONF of the caller's
# shell changes nothing.
GPUMEM_CONF = {"gpumem": "release:lazy,stitch:true", "gpumem_nostitch": "release:lazy,stitch:false",
               "gpumem_hw": "release:high_water,stitch:false"}


def split_build(name: str) -> tuple[str, str | None]:
    """A gpumem name may end in `@DIR`: that configuration run with the gpumem package installed in DIR
    (`pip install --no-build-isolation --target DIR TREE`: another build of the pool, A/B'd in the
    same run as this one; bench/lockstep.py gives both turns on one GPU). Returns (name, DIR or None)."""
    base, at, build = name.partition("@")
    return (base, build) if at else (name, None)


def gpumem_conf(name: str) -> str | None:
    """The GPUMEM_CONF of a gpumem configuration: one of GPUMEM_CONF's names, or such a name with keys
    added after '+' (`gpumem+stitch_slack:0.015`, `gpumem+stitch_slack:0.02+page_size:2MiB`: the
    driver's lists are comma-separated), either perhaps with `@DIR` (split_build); None for any other
    allocator. The pool checks the keys."""
    base, *extra = split_build(name)[0].split("+")
    if base not in GPUMEM_CONF or not all(extra):
        return None
    return ",".join([GPUMEM_CONF[base], *extra])


def is_allocator(name: str) -> bool:
    """One of ALLOCATORS, or a gpumem name with keys (gpumem_conf), with `@DIR` only where DIR holds a
    gpumem package: what a worker can run on the GPU."""
    if name in ALLOCATORS:
        return True
    build = split_build(name)[1]
    if build is not None and not os.path.isfile(os.path.join(build, "gpumem", "__init__.py")):
        return False
    return gpumem_conf(name) is not None


def allocator_arg(text: str) -> str:
    """The argparse type of the worker's allocator: an allocator (is_allocator), or 'none' (CPU)."""
    if text == "none" or is_allocator(text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is none of {', '.join(ALLOCATORS + ('none',))} nor "
                                     "gpumem+KEY:VALUE[+KEY:VALUE], nor a gpumem name with @DIR where DIR "
                                     "holds a gpumem package")


WORKLOADS = ("allocfree", "varlen", "resnet", "vit", "moe", "bert", "generate", "ckpt")
# Bytes of device memory one worker uses outside its cap (CUDA context, cuBLAS/cuDNN handles): the
# driver keeps the parallel trials' caps plus this under the device's memory.
CONTEXT_BYTES = 900 << 20


def release_slack_arg(text: str) -> float:
    """The argparse type of --release-slack (this script, pressure.py, remap_at_cap.py) and of
    remap_at_cap.py's --early-ends-by-page: a fraction in [0, 1], as GPUMEM_CONF's keys of those names."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:  # NaN too
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def select_allocator(name: str, fraction: float | None, release_slack: float | None = None) -> None:
    """Make `name` torch's CUDA allocator; before anything starts CUDA (rmm: after, see rmm_pool).
    `release_slack`: gpumem_hw's slack above the live high water (None: gpumem's default)."""
    conf = gpumem_conf(name)
    if conf is not None:
        if release_slack is not None:
            conf += f",release_slack:{release_slack}"
        os.environ["GPUMEM_CONF"] = conf
        build = split_build(name)[1]
        if build is not None:
            sys.path.insert(0, os.path.abspath(build))  # that build's gpumem, not the installed one
        import gpumem  # noqa: F401  registers itself as torch's CUDA allocator
    elif name in TORCH_ALLOC_CONF:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = TORCH_ALLOC_CONF[name]
    elif name == "rmm":
        import rmm  # noqa: F401  fails here, clearly, where RMM is not installed
        import torch
        from rmm.allocators.torch import rmm_torch_allocator

        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)


def rmm_pool(fraction: float | None, total: int):
    """RAPIDS RMM's pool as the current device resource, at most fraction * total bytes (256-aligned),
    under a statistics adaptor; returns (the adaptor, the pool) for rmm_figures()."""
    import rmm

    limit = int(fraction * total) // 256 * 256 if fraction else None
    base = rmm.mr.CudaMemoryResource()
    pool = rmm.mr.PoolMemoryResource(base, initial_pool_size=min(limit or 1 << 30, 1 << 30) // 256 * 256,
                                     maximum_pool_size=limit)
    stats = rmm.mr.StatisticsResourceAdaptor(pool)
    rmm.mr.set_current_device_resource(stats)
    return stats, pool


def rmm_figures(stats, pool) -> dict:
    """max_allocated from RMM's statistics adaptor, max_reserved from its pool's size.

    `allocation_counts` is a dict in RMM before 26.x and an rmm.statistics.Statistics (the same names
    as attributes: current_bytes, peak_bytes, total_bytes, ...) from 26.x. PoolMemoryResource's
    pool_size() is the bytes the pool holds from CUDA; the pool only grows (it gives memory back when
    destroyed), so at the end of a run it is the run's maximum. None where this RMM lacks pool_size()."""
    counts = stats.allocation_counts
    peak = counts["peak_bytes"] if isinstance(counts, dict) else counts.peak_bytes
    size = getattr(pool, "pool_size", None)
    return dict(max_allocated=int(peak), max_reserved=int(size()) if callable(size) else None)


# ----------------------------------------------------------------------------- the models


def build_models():
    """The networks, defined once torch is imported (this module imports without torch)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    class RMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    class LlamaBlock(nn.Module):
        """Pre-norm attention (SDPA, causal) and SwiGLU MLP, no biases."""

        def __init__(self, d, heads, hidden):
            super().__init__()
            self.heads = heads
            self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.out = nn.Linear(d, d, bias=False)
            self.gate_up = nn.Linear(d, 2 * hidden, bias=False)
            self.down = nn.Linear(hidden, d, bias=False)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
            gate, up = self.gate_up(self.n2(x)).chunk(2, dim=-1)
            return x + self.down(F.silu(gate) * up)

    class Llama(nn.Module):
        def __init__(self, vocab, d, layers, heads, hidden, checkpointed):
            super().__init__()
            self.checkpointed = checkpointed
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(LlamaBlock(d, heads, hidden) for _ in range(layers))
            self.norm = RMSNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, ids):
            x = self.emb(ids)
            for blk in self.blocks:
                x = checkpoint(blk, x, use_reentrant=False) if self.checkpointed else blk(x)
            return self.head(self.norm(x))

    class MoE(nn.Module):
        """A token-level mixture of experts: a frozen router picks 2 of `experts` MLPs per token; each
        expert runs on the tokens routed to it (index_select / index_add_), so its batch is whatever
        the data sends it."""

        def __init__(self, d, hidden, experts, layers):
            super().__init__()
            self.router = nn.ModuleList(nn.Linear(d, experts, bias=False) for _ in range(layers))
            for r in self.router:
                r.requires_grad_(False)
            self.experts = nn.ModuleList(
                nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
                              for _ in range(experts)) for _ in range(layers))
            self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))

        def forward(self, x):
            for router, experts, norm in zip(self.router, self.experts, self.norms):
                h = norm(x)
                weight, chosen = torch.topk(router(h).softmax(-1), 2, dim=-1)
                out = torch.zeros_like(h)
                for e, expert in enumerate(experts):
                    token, slot = (chosen == e).nonzero(as_tuple=True)  # data-dependent size
                    if token.numel():
                        y = expert(h.index_select(0, token)) * weight[token, slot].unsqueeze(-1)
                        out = out.index_add(0, token, y.to(out.dtype))
                x = x + out
            return x

    class ViT(nn.Module):
        def __init__(self, image, patch, d, layers, heads, classes):
            super().__init__()
            self.patch = nn.Conv2d(3, d, patch, patch)
            n = (image // patch) ** 2
            self.cls = nn.Parameter(torch.zeros(1, 1, d))
            self.pos = nn.Parameter(torch.zeros(1, n + 1, d))
            self.encoder = nn.ModuleList(
                nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
                for _ in range(layers))
            self.head = nn.Linear(d, classes)

        def forward(self, x):
            x = self.patch(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
            for layer in self.encoder:
                x = layer(x)
            return self.head(x[:, 0])

    return dict(Llama=Llama, MoE=MoE, ViT=ViT)


def bench_models():
    """bench/models.py (GPT, resnet50), beside this file."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import models

    return models


# ----------------------------------------------------------------------------- the workloads
# Each returns (steps, warm-up steps, step(i)); step(i) runs step i and drops what it made. The
# shapes are drawn before the first step. `tiny` shrinks every dimension for the CPU path.


def _train_step(torch, model, opt, loss_fn):
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        loss = loss_fn(model)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


ALLOCFREE_LIVE = 32  # allocfree keeps at most this many tensors (one more for a moment)


def allocfree_plan(rng, tiny):
    """allocfree's requests, which depend on its seeded random numbers only: each tensor's bytes, and
    after each, the index of the earlier tensor freed then (None while at most ALLOCFREE_LIVE are
    alive). The workload and bench/record_trace.py (its trace, without a GPU) both follow it."""
    n = 200 if tiny else 20000
    sizes = [rng.choice((256, 4 << 10, 64 << 10, 1 << 20, 8 << 20, 64 << 20)) for _ in range(n)]
    drops = [rng.random() for _ in range(n)]
    live: list = []
    frees: list = []
    for j in range(n):
        live.append(j)
        frees.append(live.pop(int(drops[j] * len(live))) if len(live) > ALLOCFREE_LIVE else None)
    return sizes, frees


def w_allocfree(torch, tiny, rng):
    sizes, frees = allocfree_plan(rng, tiny)
    n = len(sizes)
    live: dict = {}
    chunk = 50 if tiny else 2000  # ten steps: an OOM is counted per step

    # The tensors the plan keeps alive when each step starts. A step begins by dropping any others: the
    # last pass's (a later pass repeats the first), or those a step lost to an out-of-memory error
    # would have freed (the run goes on after an OOM step).
    alive_at, alive = [], set()
    for i in range(n // chunk):
        alive_at.append(frozenset(alive))
        for j in range(i * chunk, (i + 1) * chunk):
            alive.add(j)
            alive.discard(frees[j])

    def step(i):
        for k in [k for k in live if k not in alive_at[i]]:
            del live[k]
        for j in range(i * chunk, (i + 1) * chunk):
            live[j] = torch.empty(sizes[j] // (64 if tiny else 1), dtype=torch.uint8, device=DEVICE)
            if frees[j] is not None:
                live.pop(frees[j], None)  # absent: made in a step lost to an OOM
    step.live = live  # the tensors alive (tests)
    return n // chunk, 1, step


def w_lm(torch, tiny, rng, *, checkpointed):
    """varlen (GPT, bench/models.py) or ckpt (Llama with checkpointing): a length drawn per step."""
    import torch.nn.functional as F

    if checkpointed:
        vocab, d, layers, heads, tokens = (512, 64, 2, 4, 256) if tiny else (32000, 1024, 12, 16, 16384)
        model = build_models()["Llama"](vocab, d, layers, heads, 8 * d // 3 // 64 * 64, True)
        lengths = (64, 128) if tiny else (256, 512, 1024, 1536, 2048, 3072, 4096)
    else:
        vocab, d, layers, heads, tokens = (512, 64, 2, 4, 256) if tiny else (32000, 768, 8, 12, 12288)
        model = bench_models().GPT(vocab=vocab, d=d, layers=layers, heads=heads)
        lengths = (32, 64) if tiny else (128, 256, 384, 512, 768, 1024, 1536, 2048)
    model = model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    steps = 3 if tiny else 14
    shapes = []
    for _ in range(steps):
        seq = rng.choice(lengths)
        shapes.append((max(1, tokens // seq + rng.randint(-2, 2)), seq))
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    data = [torch.randint(0, vocab, s, generator=gen) for s in shapes]

    def step(i):
        ids = data[i].to(DEVICE)
        _train_step(torch, model, opt, lambda m: F.cross_entropy(m(ids).float().flatten(0, 1), ids.flatten()))
    step.shapes = shapes  # (batch, length) per step, for bench/growth_cost.py's per-step table
    return steps, 1, step


def w_image(torch, tiny, rng, *, vit):
    import torch.nn.functional as F

    if vit:
        image, batch = (32, 4) if tiny else (224, 96)
        model = build_models()["ViT"](image, 16, 64 if tiny else 768, 2 if tiny else 8, 4 if tiny else 12, 1000)
        model = model.to(DEVICE)
    else:
        image, batch = (32, 4) if tiny else (224, 96)
        model = bench_models().resnet50().to(DEVICE, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    x = torch.randn(batch, 3, image, image, generator=gen).to(DEVICE)
    if not vit:
        x = x.to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), generator=gen).to(DEVICE)

    def step(i):
        _train_step(torch, model, opt, lambda m: F.cross_entropy(m(x), y))
    return (2 if tiny else 10), 2, step


def w_moe(torch, tiny, rng):
    d, hidden, experts, layers = (32, 64, 4, 2) if tiny else (1024, 2048, 8, 4)
    model = build_models()["MoE"](d, hidden, experts, layers).to(DEVICE)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    steps = 3 if tiny else 14
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    centres = torch.randn(experts, d, generator=gen) * 2
    data = []
    for _ in range(steps):
        # Tokens clustered around a few centres, weighted anew each step: the experts' loads swing.
        n = rng.randint(64, 128) if tiny else rng.randint(12288, 24576)
        weights = torch.tensor([rng.random() ** 3 for _ in range(experts)])
        which = torch.multinomial(weights / weights.sum(), n, replacement=True, generator=gen)
        data.append(centres[which] + torch.randn(n, d, generator=gen))

    def step(i):
        x = data[i].to(DEVICE)
        _train_step(torch, model, opt, lambda m: m(x).float().pow(2).mean())
    return steps, 1, step


def w_bert(torch, tiny, rng):
    d, layers, heads = (64, 2, 4) if tiny else (768, 12, 12)
    enc = nn_encoder(torch, d, layers, heads).to(DEVICE, torch.bfloat16).eval()
    emb = torch.nn.Embedding(512 if tiny else 30522, d).to(DEVICE, torch.bfloat16)
    steps = 4 if tiny else 40
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    shapes = [(rng.randint(1, 8 if tiny else 256), rng.choice((16, 32) if tiny else (32, 64, 128, 256, 384, 512)))
              for _ in range(steps)]
    data = [torch.randint(0, emb.num_embeddings, s, generator=gen) for s in shapes]

    def step(i):
        with torch.no_grad():
            ids = data[i].to(DEVICE)
            pad = ids == 0  # a padding mask, as batched inference has
            out = enc(emb(ids), src_key_padding_mask=pad)
            out[:, 0].float().sum().item()
    return steps, 1, step


def nn_encoder(torch, d, layers, heads):
    layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def w_generate(torch, tiny, rng):
    """GPT-2 small shaped decoder, bf16 inference: prefill a prompt, then decode token by token with
    a per-layer KV cache that grows by torch.cat (each token a new, slightly larger cache)."""
    import torch.nn.functional as F

    vocab, d, layers, heads = (512, 64, 2, 4) if tiny else (50257, 768, 12, 12)
    hd = d // heads
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    w = dict(emb=torch.randn(vocab, d, generator=gen) * 0.02,
             qkv=[torch.randn(d, 3 * d, generator=gen) * 0.02 for _ in range(layers)],
             out=[torch.randn(d, d, generator=gen) * 0.02 for _ in range(layers)],
             up=[torch.randn(d, 4 * d, generator=gen) * 0.02 for _ in range(layers)],
             down=[torch.randn(4 * d, d, generator=gen) * 0.02 for _ in range(layers)])
    w = {k: ([t.to(DEVICE, torch.bfloat16) for t in v] if isinstance(v, list) else v.to(DEVICE, torch.bfloat16))
         for k, v in w.items()}
    requests = 2 if tiny else 6
    shapes = [(rng.randint(2, 4) if tiny else rng.randint(8, 48), rng.randint(8, 16) if tiny else rng.randint(128, 768),
               4 if tiny else rng.randint(96, 160)) for _ in range(requests)]

    def forward(x, cache, causal):
        b, t, _ = x.shape
        for li in range(layers):
            h = F.layer_norm(x, (d,))
            q, k, v = (h @ w["qkv"][li]).view(b, t, 3, heads, hd).transpose(1, 3).unbind(2)
            if cache[li] is not None:
                k, v = torch.cat([cache[li][0], k], 2), torch.cat([cache[li][1], v], 2)
            cache[li] = (k, v)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            x = x + a.transpose(1, 2).reshape(b, t, d) @ w["out"][li]
            x = x + F.gelu(F.layer_norm(x, (d,)) @ w["up"][li]) @ w["down"][li]
        return F.layer_norm(x, (d,)) @ w["emb"].T

    def step(i):
        batch, prompt, new = shapes[i]
        with torch.no_grad():
            ids = torch.randint(0, vocab, (batch, prompt), device=DEVICE)
            cache: list = [None] * layers
            logits = forward(w["emb"][ids], cache, True)
            for _ in range(new):
                nxt = logits[:, -1].float().argmax(-1, keepdim=True)
                logits = forward(w["emb"][nxt], cache, False)
            logits.sum().item()
    return requests, 1, step


def make_workload(name, torch, tiny, seed=0):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    return {"allocfree": lambda: w_allocfree(torch, tiny, rng),
            "varlen": lambda: w_lm(torch, tiny, rng, checkpointed=False),
            "ckpt": lambda: w_lm(torch, tiny, rng, checkpointed=True),
            "resnet": lambda: w_image(torch, tiny, rng, vit=False),
            "vit": lambda: w_image(torch, tiny, rng, vit=True),
            "moe": lambda: w_moe(torch, tiny, rng),
            "bert": lambda: w_bert(torch, tiny, rng),
            "generate": lambda: w_generate(torch, tiny, rng)}[name]()


# ----------------------------------------------------------------------------- one run

DEVICE = None  # torch.device of the run, set by run()


def is_oom(error: BaseException) -> bool:
    """torch's OutOfMemoryError, or an allocation failure under a cap that reaches Python as a
    RuntimeError: a library's (cuBLAS, cuDNN) or RAPIDS RMM's pool at its maximum size, which raises
    "std::bad_alloc: out_of_memory: RMM failure at: ... Maximum pool size exceeded"."""
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        marker in text for marker in ("out of memory", "ALLOC_FAILED", "std::bad_alloc: out_of_memory"))


# The allocators whose statistics count the calls that take memory from the device and give it back
# (num_device_alloc / num_device_free: cudaMalloc or a map, cudaFree or an unmap): torch's caching
# allocator and gpumem's pool (every gpumem configuration, gpumem_conf). Not async (cudaMallocAsync
# draws from the driver's pool; torch counts no device call of it) nor rmm (torch keeps no statistics
# for a pluggable allocator).
TORCH_COUNTED = ("native", "expandable")


def device_calls(torch, allocator: str):
    """(num_device_alloc, num_device_free) so far, or None where the allocator does not count them."""
    is_gpumem = gpumem_conf(allocator) is not None
    if DEVICE.type != "cuda" or not (is_gpumem or allocator in TORCH_COUNTED):
        return None
    if is_gpumem:
        import gpumem  # its pool's own counters (torch's memory_stats keeps torch's keys)

        stats = gpumem.stats()
    else:
        stats = torch.cuda.memory_stats()
    if "num_device_alloc" not in stats:
        return None
    return int(stats["num_device_alloc"]), int(stats.get("num_device_free", 0))


def driver_ms(allocator: str):
    """{kind: ms} gpumem's pools have spent so far per kind of upstream call (gpumem.driver_time():
    map, unmap, segment, event; wait, for the device), or None for another allocator."""
    if DEVICE.type != "cuda" or gpumem_conf(allocator) is None:
        return None
    import gpumem

    return {k: v["ms"] for k, v in gpumem.driver_time().items()}


def ballast_bytes(free: int, held: int, bound: int) -> int:
    """The bytes a ballast takes so that the allocator, holding `held` bytes of the device, has `bound`
    in all: the device's `free` bytes beyond bound - held. Raises ValueError where the allocator already
    holds more than the bound, or the device has less free than the bound leaves it."""
    if held > bound:
        raise ValueError(f"the allocator holds {held:,} bytes after the warm-up pass, more than the bound "
                         f"of {bound:,}")
    if free < bound - held:
        raise ValueError(f"the device has {free:,} bytes free, less than the {bound - held:,} the bound "
                         "leaves the allocator")
    return free - (bound - held)


class Ballast:
    """Device memory taken outside every allocator (the driver's cuMemAlloc in the current context),
    so that the allocator under test meets the device's end where the bound says."""

    def __init__(self, nbytes: int):
        import ctypes

        self._ctypes = ctypes
        self._cuda = ctypes.CDLL("libcuda.so.1")
        self.pointer = ctypes.c_uint64(0)
        self.nbytes = nbytes
        if nbytes:
            rc = self._cuda.cuMemAlloc_v2(ctypes.byref(self.pointer), ctypes.c_size_t(nbytes))
            if rc != 0:
                raise RuntimeError(f"the ballast's cuMemAlloc_v2({nbytes:,}) failed: CUDA driver error {rc}")

    def free(self) -> None:
        if self.pointer.value:
            self._cuda.cuMemFree_v2(self.pointer)
            self.pointer = self._ctypes.c_uint64(0)


def bound_device(torch, steps: int, step, bound: int) -> dict:
    """--bound device: one unmeasured pass over the steps, the allocator's cache emptied, then a
    ballast leaving the allocator `bound` bytes of the device in all, and the peaks reset. Returns the
    ballast (its "ballast" key, freed by the caller) and the figures of the bound for the JSON."""
    import gc

    for i in range(steps):
        step(i)
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    held = torch.cuda.memory_reserved()
    ballast = Ballast(ballast_bytes(free, held, bound))
    left = torch.cuda.mem_get_info()[0]
    torch.cuda.reset_peak_memory_stats()
    return dict(ballast=ballast, ballast_bytes=ballast.nbytes, held_after_warmup=held,
                bound_bytes=held + left)


def run(args) -> dict:
    global DEVICE
    if args.device == "cpu" and args.allocator != "none":
        raise SystemExit("--device cpu runs the workloads' code only: the allocator must be 'none'")
    if args.allocator != "rmm" and args.allocator != "none":
        select_allocator(args.allocator, args.fraction, args.release_slack)  # before torch starts CUDA
    import torch

    DEVICE = torch.device(args.device)
    total = 0
    rmm_resources = None
    if DEVICE.type == "cuda":
        if args.allocator == "rmm":
            select_allocator("rmm", args.fraction)
        torch.cuda.init()
        total = torch.cuda.mem_get_info()[1]
        if args.allocator == "rmm":
            rmm_resources = rmm_pool(args.fraction, total)
        elif args.fraction is not None and args.bound == "fraction":
            torch.cuda.set_per_process_memory_fraction(args.fraction)
        torch.empty(1, device=DEVICE)
    torch.backends.cudnn.benchmark = False  # algorithm choice (and its workspace) the same every run
    steps, warmup, step = make_workload(args.workload, torch, args.tiny, args.seed)
    if args.quick:
        steps = max(warmup + 2, math.ceil(steps / 2))
    sync = torch.cuda.synchronize if DEVICE.type == "cuda" else (lambda: None)
    start = min(warmup, steps - 1)  # the first timed step of every pass
    bound = {}
    if args.bound == "device" and args.fraction is not None and DEVICE.type == "cuda":
        try:
            bound = bound_device(torch, steps, step, int(args.fraction * total))
        except ValueError as e:  # the bound cannot be set: the run cannot be held to it
            raise SystemExit(f"--bound device: {e}") from None
    # Per pass: OOM steps, the first one's step, the last one's text, seconds of the timed steps
    # (None: the run stopped at an OOM before or within them), device calls over the timed steps
    # (None: not counted).
    passes: list = []
    peaks: dict = {}
    device_short = False
    for done in range(args.passes):
        if args.lockstep and not sys.stdin.readline():
            break  # the driver (bench/lockstep.py) has ended the run: no more turns
        if bound and done == args.ballast_freed_after:
            bound["ballast"].free()  # the memory outside goes: can the allocator use it again?
        ooms, first_oom, oom_text, t0, calls0, driver0, stopped = 0, None, "", None, None, None, False
        for i in range(steps):
            if i == start:
                sync()
                calls0 = device_calls(torch, args.allocator)
                driver0 = driver_ms(args.allocator)
                t0 = time.perf_counter()
            try:
                step(i)
            except Exception as e:  # noqa: BLE001  an OOM is counted; anything else ends the run
                if not is_oom(e):
                    raise
                ooms += 1
                first_oom = i if first_oom is None else first_oom
                oom_text = str(e).splitlines()[0][:300]  # the last OOM's, as before
                if DEVICE.type == "cuda":
                    # The device itself short (other runs beside this one), not this run's cap: the driver
                    # runs the trial again alone.
                    device_short |= torch.cuda.mem_get_info()[0] < CONTEXT_BYTES
                if args.stop_on_oom:
                    stopped = True
                    break
        sync()
        seconds = None if stopped or t0 is None else time.perf_counter() - t0
        calls1 = device_calls(torch, args.allocator) if calls0 is not None and not stopped else None
        driver1 = driver_ms(args.allocator) if driver0 is not None and not stopped else None
        passes.append(dict(ooms=ooms, first_oom=first_oom, oom=oom_text, seconds=seconds,
                           calls=None if calls1 is None else (calls1[0] - calls0[0], calls1[1] - calls0[1]),
                           driver=None if driver1 is None else {k: driver1[k] - driver0[k] for k in driver1}))
        if len(passes) == 1:
            peaks = memory_peaks(torch, rmm_resources)  # the first pass's: what the cap search's runs see
        if args.lockstep:  # this turn's figures, for the driver, before it hands the GPU on
            print("PASS " + json.dumps(lockstep_pass(passes[-1], steps - start, peaks, total)), flush=True)
        if stopped:
            break
    timed = steps - start
    first, later = passes[0], passes[1:]
    result = dict(workload=args.workload, allocator=args.allocator, fraction=args.fraction, steps=steps,
                  passes=args.passes, ooms=first["ooms"], first_oom_step=first["first_oom"], oom=first["oom"],
                  device_short=device_short,
                  step_ms=None if first["seconds"] is None else 1000 * first["seconds"] / timed,
                  total_bytes=total, device=torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu")
    if "gpumem" in sys.modules:  # which build ran (a name with @DIR: that directory's)
        result["gpumem_from"] = os.path.dirname(sys.modules["gpumem"].__file__)
    result.update(peaks)
    result.update(steady_figures(later, args.passes, timed))
    # Each pass's mean step: whether a policy that remaps (gpumem_hw) settles as the shapes repeat.
    result["pass_step_ms"] = [None if p["seconds"] is None else 1000 * p["seconds"] / timed for p in passes]
    # And gpumem's host time in driver calls per timed step of each pass (None for other allocators).
    result["pass_driver_ms"] = [None if not p.get("driver") else driver_call_ms(p["driver"]) / timed
                                for p in passes]
    result["ballast_freed_after"] = args.ballast_freed_after
    result["release_slack"] = args.release_slack
    result["bound"] = args.bound
    if bound:
        bound.pop("ballast").free()
        result.update(bound)
    if later and DEVICE.type == "cuda":  # the peaks over every pass: whether repeating the shapes grew them
        result.update({"steady_" + k: v for k, v in memory_peaks(torch, rmm_resources).items()})
    return result


def lockstep_pass(p: dict, timed: int, peaks: dict, total: int) -> dict:
    """One pass's figures as --lockstep prints them after it: its mean timed step (None: stopped at an
    OOM), OOM steps, device calls and gpumem's driver ms per timed step (None: not counted), and the
    first pass's peaks and the device's total (the driver derives a cap from native's)."""
    per_step = (lambda x: None if x is None else x / timed)
    return dict(step_ms=None if p["seconds"] is None else 1000 * p["seconds"] / timed, ooms=p["ooms"],
                device_calls=per_step(None if p["calls"] is None else sum(p["calls"])),
                driver_ms=per_step(None if not p["driver"] else driver_call_ms(p["driver"])),
                wait_ms=per_step(None if not p["driver"] else p["driver"].get("wait", 0.0)),
                max_allocated=peaks.get("max_allocated"), total_bytes=total)


def memory_peaks(torch, rmm_resources) -> dict:
    """torch's peak allocated / reserved bytes so far (rmm: its own figures, as torch has none for a
    pluggable allocator); {} on the CPU."""
    if DEVICE.type != "cuda":
        return {}
    if rmm_resources is not None:
        return rmm_figures(*rmm_resources)
    return dict(max_allocated=torch.cuda.max_memory_allocated(), max_reserved=torch.cuda.max_memory_reserved())


def driver_call_ms(driver: dict) -> float:
    """gpumem's host ms in driver calls, of a pass's driver_time() difference (its waits for the
    device left out)."""
    return sum(ms for kind, ms in driver.items() if kind != "wait")


def steady_figures(later: list, passes: int, timed: int) -> dict:
    """The figures of passes 2..N (`later`, each pass as run() records it): what the allocator costs
    once every shape has been seen.

    steady_step_ms: the mean over their timed steps (the same steps as the first pass's), None with
    one pass, or when a later pass did not run or stopped at an OOM (--stop-on-oom). steady_ooms: their
    OOM steps, counted apart from `ooms` (the first pass's, which alone decides the cap search).
    steady_device_allocs / _frees: device calls per timed step, None where the allocator does not
    count them. steady_driver_ms / steady_wait_ms: gpumem's host time per timed step in driver calls
    and in waits for the device, steady_driver_ms_by_kind the driver's per kind of call
    (gpumem.driver_time()); None for other allocators."""
    if passes == 1:
        return dict(steady_step_ms=None, steady_ooms=None, steady_oom="", steady_device_allocs=None,
                    steady_device_frees=None, steady_driver_ms=None, steady_wait_ms=None,
                    steady_driver_ms_by_kind=None)
    ran = len(later) == passes - 1
    seconds = [p["seconds"] for p in later]
    calls = [p["calls"] for p in later]
    counted = ran and all(c is not None for c in calls)
    driver = [p.get("driver") for p in later]
    timed_driver = ran and all(d is not None for d in driver)
    n = timed * len(later)
    return dict(
        steady_step_ms=1000 * sum(seconds) / n if ran and None not in seconds else None,
        steady_ooms=sum(p["ooms"] for p in later) if later else None,
        steady_oom=next((p["oom"] for p in later if p["oom"]), ""),
        steady_device_allocs=sum(c[0] for c in calls) / n if counted else None,
        steady_device_frees=sum(c[1] for c in calls) / n if counted else None,
        steady_driver_ms=sum(driver_call_ms(d) for d in driver) / n if timed_driver else None,
        steady_wait_ms=sum(d.get("wait", 0.0) for d in driver) / n if timed_driver else None,
        steady_driver_ms_by_kind=({k: sum(d[k] for d in driver) / n for k in driver[0] if k != "wait"}
                                  if timed_driver else None))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=WORKLOADS)
    ap.add_argument("allocator", type=allocator_arg,
                    help=f"{', '.join(ALLOCATORS + ('none',))}, or gpumem+KEY:VALUE[+KEY:VALUE] (GPUMEM_CONF keys "
                         "added to gpumem's); a gpumem name may end in @DIR (the build installed in DIR)")
    ap.add_argument("--fraction", type=float, help="set_per_process_memory_fraction (0, 1]")
    ap.add_argument("--stop-on-oom", action="store_true", help="end the run at its first OOM step")
    ap.add_argument("--quick", action="store_true", help="half the steps")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="every dimension shrunk (the CPU path)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--passes", type=int, default=1,
                    help="run the whole step list this many times (default 1); passes 2..N give the "
                         "steady_* figures")
    ap.add_argument("--release-slack", type=release_slack_arg, default=None,
                    help="gpumem_hw only: how far reserved may exceed the live high water (default: "
                         "gpumem's, 0.005)")
    ap.add_argument("--bound", default="fraction", choices=("fraction", "device"),
                    help="how --fraction bounds the run: set_per_process_memory_fraction (default), or "
                         "device: a ballast leaves the allocator that share of the device (above)")
    ap.add_argument("--lockstep", action="store_true",
                    help="take turns with other workers (bench/lockstep.py): wait for a line on stdin "
                         "before each pass, print its figures as a 'PASS {json}' line after it; end "
                         "the run early at the end of stdin")
    ap.add_argument("--ballast-freed-after", type=int, default=None, metavar="K",
                    help="--bound device: the ballast goes back to the device after pass K of --passes, as "
                         "memory outside the allocator freed mid-run (does the allocator use it again?)")
    args = ap.parse_args(argv)
    if args.ballast_freed_after is not None and (
            args.bound != "device" or not 1 <= args.ballast_freed_after < args.passes):
        ap.error("--ballast-freed-after K needs --bound device and 1 <= K < --passes, got "
                 f"{args.ballast_freed_after} with --bound {args.bound} --passes {args.passes}")
    if args.bound == "device" and args.allocator == "rmm":
        ap.error("--bound device: rmm is bounded by its pool's maximum size (--fraction) only")
    if args.release_slack is not None and args.allocator != "gpumem_hw":
        ap.error("--release-slack applies to gpumem_hw only")
    if args.passes < 1:
        ap.error(f"--passes must be at least 1, got {args.passes}")
    if args.fraction is not None and not 0 < args.fraction <= 1:
        ap.error(f"--fraction must be in (0, 1], got {args.fraction}")
    return args


def main(argv=None) -> int:
    print(json.dumps(run(parse_args(argv))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
