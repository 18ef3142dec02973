"""``find_batch_size``: arguments checked, the budget and the trials' bound set, the search run, state
restored.
"""
from __future__ import annotations

import functools
import sys
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from .._errors import is_oom_error
from .backend import _Backend, _CudaBackend
from .distributed import _OK, _OOM, _make_comm
from .results import BatchSizeError, BatchSizeResult, Trial, _fmt
from .search import _plan, _search
from .state import _StateGuard
from .trial import _default_loss, _input_factory, _Runner
from .verify import floor_bytes, verify

__all__ = ["find_batch_size"]


def _validate(model: Any, shape: Any, *, mode: str, step_fn: Any, input_fn: Any, max_memory: Any,
              margin: Optional[float], resolution: Optional[float], min_batch: int, max_batch: Optional[int],
              steps: int, target_batch: Optional[int], optimizer: Any, input_range: Any,
              verify_steps: int = 0, max_new_tokens: Optional[int] = None) -> None:
    if mode not in ("train", "inference", "generate"):
        raise ValueError(f"mode must be 'train', 'inference' or 'generate', not {mode!r}")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if mode == "generate" and step_fn is None:
        if model is not None and not callable(getattr(model, "generate", None)):
            raise TypeError(f"mode='generate' needs a model with a generate() method (Hugging Face style); "
                            f"{type(model).__name__} has none")
        if (not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool)
                or max_new_tokens < 1):
            raise ValueError(f"mode='generate' needs max_new_tokens, an int >= 1, not {max_new_tokens!r}")
    elif max_new_tokens is not None:
        raise ValueError("max_new_tokens applies to mode='generate' only")
    if not isinstance(verify_steps, int) or isinstance(verify_steps, bool) or verify_steps < 0:
        raise ValueError(f"verify_steps must be an int >= 0, not {verify_steps!r}")
    if step_fn is None:
        if model is None:
            raise ValueError("a model is needed unless step_fn is given")
        if input_fn is None:
            if shape is None:
                raise ValueError("shape (one sample's shape, without the batch dimension) "
                                 "or input_fn is needed")
            if isinstance(shape, int) and not isinstance(shape, bool):
                shape = (shape,)
            if (not isinstance(shape, (tuple, list, torch.Size))
                    or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape)):
                raise ValueError(f"shape must be a sequence of positive ints (one sample, no batch "
                                 f"dimension), not {shape!r}")
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
    if margin is not None and (not isinstance(margin, (int, float)) or isinstance(margin, bool)
                               or not 0.0 <= margin < 0.5):
        raise ValueError(f"margin must be None (measured) or in [0, 0.5), not {margin!r}")
    if resolution is not None and (not isinstance(resolution, (int, float)) or isinstance(resolution, bool)
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
    dtype: Optional[torch.dtype] = None,
    input_range: Optional[Tuple[float, float]] = None,
    input_fn: Optional[Callable[[int], Any]] = None,
    step_fn: Optional[Callable[[int], Any]] = None,
    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
    optimizer: Union[torch.optim.Optimizer, Callable[..., torch.optim.Optimizer], None] = None,
    autocast: Optional[torch.dtype] = None,
    max_memory: Union[float, int, None] = None,
    margin: Optional[float] = None,
    resolution: Optional[float] = None,
    min_batch: int = 1,
    max_batch: Optional[int] = None,
    steps: Optional[int] = None,
    verify_steps: Optional[int] = None,
    target_batch: Optional[int] = None,
    max_new_tokens: Optional[int] = None,
    generate_kwargs: Optional[Dict[str, Any]] = None,
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
            including the creation of its state; modules in train mode),
            ``"inference"`` (forward under ``torch.no_grad()``; modules in eval mode) or
            ``"generate"`` (a whole ``model.generate(input_ids, max_new_tokens=...)`` under
            ``no_grad``, forced to produce all ``max_new_tokens`` tokens: the KV cache grows to
            its full length; ``shape`` is the prompt's).
        dtype: the input's dtype (``torch.long`` for token ids; the default for ``"generate"``,
            else ``torch.float32``).
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
            and ``set_per_process_memory_fraction``) always applies.  The trials run
            as if the process were capped at the budget; to hold the training itself
            to it on a larger GPU, cap the process too (``gpumem.set_cap``): uncapped,
            the allocator may cache more than the budget.
        margin: ``None`` (default): measured.  Trials keep a small floor free
            (``max(32 MiB, 0.4 %)`` of the budget, for what no trial can see; one of its pages,
            8 MiB by default, instead of 32 MiB when gpumem is the allocator), and the final
            verification measures how much the peak at the answer moves between runs and keeps
            that free too.  A float in [0, 0.5): a fixed fraction of the budget instead.
        resolution: stop refining once the largest fitting and the smallest failing
            size differ by at most this fraction (default 0.0025 with the measured margin,
            0.005 with a fixed one; exact below 400 or 200;
            ``0`` for the exact size at any scale, at the cost of more trials near
            the limit, which are the slowest).
        min_batch, max_batch: bounds of the search (default 1 and 65536).
        steps: steps per trial (default 3; 1 with ``mode="generate"``, whose step is a whole
            generation, its cache growing to ``max_new_tokens`` inside it).
        verify_steps: steps of the final verification of the answer, in this process and under
            the same budget (default 5, 2 with ``mode="generate"``; 0: none).  See ``margin``.
        target_batch: turns the result into a plan: ``micro_batch_size`` and
            ``accumulation_steps`` reaching ``target_batch`` samples per optimizer step
            (per process); the search stops at ``target_batch``.
        max_new_tokens: with ``mode="generate"``: the tokens each generation produces.
        generate_kwargs: more keyword arguments of ``generate()`` (e.g. ``num_beams``).
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
    steps, verify_steps = _default_steps(mode, steps, verify_steps)
    args: Dict[str, Any] = dict(
        mode=mode, step_fn=step_fn, input_fn=input_fn, max_memory=max_memory, margin=margin,
        resolution=resolution, min_batch=min_batch, max_batch=max_batch, steps=steps,
        target_batch=target_batch, optimizer=optimizer, input_range=input_range, verify_steps=verify_steps,
        max_new_tokens=max_new_tokens)
    _validate(model, shape, **args)
    return _on_cuda(model, shape, dtype=dtype, loss_fn=loss_fn, autocast=autocast, verbose=verbose,
                    log=log, distributed=distributed, generate_kwargs=generate_kwargs, **args)


