"""Hugging Face ``Trainer``: ``gpumem.find_trainer_batch_size(trainer)`` before ``trainer.train()``.

``TrainingArguments(auto_find_batch_size=True)`` makes ``Trainer.train`` wrap its inner training loop
in ``transformers.trainer_utils.find_executable_batch_size``, which hands it to Accelerate's
decorator: the whole training run is the trial, it starts at ``per_device_train_batch_size`` and
shrinks by 0.9x on each OOM, with the failed run's memory left to the garbage collector.

Here instead, before training, the trainer's own step (``trainer.compute_loss`` on a batch that its
``data_collator`` builds from its ``train_dataset``, backward, the optimizer ``Trainer`` would create,
under the autocast ``bf16`` / ``fp16`` ask for) is searched with :func:`gpumem.find_batch_size`, and
the answer set: ``args.per_device_train_batch_size`` (and ``gradient_accumulation_steps`` for a
``target_batch``).  With ``auto_find_batch_size=True`` the safety net stays, done right: this
trainer's ``train()`` gets gpumem's :func:`find_executable_batch_size` (starting at the answer,
frames freed between tries, only OOM retried) in place of Accelerate's; other trainers are untouched.

Batches are made of the longest sample among the first ``scan`` of the dataset, repeated: a padding
collator pads to the longest sample of a batch, so that is the batch that must fit.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional

import torch

from .api import find_batch_size
from .decorator import find_executable_batch_size
from .results import BatchSizeResult

__all__ = ["find_trainer_batch_size"]

# trainers whose train() uses gpumem's decorator -> its progress settings (verbose, log)
_ours: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_original: Dict[str, Any] = {}


def _sample_len(item: Any) -> int:
    if isinstance(item, dict):
        for k in ("input_ids", "input_values", "pixel_values", "inputs_embeds"):
            if k in item:
                v = item[k]
                return int(v.numel()) if torch.is_tensor(v) else len(v)
        return max((len(v) for v in item.values() if hasattr(v, "__len__")), default=0)
    return len(item) if hasattr(item, "__len__") else 0


def _to(x: Any, device: torch.device) -> Any:
    if torch.is_tensor(x):
        return x.to(device)
    if isinstance(x, dict) or hasattr(x, "items"):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    return x


def _set_arg(args: Any, name: str, value: Any) -> None:
    try:
        setattr(args, name, value)
    except Exception:  # TrainingArguments frozen in some releases
        object.__setattr__(args, name, value)


def find_trainer_batch_size(trainer: Any, *, target_batch: Optional[int] = None, scan: int = 1024,
                            steps: int = 3, **kwargs: Any) -> BatchSizeResult:
    """The largest per-device batch of ``trainer``'s training step; sets it on ``trainer.args``.

    ``target_batch``: samples per optimizer step per device; sets ``per_device_train_batch_size``
    to the micro-batch and ``gradient_accumulation_steps`` to the steps.  Other keyword arguments:
    :func:`gpumem.find_batch_size`'s (``margin``, ``verify_steps``, ``max_memory``, ``verbose``, ...).
    """
    args = trainer.args
    model = trainer.model
    ds = trainer.train_dataset
    if ds is None:
        raise ValueError("find_trainer_batch_size needs trainer.train_dataset")
    try:
        n = len(ds)
    except TypeError as e:
        raise ValueError("find_trainer_batch_size needs a train_dataset with a length (map-style)") from e
    if n == 0:
        raise ValueError("trainer.train_dataset is empty")
    if not isinstance(scan, int) or scan < 1:
        raise ValueError(f"scan must be an int >= 1, not {scan!r}")
    longest = max(range(min(n, scan)), key=lambda i: _sample_len(ds[i]))
    sample = ds[longest]
    if isinstance(sample, dict) and getattr(args, "remove_unused_columns", False):
        # Trainer's loader keeps only the columns its model's forward takes, and the labels
        keep = set()
        try:
            trainer._set_signature_columns_if_needed()
            keep = set(trainer._signature_columns or ())
        except Exception:  # a Trainer without that private helper: keep every column
            pass
        if keep:
            keep |= {"label", "label_ids", "labels", *(getattr(args, "label_names", None) or ())}
            sample = {k: v for k, v in sample.items() if k in keep}
    collate = trainer.data_collator
    device = next(model.parameters()).device
    if getattr(args, "gradient_checkpointing", False) and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=getattr(args, "gradient_checkpointing_kwargs", None) or {})
    try:
        cls, okw = type(trainer).get_optimizer_cls_and_kwargs(args, model)
        opt = cls([p for p in model.parameters() if p.requires_grad], **okw)
    except Exception:  # an optimizer name this helper cannot build: AdamW, Trainer's default
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate)
    amp = torch.bfloat16 if getattr(args, "bf16", False) else (torch.float16 if getattr(args, "fp16", False)
                                                                 else None)

    def step(b: int) -> None:
        inputs = _to(collate([sample] * b), device)
        model.train()
        with torch.autocast("cuda", dtype=amp) if amp is not None else _Null():
            loss = trainer.compute_loss(model, inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    res = find_batch_size(model, step_fn=step, optimizer=opt, steps=steps, target_batch=target_batch,
                          **kwargs)
    micro = res.micro_batch_size or res.batch_size
    _set_arg(args, "per_device_train_batch_size", micro)
    if res.accumulation_steps is not None:
        _set_arg(args, "gradient_accumulation_steps", res.accumulation_steps)
    trainer._train_batch_size = args.train_batch_size
    if getattr(args, "auto_find_batch_size", False):
        _install(trainer, verbose=kwargs.get("verbose", True), log=kwargs.get("log"))
    return res


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _install(trainer: Any, verbose: bool, log: Optional[Callable[[str], None]]) -> None:
    """Route this trainer's ``auto_find_batch_size`` through gpumem's decorator."""
    import transformers.trainer as tt

    _ours[trainer] = (verbose, log)
    if "fn" in _original:
        return
    original = tt.find_executable_batch_size
    _original["fn"] = original

    def dispatch(function: Any = None, starting_batch_size: int = 128,
                 auto_find_batch_size: bool = False) -> Any:
        owner = getattr(function, "__self__", None)
        if function is not None and auto_find_batch_size and owner is not None and owner in _ours:
            loud, to = _ours[owner]
            return find_executable_batch_size(function, starting_batch_size=starting_batch_size,
                                              verbose=loud, log=to)
        return original(function, starting_batch_size=starting_batch_size,
                        auto_find_batch_size=auto_find_batch_size)

    tt.find_executable_batch_size = dispatch
