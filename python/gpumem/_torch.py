"""gpumem as PyTorch's CUDA allocator: registration at import, the scoped route, stats.

``install()`` (run by ``import gpumem``) makes gpumem torch's CUDA allocator when it can:

* ``GPUMEM_DISABLE=1``              -> nothing is registered; torch keeps its own allocator.
* ``GPUMEM_CONF`` is invalid        -> ``ValueError`` naming the key (checked first, GPU or not).
* no torch / CPU-only torch / the bridge (``gpumem._bridge``) not built -> gpumem still imports;
  ``status_line()`` says what is missing.
* CUDA already initialized          -> one warning saying what to do; ``with gpumem.mem_pool(): ...``
  still routes allocations to gpumem through ``torch.cuda.MemPool``.
* otherwise                         -> registered; with ``gc_on_oom:true`` ``gc.collect()`` runs before
  an allocation fails (not again while a collect a moment ago found nothing: ``_GcOnOom``; off by
  default, as PyTorch's allocator never collects), and NCCL's register hook is turned off on CUDA
  virtual memory (``_nccl_hook``).
"""
from __future__ import annotations

import contextlib
import gc
import os
import time
import warnings
from typing import Any, Dict, Iterator, Optional

from . import _nccl_hook
from ._optional import torch_or_reason

__all__ = ["install", "is_active", "mem_pool", "pool", "stats", "status_line"]

_DISABLE_VALUES = {"1", "true", "yes", "on"}

_status: str = "gpumem: the torch bridge has not been set up yet (gpumem._torch.install() not run)"
_installed = False
_warned = False
_bridge: Any = None
_bridge_ready = False
_bridge_config: Optional[Dict[str, Any]] = None  # GPUMEM_CONF as parsed when the bridge was initialized


def _disabled() -> bool:
    return os.environ.get("GPUMEM_DISABLE", "").strip().lower() in _DISABLE_VALUES


def _parse_conf(conf: str) -> Optional[Dict[str, Any]]:
    """Validates GPUMEM_CONF without a GPU; raises ValueError naming the key. None if the core
    extension is not importable (then the bridge validates it when it initializes)."""
    try:
        from .config import parse_config
    except ImportError:
        return None
    return dict(parse_config(conf))


def _import_bridge() -> Any:
    from . import _bridge as bridge

    return bridge


class _GcOnOom:
    """``gc.collect()`` before an allocation fails, skipped while it cannot help.

    A step near the limit can fail dozens of allocations in a row without Python running in between:
    cuDNN tries one algorithm after another when a workspace does not fit, and torch catches each
    failure. A collect costs tens of milliseconds in a process with a large heap (Lightning,
    transformers), so forty of them made one out-of-memory trial of a ResNet take seconds. A collect
    that found no garbage will find none again until Python has made new objects: the next one is
    skipped while fewer than ``NEW_OBJECTS`` container objects were made since, no automatic collection
    ran, and less than ``QUIET_S`` passed.
    """

    QUIET_S = 1.0
    NEW_OBJECTS = 100

    def __init__(self) -> None:
        self._found_nothing_at: Optional[float] = None
        self._count_after = (0, 0, 0)
        self.collected = 0  # collects run (statistics for tests and the curious)
        self.skipped = 0

    def __call__(self) -> None:
        now = time.monotonic()
        count = gc.get_count()
        if (self._found_nothing_at is not None and now - self._found_nothing_at < self.QUIET_S
                and count[1:] == self._count_after[1:]
                and count[0] - self._count_after[0] < self.NEW_OBJECTS):
            self.skipped += 1
            return
        found = gc.collect()
        self.collected += 1
        self._found_nothing_at = time.monotonic() if found == 0 else None
        self._count_after = gc.get_count()


_gc_collect = _GcOnOom()


def _init_bridge(torch: Any) -> Any:
    """The bridge, configured from GPUMEM_CONF (once)."""
    global _bridge, _bridge_ready, _bridge_config
    if _bridge_ready:
        return _bridge
    bridge = _import_bridge()
    conf = os.environ.get("GPUMEM_CONF", "")
    bridge.init(conf)
    parsed = _parse_conf(conf)
    if parsed is not None and parsed["gc_on_oom"]:
        bridge.set_oom_callback(_gc_collect)
    _bridge, _bridge_ready, _bridge_config = bridge, True, parsed
    return bridge


def _torch_with_cuda() -> Any:
    """torch, or a string saying why it cannot be used."""
    torch, why = torch_or_reason()
    if torch is None:
        return f"gpumem: PyTorch is not importable ({why}); the torch bridge is skipped"
    if getattr(torch.version, "cuda", None) is None:
        return (f"gpumem: PyTorch {torch.__version__} is a CPU-only build; the torch bridge is skipped "
                f"(install a CUDA build of torch and reinstall gpumem)")
    return torch


