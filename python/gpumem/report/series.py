"""The allocated / reserved timeline of one device's trace, downsampled, with its markers.

Allocated bytes move with ``alloc`` / ``free_completed``, reserved bytes with ``segment_alloc`` /
``segment_map`` and ``segment_free`` / ``segment_unmap``. A trace may have lost its oldest events
(memory history keeps the last N), so the curves are anchored at the end, on what the snapshot's
segments hold, and the level the trace starts from is worked back from there.

A trace of 10^6 events becomes at most ``points`` buckets of equal time, each keeping the lowest and
highest value it saw: peaks survive, and the page draws a few thousand points whatever the trace.
Markers: out-of-memory errors, ``empty_cache`` (cache released with ``empty_cache`` in the stack) and
other releases of several segments at once.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Any, Dict, List, Optional, Sequence

from .frames import frame_text, site_of
from .load import Event

__all__ = ["timeline"]

_GROW = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
MAX_MARKERS = 200


def _is_empty_cache(frames: Sequence[Dict[str, Any]]) -> bool:
    return any("empty_cache" in str(f.get("name", "")) for f in frames)


def timeline(trace: List[Event], final_allocated: int, final_reserved: int,
             points: int = 2000) -> Dict[str, Any]:
    """Downsampled series and markers of ``trace``; ``final_*``: what the snapshot holds at its end."""
    n = len(trace)
    A: List[int] = [0] * n
    R: List[int] = [0] * n
    a = r = 0
    min_a = min_r = 0
    markers: List[Dict[str, Any]] = []
    release_run: List[int] = []  # indices of the current run of segment releases

    def close_run(next_action: Optional[str]) -> None:
        if not release_run:
            return
        first = trace[release_run[0]]
        freed = sum(trace[i][2] for i in release_run)
        if any(_is_empty_cache(trace[i][4]) for i in release_run):
            kind = "empty_cache"
        elif len(release_run) >= 2 and next_action != "oom":  # an OOM's own retry is the OOM's marker
            kind = "release"
        else:
            release_run.clear()
            return
        markers.append({"i": release_run[0], "kind": kind, "bytes": freed, "site": site_of(first[4]),
                        "segments": len(release_run), "frames": [frame_text(f) for f in first[4][:6]]})
        release_run.clear()

    for i, (act, _addr, size, _t, frames, free) in enumerate(trace):
        if act == "alloc":
            a += size
            close_run(act)
        elif act == "free_completed":
            a -= size
            if a < min_a:
                min_a = a
        else:
            g = _GROW.get(act)
            if g == 1:
                r += size
                close_run(act)
            elif g == -1:
                r -= size
                if r < min_r:
                    min_r = r
                release_run.append(i)
            elif act == "oom":
                close_run(act)
                markers.append({"i": i, "kind": "oom", "bytes": size, "device_free": free,
                                "site": site_of(frames), "frames": [frame_text(f) for f in frames[:8]]})
        A[i] = a
        R[i] = r
    close_run(None)
    # The level before the first event: what the end holds minus the trace's net change, but never so
    # low that a curve dips below zero (a trace that began mid-run, or segments the snapshot omits).
    base_a = max(final_allocated - a, -min_a, 0)
    base_r = max(final_reserved - r, -min_r, 0)

    times = [e[3] for e in trace]
    xs: Sequence[float] = range(n)  # event numbers, unless every event has a time and they never go back
    if n > 1 and all(t is not None for t in times):
        ts = [float(t) for t in times]  # type: ignore[arg-type]
        if ts[-1] > ts[0] and all(ts[k] <= ts[k + 1] for k in range(n - 1)):
            xs = [t - ts[0] for t in ts]
    timed = not isinstance(xs, range)
    out: Dict[str, Any] = {"unit": "us" if timed else "event", "events": n,
                           "start_allocated": base_a, "start_reserved": base_r}
    if n == 0:
        out.update(x=[0], amin=[base_a], amax=[base_a], rmin=[base_r], rmax=[base_r], markers=[],
                   peak_allocated=base_a, peak_reserved=base_r, peak_x=0)
        return out
    span = float(xs[-1]) or 1.0
    buckets = max(1, min(points, n))
    xb, amin, amax, rmin, rmax = [], [], [], [], []
    lo = 0
    for k in range(buckets):
        edge = span * (k + 1) / buckets
        hi = n if k == buckets - 1 else bisect_left(xs, edge, lo)
        if hi <= lo:
            continue
        xb.append(float(xs[lo]))
        amin.append(min(A[lo:hi]) + base_a)
        amax.append(max(A[lo:hi]) + base_a)
        rmin.append(min(R[lo:hi]) + base_r)
        rmax.append(max(R[lo:hi]) + base_r)
        lo = hi
    xb.append(float(xs[-1]))  # the end, so the last bucket is drawn to the right edge
    for arr, v in ((amin, A[-1] + base_a), (amax, A[-1] + base_a),
                   (rmin, R[-1] + base_r), (rmax, R[-1] + base_r)):
        arr.append(v)
    peak_i = max(range(n), key=A.__getitem__)
    left = len(markers) - MAX_MARKERS
    shown = sorted(markers, key=lambda m: m["kind"] != "oom")[:MAX_MARKERS]  # OOMs first
    for m in shown:
        m["x"] = float(xs[m["i"]])
        m["allocated"] = A[m["i"]] + base_a
        m["reserved"] = R[m["i"]] + base_r
    out.update(x=xb, amin=amin, amax=amax, rmin=rmin, rmax=rmax, markers=sorted(shown, key=lambda m: m["i"]),
               markers_left_out=max(left, 0), peak_allocated=A[peak_i] + base_a,
               peak_reserved=max(R) + base_r, peak_x=float(xs[peak_i]),
               ooms=sum(1 for m in markers if m["kind"] == "oom"),
               empty_caches=sum(1 for m in markers if m["kind"] == "empty_cache"))
    return out
