"""gpumem: a pooled CUDA allocator for PyTorch, and the tools around it.

``import gpumem`` makes gpumem's pool PyTorch's CUDA allocator (when torch has CUDA and has not
started it yet), so ``torch.cuda.memory_allocated()``, ``empty_cache()``, OOM errors and the rest
keep working and tell the truth about gpumem's pool.

    >>> import gpumem
    >>> gpumem.replay("trace.gz")            # doctest: +SKIP
"""
from __future__ import annotations

from . import _C
from ._C import OutOfMemoryError, Pool, SimulatedDevice
from .config import parse_config
from .replay import replay

__all__ = ["OutOfMemoryError", "Pool", "SimulatedDevice", "parse_config", "replay"]
__version__ = "0.1.0"
