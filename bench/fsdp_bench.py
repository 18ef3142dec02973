"""FSDP2 training (torch.distributed.fsdp.fully_shard) of a GPT from bench/models.py, one allocator per
run, every rank under torchrun: step time, max reserved / max allocated, losses and reserved after
every step, per rank.

    torchrun --nproc_per_node N bench/fsdp_bench.py --allocator native     --out fsdp_native.json
    torchrun --nproc_per_node N bench/fsdp_bench.py --allocator expandable --out fsdp_expandable.json
    torchrun --nproc_per_node N bench/fsdp_bench.py --allocator gpumem     --out fsdp_gpumem.json
    python bench/fsdp_bench.py --compare fsdp_native.json fsdp_gpumem.json [fsdp_expandable.json]
    torchrun --nproc_per_node N bench/fsdp_bench.py --allocator gpumem --minutes 10 --out fsdp_soak.json

Each rank writes its own JSON (rank r > 0: NAME.rankR.json; --compare takes the rank-0 names and
reads every rank's file beside them). A run lasts --steps steps, or --minutes of wall time when given
(then every rank stops after the same step). Every step's shapes are the same (--batch x --seq
tokens per rank) and the data of rank r is seeded with r, so two runs see the same batches.

Deterministic settings (fixed seeds, CUBLAS_WORKSPACE_CONFIG, torch.use_deterministic_algorithms
(warn_only), attention through the math kernel) make losses comparable bit for bit between allocators:
an allocator decides where tensors live, never what is computed. The JSON lists ops that warned of a
nondeterministic kernel.

Reported per rank: median and mean step time after --warmup steps (the loss's .item() ends each
step, so a step is timed to its end on the GPU), max_memory_reserved / max_memory_allocated, reserved
after warm-up against reserved at the end (flat: no growth beyond --tolerance-mib), and the loss of
every step as float.hex. --compare prints, per rank, whether the losses are identical, each run's
step time over the first's (the target for gpumem: within 2 %), and the memory figures side by side;
it exits 1 when losses differ.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import workloads  # noqa: E402  bench/workloads.py (imports no torch)

MiB = 1 << 20
VOCAB = 32000


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--allocator", choices=workloads.ALLOCATORS, default="gpumem")
    p.add_argument("--steps", type=int, default=60, help="steps to run (unless --minutes)")
    p.add_argument("--minutes", type=float, default=0.0, help="run for this wall time instead of --steps")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of step times and flatness")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024, help="model width (not `--d`: torchrun would read it as an ambiguous option of its own)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=8, help="sequences per step per rank")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance-mib", type=float, default=20.0,
                   help="growth of reserved after warm-up that counts as not flat")
    p.add_argument("--deterministic", choices=["warn", "on", "off"], default="warn")
    p.add_argument("--out", default=None, help="JSON file (default fsdp_<allocator>.json)")
    p.add_argument("--compare", nargs="+", metavar="JSON", help="compare runs (rank-0 file names)")
    return p.parse_args(argv)


# ---- comparison (no torch needed) --------------------------------------------------------------------

def rank_files(path):
    """The rank-0 file and the rank files written beside it, in rank order."""
    root, ext = os.path.splitext(path)
    first = json.load(open(path))
    files = [first]
    for r in range(1, first["world_size"]):
        files.append(json.load(open(f"{root}.rank{r}{ext or '.json'}")))
    return files


def compare(paths):
    runs = [rank_files(p) for p in paths]
    worlds = {len(r) for r in runs}
    if len(worlds) != 1:
        raise SystemExit(f"the runs have different world sizes: {sorted(worlds)}")
    rows, identical = [], True
    base = runs[0]
    for rank in range(len(base)):
        for path, run in zip(paths, runs):
            r = run[rank]
            n = min(len(r["loss_hex"]), len(base[rank]["loss_hex"]))
            first = next((i for i in range(n) if r["loss_hex"][i] != base[rank]["loss_hex"][i]), None)
            identical = identical and first is None and n > 0
            rows.append(dict(rank=rank, run=path, allocator=r["allocator"], steps=r["steps"],
                             median_step_ms=r["median_step_ms"],
                             step_time_ratio=round(r["median_step_ms"] / base[rank]["median_step_ms"], 4),
                             max_reserved_mib=round(r["max_reserved"] / MiB, 1),
                             max_allocated_mib=round(r["max_allocated"] / MiB, 1),
                             reserved_growth_mib=round(r["reserved_growth_after_warmup"] / MiB, 1),
                             flat=r["flat"], losses_identical_to_first=first is None,
                             first_difference_step=first))
    print(f"{'rank':>4} {'allocator':>10} {'steps':>6} {'ms/step':>8} {'ratio':>7} {'max res MiB':>12} "
          f"{'max alloc MiB':>14} {'growth MiB':>11} {'flat':>5} {'losses':>9}")
    for x in rows:
        same = "same" if x["losses_identical_to_first"] else f"DIFFER@{x['first_difference_step']}"
        print(f"{x['rank']:>4} {x['allocator']:>10} {x['steps']:>6} {x['median_step_ms']:>8.2f} "
              f"{x['step_time_ratio']:>7.4f} {x['max_reserved_mib']:>12.1f} {x['max_allocated_mib']:>14.1f} "
              f"{x['reserved_growth_mib']:>11.1f} {x['flat']!s:>5} "
              f"{same:>9}")
    print(json.dumps(dict(runs=paths, losses_identical=identical, rows=rows)))
    return 0 if identical else 1


# ---- the run -------------------------------------------------------------------------------------------

def run(args):
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    workloads.select_allocator(args.allocator)  # before torch starts CUDA
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    GPT = workloads.models().GPT
    if not torch.cuda.is_available():
        raise SystemExit("fsdp_bench.py needs a CUDA GPU")
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world = dist.get_world_size()
    if args.deterministic != "off":
        torch.use_deterministic_algorithms(True, warn_only=args.deterministic == "warn")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_flash_sdp(False)  # the math kernel: deterministic backward
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)

    torch.manual_seed(args.seed)  # the same initial weights on every rank, before sharding
    model = GPT(vocab=VOCAB, d=args.width, layers=args.layers, heads=args.heads).cuda()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.Generator(device="cuda")
    data.manual_seed(args.seed * 1000 + rank)

    loss_hex, reserved, allocated, step_ms, nondeterministic = [], [], [], [], []
    limit = args.minutes * 60
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        while True:
            t = time.perf_counter()
            ids = torch.randint(0, VOCAB, (args.batch, args.seq), device="cuda", generator=data)
            value = workloads.lm_step(model, opt, ids).float().item()
            del ids
            step_ms.append(1000 * (time.perf_counter() - t))
            loss_hex.append(float.hex(value))
            reserved.append(torch.cuda.memory_reserved())
            allocated.append(torch.cuda.memory_allocated())
            step += 1
            done = (time.perf_counter() - t0 >= limit) if limit > 0 else step >= args.steps
            if limit > 0:  # every rank stops after the same step
                flag = torch.tensor([int(done)], device="cuda")
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                done = bool(flag.item())
            if rank == 0 and (step % 100 == 0 or done):
                print(f"step {step} loss={value:.4f} reserved={reserved[-1] / MiB:.0f} MiB", flush=True)
            if done:
                break
        for w in caught:
            text = str(w.message).splitlines()[0]
            if "deterministic" in text and text not in nondeterministic:
                nondeterministic.append(text)

    warm = min(args.warmup, max(0, step - 1))
    timed = step_ms[warm:] or step_ms
    growth = max(reserved[warm:]) - reserved[warm]
    summary = dict(
        allocator=args.allocator, rank=rank, world_size=world, steps=step,
        seconds=round(time.perf_counter() - t0, 1), warmup=warm,
        median_step_ms=round(statistics.median(timed), 3), mean_step_ms=round(statistics.fmean(timed), 3),
        max_reserved=torch.cuda.max_memory_reserved(), max_allocated=torch.cuda.max_memory_allocated(),
        reserved_after_warmup=reserved[warm], reserved_at_end=reserved[-1],
        reserved_growth_after_warmup=growth, flat=growth <= args.tolerance_mib * MiB,
        final_loss=float.fromhex(loss_hex[-1]), nondeterministic_ops=nondeterministic,
        model=dict(layers=args.layers, d=args.width, heads=args.heads, batch=args.batch, seq=args.seq),
        torch=torch.__version__, device=torch.cuda.get_device_name(),
        nccl=".".join(map(str, torch.cuda.nccl.version())))
    out = args.out or f"fsdp_{args.allocator}.json"
    if rank > 0:
        root, ext = os.path.splitext(out)
        out = f"{root}.rank{rank}{ext or '.json'}"
    with open(out, "w") as f:
        json.dump(dict(summary, loss_hex=loss_hex, reserved=reserved, allocated=allocated,
                       step_ms=step_ms), f)
    print(json.dumps(summary), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.compare:
        return compare(args.compare)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
