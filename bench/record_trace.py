"""Record an allocation trace of a workload on the GPU, in gpumem's trace format (what `gpumem replay`
and bench/remap_at_cap.py read), from PyTorch's own allocator's memory history.

    python bench/record_trace.py fbs_bert bench/traces/fbs_bert.trace.gz
    python bench/record_trace.py varlen bench/traces/varlen.trace.gz
    python bench/record_trace.py allocfree af.trace.gz --seed 3    # no GPU: see below

Workloads: a bench/pressure_workloads.py workload (all its steps: moe, bert, generate, ckpt, varlen,
resnet, vit, allocfree), or a batch-size bench step at the size gpumem's finder chose on one H100:
``fbs_bert`` (BERT-base fp16 inference, sequence 384, batch 475, 3 steps) and ``fbs_gen`` (GPT-2
generation, batch 1250, 64 new tokens, 1 step). The process runs PyTorch's native allocator
(uncapped), so the trace is the requests and their order, not any allocator's placement. The traces
in bench/traces/ were recorded this way on one H100 (torch 2.11.0+cu130).

``ddp_mlp.trace.gz`` is not from this script: the last rank's steps of tests/gpu/dist_batch_size.py's
uneven run (a 29 M-parameter MLP under DDP with AdamW and bf16 autocast: one step at batch 64, then
3 at 15,857), its memory history turned into the trace by ``snapshot_to_trace`` (PyTorch's allocator,
two H200s, torch 2.11.0+cu130, 2026-11-27; the recording script is not in the repository).

allocfree's requests depend on nothing but its seeded random numbers, so its trace is written from
them (pressure_workloads.allocfree_plan), on any machine, without torch: the same sizes (rounded to
512 bytes, as PyTorch's allocator records them) and frees, in the order the workload makes them, and
at the end the frees of the tensors the next pass's first step drops. ``--seed N`` writes the requests
the workload would make with another seed (the bench's own are seed 0): docs/benchmarks.md's "Packed small
arenas" replays seven.
"""
import argparse
import gzip
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

FBS = {"fbs_bert": ("bert", 475, 3), "fbs_gen": ("gen", 1250, 1)}


def snapshot_to_trace(snapshot: dict, device: int = 0) -> tuple:
    """(lines, allocations, peak live bytes) of the trace format from a memory-history snapshot
    (``torch.cuda.memory._snapshot()``): ``a <id> <bytes> <stream>`` per alloc event and ``f <id>`` per
    free_completed event of an address allocated while recording; streams numbered in order of first
    use. Frees of blocks allocated before recording are left out (the trace never saw them)."""
    ids, streams, lines = {}, {}, []
    live = peak = allocations = 0
    for event in snapshot["device_traces"][device]:
        action, address = event["action"], event["addr"]
        if action == "alloc":
            stream = streams.setdefault(event["stream"], len(streams))
            ids[address] = (allocations, event["size"])
            lines.append(f"a {allocations} {event['size']} {stream}")
            allocations += 1
            live += event["size"]
            peak = max(peak, live)
        elif action == "free_completed" and address in ids:
            slot, size = ids.pop(address)
            lines.append(f"f {slot}")
            live -= size
    return lines, allocations, peak


def allocfree_trace(seed: int = 0) -> tuple:
    """(lines, allocations, peak live bytes) of allocfree's requests as bench/pressure_workloads.py
    makes them with `seed` (pressure_workloads.allocfree_plan): one tensor after another, each followed
    by the free the plan says; then a free of each tensor still alive, as the first step of the bench's
    next pass drops them. Without those frees a replay with passes > 1 would keep them as tensors made
    once (a model's weights) and skip their allocations in the later passes, where the bench makes them
    again: its later passes' layout, and their remapping, would not be the GPU's."""
    import random

    import pressure_workloads as pw

    sizes, frees = pw.allocfree_plan(random.Random(seed), False)
    rounded = [-(-size // 512) * 512 for size in sizes]
    lines, alive, peak = [], 0, 0
    for j, size in enumerate(rounded):
        lines.append(f"a {j} {size} 0")
        alive += size
        peak = max(peak, alive)
        if frees[j] is not None:
            lines.append(f"f {frees[j]}")
            alive -= rounded[frees[j]]
    freed = {j for j in frees if j is not None}
    lines += [f"f {j}" for j in range(len(sizes)) if j not in freed]  # dropped by the next pass's first step
    return lines, len(sizes), peak


def write_trace(path: str, header: str, lines: list) -> None:
    """Writes a trace (gzip when `path` ends in .gz); a path that cannot be written is one line, not a
    traceback."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "wt") as f:
            f.write(header + "\n")
            f.write("\n".join(lines) + "\n")
    except OSError as e:
        raise SystemExit(f"record_trace.py: cannot write {path}: {e.strerror or e}") from None


def run_workload(name: str, torch) -> None:
    if name in FBS:
        from batch_size_workloads import Workload

        model, batch, steps = FBS[name]
        w = Workload(model)
        for _ in range(steps):
            w.step(batch)
        return
    import pressure_workloads as pw

    pw.DEVICE = torch.device("cuda")
    steps, _, step = pw.make_workload(name, torch, False, 0)
    for i in range(steps):
        step(i)


def main(argv=None) -> int:
    import pressure_workloads as pw

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=sorted(FBS) + list(pw.WORKLOADS))
    ap.add_argument("out", help="the trace file to write (.gz: gzip)")
    ap.add_argument("--seed", type=int, default=None,
                    help="allocfree only: the seed of its random requests (default 0, the bench's)")
    args = ap.parse_args(argv)
    if args.seed is not None and args.workload != "allocfree":
        ap.error("--seed is allocfree's: the other workloads are recorded as they run on the GPU")
    if not Path(args.out).resolve().parent.is_dir():  # before a recording that takes minutes
        ap.error(f"the folder for {args.out} does not exist")
    if args.workload == "allocfree":
        seed = 0 if args.seed is None else args.seed
        lines, allocations, peak = allocfree_trace(seed)
        write_trace(args.out, f"# workload allocfree (written from its seeded requests, seed {seed}, no GPU) "
                              f"allocs {allocations} peak_live_bytes {peak}", lines)
        print(f"allocfree: {allocations} allocations, peak live {peak / 2**30:.3f} GiB -> {args.out}")
        return 0
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("record_trace.py records on a CUDA device; none is available")
    torch.cuda.init()
    torch.empty(1, device="cuda")
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             max_entries=5_000_000)
    run_workload(args.workload, torch)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    lines, allocations, peak = snapshot_to_trace(snapshot)
    write_trace(args.out, f"# workload {args.workload} torch {torch.__version__} gpu "
                          f"{torch.cuda.get_device_name()} allocs {allocations} peak_live_bytes {peak} "
                          f"max_reserved_bytes {torch.cuda.max_memory_reserved()}", lines)
    print(f"{args.workload}: {allocations} allocations, peak live {peak / 2**30:.3f} GiB -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
