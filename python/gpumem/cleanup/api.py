"""Safe memory cleanup for notebooks and scripts: ``gpumem.cleanup(*names)``.

Steps, in order (each one measured):

1. **tracebacks** - clear the local variables of the finished frames pinned by the last error's
   traceback (``sys.last_value`` / ``sys.last_traceback`` / ``sys.last_exc``, IPython's
   ``InteractiveTB.tb`` and ``last_execution_result``, the exception being handled when called in an
   ``except`` block, and every chained ``__cause__`` / ``__context__``).  The traceback objects
   stay, so the error text can still be printed (``%tb``, ``traceback.print_last()``).
2. **output cache** - drop IPython ``Out[N]`` / ``_N`` / ``_`` / ``__`` / ``___`` entries that hold
   tracked tensors.
3. **names** - delete exactly the variables named (caller's globals, then the notebook namespace).
4. **gc** - ``gc.collect()`` for tensors caught in reference cycles.
5. **empty_cache** - return the allocator's free pages to the device, every device in use.

Then it reports what still holds memory.  It never deletes anything unnamed, never raises (problems
go to ``report.problems``), never initialises CUDA, and is idempotent.
"""
from __future__ import annotations

import gc
import sys
import time
import traceback
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .views import allocated_reserved, cuda_state, fmt_bytes, tracked_devices

__all__ = ["cleanup", "CleanupReport", "Step", "Holder", "release_tracebacks", "find_holders"]

_CO_GEN = 0x20 | 0x80 | 0x200  # generator, coroutine, async generator


# ------------------------------------------------------------------------------------------
# report types
# ------------------------------------------------------------------------------------------
@dataclass
class Step:
    name: str
    freed_allocated: int = 0  # CUDA allocated bytes released by this step (all devices)
    freed_reserved: int = 0  # CUDA reserved bytes released by this step
    freed_tensors: int = 0  # bytes of Python-visible tracked tensor storages that died in this step
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Holder:
    nbytes: int
    device: str
    shape: Tuple[int, ...]
    dtype: str
    refs: List[str]


@dataclass
class CleanupReport:
    cuda: str = "none"  # 'none' | 'uninitialized' | 'ready'
    tracked: str = "cuda"
    devices: List[int] = field(default_factory=list)
    allocated_before: int = 0
    reserved_before: int = 0
    allocated_after: int = 0
    reserved_after: int = 0
    steps: List[Step] = field(default_factory=list)
    cleared: List[str] = field(default_factory=list)
    deleted: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)
    not_tensors: List[str] = field(default_factory=list)
    holders: List[Holder] = field(default_factory=list)
    explained_bytes: int = 0  # CUDA bytes of storages that Python objects reference
    unexplained_bytes: int = 0  # allocated - explained: autograd graph / C++ / untracked
    problems: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    traceback_text: str = ""

    @property
    def cuda_available(self) -> bool:
        return self.cuda != "none"

    @property
    def freed_allocated(self) -> int:
        return self.allocated_before - self.allocated_after

    @property
    def freed_reserved(self) -> int:
        return self.reserved_before - self.reserved_after

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        import dataclasses

        d = dataclasses.asdict(self)
        d["freed_allocated"] = self.freed_allocated
        d["freed_reserved"] = self.freed_reserved
        return d

    def __str__(self) -> str:
        L: List[str] = []
        if self.cuda == "ready":
            devs = ", ".join(f"cuda:{d}" for d in self.devices) or "no device in use"
            L.append(f"gpumem.cleanup: freed {fmt_bytes(self.freed_allocated)} allocated, "
                     f"{fmt_bytes(self.freed_reserved)} reserved ({devs})")
            L.append(f"  allocated {fmt_bytes(self.allocated_before)} -> {fmt_bytes(self.allocated_after)}; "
                     f"reserved {fmt_bytes(self.reserved_before)} -> {fmt_bytes(self.reserved_after)}")
        elif self.cuda == "uninitialized":
            L.append("gpumem.cleanup: CUDA not initialised in this process: nothing on GPU to release.")
        else:
            L.append("gpumem.cleanup: no CUDA device available: nothing on GPU to release.")
        L.append("  steps:")
        for s in self.steps:
            if self.cuda == "ready":
                fr = f"{fmt_bytes(s.freed_allocated):>10} alloc {fmt_bytes(s.freed_reserved):>10} reserved"
            else:
                fr = f"{fmt_bytes(s.freed_tensors):>10} tensors"
            L.append(f"    {s.name:<12} {fr}   {s.detail}".rstrip())
        if self.deleted:
            L.append(f"  deleted: {', '.join(self.deleted)}")
        if self.not_tensors:
            L.append(f"  named but held no {self.tracked} tensors (deleted anyway): {', '.join(self.not_tensors)}")
        if self.missing:
            L.append(f"  not found (skipped): {', '.join(self.missing)}")
        if self.holders:
            L.append(f"  still holding memory (largest live {self.tracked} tensors):")
            for h in self.holders:
                shape = "x".join(str(x) for x in h.shape) if h.shape else "scalar"
                refs = "; ".join(h.refs[:4]) + (f"; +{len(h.refs) - 4} more" if len(h.refs) > 4 else "")
                L.append(f"    {fmt_bytes(h.nbytes):>10}  {h.device:<7} {h.dtype}[{shape}]  {refs}")
        if self.cuda == "ready":
            L.append(f"  explained by Python objects: {fmt_bytes(self.explained_bytes)}; "
                     f"not explained (autograd graph, C++ or other references): {fmt_bytes(self.unexplained_bytes)}")
        for n in self.notes:
            L.append(f"  note: {n}")
        for p in self.problems:
            L.append(f"  problem: {p}")
        return "\n".join(L)

    def __repr__(self) -> str:
        return self.__str__()

    def _repr_pretty_(self, p, cycle):  # IPython display
        p.text(self.__str__())


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------
def _torch():
    try:
        import torch
        return torch
    except Exception:
        return None


