"""Reading snapshots: PyTorch's ``_dump_snapshot`` pickles and gpumem's JSON, into one shape.

Both become a :class:`Snapshot`: segments (each with its blocks, as PyTorch's snapshot lists them)
and, per device, the trace as tuples ``(action, addr, size, time_us, frames, device_free)``. What is
malformed raises ``ValueError`` naming the file and the place (``segments[3].blocks[7]: no 'size'``).

Pickles are read with an unpickler that builds only plain data (dicts, lists, numbers, strings):
PyTorch's snapshots hold nothing else, and refusing any class means opening a file cannot run code.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from .record import FORMAT

__all__ = ["Snapshot", "Event", "load_snapshot", "from_torch", "from_gpumem"]

# (action, addr, size, time_us or None, frames, device_free or None)
Event = Tuple[str, int, int, Optional[float], List[Dict[str, Any]], Optional[int]]
BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "snapshot", "oom")


@dataclass
class Snapshot:
    """A snapshot in one shape, whatever it was read from."""

    kind: str  # "pytorch" (a _dump_snapshot pickle or a live torch snapshot) or "gpumem"
    source: str  # the file, or "live process"
    segments: List[Dict[str, Any]]  # device, address, total_size, stream, segment_type, is_expandable, blocks
    traces: Dict[int, List[Event]]  # device -> its trace, oldest first
    settings: str = ""
    holders: Optional[Dict[str, Any]] = None  # live processes only: report/live.py
    notes: List[str] = field(default_factory=list)

    def devices(self) -> List[int]:
        return sorted({s["device"] for s in self.segments} | {d for d, t in self.traces.items() if t})


class _DataOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it holds a Python object ({module}.{name}), and a memory snapshot "
                                     f"holds only dicts, lists, numbers and strings")


def load_snapshot(path: Union[str, os.PathLike[str]]) -> Snapshot:
    """Read a snapshot file: a ``torch.cuda.memory._dump_snapshot`` pickle (or a pickled
    ``torch.cuda.memory_snapshot()`` list), or gpumem's JSON (``report.record``); gzip allowed."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such snapshot file")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise ValueError(f"{path}: a damaged gzip file ({e})") from None
    if not raw:
        raise ValueError(f"{path}: the file is empty, not a memory snapshot")
    if raw[:1] == b"\x80":
        try:
            data = _DataOnly(io.BytesIO(raw)).load()
        except Exception as e:
            raise ValueError(f"{path}: not a readable snapshot pickle: {e}") from None
        return from_torch(data, str(path))
    if raw.lstrip()[:1] == b"{":
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from None
        if isinstance(data, dict) and data.get("format") == FORMAT:
            return from_gpumem(data, str(path))
        if isinstance(data, dict) and "segments" in data:
            return from_torch(data, str(path))
        raise ValueError(f"{path}: a JSON document, but neither gpumem's snapshot (\"format\": \"{FORMAT}\") "
                         f"nor PyTorch's (a 'segments' key)")
    raise ValueError(f"{path}: not a memory snapshot: expected a pickle from "
                     f"torch.cuda.memory._dump_snapshot or gpumem's JSON snapshot")


def _int(d: Dict[str, Any], key: str, where: str, default: Optional[int] = None) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        if v is None:
            raise ValueError(f"{where}: no {key!r}")
        raise ValueError(f"{where}: {key!r} is {type(v).__name__} {v!r}, not a whole number")
    if v < 0:
        raise ValueError(f"{where}: {key!r} is negative ({v})")
    return v


def _frames(v: Any, where: str) -> List[Dict[str, Any]]:
    if v is None:
        return []
    if not isinstance(v, list) or any(not isinstance(f, dict) for f in v[:1]):
        raise ValueError(f"{where}: 'frames' is not a list of frames")
    return v


