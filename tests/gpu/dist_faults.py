"""One rank runs out of memory inside a training step, with gpumem on every rank, under torchrun, one
GPU per rank (any number of ranks; the failing rank is the last).

    torchrun --standalone --nproc_per_node N tests/gpu/dist_faults.py recover|crash

recover  DDP. At step 2 the last rank asks for more than its device holds inside the forward (a real
         out-of-memory error from gpumem). Every rank calls gpumem.check_ranks after the forward, so
         every rank raises RankOutOfMemoryError (with one rank: the OutOfMemoryError itself), skips
         the batch together, empties its cache and goes on; 6 steps in all. The parameters stay equal
         on every rank (DDP's all-reduce kept running), and nothing hangs.
crash    FSDP2. At step 2 the last rank runs out of memory in the forward of its third block and does
         not catch it: the others' GPUs wait in FSDP's next all-gather, and their CPUs where the step
         logs its loss (loss.item(), as training loops do: without it a rank's CPU may queue its
         remaining steps and reach the end before anything stops it), until torchrun, seeing a rank
         exit with an error, stops them (the process group's timeout, 60 s, bounds it otherwise). The
         test checks the whole job ends, with an error naming the out-of-memory, well inside its
         timeout.

Prints ``RESULT {json}`` per rank (recover), or the failing rank's traceback (crash).
"""
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gpumem  # before torch starts CUDA

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
from models import GPT  # noqa: E402

import _run  # noqa: E402  (tests/gpu, the script's own folder)

VOCAB = 8192


def too_much():
    """A real allocation failure from the allocator: twice the device."""
    return torch.empty(2 * torch.cuda.get_device_properties(0).total_memory, dtype=torch.uint8, device="cuda")


def recover(rank, world, local_rank):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    done, skipped, raised = [], [], []
    for step in range(6):
        x = torch.randn(64, 1024, device="cuda")
        error, loss = None, None
        try:
            out = ddp(x)
            if step == 2 and rank == world - 1:
                hog = too_much()  # noqa: F841
            loss = F.mse_loss(out, x)
        except torch.cuda.OutOfMemoryError as e:
            error = e
        try:
            gpumem.check_ranks(error)
        except torch.cuda.OutOfMemoryError as e:  # RankOutOfMemoryError on every rank (world > 1)
            raised.append(dict(type=type(e).__name__, message=str(e)[:400],
                               failures={str(k): v for k, v in getattr(e, "failures", {}).items()}))
            del error, loss
            out = None
            torch.cuda.empty_cache()
            skipped.append(step)
            continue
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        done.append(step)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    sums = [None] * world
    dist.all_gather_object(sums, float(flat.double().sum()))
    return dict(done=done, skipped=skipped, raised=raised, param_sums=sums)


def crash(rank, world, local_rank):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, d=512, layers=4, heads=8).cuda()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = {"step": 0}

    def maybe_fail(module, args):
        if state["step"] == 2 and rank == world - 1:
            too_much()

    model.blocks[2].register_forward_pre_hook(maybe_fail)
    for step in range(5):
        state["step"] = step
        ids = torch.randint(0, VOCAB, (4, 256), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(ids).float().view(-1, VOCAB), ids.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"RANK {rank} step {step} done, loss {loss.item():.4f}", flush=True)
    return dict(unexpected="every step ran")


def main():
    scenario = sys.argv[1]
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert gpumem.is_active()
    result = {"recover": recover, "crash": crash}[scenario](rank, world, local_rank)
    _run.print_result(dict(result, rank=rank, world=world, scenario=scenario))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
