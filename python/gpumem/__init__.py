"""gpumem: a pooled CUDA allocator for PyTorch, and the tools around it.

``import gpumem`` makes gpumem's pool PyTorch's CUDA allocator (when torch has CUDA and has not
started CUDA yet), so ``torch.cuda.memory_allocated()``, ``empty_cache()``, OOM errors and the rest
keep working and tell the truth about gpumem's pool. ``gpumem.status_line()`` says what is active.

    >>> import gpumem
    >>> gpumem.status_line()                                   # doctest: +SKIP
    >>> res = gpumem.find_batch_size(model, (1024,), dtype=torch.long)   # doctest: +SKIP
    >>> report = gpumem.cleanup()                              # doctest: +SKIP
    >>> print(gpumem.summary())                                # doctest: +SKIP

Importing gpumem never fails for lack of a GPU or of torch: the features that need them say so when
they are used.

What users call is ``gpumem.<name>`` (``__all__``); the underscored modules (``_C``, the compiled core;
``_bridge``, the compiled torch allocator; ``_torch``, its registration) are internals.

* torch's allocator: ``status_line()``, ``is_active()``, ``stats()``, ``trim()``, ``set_cap()``,
  ``cap()``, ``validate()``, ``driver_time()`` (host time in driver calls and waits), ``mem_pool()``
  (a ``torch.cuda.MemPool`` backed by gpumem, for when CUDA started first; ``pool`` is its former
  name, kept as an alias).
* Out of memory: allocations through torch raise ``torch.cuda.OutOfMemoryError``; direct use of
  ``Pool`` raises ``OutOfMemoryError`` (gpumem's core error); ``is_oom_error(exc)`` recognises both,
  and cuBLAS/cuDNN allocation failures.
* The core pool for direct use: ``Pool`` on a ``SimulatedDevice`` (no GPU needed) or on
  ``cuda_upstream(kind, device)``; ``validate()`` raises ``InvariantViolation``; ``parse_config``,
  ``replay``.
* Other GPU libraries from the same pool: ``gpumem.cupy.use()``, ``gpumem.numba.use()`` (or
  ``NUMBA_CUDA_MEMORY_MANAGER=gpumem.numba``), ``gpumem.rmm.use()``; ``stats()`` and ``summary()``
  show each library's live bytes.
* Tools: ``find_batch_size``, ``cleanup``, ``summary``, ``plot``, ``record``, ``report`` (one HTML
  page: timeline, largest allocations and their stacks, segments, holders, diagnosis),
  ``%load_ext gpumem``.
"""
from __future__ import annotations

from typing import Any

from . import _torch
from ._C import InvariantViolation, OutOfMemoryError, Pool, SimulatedDevice, cuda_upstream
from ._errors import is_oom_error
from .config import Config, parse_config
from .replay import replay

__version__ = "0.1.0"



def _imported_by_the_command_line() -> bool:
    """Is this import the command line's own (``python -m gpumem ...`` or the ``gpumem`` script)?

    Then a bad GPUMEM_CONF must not fail the import with a traceback: ``gpumem run`` reports it (exit
    2) before the script starts, and ``status``/``replay`` do not use torch's allocator at all."""
    import os
    import sys

    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 == "-m":  # `python -m X` while X is being located: is X this package?
        orig = list(getattr(sys, "orig_argv", None) or [])
        for i, a in enumerate(orig):
            if a == "-m":
                return orig[i + 1:i + 2] in (["gpumem"], ["gpumem.__main__"])
            if a in ("-mgpumem", "-mgpumem.__main__"):
                return True
        return False
    main = sys.modules.get("__main__")
    name = os.path.basename(argv0).lower()
    # the installed script itself, run as the program
    return (name in ("gpumem", "gpumem.exe", "gpumem-script.py")
            and getattr(main, "__file__", None) in (argv0, os.path.abspath(argv0)))


# Registers the pool as torch's CUDA allocator when it can; raises ValueError for a bad GPUMEM_CONF
# (except for the command line's own import, see above: there `install()` raises again when called).
try:
    _torch.install()
except ValueError:
    if not _imported_by_the_command_line():
        raise
from ._torch import is_active, mem_pool, pool, stats, status_line  # noqa: E402
from .allocator import cap, driver_time, set_cap, trim, validate  # noqa: E402

# These import torch only inside their functions. Imported here so that `gpumem.cleanup` is the
# function even after some module has imported the `gpumem.cleanup` submodule.
from .cleanup import CleanupReport, cleanup  # noqa: E402
from .ipython_ext import load_ipython_extension, unload_ipython_extension  # noqa: E402

# The report package imports only itself here (its modules load when report() is called); bound
# after the import so that `gpumem.report` is the function, as `gpumem.cleanup` is.
from .report import report  # noqa: E402
from .timeline import Timeline, record  # noqa: E402
from .views import plot, summary  # noqa: E402

# The batch-size probe and gpumem.distributed import torch at module level: imported when first
# used, so `import gpumem` works without torch.
_LAZY = {
    "find_batch_size": "batch_size",
    "find_max_length": "batch_size",
    "find_token_frontier": "batch_size",
    "TokenFrontier": "batch_size",
    "find_executable_batch_size": "batch_size",
    "BatchSizeResult": "batch_size",
    "BatchSizeError": "batch_size",
    "check_ranks": "distributed",
    "RankFailure": "distributed",
    "RankOutOfMemoryError": "distributed",
    # these import Lightning / transformers when first used
    "BatchSizeFinder": "batch_size.lightning",
    "scale_batch_size": "batch_size.lightning",
    "find_trainer_batch_size": "batch_size.hf",
}
_NEEDS = {"batch_size": "PyTorch", "distributed": "PyTorch with torch.distributed",
          "batch_size.lightning": "Lightning (pip install lightning)",
          "batch_size.hf": "transformers and accelerate (pip install transformers accelerate)"}


# The integrations with other GPU libraries, submodules imported on first use (``gpumem.cupy.use()``)
# so that `import gpumem` imports none of those libraries.
_INTEGRATIONS = ("cupy", "numba", "rmm")


def __getattr__(name: str) -> Any:
    if name in _INTEGRATIONS:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpumem' has no attribute {name!r}")
    import importlib

    try:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    except ImportError as e:
        raise ImportError(f"gpumem.{name} needs {_NEEDS[module]}, which could not be imported ({e}); "
                          f"install it, then use it") from e
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY) | set(_INTEGRATIONS))


__all__ = [
    # torch's CUDA allocator
    "status_line", "is_active", "stats", "trim", "set_cap", "cap", "validate", "driver_time", "mem_pool",
    "pool",
    # out of memory
    "OutOfMemoryError", "is_oom_error",
    # the core pool, for direct use
    "Pool", "SimulatedDevice", "cuda_upstream", "InvariantViolation", "Config", "parse_config", "replay",
    # tools
    "find_batch_size", "find_max_length", "find_token_frontier", "TokenFrontier",
    "find_executable_batch_size",
    "BatchSizeFinder", "scale_batch_size", "find_trainer_batch_size", "BatchSizeResult", "BatchSizeError",
    "cleanup", "CleanupReport", "summary", "plot",
    "Timeline", "record", "report", "load_ipython_extension", "unload_ipython_extension",
    # distributed training: one rank's failure made known to every rank
    "check_ranks", "RankFailure", "RankOutOfMemoryError",
]
