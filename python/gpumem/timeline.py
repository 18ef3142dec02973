"""A light recorder of allocated / reserved memory over time.

    from gpumem.timeline import record
    with record(interval=0.05) as tl:   # background thread samples every 50 ms
        train_one_epoch()
    gpumem.plot(tl)

The Jupyter extension adds one sample before and after every cell to :func:`default_timeline`.
This module owns the recording and the drawing of a timeline (:func:`plot_timeline`; ``gpumem.plot``
draws the session's); the allocator figures come from ``gpumem._stats``.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ._format import UNIT_BYTES, unit_for
from ._stats import get_stats, library_bytes, tracked_devices

__all__ = ["Sample", "Timeline", "record", "default_timeline", "plot_timeline"]


@dataclass
class Sample:
    t: float  # time.monotonic() seconds
    allocated: int
    reserved: int
    label: Optional[str] = None
    # Live bytes per library drawing from gpumem's pool ({"torch": ..., "cupy": ...}); None when the
    # sampler does not report them (PyTorch's allocator, custom samplers).
    libraries: Optional[Dict[str, int]] = None


# (allocated, reserved) or (allocated, reserved, {library: live bytes} or None)
Sampled = Tuple[Any, ...]


def _default_sampler(device: Any) -> Callable[[], Sampled]:
    def sample() -> Sampled:
        devices = tracked_devices() if device is None else [device]
        stats = [get_stats(d) for d in devices]
        a = sum(int(s.get("allocated_bytes.all.current", 0)) for s in stats)
        r = sum(int(s.get("reserved_bytes.all.current", 0)) for s in stats)
        return a, r, (library_bytes(devices, stats) or None)

    return sample


class Timeline:
    """Samples of (time, allocated, reserved, label, live bytes per library).

    ``sampler``: a callable returning ``(allocated, reserved)`` or ``(allocated, reserved,
    {library: live bytes})``; default reads the allocator stats of ``device`` (None: the sum over
    every device in use), with each library's live bytes when gpumem's pool serves them.  Holds at
    most ``maxlen`` samples.
    """

    def __init__(self, device: Any = None, interval: float = 0.05, maxlen: int = 100_000,
                 sampler: Optional[Callable[[], Sampled]] = None):
        self.device = device
        self.interval = float(interval)
        self.samples: collections.deque[Sample] = collections.deque(maxlen=maxlen)
        self._sampler = sampler or _default_sampler(device)
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    # -- adding samples -------------------------------------------------------------------
    def add(self, allocated: int, reserved: int, t: Optional[float] = None,
            label: Optional[str] = None, libraries: Optional[Dict[str, int]] = None) -> Sample:
        libs = {k: int(v) for k, v in libraries.items()} if libraries else None
        s = Sample(time.monotonic() if t is None else float(t), int(allocated), int(reserved), label, libs)
        with self._lock:
            self.samples.append(s)
        return s

    def sample(self, label: Optional[str] = None) -> Sample:
        got = self._sampler()
        libraries = got[2] if len(got) > 2 else None
        return self.add(got[0], got[1], label=label, libraries=libraries)

    mark = sample

    def clear(self) -> None:
        with self._lock:
            self.samples.clear()

    def __len__(self) -> int:
        return len(self.samples)

    def snapshot(self) -> List[Sample]:
        with self._lock:
            return list(self.samples)

    # -- background sampling ---------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, interval: Optional[float] = None) -> Timeline:
        if interval is not None:
            self.interval = float(interval)
        if self.running:
            return self
        self._stop.clear()

        def loop():
            while not self._stop.is_set():
                try:
                    self.sample()
                except Exception:
                    pass
                self._stop.wait(self.interval)

        self._thread = threading.Thread(target=loop, name="gpumem-timeline", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Timeline:
        self._stop.set()
        th, self._thread = self._thread, None
        if th is not None:
            th.join(timeout=max(1.0, 2 * self.interval))
        return self

    def __enter__(self) -> Timeline:
        try:
            self.sample(label="start")
        except Exception:
            pass
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        try:
            self.sample(label="end")
        except Exception:
            pass

    # -- output ---------------------------------------------------------------------------
    def peak(self) -> Tuple[int, int]:
        snap = self.snapshot()
        if not snap:
            return 0, 0
        return max(s.allocated for s in snap), max(s.reserved for s in snap)

    def to_dict(self) -> dict:
        snap = self.snapshot()
        return {
            "t": [s.t for s in snap],
            "allocated": [s.allocated for s in snap],
            "reserved": [s.reserved for s in snap],
            "label": [s.label for s in snap],
            "libraries": [s.libraries for s in snap],
        }

    def plot(self, ax: Any = None, title: Optional[str] = None):
        return plot_timeline(self, ax=ax, title=title)

    def __repr__(self) -> str:
        return f"<gpumem Timeline: {len(self)} samples{' (recording)' if self.running else ''}>"


_DEFAULT: Optional[Timeline] = None


def default_timeline() -> Timeline:
    """The session-wide timeline (filled per cell by the Jupyter extension)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Timeline()
    return _DEFAULT


