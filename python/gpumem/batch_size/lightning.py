"""Lightning: ``gpumem.BatchSizeFinder`` (a drop-in for ``lightning.pytorch.callbacks.BatchSizeFinder``)
and ``gpumem.scale_batch_size`` (for ``Tuner(trainer).scale_batch_size``).

The callback *is* Lightning's ``BatchSizeFinder`` (a subclass): the same hooks (``on_fit_start``,
``on_validation_start``, ``on_test_start``, ``on_predict_start``), the same checks in ``setup``, the
same way of setting the size (``lightning_setattr``: ``model.<name>``, ``model.hparams.<name>`` or
the datamodule's), and the same preparation and restoration of the trainer around the trials (its
checkpoint, loggers, callbacks, limits and loop state, through ``lightning.pytorch.tuner.
batch_size_scaling``'s own helpers).  Only the search differs: a trial is Lightning's loop run for
``steps_per_trial`` steps at a size, and gpumem's search (:func:`gpumem.find_batch_size` with that
loop as ``step_fn``: the cap at the target, the fitted line, the measured margin, the verification)
picks the sizes, instead of doubling.  ``target_batch`` also sets ``trainer.accumulate_grad_batches``.

Imports Lightning (``lightning`` or the older ``pytorch_lightning``) when first used.
"""
from __future__ import annotations

import importlib
import inspect
import os
import uuid
from typing import Any, Callable, Optional

import torch

from .api import find_batch_size
from .backend import _CudaBackend
from .results import BatchSizeResult


def _lightning() -> Any:
    """``lightning.pytorch``, else the older ``pytorch_lightning`` (typed Any: either may be absent)."""
    try:
        return importlib.import_module("lightning.pytorch")
    except ImportError:
        return importlib.import_module("pytorch_lightning")


pl: Any = _lightning()


def _sub(name: str) -> Any:
    """A submodule of whichever Lightning package was imported."""
    return importlib.import_module(f"{pl.__name__}.{name}")


_LightningFinder: Any = _sub("callbacks").BatchSizeFinder
_bss: Any = _sub("tuner.batch_size_scaling")
lightning_setattr: Any = _sub("utilities.parsing").lightning_setattr


__all__ = ["BatchSizeFinder", "scale_batch_size"]

# Lightning's module-level helpers with two leading underscores (not name-mangled at module level).
_dump = getattr(_bss, "__scale_batch_dump_params")
_reset = getattr(_bss, "__scale_batch_reset_params")
_restore = getattr(_bss, "__scale_batch_restore_params")


