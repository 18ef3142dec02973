"""``gpumem.cleanup(*names)``: the steps in order, each measured, then the holder analysis.

Steps (see the package docstring): tracebacks (``frames``), output cache (``output_cache``), the
named variables (here), ``gc.collect``, ``empty_cache`` (here); then :func:`find_holders`
(``holders``).  Never raises, never deletes anything unnamed, never initialises CUDA.
"""
from __future__ import annotations

import gc
import sys
import time
from typing import Any, Callable, Iterable, List, Optional, Sequence

from .._optional import import_torch
from .._stats import allocated_reserved, cuda_state, tracked_devices
from .frames import release_tracebacks
from .heap import _holds, _make_pred, _Tracker
from .holders import find_holders
from .output_cache import _clear_output_cache, _get_shell
from .report import CleanupReport, Step

__all__ = ["cleanup"]


def cleanup(*names: str,
            namespace: Optional[dict] = None,
            tracebacks: bool = True,
            output_cache: bool = True,
            collect: bool = True,
            empty_cache: bool = True,
            analyze: bool = True,
            top: int = 10,
            include_cpu: bool = False,
            devices: Optional[Iterable[Any]] = None,
            _stacklevel: int = 1) -> CleanupReport:
    """Release GPU memory that a notebook or script no longer needs, and report what still holds it.

    ``names``: variables to delete (strings), looked up in ``namespace`` or else the caller's globals,
    then IPython's user namespace.  Nothing unnamed is ever deleted.
    ``tracebacks`` / ``output_cache`` / ``collect`` / ``empty_cache``: enable the individual steps.
    ``analyze``: find the largest live tensors and their holders (one scan of the gc heap).
    ``include_cpu``: also treat CPU tensors as tracked (output cache, holders, per-step bytes).
    ``devices``: restrict the tracked tensors to these devices.
    Returns a :class:`CleanupReport`; never raises (problems are listed in ``report.problems``).
    """
    report = CleanupReport(tracked="cuda+cpu" if include_cpu else "cuda")
    try:
        _cleanup(report, names, namespace, tracebacks, output_cache, collect, empty_cache, analyze, top,
                 include_cpu, devices, _stacklevel + 1)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # never raise: report instead
        report.problems.append(f"internal error: {type(e).__name__}: {e}")
    return report


