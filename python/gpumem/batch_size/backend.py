"""Memory backends: the device the trials run on, its limits, its peaks, and the trials' bound.

:class:`_CudaBackend` reads ``torch.cuda`` statistics (so it works with gpumem's allocator or
PyTorch's own) and bounds the trials with the per-process memory fraction at the target, so a trial
that passes fits under a cap at the budget with the margin to spare.  Tests substitute a simulated
:class:`_Backend` to drive the real step runner on a CPU model.

Why a cap and not a *ballast* (a tensor taking everything above the target, as before): a trial must
answer for the process as the user runs it, capped at the budget (``set_per_process_memory_fraction``
or ``gpumem.set_cap``), and gpumem's pool packs differently next to a ballast in its own pages than
under a cap. On two H200s (DDP, a 29 M-parameter MLP with AdamW, the last rank's budget 1.5 GiB) a
size whose trials passed next to the ballast, with 1.008x its peak allocated bytes of room, ran out of
memory 3 steps later capped at the budget (1.013x). The CPU replay of that step's trace agrees: under a
limit it needs 1.018x its peak live bytes. A cap also leaves the rest of the device free, for
compute-sanitizer's launches and for NCCL's buffers, which the ballast took. An allocator plugged into
torch that may ignore the fraction (neither gpumem nor PyTorch's own) still gets the ballast.
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

    def bound(self, target: int, limit: int) -> None:
        """Hold the allocator to ``target`` bytes for the trials (lifted by unbound()); ``limit`` is
        what it may use at all (limits())."""

    def unbound(self) -> None:
        """Lift bound()'s cap: the bound the process had before applies again."""

    def capped(self) -> bool:
        """Whether bound() capped the allocator (its reserved peaks then sit at the cap, see verify)."""
        return False

    def begin(self, batch_size: int) -> None:
        """Reset the peak statistics before a trial."""

    def sync(self) -> None:
        """Inside the trial's try block: wait for the device (raises late errors)."""

    def end(self) -> Tuple[int, Optional[int]]:
        """(peak allocated, peak reserved) since begin(), a ballast excluded."""
        raise NotImplementedError

    def after(self, reserved_before: int) -> None:
        self.clean()


class _CudaBackend(_Backend):
    def __init__(self, device: torch.device):
        self.device = device
        self._fraction_before: Optional[float] = None  # while bound() by the fraction: the one to restore
        self._ballast: Optional[torch.Tensor] = None  # while bound() by a ballast (other allocators)
        self._b_alloc = self._b_res = 0  # the ballast's allocated and reserved bytes

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
        try:
            frac = float(torch.cuda.get_per_process_memory_fraction(self.device))
        except Exception:  # an allocator plugged into torch without the notion
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

    def bound(self, target: int, limit: int) -> None:
        if self._fraction_honoured():
            # The fraction the process had (1.0 unless the user capped it) comes back in unbound();
            # both allocators turn a fraction of bytes / total back into those bytes.
            total = torch.cuda.mem_get_info(self.device)[1]
            self._fraction_before = float(torch.cuda.get_per_process_memory_fraction(self.device))
            torch.cuda.set_per_process_memory_fraction(min(1.0, target / total), self.device)
            return
        # Another allocator plugged into torch may ignore the fraction: a ballast tensor then takes
        # everything between the target and the limit.
        a0, r0 = self.allocated(), self.reserved()
        if limit > target:
            self._ballast = torch.empty(limit - target, dtype=torch.uint8, device=self.device)
        self._b_alloc, self._b_res = self.allocated() - a0, self.reserved() - r0

    def unbound(self) -> None:
        if self._fraction_before is not None:
            torch.cuda.set_per_process_memory_fraction(self._fraction_before, self.device)
            self._fraction_before = None
        self._ballast = None
        self._b_alloc = self._b_res = 0

    def capped(self) -> bool:
        return self._fraction_before is not None

    def _fraction_honoured(self) -> bool:
        """Whether torch's allocator bounds itself by the per-process memory fraction: gpumem and
        PyTorch's own two do; an allocator plugged in through CUDAPluggableAllocator need not."""
        from .. import _torch

        if _torch.is_active():
            return True
        return torch.cuda.get_allocator_backend() in ("native", "cudaMallocAsync")

    def begin(self, batch_size: int) -> None:
        # A fresh process, and the user's run after the search (after() clears them), creates cuBLAS's
        # workspaces at its first matrix product, in the middle of its first step, between the step's
        # own blocks; a trial after another found them at the bottom of the pool, where the first trial
        # put them. Near the cap that placement decides: on two H200s (DDP, a 29 M-parameter MLP with
        # AdamW, 1.5 GiB) a size passed every trial and verification with the workspaces kept, then
        # ran out of memory 3 steps later under the same cap in the same process.
        self._clear_cublas_workspaces()
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
            self._clear_cublas_workspaces()  # created during the trials, they live in the allocator's pool

    def _clear_cublas_workspaces(self) -> None:
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
            self.clean(collect=False)
