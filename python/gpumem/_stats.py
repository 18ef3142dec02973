"""What the CUDA allocator holds, read without ever initialising CUDA.

The shared readers of the views, the timeline, cleanup and the notebook extension.  Figures come from
``gpumem.stats()`` when gpumem's pool is torch's allocator, otherwise from
``torch.cuda.memory_stats()``; a process that has not touched the GPU yet reads as empty.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Sequence, Tuple

from ._optional import import_torch

__all__ = ["pool_active", "cuda_state", "get_stats", "memory_totals", "allocated_reserved", "tracked_devices",
           "LIBRARIES", "library_bytes"]

#: The libraries whose live bytes gpumem's pool counts apart (``gpumem.library.<name>.*`` keys).
LIBRARIES = ("torch", "cupy", "numba", "rmm")


def pool_active() -> bool:
    """gpumem's pool is torch's allocator (asked through the ``gpumem`` module, so tests can fake it)."""
    mod = sys.modules.get("gpumem")
    fn = getattr(mod, "is_active", None) if mod is not None else None
    if not callable(fn):
        return False
    try:
        return bool(fn())
    except Exception:
        return False


def cuda_state() -> str:
    """'none' (no usable CUDA), 'uninitialized' (CUDA present, not touched yet) or 'ready'."""
    torch = import_torch()
    if torch is None:
        return "none"
    try:
        if not torch.cuda.is_available():
            return "none"
        if pool_active() or torch.cuda.is_initialized():
            return "ready"
        return "uninitialized"
    except Exception:
        return "none"


def get_stats(device: Any = None) -> Dict[str, Any]:
    """Flat allocator statistics for ``device`` (``torch.cuda.memory_stats`` keys).

    Uses ``gpumem.stats(device)`` when gpumem's pool is the active allocator, else
    ``torch.cuda.memory_stats(device)``.  Returns ``{}`` without CUDA or before CUDA is initialised
    (never initialises CUDA itself).
    """
    mod = sys.modules.get("gpumem")
    st = getattr(mod, "stats", None) if mod is not None else None
    if callable(st) and pool_active():
        try:
            return dict(st(device))
        except Exception:
            pass
    torch = import_torch()
    if torch is None:
        return {}
    try:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return {}
        return dict(torch.cuda.memory_stats(device))
    except Exception:
        return {}


def memory_totals(devices: Sequence[Any]) -> Tuple[int, int, int]:
    """Current allocated, current reserved and peak allocated bytes, summed over ``devices``."""
    a = r = p = 0
    for d in devices:
        s = get_stats(d)
        a += int(s.get("allocated_bytes.all.current", 0))
        r += int(s.get("reserved_bytes.all.current", 0))
        p += int(s.get("allocated_bytes.all.peak", 0))
    return a, r, p


def library_bytes(devices: Sequence[Any], stats: Sequence[Dict[str, Any]] = ()) -> Dict[str, int]:
    """Live bytes per library (``LIBRARIES``), summed over ``devices``; ``{}`` when the allocator
    does not count them (PyTorch's own allocator, or a bridge without per-library figures).
    ``stats``: the devices' ``get_stats`` results when the caller already has them."""
    per_device = list(stats) if stats else [get_stats(d) for d in devices]
    out: Dict[str, int] = {}
    for s in per_device:
        for name in LIBRARIES:
            key = f"gpumem.library.{name}.current"
            if key in s:
                out[name] = out.get(name, 0) + int(s[key])
    return out


def allocated_reserved(devices: Sequence[Any]) -> Tuple[int, int]:
    """Current allocated and reserved bytes, summed over ``devices``."""
    a, r, _ = memory_totals(devices)
    return a, r


def tracked_devices() -> List[int]:
    """Indices of CUDA devices whose allocator may hold memory (never initialises CUDA)."""
    torch = import_torch()
    if torch is None or cuda_state() != "ready":
        return []
    try:
        n = torch.cuda.device_count()
    except Exception:
        return []
    out = []
    try:
        cur = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    except Exception:
        cur = 0
    for i in range(n):
        s = get_stats(i)
        if i == cur or s.get("reserved_bytes.all.current", 0) or s.get("allocated_bytes.all.current", 0):
            out.append(i)
    return out