def _default_steps(mode: str, steps: Optional[int], verify_steps: Optional[int]) -> Tuple[int, int]:
    """(steps per trial, steps of the verification), the defaults for those left ``None``: a
    generation is a whole loop whose cache grows inside it, so 1 and 2; any other step 3 and 5."""
    generating = mode == "generate"
    return (steps if steps is not None else (1 if generating else 3),
            verify_steps if verify_steps is not None else (2 if generating else 5))


def _on_cuda(model: Optional[nn.Module], shape: Any, **kw: Any) -> BatchSizeResult:
    """:func:`_find` on the model's CUDA device (the public functions' common path)."""
    name = kw.get("name", "find_batch_size")
    if not torch.cuda.is_available():
        raise RuntimeError(f"gpumem.{name} needs a CUDA device: torch.cuda.is_available() is False")
    device = None
    if model is not None:
        model = _unwrap(model)
        device = _model_device(model)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(device):
        return _find(model, shape, backend=_CudaBackend(device), **kw)


def _unwrap(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while isinstance(model, (DistributedDataParallel, DataParallel)):
        model = model.module
    return model


def _find(model: Optional[nn.Module], shape: Optional[Sequence[int]], *, mode: str,
          dtype: Optional[torch.dtype], input_range: Optional[Tuple[float, float]],
          input_fn: Optional[Callable[[int], Any]], step_fn: Optional[Callable[[int], Any]],
          loss_fn: Optional[Callable], optimizer: Any, autocast: Optional[torch.dtype],
          max_memory: Union[float, int, None], margin: Optional[float], resolution: Optional[float],
          min_batch: int, max_batch: Optional[int], steps: int, target_batch: Optional[int], verbose: bool,
          log: Optional[Callable[[str], None]], distributed: Optional[bool], backend: _Backend,
          verify_steps: int = 0, max_new_tokens: Optional[int] = None,
          generate_kwargs: Optional[Dict[str, Any]] = None, searched: str = "batch",
          dim: Optional[int] = None, length_batch: int = 1,
          name: str = "find_batch_size") -> BatchSizeResult:
    """find_batch_size on a given memory backend (the CUDA one, or a test's simulation).

    ``searched="length"`` (with ``dim``): the size is a length, ``input_fn`` builds the input of a
    length (:mod:`.lengths`); ``name`` is what the progress lines start with."""
    t_start = time.perf_counter()
    _validate(model, shape, mode=mode, step_fn=step_fn, input_fn=input_fn, max_memory=max_memory,
              margin=margin, resolution=resolution, min_batch=min_batch, max_batch=max_batch, steps=steps,
              target_batch=target_batch, optimizer=optimizer, input_range=input_range,
              verify_steps=verify_steps, max_new_tokens=max_new_tokens)
    if dtype is None:
        dtype = torch.long if mode == "generate" else torch.float32
    if resolution is None:
        resolution = 0.0025 if margin is None else 0.005
    if model is not None:
        model = _unwrap(model)
    device = backend.device
    comm = _make_comm(distributed, device)
    emit = log if log is not None else _default_log(comm.rank)
    if not verbose:
        emit = lambda line: None

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
    floor = floor_bytes(int(budget), backend.floor_min_bytes()) if margin is None else int(budget * margin)
    target = comm.min_int(int(budget) - floor)
    live = backend.allocated()
    if comm.min_int(target - live) <= 0:
        raise BatchSizeError(
            f"no batch fits: the model and other live tensors already use {_fmt(live)}, and the budget less "
            f"the safety margin is {_fmt(target)} (budget {_fmt(budget)}, allocator limit {_fmt(limit)})",
            needed_bytes=live, available_bytes=target)

    hi = max_batch if max_batch is not None else 1 << 16
    if target_batch is not None and searched == "batch":
        hi = min(hi, max(target_batch, min_batch))
    make_input: Optional[Callable[[int], Any]] = None
    shape_hint = "custom input_fn"
    if searched == "length":
        assert dim is not None and shape is not None
        sample = list(shape)

        def make_input(n: int) -> Any:
            sample[dim] = n
            return _input_factory(tuple(sample), dtype, input_range, device)(length_batch)

        dims = ", ".join("L" if i == dim else str(v) for i, v in enumerate(sample))
        shape_hint = f"shape ({length_batch}, {dims}), dtype {dtype}"
    elif step_fn is None:
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

    how = "measured margin, floor" if margin is None else f"fixed margin {margin:.1%},"
    emit(f"gpumem.{name}: {mode} on {device}, budget {_fmt(budget)}, trials under {_fmt(target)} "
         f"({how} {_fmt(budget - target)}), allocator limit {_fmt(limit)}, live {_fmt(live)}, "
         f"{searched} in [{min_batch}, {hi}]" + (f", {comm.world} ranks" if comm.world > 1 else ""))

    guard = _StateGuard(model, optimizer if isinstance(optimizer, torch.optim.Optimizer) else None, device)
    runner = _Runner(model=model, make_input=make_input, mode=mode, step_fn=step_fn, loss_fn=loss_fn,
                     optimizer=optimizer, autocast=autocast, steps=steps, backend=backend, comm=comm,
                     guard=guard, shape_hint=shape_hint, max_new_tokens=max_new_tokens,
                     generate_kwargs=dict(generate_kwargs or {}))

    def log_trial(t: Trial) -> None:
        emit(f"gpumem.{name}:   " + t.line(searched))

    try:
        held = _OK
        try:
            backend.bound(target, limit)
        except Exception as e:
            if not is_oom_error(e):
                raise
            held = _OOM
        if comm.exchange(held, 0, 0, 0)[0] != _OK:
            raise BatchSizeError(f"no batch fits: {_fmt(limit - target)} of ballast (the memory outside the "
                                 f"target, for an allocator that may ignore the memory fraction) could not "
                                 f"be allocated next to {_fmt(live)} of live tensors",
                                 needed_bytes=live, available_bytes=target)
        out = _search(runner.trial, target, min_batch, hi, log=log_trial, resolution=resolution)
        spread: Optional[int] = None
        trials = list(out.trials)
        if verify_steps > 0:
            proven = next((t for t in reversed(out.trials) if t.fits and t.batch_size == out.batch_size),
                          None)
            # Every rank verifies alike: the trials' outcomes and peaks are exchanged, so the ranks'
            # steps down agree only when each measures them against the same budget, the smallest
            # (the one the common target came from). Against its own, a rank with more memory stepped
            # down by its whole surplus after one out-of-memory run: below size 1, while the others
            # went on (two H100s, DDP with uneven budgets).
            v = verify(functools.partial(runner.trial, steps=verify_steps), out.batch_size, proven,
                       budget=comm.min_int(int(budget)), target=target,
                       bytes_per_sample=out.bytes_per_sample, lo=min_batch, log=log_trial,
                       capped=backend.capped())
            trials += v.trials
            spread = v.spread_bytes
            if v.batch_size != out.batch_size:
                out.batch_size, out.measured_peak_bytes = v.batch_size, v.peak_bytes
                out.predicted_peak_bytes = int(out.fixed_bytes + out.bytes_per_sample * v.batch_size)
    finally:
        del runner
        backend.unbound()
        guard.restore()
        backend.after(reserved_before)
    best = comm.min_int(out.batch_size)  # identical on every rank already; belt and braces
    micro = accum = None
    if target_batch is not None:
        micro, accum = _plan(best, target_batch)
    res = BatchSizeResult(
        batch_size=best, predicted_peak_bytes=out.predicted_peak_bytes,
        measured_peak_bytes=out.measured_peak_bytes, bytes_per_sample=out.bytes_per_sample,
        fixed_bytes=out.fixed_bytes, budget_bytes=int(budget), target_bytes=int(target),
        limit_bytes=int(limit),
        trials=trials, seconds=time.perf_counter() - t_start, reserved_before=int(reserved_before),
        reserved_after=int(backend.reserved()), at_upper_bound=out.at_upper_bound and best == hi,
        target_batch=target_batch, micro_batch_size=micro, accumulation_steps=accum, world_size=comm.world,
        margin_bytes=int(budget) - int(out.measured_peak_bytes), spread_bytes=spread,
        verified_steps=verify_steps if spread is not None else 0, dim=dim, searched=searched)
    emit(res.summary())
    return res
