"""The OOM-retry loop, done right: ``@gpumem.find_executable_batch_size``.

Same signature and behaviour as Accelerate's ``accelerate.utils.find_executable_batch_size``: the
decorated function takes the batch size as its first argument and is called without it
(``train(model, opt)`` calls ``train(batch_size, model, opt)``); an out-of-memory error retries with
a smaller size, any other error propagates at once; ``RuntimeError("No executable batch size found,
reached zero.")`` when the size reaches 0; a ``TypeError`` when the caller passes the batch size
itself; the size reached persists between calls; ``reduce_batch_size_fn()`` replaces the reduction.

What differs, and why:

* **The next size is predicted, not 0.9x blindly.**  A failed try's peak (allocated bytes when it
  failed, plus the request that failed) and the memory live before it give a lower bound of its
  bytes per sample; the next size is the largest whose predicted peak fits the allocator's limit
  less a small floor, and never more than 0.9x (Accelerate's step).  Several failures refine the
  line.  ``probe=`` (``find_batch_size``'s keyword arguments) or ``probe=callable`` gives the first
  size from gpumem's own search instead of ``starting_batch_size``.
* **What the failed try held is freed**: the frames of its traceback (the activations its locals
  pinned) are cleared, the error dropped, ``gc.collect()`` and ``torch.cuda.empty_cache()`` run
  before the next try, outside the ``except`` block.
* **Only OOM retries** (``gpumem.is_oom_error``: ``torch.cuda.OutOfMemoryError``, cuBLAS/cuDNN
  allocation failures, or an error raised from one of them); Accelerate's cuDNN
  ``CUDNN_STATUS_NOT_SUPPORTED`` is not out of memory and propagates.
* ``target_batch=``: the function is called with the micro-batch size and an ``accumulation_steps``
  keyword argument (it must accept one), so micro-batch x steps >= ``target_batch``.
* each try is one progress line (size, predicted and measured peak, OOM or done, seconds).
"""
from __future__ import annotations

import functools
import gc
import inspect
import math
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

from .._errors import find_oom_error, requested_bytes
from .results import Trial, _fmt
from .search import _plan
from .trial import _clear_frames

__all__ = ["find_executable_batch_size"]

_FLOOR = 64 << 20  # kept free below the limit by a predicted size (segment rounding)


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _limit() -> Optional[int]:
    """What the allocator may use at all (free device memory plus torch's reserved, fraction-capped)."""
    if not _cuda():
        return None
    free, total = torch.cuda.mem_get_info()
    limit = free + torch.cuda.memory_reserved()
    try:
        frac = float(torch.cuda.get_per_process_memory_fraction())
    except Exception:  # an allocator without the notion
        frac = 1.0
    if 0 < frac < 1:
        limit = min(limit, int(frac * total))
    return int(limit)


def _free_failed(e: Optional[BaseException]) -> None:
    """Release what a failed try pinned: its frames' locals, reference cycles, the cached pages."""
    if e is not None:
        _clear_frames(e)
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _predict_next(fails: List[Tuple[int, int]], live: int, limit: Optional[int], b: int) -> Optional[int]:
    """The largest size whose line from (0, live) through the failures' (size, needed) stays under
    the limit less the floor; None without the figures.  Needs are lower bounds, so the line is too:
    the prediction is an upper bound, capped at 0.9x by the caller."""
    if limit is None or not fails:
        return None
    per = max(((need - live) / size for size, need in fails if size > 0 and need > live), default=0.0)
    if per <= 0:
        return None
    return math.floor((limit - _FLOOR - live) / per)


