"""One rank of tests/test_distributed_cpu.py: gloo on the CPU, started as a plain process.

    python tests/dist_cpu_worker.py SCENARIO RANK WORLD PORT

Prints one ``RESULT {json}`` line per check it made, then ``RESULT {"done": true}``.

Scenarios:
  agree   the batch-size finder's agreement (batch_size/distributed.py): MIN of sizes, MAX of
          outcomes and figures, every rank the same; then gpumem.check_ranks with no failure, an
          out-of-memory error on rank 1, a plain error on rank 0, both, and a collective afterwards
          (the ranks recovered together)
  crash   rank 1 exits without reaching check_ranks; rank 0 must get an error, not hang (its
          process group's timeout is 20 s; the test gives it 60 s)
"""
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import gpumem
from gpumem.batch_size.distributed import _OK, _OOM, _DistComm, _make_comm


def report(**fields):
    print("RESULT " + json.dumps(fields), flush=True)


def outcome(error):
    """What check_ranks did on this rank: ok, or the exception's class, its failures and its cause."""
    try:
        gpumem.check_ranks(error)
        return {"raised": None}
    except gpumem.RankFailure as e:
        return {"raised": type(e).__name__, "failures": {str(k): v for k, v in e.failures.items()},
                "is_torch_oom": isinstance(e, torch.cuda.OutOfMemoryError),
                "cause": type(e.__cause__).__name__ if e.__cause__ else None, "message": str(e)}


def agree(rank, world):
    comm = _make_comm(None, torch.device("cpu"))
    report(check="comm", kind=type(comm).__name__, rank=comm.rank, world=comm.world)
    report(check="min_int", value=comm.min_int([40, 17, 29, 33][rank % 4]))
    code, peak, reserved, needed = comm.exchange(_OOM if rank == 1 else _OK, 100 + rank, 7 - rank, 5)
    report(check="exchange", value=[code, peak, reserved, needed])
    report(check="not_distributed", kind=type(_make_comm(False, torch.device("cpu"))).__name__)
    assert isinstance(comm, _DistComm)

    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    report(check="none_failed", **outcome(None))
    report(check="rank1_oom", **outcome(oom if rank == 1 else None))
    report(check="rank0_error", **outcome(ValueError("bad input") if rank == 0 else None))
    report(check="both", **outcome(ValueError("bad input") if rank == 0 else oom))
    t = torch.ones(3)
    dist.all_reduce(t)
    report(check="after", value=t.tolist())
    try:
        gpumem.check_ranks("not an exception")
        report(check="bad_argument", raised=None)
    except TypeError as e:
        report(check="bad_argument", raised=type(e).__name__, message=str(e))


def crash(rank, world):
    dist.barrier()
    if rank == 1:
        os._exit(0)  # gone without a word (a success status: torchrun would not stop the others)
    start = time.monotonic()
    try:
        gpumem.check_ranks(None)
        report(check="crash", raised=None, seconds=time.monotonic() - start)
    except Exception as e:
        report(check="crash", raised=type(e).__name__, seconds=time.monotonic() - start,
               message=str(e)[:300])


def main():
    scenario, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=20))
    {"agree": agree, "crash": crash}[scenario](rank, world)
    report(done=True)
    if scenario != "crash":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