@contextlib.contextmanager
def record(interval: float = 0.05, device: Any = None,
           timeline: Optional[Timeline] = None) -> Iterator[Timeline]:
    """Sample allocated/reserved every ``interval`` seconds in a background thread while the block runs."""
    tl = timeline if timeline is not None else Timeline(device=device, interval=interval)
    tl.interval = float(interval)
    with tl:
        yield tl


def plot_timeline(tl: Timeline, ax: Any = None, title: Optional[str] = None):
    """Draw ``tl`` (allocated and reserved vs seconds) and return the matplotlib Figure."""
    from matplotlib.figure import Figure

    snap = tl.snapshot()
    if ax is None:
        fig = Figure(figsize=(8, 3.6), layout="constrained")
        ax = fig.add_subplot(1, 1, 1)
    else:
        fig = ax.figure
    peak = max([max(s.allocated, s.reserved) for s in snap] + [1])
    unit = unit_for(peak, largest="GiB")
    scale = UNIT_BYTES[unit]
    if snap:
        t0 = snap[0].t
        xs = [s.t - t0 for s in snap]
        al = [s.allocated / scale for s in snap]
        rs = [s.reserved / scale for s in snap]
        ax.step(xs, rs, where="post", label="reserved", color="tab:orange")
        ax.fill_between(xs, al, step="post", alpha=0.35, color="tab:blue")
        ax.step(xs, al, where="post", label="allocated", color="tab:blue")
        i_pk = max(range(len(al)), key=al.__getitem__)
        ax.annotate(f"peak {al[i_pk]:.2f} {unit}", (xs[i_pk], al[i_pk]), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
        # Each library drawing from the pool, beside the totals, once any but torch allocated.
        names = sorted({n for s in snap if s.libraries for n in s.libraries})
        if any(n != "torch" and any(s.libraries and s.libraries.get(n) for s in snap) for n in names):
            for n in names:
                ys = [(s.libraries or {}).get(n, 0) / scale for s in snap]
                ax.step(xs, ys, where="post", label=n, lw=1.0, ls="--")
        labelled = [(x, s.label) for x, s in zip(xs, snap) if s.label]
        if len(labelled) <= 40:
            for x, lab in labelled:
                ax.axvline(x, color="grey", lw=0.5, alpha=0.4)
                ax.annotate(lab, (x, 0), xycoords=("data", "axes fraction"), xytext=(2, 2),
                            textcoords="offset points", fontsize=7, color="grey", rotation=90)
    else:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("seconds")
    ax.set_ylabel(unit)
    ax.set_ylim(bottom=0)
    ax.set_title(title or "GPU memory: allocated and reserved")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    return fig
