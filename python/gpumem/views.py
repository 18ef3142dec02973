"""Human-readable views of allocator state: ``summary()`` and ``plot()``.

Everything here works with gpumem's pool *and* with PyTorch's native caching allocator: figures come
from ``gpumem.stats()`` when gpumem's pool is torch's allocator, otherwise from
``torch.cuda.memory_stats()`` (the readers live in ``gpumem._stats``, the timeline and its drawing in
``gpumem.timeline``).  Nothing here initialises CUDA: a process that has not touched the GPU yet is
reported as such.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from ._format import fmt_bytes
from ._optional import import_torch
from ._stats import LIBRARIES, allocated_reserved, cuda_state, get_stats, pool_active, tracked_devices
from .timeline import default_timeline, plot_timeline

# get_stats, allocated_reserved, cuda_state, tracked_devices and fmt_bytes are re-exported: they
# were first defined here, and callers import them from here.
__all__ = ["get_stats", "allocated_reserved", "summary", "plot", "fmt_bytes", "cuda_state", "tracked_devices"]


class Text(str):
    """A ``str`` that shows as plain text (not as a quoted repr) at the end of a notebook cell."""

    def __repr__(self) -> str:  # pragma: no cover - trivial
        return str(self)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # pragma: no cover - IPython only
        p.text(str(self))


def _largest_free_native(torch: Any, device: int) -> Optional[int]:
    """Largest cached-but-free block of PyTorch's native allocator on ``device`` (from a snapshot)."""
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


def _library_lines(s: Dict[str, Any]) -> List[str]:
    """The live bytes of each library drawing from gpumem's pool (torch, CuPy, Numba, RMM), beside
    the totals above; only libraries that allocated something. Nothing for PyTorch's allocator."""
    lines = []
    for name in LIBRARIES:
        cur = s.get(f"gpumem.library.{name}.current")
        peak = int(s.get(f"gpumem.library.{name}.peak", 0) or 0)
        if cur is None or (not cur and not peak):
            continue
        blocks = int(s.get(f"gpumem.library.{name}.allocations", 0) or 0)
        lines.append(f"    {name:<11} {fmt_bytes(int(cur)):>11}   peak {fmt_bytes(peak)}   "
                     f"({blocks} block{'s' if blocks != 1 else ''})")
    if lines:
        lines.insert(0, "  by library    (live bytes drawn from the pool)")
    return lines


def _device_summary(torch: Any, i: int) -> List[str]:
    s = get_stats(i)
    pool = "gpumem pool" if pool_active() else "PyTorch caching allocator"
    try:
        name = torch.cuda.get_device_name(i)
    except Exception:
        name = "?"
    alloc = int(s.get("allocated_bytes.all.current", 0))
    alloc_peak = int(s.get("allocated_bytes.all.peak", 0))
    res = int(s.get("reserved_bytes.all.current", 0))
    res_peak = int(s.get("reserved_bytes.all.peak", 0))
    free_cached = max(res - alloc, 0)
    largest: Optional[int]
    if "gpumem.largest_free_bytes" in s:
        largest = int(s.get("gpumem.largest_free_bytes", 0))
    else:
        largest = _largest_free_native(torch, i)
    lines = [f"GPU {i} ({name}) - {pool}"]
    lines.append(f"  allocated     {fmt_bytes(alloc):>11}   peak {fmt_bytes(alloc_peak)}")
    lines.append(f"  reserved      {fmt_bytes(res):>11}   peak {fmt_bytes(res_peak)}")
    frag = ""
    if largest is not None and free_cached > 0:
        frag = f"   fragmentation {100.0 * (1.0 - min(largest, free_cached) / free_cached):.1f}%"
    lines.append(f"  cached free   {fmt_bytes(free_cached):>11}{frag}")
    if largest is not None:
        lines.append(f"  largest free  {fmt_bytes(largest):>11}   "
                     f"(biggest block available without new device memory)")
    lines.extend(_library_lines(s))
    cap = s.get("gpumem.cap_bytes")
    if cap is not None:
        lines.append(f"  cap           {fmt_bytes(cap) if cap else 'none':>11}")
    ooms = s.get("num_ooms")
    if ooms:
        lines.append(f"  OOMs          {int(ooms):>11}")
    try:
        free, total = torch.cuda.mem_get_info(i)
        lines.append(f"  device        {fmt_bytes(total - free):>11} used of {fmt_bytes(total)} "
                     f"(all processes)")
    except Exception:
        pass
    return lines


def summary(device: Any = None) -> str:
    """A short human-readable memory summary (allocated, reserved, peaks, fragmentation,
    largest free block, live bytes per library drawing from gpumem's pool, cap) for ``device``
    (index, ``torch.device`` or None = every device in use)."""
    torch = import_torch()
    if torch is None:
        return Text("gpumem: PyTorch is not importable, so there is no GPU memory to show.")
    state = cuda_state()
    if state == "none":
        return Text("gpumem: no CUDA device available (torch.cuda.is_available() is False); nothing on GPU.")
    if state == "uninitialized":
        return Text("gpumem: CUDA is available but not initialised yet; nothing allocated on any GPU.")
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
            lines.extend(_device_summary(torch, i))
        except Exception as e:  # never raise from a view
            lines.append(f"GPU {i}: could not read allocator stats ({type(e).__name__}: {e})")
    return Text("\n".join(lines) if lines else "gpumem: no GPU memory in use.")


def plot(timeline: Any = None, ax: Any = None, title: Optional[str] = None):
    """Matplotlib Figure of allocated and reserved memory over time.

    ``timeline``: a :class:`gpumem.timeline.Timeline` (default: the session timeline that the
    Jupyter extension fills per cell and that :func:`gpumem.timeline.record` can sample into).
    Does not need a display (uses ``matplotlib.figure.Figure`` directly, no pyplot).
    """
    tl = timeline if timeline is not None else default_timeline()
    if len(tl) == 0:
        try:
            tl.sample(label="now")
        except Exception:
            pass
    return plot_timeline(tl, ax=ax, title=title)
