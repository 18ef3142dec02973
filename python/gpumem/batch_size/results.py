"""What the batch-size search returns and raises: :class:`Trial`, :class:`BatchSizeResult`,
:class:`BatchSizeError`, and the internal trial outcome types.  Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from .._format import fmt_bytes

__all__ = ["Trial", "BatchSizeResult", "BatchSizeError"]


def _fmt(n: Optional[float]) -> str:
    """Bytes in GiB with 2 decimals, as every line of the finder prints them ("?" when unknown)."""
    return fmt_bytes(n, unit="GiB")


@dataclass(frozen=True)
class Trial:
    """One real attempt at a batch size.

    ``outcome`` is ``"fits"``, ``"oom"`` (an out-of-memory error) or ``"over"`` (it
    ran, but its peak exceeded the target).  ``peak_bytes`` is the peak of allocated
    memory during the trial (the ballast excluded; for an OOM, a lower bound of what
    was needed, when known); ``reserved_bytes`` the peak reserved by the allocator.
    """

    batch_size: int
    outcome: str
    peak_bytes: Optional[int]
    reserved_bytes: Optional[int]
    seconds: float
    phase: str  # "probe", "prove" or "refine"

    @property
    def fits(self) -> bool:
        return self.outcome == "fits"


@dataclass
class BatchSizeResult:
    """What :func:`find_batch_size` found.  ``int(result)`` is the batch size."""

    batch_size: int
    predicted_peak_bytes: int  # the model's prediction (from the probes) at batch_size
    measured_peak_bytes: int  # peak allocated in the proving trial at batch_size
    bytes_per_sample: int
    fixed_bytes: int
    budget_bytes: int  # min(max_memory, what the allocator may use)
    target_bytes: int  # budget less the safety margin: what a step had to fit in
    limit_bytes: int  # what the allocator may use at all
    trials: List[Trial] = field(default_factory=list)
    seconds: float = 0.0
    reserved_before: int = 0
    reserved_after: int = 0
    at_upper_bound: bool = False
    target_batch: Optional[int] = None
    micro_batch_size: Optional[int] = None
    accumulation_steps: Optional[int] = None
    world_size: int = 1

    def __int__(self) -> int:
        return self.batch_size

    @property
    def effective_batch(self) -> Optional[int]:
        if self.micro_batch_size is None or self.accumulation_steps is None:
            return None
        return self.micro_batch_size * self.accumulation_steps

    def summary(self) -> str:
        n_oom = sum(1 for t in self.trials if not t.fits)
        s = (f"gpumem.find_batch_size: batch {self.batch_size}"
             f"{' (the upper bound)' if self.at_upper_bound else ''}"
             f", peak {_fmt(self.measured_peak_bytes)} (predicted {_fmt(self.predicted_peak_bytes)})"
             f" of {_fmt(self.target_bytes)} target / {_fmt(self.budget_bytes)} budget"
             f", {_fmt(self.bytes_per_sample)} per sample"
             f", {len(self.trials)} trials ({n_oom} failed) in {self.seconds:.1f} s")
        if self.micro_batch_size is not None:
            s += (f"; plan for {self.target_batch}: micro-batch {self.micro_batch_size}"
                  f" x {self.accumulation_steps} accumulation steps")
        if self.world_size > 1:
            s += f"; agreed by {self.world_size} ranks"
        return s

    __str__ = summary


class BatchSizeError(RuntimeError):
    """Not even the smallest batch size fits (or the budget is already used up)."""

    def __init__(self, message: str, needed_bytes: Optional[int] = None,
                 available_bytes: Optional[int] = None):
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes


class _TrialOOM(Exception):
    """Raised by a measure function after recovery: the trial ran out of memory."""

    def __init__(self, batch_size: int, needed_bytes: Optional[int], seconds: Optional[float]):
        super().__init__(f"out of memory at batch size {batch_size}")
        self.needed_bytes = needed_bytes
        self.seconds = seconds


@dataclass
class _Measurement:
    peak_bytes: int
    reserved_bytes: Optional[int] = None
    seconds: Optional[float] = None
