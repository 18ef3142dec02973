"""What the batch-size search returns and raises: :class:`Trial`, :class:`BatchSizeResult`,
:class:`BatchSizeError`, and the internal trial outcome types.  Torch-free.
"""
from __future__ import annotations

import html
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
    memory during the trial (a ballast excluded, where one is used; for an OOM, a lower bound of what
    was needed, when known); ``reserved_bytes`` the peak reserved by the allocator.
    """

    batch_size: int
    outcome: str
    peak_bytes: Optional[int]
    reserved_bytes: Optional[int]
    seconds: float
    phase: str  # "probe", "prove", "refine" or "verify"
    predicted_bytes: Optional[int] = None  # the fitted line's peak at batch_size, when there was one

    @property
    def fits(self) -> bool:
        return self.outcome == "fits"

    def line(self, what: str = "batch") -> str:
        """The progress line of this trial: size, predicted and measured peak, outcome, seconds."""
        verdict = {"fits": "fits", "oom": "OOM", "over": "over target"}[self.outcome]
        pred = "-" if self.predicted_bytes is None else _fmt(self.predicted_bytes)
        if self.peak_bytes is None:
            peak = "?"
        else:
            peak = (">" if self.outcome == "oom" else "") + _fmt(self.peak_bytes)
        return (f"{self.phase:7s} {what} {self.batch_size:>7d}  predicted {pred:>10s}  measured {peak:>11s}  "
                f"{verdict:11s} {self.seconds:6.2f} s")


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
    margin_bytes: Optional[int] = None  # what the answer keeps free below the budget, from measurement
    spread_bytes: Optional[int] = None  # run-to-run spread of the peak at the answer (verification)
    verified_steps: int = 0  # steps the answer ran in the final verification
    dim: Optional[int] = None  # for a length search: the sample dimension searched (else None)
    searched: str = "batch"  # "batch" or "length": what batch_size (the size found) counts

    def __int__(self) -> int:
        return self.batch_size

    @property
    def effective_batch(self) -> Optional[int]:
        if self.micro_batch_size is None or self.accumulation_steps is None:
            return None
        return self.micro_batch_size * self.accumulation_steps

    @property
    def size(self) -> int:
        """The size found: a batch size, or a length for :func:`gpumem.find_max_length`."""
        return self.batch_size

    def summary(self) -> str:
        n_oom = sum(1 for t in self.trials if not t.fits)
        s = (f"gpumem.find_{'batch_size' if self.searched == 'batch' else 'max_length'}: "
             f"{self.searched} {self.batch_size}"
             f"{' (the upper bound)' if self.at_upper_bound else ''}"
             f", peak {_fmt(self.measured_peak_bytes)} (predicted {_fmt(self.predicted_peak_bytes)})"
             f" of {_fmt(self.target_bytes)} target / {_fmt(self.budget_bytes)} budget"
             f", {_fmt(self.bytes_per_sample)} per sample"
             f", {len(self.trials)} trials ({n_oom} failed) in {self.seconds:.1f} s")
        if self.micro_batch_size is not None:
            s += (f"; plan for {self.target_batch}: micro-batch {self.micro_batch_size}"
                  f" x {self.accumulation_steps} accumulation steps")
        if self.margin_bytes is not None:
            s += f"; margin {_fmt(self.margin_bytes)} (measured spread {_fmt(self.spread_bytes)})"
        if self.verified_steps:
            s += f"; verified with {self.verified_steps} steps"
        if self.world_size > 1:
            s += f"; agreed by {self.world_size} ranks"
        return s

    __str__ = summary

    def table(self) -> List[List[str]]:
        """The trials as rows (header first): phase, size, predicted, measured, outcome, seconds."""
        rows = [["phase", self.searched, "predicted", "measured", "outcome", "seconds"]]
        for t in self.trials:
            pred = "-" if t.predicted_bytes is None else _fmt(t.predicted_bytes)
            peak = "?" if t.peak_bytes is None else (">" if t.outcome == "oom" else "") + _fmt(t.peak_bytes)
            verdict = {"fits": "fits", "oom": "OOM", "over": "over target"}[t.outcome]
            rows.append([t.phase, str(t.batch_size), pred, peak, verdict, f"{t.seconds:.2f}"])
        return rows

    def __repr__(self) -> str:
        rows = self.table()
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [self.summary()] + ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        esc = html.escape
        rows = self.table()
        head = "".join(f"<th>{esc(c)}</th>" for c in rows[0])
        body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
        return (f"<div><p><b>{esc(self.searched)} {self.batch_size}</b> &mdash; {esc(self.summary())}</p>"
                f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")


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
