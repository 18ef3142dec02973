"""Soak: the variable-length transformer workload of bench/workloads.py (its GPT model, its shapes and
its training step) for a fixed wall-clock time, sampling reserved memory after every step, so creep and
divergence show up.

    python bench/soak.py --allocator gpumem --minutes 10 --out soak_gpumem.json
    python bench/soak.py --allocator native --minutes 2  --out soak_native.json
    python bench/soak.py --compare soak_gpumem.json soak_native.json
    torchrun --nproc_per_node 2 bench/soak.py --ddp --allocator gpumem --minutes 3 --out soak_ddp.json

Each run writes JSON (per rank: rank r > 0 writes NAME.rankR.json): the loss of every step (exact,
as float.hex), reserved / allocated / device-used bytes after every step with their times, and a
summary (with torch's peak reserved and allocated bytes, reached within steps). It prints reserved
at minute 1 against the last minute, and whether reserved crept by more than one segment
(--tolerance-mib, default 20 MiB: PyTorch's large segment) after warm-up.

--compare A B checks that the losses of the steps both runs made are bitwise identical (the runs
stop on time, so they compare over the shorter one) and names the first step that differs. For a
bitwise comparison the run is made deterministic: fixed seeds, CUBLAS_WORKSPACE_CONFIG,
torch.use_deterministic_algorithms (warn_only: ops without a deterministic kernel are listed in the
JSON as the reason when losses differ), and attention through the math kernel (--sdpa math; the
flash / memory-efficient backward kernels accumulate with atomics). Compare two native runs to
check that the workload itself is deterministic on the machine. --workloads PATH takes the GPT model
from another workloads file (or a folder holding workloads.py).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import workloads  # noqa: E402  bench/workloads.py (imports no torch)

MiB = 1 << 20
VOCAB = 32000  # GPT's default vocabulary: the token ids of every step


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--allocator", choices=workloads.ALLOCATORS, default="gpumem")
    p.add_argument("--minutes", type=float, default=10.0, help="wall-clock length of the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step (per rank), as in workloads.varlen")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--window", type=float, default=60.0,
                   help="seconds per window: 'minute 1' is the first window (default 60)")
    p.add_argument("--tolerance-mib", type=float, default=20.0,
                   help="growth of peak reserved after the first window that counts as creep")
    p.add_argument("--sdpa", choices=["math", "default"], default="math",
                   help="attention kernel: math (deterministic) or torch's choice (flash)")
    p.add_argument("--deterministic", choices=["warn", "on", "off"], default="warn")
    p.add_argument("--ddp", action="store_true", help="DistributedDataParallel over NCCL (under torchrun)")
    p.add_argument("--workloads", default=None,
                   help="the workloads file (or its folder) whose GPT to train (default: bench/workloads.py)")
    p.add_argument("--out", default=None, help="JSON file (default soak_<allocator>.json)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare the losses of two soak JSON files")
    return p.parse_args(argv)


# ---- comparison (no torch needed) --------------------------------------------------------------------

def compare(a_path, b_path):
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    la, lb = a["loss_hex"], b["loss_hex"]
    n = min(len(la), len(lb))
    first = next((i for i in range(n) if la[i] != lb[i]), None)
    same_shapes = a.get("shapes", [])[:n] == b.get("shapes", [])[:n]
    result = dict(a=a_path, b=b_path, allocators=[a["allocator"], b["allocator"]], steps_compared=n,
                  steps=[len(la), len(lb)], identical=first is None and n > 0, same_shapes=same_shapes)
    if first is not None:
        result.update(first_difference_step=first, a_loss=float.fromhex(la[first]), b_loss=float.fromhex(lb[first]),
                      max_abs_difference=max(abs(float.fromhex(x) - float.fromhex(y)) for x, y in zip(la[:n], lb[:n])))
        reasons = sorted(set(a.get("nondeterministic_ops", []) + b.get("nondeterministic_ops", [])))
        result["possible_reasons"] = reasons or [
            "no op warned of a nondeterministic kernel; compare two runs with the same allocator "
            "to tell the allocator from the machine"]
    print(f"losses over {n} common steps ({a['allocator']} vs {b['allocator']}): "
          + ("bitwise identical" if result["identical"] else f"DIFFER from step {first}"))
    print(json.dumps(result))
    return 0 if result["identical"] else 1


# ---- the run -----------------------------------------------------------------------------------------

def window_peak(samples, t0, t1):
    vals = [r for t, r in samples if t0 <= t < t1]
    return max(vals) if vals else None


def run(args):
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    workloads.select_allocator(args.allocator)  # before torch starts CUDA
    import torch

    GPT = workloads.load(args.workloads).GPT  # after the allocator is chosen: another file may import torch

    if not torch.cuda.is_available():
        raise SystemExit("soak.py needs a CUDA GPU")
    torch.cuda.set_device(local_rank)
    if args.ddp:
        import torch.distributed as dist
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    nondeterministic = []
    if args.deterministic != "off":
        torch.use_deterministic_algorithms(True, warn_only=args.deterministic == "warn")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    if args.sdpa == "math":
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)

    rng = random.Random(args.seed)  # the same shapes on every rank and in every run
    torch.manual_seed(args.seed)    # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = GPT(layers=args.layers).cuda()
    if args.ddp:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.Generator(device="cuda")
    data.manual_seed(args.seed * 1000 + rank)

    losses, loss_hex, shapes, samples_t, reserved, allocated, used, step_ms = [], [], [], [], [], [], [], []
    limit = args.minutes * 60
    torch.cuda.synchronize()
    t_start = time.perf_counter()
    step = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        while True:
            t_step = time.perf_counter()
            B, L = workloads.varlen_shape(rng, args.tokens)
            ids = torch.randint(0, VOCAB, (B, L), device="cuda", generator=data)
            value = workloads.lm_step(model, opt, ids).float().item()  # synchronises: the step is done
            del ids
            now = time.perf_counter() - t_start
            free, total = torch.cuda.mem_get_info()
            losses.append(value)
            loss_hex.append(float.hex(value))
            shapes.append([B, L])
            samples_t.append(round(now, 4))
            used.append(total - free)
            try:
                reserved.append(torch.cuda.memory_reserved())
                allocated.append(torch.cuda.memory_allocated())
            except RuntimeError:  # an allocator without stats: the device's own figure stands in
                reserved.append(used[-1])
                allocated.append(0)
            step_ms.append(1000 * (time.perf_counter() - t_step))
            step += 1
            done = now >= limit
            if args.ddp:
                flag = torch.tensor([1 if done else 0], device="cuda")
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops after the same step
                done = bool(flag.item())
            if rank == 0 and (step % 200 == 0 or done):
                print(f"step {step} t={now:.0f}s loss={value:.4f} reserved={reserved[-1] / MiB:.0f} MiB "
                      f"allocated={allocated[-1] / MiB:.0f} MiB", flush=True)
            if done:
                break
        for w in caught:
            text = str(w.message).splitlines()[0]
            if "deterministic" in text and text not in nondeterministic:
                nondeterministic.append(text)

    peaks = {}
    try:
        peaks = dict(reserved=torch.cuda.max_memory_reserved(), allocated=torch.cuda.max_memory_allocated())
    except RuntimeError:  # an allocator without stats
        pass
    win = min(args.window, limit / 2) if limit > 0 else args.window
    series = list(zip(samples_t, reserved))
    end = samples_t[-1]
    first = window_peak(series, 0, win)
    last = window_peak(series, max(win, end - win), end + 1)
    after_warmup = window_peak(series, win, end + 1)
    tolerance = int(args.tolerance_mib * MiB)
    growth = (after_warmup - first) if (first is not None and after_warmup is not None) else None
    summary = dict(
        allocator=args.allocator, rank=rank, world_size=world, ddp=args.ddp, seconds=round(end, 1),
        steps=step, mean_step_ms=round(sum(step_ms[10:]) / max(1, len(step_ms[10:])), 2),
        window_s=win, reserved_minute1_peak=first, reserved_last_window_peak=last,
        reserved_peak_after_minute1=after_warmup, growth_after_minute1=growth, tolerance_bytes=tolerance,
        crept=None if growth is None else growth > tolerance,
        # The samples are taken between steps, when a step's activations are gone: their maxima are
        # not the peaks. The peaks within steps are torch's (None where the allocator keeps no stats).
        reserved_at_end=reserved[-1], max_reserved_after_step=max(reserved),
        max_allocated_after_step=max(allocated), peak_reserved=peaks.get("reserved"),
        peak_allocated=peaks.get("allocated"), peak_device_used_after_step=max(used),
        final_loss=losses[-1], nondeterministic_ops=nondeterministic,
        torch=torch.__version__, device=torch.cuda.get_device_name(), sdpa=args.sdpa,
        deterministic=args.deterministic)
    out = args.out or f"soak_{args.allocator}.json"
    if rank > 0:
        root, ext = os.path.splitext(out)
        out = f"{root}.rank{rank}{ext or '.json'}"
    with open(out, "w") as f:
        json.dump(dict(summary, loss=losses, loss_hex=loss_hex, shapes=shapes, t=samples_t,
                       reserved=reserved, allocated=allocated, device_used=used, step_ms=step_ms), f)
    if first is not None:
        print(f"[rank {rank}] reserved: minute 1 peak {first / MiB:.0f} MiB, last window peak "
              f"{last / MiB:.0f} MiB, peak after minute 1 {after_warmup / MiB:.0f} MiB: growth "
              f"{growth / MiB:+.0f} MiB -> {'CREPT' if summary['crept'] else 'no creep'} "
              f"(tolerance {args.tolerance_mib:.0f} MiB)")
    print(json.dumps(summary), flush=True)
    if args.ddp:
        dist.barrier()
        dist.destroy_process_group()
    return 1 if summary["crept"] else 0


def main(argv=None):
    args = parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
