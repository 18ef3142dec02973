"""Find the largest batch size that really fits on the GPU: fast, proven, and without a trace.

    >>> import torch, gpumem
    >>> model = MyNet().cuda()
    >>> res = gpumem.find_batch_size(model, (3, 224, 224), autocast=torch.bfloat16)
    >>> res.batch_size
    412
    >>> print(res)          # one-line summary
    >>> plan = gpumem.find_batch_size(model, (3, 224, 224), target_batch=1024)
    >>> plan.micro_batch_size, plan.accumulation_steps
    (342, 3)

How it works
------------
A *trial* at batch size ``B`` runs ``steps`` real steps (default 3: forward, loss,
backward, optimizer step including the creation of the optimizer state) starting
from an emptied allocator cache, exactly as a fresh training process would.  While
it runs, a *ballast* tensor holds ``limit - target`` bytes, where ``limit`` is what
the allocator may use at all (free device memory plus what torch already reserved,
capped by ``torch.cuda.set_per_process_memory_fraction``) and ``target`` is the
budget (``max_memory``) less the safety ``margin``.  A trial passes when no
out-of-memory error happened, so a pass proves the step fits with ``margin`` of the
budget to spare, fragmentation, workspaces and optimizer-state creation included.

The search (:func:`_search`, pure and torch-free in its logic) measures peaks at a
few small batch sizes, fits ``peak = fixed + per_sample * B``, predicts the largest
size under the target, proves it with a trial and refines with a short bracketed
search around the prediction (galloping down from a failure, bisecting a bracket,
and stopping without a trial where the allocated-bytes line alone already exceeds
the target).  Peaks are read through ``torch.cuda`` statistics, so it works with
gpumem's allocator registered or with PyTorch's own.

Nothing is left behind: parameters, buffers, optimizer state, gradients, the
modules' train/eval flags and the RNG states are restored bit for bit, and the
allocator cache is emptied at the end so memory reserved afterwards is no more than
before the call.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import math
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

__all__ = ["find_batch_size", "BatchSizeResult", "Trial", "BatchSizeError"]

GiB = float(1 << 30)

# Messages of allocation failures that do not arrive as torch.OutOfMemoryError
# (cuBLAS / cuDNN handles failing to get workspace, raw CUDA errors).
_OOM_MESSAGES = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cudaErrorMemoryAllocation",
    "HIP out of memory",
)

_OK, _OOM, _ERROR = 0, 1, 2


def _fmt(n: Optional[float]) -> str:
    return "?" if n is None else f"{n / GiB:.2f} GiB"


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Trial:
    """One real attempt at a batch size.

    ``outcome`` is ``"fits"``, ``"oom"`` (an out-of-memory error) or ``"over"`` (it
    ran, but its peak exceeded the target).  ``peak_bytes`` is the peak of allocated
    memory during the trial (the ballast excluded; for an OOM, a lower bound of what
    was needed, when known); ``reserved_bytes`` the peak reserved by the allocator.
    """

    batch_size: int
    outcome: str
    peak_bytes: Optional[int]
    reserved_bytes: Optional[int]
    seconds: float
    phase: str  # "probe", "prove" or "refine"

    @property
    def fits(self) -> bool:
        return self.outcome == "fits"


@dataclass
class BatchSizeResult:
    """What :func:`find_batch_size` found.  ``int(result)`` is the batch size."""

    batch_size: int
    predicted_peak_bytes: int  # the model's prediction (from the probes) at batch_size
    measured_peak_bytes: int  # peak allocated in the proving trial at batch_size
    bytes_per_sample: int
    fixed_bytes: int
    budget_bytes: int  # min(max_memory, what the allocator may use)
    target_bytes: int  # budget less the safety margin: what a step had to fit in
    limit_bytes: int  # what the allocator may use at all
    trials: List[Trial] = field(default_factory=list)
    seconds: float = 0.0
    reserved_before: int = 0
    reserved_after: int = 0
    at_upper_bound: bool = False
    target_batch: Optional[int] = None
    micro_batch_size: Optional[int] = None
    accumulation_steps: Optional[int] = None
    world_size: int = 1

    def __int__(self) -> int:
        return self.batch_size

    @property
    def effective_batch(self) -> Optional[int]:
        if self.micro_batch_size is None or self.accumulation_steps is None:
            return None
        return self.micro_batch_size * self.accumulation_steps

    def summary(self) -> str:
        n_oom = sum(1 for t in self.trials if not t.fits)
        s = (f"gpumem.find_batch_size: batch {self.batch_size}"
             f"{' (the upper bound)' if self.at_upper_bound else ''}"
             f", peak {_fmt(self.measured_peak_bytes)} (predicted {_fmt(self.predicted_peak_bytes)})"
             f" of {_fmt(self.target_bytes)} target / {_fmt(self.budget_bytes)} budget"
             f", {_fmt(self.bytes_per_sample)} per sample"
             f", {len(self.trials)} trials ({n_oom} failed) in {self.seconds:.1f} s")
        if self.micro_batch_size is not None:
            s += (f"; plan for {self.target_batch}: micro-batch {self.micro_batch_size}"
                  f" x {self.accumulation_steps} accumulation steps")
        if self.world_size > 1:
            s += f"; agreed by {self.world_size} ranks"
        return s

    __str__ = summary


class BatchSizeError(RuntimeError):
    """Not even the smallest batch size fits (or the budget is already used up)."""

    def __init__(self, message: str, needed_bytes: Optional[int] = None, available_bytes: Optional[int] = None):
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes


class _TrialOOM(Exception):
    """Raised by a measure function after recovery: the trial ran out of memory."""

    def __init__(self, batch_size: int, needed_bytes: Optional[int], seconds: Optional[float]):
        super().__init__(f"out of memory at batch size {batch_size}")
        self.needed_bytes = needed_bytes
        self.seconds = seconds


@dataclass
class _Measurement:
    peak_bytes: int
    reserved_bytes: Optional[int] = None
    seconds: Optional[float] = None


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, (_TrialOOM, torch.cuda.OutOfMemoryError)):
        return True
    if isinstance(e, RuntimeError):
        msg = str(e)
        return any(m in msg for m in _OOM_MESSAGES)
    return False


_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
          "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40, "bytes": 1}


def _requested_bytes(msg: str) -> int:
    """The size of the allocation that failed, from torch's OOM message, or 0."""
    m = re.search(r"Tried to allocate ([0-9.]+) ?([KMGT]i?B|B|bytes)", msg)
    if not m:
        return 0
    return int(float(m.group(1)) * _UNITS.get(m.group(2), 1))


