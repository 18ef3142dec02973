"""RMM (and the RAPIDS libraries on it: cuDF, cuML, ...) from gpumem's pool.

    >>> import gpumem.rmm                                   # doctest: +SKIP
    >>> gpumem.rmm.use()        # rmm.mr.set_current_device_resource(gpumem's resource)
    >>> buf = rmm.DeviceBuffer(size=1 << 20)                # from gpumem's pool

``memory_resource()`` is an ``rmm.mr.CallbackMemoryResource`` whose callbacks allocate on the stream
RMM names, from the device's main pool (the one torch's allocations use), and free stream-ordered:
a block freed on another stream than its own waits for that stream's work before reuse. One cap
covers RMM, torch, CuPy and Numba; ``gpumem.stats()`` counts RMM's live bytes apart. Out of memory:
the pool releases its cache and runs the OOM callbacks (``gc.collect`` with ``gc_on_oom:true``), then
``MemoryError`` (which RMM passes on as ``MemoryError``).

Each call goes through Python (RMM's callback resource), which costs more per allocation than RMM's
own C++ pools: ``bench/mixed_pipeline.py`` measures it. Without RMM installed, ``use()`` raises
``ImportError`` naming it.
"""
from __future__ import annotations

from typing import Any, Optional

from ._integrations import LIBRARY_IDS, bridge_for, require

__all__ = ["memory_resource", "use"]

_LIBRARY = LIBRARY_IDS["rmm"]


def _rmm(what: str) -> Any:
    return require("rmm", "rmm (rmm-cu12 / rmm-cu13)", what)


def _stream_handle(stream: Any) -> int:
    """The cudaStream_t of RMM's ``Stream`` (the CUDA stream protocol), or of an int."""
    if isinstance(stream, int):
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is None:
        raise TypeError(f"gpumem.rmm: cannot read the CUDA stream of {stream!r} (it has no "
                        f"__cuda_stream__; RMM 25.02 or later has it)")
    return int(proto()[1])


def memory_resource(device: Optional[int] = None) -> Any:
    """An ``rmm.mr.CallbackMemoryResource`` backed by gpumem's pool of ``device`` (default: the
    current CUDA device)."""
    rmm = _rmm("gpumem.rmm.memory_resource()")
    bridge = bridge_for("gpumem.rmm.memory_resource()")
    if device is None:
        from ._torch import _torch_with_cuda

        device = int(_torch_with_cuda().cuda.current_device())
    index = int(device)
    alloc, free, foreign_oom = bridge.foreign_alloc, bridge.foreign_free, bridge.ForeignOutOfMemoryError

    def allocate(size: int, stream: Any) -> int:
        try:
            return int(alloc(_LIBRARY, size, index, _stream_handle(stream)))
        except foreign_oom as e:
            raise MemoryError(str(e.args[0])) from e

    def deallocate(ptr: int, size: int, stream: Any) -> None:
        if ptr:
            free(ptr, _stream_handle(stream))

    return rmm.mr.CallbackMemoryResource(allocate, deallocate)


def use(device: Optional[int] = None) -> Any:
    """Make gpumem RMM's resource for ``device`` (default: the current device:
    ``rmm.mr.set_current_device_resource``); returns the resource it set."""
    rmm = _rmm("gpumem.rmm.use()")
    mr = memory_resource(device)
    if device is None:
        rmm.mr.set_current_device_resource(mr)
    else:
        rmm.mr.set_per_device_resource(int(device), mr)
    return mr
