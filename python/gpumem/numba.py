"""Numba's CUDA arrays from gpumem's pool: an External Memory Management (EMM) plugin.

    $ NUMBA_CUDA_MEMORY_MANAGER=gpumem.numba python script.py      # numba loads it by name

    >>> import gpumem.numba                                          # doctest: +SKIP
    >>> gpumem.numba.use()      # the same, from Python: before numba's first CUDA call

Device memory comes from the main pool of the context's device (Numba's own default stream, the
legacy stream 0: Numba's EMM interface has no stream), so it is reused by torch and CuPy, one cap
covers all, and ``gpumem.stats()`` counts Numba's live bytes apart (``gpumem.library.numba.*``).
Pinned and mapped host memory stay Numba's (``HostOnlyCUDAMemoryManager``). Out of memory: the pool
releases its cache and runs the OOM callbacks (``gc.collect`` with ``gc_on_oom:true``), then Numba's
``CudaAPIError`` with ``CUDA_ERROR_OUT_OF_MEMORY`` is raised, as Numba's own allocator raises it.

IPC handles (``get_ipc_handle``) need memory from ``cudaMalloc``: with gpumem's default virtual-memory
pages they raise, saying to set ``GPUMEM_CONF=upstream:segments``.

``_numba_memory_manager`` (what ``NUMBA_CUDA_MEMORY_MANAGER`` looks up) is built on first access, so
this module imports without numba; ``use()`` raises ``ImportError`` naming numba-cuda when absent.
"""
from __future__ import annotations

import ctypes
import weakref
from typing import Any, Optional

from ._integrations import LIBRARY_IDS, bridge_for, require

__all__ = ["memory_manager", "use"]

_LIBRARY = LIBRARY_IDS["numba"]
_manager: Optional[type] = None


def _numba_cuda(what: str) -> Any:
    return require("numba.cuda", "numba-cuda", what)


def memory_manager() -> type:
    """The EMM plugin class (a ``numba.cuda.HostOnlyCUDAMemoryManager``), for
    ``numba.cuda.set_memory_manager``."""
    global _manager
    if _manager is not None:
        return _manager
    cuda = _numba_cuda("gpumem.numba")
    from numba.cuda.cudadrv import driver as drv

    binding = getattr(drv, "binding", None)
    if binding is not None:
        oom_code: Any = binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    else:  # numba's ctypes driver
        from numba.cuda.cudadrv import enums

        oom_code = enums.CUDA_ERROR_OUT_OF_MEMORY

    def device_pointer(ptr: int) -> Any:
        if ptr or binding is None:
            return ctypes.c_void_p(ptr)
        return binding.CUdeviceptr(0)  # c_void_p(0).value is None, which numba cannot convert

    ipc_mixin: Any = cuda.GetIpcHandleMixin
    host_only: Any = cuda.HostOnlyCUDAMemoryManager

    class GpumemNumbaMemoryManager(ipc_mixin, host_only):
        """Numba's device allocations from gpumem's pool (see ``gpumem.numba``)."""

        def initialize(self) -> None:
            self._bridge = bridge_for("gpumem.numba")

        def _device(self) -> int:
            return int(self.context.device.id)

        def memalloc(self, size: int) -> Any:
            bridge = getattr(self, "_bridge", None) or bridge_for("gpumem.numba")
            try:
                block = bridge.foreign_block(_LIBRARY, size, self._device(), 0)
            except bridge.ForeignOutOfMemoryError as e:
                raise drv.CudaAPIError(oom_code, str(e.args[0])) from e
            # The finalizer is the block's free: called when numba drops the MemoryPointer.
            return cuda.MemoryPointer(weakref.proxy(self.context), device_pointer(block.ptr), size,
                                      finalizer=block)

        def get_memory_info(self) -> Any:
            bridge = getattr(self, "_bridge", None) or bridge_for("gpumem.numba")
            free, total = bridge.memory_info(self._device())
            return cuda.MemoryInfo(free=int(free), total=int(total))

        def get_ipc_handle(self, memory: Any) -> Any:
            try:
                return super().get_ipc_handle(memory)
            except drv.CudaAPIError as e:
                raise RuntimeError(
                    "gpumem.numba: this block cannot be shared through CUDA IPC: gpumem's pool maps "
                    "virtual-memory pages, which cuIpcGetMemHandle refuses. Set "
                    "GPUMEM_CONF=upstream:segments (cudaMalloc segments) before the first "
                    f"allocation to share Numba arrays between processes ({e})") from e

        @property
        def interface_version(self) -> int:
            return 1

    _manager = GpumemNumbaMemoryManager
    return _manager


def use() -> None:
    """Make gpumem Numba's memory manager (``numba.cuda.set_memory_manager``). Call it before Numba
    first uses CUDA: contexts created earlier keep the manager they started with."""
    cuda = _numba_cuda("gpumem.numba.use()")
    bridge_for("gpumem.numba.use()")  # says now, not at the first allocation, when gpumem cannot
    cuda.set_memory_manager(memory_manager())


def __getattr__(name: str) -> Any:
    # NUMBA_CUDA_MEMORY_MANAGER=gpumem.numba: numba reads this attribute after importing the module.
    if name == "_numba_memory_manager":
        return memory_manager()
    raise AttributeError(f"module 'gpumem.numba' has no attribute {name!r}")