# ----------------------------------------------------------------------------- the search


@dataclass
class _SearchOutcome:
    batch_size: int
    trials: List[Trial]
    fixed_bytes: int
    bytes_per_sample: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    at_upper_bound: bool


def _line(points: List[Tuple[int, int]]) -> Optional[Tuple[float, float, int, int]]:
    """(fixed, per_sample, anchor_b, anchor_peak) from measured (b, peak) points: the secant
    from the largest point to the largest point at most half its size (or the smallest
    point), falling back to least squares; None without a positive slope."""
    pts = sorted(set(points))
    if len(pts) < 2:
        return None
    bmax, pmax = pts[-1]
    partners = [p for p in pts[:-1] if p[0] <= bmax // 2] or [pts[0]]
    b0, p0 = partners[-1]
    if bmax > b0:
        slope = (pmax - p0) / (bmax - b0)
        if slope > 0:
            return pmax - slope * bmax, slope, bmax, pmax
    n = len(pts)
    mb = sum(b for b, _ in pts) / n
    mp = sum(p for _, p in pts) / n
    var = sum((b - mb) ** 2 for b, _ in pts)
    if var <= 0:
        return None
    slope = sum((b - mb) * (p - mp) for b, p in pts) / var
    if slope <= 0:
        return None
    return mp - slope * mb, slope, bmax, pmax


def _search(measure: Callable[[int], Any], target: int, lo: int = 1, hi: int = 1 << 16, *,
            log: Optional[Callable[[Trial], None]] = None, max_trials: int = 40,
            resolution: float = 0.005,
            clock: Callable[[], float] = time.perf_counter) -> _SearchOutcome:
    """The largest ``b`` in ``[lo, hi]`` whose trial fits in ``target`` bytes, to within
    ``resolution`` (a fraction of ``b``; 0 for the exact size).

    Near the limit every trial runs close to full memory and is the slowest of the search,
    so the refinement stops once the bracket between the largest fitting and the smallest
    failing size is at most ``resolution`` of the fitting size (always exact below 200 at
    the default 0.5%), and its gallop down from a failure moves in steps of half of that.

    ``measure(b)`` runs a trial and returns its peak bytes (an ``int``, or an object
    with ``peak_bytes`` and optionally ``reserved_bytes`` / ``seconds``), or raises an
    out-of-memory error (``torch.cuda.OutOfMemoryError``, an allocation-failure
    ``RuntimeError``, or ``_TrialOOM``).  Any other exception propagates at once.
    A trial fits when it raised nothing and its peak is at most ``target``.  Assumes
    fitting is monotone in ``b``; the returned size has always passed a real trial.
    """
    if lo < 1 or hi < lo:
        raise ValueError(f"bad bounds [{lo}, {hi}]")
    trials: List[Trial] = []
    ok: Dict[int, Trial] = {}
    measured: Dict[int, int] = {}  # b -> allocated peak, for every trial that ran

    def run(b: int, phase: str) -> Trial:
        if len(trials) >= max_trials:
            raise RuntimeError(f"find_batch_size: gave up after {max_trials} trials")
        t0 = clock()
        try:
            m = measure(b)
        except Exception as e:  # noqa: BLE001 - classified below, others re-raised
            if not _is_oom(e):
                raise
            needed = getattr(e, "needed_bytes", None)
            secs = getattr(e, "seconds", None)
            tr = Trial(b, "oom", needed, None, clock() - t0 if secs is None else secs, phase)
        else:
            if isinstance(m, (int, float)):
                m = _Measurement(int(m))
            peak = int(m.peak_bytes)
            secs = getattr(m, "seconds", None)
            tr = Trial(b, "fits" if peak <= target else "over", peak, getattr(m, "reserved_bytes", None),
                       clock() - t0 if secs is None else secs, phase)
            measured[b] = peak
        trials.append(tr)
        if tr.fits:
            ok[b] = tr
        if log is not None:
            log(tr)
        return tr

    # -- 1. probes at small sizes
    first = run(lo, "probe")
    if not first.fits:
        need = first.peak_bytes
        raise BatchSizeError(
            f"batch size {lo} does not fit: it needs {'more than ' if first.outcome == 'oom' else ''}"
            f"{_fmt(need) if need else 'more than the available memory'}, "
            f"and {_fmt(target)} is available (the budget less the safety margin)",
            needed_bytes=need, available_bytes=target)
    lo_ok, hi_bad = lo, None
    b = min(hi, 2 * lo)
    min_delta = 0.01 * target
    while b > lo_ok:
        t = run(b, "probe")
        if not t.fits:
            hi_bad = b
            break
        lo_ok = b
        if measured[b] - measured[lo] >= min_delta or b >= hi:
            break
        b = min(hi, 4 * b)  # too flat to see a slope yet: grow

    # one more probe about half way to the prediction gives a long baseline
    if hi_bad is None and lo_ok < hi:
        fit = _line(list(measured.items()))
        if fit is not None:
            _, slope, ab, ap = fit
            pred = ab + math.floor((target - ap) / slope)
            if pred >= 3 * lo_ok:
                mid = min(hi, lo_ok + int((pred - lo_ok) * 0.45))
                if mid > lo_ok:
                    t = run(mid, "probe")
                    if t.fits:
                        lo_ok = mid
                    else:
                        hi_bad = mid

    probe_fit = _line(list(measured.items()))

    # allowance for fragmentation in the first prediction: half the unconstrained
    # reserved-minus-allocated overhead seen at the largest probe (capped)
    frag = 0
    top = ok[lo_ok]
    if top.reserved_bytes is not None and top.peak_bytes is not None:
        frag = int(min(max(0, top.reserved_bytes - top.peak_bytes) / 2, 0.05 * target))

    # -- 2. prove and refine
    fails_in_row = 0
    gallop = False
    phase = "prove"
    while True:
        upper = hi if hi_bad is None else hi_bad - 1
        if lo_ok >= upper:
            break
        if hi_bad is not None and hi_bad - lo_ok <= max(1, int(resolution * lo_ok)):
            break  # close enough: the sizes left differ by less than the resolution
        pts = [(bb, p) for bb, p in measured.items() if bb <= lo_ok or bb in ok]
        fit = _line(pts)

        def predict(tgt: int) -> int:
            if fit is None:
                return upper  # no slope visible: go straight to the bound
            _, slope, ab, ap = fit
            return ab + math.floor((tgt - ap) / slope)

        optimistic = predict(target)  # allocated bytes alone: never fits beyond this
        if optimistic <= lo_ok:
            break  # the allocated-bytes line already exceeds the target at lo_ok + 1
        if hi_bad is None:
            guess = predict(target - frag) if phase == "prove" else optimistic
            guess = min(max(guess, lo_ok + 1), upper)
        elif gallop:
            # the first failure was near the model's line, so the limit is just below it:
            # gallop down from it (1, 2, 4, ... steps) rather than bisect the whole bracket
            step = max(1, int(resolution * hi_bad / 2))
            guess = max(lo_ok + 1, min(optimistic, hi_bad - step * (1 << (fails_in_row - 1))))
        else:
            guess = max(lo_ok + 1, min(optimistic, (lo_ok + hi_bad) // 2))
        first_failure = hi_bad is None
        t = run(guess, phase)
        phase = "refine"
        if t.fits:
            lo_ok, fails_in_row = guess, 0
            gallop = False  # a bracket from real trials on both sides: bisect it
        else:
            if first_failure:
                gallop = optimistic - guess <= max(2, guess // 10)
            hi_bad, fails_in_row = guess, fails_in_row + 1

    final_fit = _line([(bb, p) for bb, p in measured.items() if bb in ok]) or probe_fit
    fixed, slope = (final_fit[0], final_fit[1]) if final_fit else (float(ok[lo_ok].peak_bytes or 0), 0.0)
    if probe_fit is not None:
        predicted = int(probe_fit[0] + probe_fit[1] * lo_ok)
    else:
        predicted = int(ok[lo_ok].peak_bytes or 0)
    return _SearchOutcome(lo_ok, trials, int(fixed), int(round(slope)), predicted,
                          int(ok[lo_ok].peak_bytes or 0), lo_ok >= hi)


def _plan(max_fit: int, target_batch: int) -> Tuple[int, int]:
    """(micro_batch, accumulation_steps) for target_batch samples per optimizer step with
    micro-batches of at most max_fit: the fewest steps whose micro-batch divides
    target_batch exactly (up to twice the minimum), else balanced micro-batches whose
    total is the smallest multiple at or above target_batch."""
    if target_batch <= max_fit:
        return target_batch, 1
    steps0 = -(-target_batch // max_fit)
    for steps in range(steps0, 2 * steps0 + 1):
        if target_batch % steps == 0 and target_batch // steps <= max_fit:
            return target_batch // steps, steps
    return -(-target_batch // steps0), steps0


# ----------------------------------------------------------------------------- memory backends


class _Backend:
    """Memory operations of the device the trials run on (CUDA here; tests substitute
    a simulated one to drive the real step runner on a CPU model)."""

    device: torch.device

    def clean(self, collect: bool = True) -> None:
        if collect:
            gc.collect()

    def reserved(self) -> int:
        return 0

    def allocated(self) -> int:
        return 0

    def limits(self) -> Tuple[int, int]:
        """(bytes the allocator may use in all, total device bytes), after clean()."""
        raise NotImplementedError

    def hold(self, ballast: int) -> None:
        """Allocate the ballast (held across all trials, released by release())."""

    def release(self) -> None:
        """Free the ballast."""

    def begin(self, batch_size: int) -> None:
        """Reset the peak statistics before a trial."""

    def sync(self) -> None:
        """Inside the trial's try block: wait for the device (raises late errors)."""

    def end(self) -> Tuple[int, Optional[int]]:
        """(peak allocated, peak reserved) since begin(), the ballast excluded."""
        raise NotImplementedError

    def after(self, reserved_before: int) -> None:
        self.clean()


class _CudaBackend(_Backend):
    def __init__(self, device: torch.device):
        self.device = device
        self._b_alloc = 0
        self._b_res = 0
        self._ballast: Optional[torch.Tensor] = None

    def clean(self, collect: bool = True) -> None:
        if collect:  # only needed for reference cycles (a failed step's frames); costs ~0.1 s
            gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def limits(self) -> Tuple[int, int]:
        self.clean()
        free, total = torch.cuda.mem_get_info(self.device)
        limit = self.reserved() + free
        frac = None
        if hasattr(torch.cuda, "get_per_process_memory_fraction"):
            try:
                frac = float(torch.cuda.get_per_process_memory_fraction(self.device))
            except Exception:  # noqa: BLE001 - an allocator without the notion
                frac = None
        if frac is not None and 0 < frac < 1:
            limit = min(limit, int(frac * total))
        return int(limit), int(total)

    def hold(self, ballast: int) -> None:
        a0, r0 = self.allocated(), self.reserved()
        if ballast > 0:
            self._ballast = torch.empty(ballast, dtype=torch.uint8, device=self.device)
        self._b_alloc, self._b_res = self.allocated() - a0, self.reserved() - r0

    def release(self) -> None:
        self._ballast = None
        self._b_alloc = self._b_res = 0

    def begin(self, batch_size: int) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def end(self) -> Tuple[int, Optional[int]]:
        return (torch.cuda.max_memory_allocated(self.device) - self._b_alloc,
                torch.cuda.max_memory_reserved(self.device) - self._b_res)

    def after(self, reserved_before: int) -> None:
        self.clean(collect=False)
        if self.reserved() > reserved_before:
            self.clean()
        if self.reserved() > reserved_before:
            # cuBLAS workspaces created during the trials live in the allocator's pool
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
                self.clean(collect=False)


# ----------------------------------------------------------------------------- distributed


class _Comm:
    rank = 0
    world = 1

    def min_int(self, x: int) -> int:
        return x

    def exchange(self, code: int, peak: int, reserved: int, needed: int) -> Tuple[int, int, int, int]:
        return code, peak, reserved, needed


class _DistComm(_Comm):
    """Every rank takes part in every exchange, whatever happened in its own trial, so an
    OOM on one rank never leaves the others waiting in a collective."""

    def __init__(self, device: torch.device):
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        backend = str(dist.get_backend()).lower()
        self.dev = device if ("nccl" in backend and device.type == "cuda") else torch.device("cpu")

    def _reduce(self, vals: List[int], op: Any) -> List[int]:
        t = torch.tensor(vals, dtype=torch.int64, device=self.dev)
        self.dist.all_reduce(t, op=op)
        return [int(v) for v in t.tolist()]

    def min_int(self, x: int) -> int:
        return self._reduce([x], self.dist.ReduceOp.MIN)[0]

    def exchange(self, code: int, peak: int, reserved: int, needed: int) -> Tuple[int, int, int, int]:
        c, p, r, n = self._reduce([code, peak, reserved, needed], self.dist.ReduceOp.MAX)
        return c, p, r, n


def _make_comm(distributed: Optional[bool], device: torch.device) -> _Comm:
    if distributed is False:
        return _Comm()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return _DistComm(device)
    if distributed:
        raise RuntimeError("distributed=True but torch.distributed is not initialized with more than one rank")
    return _Comm()


# ----------------------------------------------------------------------------- state guard


class _StateGuard:
    """Snapshot of everything a trial may change; restore() puts it back bit for bit.

    Parameters, buffers, gradients and the user's optimizer state are copied to host
    memory (no device memory is spent on the copy).  Between trials only what costs
    memory is reset (gradients dropped, optimizer state created by a trial deleted);
    values are restored once, at the end.
    """

    def __init__(self, model: Optional[nn.Module], optimizer: Optional[torch.optim.Optimizer],
                 device: torch.device):
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.params: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.grads: List[Tuple[torch.Tensor, Optional[torch.Tensor]]] = []
        self.buffers: List[Tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []
        self.flags: List[Tuple[nn.Module, bool]] = []
        self.opt_state: Dict[Any, Dict[str, Any]] = {}
        self.opt_groups: List[Dict[str, Any]] = []
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = None
        if device.type == "cuda":
            self.cuda_rng = torch.cuda.get_rng_state(device)
        if model is not None:
            seen = set()
            for p in model.parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                self.params.append((p, p.detach().to("cpu", copy=True)))
                g = p.grad
                self.grads.append((p, None if g is None else g.detach().to("cpu", copy=True)))
            for mod in model.modules():
                self.flags.append((mod, mod.training))
                for name, buf in mod._buffers.items():
                    if buf is not None:
                        self.buffers.append((mod, name, buf, buf.detach().to("cpu", copy=True)))
            for p, _ in self.grads:  # trials start without gradients, as after zero_grad()
                p.grad = None
        if optimizer is not None:
            for p, st in optimizer.state.items():
                saved = {}
                for k, v in st.items():
                    if torch.is_tensor(v):
                        saved[k] = (v, v.detach().to("cpu", copy=True))
                    else:
                        saved[k] = (None, copy.deepcopy(v))
                self.opt_state[p] = saved
            self.opt_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                               for g in optimizer.param_groups]

    def between_trials(self) -> None:
        """Drop what a trial allocated for good: gradients, optimizer state it created."""
        for p, _ in self.grads:
            p.grad = None
        if self.optimizer is not None:
            for p in list(self.optimizer.state.keys()):
                if p not in self.opt_state:
                    del self.optimizer.state[p]

    def restore(self) -> None:
        with torch.no_grad():
            for p, saved in self.params:
                p.copy_(saved)
            for mod, name, buf, saved in self.buffers:
                if mod._buffers.get(name) is not buf:
                    mod._buffers[name] = buf
                buf.copy_(saved)
            for p, g in self.grads:
                p.grad = None if g is None else g.to(p.device)
        for mod, flag in self.flags:
            mod.training = flag
        if self.optimizer is not None:
            opt = self.optimizer
            for p in list(opt.state.keys()):
                if p not in self.opt_state:
                    del opt.state[p]
            with torch.no_grad():
                for p, saved in self.opt_state.items():
                    st = opt.state[p]
                    for k in list(st.keys()):
                        if k not in saved:
                            del st[k]
                    for k, (orig, val) in saved.items():
                        if orig is not None:
                            orig.copy_(val)
                            st[k] = orig
                        else:
                            st[k] = copy.deepcopy(val)
            for g, saved_g in zip(opt.param_groups, self.opt_groups):
                for k in [k for k in g if k != "params" and k not in saved_g]:
                    del g[k]
                g.update(copy.deepcopy(saved_g))
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)


# ----------------------------------------------------------------------------- step runner


def _first_tensor(out: Any) -> Optional[torch.Tensor]:
    if torch.is_tensor(out):
        return out
    if isinstance(out, dict) or hasattr(out, "keys"):
        for k in ("logits", "last_hidden_state", "out"):
            try:
                v = out[k]
            except (KeyError, TypeError, IndexError):
                continue
            if torch.is_tensor(v):
                return v
        for v in out.values():
            t = _first_tensor(v)
            if t is not None:
                return t
    if isinstance(out, (list, tuple)):
        for v in out:
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


def _default_loss(gen: Optional[torch.Generator]) -> Callable[[Any, Any], torch.Tensor]:
    """Cross-entropy over the last dimension against random class targets (the memory of
    a typical classifier / language-model loss: an fp32 log-softmax saved for backward);
    a model output's own ``loss`` when it has one; mean square for 0-d/1-d outputs."""

    def loss_fn(out: Any, batch: Any) -> torch.Tensor:
        own = getattr(out, "loss", None)
        if own is None and isinstance(out, dict):
            own = out.get("loss")
        if torch.is_tensor(own) and own.requires_grad:
            return own
        t = _first_tensor(out)
        if t is None or not t.is_floating_point():
            raise TypeError("find_batch_size: cannot build a loss from the model's output "
                            f"({type(out).__name__}); pass loss_fn=lambda output, batch: ...")
        if t.dim() >= 2 and t.shape[-1] > 1:
            logits = t.reshape(-1, t.shape[-1])
            classes = torch.randint(0, t.shape[-1], (logits.shape[0],), device=t.device, generator=gen)
            return nn.functional.cross_entropy(logits, classes)
        return t.float().pow(2).mean()

    return loss_fn


class _Runner:
    """Runs one trial: ``steps`` steps at a batch size, OOM caught and recovered from
    outside the ``except`` block, everything a trial allocated released afterwards."""

    def __init__(self, *, model: Optional[nn.Module], make_input: Optional[Callable[[int], Any]],
                 mode: str, step_fn: Optional[Callable[[int], Any]], loss_fn: Optional[Callable],
                 optimizer: Any, autocast: Optional[torch.dtype], steps: int, backend: _Backend,
                 comm: _Comm, guard: _StateGuard, shape_hint: str):
        self.model = model
        self.make_input = make_input
        self.mode = mode
        self.step_fn = step_fn
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.autocast = autocast
        self.steps = steps
        self.backend = backend
        self.comm = comm
        self.guard = guard
        self.shape_hint = shape_hint
        self._opt: Optional[torch.optim.Optimizer] = None
        self.calls = 0

    def _autocast_ctx(self) -> Any:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.backend.device.type, dtype=self.autocast)

    def _call_model(self, x: Any) -> Any:
        assert self.model is not None
        if isinstance(x, dict):
            return self.model(**x)
        if isinstance(x, (list, tuple)):
            return self.model(*x)
        return self.model(x)

    def _optimizer(self) -> torch.optim.Optimizer:
        if self._opt is None:
            assert self.model is not None
            if isinstance(self.optimizer, torch.optim.Optimizer):
                self._opt = self.optimizer
            else:
                factory = self.optimizer or torch.optim.AdamW
                self._opt = factory([p for p in self.model.parameters() if p.requires_grad])
        return self._opt

    def _step(self, b: int) -> None:
        self.calls += 1
        if self.step_fn is not None:
            self.step_fn(b)
            return
        assert self.model is not None and self.make_input is not None
        x = self.make_input(b)
        if self.mode == "inference":
            with torch.no_grad(), self._autocast_ctx():
                out = self._call_model(x)
            del out
            return
        opt = self._optimizer()
        with self._autocast_ctx():
            out = self._call_model(x)
            loss = self.loss_fn(out, x)  # type: ignore[misc]
        # The output stays referenced through backward and the optimizer step, as in a typical
        # training loop (`logits = model(x); loss = ...; loss.backward(); opt.step()`): dropping it
        # first would measure a lower peak than the user's own step reaches.
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out, loss

    def trial(self, b: int) -> _Measurement:
        self.guard.between_trials()  # the cache was emptied by limits() or the previous trial
        if self.model is not None and self.step_fn is None:
            self.model.train(self.mode == "train")
        status, err, requested = _OK, None, 0
        t0 = time.perf_counter()
        try:
            self.backend.begin(b)
            for _ in range(self.steps):
                self._step(b)
            self.backend.sync()
        except Exception as e:  # noqa: BLE001 - classified; non-OOM errors re-raised below
            traceback.clear_frames(e.__traceback__)  # free the failed step's tensors
            if _is_oom(e):
                status, requested = _OOM, _requested_bytes(str(e))
            else:
                status, err = _ERROR, e
        # Recovery runs here, outside the except block: the failed step's frames are gone.
        peak, reserved = self.backend.end()
        self._opt = None
        self.guard.between_trials()
        self.backend.clean(collect=status != _OK)
        seconds = time.perf_counter() - t0
        needed = peak + requested if status == _OOM else 0
        code, peak, reserved, needed = self.comm.exchange(status, peak, reserved or 0, needed)
        if err is not None:
            if self.step_fn is None and hasattr(err, "add_note"):
                err.add_note(f"gpumem.find_batch_size: the {self.mode} step at batch size {b} failed with a "
                             f"non-memory error; does the input ({self.shape_hint}) match the model?")
            raise err
        if code == _ERROR:
            raise RuntimeError("gpumem.find_batch_size: another rank failed with a non-memory error")
        if code == _OOM:
            raise _TrialOOM(b, needed or None, seconds)
        return _Measurement(peak, reserved, seconds)


# ----------------------------------------------------------------------------- public API


def _input_factory(shape: Sequence[int], dtype: torch.dtype, value_range: Optional[Tuple[float, float]],
                   device: torch.device) -> Callable[[int], torch.Tensor]:
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    shape = tuple(int(s) for s in shape)

    def make(b: int) -> torch.Tensor:
        size = (b,) + shape
        if dtype == torch.bool:
            return torch.randint(0, 2, size, device=device, generator=gen).bool()
        if not (dtype.is_floating_point or dtype.is_complex):
            low, high = (0, 2) if value_range is None else (int(value_range[0]), int(value_range[1]))
            return torch.randint(low, high, size, device=device, dtype=dtype, generator=gen)
        if value_range is None:
            return torch.randn(size, device=device, dtype=dtype, generator=gen)
        low, high = value_range
        return torch.rand(size, device=device, dtype=dtype, generator=gen) * (high - low) + low

    return make


def _validate(model: Any, shape: Any, *, mode: str, step_fn: Any, input_fn: Any, max_memory: Any,
              margin: float, resolution: float, min_batch: int, max_batch: Optional[int], steps: int,
              target_batch: Optional[int], optimizer: Any, input_range: Any) -> None:
    if mode not in ("train", "inference"):
        raise ValueError(f"mode must be 'train' or 'inference', not {mode!r}")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if step_fn is None:
        if model is None:
            raise ValueError("a model is needed unless step_fn is given")
        if input_fn is None:
            if shape is None:
                raise ValueError("shape (one sample's shape, without the batch dimension) or input_fn is needed")
            if isinstance(shape, int) and not isinstance(shape, bool):
                shape = (shape,)
            if (not isinstance(shape, (tuple, list, torch.Size))
                    or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape)):
                raise ValueError(f"shape must be a sequence of positive ints (one sample, no batch dimension), "
                                 f"not {shape!r}")
    elif not callable(step_fn):
        raise TypeError("step_fn must be callable: step_fn(batch_size)")
    if input_fn is not None and not callable(input_fn):
        raise TypeError("input_fn must be callable: input_fn(batch_size) -> model input")
    if input_range is not None:
        if len(input_range) != 2 or not input_range[0] < input_range[1]:
            raise ValueError(f"input_range must be (low, high) with low < high, not {input_range!r}")
    if max_memory is not None:
        if isinstance(max_memory, bool) or not isinstance(max_memory, (int, float)):
            raise TypeError("max_memory must be a fraction of the device (float in (0, 1]) or bytes (int)")
        if isinstance(max_memory, float) and not 0.0 < max_memory <= 1.0:
            raise ValueError(f"max_memory as a fraction must be in (0, 1], not {max_memory}")
        if isinstance(max_memory, int) and max_memory <= 0:
            raise ValueError(f"max_memory in bytes must be positive, not {max_memory}")
    if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not 0.0 <= margin < 0.5:
        raise ValueError(f"margin must be in [0, 0.5), not {margin!r}")
    if (not isinstance(resolution, (int, float)) or isinstance(resolution, bool)
            or not 0.0 <= resolution <= 0.1):
        raise ValueError(f"resolution must be in [0, 0.1], not {resolution!r}")
    if not isinstance(min_batch, int) or min_batch < 1:
        raise ValueError(f"min_batch must be an int >= 1, not {min_batch!r}")
    if max_batch is not None and (not isinstance(max_batch, int) or max_batch < min_batch):
        raise ValueError(f"max_batch must be an int >= min_batch ({min_batch}), not {max_batch!r}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, not {steps!r}")
    if target_batch is not None and (not isinstance(target_batch, int) or target_batch < 1):
        raise ValueError(f"target_batch must be an int >= 1, not {target_batch!r}")
    if optimizer is not None and not (isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)):
        raise TypeError("optimizer must be a torch.optim.Optimizer, an optimizer class, or a factory "
                        "params -> Optimizer")


def _model_device(model: nn.Module) -> Optional[torch.device]:
    devs = {t.device for t in list(model.parameters()) + list(model.buffers())}
    if not devs:
        return None
    cuda = [d for d in devs if d.type == "cuda"]
    if len(devs) > 1 or not cuda:
        where = ", ".join(sorted(str(d) for d in devs))
        raise ValueError(f"find_batch_size needs the model on one CUDA device; its tensors are on {where}. "
                         "Move it first: model.cuda()")
    return cuda[0]


def _default_log(rank: int) -> Callable[[str], None]:
    def log(line: str) -> None:
        if rank == 0:
            print(line, file=sys.stderr, flush=True)

    return log


def find_batch_size(
    model: Optional[nn.Module],
    shape: Optional[Sequence[int]] = None,
    *,
    mode: str = "train",
    dtype: torch.dtype = torch.float32,
    input_range: Optional[Tuple[float, float]] = None,
    input_fn: Optional[Callable[[int], Any]] = None,
    step_fn: Optional[Callable[[int], Any]] = None,
    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
    optimizer: Union[None, torch.optim.Optimizer, Callable[..., torch.optim.Optimizer]] = None,
    autocast: Optional[torch.dtype] = None,
    max_memory: Union[None, float, int] = None,
    margin: float = 0.02,
    resolution: float = 0.005,
    min_batch: int = 1,
    max_batch: Optional[int] = None,
    steps: int = 3,
    target_batch: Optional[int] = None,
    verbose: bool = True,
    log: Optional[Callable[[str], None]] = None,
    distributed: Optional[bool] = None,
) -> BatchSizeResult:
    """Find the largest batch size whose step fits in GPU memory.

    Args:
        model: the model, already on its CUDA device.  A ``DistributedDataParallel``
            model is measured through its ``.module`` (no gradient all-reduce runs during
            the search).  May be ``None`` with ``step_fn``.
        shape: one sample's shape, without the batch dimension, e.g. ``(3, 224, 224)``
            or ``(1024,)`` for token ids.
        mode: ``"train"`` (forward under ``autocast``, loss, backward, optimizer step
            including the creation of its state; modules in train mode) or
            ``"inference"`` (forward under ``torch.no_grad()``; modules in eval mode).
        dtype: the input's dtype (``torch.long`` for token ids).
        input_range: ``(low, high)`` of input values: integers are drawn in
            ``[low, high)`` (default ``[0, 2)``, valid for any embedding), floats
            uniformly (default: standard normal).
        input_fn: ``input_fn(batch_size) -> input`` instead of ``shape``; a tuple is
            passed as positional arguments, a dict as keyword arguments.
        step_fn: ``step_fn(batch_size)`` runs one whole custom step instead of the
            built-in one; it is called ``steps`` times per trial.  Pass ``model`` (and
            an ``optimizer`` instance) too to have their state restored afterwards.
        loss_fn: ``loss_fn(output, input) -> scalar``; default: the output's own
            ``.loss`` if it has one, else cross-entropy over the last dimension against
            random classes (the memory of a typical classifier/LM loss).
        optimizer: an optimizer *instance* (used in the trials; its state is restored
            exactly and state it creates is deleted), or a class / factory
            ``params -> Optimizer`` (a fresh one per trial).  Default ``torch.optim.AdamW``.
        autocast: e.g. ``torch.bfloat16`` to run the step under ``torch.autocast``.
        max_memory: budget: a fraction of the device's memory in (0, 1] (float) or bytes
            (int).  The allocator's own limit (free memory plus what torch reserved,
            and ``set_per_process_memory_fraction``) always applies.
        margin: fraction of the budget left free (default 0.02), for the differences
            between a trial and a fresh process.
        resolution: stop refining once the largest fitting and the smallest failing
            size differ by at most this fraction (default 0.005; exact below 200;
            ``0`` for the exact size at any scale, at the cost of more trials near
            the limit, which are the slowest).
        min_batch, max_batch: bounds of the search (default 1 and 65536).
        steps: steps per trial (default 3).
        target_batch: turns the result into a plan: ``micro_batch_size`` and
            ``accumulation_steps`` reaching ``target_batch`` samples per optimizer step
            (per process); the search stops at ``target_batch``.
        verbose: a progress line per trial and a summary on stderr (rank 0 only).
        log: a callable receiving those lines instead of stderr.
        distributed: ``None`` (default) agrees across ranks when ``torch.distributed``
            is initialized: every rank returns the same size, the largest that fits on
            all; ``False`` searches on this process alone.

    Returns:
        :class:`BatchSizeResult` (``.batch_size``, ``.trials``, ``.summary()``, ...).

    Raises:
        RuntimeError: no CUDA device.  ValueError / TypeError: bad arguments, a model on
        the CPU, ``max_memory`` larger than the device.  BatchSizeError: not even
        ``min_batch`` fits (the message names the memory needed and available).  Any
        non-memory error of the step is re-raised at once, with the state restored.

    Example:
        >>> res = gpumem.find_batch_size(gpt, (1024,), dtype=torch.long,
        ...                              input_range=(0, 32000), autocast=torch.bfloat16)
        >>> loader = DataLoader(ds, batch_size=res.batch_size)
    """
    args = dict(mode=mode, step_fn=step_fn, input_fn=input_fn, max_memory=max_memory, margin=margin,
                resolution=resolution, min_batch=min_batch, max_batch=max_batch, steps=steps, target_batch=target_batch,
                optimizer=optimizer, input_range=input_range)
    _validate(model, shape, **args)
    if not torch.cuda.is_available():
        raise RuntimeError("gpumem.find_batch_size needs a CUDA device: torch.cuda.is_available() is False")
    device = None
    if model is not None:
        model = _unwrap(model)
        device = _model_device(model)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(device):
        return _find(model, shape, dtype=dtype, loss_fn=loss_fn, autocast=autocast, verbose=verbose,
                     log=log, distributed=distributed, backend=_CudaBackend(device), **args)


def _unwrap(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel, DataParallel

    while isinstance(model, (DistributedDataParallel, DataParallel)):
        model = model.module
    return model


def _find(model: Optional[nn.Module], shape: Optional[Sequence[int]], *, mode: str, dtype: torch.dtype,
          input_range: Optional[Tuple[float, float]], input_fn: Optional[Callable[[int], Any]],
          step_fn: Optional[Callable[[int], Any]], loss_fn: Optional[Callable], optimizer: Any,
          autocast: Optional[torch.dtype], max_memory: Union[None, float, int], margin: float,
          resolution: float, min_batch: int, max_batch: Optional[int], steps: int, target_batch: Optional[int],
          verbose: bool, log: Optional[Callable[[str], None]], distributed: Optional[bool],
          backend: _Backend) -> BatchSizeResult:
    """find_batch_size on a given memory backend (the CUDA one, or a test's simulation)."""
    t_start = time.perf_counter()
    _validate(model, shape, mode=mode, step_fn=step_fn, input_fn=input_fn, max_memory=max_memory,
              margin=margin, resolution=resolution, min_batch=min_batch, max_batch=max_batch, steps=steps,
              target_batch=target_batch, optimizer=optimizer, input_range=input_range)
    if model is not None:
        model = _unwrap(model)
    device = backend.device
    comm = _make_comm(distributed, device)
    emit = log if log is not None else _default_log(comm.rank)
    if not verbose:
        emit = lambda line: None  # noqa: E731

    reserved_before = backend.reserved()
    limit, total = backend.limits()
    if isinstance(max_memory, float):
        budget = min(limit, int(max_memory * total))
    elif isinstance(max_memory, int):
        if max_memory > total:
            raise ValueError(f"max_memory {_fmt(max_memory)} is larger than the device ({_fmt(total)})")
        budget = min(limit, max_memory)
    else:
        budget = limit
    target = comm.min_int(int(budget * (1.0 - margin)))
    live = backend.allocated()
    if comm.min_int(target - live) <= 0:
        raise BatchSizeError(
            f"no batch fits: the model and other live tensors already use {_fmt(live)}, and the budget less "
            f"the safety margin is {_fmt(target)} (budget {_fmt(budget)}, allocator limit {_fmt(limit)})",
            needed_bytes=live, available_bytes=target)
    ballast = max(0, limit - target)

    hi = max_batch if max_batch is not None else 1 << 16
    if target_batch is not None:
        hi = min(hi, max(target_batch, min_batch))
    make_input = None
    shape_hint = "custom input_fn"
    if step_fn is None:
        if input_fn is not None:
            make_input = input_fn
        else:
            sh = (shape,) if isinstance(shape, int) else tuple(shape)  # type: ignore[arg-type]
            make_input = _input_factory(sh, dtype, input_range, device)
            shape_hint = f"shape (batch, {', '.join(map(str, sh))}), dtype {dtype}"
    if loss_fn is None:
        gen = torch.Generator(device=device)
        gen.manual_seed(1)
        loss_fn = _default_loss(gen)

    emit(f"gpumem.find_batch_size: {mode} on {device}, budget {_fmt(budget)}, target {_fmt(target)} "
         f"(margin {margin:.0%}), allocator limit {_fmt(limit)}, live {_fmt(live)}, "
         f"search [{min_batch}, {hi}]" + (f", {comm.world} ranks" if comm.world > 1 else ""))

    guard = _StateGuard(model, optimizer if isinstance(optimizer, torch.optim.Optimizer) else None, device)
    runner = _Runner(model=model, make_input=make_input, mode=mode, step_fn=step_fn, loss_fn=loss_fn,
                     optimizer=optimizer, autocast=autocast, steps=steps, backend=backend, comm=comm,
                     guard=guard, shape_hint=shape_hint)

    def log_trial(t: Trial) -> None:
        what = {"fits": "fits", "oom": "out of memory", "over": "over the target"}[t.outcome]
        peak = "" if t.peak_bytes is None else (
            f", peak {_fmt(t.peak_bytes)}" if t.outcome != "oom" else f", needs > {_fmt(t.peak_bytes)}")
        emit(f"gpumem.find_batch_size:   {t.phase:6s} batch {t.batch_size:>6d}: {what}{peak}, {t.seconds:.2f} s")

    try:
        held = _OK
        try:
            backend.hold(ballast)
        except Exception as e:  # noqa: BLE001
            if not _is_oom(e):
                raise
            held = _OOM
        if comm.exchange(held, 0, 0, 0)[0] != _OK:
            raise BatchSizeError(f"no batch fits: {_fmt(ballast)} of ballast (the memory outside the target) "
                                 f"could not be allocated next to {_fmt(live)} of live tensors",
                                 needed_bytes=live, available_bytes=target)
        out = _search(runner.trial, target, min_batch, hi, log=log_trial, resolution=resolution)
    finally:
        del runner
        backend.release()
        guard.restore()
        backend.after(reserved_before)
    best = comm.min_int(out.batch_size)  # identical on every rank already; belt and braces
    micro = accum = None
    if target_batch is not None:
        micro, accum = _plan(best, target_batch)
    res = BatchSizeResult(
        batch_size=best, predicted_peak_bytes=out.predicted_peak_bytes,
        measured_peak_bytes=out.measured_peak_bytes, bytes_per_sample=out.bytes_per_sample,
        fixed_bytes=out.fixed_bytes, budget_bytes=int(budget), target_bytes=int(target), limit_bytes=int(limit),
        trials=out.trials, seconds=time.perf_counter() - t_start, reserved_before=int(reserved_before),
        reserved_after=int(backend.reserved()), at_upper_bound=out.at_upper_bound and best == hi,
        target_batch=target_batch, micro_batch_size=micro, accumulation_steps=accum, world_size=comm.world)
    emit(res.summary())
    return res
