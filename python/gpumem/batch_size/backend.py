"""Memory backends: the device the trials run on, its limits, its peaks, and the ballast.

:class:`_CudaBackend` reads ``torch.cuda`` statistics (so it works with gpumem's allocator or
PyTorch's own) and holds the *ballast*, a tensor that takes everything above the target so a trial
that passes fits with the margin to spare.  Tests substitute a simulated :class:`_Backend` to drive
the real step runner on a CPU model.
"""
from __future__ import annotations

import gc
from typing import Optional, Tuple

import torch

from .verify import FLOOR_MIN_BYTES


class _Backend:
    """Memory operations of the device the trials run on (CUDA here; tests substitute
    a simulated one to drive the real step runner on a CPU model)."""

    device: torch.device

    def clean(self, collect: bool = True) -> None:
        if collect:
            gc.collect()

    def reserved(self) -> int:
        return 0

    def allocated(self) -> int:
        return 0

    def limits(self) -> Tuple[int, int]:
        """(bytes the allocator may use in all, total device bytes), after clean()."""
        raise NotImplementedError

    def floor_min_bytes(self) -> int:
        """The smallest floor of the measured margin for this allocator (see verify.py)."""
        return FLOOR_MIN_BYTES

    def hold(self, ballast: int) -> None:
        """Allocate the ballast (held across all trials, released by release())."""

    def release(self) -> None:
        """Free the ballast."""

    def begin(self, batch_size: int) -> None:
        """Reset the peak statistics before a trial."""

    def sync(self) -> None:
        """Inside the trial's try block: wait for the device (raises late errors)."""

    def end(self) -> Tuple[int, Optional[int]]:
        """(peak allocated, peak reserved) since begin(), the ballast excluded."""
        raise NotImplementedError

    def after(self, reserved_before: int) -> None:
        self.clean()


class _CudaBackend(_Backend):
    def __init__(self, device: torch.device):
        self.device = device
        self._b_alloc = 0
        self._b_res = 0
        self._ballast: Optional[torch.Tensor] = None

    def clean(self, collect: bool = True) -> None:
        if collect:  # only needed for reference cycles (a failed step's frames); costs ~0.1 s
            gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def limits(self) -> Tuple[int, int]:
        self.clean()
        free, total = torch.cuda.mem_get_info(self.device)
        limit = self.reserved() + free
        frac = None
        if hasattr(torch.cuda, "get_per_process_memory_fraction"):
            try:
                frac = float(torch.cuda.get_per_process_memory_fraction(self.device))
            except Exception:  # an allocator without the notion
                frac = None
        if frac is not None and 0 < frac < 1:
            limit = min(limit, int(frac * total))
        return int(limit), int(total)

    def floor_min_bytes(self) -> int:
        from .. import _torch
        from ..config import maps_pages

        conf = _torch.active_config()  # the pool's own, when gpumem is torch's allocator
        if conf is not None and maps_pages(conf):  # CUDA virtual memory: it rounds to pages
            return int(conf["page_size"])
        return FLOOR_MIN_BYTES  # PyTorch's allocator, or gpumem's whole segments (not measured)

    def hold(self, ballast: int) -> None:
        a0, r0 = self.allocated(), self.reserved()
        if ballast > 0:
            self._ballast = torch.empty(ballast, dtype=torch.uint8, device=self.device)
        self._b_alloc, self._b_res = self.allocated() - a0, self.reserved() - r0

    def release(self) -> None:
        self._ballast = None
        self._b_alloc = self._b_res = 0

    def begin(self, batch_size: int) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def end(self) -> Tuple[int, Optional[int]]:
        return (torch.cuda.max_memory_allocated(self.device) - self._b_alloc,
                torch.cuda.max_memory_reserved(self.device) - self._b_res)

    def after(self, reserved_before: int) -> None:
        self.clean(collect=False)
        if self.reserved() > reserved_before:
            self.clean()
        if self.reserved() > reserved_before:
            # cuBLAS workspaces created during the trials live in the allocator's pool
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
                self.clean(collect=False)