def _cleanup(report, names, namespace, tracebacks, output_cache, collect, empty_cache, analyze, top,
             include_cpu, devices, stacklevel):
    caller_locals = None
    spaces: List[dict] = []
    try:
        frame = sys._getframe(stacklevel)
        if namespace is None:
            spaces.append(frame.f_globals)
            if frame.f_code.co_flags & 0x02 and frame.f_locals is not frame.f_globals:  # CO_NEWLOCALS
                caller_locals = frame.f_locals
        del frame
    except Exception:
        pass
    if namespace is not None:
        spaces.insert(0, namespace)
    shell = _get_shell()
    if shell is not None:
        uns = getattr(shell, "user_ns", None)
        if isinstance(uns, dict) and all(uns is not s for s in spaces):
            spaces.append(uns)

    pred = _make_pred(include_cpu, devices)
    report.cuda = cuda_state()
    devs = tracked_devices() if report.cuda == "ready" else []
    report.devices = devs
    if report.cuda == "none":
        report.notes.append("no CUDA device available: GPU steps skipped" +
                            ("; CPU tensors tracked" if include_cpu else ""))
    elif report.cuda == "uninitialized":
        report.notes.append("CUDA not initialised in this process: GPU steps skipped")
    if sys.exc_info()[1] is not None and tracebacks:
        report.notes.append("called inside an `except` block: the frames still running (this one and its "
                            "callers) keep their variables; the finished frames of the exception were "
                            "released")

    tracker = _Tracker(pred) if analyze or report.cuda != "ready" else None
    report.allocated_before, report.reserved_before = allocated_reserved(devs)
    last = [report.allocated_before, report.reserved_before]

    def run(step_name: str, fn: Callable[[], str]) -> None:
        t0 = time.perf_counter()
        step = Step(step_name)
        try:
            step.detail = fn() or ""
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            report.problems.append(f"{step_name}: {type(e).__name__}: {e}")
            step.detail = "failed (see problems)"
        a, r = allocated_reserved(devs)
        step.freed_allocated, step.freed_reserved = last[0] - a, last[1] - r
        last[0], last[1] = a, r
        if tracker is not None:
            step.freed_tensors = tracker.freed_now()
        step.seconds = time.perf_counter() - t0
        report.steps.append(step)

    if tracebacks:
        def do_tb():
            touched, text, c, s = release_tracebacks(shell, include_active=True)
            report.traceback_text = text
            report.cleared.extend(touched)
            if not c and not s:
                return "no traceback holding frames"
            msg = f"cleared locals of {c} finished frame(s)"
            if touched:
                msg += " via " + ", ".join(touched)
            if s:
                msg += f"; {s} running frame(s) kept"
            return msg
        run("tracebacks", do_tb)

    if output_cache:
        def do_out():
            if shell is None:
                return "not in IPython"
            dropped = _clear_output_cache(shell, lambda v: _holds(v, pred))
            report.cleared.extend(dropped)
            return ("dropped " + ", ".join(dropped)) if dropped else "nothing cached holds tensors"
        run("output cache", do_out)

    if names:
        run("names", lambda: _delete_names(names, spaces, shell, pred, report, caller_locals))

    if collect:
        run("gc.collect", lambda: f"{gc.collect()} unreachable objects collected")

    if empty_cache:
        run("empty_cache", lambda: _empty_cache(devs) if devs else "no CUDA memory in use")

    report.allocated_after, report.reserved_after = last[0], last[1]
    if tracker is not None:
        tracker.groups.clear()

    if analyze:
        try:
            holders, explained = find_holders(spaces, pred, top=top)
            report.holders = holders
            cuda_explained = sum(v for k, v in explained.items() if k.startswith("cuda"))
            report.explained_bytes = cuda_explained
            report.unexplained_bytes = max(report.allocated_after - cuda_explained, 0)
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            report.problems.append(f"analysis: {type(e).__name__}: {e}")


def _delete_names(names: Sequence[Any], spaces: List[dict], shell: Any, pred, report: CleanupReport,
                  caller_locals: Optional[dict]) -> str:
    for name in names:
        if not isinstance(name, str):
            report.problems.append(f"cleanup() takes variable *names* as strings, got "
                                   f"{type(name).__name__}; skipped (write cleanup('x'), not cleanup(x))")
            continue
        ns = next((s for s in spaces if name in s), None)
        if ns is None:
            if caller_locals is not None and name in caller_locals:
                report.problems.append(f"'{name}' is a local variable of the calling function; "
                                       f"cleanup() cannot delete it (use `del {name}` there)")
            report.missing.append(name)
            continue
        v = ns[name]
        held = _holds(v, pred)
        try:
            del ns[name]
        except Exception as e:
            report.problems.append(f"could not delete '{name}': {type(e).__name__}: {e}")
            continue
        report.deleted.append(name)
        if not held:
            report.not_tensors.append(name)
        # Out[N] / _N / _ entries that are this very object are references IPython made, not the user
        if shell is not None:
            _clear_output_cache(shell, _same_object(v))
        v = None
    parts = []
    if report.deleted:
        parts.append("deleted " + ", ".join(report.deleted))
    if report.missing:
        parts.append("not found " + ", ".join(report.missing))
    return "; ".join(parts)


def _same_object(target: Any) -> Callable[[Any], bool]:
    return lambda x: x is target


def _empty_cache(devs: List[int]) -> str:
    torch = import_torch()
    if torch is None or not devs:
        return ""
    for d in devs:
        with torch.cuda.device(d):
            torch.cuda.empty_cache()
    return "returned free pages to the device (" + ", ".join(f"cuda:{d}" for d in devs) + ")"

