"""gpumem.find_batch_size under torch.distributed with gpumem on every rank, under torchrun, one GPU per
rank (any number of ranks, 1 included).

    torchrun --standalone --nproc_per_node N tests/gpu/dist_batch_size.py fsdp|uneven

fsdp    a GPT sharded with FSDP2 (fully_shard per block and at the root), trained by a step_fn; the
        same budget on every rank. Every rank must get the same size, and 3 steps at that size must
        run capped at the budget (set_per_process_memory_fraction) without an OOM on every rank.
uneven  a DDP model; rank r's budget is 3 GiB / (r + 1), so the last rank has the least memory. Each
        rank's own answer (searched alone, distributed=False) before and after the agreed one: the
        agreed one is the same on every rank, the smallest rank's answer (it decides), and it fits
        on that rank.

Prints ``RESULT {json}`` per rank.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gpumem  # before torch starts CUDA

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
from models import GPT  # noqa: E402

import _run  # noqa: E402  (tests/gpu, the script's own folder)

GiB = 1 << 30
VOCAB, SEQ = 8192, 512


def peak_in_budget(step, batch, budget, detail=None):
    """3 steps at `batch` with the process capped at `budget` (what the budget means to the allocator:
    the search ran under the same cap): (max_memory_reserved, whether all 3 ran without an OOM).
    Uncapped, a caching allocator may keep more than the budget reserved (pages cached for FSDP's
    other streams), which is not what the search promises. `detail` (a dict), if given, gets the
    allocated and reserved peaks and the out-of-memory message, if any."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(budget / total)
    try:
        for _ in range(3):
            step(batch)
        torch.cuda.synchronize()
        fits = True
    except torch.cuda.OutOfMemoryError as e:
        fits = False
        if detail is not None:
            detail["oom"] = str(e)[:300]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    peak = torch.cuda.max_memory_reserved()
    if detail is not None:
        detail.update(max_allocated=torch.cuda.max_memory_allocated(), max_reserved=peak)
    return peak, fits and peak <= budget


def outside_bytes():
    """Device memory in use that torch's allocator does not hold (CUDA context, NCCL, loaded kernels):
    what a search's cap does not count (the ballast of earlier versions could not see it grow)."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def fsdp(rank, world):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, d=768, layers=6, heads=12).cuda()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(b):
        ids = torch.randint(0, VOCAB, (b, SEQ), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids)
            loss = F.cross_entropy(logits.float().view(-1, VOCAB), ids.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    budget = 6 * GiB
    res = gpumem.find_batch_size(model, step_fn=step, optimizer=opt, max_memory=budget, verbose=False)
    peak, fits = peak_in_budget(step, res.batch_size, budget)
    return dict(batch=res.batch_size, world_size=res.world_size, budget=budget, peak=peak, fits=fits)


def uneven(rank, world):
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.manual_seed(0)
    # 29 M parameters: with their gradients, AdamW's two states and DDP's gradient buckets 0.6 GiB,
    # which leaves the last of two ranks (1.5 GiB) room for batches (92 M left it none: batch 1 did
    # not fit there).
    model = nn.Sequential(nn.Linear(2048, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(),
                          nn.Linear(4096, 1000)).cuda()
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(ddp.parameters())

    def step(b):
        x = torch.randn(b, 2048, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), torch.randint(0, 1000, (b,), device="cuda"))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    budget = 3 * GiB // (rank + 1)
    # every rank's trial lines on stderr (verbose alone prints rank 0's), for a failure to show them
    kw = dict(model=model, step_fn=step, optimizer=opt, max_memory=budget, verbose=True,
              log=lambda line: print(f"[rank {rank}] {line}", file=sys.stderr, flush=True))
    # Each rank's own answer before and after the agreed search: the one after is taken in the same
    # state of the process as the agreed one (two ranks on two H200s: the first search of a process
    # answered 13,578 on the last rank, the agreed search after it 15,857).
    outside = [outside_bytes()]  # device memory outside torch's allocator, before and after each search
    local = gpumem.find_batch_size(distributed=False, **kw)
    outside.append(outside_bytes())
    dist.barrier()
    agreed = gpumem.find_batch_size(**kw)
    outside.append(outside_bytes())
    dist.barrier()
    local_after = gpumem.find_batch_size(distributed=False, **kw)
    outside.append(outside_bytes())
    locals_, locals_after = [None] * world, [None] * world
    dist.all_gather_object(locals_, local.batch_size)
    dist.all_gather_object(locals_after, local_after.batch_size)
    detail = {}
    peak, fits = peak_in_budget(step, agreed.batch_size, budget, detail)
    # What each search measured, for a failure to say why (the first search of a process answered lower).
    searches = {name: dict(batch=r.batch_size, limit=r.limit_bytes, target=r.target_bytes,
                           measured_peak=r.measured_peak_bytes, margin=r.margin_bytes,
                           per_sample=r.bytes_per_sample, fixed=r.fixed_bytes,
                           reserved_before=r.reserved_before, trials=len(r.trials))
                for name, r in (("local", local), ("agreed", agreed), ("local_after", local_after))}
    return dict(local=local.batch_size, agreed=agreed.batch_size, locals=locals_, locals_after=locals_after,
                budget=budget, world_size=agreed.world_size, peak=peak, fits=fits, check=detail,
                searches=searches, outside=outside)


def main():
    scenario = sys.argv[1]
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert gpumem.is_active()
    result = {"fsdp": fsdp, "uneven": uneven}[scenario](rank, world)
    _run.print_result(dict(result, rank=rank, world=world, scenario=scenario))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