def _get_shell():
    ip_mod = sys.modules.get("IPython")
    if ip_mod is None:
        return None
    try:
        from IPython.core.interactiveshell import InteractiveShell

        if InteractiveShell.initialized():
            return InteractiveShell.instance()
    except Exception:
        pass
    return None


def _make_pred(include_cpu: bool, devices: Optional[Iterable[Any]]):
    torch = _torch()
    if torch is None:
        return lambda t: False
    allowed = None
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
    torch = _torch()
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
        if obj is None or isinstance(obj, (str, bytes, int, float, complex, bool, type, types.ModuleType,
                                           types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
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
    torch = _torch()
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




# ------------------------------------------------------------------------------------------
# step 1: tracebacks
# ------------------------------------------------------------------------------------------
def _exc_chain(e: Optional[BaseException], out: List[BaseException], seen: set) -> None:
    stack = [e]
    while stack:
        x = stack.pop()
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        out.append(x)
        stack.append(x.__cause__)
        stack.append(x.__context__)
        for sub in getattr(x, "exceptions", ()) or ():  # ExceptionGroup
            stack.append(sub)


def _clear_tb(tb: Optional[types.TracebackType], seen_frames: set) -> Tuple[int, int]:
    """Clear the locals of every finished frame of ``tb``; returns (cleared, skipped_executing)."""
    cleared = skipped = 0
    while tb is not None:
        f = tb.tb_frame
        if id(f) not in seen_frames:
            seen_frames.add(id(f))
            loc = None
            try:
                # function frames (3.11/3.12) keep a snapshot dict of their locals that clear() leaves
                if f.f_code.co_flags & 0x01 and f.f_locals is not f.f_globals:  # CO_OPTIMIZED
                    loc = f.f_locals
            except Exception:
                loc = None
            try:
                f.clear()
                cleared += 1
                if isinstance(loc, dict):
                    loc.clear()
            except RuntimeError:  # still executing (e.g. the caller, when called in `except`)
                skipped += 1
            except Exception:
                skipped += 1
        tb = tb.tb_next
    return cleared, skipped


def release_tracebacks(shell: Any = None, include_active: bool = True,
                       extra: Sequence[BaseException] = ()) -> Tuple[List[str], str, int, int]:
    """Release what the last error's traceback pins; keep the traceback text.

    Returns ``(holders_touched, traceback_text, frames_cleared, frames_skipped)``.
    """
    sources: List[Tuple[str, Any]] = []
    for attr in ("last_exc", "last_value"):
        v = getattr(sys, attr, None)
        if isinstance(v, BaseException):
            sources.append((f"sys.{attr}", v))
    ltb = getattr(sys, "last_traceback", None)
    if include_active:
        act = sys.exc_info()[1]
        if act is not None:
            sources.append(("active exception (except block)", act))
    if shell is not None:
        itb = getattr(shell, "InteractiveTB", None)
        if itb is not None and getattr(itb, "tb", None) is not None:
            sources.append(("IPython InteractiveTB.tb", itb.tb))
        ler = getattr(shell, "last_execution_result", None)
        for attr in ("error_in_exec", "error_before_exec"):
            v = getattr(ler, attr, None) if ler is not None else None
            if isinstance(v, BaseException):
                sources.append((f"IPython last_execution_result.{attr}", v))
    for e in extra:
        sources.append(("exception", e))

    text = ""
    lv = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if isinstance(lv, BaseException):
        try:
            text = "".join(traceback.format_exception(type(lv), lv, lv.__traceback__ or ltb))
        except Exception:
            text = f"{type(lv).__name__}: {lv}"

    excs: List[BaseException] = []
    seen: set = set()
    tbs: List[Tuple[str, types.TracebackType]] = []
    if isinstance(ltb, types.TracebackType):
        tbs.append(("sys.last_traceback", ltb))
    for name, v in sources:
        if isinstance(v, types.TracebackType):
            tbs.append((name, v))
            continue
        before = len(excs)
        _exc_chain(v, excs, seen)
        for e in excs[before:]:
            if e.__traceback__ is not None:
                tbs.append((name, e.__traceback__))
    frames_seen: set = set()
    touched: List[str] = []
    total_c = total_s = 0
    for name, tb in tbs:
        c, s = _clear_tb(tb, frames_seen)
        total_c += c
        total_s += s
        if c and name not in touched:
            touched.append(name)
    return touched, text, total_c, total_s


# ------------------------------------------------------------------------------------------
# step 2: output cache
# ------------------------------------------------------------------------------------------
def _clear_output_cache(shell: Any, pred) -> List[str]:
    dropped: List[str] = []
    if shell is None:
        return dropped
    ns = getattr(shell, "user_ns", {}) or {}
    caches = []
    for c in (ns.get("_oh"), ns.get("Out"), getattr(getattr(shell, "history_manager", None), "output_hist", None)):
        if isinstance(c, dict) and all(c is not x for x in caches):
            caches.append(c)
    hidden = getattr(shell, "user_ns_hidden", None)
    if not isinstance(hidden, dict):
        hidden = {}
    victims: Dict[int, Any] = {}
    for cache in caches:
        for k in list(cache.keys()):
            v = cache.get(k)
            if _holds(v, pred):
                victims[id(v)] = v
                del cache[k]
                if f"Out[{k}]" not in dropped:
                    dropped.append(f"Out[{k}]")
                un = f"_{k}"
                if ns.get(un) is v:
                    del ns[un]
                    dropped.append(un)
                if hidden.get(un) is v:
                    del hidden[un]
    dh = getattr(shell, "displayhook", None)
    for u in ("_", "__", "___"):
        v = getattr(dh, u, None) if dh is not None else None
        hit = v is not None and (id(v) in victims or _holds(v, pred))
        if not hit:
            continue
        if ns.get(u) is v:  # only when IPython owns the name (user did not assign it)
            ns[u] = ""
            dropped.append(u)
        if hidden.get(u) is v:
            hidden[u] = ""
        try:
            setattr(dh, u, "")
        except Exception:
            pass
    for holder in (getattr(dh, "exec_result", None), getattr(shell, "last_execution_result", None)):
        r = getattr(holder, "result", None) if holder is not None else None
        if r is not None and (id(r) in victims or _holds(r, pred)):
            try:
                holder.result = None
            except Exception:
                pass
    victims.clear()
    # unique, keep order
    return list(dict.fromkeys(dropped))


# ------------------------------------------------------------------------------------------
# step 3: named deletion
# ------------------------------------------------------------------------------------------
def _delete_names(names: Sequence[Any], spaces: List[dict], shell: Any, pred, report: CleanupReport,
                  caller_locals: Optional[dict]) -> str:
    for name in names:
        if not isinstance(name, str):
            report.problems.append(f"cleanup() takes variable *names* as strings, got {type(name).__name__}; skipped "
                                   f"(write cleanup('x'), not cleanup(x))")
            continue
        ns = next((s for s in spaces if name in s), None)
        if ns is None:
            if caller_locals is not None and name in caller_locals:
                report.problems.append(f"'{name}' is a local variable of the calling function; "
                                       f"cleanup() cannot delete it (use `del {name}` there)")
            report.missing.append(name)
            continue
        v = ns[name]
        held = _holds(v, pred)
        try:
            del ns[name]
        except Exception as e:
            report.problems.append(f"could not delete '{name}': {type(e).__name__}: {e}")
            continue
        report.deleted.append(name)
        if not held:
            report.not_tensors.append(name)
        # Out[N] / _N entries that are this very object are references IPython made, not the user
        if shell is not None:
            uns = getattr(shell, "user_ns", {})
            out = uns.get("_oh")
            if isinstance(out, dict):
                for k in [k for k, x in out.items() if x is v]:
                    del out[k]
                    if uns.get(f"_{k}") is v:
                        del uns[f"_{k}"]
            hid = getattr(shell, "user_ns_hidden", None)
            hid = hid if isinstance(hid, dict) else {}
            for k in [k for k, x in hid.items() if x is v and k.startswith("_")]:
                del hid[k]
            dh = getattr(shell, "displayhook", None)
            for u in ("_", "__", "___"):
                if dh is not None and getattr(dh, u, None) is v:
                    if uns.get(u) is v:
                        uns[u] = ""
                    setattr(dh, u, "")
        v = None
    parts = []
    if report.deleted:
        parts.append("deleted " + ", ".join(report.deleted))
    if report.missing:
        parts.append("not found " + ", ".join(report.missing))
    return "; ".join(parts)


# ------------------------------------------------------------------------------------------
# step 5: empty the allocator caches
# ------------------------------------------------------------------------------------------
def _empty_cache(devs: List[int]) -> str:
    torch = _torch()
    if torch is None or not devs:
        return ""
    for d in devs:
        with torch.cuda.device(d):
            torch.cuda.empty_cache()
    return "returned free pages to the device (" + ", ".join(f"cuda:{d}" for d in devs) + ")"


# ------------------------------------------------------------------------------------------
# who holds what
# ------------------------------------------------------------------------------------------
_SKIP_NAMES = {"In", "Out", "_ih", "_oh", "_dh", "_ii", "_iii", "_i", "exit", "quit", "get_ipython",
               "__builtins__", "__builtin__"}


def _name_tensors(spaces: List[dict], pred, max_nodes: int = 200000) -> Dict[Tuple, List[str]]:
    """storage key -> names like ``model.layer1.0.conv1.weight`` / ``opt.state[model.fc.weight]['exp_avg']``."""
    torch = _torch()
    names: Dict[Tuple, List[str]] = {}
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
        if obj is None or isinstance(obj, (str, bytes, int, float, complex, bool, type, types.ModuleType,
                                           types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                                           weakref.ref)):
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
    this_file = __file__
    try:
        refs = gc.get_referrers(t)
    except Exception:
        return out
    for r in refs:
        if id(r) in exclude:
            continue
        try:
            if isinstance(r, types.FrameType):
                if r.f_code.co_filename == this_file:
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


# ------------------------------------------------------------------------------------------
# the public entry point
# ------------------------------------------------------------------------------------------
def cleanup(*names: str,
            namespace: Optional[dict] = None,
            tracebacks: bool = True,
            output_cache: bool = True,
            collect: bool = True,
            empty_cache: bool = True,
            analyze: bool = True,
            top: int = 10,
            include_cpu: bool = False,
            devices: Optional[Iterable[Any]] = None,
            _stacklevel: int = 1) -> CleanupReport:
    """Release GPU memory that a notebook or script no longer needs, and report what still holds it.

    ``names``: variables to delete (strings), looked up in ``namespace`` or else the caller's globals,
    then IPython's user namespace.  Nothing unnamed is ever deleted.
    ``tracebacks`` / ``output_cache`` / ``collect`` / ``empty_cache``: enable the individual steps.
    ``analyze``: find the largest live tensors and their holders (one scan of the gc heap).
    ``include_cpu``: also treat CPU tensors as tracked (output cache, holders, per-step bytes).
    ``devices``: restrict the tracked tensors to these devices.
    Returns a :class:`CleanupReport`; never raises (problems are listed in ``report.problems``).
    """
    report = CleanupReport(tracked="cuda+cpu" if include_cpu else "cuda")
    try:
        _cleanup(report, names, namespace, tracebacks, output_cache, collect, empty_cache, analyze, top,
                 include_cpu, devices, _stacklevel + 1)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # never raise: report instead
        report.problems.append(f"internal error: {type(e).__name__}: {e}")
    return report


def _cleanup(report, names, namespace, tracebacks, output_cache, collect, empty_cache, analyze, top,
             include_cpu, devices, stacklevel):
    caller_locals = None
    spaces: List[dict] = []
    try:
        frame = sys._getframe(stacklevel)
        if namespace is None:
            spaces.append(frame.f_globals)
            if frame.f_code.co_flags & 0x02 and frame.f_locals is not frame.f_globals:  # CO_NEWLOCALS
                caller_locals = frame.f_locals
        del frame
    except Exception:
        pass
    if namespace is not None:
        spaces.insert(0, namespace)
    shell = _get_shell()
    if shell is not None:
        uns = getattr(shell, "user_ns", None)
        if isinstance(uns, dict) and all(uns is not s for s in spaces):
            spaces.append(uns)

    pred = _make_pred(include_cpu, devices)
    report.cuda = cuda_state()
    devs = tracked_devices() if report.cuda == "ready" else []
    report.devices = devs
    if report.cuda == "none":
        report.notes.append("no CUDA device available: GPU steps skipped" +
                            ("; CPU tensors tracked" if include_cpu else ""))
    elif report.cuda == "uninitialized":
        report.notes.append("CUDA not initialised in this process: GPU steps skipped")
    if sys.exc_info()[1] is not None and tracebacks:
        report.notes.append("called inside an `except` block: the frames still running (this one and its "
                            "callers) keep their variables; the finished frames of the exception were released")

    tracker = _Tracker(pred) if analyze or report.cuda != "ready" else None
    report.allocated_before, report.reserved_before = allocated_reserved(devs)
    last = [report.allocated_before, report.reserved_before]

    def run(step_name: str, fn: Callable[[], str]) -> None:
        t0 = time.perf_counter()
        step = Step(step_name)
        try:
            step.detail = fn() or ""
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            report.problems.append(f"{step_name}: {type(e).__name__}: {e}")
            step.detail = "failed (see problems)"
        a, r = allocated_reserved(devs)
        step.freed_allocated, step.freed_reserved = last[0] - a, last[1] - r
        last[0], last[1] = a, r
        if tracker is not None:
            step.freed_tensors = tracker.freed_now()
        step.seconds = time.perf_counter() - t0
        report.steps.append(step)

    if tracebacks:
        def do_tb():
            touched, text, c, s = release_tracebacks(shell, include_active=True)
            report.traceback_text = text
            report.cleared.extend(touched)
            if not c and not s:
                return "no traceback holding frames"
            msg = f"cleared locals of {c} finished frame(s)"
            if touched:
                msg += " via " + ", ".join(touched)
            if s:
                msg += f"; {s} running frame(s) kept"
            return msg
        run("tracebacks", do_tb)

    if output_cache:
        def do_out():
            if shell is None:
                return "not in IPython"
            dropped = _clear_output_cache(shell, pred)
            report.cleared.extend(dropped)
            return ("dropped " + ", ".join(dropped)) if dropped else "nothing cached holds tensors"
        run("output cache", do_out)

    if names:
        run("names", lambda: _delete_names(names, spaces, shell, pred, report, caller_locals))

    if collect:
        run("gc.collect", lambda: f"{gc.collect()} unreachable objects collected")

    if empty_cache:
        run("empty_cache", lambda: _empty_cache(devs) if devs else "no CUDA memory in use")

    report.allocated_after, report.reserved_after = last[0], last[1]
    if tracker is not None:
        tracker.groups.clear()

    if analyze:
        try:
            holders, explained = find_holders(spaces, pred, top=top)
            report.holders = holders
            cuda_explained = sum(v for k, v in explained.items() if k.startswith("cuda"))
            report.explained_bytes = cuda_explained
            report.unexplained_bytes = max(report.allocated_after - cuda_explained, 0)
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            report.problems.append(f"analysis: {type(e).__name__}: {e}")
