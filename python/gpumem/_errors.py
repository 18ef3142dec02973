"""Out-of-memory errors: which exceptions mean "the GPU ran out of memory", decided in one place.

Which error is raised where:

* ``gpumem.OutOfMemoryError`` (the core's ``_C.OutOfMemoryError``, a ``MemoryError``): direct use of
  :class:`gpumem.Pool` (a simulated device, or pools you build on a CUDA upstream).
* ``torch.cuda.OutOfMemoryError``: every allocation through torch, with gpumem as torch's allocator
  (its message starts with ``CUDA out of memory.`` as PyTorch's does) or with torch's own.
* ``RuntimeError`` with a message: libraries that allocate on their own (cuBLAS / cuDNN handles and
  workspaces, raw CUDA calls).

:func:`is_oom_error` recognises all of them, and an error raised from or while handling one
(``__cause__`` / ``__context__``), so an OOM that a framework re-raises as another error still counts.
It never imports torch: without torch imported no torch error can exist.
"""
from __future__ import annotations

import re
import sys
from typing import Any, List, Optional, Set, Tuple, Type

from ._C import OutOfMemoryError as _CoreOutOfMemoryError
from ._format import UNIT_BYTES

__all__ = ["is_oom_error", "find_oom_error", "exception_chain", "requested_bytes"]

# Messages of GPU allocation failures that do not arrive as an out-of-memory exception type.
_OOM_MESSAGES = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cudaErrorMemoryAllocation",
    "HIP out of memory",
)


def _oom_types() -> Tuple[Type[BaseException], ...]:
    types: List[Type[BaseException]] = [_CoreOutOfMemoryError]
    torch = sys.modules.get("torch")
    t = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None) if torch is not None else None
    if isinstance(t, type) and issubclass(t, BaseException):
        types.append(t)
    return tuple(types)


def _is_oom_one(e: BaseException, types: Tuple[Type[BaseException], ...]) -> bool:
    if isinstance(e, types):
        return True
    if not isinstance(e, (RuntimeError, MemoryError)):  # other types: the text alone proves nothing
        return False
    msg = str(e)
    if any(m in msg for m in _OOM_MESSAGES):
        return True
    return "out of memory" in msg and ("CUDA" in msg or "cuda" in msg or "GPU" in msg)


def exception_chain(exc: Optional[BaseException], seen: Optional[Set[int]] = None) -> List[BaseException]:
    """``exc`` and every exception it was raised from or while handling (``__cause__``,
    ``__context__``) and the members of exception groups, each once (``seen``: ids to skip, updated)."""
    seen = set() if seen is None else seen
    out: List[BaseException] = []
    stack: List[Any] = [exc]
    while stack:
        x = stack.pop()
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        out.append(x)
        stack.append(x.__cause__)
        stack.append(x.__context__)
        try:
            stack.extend(getattr(x, "exceptions", ()) or ())  # ExceptionGroup
        except TypeError:  # an unrelated attribute of that name
            pass
    return out


def find_oom_error(exc: Optional[BaseException]) -> Optional[BaseException]:
    """The out-of-memory error that ``exc`` is or was raised from (see :func:`is_oom_error`), or None."""
    types = _oom_types()
    return next((e for e in exception_chain(exc) if _is_oom_one(e, types)), None)


def is_oom_error(exc: Optional[BaseException]) -> bool:
    """Is ``exc`` a GPU out-of-memory error, or an error raised from or while handling one?

    True for ``torch.cuda.OutOfMemoryError``, ``gpumem.OutOfMemoryError``, and a ``RuntimeError`` or
    ``MemoryError`` whose message says a GPU allocation failed (``CUDA out of memory``,
    ``CUDA error: out of memory``, ``CUBLAS_STATUS_ALLOC_FAILED``, ``CUDNN_STATUS_ALLOC_FAILED``,
    ``cudaErrorMemoryAllocation``, ``HIP out of memory``, or "out of memory" naming CUDA or the GPU);
    the same for any exception in its ``__cause__`` / ``__context__`` chain (and the members of an
    exception group).  False for ``None``, a
    plain ``MemoryError`` (host memory) and other types whatever their message.

    Example::

        try:
            loss = step(batch)
        except Exception as e:
            if not gpumem.is_oom_error(e):
                raise
            gpumem.cleanup()
    """
    return find_oom_error(exc) is not None


# torch writes binary units, as KiB or (older messages) as KB
_UNITS = {**UNIT_BYTES, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40, "bytes": 1}


def requested_bytes(msg: str) -> int:
    """The size of the allocation that failed, from an OOM message ("Tried to allocate 2.50 GiB"), or 0."""
    m = re.search(r"Tried to allocate ([0-9.]+) ?([KMGT]i?B|B|bytes)", msg)
    if not m:
        return 0
    return int(float(m.group(1)) * _UNITS.get(m.group(2), 1))
