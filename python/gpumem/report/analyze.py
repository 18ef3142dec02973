"""From a :class:`Snapshot` to the figures the page shows: one JSON-able dict, capped in size.

One device per report (the one holding the most memory unless told). Live blocks give the largest
allocations with their stacks and the code sites that hold the most; segments give the page map, its
free holes and the fragmentation figure; the trace gives the timeline (``series``); the diagnosis
(``diagnose``) reads all of it. Everything is cut to what a page shows (the largest 50 allocations,
150 segments, 1000 cells per segment), so the page stays small whatever the snapshot.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from .diagnose import diagnosis
from .frames import page_frames, site_of
from .load import Snapshot
from .series import timeline

__all__ = ["analyze"]

TOP_ALLOCATIONS = 50
TOP_SITES = 30
MAX_SEGMENTS = 150
CELLS = 1000  # a segment with more blocks is drawn as this many cells, each the state holding most bytes
STATE_CODE = {"active_allocated": 1, "active_pending_free": 2, "inactive": 0}

def _cells(seg: Dict[str, Any]) -> List[List[int]]:
    """The segment's blocks as [offset, size, state code]; too many blocks become CELLS cells."""
    base, blocks = seg["address"], seg["blocks"]
    if len(blocks) <= CELLS:
        return [[b["address"] - base, b["size"], STATE_CODE[b["state"]]] for b in blocks]
    total = max(seg["total_size"], 1)
    cell = total / CELLS
    acc = [[0, 0, 0] for _ in range(CELLS)]  # bytes per state code in each cell
    for b in blocks:
        start, end, code = b["address"] - base, b["address"] - base + b["size"], STATE_CODE[b["state"]]
        c = min(int(start / cell), CELLS - 1)
        while start < end and c < CELLS:
            edge = min(end, (c + 1) * cell)
            acc[c][code] += int(edge - start)
            start, c = edge, c + 1
    return [[int(i * cell), int(cell), max(range(3), key=v.__getitem__)] for i, v in enumerate(acc)]


def _pick_device(snap: Snapshot, device: Optional[int]) -> int:
    devices = snap.devices()
    if device is not None:
        if devices and device not in devices:
            raise ValueError(f"{snap.source}: device {device} has no segments and no trace "
                             f"(devices in the snapshot: {', '.join(map(str, devices))})")
        return device
    if not devices:
        return 0
    held = {d: sum(s["total_size"] for s in snap.segments if s["device"] == d) for d in devices}
    return max(devices, key=lambda d: (held[d], len(snap.traces.get(d, ()))))


def _holes(segments: List[Dict[str, Any]]) -> Tuple[int, int, int]:
    """(bytes free inside segments, the largest free block, how many free blocks)."""
    sizes = [b["size"] for s in segments for b in s["blocks"] if b["state"] == "inactive"]
    return sum(sizes), max(sizes, default=0), len(sizes)


def analyze(snap: Snapshot, device: Optional[int] = None, points: int = 2000) -> Dict[str, Any]:
    """Everything the page shows, for ``device`` (default: the one holding the most)."""
    dev = _pick_device(snap, device)
    segs = sorted((s for s in snap.segments if s["device"] == dev), key=lambda s: s["address"])
    live = [(b, s) for s in segs for b in s["blocks"] if b["state"] != "inactive"]
    allocated = sum(b["size"] for b, _ in live)
    reserved = sum(int(s.get("reserved_size", s["total_size"])) for s in segs)
    free, largest, n_holes = _holes(segs)
    series = timeline(snap.traces.get(dev, []), allocated, reserved, points)

    top = sorted(live, key=lambda bs: -bs[0]["size"])[:TOP_ALLOCATIONS]
    allocations = [{"size": b["size"], "requested": b["requested_size"], "address": hex(b["address"]),
                    "state": b["state"], "segment": s["segment_type"], "site": site_of(b["frames"]),
                    "frames": page_frames(b["frames"])} for b, s in top]
    by_site: Dict[str, List[int]] = {}
    for b, _ in live:
        e = by_site.setdefault(site_of(b["frames"]), [0, 0])
        e[0] += b["size"]
        e[1] += 1
    sites = [{"site": k, "bytes": v[0], "count": v[1]}
             for k, v in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:TOP_SITES]]

    shown = sorted(segs, key=lambda s: -s["total_size"])[:MAX_SEGMENTS]
    shown.sort(key=lambda s: s["address"])
    segments = [{"address": hex(s["address"]), "size": s["total_size"], "type": s["segment_type"],
                 "expandable": s["is_expandable"], "stream": s["stream"],
                 "allocated": sum(b["size"] for b in s["blocks"] if b["state"] != "inactive"),
                 "blocks": len(s["blocks"]), "cells": _cells(s)} for s in shown]
    others = [d for d in snap.devices() if d != dev]
    out: Dict[str, Any] = {
        "source": snap.source, "kind": snap.kind, "settings": snap.settings, "device": dev,
        "other_devices": [{"device": d, "reserved": sum(s["total_size"] for s in snap.segments
                                                        if s["device"] == d)} for d in others],
        "totals": {"allocated": allocated, "reserved": reserved, "live_blocks": len(live),
                   "segments": len(segs), "free_in_segments": free, "largest_free": largest,
                   "free_blocks": n_holes,
                   "fragmentation": (1.0 - largest / free) if free else 0.0,
                   "reserved_over_allocated": (reserved / allocated) if allocated else None,
                   "stacks_recorded": any(b["frames"] for b, _ in live)},
        "timeline": series, "allocations": allocations, "sites": sites, "segments": segments,
        "segments_left_out": len(segs) - len(shown), "holders": snap.holders, "notes": list(snap.notes),
    }
    out["diagnosis"] = diagnosis(out)
    return out
