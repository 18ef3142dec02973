"""Who holds what: the largest live tracked tensors and the names that reach them.

:func:`find_holders` walks the namespaces (``model.layer1.0.conv1.weight``,
``opt.state[model.fc.weight]['exp_avg']``, ``batch['input_ids']``, ...), then, for storages no name
reaches, asks the gc heap whether any Python object refers to them; what nothing explains is kept
alive from C++ (typically saved by the autograd graph).
"""
from __future__ import annotations

import gc
import os
import sys
import types
from typing import Any, Dict, List, Tuple

from .._optional import import_torch
from .heap import _ATOMS, _live_tensors, _storage_key
from .report import Holder

__all__ = ["find_holders"]

# Frames of cleanup's own code refer to the tensors they examine: never report them as holders.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

_SKIP_NAMES = {"In", "Out", "_ih", "_oh", "_dh", "_ii", "_iii", "_i", "exit", "quit", "get_ipython",
               "__builtins__", "__builtin__"}


def _name_tensors(spaces: List[dict], pred, max_nodes: int = 200000) -> Dict[Tuple, List[str]]:
    """storage key -> names like ``model.layer1.0.conv1.weight`` /
    ``opt.state[model.fc.weight]['exp_avg']``."""
    torch = import_torch()
    names: Dict[Tuple, List[str]] = {}
    if torch is None:  # no torch, no tensors
        return names
    param_names: Dict[int, str] = {}
    optimizers: List[Tuple[str, Any]] = []
    seen: set = set()
    budget = [max_nodes]

    def add(t, nm):
        if not pred(t):
            return
        k = _storage_key(t)
        if k is None:
            return
        lst = names.setdefault(k, [])
        if nm not in lst:
            lst.append(nm)

    def tensor(t, nm):
        add(t, nm)
        g = getattr(t, "grad", None) if t.is_leaf else None
        if isinstance(g, torch.Tensor):
            add(g, nm + ".grad")

    def walk(obj, nm, depth):
        budget[0] -= 1
        if budget[0] < 0:
            return
        if isinstance(obj, torch.Tensor):
            tensor(obj, nm)
            return
        if obj is None or isinstance(obj, _ATOMS):
            return
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            for pn, p in obj.named_parameters(remove_duplicate=False):
                param_names.setdefault(id(p), f"{nm}.{pn}")
                tensor(p, f"{nm}.{pn}")
            for bn, b in obj.named_buffers(remove_duplicate=False):
                tensor(b, f"{nm}.{bn}")
            for mn, m in obj.named_modules():
                for an, av in list(vars(m).items()):
                    if an.startswith("_"):
                        continue
                    if isinstance(av, torch.Tensor):
                        tensor(av, f"{nm}.{mn + '.' if mn else ''}{an}")
            return
        if isinstance(obj, torch.optim.Optimizer):
            optimizers.append((nm, obj))
            return
        if depth <= 0:
            return
        if isinstance(obj, dict):
            for k, v in list(obj.items())[:10000]:
                walk(v, f"{nm}[{k!r}]", depth - 1)
            return
        if isinstance(obj, (list, tuple)):
            for i, v in enumerate(list(obj)[:10000]):
                walk(v, f"{nm}[{i}]", depth - 1)
            return
        if isinstance(obj, (set, frozenset)):
            for v in list(obj)[:10000]:
                walk(v, f"{nm}{{...}}", depth - 1)
            return
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            for an, av in list(d.items()):
                walk(av, f"{nm}.{an}", depth - 1)

    for ns in spaces:
        for k, v in list(ns.items()):
            if not isinstance(k, str) or k in _SKIP_NAMES or k.startswith("__"):
                continue
            try:
                walk(v, k, 3)
            except Exception:
                continue
    for onm, opt in optimizers:
        try:
            for p, st in list(opt.state.items()):
                pn = param_names.get(id(p))
                if pn is None:
                    idx = next((f"param_groups[{gi}]['params'][{pi}]"
                                for gi, g in enumerate(opt.param_groups)
                                for pi, q in enumerate(g["params"]) if q is p), "?")
                    pn = f"{onm}.{idx}"
                    if isinstance(p, torch.Tensor):
                        tensor(p, pn)
                for sk, sv in st.items():
                    if isinstance(sv, torch.Tensor):
                        add(sv, f"{onm}.state[{pn}][{sk!r}]")
        except Exception:
            continue
    return names


