"""The measured margin and the final verification of an answer.  Torch-free.

A trial passes when its step fits under ``target`` (the trials run capped there), so a
passing size already keeps ``floor = budget - target`` free: room for what no trial can see
(segment and page rounding of the allocator, a workspace another process would get).  What a trial
*can* see is how much the peak moves between runs of the same size: algorithm choices, the order in
which the allocator splits and reuses its segments (reserved minus allocated).  The verification
runs the answer again, for ``steps`` steps, in the search process and under the same bound; the
spread is the largest difference of its peaks (allocated; reserved too where the trials were not
capped, see verify()) from the proving trial's.
The answer must keep that spread free below the budget as well; when it does not, the size steps
down by the spread's worth of samples and is verified again.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from .._errors import is_oom_error
from .results import BatchSizeError, Trial, _Measurement, _TrialOOM

# Smallest floor, PyTorch's caching allocator: a couple of its large segments (it rounds requests
# between 1 and 10 MiB up to 20 MiB segments, and a fresh process may split them otherwise than the
# search's trials did). gpumem's pool rounds to its physical pages (8 MiB by default), and a trial
# under the bound already pays that rounding: on an H100 a fresh process repeated the trials'
# allocated peaks to the byte (tests/gpu/test_batch_size_gpu.py's GPT), so its smallest floor is one
# page (_CudaBackend.floor_min_bytes).
FLOOR_MIN_BYTES = 32 << 20
# Floor as a fraction of the budget: the part of a fresh process that no trial here can see.
FLOOR_FRACTION = 0.004


def floor_bytes(budget: int, min_bytes: int = FLOOR_MIN_BYTES) -> int:
    """The memory every answer keeps free below the budget before any measured spread."""
    return int(max(min_bytes, FLOOR_FRACTION * budget))


@dataclass
class _Verified:
    batch_size: int
    spread_bytes: int
    peak_bytes: int
    reserved_bytes: Optional[int]
    trials: List[Trial]


def _as_measurement(m: Any) -> _Measurement:
    if isinstance(m, (int, float)):
        return _Measurement(int(m))
    return m


def verify(measure: Callable[[int], Any], b: int, proven: Optional[Trial], *, budget: int, target: int,
           bytes_per_sample: int, lo: int, log: Optional[Callable[[Trial], None]] = None,
           rounds: int = 4, capped: bool = False,
           clock: Callable[[], float] = time.perf_counter) -> _Verified:
    """Run ``b`` again with ``measure`` (the verification's longer trial); step down until the answer
    keeps the measured spread free below ``budget``.  ``proven`` is the search's passing trial at ``b``.

    ``capped``: the trials ran under a cap at ``target`` (the per-process memory fraction). The
    allocator then keeps what it freed cached up to the cap, so a trial's reserved peak sits at the cap
    whatever the step needs, and passing under it already proves the reserved bytes fit: the allocated
    peaks alone measure the spread and what the answer keeps free. Bounded otherwise (a ballast, or
    a simulated device), the reserved peaks count as well."""
    trials: List[Trial] = []
    ref = proven
    spread = 0
    ooms = 0
    for _ in range(rounds):
        t0 = clock()
        try:
            m = _as_measurement(measure(b))
        except Exception as e:  # classified below, others re-raised
            if not (isinstance(e, _TrialOOM) or is_oom_error(e)):
                raise
            tr = Trial(b, "oom", getattr(e, "needed_bytes", None), None, clock() - t0, "verify",
                       None if ref is None else ref.peak_bytes)
            trials.append(tr)
            if log is not None:
                log(tr)
            # the same size failed where it passed before: that is a spread of at least what it needed
            # beyond the target; step down by it, and by at least the floor's worth of samples, doubled
            # with each failure: an out-of-memory error early in a step says little of what the whole
            # step needs, and near the cap gpumem's pool does not fit a size every time (on two H200s,
            # DDP with uneven budgets, a size that passed every trial under a cap failed 3 runs of 3 under
            # the same cap after the search)
            ooms += 1
            need = getattr(e, "needed_bytes", None) or 0
            base = ref.peak_bytes if ref is not None and ref.peak_bytes is not None else target
            spread = max(spread, need - base, 0)
            b = _step_down(b, max(spread, (budget - target) << (ooms - 1)), bytes_per_sample, lo)
            ref = None
            continue
        secs = m.seconds if m.seconds is not None else clock() - t0
        tr = Trial(b, "fits" if m.peak_bytes <= target else "over", m.peak_bytes, m.reserved_bytes, secs,
                   "verify", None if ref is None else ref.peak_bytes)
        trials.append(tr)
        if log is not None:
            log(tr)
        reserved = None if capped else m.reserved_bytes
        ref_reserved = None if capped or ref is None else ref.reserved_bytes
        if ref is not None and ref.peak_bytes is not None:
            spread = max(spread, abs(m.peak_bytes - ref.peak_bytes))
            if reserved is not None and ref_reserved is not None:
                spread = max(spread, abs(reserved - ref_reserved))
        high = max(reserved or m.peak_bytes, m.peak_bytes)
        if ref_reserved is not None:
            high = max(high, ref_reserved)
        if tr.fits and high + spread <= budget - (budget - target) // 2:
            return _Verified(b, spread, m.peak_bytes, m.reserved_bytes, trials)
        # over: keep the spread free on top of the floor
        b = _step_down(b, max(high + spread - (budget - (budget - target) // 2), 1), bytes_per_sample, lo)
        ref = None
    raise BatchSizeError(f"the answer could not be verified in {rounds} rounds: the peak at the same size "
                         f"moves by up to {spread} bytes between runs", needed_bytes=None,
                         available_bytes=target)


def _step_down(b: int, excess: int, per_sample: int, lo: int) -> int:
    n = math.ceil(excess / per_sample) if per_sample > 0 else max(1, b // 100)
    nb = b - max(1, n)
    if nb < lo:
        raise BatchSizeError(f"size {lo} does not fit once the run-to-run spread of the peak "
                             f"({excess} bytes) is kept free", needed_bytes=None, available_bytes=None)
    return nb
