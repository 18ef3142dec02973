"""The live process as a snapshot: torch's own snapshot of its allocator, plus who holds memory.

``torch.cuda.memory._snapshot()`` gives segments, blocks and (with memory history on) the trace, from
gpumem's pool or PyTorch's own allocator alike. What only a live process can add is cleanup's holder
analysis (``cleanup.holders``): the largest tensors and the names that reach them, the bytes of
parameters, gradients, optimizer state and other variables, and the bytes that only the last
exception's traceback keeps alive. Nothing is freed or changed, and CUDA is never initialised here.
"""
from __future__ import annotations

import re
import types
from typing import Any, Dict, List, Optional, Set, Tuple

from .._format import fmt_bytes
from .._optional import import_torch
from .._stats import allocated_reserved, cuda_state, tracked_devices
from ..cleanup.frames import pinned_tracebacks
from ..cleanup.heap import _ATOMS, _make_pred, _storage_key
from ..cleanup.holders import _name_tensors, find_holders
from ..cleanup.output_cache import _get_shell
from .load import Snapshot, from_torch

__all__ = ["live_snapshot", "namespaces"]

# When one storage has several names, the kind that explains it best wins (optimizer state over the
# parameter it belongs to, and so on).
_KIND_ORDER = ("optimizer state", "gradients", "parameters and buffers", "variables")


def namespaces(frame: Any) -> List[dict]:
    """The caller's globals and (in IPython) the notebook's namespace: where names are looked up."""
    spaces: List[dict] = [frame.f_globals]
    if frame.f_locals is not frame.f_globals:
        spaces.insert(0, dict(frame.f_locals))
    shell = _get_shell()
    uns = getattr(shell, "user_ns", None) if shell is not None else None
    if isinstance(uns, dict) and all(uns is not s for s in spaces):
        spaces.append(uns)
    return spaces


def live_snapshot(spaces: List[dict], top: int = 20) -> Snapshot:
    """This process's CUDA memory as a :class:`Snapshot`, with ``holders`` filled in."""
    torch = import_torch()
    if torch is None:
        raise RuntimeError("gpumem.report() with no snapshot reads this process's GPU memory, which needs "
                           "PyTorch (not importable here); pass a snapshot file instead")
    state = cuda_state()
    if state != "ready":
        why = "no CUDA device is available" if state == "none" else "CUDA is not initialised in this process"
        raise RuntimeError(f"gpumem.report() with no snapshot reads this process's GPU memory, but {why}; "
                           f"pass a snapshot file (torch.cuda.memory._dump_snapshot) instead")
    snap = from_torch(torch.cuda.memory._snapshot(), "live process")
    if not any(snap.traces.values()):
        snap.notes.append("memory history is off, so there is no timeline and no stacks: call "
                          "torch.cuda.memory._record_memory_history() early in the run")
    try:
        snap.holders = holders(spaces, top)
    except Exception as e:  # the page still shows the allocator's side
        snap.notes.append(f"who holds memory could not be worked out: {type(e).__name__}: {e}")
    return snap


def _kind(name: str, modules: Set[str]) -> str:
    if ".state[" in name:
        return "optimizer state"
    if name.endswith(".grad"):
        return "gradients"
    if re.split(r"[.\[]", name, maxsplit=1)[0] in modules:
        return "parameters and buffers"
    return "variables"


def _tensors_in(obj: Any, torch: Any, pred: Any, out: Dict[Tuple, int], depth: int = 3,
                seen: Any = None) -> None:
    """Storage keys of the tracked tensors ``obj`` reaches through containers and attributes."""
    seen = set() if seen is None else seen
    if id(obj) in seen or obj is None or isinstance(obj, _ATOMS):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if pred(obj):
            k = _storage_key(obj)
            if k is not None:
                out[k] = k[2]
        return
    if depth <= 0:
        return
    if isinstance(obj, torch.nn.Module):
        for t in list(obj.parameters()) + list(obj.buffers()):
            _tensors_in(t, torch, pred, out, 0, seen)
        return
    if isinstance(obj, dict):
        items = list(obj.values())[:10000]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)[:10000]
    else:
        d = getattr(obj, "__dict__", None)
        items = list(d.values()) if isinstance(d, dict) else []
    for v in items:
        _tensors_in(v, torch, pred, out, depth - 1, seen)


