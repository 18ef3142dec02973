"""Releasing what an error's traceback pins, and keeping its text.

After an exception the traceback keeps every frame's local variables alive (``sys.last_value`` /
``sys.last_traceback`` / ``sys.last_exc``, IPython's traceback holder, the exception being handled in
an ``except`` block, and every chained ``__cause__`` / ``__context__``).  :func:`release_tracebacks`
clears the locals of the *finished* frames, like ``traceback.clear_frames()``; the traceback objects
stay, so the error can still be printed.
"""
from __future__ import annotations

import sys
import traceback
import types
from typing import Any, List, Optional, Sequence, Set, Tuple

from .._errors import exception_chain

__all__ = ["release_tracebacks", "pinned_tracebacks"]


def _clear_tb(tb: Optional[types.TracebackType], seen_frames: set) -> Tuple[int, int]:
    """Clear the locals of every finished frame of ``tb``; returns (cleared, skipped_executing)."""
    cleared = skipped = 0
    while tb is not None:
        f = tb.tb_frame
        if id(f) not in seen_frames:
            seen_frames.add(id(f))
            loc = None
            try:
                # function frames (3.11/3.12) keep a snapshot dict of their locals that clear() leaves
                if f.f_code.co_flags & 0x01 and f.f_locals is not f.f_globals:  # CO_OPTIMIZED
                    loc = f.f_locals
            except Exception:
                loc = None
            try:
                f.clear()
                cleared += 1
                if isinstance(loc, dict):
                    loc.clear()
            except RuntimeError:  # still executing (e.g. the caller, when called in `except`)
                skipped += 1
            except Exception:
                skipped += 1
        tb = tb.tb_next
    return cleared, skipped


def pinned_tracebacks(shell: Any = None, include_active: bool = True, extra: Sequence[BaseException] = ()
                      ) -> Tuple[List[Tuple[str, types.TracebackType]], str]:
    """Every traceback that pins frames (named by where it was found), and the last error's text."""
    sources: List[Tuple[str, Any]] = []
    for attr in ("last_exc", "last_value"):
        v = getattr(sys, attr, None)
        if isinstance(v, BaseException):
            sources.append((f"sys.{attr}", v))
    ltb = getattr(sys, "last_traceback", None)
    if include_active:
        act = sys.exc_info()[1]
        if act is not None:
            sources.append(("active exception (except block)", act))
    if shell is not None:
        itb = getattr(shell, "InteractiveTB", None)
        if itb is not None and getattr(itb, "tb", None) is not None:
            sources.append(("IPython InteractiveTB.tb", itb.tb))
        ler = getattr(shell, "last_execution_result", None)
        for attr in ("error_in_exec", "error_before_exec"):
            v = getattr(ler, attr, None) if ler is not None else None
            if isinstance(v, BaseException):
                sources.append((f"IPython last_execution_result.{attr}", v))
    for e in extra:
        sources.append(("exception", e))

    text = ""
    lv = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if isinstance(lv, BaseException):
        try:
            text = "".join(traceback.format_exception(type(lv), lv, lv.__traceback__ or ltb))
        except Exception:
            text = f"{type(lv).__name__}: {lv}"

    seen: Set[int] = set()
    tbs: List[Tuple[str, types.TracebackType]] = []
    if isinstance(ltb, types.TracebackType):
        tbs.append(("sys.last_traceback", ltb))
    for name, v in sources:
        if isinstance(v, types.TracebackType):
            tbs.append((name, v))
            continue
        for e in exception_chain(v, seen):
            if e.__traceback__ is not None:
                tbs.append((name, e.__traceback__))
    return tbs, text


def release_tracebacks(shell: Any = None, include_active: bool = True,
                       extra: Sequence[BaseException] = ()) -> Tuple[List[str], str, int, int]:
    """Release what the last error's traceback pins; keep the traceback text.

    Returns ``(holders_touched, traceback_text, frames_cleared, frames_skipped)``.
    """
    tbs, text = pinned_tracebacks(shell, include_active, extra)
    frames_seen: set = set()
    touched: List[str] = []
    total_c = total_s = 0
    for name, tb in tbs:
        c, s = _clear_tb(tb, frames_seen)
        total_c += c
        total_s += s
        if c and name not in touched:
            touched.append(name)
    return touched, text, total_c, total_s
