"""torch.compile(mode="reduce-overhead") (cudagraph trees) with changing input shapes, one allocator per
process. Run by tests/gpu/test_compile_gpu.py once with PyTorch's own allocator (twice, to measure how
much two runs of the same program differ on this machine) and once with gpumem imported first.

    python tests/gpu/compile_scenario.py --allocator gpumem|native [--steps 50] [--only NAME ...]

Prints one ``ALLOCATOR {json}`` line (which allocator torch really uses) and then one
``SCENARIO {json}`` line per scenario:

  name              the scenario
  values            per step, the loss (and for backward_only the gradient norm after it)
  sizes             per step, the batch size
  recorded_graphs   CUDA graphs cudagraph trees recorded (nodes of the trees), None if unavailable
  checkpoint_restores  times cudagraph trees restored the allocator to a checkpoint (re-recording a
                    path), None if unavailable
  cudagraph_skips   inductor's count of graphs that ran without CUDA graphs
  unique_graphs     dynamo's count of compiled graphs
  allocated_before / allocated_after / leak_bytes  torch.cuda.memory_allocated() before the scenario
                    and after deleting the model, optimizer and compiled function,
                    torch._dynamo.reset() (which shuts the trees down), gc.collect() and releasing
                    the cuBLAS workspaces
  seconds           wall time of the scenario
  error             the traceback, when the scenario failed (the next scenario still runs)

Scenarios (50 steps each by default, fp32, TF32 off, seeded data made on the CPU):

  train_alternating  a 2-block transformer, forward + backward + AdamW, batch 32, 20, 32, 20, ...
  train_cycling      an MLP, forward + backward + SGD(momentum), batch 32, 24, 16, 8, 32, ...
  backward_only      a compiled function of (x, w1, w2) returning a loss; loss.backward(), no
                     optimizer; batch 32, 20, 12, ...
  inference          the MLP under torch.no_grad(), batch 32, 20, 8, 17, ...
  train_dynamic      train_alternating with torch.compile(..., dynamic=True)
  chained_inference  two compiled modules in a row under no_grad: an encoder on a fixed batch of 16,
                     then a decoder attending from queries of 32, 20, 8, 17, ... rows to its output.
                     The encoder's graph replays and the decoder then needs a new recording below it:
                     cudagraph trees restores the allocator to the encoder's checkpoint
                     (getCheckpointState / setCheckpointPoolState), as in decoding loops
  train_chained      the same in training: a compiled trunk on a fixed batch of 32, then a compiled
                     head on the first 32, 20, 32, 20, ... rows of its output (a loss over a varying
                     subset), AdamW; new head shapes are recorded below the replayed trunk

Deterministic settings: CUBLAS_WORKSPACE_CONFIG=:4096:8, TORCHINDUCTOR_DETERMINISTIC=1 (no on-device
benchmarking picks kernels by timing), torch.use_deterministic_algorithms(True, warn_only=True), flash
and memory-efficient attention off (their backward kernels accumulate with atomics).
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import math
import os
import sys
import time
import traceback

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")  # bench/models.py
SCENARIOS = ["train_alternating", "train_cycling", "backward_only", "inference", "train_dynamic",
             "chained_inference", "train_chained"]
D = 64          # model width
T = 8           # sequence length of the transformer scenarios
HIDDEN = 256    # MLP hidden width


def setup(allocator: str):
    """Import torch with the chosen allocator in charge; deterministic settings. Returns (torch, info)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("TORCHINDUCTOR_DETERMINISTIC", "1")
    if allocator == "gpumem":
        os.environ.pop("GPUMEM_DISABLE", None)
        import gpumem  # noqa: F401  first: registers gpumem as torch's CUDA allocator before CUDA starts
        import gpumem._torch as gt
        import torch
    else:
        os.environ["GPUMEM_DISABLE"] = "1"  # in case anything imports gpumem
        gt = None
        import torch
    torch.cuda.init()
    info = dict(allocator=allocator, torch=torch.__version__, device=torch.cuda.get_device_name(0),
                backend=torch.cuda.memory.get_allocator_backend(),
                gpumem_active=bool(gt.is_active()) if gt else False,
                status=gt.status_line() if gt else "gpumem not imported")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    for name in ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp"):
        if hasattr(torch.backends.cuda, name):
            getattr(torch.backends.cuda, name)(False)
    import torch._inductor.config as inductor_config

    inductor_config.triton.cudagraph_trees = True  # the default, said explicitly
    if hasattr(inductor_config, "deterministic"):
        inductor_config.deterministic = True
    return torch, info