def _traceback_bytes(named: Set[Tuple], torch: Any, pred: Any) -> Dict[str, Any]:
    """Bytes of tracked storages that the last exception's finished frames keep and no name reaches."""
    tbs, text = pinned_tracebacks(_get_shell(), include_active=False)
    found: Dict[Tuple, int] = {}
    frames: List[str] = []
    seen_frames: Set[int] = set()
    for _, first in tbs:
        tb: Optional[types.TracebackType] = first
        while tb is not None:
            f = tb.tb_frame
            if id(f) not in seen_frames:
                seen_frames.add(id(f))
                before = sum(found.values())
                for v in list(f.f_locals.values()):
                    _tensors_in(v, torch, pred, found)
                if sum(found.values()) > before:
                    frames.append(f"{f.f_code.co_filename}:{tb.tb_lineno} {f.f_code.co_name}")
            tb = tb.tb_next
    held = {k: b for k, b in found.items() if k not in named}
    last = text.strip().splitlines()[-1] if text.strip() else ""
    return {"bytes": sum(held.values()), "exception": last[:200], "frames": frames[:10],
            "storages": sorted({(k[0], b) for k, b in held.items()})}


def holders(spaces: List[dict], top: int = 20, pred: Any = None) -> Dict[str, Any]:
    """Who holds this process's CUDA memory (JSON-able; see the module's docstring). ``pred``: which
    tensors count (default: CUDA tensors, as cleanup tracks them)."""
    torch = import_torch()
    if torch is None:  # live_snapshot checked; here for a direct call
        raise RuntimeError("who holds GPU memory needs PyTorch, which is not importable")
    pred = pred or _make_pred(False, None)
    named = _name_tensors(spaces, pred)
    modules = {k for ns in spaces for k, v in list(ns.items())
               if isinstance(k, str) and isinstance(v, torch.nn.Module)}
    by_kind = dict.fromkeys(_KIND_ORDER, 0)
    for key, names in named.items():
        kind = min((_kind(n, modules) for n in names), key=_KIND_ORDER.index)
        by_kind[kind] += key[2]
    found, explained = find_holders(spaces, pred, top=top)
    tb = _traceback_bytes(set(named), torch, pred)
    pinned = {tuple(x) for x in tb.pop("storages")}  # (device, bytes) of what only the traceback keeps
    rows = []
    for h in found:
        kind = _holder_kind(h.refs, modules)
        if kind == "unnamed object" and (h.device, h.nbytes) in pinned:  # no name, a traceback's size
            kind = "last exception's traceback"
        rows.append({"bytes": h.nbytes, "device": h.device, "shape": list(h.shape), "dtype": h.dtype,
                     "refs": h.refs[:6], "kind": kind})
    allocated = allocated_reserved(tracked_devices())[0]
    cuda_explained = sum(v for k, v in explained.items() if k.startswith("cuda"))
    return {"holders": rows, "by_kind": by_kind, "explained": cuda_explained,
            "unexplained": max(allocated - cuda_explained - tb["bytes"], 0), "traceback": tb,
            "summary": f"{fmt_bytes(cuda_explained)} reached from Python names or objects"}


def _holder_kind(refs: List[str], modules: Set[str]) -> str:
    """The kind of one holder row; find_holders words the storages no name reaches in parentheses."""
    if not refs or refs[0].startswith("(no Python referrer: kept"):
        return "autograd graph or C++"
    if refs[0].startswith(("unnamed:", "(")):
        return "unnamed object"
    return min((_kind(r, modules) for r in refs), key=_KIND_ORDER.index)
