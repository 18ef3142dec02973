"""The trial runner: ``steps`` real steps at a batch size, an out-of-memory error caught and
recovered from, and what the trial allocated released; plus the built-in step's input and loss.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import traceback
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .._errors import exception_chain, find_oom_error, requested_bytes
from .backend import _Backend
from .distributed import _ERROR, _OK, _OOM, _Comm
from .results import _Measurement, _TrialOOM
from .state import _StateGuard


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
        if own is not None and torch.is_tensor(own) and own.requires_grad:
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


def _clear_frames(e: BaseException) -> None:
    """Free the tensors that the failed step's frames hold (those of the errors it chains too)."""
    for x in exception_chain(e):
        traceback.clear_frames(x.__traceback__)


@dataclasses.dataclass
class _Runner:
    """Runs one trial: ``steps`` steps at a batch size, OOM caught and recovered from
    outside the ``except`` block, everything a trial allocated released afterwards."""

    model: Optional[nn.Module]
    make_input: Optional[Callable[[int], Any]]
    mode: str
    step_fn: Optional[Callable[[int], Any]]
    loss_fn: Optional[Callable]
    optimizer: Any
    autocast: Optional[torch.dtype]
    steps: int
    backend: _Backend
    comm: _Comm
    guard: _StateGuard
    shape_hint: str
    max_new_tokens: Optional[int] = None
    generate_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    _opt: Optional[torch.optim.Optimizer] = dataclasses.field(default=None, init=False)
    calls: int = dataclasses.field(default=0, init=False)

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

    def _generate(self, x: Any) -> Any:
        """One whole generation, forced to its full length (``min_new_tokens``): the KV cache and the
        logits grow to what the longest generation needs, whatever the sampled tokens are."""
        assert self.model is not None
        kw: Dict[str, Any] = dict(max_new_tokens=self.max_new_tokens, min_new_tokens=self.max_new_tokens,
                                  do_sample=False, use_cache=True)
        if torch.is_tensor(x):
            kw.update(input_ids=x, attention_mask=torch.ones_like(x))
        elif isinstance(x, dict):
            kw.update(x)
        else:
            raise TypeError("mode='generate' needs input_ids: a tensor (shape=(prompt_length,)) or, from "
                            "input_fn, a dict of generate()'s keyword arguments")
        cfg = getattr(self.model, "generation_config", None) or getattr(self.model, "config", None)
        if getattr(cfg, "pad_token_id", None) is None:
            eos = getattr(cfg, "eos_token_id", None)
            kw["pad_token_id"] = (eos[0] if isinstance(eos, (list, tuple)) else eos) if eos is not None else 0
        kw.update(self.generate_kwargs)
        return self.model.generate(**kw)

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
        if self.mode == "generate":
            with torch.no_grad(), self._autocast_ctx():
                out = self._generate(x)
            del out
            return
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

    def trial(self, b: int, steps: Optional[int] = None) -> _Measurement:
        """``steps`` (default: the runner's) steps at size ``b``; its peaks, or ``_TrialOOM``."""
        n_steps = self.steps if steps is None else steps
        self.guard.between_trials()  # the cache was emptied by limits() or the previous trial
        if self.model is not None and self.step_fn is None:
            self.model.train(self.mode == "train")  # generate and inference: eval mode
        status, err, requested = _OK, None, 0
        t0 = time.perf_counter()
        try:
            self.backend.begin(b)
            for _ in range(n_steps):
                self._step(b)
            self.backend.sync()
        except Exception as e:  # classified; non-OOM errors re-raised below
            _clear_frames(e)
            oom = find_oom_error(e)
            if oom is not None:
                status, requested = _OOM, requested_bytes(str(oom))
            else:
                status, err = _ERROR, e
            oom = None  # holds no exception past this block
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


def _input_factory(shape: Sequence[int], dtype: torch.dtype, value_range: Optional[Tuple[float, float]],
                   device: torch.device) -> Callable[[int], torch.Tensor]:
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    shape = tuple(int(s) for s in shape)

    def make(b: int) -> torch.Tensor:
        size = (b, *shape)
        if dtype == torch.bool:
            return torch.randint(0, 2, size, device=device, generator=gen).bool()
        if not (dtype.is_floating_point or dtype.is_complex):
            ilow, ihigh = (0, 2) if value_range is None else (int(value_range[0]), int(value_range[1]))
            return torch.randint(ilow, ihigh, size, device=device, dtype=dtype, generator=gen)
        if value_range is None:
            return torch.randn(size, device=device, dtype=dtype, generator=gen)
        low, high = value_range
        return torch.rand(size, device=device, dtype=dtype, generator=gen) * (high - low) + low

    return make