class BatchSizeFinder(_LightningFinder):
    """Lightning's ``BatchSizeFinder`` with gpumem's search.

    Args (Lightning's, same meaning): ``steps_per_trial``, ``init_val`` (the smallest size
    searched), ``max_trials``, ``batch_arg_name``, ``max_val`` (the largest).  gpumem's:
    ``margin`` (``None``: measured), ``verify_steps`` (the answer's final verification, in loop
    runs of ``steps_per_trial`` steps each; default 1), ``target_batch`` (micro-batch plus
    ``trainer.accumulate_grad_batches``), ``max_memory``, ``verbose``, ``log``.

    After a search: ``optimal_batch_size`` (what was set), ``accumulation_steps`` and ``result``
    (the :class:`gpumem.BatchSizeResult`).
    """

    def __init__(self, steps_per_trial: int = 3, init_val: int = 2, max_trials: int = 25,
                 batch_arg_name: str = "batch_size", max_val: int = 8192, *, margin: Optional[float] = None,
                 verify_steps: int = 1, target_batch: Optional[int] = None, max_memory: Any = None,
                 verbose: bool = True, log: Optional[Callable[[str], None]] = None) -> None:
        kw = dict(mode="power", steps_per_trial=steps_per_trial, init_val=init_val, max_trials=max_trials,
                  batch_arg_name=batch_arg_name, max_val=max_val)
        accepted = inspect.signature(_LightningFinder.__init__).parameters
        super().__init__(**{k: v for k, v in kw.items() if k in accepted})
        if not isinstance(init_val, int) or init_val < 1:
            raise ValueError(f"init_val must be an int >= 1, not {init_val!r}")
        if not isinstance(max_val, int) or max_val < init_val:
            raise ValueError(f"max_val must be an int >= init_val ({init_val}), not {max_val!r}")
        if not isinstance(steps_per_trial, int) or steps_per_trial < 1:
            raise ValueError(f"steps_per_trial must be an int >= 1, not {steps_per_trial!r}")
        self._gm = dict(margin=margin, verify_steps=verify_steps, target_batch=target_batch,
                        max_memory=max_memory, verbose=verbose, log=log)
        self._steps = steps_per_trial
        self._lo, self._hi, self._name = init_val, max_val, batch_arg_name
        self.result: Optional[BatchSizeResult] = None
        self.accumulation_steps: Optional[int] = None

    def scale_batch_size(self, trainer: Any, pl_module: Any) -> None:
        if trainer.fast_dev_run:
            _sub("utilities.rank_zero").rank_zero_warn(
                "Skipping batch size scaler since `fast_dev_run` is enabled.")
            return
        self.result = res = self._search(trainer, pl_module)
        size = res.batch_size if res.micro_batch_size is None else res.micro_batch_size
        lightning_setattr(pl_module, self._name, size)
        if res.accumulation_steps is not None:
            trainer.accumulate_grad_batches = res.accumulation_steps
            self.accumulation_steps = res.accumulation_steps
        _bss._reset_dataloaders(trainer)  # the loop's loaders at the new size
        self.optimal_batch_size = size
        if self._early_exit:
            raise _sub("utilities.exceptions")._TunerExitException()

    def _search(self, trainer: Any, pl_module: Any) -> BatchSizeResult:
        # As Lightning's _scale_batch_size: a checkpoint to return to, the trainer's settings saved,
        # set for short runs (steps_per_trial steps, no loggers or callbacks), and put back after.
        ckpt_path = os.path.join(trainer.default_root_dir, f".scale_batch_size_{uuid.uuid4()}.ckpt")
        trainer.save_checkpoint(ckpt_path)
        params = _dump(trainer)
        _reset(trainer, self._steps)
        # Lightning's reset limits the fit and evaluation loops only: a prediction loop would run its
        # whole dataset per trial. Limited here too, and put back after.
        predicting = type(trainer._active_loop).__name__ == "_PredictionLoop"
        limit_predict = trainer.limit_predict_batches
        if predicting:
            trainer.limit_predict_batches = self._steps
        if trainer.progress_bar_callback:
            trainer.progress_bar_callback.disable()
        hi = self._hi
        try:
            loop = trainer._active_loop
            loop.setup_data()
            try:  # Lightning never tries a size beyond the dataset (its _adjust_batch_size)
                n = loop._combined_loader._dataset_length()
                hi = max(self._lo, min(hi, int(n)))
            except (NotImplementedError, AttributeError, TypeError):
                pass

            def run_loop(b: int) -> None:
                lightning_setattr(pl_module, self._name, b)
                _bss._reset_dataloaders(trainer)
                _bss._reset_progress(trainer)
                _bss._try_loop_run(trainer, params)

            kw = dict(self._gm)
            if kw["target_batch"] is not None:
                hi = min(hi, kw["target_batch"])
            res = find_batch_size(pl_module, step_fn=run_loop, steps=1, min_batch=self._lo, max_batch=hi,
                                  **kw)
        finally:
            if predicting:
                trainer.limit_predict_batches = limit_predict
            _restore(trainer, params)
            if trainer.progress_bar_callback:
                trainer.progress_bar_callback.enable()
            trainer._checkpoint_connector.restore(ckpt_path)
            trainer.strategy.remove_checkpoint(ckpt_path)
        # The trials ran Lightning's own optimizer, so its state (Adam's moments) lived until the
        # checkpoint put the optimizer back, after find_batch_size measured: measure again now, once
        # the memory of the trials is really gone.
        backend = _backend_for(pl_module)
        if backend is not None:
            backend.after(res.reserved_before)
            res.reserved_after = int(backend.reserved())
        return res


def _backend_for(pl_module: Any) -> Optional[_CudaBackend]:
    """The CUDA backend of the module's device (None off CUDA: nothing to measure there)."""
    device = getattr(pl_module, "device", None)
    if not isinstance(device, torch.device) or device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _CudaBackend(device)


def scale_batch_size(trainer: Any, model: Any, train_dataloaders: Any = None,
                     val_dataloaders: Any = None, dataloaders: Any = None, datamodule: Any = None,
                     method: str = "fit", steps_per_trial: int = 3, init_val: int = 2, max_trials: int = 25,
                     batch_arg_name: str = "batch_size", max_val: int = 8192,
                     **gpumem_kwargs: Any) -> Optional[int]:
    """``Tuner(trainer).scale_batch_size(model, ...)`` with gpumem's search: runs ``method`` only as
    far as the search (then stops, as the Tuner does) and returns the size set on the model or
    datamodule.  ``gpumem_kwargs``: :class:`BatchSizeFinder`'s (``margin``, ``target_batch``, ...)."""
    tuning = _sub("tuner.tuning")
    tuning._check_tuner_configuration(train_dataloaders, val_dataloaders, dataloaders, method)
    tuning._check_scale_batch_size_configuration(trainer)
    finder = BatchSizeFinder(steps_per_trial=steps_per_trial, init_val=init_val, max_trials=max_trials,
                             batch_arg_name=batch_arg_name, max_val=max_val, **gpumem_kwargs)
    finder._early_exit = True
    trainer.callbacks = [finder, *trainer.callbacks]
    try:
        if method == "fit":
            trainer.fit(model, train_dataloaders, val_dataloaders, datamodule)
        elif method == "validate":
            trainer.validate(model, dataloaders, datamodule=datamodule)
        elif method == "test":
            trainer.test(model, dataloaders, datamodule=datamodule)
        elif method == "predict":
            trainer.predict(model, dataloaders, datamodule=datamodule)
    finally:
        trainer.callbacks = [cb for cb in trainer.callbacks if cb is not finder]
    scale_batch_size.last_finder = finder  # type: ignore[attr-defined]
    return finder.optimal_batch_size if finder.result is not None else None

