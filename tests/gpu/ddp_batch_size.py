"""gpumem.find_batch_size under torch.distributed: 2 processes, one GPU each.

    torchrun --standalone --nproc_per_node 2 tests/gpu/ddp_batch_size.py

Prints ``RANK r KEY value`` lines (checked by tests/gpu/test_batch_size_gpu.py):

  ddp          the size agreed for a DistributedDataParallel model (built-in step)
  local        each rank's own answer for a step whose memory differs per rank
               (rank 1 holds 3x the extra memory per sample of rank 0), searched alone
  agreed       the answer with the ranks agreeing: the same on both, the minimum
  agreed_fits  yes/no: 3 steps at the agreed size run on this rank
  error        the exception type when rank 1's step raises a non-memory error
               (rank 0 gets a RuntimeError instead of hanging)
  done         ok
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gpumem

MiB = 1 << 20


def main():
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank = dist.get_rank()

    def say(key, value):
        print(f"RANK {rank} {key} {value}", flush=True)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(),
                          nn.Linear(4096, 1000)).cuda()
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    budget = 2 << 30

    # 1. a DDP model through the built-in step: measured on .module, agreed across ranks
    res = gpumem.find_batch_size(ddp, (1024,), autocast=torch.bfloat16, max_memory=budget)
    say("ddp", res.batch_size)

    # 2. memory that differs per rank: rank 1 holds 3x the extra per-sample memory
    extra = [1, 3][rank] * MiB
    opt = torch.optim.AdamW(model.parameters())

    def step(b):
        hold = torch.empty(b * extra, dtype=torch.uint8, device="cuda")
        x = torch.randn(b, 1024, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), torch.randint(0, 1000, (b,), device="cuda"))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del hold

    kw = dict(model=model, step_fn=step, optimizer=opt, max_memory=budget)
    local = gpumem.find_batch_size(distributed=False, verbose=False, **kw)
    say("local", local.batch_size)
    dist.barrier()
    agreed = gpumem.find_batch_size(**kw)
    say("agreed", agreed.batch_size)

    # the agreed size runs on this rank inside the same budget (a tensor holding the rest of the device
    # stands in for other processes' memory)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(max(0, free + torch.cuda.memory_reserved() - budget), dtype=torch.uint8, device="cuda")
    try:
        for _ in range(3):
            step(agreed.batch_size)
        torch.cuda.synchronize()
        ok = "yes"
    except torch.cuda.OutOfMemoryError:
        ok = "no"
    del hog
    torch.cuda.empty_cache()
    say("agreed_fits", ok)
    dist.barrier()

    # 3. a non-memory error on rank 1 only: rank 1 re-raises it, rank 0 is told, nobody hangs
    def broken(b):
        if rank == 1 and b > 4:
            raise ValueError("rank 1: not a memory problem")
        step(b)

    try:
        gpumem.find_batch_size(model, step_fn=broken, optimizer=opt, max_memory=budget, verbose=False)
        say("error", "none")
    except Exception as e:  # noqa: BLE001
        say("error", type(e).__name__)
    dist.barrier()
    say("done", "ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
