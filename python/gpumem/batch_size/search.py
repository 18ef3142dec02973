"""The search: fit ``peak = fixed + per_sample * B`` from small probes, predict, prove, refine.

:func:`_search` is pure (torch-free): it calls ``measure(b)`` for each trial and decides from the
peaks and out-of-memory errors it gets back, so tests drive it with simulated memory curves.
:func:`_plan` turns the largest fitting size into micro-batches and accumulation steps.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .._errors import is_oom_error
from .results import BatchSizeError, Trial, _fmt, _Measurement, _TrialOOM


def _is_oom(e: BaseException) -> bool:
    """A trial's failure is out of memory: the runner's verdict (``_TrialOOM``) or gpumem's OOM test."""
    return isinstance(e, _TrialOOM) or is_oom_error(e)


@dataclass
class _SearchOutcome:
    batch_size: int
    trials: List[Trial]
    fixed_bytes: int
    bytes_per_sample: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    at_upper_bound: bool


def _line(points: List[Tuple[int, int]]) -> Optional[Tuple[float, float, int, int]]:
    """(fixed, per_sample, anchor_b, anchor_peak) from measured (b, peak) points: the secant
    from the largest point to the largest point at most half its size (or the smallest
    point), falling back to least squares; None without a positive slope."""
    pts = sorted(set(points))
    if len(pts) < 2:
        return None
    bmax, pmax = pts[-1]
    partners = [p for p in pts[:-1] if p[0] <= bmax // 2] or [pts[0]]
    b0, p0 = partners[-1]
    if bmax > b0:
        slope = (pmax - p0) / (bmax - b0)
        if slope > 0:
            return pmax - slope * bmax, slope, bmax, pmax
    n = len(pts)
    mb = sum(b for b, _ in pts) / n
    mp = sum(p for _, p in pts) / n
    var = sum((b - mb) ** 2 for b, _ in pts)
    if var <= 0:
        return None
    slope = sum((b - mb) * (p - mp) for b, p in pts) / var
    if slope <= 0:
        return None
    return mp - slope * mb, slope, bmax, pmax


def _predict(fit: Optional[Tuple[float, float, int, int]], tgt: float, default: int) -> int:
    """The largest size at which the fitted line stays within ``tgt`` bytes; ``default`` without a
    line (no slope visible: go straight to the bound)."""
    if fit is None:
        return default
    _, slope, ab, ap = fit
    return ab + math.floor((tgt - ap) / slope)


# What the allocator's pages are expected to add to the allocated peak at the limit, as a fraction of the
# target: where the search's first guess near the limit aims (on the GPU: 0.6-2 %, the gap between the
# largest fitting trial's allocated peak and the target on bench/batch_size_bench.py's workloads).
OVERHEAD = 0.01


def _search(measure: Callable[[int], Any], target: int, lo: int = 1, hi: int = 1 << 16, *,
            log: Optional[Callable[[Trial], None]] = None, max_trials: int = 40,
            resolution: float = 0.005,
            clock: Callable[[], float] = time.perf_counter) -> _SearchOutcome:
    """The largest ``b`` in ``[lo, hi]`` whose trial fits in ``target`` bytes, to within
    ``resolution`` (a fraction of ``b``; 0 for the exact size).

    Near the limit every trial runs close to full memory and is the slowest of the search,
    so the refinement stops once the bracket between the largest fitting and the smallest
    failing size is at most ``resolution`` of the fitting size (always exact below 200 at
    the default 0.5%); its first guess there allows ``OVERHEAD`` for the allocator's pages.

    ``measure(b)`` runs a trial and returns its peak bytes (an ``int``, or an object
    with ``peak_bytes`` and optionally ``reserved_bytes`` / ``seconds``), or raises an
    out-of-memory error (``torch.cuda.OutOfMemoryError``, an allocation-failure
    ``RuntimeError``, or ``_TrialOOM``).  Any other exception propagates at once.
    A trial fits when it raised nothing and its peak is at most ``target``.  Assumes
    fitting is monotone in ``b``; the returned size has always passed a real trial.
    """
    if lo < 1 or hi < lo:
        raise ValueError(f"bad bounds [{lo}, {hi}]")
    trials: List[Trial] = []
    ok: Dict[int, Trial] = {}
    measured: Dict[int, int] = {}  # b -> allocated peak, for every trial that ran

    def run(b: int, phase: str) -> Trial:
        if len(trials) >= max_trials:
            raise RuntimeError(f"find_batch_size: gave up after {max_trials} trials")
        fit_now = _line(list(measured.items()))
        pred = None if fit_now is None else int(fit_now[0] + fit_now[1] * b)
        t0 = clock()
        try:
            m = measure(b)
        except Exception as e:  # classified below, others re-raised
            if not _is_oom(e):
                raise
            needed = getattr(e, "needed_bytes", None)
            secs = getattr(e, "seconds", None)
            tr = Trial(b, "oom", needed, None, clock() - t0 if secs is None else secs, phase, pred)
        else:
            if isinstance(m, (int, float)):
                m = _Measurement(int(m))
            peak = int(m.peak_bytes)
            secs = getattr(m, "seconds", None)
            tr = Trial(b, "fits" if peak <= target else "over", peak, getattr(m, "reserved_bytes", None),
                       clock() - t0 if secs is None else secs, phase, pred)
            measured[b] = peak
        trials.append(tr)
        if tr.fits:
            ok[b] = tr
        if log is not None:
            log(tr)
        return tr

    # -- 1. probes at small sizes
    first = run(lo, "probe")
    if not first.fits:
        need = first.peak_bytes
        raise BatchSizeError(
            f"batch size {lo} does not fit: it needs {'more than ' if first.outcome == 'oom' else ''}"
            f"{_fmt(need) if need else 'more than the available memory'}, "
            f"and {_fmt(target)} is available (the budget less the safety margin)",
            needed_bytes=need, available_bytes=target)
    lo_ok, hi_bad = lo, None
    b = min(hi, 2 * lo)
    min_delta = 0.01 * target
    while b > lo_ok:
        t = run(b, "probe")
        if not t.fits:
            hi_bad = b
            break
        lo_ok = b
        grown = measured[b] - measured[lo]
        if grown >= min_delta or b >= hi:
            break
        # too flat to see a slope yet: grow 4x, or up to 16x where the little growth seen so far
        # says the limit is still far (45% of the way to where that slope would reach the target)
        far = 4 * b
        if grown > 0:
            far = max(far, min(16 * b, int(0.45 * (b + (target - measured[b]) * (b - lo) / grown))))
        b = min(hi, far)

    # one more probe about half way to the prediction gives a long baseline
    if hi_bad is None and lo_ok < hi:
        fit = _line(list(measured.items()))
        if fit is not None:
            pred = _predict(fit, target, hi)
            if pred >= 3 * lo_ok:
                mid = min(hi, lo_ok + int((pred - lo_ok) * 0.45))
                if mid > lo_ok:
                    t = run(mid, "probe")
                    if t.fits:
                        lo_ok = mid
                    else:
                        hi_bad = mid

    probe_fit = _line(list(measured.items()))

    # -- 2. prove and refine.  The allocated peaks lie on the line, but what fits is bounded by the
    # allocator's pages, which run ahead of the allocated bytes near the limit by an overhead no
    # probe shows (fragmentation under pressure: 0.5-2 % of the target on the GPU; the reserved peak
    # of a probe far from the limit holds cached blocks the pool would give back, so it says
    # nothing).  The first guess assumes OVERHEAD, each failure doubles it; after a fit, bisection
    # (a trial near the limit is the dearest of the search).
    overhead = OVERHEAD * target
    fails_in_row = past_line = 0
    fit_near = False  # a prove or refine trial fitted: bisect from there on
    phase = "prove"
    while True:
        upper = hi if hi_bad is None else hi_bad - 1
        if lo_ok >= upper:
            break
        if hi_bad is not None and hi_bad - lo_ok <= max(1, int(resolution * lo_ok)):
            break  # close enough: the sizes left differ by less than the resolution
        fit = _line([(bb, p) for bb, p in measured.items() if bb <= lo_ok or bb in ok])
        optimistic = _predict(fit, target, upper)  # allocated bytes alone: never fits beyond this
        step = max(1, int(resolution * lo_ok))
        if optimistic <= lo_ok + step and hi_bad is None:
            # the line puts the limit within a step: one real failure there ends the search (where
            # the peaks rise in steps, a line through them cannot see the last flat part: then
            # each fit beyond the line doubles the step)
            guess = lo_ok + step * (1 << past_line)
        elif optimistic <= lo_ok:
            break  # the allocated-bytes line already exceeds the target at lo_ok + 1
        elif fit is None and hi_bad is not None:
            # no line to aim with (the peaks measured so far do not grow with the size: a flat start,
            # or noise in them): bisect. Aiming at the bound instead walked down from a failure one
            # size at a time, until the search gave up after max_trials.
            guess = (lo_ok + hi_bad) // 2
        elif phase == "prove" or (fails_in_row and not fit_near):
            # the first guess assumes OVERHEAD; each failure since doubles it, until a trial near
            # the limit fits (never below the middle of the bracket)
            guess = _predict(fit, target - overhead * (1 << fails_in_row), upper)
            if hi_bad is not None:
                guess = max(guess, (lo_ok + hi_bad) // 2)
        else:  # bisect, above a fit by the line's own bound (beyond it, the allocated bytes alone
            # exceed the target)
            guess = (lo_ok + (optimistic + 1 if hi_bad is None else hi_bad)) // 2
        guess = min(max(guess, lo_ok + 1), upper, max(optimistic, lo_ok + step * (1 << past_line)))
        t = run(guess, phase)
        phase = "refine"
        if t.fits:
            past_line = past_line + 1 if guess > optimistic else 0
            lo_ok, fails_in_row, fit_near = guess, 0, True
        else:
            hi_bad, fails_in_row = guess, fails_in_row + 1

    final_fit = _line([(bb, p) for bb, p in measured.items() if bb in ok]) or probe_fit
    fixed, slope = (final_fit[0], final_fit[1]) if final_fit else (float(ok[lo_ok].peak_bytes or 0), 0.0)
    if probe_fit is not None:
        predicted = int(probe_fit[0] + probe_fit[1] * lo_ok)
    else:
        predicted = int(ok[lo_ok].peak_bytes or 0)
    return _SearchOutcome(lo_ok, trials, int(fixed), round(slope), predicted,
                          int(ok[lo_ok].peak_bytes or 0), lo_ok >= hi)


def _plan(max_fit: int, target_batch: int) -> Tuple[int, int]:
    """(micro_batch, accumulation_steps) for target_batch samples per optimizer step with
    micro-batches of at most max_fit: the fewest steps whose micro-batch divides
    target_batch exactly (up to twice the minimum), else balanced micro-batches whose
    total is the smallest multiple at or above target_batch."""
    if target_batch <= max_fit:
        return target_batch, 1
    steps0 = -(-target_batch // max_fit)
    for steps in range(steps0, 2 * steps0 + 1):
        if target_batch % steps == 0 and target_batch // steps <= max_fit:
            return target_batch // steps, steps
    return -(-target_batch // steps0), steps0