def _segments(raw: Any, source: str, default_device: int = 0) -> List[Dict[str, Any]]:
    if not isinstance(raw, list):
        raise ValueError(f"{source}: 'segments' is {type(raw).__name__}, not a list")
    out = []
    for i, s in enumerate(raw):
        where = f"{source}: segments[{i}]"
        if not isinstance(s, dict):
            raise ValueError(f"{where} is {type(s).__name__}, not a dict")
        addr = _int(s, "address", where)
        total = _int(s, "total_size", where)
        blocks_raw = s.get("blocks")
        if not isinstance(blocks_raw, list):
            raise ValueError(f"{where}: 'blocks' is missing or not a list")
        blocks, at = [], addr
        for j, b in enumerate(blocks_raw):
            bw = f"{where}.blocks[{j}]"
            if not isinstance(b, dict):
                raise ValueError(f"{bw} is {type(b).__name__}, not a dict")
            size = _int(b, "size", bw)
            state = b.get("state")
            if state not in BLOCK_STATES:
                raise ValueError(f"{bw}: state {state!r} is not one of {', '.join(BLOCK_STATES)}")
            frames = b.get("frames")
            if frames is None and isinstance(b.get("history"), list) and b["history"]:  # before torch 2.1
                frames = b["history"][-1].get("frames")
            baddr = _int(b, "address", bw, default=at)
            blocks.append({"address": baddr, "size": size, "state": state,
                           "requested_size": _int(b, "requested_size", bw, default=size),
                           "frames": _frames(frames, bw)})
            at = baddr + size
        device = s.get("device", default_device)
        if not isinstance(device, int):
            raise ValueError(f"{where}: 'device' is {device!r}, not a device index")
        out.append({"device": device, "address": addr, "total_size": total,
                    "reserved_size": s.get("reserved_size", total), "stream": s.get("stream", 0),
                    "segment_type": s.get("segment_type", "large"),
                    "is_expandable": bool(s.get("is_expandable", False)), "blocks": blocks})
    return out


def _trace(tr: List[Any], where: str) -> List[Event]:
    """One device's events; the checks are inline, and the place named only on error, because a
    trace can hold millions of them."""
    out: List[Event] = []
    append = out.append
    for i, e in enumerate(tr):
        try:
            action, addr, size = e["action"], e.get("addr", 0), e.get("size", 0)
            t, frames = e.get("time_us"), e.get("frames") or []
            ok = (type(action) is str and type(addr) is int and type(size) is int and size >= 0
                  and (t is None or type(t) in (int, float)) and type(frames) is list)
        except (TypeError, KeyError, AttributeError):
            ok = False
        if not ok:
            raise ValueError(f"{where}[{i}]: {_what_is_wrong(e)}")
        free = e.get("device_free")
        append((action, addr, size, t, frames, free if type(free) is int else None))
    return out


def _what_is_wrong(e: Any) -> str:
    if not isinstance(e, dict):
        return f"a {type(e).__name__}, not an event (a dict)"
    if not isinstance(e.get("action"), str):
        return "no 'action'"
    for k, kinds in (("addr", (int,)), ("size", (int,)), ("time_us", (int, float)), ("frames", (list,))):
        v = e.get(k)
        if v is not None and (type(v) not in kinds or (k == "size" and v < 0)):
            return f"{k!r} is {v!r}"
    return f"not an event: {e!r:.200}"


