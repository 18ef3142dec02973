"""Controls of gpumem's pools while gpumem is torch's CUDA allocator: ``trim``, ``set_cap``, ``cap``,
``validate``, and what they cost: ``driver_time``.

    >>> import gpumem                                  # first, before anything touches the GPU
    >>> released = gpumem.trim()                       # doctest: +SKIP
    >>> gpumem.set_cap(40 << 30)                       # doctest: +SKIP
    >>> gpumem.cap()                                   # doctest: +SKIP
    42949672960
    >>> gpumem.validate()                              # doctest: +SKIP
    >>> gpumem.driver_time()["map"]                    # doctest: +SKIP
    {'calls': 41, 'ms': 3.27}

Each takes ``device`` as an index, ``"cuda:1"``, a ``torch.device`` or None (the current device).
They act on the pools behind torch's allocations, so they need gpumem to *be* torch's allocator:
otherwise (no torch or a CPU-only one, the bridge not built, ``GPUMEM_DISABLE=1``, CUDA started before
``import gpumem``) they raise ``RuntimeError`` with ``gpumem.status_line()``'s explanation, and without a
CUDA device they say so.  For pools you build yourself, :class:`gpumem.Pool` has the same methods.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Tuple, Union

from . import _torch

if TYPE_CHECKING:
    import torch

    Device = Union[None, int, str, torch.device]
else:
    Device = Any

__all__ = ["trim", "set_cap", "cap", "validate", "driver_time"]


def _bridge_for(what: str, device: Device) -> Tuple[Any, int]:
    """The compiled bridge and the device index, or RuntimeError saying why gpumem cannot do ``what``."""
    if not _torch.is_active():
        raise RuntimeError(f"gpumem.{what}() acts on gpumem's pools as torch's CUDA allocator, and gpumem is "
                           f"not torch's allocator in this process ({_torch.status_line()})")
    torch = _torch._torch_with_cuda()
    if isinstance(torch, str):  # pragma: no cover - active implies a CUDA torch
        raise RuntimeError(f"gpumem.{what}(): {torch}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"gpumem.{what}(): no CUDA device is available "
                           f"(torch.cuda.is_available() is False)")
    return _torch._bridge, _torch._device_index(torch, device)


def trim(device: Device = None) -> int:
    """Give the device's cached free memory back to the device (``torch.cuda.empty_cache()`` for one
    device); returns the bytes released."""
    bridge, index = _bridge_for("trim", device)
    return int(bridge.trim(index))


def set_cap(nbytes: int, device: Device = None) -> None:
    """Bound the bytes gpumem reserves on the device (``0``: no cap, the device's memory is the bound).

    Cached memory above the cap goes back to the device at once; an allocation that would pass the
    cap raises ``torch.cuda.OutOfMemoryError``.  ``ValueError`` (and nothing changes) for a cap below
    what live tensors hold or below one page.  ``torch.cuda.set_per_process_memory_fraction`` sets a
    bound beside this one, as a fraction.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"gpumem.set_cap(nbytes): nbytes must be an int (bytes; 0 = no cap), not "
                        f"{type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"gpumem.set_cap(nbytes): nbytes must be >= 0 (0 = no cap), not {nbytes}")
    bridge, index = _bridge_for("set_cap", device)
    bridge.set_cap(index, nbytes)


def cap(device: Device = None) -> int:
    """The device's cap in bytes (``0``: none), as ``set_cap`` or ``GPUMEM_CONF``'s ``cap`` set it."""
    bridge, index = _bridge_for("cap", device)
    return int(bridge.cap(index))


def validate(device: Device = None) -> None:
    """Walk every block of the device's pools (private graph pools included) and check the pool's
    structures and statistics against them; raises an error naming the first inconsistency."""
    bridge, index = _bridge_for("validate", device)
    bridge.validate(index)


def driver_time(device: Device = None) -> Dict[str, Dict[str, float]]:
    """What the device's pools have spent in the driver and waiting for the device since the process
    started: per kind of call, ``{"calls": n, "ms": host milliseconds}``.

    ``map``: pages mapped (memory created or moved, access set); ``unmap``: pages unmapped and their
    memory released (its time also holds units kept for a map and released unused, which make no
    call of their own); ``segment``: whole regions taken and returned (``upstream:segments``); ``wait``:
    the host blocked until the device reached an event or drained a stream, before memory it may still
    use went back; ``event``: events recorded, polled and destroyed (never blocking). Under memory
    pressure these are what gpumem costs a step beyond PyTorch's allocator; take the difference of two
    calls around the steps you time::

        before = gpumem.driver_time()
        train_step()
        after = gpumem.driver_time()
        ms = {k: after[k]["ms"] - before[k]["ms"] for k in after}
    """
    bridge, index = _bridge_for("driver_time", device)
    return {kind: {"calls": int(calls), "ms": ns / 1e6}
            for kind, (calls, ns) in bridge.driver_time(index).items()}
