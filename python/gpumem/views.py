"""Human-readable views of allocator state: ``summary()``, ``plot()`` and the stats accessor.

Everything here works with gpumem's pool *and* with PyTorch's native caching allocator:
figures come from ``gpumem.stats()`` when gpumem's pool is torch's allocator, otherwise from
``torch.cuda.memory_stats()``.  Nothing here initialises CUDA: a process that has not touched
the GPU yet is reported as such.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["get_stats", "allocated_reserved", "summary", "plot", "fmt_bytes", "cuda_state", "tracked_devices"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def fmt_bytes(n: Any, signed: bool = False) -> str:
    """Format a byte count in binary units: ``fmt_bytes(3 << 30) == '3.00 GiB'``."""
    try:
        n = int(n)
    except Exception:
        return str(n)
    sign = ""
    if n < 0:
        sign, n = "-", -n
    elif signed and n > 0:
        sign = "+"
    if n < 1024:
        return f"{sign}{n} B"
    v = float(n)
    for unit in _UNITS[1:]:
        v /= 1024.0
        if v < 1024.0 or unit == _UNITS[-1]:
            digits = 2 if v < 10 else (1 if v < 100 else 0)
            return f"{sign}{v:.{digits}f} {unit}"
    return f"{sign}{n} B"  # pragma: no cover


class Text(str):
    """A ``str`` that shows as plain text (not as a quoted repr) at the end of a notebook cell."""

    def __repr__(self) -> str:  # pragma: no cover - trivial
        return str(self)

    def _repr_pretty_(self, p, cycle):  # pragma: no cover - IPython only
        p.text(str(self))


def _torch():
    try:
        import torch  # noqa: F401
        return torch
    except Exception:
        return None


def _gpumem_pool_active() -> bool:
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
    torch = _torch()
    if torch is None:
        return "none"
    try:
        if not torch.cuda.is_available():
            return "none"
        if _gpumem_pool_active() or torch.cuda.is_initialized():
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
    if callable(st) and _gpumem_pool_active():
        try:
            return dict(st(device))
        except Exception:
            pass
    torch = _torch()
    if torch is None:
        return {}
    try:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return {}
        return dict(torch.cuda.memory_stats(device))
    except Exception:
        return {}


def allocated_reserved(devices: List[Any]) -> Tuple[int, int]:
    """Current allocated and reserved bytes, summed over ``devices``."""
    a = r = 0
    for d in devices:
        s = get_stats(d)
        a += int(s.get("allocated_bytes.all.current", 0))
        r += int(s.get("reserved_bytes.all.current", 0))
    return a, r


def tracked_devices() -> List[int]:
    """Indices of CUDA devices whose allocator may hold memory (never initialises CUDA)."""
    if cuda_state() != "ready":
        return []
    torch = _torch()
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


def _largest_free_native(device: int) -> Optional[int]:
    """Largest cached-but-free block of PyTorch's native allocator on ``device`` (from a snapshot)."""
    torch = _torch()
    try:
        snap = torch.cuda.memory_snapshot()
    except Exception:
        return None
    best = 0
    for seg in snap:
        if seg.get("device", device) != device:
            continue
        for blk in seg.get("blocks", ()):
            if blk.get("state") == "inactive":
                best = max(best, int(blk.get("size", 0)))
    return best


def _device_summary(i: int) -> List[str]:
    torch = _torch()
    s = get_stats(i)
    pool = "gpumem pool" if _gpumem_pool_active() else "PyTorch caching allocator"
    try:
        name = torch.cuda.get_device_name(i)
    except Exception:
        name = "?"
    alloc = int(s.get("allocated_bytes.all.current", 0))
    alloc_peak = int(s.get("allocated_bytes.all.peak", 0))
    res = int(s.get("reserved_bytes.all.current", 0))
    res_peak = int(s.get("reserved_bytes.all.peak", 0))
    free_cached = max(res - alloc, 0)
    if "gpumem.largest_free_bytes" in s:
        largest = int(s.get("gpumem.largest_free_bytes", 0))
    else:
        largest = _largest_free_native(i)
    lines = [f"GPU {i} ({name}) - {pool}"]
    lines.append(f"  allocated     {fmt_bytes(alloc):>11}   peak {fmt_bytes(alloc_peak)}")
    lines.append(f"  reserved      {fmt_bytes(res):>11}   peak {fmt_bytes(res_peak)}")
    frag = ""
    if largest is not None and free_cached > 0:
        frag = f"   fragmentation {100.0 * (1.0 - min(largest, free_cached) / free_cached):.1f}%"
    lines.append(f"  cached free   {fmt_bytes(free_cached):>11}{frag}")
    if largest is not None:
        lines.append(f"  largest free  {fmt_bytes(largest):>11}   (biggest block available without new device memory)")
    cap = s.get("gpumem.cap_bytes")
    if cap is not None:
        lines.append(f"  cap           {fmt_bytes(cap) if cap else 'none':>11}")
    ooms = s.get("num_ooms")
    if ooms:
        lines.append(f"  OOMs          {int(ooms):>11}")
    try:
        free, total = torch.cuda.mem_get_info(i)
        lines.append(f"  device        {fmt_bytes(total - free):>11} used of {fmt_bytes(total)} (all processes)")
    except Exception:
        pass
    return lines


def summary(device: Any = None) -> str:
    """A short human-readable memory summary (allocated, reserved, peaks, fragmentation,
    largest free block, cap) for ``device`` (index, ``torch.device`` or None = every device in use)."""
    state = cuda_state()
    if state == "none":
        if _torch() is None:
            return Text("gpumem: PyTorch is not importable, so there is no GPU memory to show.")
        return Text("gpumem: no CUDA device available (torch.cuda.is_available() is False); nothing on GPU.")
    if state == "uninitialized":
        return Text("gpumem: CUDA is available but not initialised yet; nothing allocated on any GPU.")
    torch = _torch()
    if device is None:
        devs = tracked_devices()
    else:
        try:
            devs = [torch.cuda._utils._get_device_index(device, optional=True)]
        except Exception:
            devs = [int(device)]
    lines: List[str] = []
    for i in devs:
        try:
            lines.extend(_device_summary(i))
        except Exception as e:  # never raise from a view
            lines.append(f"GPU {i}: could not read allocator stats ({type(e).__name__}: {e})")
    return Text("\n".join(lines) if lines else "gpumem: no GPU memory in use.")


def plot(timeline: Any = None, ax: Any = None, title: Optional[str] = None):
    """Matplotlib Figure of allocated and reserved memory over time.

    ``timeline``: a :class:`gpumem.timeline.Timeline` (default: the session timeline that the
    Jupyter extension fills per cell and that :func:`gpumem.timeline.record` can sample into).
    Does not need a display (uses ``matplotlib.figure.Figure`` directly, no pyplot).
    """
    from .timeline import default_timeline, plot_timeline

    tl = timeline if timeline is not None else default_timeline()
    if len(tl) == 0:
        try:
            tl.sample(label="now")
        except Exception:
            pass
    return plot_timeline(tl, ax=ax, title=title)