def find_executable_batch_size(function: Optional[Callable[..., Any]] = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Optional[Callable[[], int]] = None, *,
                               target_batch: Optional[int] = None,
                               probe: Union[Mapping[str, Any], Callable[[], Any], None] = None,
                               verbose: bool = True, log: Optional[Callable[[str], None]] = None) -> Any:
    """Retry ``function(batch_size, *args, **kwargs)`` with a smaller size on out-of-memory errors.

    Args:
        function: the function to wrap (its first parameter is the batch size); omitted when used
            as ``@find_executable_batch_size(starting_batch_size=...)``.
        starting_batch_size: the first size tried (the upper bound of a ``probe``).
        reduce_batch_size_fn: ``() -> int``, the next size after a failure (Accelerate's hook);
            replaces gpumem's prediction.
        target_batch: call ``function(micro_batch, *args, accumulation_steps=n, **kwargs)`` with
            ``micro_batch * n >= target_batch`` (``micro_batch`` the size that fits).
        probe: ``find_batch_size``'s keyword arguments (``model``, ``shape``, ...) to start from its
            answer, or a callable returning a size (or a result with ``batch_size``).
        verbose, log: a line per try on stderr, or to ``log``; ``verbose=False``: quiet.

    The wrapper has ``.batch_size`` (the size reached), ``.accumulation_steps`` and ``.tries``
    (:class:`gpumem.batch_size.Trial` per try).
    """
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn, target_batch=target_batch,
                                 probe=probe, verbose=verbose, log=log)
    if not callable(function):
        raise TypeError(f"find_executable_batch_size wraps a function, not {type(function).__name__}")
    if (not isinstance(starting_batch_size, int) or isinstance(starting_batch_size, bool)
            or starting_batch_size < 0):
        raise ValueError(f"starting_batch_size must be an int >= 0, not {starting_batch_size!r}")
    if target_batch is not None and (not isinstance(target_batch, int) or target_batch < 1):
        raise ValueError(f"target_batch must be an int >= 1, not {target_batch!r}")
    if target_batch is not None:
        params = inspect.signature(function).parameters
        if "accumulation_steps" not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            raise TypeError(f"with target_batch, {function.__name__} must accept an accumulation_steps "
                            f"keyword argument")
    emit: Callable[[str], None] = log if log is not None else (
        lambda line: print(line, file=sys.stderr, flush=True))
    if not verbose:
        emit = lambda line: None

    state: Dict[str, Any] = {"batch_size": None}
    tries: List[Trial] = []

    def first_size() -> int:
        b = starting_batch_size
        if target_batch is not None:
            b = min(b, target_batch)
        if probe is None or b == 0:
            return b
        if callable(probe):
            got = probe()
        else:
            from .api import find_batch_size

            kw = dict(probe)
            kw.setdefault("max_batch", b)
            kw.setdefault("verbose", verbose)
            if log is not None:
                kw.setdefault("log", log)
            got = find_batch_size(kw.pop("model", None), kw.pop("shape", None), **kw)
        got = int(getattr(got, "batch_size", got))
        if got < 1:
            raise ValueError(f"probe returned batch size {got}")
        return min(b, got)

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _free_failed(None)
        params = list(inspect.signature(function).parameters.keys())
        if len(params) < (len(args) + 1):  # Accelerate's guard: the caller passed the batch size
            arg_str = ", ".join([f"{arg}={value}" for arg, value in zip(params[1:], args[1:])])
            raise TypeError(f"Batch size was passed into `{function.__name__}` as the first argument when "
                            f"called.Remove this as the decorator already does so: "
                            f"`{function.__name__}({arg_str})`")
        if state["batch_size"] is None:
            state["batch_size"] = first_size()
        fails: List[Tuple[int, int]] = []
        live = torch.cuda.memory_allocated() if _cuda() else 0
        while True:
            fits = state["batch_size"]
            if fits == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            micro, accum = (fits, None) if target_batch is None else _plan(fits, target_batch)
            wrapper.batch_size, wrapper.accumulation_steps = micro, accum  # type: ignore[attr-defined]
            pred = None if not fails else int(live + max((n - live) / s for s, n in fails) * micro)
            if _cuda():
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            failed: Optional[BaseException] = None
            needed = 0
            try:
                extra = {} if accum is None else {"accumulation_steps": accum}
                out = function(micro, *args, **kwargs, **extra)
            except Exception as e:  # classified below; anything but OOM propagates
                oom = find_oom_error(e)
                if oom is None:
                    raise
                needed = (torch.cuda.max_memory_allocated() if _cuda() else 0) + requested_bytes(str(oom))
                failed, oom = e, None
            secs = time.perf_counter() - t0
            if failed is None:
                peak = torch.cuda.max_memory_allocated() if _cuda() else None
                tr = Trial(micro, "fits", peak, None, secs, "try", pred)
                tries.append(tr)
                emit("gpumem.find_executable_batch_size:   " + tr.line()
                     + ("" if accum is None else f"  (x {accum} accumulation steps)"))
                return out
            # Outside the except block: the failed try's frames can be cleared and freed.
            _free_failed(failed)
            failed = None
            tr = Trial(micro, "oom", needed or None, None, secs, "try", pred)
            tries.append(tr)
            if needed:
                fails.append((micro, needed))
            if reduce_batch_size_fn is not None:
                nxt = int(reduce_batch_size_fn())
            else:
                nxt = int(micro * 0.9)
                guess = _predict_next(fails, live, _limit(), micro)
                if guess is not None:
                    nxt = max(0, min(nxt, guess))
                if target_batch is not None:
                    nxt = min(nxt, fits - 1)
            emit("gpumem.find_executable_batch_size:   " + tr.line() + f"  -> next {nxt}"
                 + (f" ({_fmt(needed)} needed at least)" if needed else ""))
            state["batch_size"] = max(0, nxt)

    wrapper.batch_size = None  # type: ignore[attr-defined]
    wrapper.accumulation_steps = None  # type: ignore[attr-defined]
    wrapper.tries = tries  # type: ignore[attr-defined]
    return wrapper