def from_torch(data: Any, source: str = "snapshot") -> Snapshot:
    """A snapshot in PyTorch's shape: ``torch.cuda.memory._snapshot()``'s dict, or the list of
    segments ``torch.cuda.memory_snapshot()`` returns."""
    if isinstance(data, list):
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a {type(data).__name__}, not a memory snapshot (a dict with "
                         f"'segments' and 'device_traces')")
    if "segments" not in data:
        keys = ", ".join(map(repr, list(data)[:6])) or "none"
        raise ValueError(f"{source}: no 'segments' key (keys: {keys}): not a memory snapshot")
    segments = _segments(data["segments"], source)
    raw_traces = data.get("device_traces", [])
    if not isinstance(raw_traces, list):
        raise ValueError(f"{source}: 'device_traces' is {type(raw_traces).__name__}, not a list per device")
    traces: Dict[int, List[Event]] = {}
    for d, tr in enumerate(raw_traces):
        if not isinstance(tr, list):
            raise ValueError(f"{source}: device_traces[{d}] is {type(tr).__name__}, not a list of events")
        traces[d] = _trace(tr, f"{source}: device_traces[{d}]")
    settings = data.get("allocator_settings", "")
    return Snapshot("pytorch", source, segments, traces, settings=_settings_text(settings))


def _settings_text(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k}={w}" for k, w in v.items() if w not in (None, "", [], {}))
    return str(v or "")


def from_gpumem(data: Dict[str, Any], source: str = "snapshot") -> Snapshot:
    """A snapshot in gpumem's format (``report.record``: regions, event columns, shared stacks)."""
    version = data.get("version")
    if version != 1:
        raise ValueError(f"{source}: gpumem snapshot version {version!r}; this gpumem reads version 1")
    device = data.get("device", 0)
    if not isinstance(device, int):
        raise ValueError(f"{source}: 'device' is {device!r}, not a device index")
    stacks = data.get("stacks", [])
    if not isinstance(stacks, list):
        raise ValueError(f"{source}: 'stacks' is not a list")
    checked = [_frames(s, f"{source}: stacks[{i}]") for i, s in enumerate(stacks)]
    checked.append([])  # index -1: no stack

    def stack(i: Any, where: str) -> List[Dict[str, Any]]:
        if i is None:
            return []
        if type(i) is not int or not -1 <= i < len(stacks):
            raise ValueError(f"{where}: stack {i!r} is not an index into 'stacks' ({len(stacks)} of them)")
        return checked[i]

    raw = data.get("regions")
    if not isinstance(raw, list):
        raise ValueError(f"{source}: 'regions' is missing or not a list")
    regions = []  # copies with the blocks' stacks as frames, leaving the caller's dict as it was
    for i, r in enumerate(raw):
        if isinstance(r, dict) and isinstance(r.get("blocks"), list):
            r = dict(r, blocks=[dict(b, frames=stack(b.get("stack"), f"{source}: regions[{i}].blocks[{j}]"))
                                if isinstance(b, dict) else b for j, b in enumerate(r["blocks"])])
        regions.append(r)
    segments = _segments(regions, source, default_device=device)
    ev = data.get("events", {})
    if not isinstance(ev, dict):
        raise ValueError(f"{source}: 'events' is not a dict of columns")
    cols = [ev.get(k, []) for k in ("action", "addr", "size", "time_us", "stack")]
    n = len(cols[0])
    for k, c in zip(("action", "addr", "size", "time_us", "stack"), cols):
        if not isinstance(c, list) or len(c) != n:
            raise ValueError(f"{source}: events[{k!r}] is not a list of {n} entries, as 'action' is")
    free = {int(i): int(b) for i, b in ev.get("oom_device_free", [])}
    trace: List[Event] = []
    append, last = trace.append, len(stacks)
    for i, (a, addr, size, t, s) in enumerate(zip(*cols)):
        if (type(a) is not str or type(addr) is not int or type(size) is not int or type(s) is not int
                or not -1 <= s < last or not (t is None or type(t) in (int, float))):
            raise ValueError(f"{source}: event {i} (action {a!r}, addr {addr!r}, size {size!r}, "
                             f"time_us {t!r}, stack {s!r}) is not an event (stack: -1 or an index into "
                             f"'stacks')")
        append((a, addr, size, t, checked[s], free.get(i)))
    return Snapshot("gpumem", data.get("source") or source, segments, {device: trace},
                    settings=str(data.get("settings", "")))
