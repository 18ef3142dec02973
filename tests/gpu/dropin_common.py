"""What every drop-in scenario shares (tests/gpu/dropin_scenarios.py runs them): the allocator chosen
from GPUMEM_DROPIN_ALLOCATOR at import, before torch starts CUDA (gpumem first, or PyTorch's own with
GPUMEM_DISABLE=1), the FACTS a scenario records, and small helpers over torch's allocator API.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os

faulthandler.enable()  # a crash prints the Python line it happened on (stderr)
ALLOCATOR = os.environ.get("GPUMEM_DROPIN_ALLOCATOR", "gpumem")
if ALLOCATOR == "gpumem":
    os.environ.pop("GPUMEM_DISABLE", None)
    import gpumem  # noqa: F401  first: gpumem becomes torch's CUDA allocator before CUDA starts
    import gpumem._torch as _gt
else:
    os.environ["GPUMEM_DISABLE"] = "1"  # in case anything imports gpumem
    _gt = None
import torch  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
DEV = 0
FACTS: dict = {}
GPUMEM = ALLOCATOR == "gpumem"


def start():
    """Start CUDA and check that the allocator is the one claimed."""
    torch.cuda.init()
    FACTS["backend"] = torch.cuda.memory.get_allocator_backend()
    if GPUMEM:
        assert _gt.is_active(), _gt.status_line()
        assert FACTS["backend"] != "native", FACTS["backend"]
    else:
        assert FACTS["backend"] == "native", FACTS["backend"]


def std_deleter(t) -> bool:
    """Whether the tensor's storage deleter is the current allocator's raw_deleter (what cudagraph
    trees assert for the storages it hands back deleters to)."""
    return bool(torch._C._has_Standard_Deleter(t.untyped_storage()._cdata))


def warm(x):
    """Run a kernel once outside capture (lazy module loading must not happen inside a capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        (x * 2 + 1).sum()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def pool_blocks(pool, state="active_allocated"):
    """{address: size} of the blocks of the given state in the segments of a private pool."""
    out = {}
    for seg in torch.cuda.memory_snapshot():
        if tuple(seg.get("segment_pool_id", (0, 0))) != tuple(pool):
            continue
        for b in seg["blocks"]:
            if b["state"] == state:
                out[b["address"]] = b["size"]
    return out


def live_check(pool, ptrs) -> bool:
    return bool(torch._C._cuda_checkPoolLiveAllocations(DEV, tuple(pool), set(ptrs)))


def try_gib(value: float, pool=None):
    """Tries a 1 GiB float32 tensor filled with `value` (inside the MemPool `pool` when given): what
    happened (fits, with its last element; or the out-of-memory message) and how many OOMs torch's
    num_ooms counted meanwhile."""
    ooms = torch.cuda.memory_stats()["num_ooms"]
    try:
        with torch.cuda.use_mem_pool(pool) if pool is not None else contextlib.nullcontext():
            t = torch.full((256 * MiB,), value, device="cuda")
        torch.cuda.synchronize()
        outcome = dict(outcome="fits", last=float(t[-1]))
        del t
    except torch.OutOfMemoryError as e:
        outcome = dict(outcome="oom", message=str(e)[:400])
    return outcome, torch.cuda.memory_stats()["num_ooms"] - ooms


def exc_name(e: BaseException) -> str:
    return type(e).__name__


def _capture_outputs(x, pool=None):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        outs = [x * 2, x + 1, torch.empty(3 * MiB, dtype=torch.uint8, device="cuda"),
                (x * 3).repeat(1024)]  # 16 MiB
    torch.cuda.synchronize()
    return g, outs


def _captured():
    """x, and a graph of _capture_outputs(x) in a private pool of its own: (x, g, outs, pool)."""
    x = torch.arange(4096, dtype=torch.float32, device="cuda")
    warm(x)
    g, outs = _capture_outputs(x)
    return x, g, outs, tuple(g.pool())
