"""GPUMEM_CONF: the configuration string, validated by the C++ core.

Keys (comma separated, ``key:value`` or ``key=value``):

``upstream``   ``auto`` (default: CUDA virtual memory where the driver supports it), ``vmm``, ``segments``
``cap``        a fraction of device memory in (0, 1] such as ``0.9``, or bytes such as ``40GiB``; ``0`` = none
``release``    ``lazy`` (default: keep free pages cached until ``empty_cache()`` or until the cap or the
               device runs short, then unmap free pages anywhere) or ``high_water`` (also release before
               reserving past the highest live bytes since the last ``empty_cache()``: lower reserved, slower
               on a GPU)
``release_slack``  high_water only: how far (fraction) reserved may exceed the live high water (0.005)
``page_size``  vmm: bytes per physical page, a multiple of 2MiB (default 8MiB)
``gc_on_oom``  ``false`` (default, as PyTorch's allocator: an allocation fails without collecting) or
               ``true`` (run ``gc.collect()`` before failing one, as CuPy's own pool does)
``ipc``        vmm: ``true`` (default: pages are created shareable as file descriptors, so CUDA tensors can
               go to other processes) or ``false`` (plain pages; sharing a tensor raises, naming this key)
``stitch``     vmm: ``true`` (default) or ``false``: new pages past the live high water (+1%,
               ``stitch_slack``) are backed by the memory of free cached pages elsewhere, whose old
               positions stay mapped for a block that lands there later (no driver call while that
               memory is free again): reserved stays near live without releasing; costs unmaps where
               such a position's memory is in use elsewhere. Only while no cap and no memory fraction
               bounds the pool (there it releases as without)
``stitch_slack``  vmm, stitch: how far (fraction) reserved may grow past the live high water with new
               memory before new pages are stitched (0.01). Higher: fewer unmaps and waits in steady
               steps where stitched memory is in use elsewhere, reserved further above live
``ends_by_page``  vmm: ``false`` (default) or ``true``: under a cap or a memory fraction that is not roomy,
               a block's end pages (shared with its neighbours) are mapped page by page rather than in
               whole 8 MiB groups, so a freed neighbour's pages there can go back: fits tighter caps,
               costs more driver calls under them
``early_ends_by_page``  vmm: a fraction in [0, 1] (0.1): under a cap or a memory fraction, blocks mapped
               while the live high water is below this share of it (a run's first blocks: weights and
               optimizer state, which live as long as the run) map their end pages as ``ends_by_page``
               does; 0 never. Fits tighter caps without ``ends_by_page``'s steady cost in driver calls
               at 1.05x; more calls in the first pass (docs/benchmarks.md, "early_ends_by_page")
``park_lent``  vmm: ``true`` (default) or ``false``: under a cap or a memory fraction that is roomy (2%
               above the settled live high water), memory moved from freed pages to a new block stays
               mapped at its old place too, so a later block there takes it back with no driver call
               while it is free again, as ``stitch`` does without a bound: fewer remaps a step at
               1.05x (docs/benchmarks.md, "park_lent")

Example: ``GPUMEM_CONF="cap:0.8,release:high_water" python train.py``
"""
from __future__ import annotations

import os
from typing import Any, Mapping, TypedDict

from . import _C


class Config(TypedDict):
    """A parsed ``GPUMEM_CONF``: every key the core's ``parse_config`` returns, defaults filled in."""

    upstream: str  # "auto", "vmm" or "segments"
    cap_bytes: int  # the cap as bytes (0 = none) ...
    cap_fraction: float  # ... or as a fraction of the device's memory (0.0 = none)
    release: str  # "lazy" or "high_water"
    release_slack: float  # high_water: how far reserved may exceed the live high water (0.005)
    page_size: int  # bytes per physical page of large arenas, a multiple of 2 MiB (8 MiB)
    gc_on_oom: bool  # run gc.collect() before failing an allocation (false)
    ipc: bool  # vmm: pages shareable with other processes (POSIX file descriptor handles)
    stitch: bool  # vmm: new pages past the live high water backed by free cached pages' memory
    stitch_slack: float  # vmm, stitch: how far reserved may grow past the live high water first (0.01)
    ends_by_page: bool  # vmm, bounded: a block's end groups mapped page by page (false)
    early_ends_by_page: float  # vmm, bounded: so are those of blocks mapped below this share of it (0.1)
    park_lent: bool  # vmm, roomy bound: moved memory stays mapped at its old place too (true)


def parse_config(text: str, source: str = "GPUMEM_CONF") -> Config:
    """Parse a configuration string; raises ``ValueError`` naming the bad key and the accepted values.

    >>> parse_config("cap:0.5,upstream:segments")["cap_fraction"]
    0.5
    """
    return _C.parse_config(text, source)  # type: ignore[return-value]


def maps_pages(config: Mapping[str, Any]) -> bool:
    """Whether pools of this configuration map CUDA virtual memory pages (``upstream`` ``auto`` or
    ``vmm``; auto falls back to segments only where the driver has no virtual memory) rather than
    take whole ``cudaMalloc`` segments."""
    return config["upstream"] != "segments"


def from_environment() -> Config:
    """The configuration in ``GPUMEM_CONF`` (defaults when unset)."""
    return parse_config(os.environ.get("GPUMEM_CONF", ""))
