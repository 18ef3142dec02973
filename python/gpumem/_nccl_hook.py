"""NCCL buffer registration and gpumem's pages: ``TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK``
turned off where gpumem's memory is CUDA virtual memory (run by ``install()`` once gpumem is torch's
allocator, before any process group reads the variable).

With the hook on, ProcessGroupNCCL registers with NCCL every segment the allocator reports: the
snapshot's when a communicator starts, then each ``SEGMENT_ALLOC`` (``ncclCommRegister``). A collective
on a registered buffer lets the other GPUs of the node read and write it directly, and NCCL (2.28.9,
torch 2.11's) shares it with them as the one physical allocation that holds the buffer
(``cuMemGetAddressRange`` + ``cuMemRetainAllocationHandle``) at the offset of the registered segment.
gpumem's segments are spans of mapped pages, each page a physical allocation of its own, so a peer
maps one page of a span and a collective on a buffer past it reads or writes outside the mapping
(two ranks on two H200s, ``tests/gpu/dist_nccl_register.py``: 3 failed runs of 5, the two whose output
was kept with an illegal memory access). PyTorch turns the hook off for its own expandable segments,
which are made the same way; gpumem does the same and says so. Collectives stay correct without it:
NCCL copies through its own buffers, as it does by default.

Whole ``cudaMalloc`` segments (``GPUMEM_CONF=upstream:segments``) are one allocation each, so the hook
stays on there. A variable set after ``import gpumem`` is not seen here: set it before, or not at all.
Nor is anything done when gpumem is not torch's allocator (CUDA started first; ``gpumem.mem_pool()``
routes allocations to blocks that span pages as well): docs/distributed.md says not to combine them.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Dict, Optional

HOOK_VARIABLE = "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"
# What ProcessGroupNCCL reads as on (c10d's getCvarBool, lower-cased, nothing stripped); "n", "no",
# "0", "f", "false" are off, and anything else makes it raise, which is left for it to say.
_ON_VALUES = {"y", "yes", "1", "t", "true"}


def hook_requested() -> bool:
    """Whether the environment asks ProcessGroupNCCL for the register hook, as it reads the variable."""
    return os.environ.get(HOOK_VARIABLE, "").lower() in _ON_VALUES


def turn_off_for_pages(config: Optional[Dict[str, Any]]) -> bool:
    """Sets the hook's variable to 0, with a warning, when it is on and gpumem's pools map pages
    (``upstream`` ``auto`` or ``vmm``; None, no parsed configuration, counts as the default). Returns
    whether it did."""
    if not hook_requested():
        return False
    from .config import maps_pages  # the core, which parses the configuration, is there by now

    if config is not None and not maps_pages(config):
        return False
    value = os.environ[HOOK_VARIABLE]
    os.environ[HOOK_VARIABLE] = "0"
    warnings.warn(
        f"gpumem: {HOOK_VARIABLE}={value} turned off (set to 0). With it, NCCL shares a registered "
        f"segment with the other GPUs as one physical allocation, and gpumem's segments are runs of "
        f"CUDA virtual memory pages, one allocation each, so collectives on them could touch memory "
        f"outside what the other GPUs mapped. PyTorch turns the hook off for its expandable segments "
        f"for the same reason. Collectives stay correct without it (NCCL copies through its own "
        f"buffers). GPUMEM_CONF=upstream:segments (whole cudaMalloc segments) keeps the hook.",
        RuntimeWarning, stacklevel=4)
    return True
