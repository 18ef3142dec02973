"""Recording a core ``Pool`` as a snapshot, and gpumem's own snapshot file format.

A process that uses gpumem through torch gets snapshots from torch's API
(``torch.cuda.memory._snapshot()``, PyTorch's format, which ``gpumem.report`` reads). A ``Pool``
used directly (a simulated device, a trace replay) has no torch: :class:`PoolRecorder` wraps it,
records every allocate / free / map / unmap / OOM / trim as a trace entry in torch's vocabulary, and
writes gpumem's snapshot format, a JSON document (gzip when the name ends in ``.gz``):

    {"format": "gpumem.snapshot", "version": 1, "source": "...", "device": 0, "settings": "...",
     "regions": Pool.snapshot() (address, total_size, reserved_size, stream, segment_type, blocks:
                [{address, size, requested_size, state, stack?}]),
     "events":  {"action": [...], "addr": [...], "size": [...], "time_us": [...], "stack": [...]},
     "stacks":  [[{"filename", "line", "name"}, ...], ...],   # "stack" fields index this list (-1: none)
     "stats":   Pool.stats()}

Columns and shared stacks keep a file of 10^6 events small; JSON (not pickle) can be opened from
anywhere without running code. :meth:`PoolRecorder.torch_snapshot` gives the same state in
PyTorch's ``_dump_snapshot`` shape instead.

    >>> from gpumem import _C
    >>> rec = PoolRecorder(_C.Pool(_C.SimulatedDevice("vmm", 1 << 30)))
    >>> p = rec.allocate(3 << 20); rec.free(p)
    >>> rec.snapshot()["events"]["action"]
    ['segment_map', 'alloc', 'free_requested', 'free_completed']
"""
from __future__ import annotations

import gzip
import json
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

__all__ = ["FORMAT", "VERSION", "PoolRecorder", "write_snapshot"]

FORMAT = "gpumem.snapshot"
VERSION = 1

Frames = Sequence[Dict[str, Any]]
# The core's segment observer names -> torch's trace actions.
_OBSERVED = {"map": "segment_map", "unmap": "segment_unmap", "segment_alloc": "segment_alloc",
             "segment_free": "segment_free"}


