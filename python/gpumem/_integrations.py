"""What the integrations (``gpumem.cupy``, ``gpumem.numba``, ``gpumem.rmm``) share: importing the
other library or saying which package is missing, the compiled bridge they allocate through, and the
per-library figures ``gpumem.stats()`` and the views show.

Each library's blocks come from the device's main pool, the one torch's allocations use when gpumem
is torch's allocator (``csrc/torch_bridge/foreign.cpp``): one cap, one cache, one OOM path.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Dict

__all__ = ["LIBRARY_IDS", "require", "bridge_for", "library_stats"]

#: The bridge's library tags (``gpumem._bridge.LIBRARIES`` in this order).
LIBRARY_IDS = {"torch": 0, "cupy": 1, "numba": 2, "rmm": 3}


def require(module: str, package: str, what: str) -> ModuleType:
    """``module`` imported, or ``ImportError`` naming the ``package`` to install for ``what``."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{what} needs {package}, which could not be imported ({type(e).__name__}: "
                          f"{e}); install it (pip install {package}) or leave {what} out",
                          name=module) from e


def bridge_for(what: str) -> Any:
    """The compiled bridge (``gpumem._bridge``), configured from ``GPUMEM_CONF``, or ``RuntimeError``
    saying why ``what`` cannot use gpumem's pool (no CUDA torch, the bridge not built, gpumem
    disabled)."""
    from . import _torch

    if _torch._disabled():
        raise RuntimeError(f"{what}: gpumem is disabled by GPUMEM_DISABLE=1 in this process")
    torch = _torch._torch_with_cuda()
    if isinstance(torch, str):
        raise RuntimeError(f"{what}: {torch}")
    try:
        return _torch._init_bridge(torch)
    except ImportError as e:
        raise RuntimeError(f"{what}: the torch bridge (gpumem._bridge) is not built ({e}); reinstall "
                           f"gpumem with a CUDA build of torch installed") from e


def library_stats(bridge: Any, device: int) -> Dict[str, Dict[str, int]]:
    """``{"torch": {"current", "peak", "allocations", "ooms"}, "cupy": ..., "numba": ..., "rmm": ...}``
    for ``device``: live bytes (rounded to 512, as ``allocated_bytes``) and their peak since the last
    ``torch.cuda.reset_peak_memory_stats``."""
    return {name: {k: int(v) for k, v in d.items()} for name, d in bridge.library_stats(device).items()}
