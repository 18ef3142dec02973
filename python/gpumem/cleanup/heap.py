"""Which tensors cleanup tracks, and finding them on the garbage collector's heap.

A *predicate* says whether a tensor is of the tracked kind (CUDA, optionally CPU, optionally only some
devices); :func:`_holds` says whether an object reaches such a tensor through containers and
attributes; :func:`_live_tensors` scans the gc heap for them; :class:`_Tracker` measures, step by
step, how many bytes of tensor storage died.
"""
from __future__ import annotations

import gc
import types
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from .._optional import import_torch

Pred = Callable[[Any], bool]
StorageKey = Tuple[str, int, int]  # (device, data pointer, bytes) of a tensor's storage

# Objects that hold no tensor through containers or attributes worth walking.
_ATOMS = (str, bytes, int, float, complex, bool, type, types.ModuleType, types.FunctionType,
          types.BuiltinFunctionType, types.MethodType, weakref.ref)


def _make_pred(include_cpu: bool, devices: Optional[Iterable[Any]]):
    torch = import_torch()
    if torch is None:
        return lambda t: False
    allowed: Optional[Set[Tuple[str, Optional[int]]]] = None
    if devices is not None:
        allowed = set()
        for d in devices:
            dd = torch.device(d) if not isinstance(d, int) else torch.device("cuda", d)
            allowed.add((dd.type, dd.index if dd.index is not None else (0 if dd.type == "cuda" else None)))
    kinds = ("cuda", "cpu") if include_cpu else ("cuda",)

    def pred(t) -> bool:
        try:
            dev = t.device
        except Exception:
            return False
        if dev.type not in kinds:
            return False
        if allowed is not None:
            return (dev.type, dev.index) in allowed or (dev.type == "cpu" and include_cpu)
        return True

    return pred


def _holds(obj: Any, pred: Callable, depth: int = 4, budget: Optional[List[int]] = None, seen=None) -> bool:
    """Does ``obj`` hold (directly or via containers / attributes) a tensor for which pred is true?"""
    torch = import_torch()
    if torch is None:
        return False
    if budget is None:
        budget = [20000]
    if seen is None:
        seen = set()
    budget[0] -= 1
    if budget[0] < 0 or id(obj) in seen:
        return False
    seen.add(id(obj))
    try:
        if isinstance(obj, torch.Tensor):
            return pred(obj)
        if obj is None or isinstance(obj, _ATOMS):
            return False
        if isinstance(obj, torch.nn.Module):
            for t in obj.parameters():
                if pred(t):
                    return True
            for t in obj.buffers():
                if pred(t):
                    return True
            return False
        if depth <= 0:
            return False
        if isinstance(obj, dict):
            return any(_holds(v, pred, depth - 1, budget, seen) for v in list(obj.values()))
        if isinstance(obj, (list, tuple, set, frozenset)):
            return any(_holds(v, pred, depth - 1, budget, seen) for v in list(obj))
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            return any(_holds(v, pred, depth - 1, budget, seen) for v in list(d.values()))
    except Exception:
        return False
    return False


def _storage_key(t) -> Optional[Tuple[str, int, int]]:
    try:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr == 0:
            return None
        return (str(t.device), ptr, int(st.nbytes()))
    except Exception:
        return None


def _live_tensors(pred) -> List[Any]:
    torch = import_torch()
    if torch is None:
        return []
    T = torch.Tensor
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            try:
                if isinstance(o, T) and pred(o):
                    out.append(o)
            except Exception:
                continue
    return out


class _Tracker:
    """Weak references to every Python-visible tracked tensor, grouped by storage, to measure per
    step how many bytes of tensor storage died (works for CPU tensors too)."""

    def __init__(self, pred):
        self.groups: Dict[Tuple, List[weakref.ref]] = {}
        for t in _live_tensors(pred):
            k = _storage_key(t)
            if k is None:
                continue
            try:
                self.groups.setdefault(k, []).append(weakref.ref(t))
            except TypeError:
                continue
        self.dead: set = set()

    def freed_now(self) -> int:
        n = 0
        for k, refs in self.groups.items():
            if k in self.dead:
                continue
            if all(r() is None for r in refs):
                self.dead.add(k)
                n += k[2]
        return n