def _describe_referrers(t, exclude: set, limit: int = 3) -> List[str]:
    out: List[str] = []
    try:
        refs = gc.get_referrers(t)
    except Exception:
        return out
    for r in refs:
        if id(r) in exclude:
            continue
        try:
            if isinstance(r, types.FrameType):
                if os.path.dirname(os.path.abspath(r.f_code.co_filename)) == _PACKAGE_DIR:
                    continue
                var = next((k for k, v in r.f_locals.items() if v is t), "?")
                out.append(f"local '{var}' of {r.f_code.co_name}() ({r.f_code.co_filename}:{r.f_lineno})")
            elif isinstance(r, dict):
                key = next((k for k, v in r.items() if v is t), "?")
                owner = None
                for o in gc.get_referrers(r):
                    if isinstance(o, types.ModuleType) and o.__dict__ is r:
                        owner = f"{o.__name__}.{key}"
                        break
                    if getattr(o, "__dict__", None) is r:
                        owner = f"<{type(o).__name__} object>.{key}"
                        break
                out.append(owner or f"dict[{key!r}]")
            elif isinstance(r, (list, tuple)):
                if id(r) in exclude:
                    continue
                out.append(f"{type(r).__name__} of {len(r)} items")
            elif type(r).__name__ == "cell":
                out.append("closure variable")
            elif hasattr(r, "__traceback__") or type(r).__name__ == "weakref":
                continue
            else:
                out.append(f"<{type(r).__name__}>")
        except Exception:
            continue
        if len(out) >= limit:
            break
    return out


def find_holders(spaces: List[dict], pred, top: int = 10) -> Tuple[List[Holder], Dict[str, int]]:
    """The ``top`` largest live tracked tensor storages with who refers to them, and bytes explained
    by Python objects per device."""
    tensors = _live_tensors(pred)
    groups: Dict[Tuple, List[Any]] = {}
    for t in tensors:
        k = _storage_key(t)
        if k is not None:
            groups.setdefault(k, []).append(t)
    named = _name_tensors(spaces, pred)
    # storages that no name reaches: does any Python object (not ours) refer to one of their tensors?
    # (tensors kept only by C++ - e.g. saved for backward - can still have a preserved Python object)
    exclude = {id(tensors), id(groups)} | {id(v) for v in groups.values()}
    unnamed = {id(t): k for k, ts in groups.items() if k not in named for t in ts}
    referred: set = set()
    if unnamed:
        me = sys._getframe()
        objs = gc.get_objects()
        exclude.add(id(objs))
        for o in objs:
            if id(o) in exclude or o is me:
                continue
            try:
                for x in gc.get_referents(o):
                    k = unnamed.get(id(x))
                    if k is not None and x is not o:
                        referred.add(k)
            except Exception:
                continue
        del objs, me
    explained: Dict[str, int] = {}
    for k in groups:
        if k in named or k in referred:
            explained[k[0]] = explained.get(k[0], 0) + k[2]
    order = sorted(groups.keys(), key=lambda k: -k[2])[: max(0, top)]
    holders: List[Holder] = []
    for k in order:
        ts = groups[k]
        big = max(ts, key=lambda x: x.numel())
        refs = list(named.get(k, []))
        if not refs and k not in referred:
            refs = ["(no Python referrer: kept alive from C++, e.g. saved by the autograd graph)"]
        if not refs:
            for t in ts:
                refs.extend(_describe_referrers(t, exclude))
                if len(refs) >= 3:
                    break
            if not refs:
                refs = ["(no Python referrer found)"]
            else:
                refs = ["unnamed: " + r for r in dict.fromkeys(refs)]
        holders.append(Holder(nbytes=k[2], device=k[0], shape=tuple(big.shape),
                              dtype=str(big.dtype).replace("torch.", ""), refs=refs))
        del big, ts
    tensors.clear()
    groups.clear()
    return holders, explained