# ----------------------------------------------------------------------------- models and data


def make_models(torch):
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        """Pre-norm transformer block: single-head attention written out, then an MLP."""

        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.fc1, self.fc2 = nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)

        def forward(self, x):  # (B, T, D)
            q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
            att = ((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))).softmax(dim=-1)
            x = x + self.proj(att @ v)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def transformer():
        return nn.Sequential(Block(), Block(), nn.LayerNorm(D), nn.Linear(D, D))

    def mlp():
        return nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                             nn.Linear(HIDDEN, D))

    return transformer, mlp


def batch(torch, step, bs, shape):
    """Seeded per step, made on the CPU: the same numbers whatever the GPU's RNG did."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(bs, *shape, generator=g)
    y = torch.randn(bs, *shape, generator=g)
    return x.cuda(), y.cuda()


# ----------------------------------------------------------------------------- scenarios


def train(torch, model_fn, shape, sizes, steps, dynamic, optimizer):
    F = torch.nn.functional
    torch.manual_seed(0)
    model = model_fn().cuda()
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    cmodel = torch.compile(model, mode="reduce-overhead", dynamic=dynamic)
    values, used = [], []
    for step in range(steps):
        bs = sizes[step % len(sizes)]
        x, y = batch(torch, step, bs, shape)
        torch.compiler.cudagraph_mark_step_begin()
        loss = F.mse_loss(cmodel(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        values.append([loss.item()])
        used.append(bs)
    return values, used


def backward_only(torch, sizes, steps):
    torch.manual_seed(0)
    w1 = (torch.randn(D, HIDDEN, device="cuda") / math.sqrt(D)).requires_grad_()
    w2 = (torch.randn(HIDDEN, D, device="cuda") / math.sqrt(HIDDEN)).requires_grad_()

    def f(x, a, b):
        return (torch.tanh(x @ a) @ b).pow(2).mean()

    cf = torch.compile(f, mode="reduce-overhead")
    values, used = [], []
    for step in range(steps):
        bs = sizes[step % len(sizes)]
        x, _ = batch(torch, step, bs, (D,))
        torch.compiler.cudagraph_mark_step_begin()
        loss = cf(x, w1, w2)
        loss.backward()
        values.append([loss.item(), w1.grad.norm().item(), w2.grad.norm().item()])
        w1.grad = None
        w2.grad = None
        used.append(bs)
    return values, used


def inference(torch, model_fn, sizes, steps):
    torch.manual_seed(0)
    model = model_fn().cuda().eval()
    cmodel = torch.compile(model, mode="reduce-overhead")
    values, used = [], []
    with torch.no_grad():
        for step in range(steps):
            bs = sizes[step % len(sizes)]
            x, _ = batch(torch, step, bs, (D,))
            torch.compiler.cudagraph_mark_step_begin()
            out = cmodel(x)
            values.append([out.pow(2).mean().item()])
            used.append(bs)
    return values, used


def chained_inference(torch, model_fn, sizes, steps):
    nn = torch.nn

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D) for _ in range(4))

        def forward(self, h, q):  # h: (16, D) encoder output, q: (n, D) queries
            att = (self.wq(q) @ self.wk(h).t() * (1.0 / math.sqrt(D))).softmax(dim=-1)
            return self.wo(att @ self.wv(h))

    torch.manual_seed(0)
    enc, dec = model_fn().cuda().eval(), Decoder().cuda().eval()
    cenc = torch.compile(enc, mode="reduce-overhead")
    cdec = torch.compile(dec, mode="reduce-overhead")
    values, used = [], []
    with torch.no_grad():
        for step in range(steps):
            n = sizes[step % len(sizes)]
            x, _ = batch(torch, step, 16, (D,))
            q, _ = batch(torch, 10_000 + step, n, (D,))
            torch.compiler.cudagraph_mark_step_begin()
            out = cdec(cenc(x), q)
            values.append([out.pow(2).mean().item()])
            used.append(n)
    return values, used


def train_chained(torch, model_fn, sizes, steps):
    nn, F = torch.nn, torch.nn.functional
    torch.manual_seed(0)
    trunk = model_fn().cuda()
    head = nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D)).cuda()
    opt = torch.optim.AdamW(list(trunk.parameters()) + list(head.parameters()), lr=1e-3)
    ctrunk = torch.compile(trunk, mode="reduce-overhead")
    chead = torch.compile(head, mode="reduce-overhead")
    values, used = [], []
    for step in range(steps):
        n = sizes[step % len(sizes)]
        x, y = batch(torch, step, 32, (D,))
        torch.compiler.cudagraph_mark_step_begin()
        h = ctrunk(x)
        loss = F.mse_loss(chead(h[:n]), y[:n])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        values.append([loss.item()])
        used.append(n)
    return values, used


def run_scenario(torch, name, steps):
    transformer, mlp = make_models(torch)
    if name == "train_alternating":
        return train(torch, transformer, (T, D), [32, 20], steps, None, "adamw")
    if name == "train_cycling":
        return train(torch, mlp, (D,), [32, 24, 16, 8], steps, None, "sgd")
    if name == "backward_only":
        return backward_only(torch, [32, 20, 12], steps)
    if name == "inference":
        return inference(torch, mlp, [32, 20, 8, 17], steps)
    if name == "train_dynamic":
        return train(torch, transformer, (T, D), [32, 20], steps, True, "adamw")
    if name == "chained_inference":
        return chained_inference(torch, mlp, [32, 20, 8, 17], steps)
    if name == "train_chained":
        return train_chained(torch, mlp, [32, 20], steps)
    raise ValueError(f"unknown scenario {name!r}")


# ----------------------------------------------------------------------------- measurements


def settled_allocated(torch):
    gc.collect()
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()  # cuBLAS keeps a workspace per (handle, stream) from the allocator
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--allocator", choices=["gpumem", "native"], required=True)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--only", nargs="*", default=SCENARIOS, choices=SCENARIOS)
    args = ap.parse_args(argv)
    faulthandler.enable()  # a crash prints the Python line it happened on (stderr)
    torch, info = setup(args.allocator)
    print("ALLOCATOR " + json.dumps(info), flush=True)
    from torch._dynamo.utils import counters

    sys.path.insert(0, BENCH)
    from models import cudagraph_tree_counts  # imports torch.nn: after setup chose the allocator

    for name in args.only:
        counters.clear()
        before = settled_allocated(torch)
        t0 = time.perf_counter()
        row = dict(name=name, allocator=args.allocator)
        try:
            values, sizes = run_scenario(torch, name, args.steps)
            row.update(values=values, sizes=sizes)
        except Exception:  # noqa: BLE001  reported; the next scenario still runs
            row["error"] = traceback.format_exc()
        row["recorded_graphs"], row["checkpoint_restores"] = cudagraph_tree_counts(torch)
        row["cudagraph_skips"] = int(counters["inductor"].get("cudagraph_skips", 0))
        row["unique_graphs"] = int(counters["stats"].get("unique_graphs", 0))
        try:
            torch._dynamo.reset()
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()  # torch._dynamo.reset() does it too in recent versions
            after = settled_allocated(torch)
            row.update(allocated_before=before, allocated_after=after, leak_bytes=after - before)
            if args.allocator == "gpumem":
                import gpumem

                gpumem._bridge.validate(torch.cuda.current_device())
                row["validate"] = "ok"
        except Exception:  # noqa: BLE001
            row.setdefault("error", "")
            row["error"] += "\nafter the scenario:\n" + traceback.format_exc()
        row["seconds"] = round(time.perf_counter() - t0, 2)
        print("SCENARIO " + json.dumps(row), flush=True)
        print(f"{args.allocator}: {name} done in {row['seconds']} s"
              + (" (error)" if "error" in row else ""), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
