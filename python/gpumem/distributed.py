"""Failures across ranks: one rank's error (an out-of-memory error above all) made known to every rank.

Under ``torch.distributed`` a rank that fails inside a step stops taking part in collectives, and the
others wait for it. :func:`check_ranks` is the agreement point: every rank calls it with the exception
it caught (or ``None``) at a place all ranks reach, and if any rank failed, every rank raises the same
:class:`RankFailure` naming the ranks and what they hit, a :class:`RankOutOfMemoryError` (also a
``torch.cuda.OutOfMemoryError``) when one of them ran out of memory. What happens next is the user's
code: recover together (free memory, shrink the batch, go on) or stop on every rank.

Put the check where no collective of the step is pending: after the part that may run out of memory
and before the next collective (with DDP, after the forward and before ``backward()``, whose hooks
all-reduce; with FSDP2, around the whole step, since its forward and backward run collectives, after
a failure on every rank is then only possible when it happens before the first one). A rank that dies
or fails inside a collective never reaches the check: the process group's ``timeout``
(``init_process_group(timeout=...)``) bounds the others' wait, and torchrun stops every rank when one
exits with an error. docs/distributed.md shows both.

The check costs one small all-reduce (``world_size`` integers) and waits for it on the host.

Example::

    for batch in loader:
        error = None
        try:
            loss = model(batch).loss             # the memory-hungry part, no collective in it
        except torch.cuda.OutOfMemoryError as e:
            error = e
        try:
            gpumem.check_ranks(error)            # every rank: the same outcome
        except gpumem.RankOutOfMemoryError:
            loss = None
            torch.cuda.empty_cache()             # every rank skips this batch together
            continue
        loss.backward()
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from ._errors import is_oom_error

__all__ = ["check_ranks", "RankFailure", "RankOutOfMemoryError"]

# What a rank reports (0: nothing; the SUM over ranks of one-hot slots keeps every rank's code).
_OK, _OOM, _ERROR = 0, 1, 2
_KIND = {_OOM: "out of memory", _ERROR: "error"}


class RankFailure(RuntimeError):
    """Raised on every rank when one or more ranks passed an exception to :func:`check_ranks`.

    ``failures`` maps each failed rank to ``"out of memory"`` or ``"error"``; ``local`` is this rank's
    own exception (``None`` where this rank did not fail; it is also the ``__cause__``)."""

    def __init__(self, message: str, failures: Dict[int, str], local: Optional[BaseException]):
        super().__init__(message)
        self.failures = failures
        self.local = local


class RankOutOfMemoryError(RankFailure, torch.cuda.OutOfMemoryError):
    """A :class:`RankFailure` where at least one rank ran out of GPU memory: existing
    ``except torch.cuda.OutOfMemoryError`` recovery code handles it on every rank."""


def _device_for(group: Any) -> torch.device:
    """Where the exchange's tensor lives: NCCL needs CUDA, gloo (or a mixed cpu/cuda group) the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_ranks(error: Optional[BaseException] = None, *, group: Any = None) -> None:
    """Tell every rank whether any rank failed; raise the same error on all of them if one did.

    Args:
        error: the exception this rank caught in the guarded part of its step, or ``None``.
        group: the process group (default: the world).

    Raises:
        RankOutOfMemoryError: some rank passed a GPU out-of-memory error (``gpumem.is_oom_error``).
        RankFailure: some rank passed another exception.
        RuntimeError: ``torch.distributed`` is not initialized.

    Without a process group of more than one rank there is no one to tell: ``error`` is re-raised
    as it is, and ``None`` returns.
    """
    if error is not None and not isinstance(error, BaseException):
        raise TypeError(f"check_ranks takes the exception this rank caught, or None; got "
                        f"{type(error).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("gpumem.check_ranks: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if world <= 1:
        if error is not None:
            raise error
        return
    code = _OK if error is None else _OOM if is_oom_error(error) else _ERROR
    slots = torch.zeros(world, dtype=torch.int64, device=_device_for(group))
    slots[rank] = code
    dist.all_reduce(slots, op=dist.ReduceOp.SUM, group=group)
    codes = [int(c) for c in slots.tolist()]
    failures = {r: _KIND[c] for r, c in enumerate(codes) if c != _OK}
    if not failures:
        return
    listed = ", ".join(f"rank {r}: {kind}" for r, kind in sorted(failures.items()))
    here = (f"this rank (rank {rank}) raised {type(error).__name__}: {error}" if error is not None
            else f"this rank (rank {rank}) did not fail")
    message = (f"gpumem.check_ranks: {len(failures)} of {world} ranks failed in this step ({listed}); "
               f"{here}. Every rank raises this error: recover together or stop.")
    cls = RankOutOfMemoryError if _OOM in codes else RankFailure
    raise cls(message, failures, error) from error
