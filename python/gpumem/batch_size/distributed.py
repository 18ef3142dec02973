"""Agreement across ranks: every rank takes part in every exchange, so all follow the same search.

A trial's outcome (:data:`_OK`, :data:`_OOM`, :data:`_ERROR`) and figures are MAX-reduced after the
local step, so an out-of-memory error on one rank never leaves another waiting in a collective, and
the worst outcome wins; sizes and budgets are MIN-reduced.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

# A trial's outcome as exchanged between ranks (ordered: the MAX over the ranks is the worst).
_OK, _OOM, _ERROR = 0, 1, 2


class _Comm:
    rank = 0
    world = 1

    def min_int(self, x: int) -> int:
        return x

    def exchange(self, code: int, peak: int, reserved: int, needed: int) -> Tuple[int, int, int, int]:
        return code, peak, reserved, needed


class _DistComm(_Comm):
    """Every rank takes part in every exchange, whatever happened in its own trial, so an
    OOM on one rank never leaves the others waiting in a collective."""

    def __init__(self, device: torch.device):
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        backend = str(dist.get_backend()).lower()
        self.dev = device if ("nccl" in backend and device.type == "cuda") else torch.device("cpu")

    def _reduce(self, vals: List[int], op: Any) -> List[int]:
        t = torch.tensor(vals, dtype=torch.int64, device=self.dev)
        self.dist.all_reduce(t, op=op)
        return [int(v) for v in t.tolist()]

    def min_int(self, x: int) -> int:
        return self._reduce([x], self.dist.ReduceOp.MIN)[0]

    def exchange(self, code: int, peak: int, reserved: int, needed: int) -> Tuple[int, int, int, int]:
        c, p, r, n = self._reduce([code, peak, reserved, needed], self.dist.ReduceOp.MAX)
        return c, p, r, n


def _make_comm(distributed: Optional[bool], device: torch.device) -> _Comm:
    if distributed is False:
        return _Comm()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return _DistComm(device)
    if distributed:
        raise RuntimeError("distributed=True but torch.distributed is not initialized with more than "
                           "one rank")
    return _Comm()