class PoolRecorder:
    """Wraps a core ``gpumem.Pool``: allocate / free / trim through it record trace entries.

    ``clock``: a callable giving microseconds (default: wall time since the recorder started); a
    trace replay passes its own so that a replay's times do not depend on the machine's speed.
    """

    def __init__(self, pool: Any, device: int = 0, source: str = "",
                 clock: Optional[Callable[[], float]] = None):
        self.pool = pool
        self.device = device
        self.source = source
        t0 = time.perf_counter()
        self._clock = clock or (lambda: (time.perf_counter() - t0) * 1e6)
        self.cols: Dict[str, List[Any]] = {"action": [], "addr": [], "size": [], "time_us": [], "stack": []}
        self.stacks: List[List[Dict[str, Any]]] = []
        self._stack_ids: Dict[int, int] = {}  # id(frames) -> index: callers reuse frame lists per site
        self._keep: List[Frames] = []  # keeps those lists alive so that their ids stay unique
        self._block_stack: Dict[int, int] = {}  # live address -> stack index
        self._current = -1  # stack of the operation under way: map/unmap events inherit it
        self._oom_free: Dict[int, int] = {}  # index of an "oom" event -> the device's free bytes then
        pool.set_segment_observer(self._observe)

    def close(self) -> None:
        """Detach from the pool (the observer holds a reference to this recorder)."""
        self.pool.set_segment_observer(None)

    # -- recording ------------------------------------------------------------------------
    def _stack(self, frames: Optional[Frames]) -> int:
        if not frames:
            return -1
        idx = self._stack_ids.get(id(frames))
        if idx is None:
            idx = self._stack_ids[id(frames)] = len(self.stacks)
            self.stacks.append([{"filename": str(f["filename"]), "line": int(f["line"]),
                                 "name": str(f["name"])} for f in frames])
            self._keep.append(frames)
        return idx

    def _add(self, action: str, addr: int, size: int, stack: int) -> None:
        c = self.cols
        c["action"].append(action)
        c["addr"].append(int(addr))
        c["size"].append(int(size))
        c["time_us"].append(round(self._clock(), 3))
        c["stack"].append(stack)

    def _observe(self, event: str, address: int, nbytes: int, stream: int) -> None:
        self._add(_OBSERVED.get(event, event), address, nbytes, self._current)

    def allocate(self, nbytes: int, stream: int = 0, frames: Optional[Frames] = None) -> int:
        """``pool.allocate`` that records it (and the OOM it may raise, then re-raises it)."""
        sid = self._current = self._stack(frames)
        try:
            ptr = self.pool.allocate(nbytes, stream)
        except Exception as e:
            if type(e).__name__ == "OutOfMemoryError":
                self._oom_free[self.events] = int(self.pool.upstream.free_bytes)
                self._add("oom", 0, nbytes, sid)
            raise
        finally:
            self._current = -1
        self._add("alloc", ptr, self.pool.allocation_size(ptr), sid)
        self._block_stack[ptr] = sid
        return ptr

    def free(self, ptr: int) -> None:
        size = self.pool.allocation_size(ptr)
        sid = self._block_stack.pop(ptr, -1)
        self._add("free_requested", ptr, size, sid)
        self.pool.free(ptr)
        self._add("free_completed", ptr, size, sid)

    def trim(self, frames: Optional[Frames] = None) -> int:
        """``pool.trim()`` (what ``empty_cache`` does); the unmaps it causes carry ``frames``."""
        self._current = self._stack(frames)
        try:
            return int(self.pool.trim())
        finally:
            self._current = -1

    @property
    def events(self) -> int:
        return len(self.cols["action"])

    # -- output ---------------------------------------------------------------------------
    def snapshot(self) -> Dict[str, Any]:
        """The pool's state and the recorded trace in gpumem's snapshot format (a JSON-able dict)."""
        regions = self.pool.snapshot()
        for r in regions:
            for b in r["blocks"]:
                sid = self._block_stack.get(b["address"], -1) if b["state"] != "inactive" else -1
                if sid >= 0:
                    b["stack"] = sid
        events: Dict[str, Any] = {k: list(v) for k, v in self.cols.items()}
        events["oom_device_free"] = sorted(self._oom_free.items())
        return {"format": FORMAT, "version": VERSION, "source": self.source, "device": self.device,
                "settings": f"gpumem pool on {self.pool.upstream.name}",
                "regions": regions, "events": events, "stacks": self.stacks, "stats": self.pool.stats()}

    def torch_snapshot(self) -> Dict[str, Any]:
        """The same state in PyTorch's ``torch.cuda.memory._snapshot()`` shape (``segments``,
        ``device_traces``), as PyTorch's allocator would show it."""
        snap = self.snapshot()
        stacks = snap["stacks"]
        no_frames: List[Dict[str, Any]] = []

        def frames_of(sid: int) -> List[Dict[str, Any]]:
            return stacks[sid] if sid >= 0 else no_frames

        segments = []
        paged = any(a in ("segment_map", "segment_unmap") for a in self.cols["action"][:1000])
        for r in snap["regions"]:
            blocks = [{"address": b["address"], "size": b["size"], "requested_size": b["requested_size"],
                       "state": b["state"], "frames": frames_of(b.get("stack", -1))} for b in r["blocks"]]
            used = [b for b in r["blocks"] if b["state"] == "active_allocated"]
            segments.append({"device": self.device, "address": r["address"], "total_size": r["total_size"],
                             "allocated_size": sum(b["size"] for b in used),
                             "requested_size": sum(b["requested_size"] for b in used),
                             "active_size": sum(b["size"] for b in r["blocks"] if b["state"] != "inactive"),
                             "stream": r["stream"], "segment_type": r["segment_type"],
                             "segment_pool_id": (0, 0), "is_expandable": paged, "frames": no_frames,
                             "blocks": blocks})
        c = self.cols
        trace = []
        for i, (action, addr, size, t, sid) in enumerate(
                zip(c["action"], c["addr"], c["size"], c["time_us"], c["stack"])):
            e = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": int(t),
                 "frames": frames_of(sid)}
            if action == "oom":
                e["device_free"] = self._oom_free.get(i, 0)
            trace.append(e)
        traces: List[List[Dict[str, Any]]] = [[] for _ in range(self.device + 1)]
        traces[self.device] = trace
        return {"segments": segments, "device_traces": traces,
                "allocator_settings": {"gpumem": snap["settings"]}}


def write_snapshot(snapshot: Dict[str, Any], path: Union[str, Path]) -> Path:
    """Write a gpumem-format snapshot dict as JSON (gzip when ``path`` ends in ``.gz``)."""
    path = Path(path)
    data = json.dumps(snapshot, separators=(",", ":")).encode()
    if path.name.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    path.write_bytes(data)
    return path