def install() -> str:
    """Registers gpumem as torch's CUDA allocator if it can; returns ``status_line()``.

    Raises ``ValueError`` (naming the key) for a bad ``GPUMEM_CONF``. Idempotent.
    """
    global _installed, _status, _warned
    if _installed:
        return _status
    if _disabled():
        _installed = True
        _status = "gpumem: disabled by GPUMEM_DISABLE=1; torch keeps its own CUDA allocator"
        return _status
    _parse_conf(os.environ.get("GPUMEM_CONF", ""))  # bad config: raise now, GPU or not
    _installed = True
    torch = _torch_with_cuda()
    if isinstance(torch, str):
        _status = torch
        return _status
    try:
        _import_bridge()
    except ImportError as e:
        _status = (f"gpumem: the torch bridge (gpumem._bridge) is not built ({e}); torch keeps its own "
                   f"allocator. Reinstall gpumem with torch {torch.__version__} installed to build it")
        return _status
    bridge = _init_bridge(torch)
    if bridge.is_current():
        _status = "gpumem: active as torch's CUDA allocator"
        return _status
    if torch.cuda.is_initialized():
        _status = ("gpumem: CUDA was initialized before gpumem was imported, so torch's own allocator "
                   "stays in charge; `with gpumem.mem_pool(): ...` routes allocations to gpumem")
        if not _warned:
            _warned = True
            warnings.warn(
                "gpumem could not become PyTorch's CUDA allocator because CUDA was already "
                "initialized in this process. Import gpumem before anything touches the GPU (first "
                "line of the script / first notebook cell, then restart the kernel), or use "
                "`with gpumem.mem_pool(): ...` (alias gpumem.pool) for the allocations that should "
                "come from gpumem.",
                RuntimeWarning, stacklevel=3)
        return _status
    bridge.register()
    _nccl_hook.turn_off_for_pages(_bridge_config)  # before any process group reads it
    _status = "gpumem: active as torch's CUDA allocator"
    return _status


def status_line() -> str:
    """One line: whether gpumem is torch's allocator, and if not, what is missing."""
    if not _installed and _disabled():
        return "gpumem: disabled by GPUMEM_DISABLE=1; torch keeps its own CUDA allocator"
    if _bridge_ready and _bridge.is_current():
        return "gpumem: active as torch's CUDA allocator"
    return _status


def is_active() -> bool:
    """True when gpumem is PyTorch's CUDA allocator in this process."""
    return bool(_bridge_ready and _bridge.is_current())


def active_config() -> Optional[Dict[str, Any]]:
    """The configuration of gpumem's pools while gpumem is PyTorch's CUDA allocator (``GPUMEM_CONF``
    as gpumem read it at start-up: setting the variable later changes nothing), else None."""
    return _bridge_config if is_active() else None


def _device_index(torch: Any, device: Any) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return d.index if d.index is not None else torch.cuda.current_device()


@contextlib.contextmanager
def mem_pool(device: Any = None) -> Iterator[Any]:
    """Allocations inside come from gpumem, even when CUDA started before ``import gpumem``.

    Uses ``torch.cuda.MemPool(allocator=gpumem)`` + ``torch.cuda.use_mem_pool``: torch's allocator
    carves its blocks from memory gpumem hands out. Yields the MemPool (None when gpumem already is
    the allocator, where this is a no-op). Tensors made inside stay valid after the block.
    """
    torch = _torch_with_cuda()
    if isinstance(torch, str):
        raise RuntimeError(torch)
    bridge = _init_bridge(torch)
    if bridge.is_current():
        yield None
        return
    index = _device_index(torch, device)
    with torch.cuda.device(index):
        mp = torch.cuda.MemPool(bridge.allocator())
    with torch.cuda.use_mem_pool(mp, device=index):
        yield mp


#: The former name of :func:`mem_pool`, kept as an alias.
pool = mem_pool


def stats(device: Any = None) -> Dict[str, Any]:
    """gpumem's pool stats of a device in ``torch.cuda.memory_stats()``'s flat shape, plus
    ``gpumem.cap_bytes`` (0 = no cap), ``gpumem.largest_free_bytes`` and, per library drawing from
    the pool (torch, cupy, numba, rmm), ``gpumem.library.<name>.current`` / ``.peak`` (live bytes),
    ``.allocations`` (live blocks) and ``.ooms``. torch's own ``memory_stats`` keeps torch's keys."""
    torch = _torch_with_cuda()
    if isinstance(torch, str):
        raise RuntimeError(torch)
    bridge = _init_bridge(torch)
    index = _device_index(torch, device)
    out = dict(bridge.device_stats(index))
    out["gpumem.cap_bytes"] = int(bridge.cap(index))
    out["gpumem.largest_free_bytes"] = int(bridge.largest_free(index))
    library_stats = getattr(bridge, "library_stats", None)  # (a bridge built before it had them)
    if library_stats is not None:
        for name, figures in library_stats(index).items():
            for key, value in figures.items():
                out[f"gpumem.library.{name}.{key}"] = int(value)
    return out
