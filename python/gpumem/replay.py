"""Replay allocation traces through gpumem's pool on the simulated device.

A trace (format: ``a <id> <bytes> <stream>`` / ``f <id>`` lines, optionally gzip) records what a real
training run asked of its allocator. Replaying it through the pool on a simulated device shows the
fragmentation the pool would reach (peak reserved / peak live) and what its own logic costs on the CPU,
with no GPU at all.

    >>> from gpumem import replay
    >>> report = replay(bundled_traces()[0])               # doctest: +SKIP
    >>> print(report.fragmentation)                        # doctest: +SKIP
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple, Union

from . import _C

GiB = 1 << 30
#: Capacity of the simulated device unless told otherwise: an H200, where the bundled traces were recorded.
DEFAULT_CAPACITY = 141 * GiB
TRACES_DIR = Path(__file__).with_name("traces")


@dataclass
class ReplayReport:
    trace: str
    workload: str
    upstream: str
    release: str
    page_size: int
    capacity_bytes: int
    operations: int
    allocations: int
    peak_live_bytes: int
    peak_reserved_bytes: int
    fragmentation: float
    upstream_calls: int
    mapped_bytes: int  # reserved bytes ever taken (the first mapping and every map after a release)
    # Physical allocations made plus released on the device (a unit of 2-20 MiB costs a real driver
    # about the same: ~60 us to create, map and give access, then unmap and release, on an H100).
    physical_units: int
    # The CUDA driver's time for the unit calls of the replay on a vmm upstream, modelled with the
    # per-unit costs measured on an H100 (DRIVER_US_PER_UNIT); None on a segments upstream.
    driver_ms: Optional[float]
    # The simulated device's lag (host operations an event takes to complete; 0: none), the times
    # the pool made the host wait for it (an allocation under a cap whose room was still draining)
    # and how long those waits were: the operations the device still had to run, summed.
    device_lag: int
    waits: int
    waited_operations: int
    ns_per_pair: float
    ooms: int
    first_oom: str
    # Times the trace was replayed in one pool (``passes``): with more than one, upstream_calls,
    # mapped_bytes, physical_units, driver_ms, waits and waited_operations are the last pass's (the
    # steady state of a run whose steps repeat, as epochs do); peaks and OOMs cover every pass.
    passes: int = 1
    # Allocations that found no room without giving the pool's whole cache back and retrying (the
    # pool's num_alloc_retries; the last pass's with several): each a burst of driver calls on a GPU.
    retries: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))


#: Microseconds the CUDA driver takes per physical unit, whatever its size (2, 8 or 20 MiB alike),
#: measured with ctypes on libcuda on an H100 (docs/benchmarks.md, "At the cap"): cuMemCreate 9-11, cuMemMap 2
#: plus cuMemSetAccess 22, cuMemUnmap 17, cuMemRelease 10-17.
DRIVER_US_PER_UNIT = {"create": 10.0, "map": 24.0, "unmap": 17.0, "release": 13.0}


def modelled_driver_ms(creates: int, maps: int, unmaps: int, releases: int) -> float:
    """The driver's time for these unit calls on an H100, by DRIVER_US_PER_UNIT, in milliseconds."""
    us = DRIVER_US_PER_UNIT
    return (creates * us["create"] + maps * us["map"] + unmaps * us["unmap"] + releases * us["release"]) / 1e3


def bundled_traces() -> list[Path]:
    """The traces shipped with gpumem (recorded from real PyTorch training on an H200)."""
    return sorted(TRACES_DIR.glob("*.trace.gz"))


def reference_ratios() -> dict:
    """PyTorch's own fragmentation on the bundled traces' workloads, measured live (see the JSON's
    _source)."""
    return json.loads((TRACES_DIR / "reference.json").read_text())


def replay(
    trace: Union[str, Path],
    upstream: str = "vmm",
    capacity: Optional[int] = None,
    page_size: Optional[int] = None,
    release: str = "lazy",
    release_slack: Optional[float] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    limit: Optional[int] = None,
    device_lag: int = 0,
    passes: int = 1,
    held_elsewhere: int = 0,
    elsewhere_freed_after: Optional[int] = None,
    stitch: bool = True,
    stitch_slack: Optional[float] = None,
    ends_by_page: bool = False,
    early_ends_by_page: Optional[float] = None,
    park_lent: bool = True,
) -> ReplayReport:
    """Replay ``trace`` through a fresh pool on a simulated device and report what happened.

    ``upstream`` is ``"vmm"`` (pages mapped on demand, gpumem's default) or ``"segments"``
    (cudaMalloc-style regions); ``capacity`` is the simulated device's memory in bytes; ``page_size``
    the bytes per page of large arenas (a multiple of 2 MiB; small arenas use 2 MiB pages);
    ``limit`` bounds the pool's reserved bytes on that device as ``set_per_process_memory_fraction``
    does in PyTorch (``Pool.set_limit``); ``device_lag`` makes the device run that many operations behind
    the replay (an event recorded at one operation completes ``device_lag`` operations later, as a GPU runs
    behind the host), and the report counts the ``waits`` the pool made for it. ``passes`` replays the trace
    that many times in the same pool, as later epochs run the same steps (allocations the trace never frees
    are made once); the report's driver figures are then the last pass's, what a step costs once its shapes
    repeat (``ReplayReport.passes``). ``held_elsewhere`` bytes of the device are held outside the pool
    (another process, a library's own ``cudaMalloc``): the pool meets the device's end without a cap or
    a limit telling it where that is, as on a shared GPU (``bench/pressure.py --bound device``); with
    ``elsewhere_freed_after=K`` that memory goes back to the device after the K-th pass. ``stitch`` is
    the pool's option of that name (``GPUMEM_CONF`` ``stitch``, on by default: new pages past the live
    high water backed by free blocks' memory, while no cap or limit is set), ``stitch_slack`` how far
    (fraction) reserved grows past the live high water before it stitches (``GPUMEM_CONF``
    ``stitch_slack``; None: the pool's default, 0.01). ``ends_by_page`` is the pool's option of that name
    (``GPUMEM_CONF`` ``ends_by_page``, off by default: under a limit that is not roomy, a block's end
    pages are mapped one by one rather than in whole groups), ``early_ends_by_page`` the pool's option
    of that name (``GPUMEM_CONF`` ``early_ends_by_page``; None: the pool's default, 0.1: so are those
    of the blocks mapped while the live high water is below that fraction of the limit; 0: never).
    ``park_lent`` is the pool's option of that name (``GPUMEM_CONF`` ``park_lent``, on by default:
    under a roomy limit, units moved from draining pages to a new block stay mapped where they were).
    Raises ``ValueError`` with ``file:line`` for a malformed trace.
    """
    if isinstance(device_lag, bool) or not isinstance(device_lag, int) or device_lag < 0:
        raise ValueError(f"device_lag must be a whole number of operations >= 0, got {device_lag!r}")
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"passes must be a whole number >= 1, got {passes!r}")
    capacity = DEFAULT_CAPACITY if capacity is None else capacity
    if (isinstance(held_elsewhere, bool) or not isinstance(held_elsewhere, int)
            or not 0 <= held_elsewhere <= capacity):
        raise ValueError(f"held_elsewhere must be a whole number of bytes in [0, capacity {capacity}], "
                         f"got {held_elsewhere!r}")
    if elsewhere_freed_after is not None and not (
            isinstance(elsewhere_freed_after, int) and not isinstance(elsewhere_freed_after, bool)
            and 1 <= elsewhere_freed_after < passes):
        raise ValueError(f"elsewhere_freed_after must be a pass from 1 to passes - 1 ({passes - 1}), "
                         f"got {elsewhere_freed_after!r}")
    page_size = _C.DEFAULT_PAGE_SIZE if page_size is None else page_size
    loaded = _load(Path(trace))
    device = _C.SimulatedDevice(upstream, capacity)  # CUDA's 2 MiB granularity
    device.lag = device_lag
    device.held_elsewhere = held_elsewhere
    options: Dict[str, Any] = {} if release_slack is None else {"release_slack": release_slack}
    if stitch_slack is not None:
        options["stitch_slack"] = stitch_slack
    if early_ends_by_page is not None:
        options["early_ends_by_page"] = early_ends_by_page
    pool = _C.Pool(device, release=release, page_size=page_size, stitch=bool(stitch),
                   ends_by_page=bool(ends_by_page), park_lent=bool(park_lent), **options)
    if limit is not None:
        pool.set_limit(limit)
    clock = device if device_lag else None
    result = _C.replay(loaded, pool, progress, clock)
    ooms, first_oom = result["ooms"], result["first_oom"]
    counted: Tuple[int, ...] = (0,) * 8  # what the passes before the last one made, off the report
    for done in range(1, passes):
        if done == elsewhere_freed_after:
            device.held_elsewhere = 0
        counted = _device_counters(pool, device)
        again = _C.replay(loaded, pool, None, clock, again=True)
        ooms += again["ooms"]
        first_oom = first_oom or again["first_oom"]
        result = dict(again, peak_live_bytes=max(result["peak_live_bytes"], again["peak_live_bytes"]))
    reserved, creates, releases, maps, unmaps, waits, waited, retries = (
        a - b for a, b in zip(_device_counters(pool, device), counted))
    peak_reserved = pool.stats()["reserved_bytes"]["all"]["peak"]
    return ReplayReport(
        trace=str(trace),
        workload=loaded.workload or Path(trace).name.split(".")[0],
        upstream=upstream,
        release=release,
        page_size=page_size,
        capacity_bytes=capacity,
        operations=loaded.operations,
        allocations=loaded.allocations,
        peak_live_bytes=result["peak_live_bytes"],
        peak_reserved_bytes=peak_reserved,
        fragmentation=peak_reserved / result["peak_live_bytes"] if result["peak_live_bytes"] else 0.0,
        upstream_calls=result["upstream_calls"],  # the last pass's (the C++ replay counts per call)
        ns_per_pair=result["ns_per_pair"],
        ooms=ooms,
        first_oom=first_oom,
        mapped_bytes=reserved,
        physical_units=creates + releases,
        driver_ms=modelled_driver_ms(creates, maps, unmaps, releases) if upstream == "vmm" else None,
        device_lag=device_lag,
        waits=waits,
        waited_operations=waited,
        passes=passes,
        retries=retries,
    )


def _device_counters(pool: Any, device: Any) -> Tuple[int, ...]:
    """Reserved bytes ever taken, units created and released, unit maps and unmaps, waits and their
    length, the pool's release-everything retries, so far: what each pass of ``replay`` adds."""
    stats = pool.stats()
    return (stats["reserved_bytes"]["all"]["allocated"], device.physical_allocations,
            device.physical_releases, device.unit_maps, device.unit_unmaps, device.waits, device.waited_steps,
            stats["num_alloc_retries"])


def bound_keywords(bound: str, nbytes: int) -> Dict[str, Any]:
    """``replay``'s keywords that leave the pool ``nbytes`` under ``bound``: the simulated device's
    ``capacity``; a ``limit`` on the default device (what ``set_per_process_memory_fraction`` sets);
    or (``device``) the default device with the rest ``held_elsewhere``."""
    if bound == "capacity":
        return {"capacity": nbytes}
    if bound == "limit":
        return {"limit": nbytes}
    if bound == "device":
        return {"held_elsewhere": DEFAULT_CAPACITY - nbytes}
    raise ValueError(f"bound must be 'capacity', 'limit' or 'device', got {bound!r}")


@dataclass
class MinCapacity:
    """The lowest simulated device capacity at which a trace replays with 0 OOMs (``min_capacity``)."""
    trace: str
    workload: str
    peak_live_bytes: int
    capacity_bytes: int     # the lowest capacity that passed
    ratio: float            # capacity_bytes / peak_live_bytes
    failed_below: float     # the highest ratio that failed below it (the bracket is [failed_below, ratio])
    replays: int
    non_monotone: bool      # a capacity above the result failed: the outcome is not monotone in it

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def min_capacity(
    trace: Union[str, Path],
    tolerance: float = 0.0025,
    checks: Tuple[float, ...] = (0.01, 0.02, 0.05),
    bound: str = "capacity",
    **options: Any,
) -> MinCapacity:
    """The tight case on the CPU: the lowest simulated device capacity, as a multiple of the trace's
    peak live bytes P, at which the whole trace replays with 0 OOMs, bisected to ``tolerance`` x P.
    With ``bound="limit"`` the device keeps its default size and the bound is the pool's limit instead
    (what ``set_per_process_memory_fraction`` sets on a GPU, and what the GPU pressure bench bisects);
    the pool treats the two alike except where it asks whether the user set a bound (a cap or a
    limit: ``capacity_bytes`` is then the limit found). With ``bound="device"`` the rest of the
    default device is held outside the pool (``replay``'s ``held_elsewhere``): the pool learns where
    the device ends only when it refuses a map, as on a GPU shared with other memory.

    Each step is a fresh replay (``options`` are ``replay``'s: upstream, page_size, release, ...) on a
    device of that capacity; a capped PyTorch run stops at its first OOM, so any OOM fails the step.
    Capacities below P always fail (live bytes alone exceed them); P itself is tried first. The
    search starts from the peak reserved of a replay on the default device, which passed.
    Bisection assumes the outcome is monotone in the capacity; ``checks`` (fractions of P above the
    result) are replayed as well and ``non_monotone`` says whether any of them failed.
    """
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
    bound_keywords(bound, 0)  # a bad bound fails here, before the base replay
    if {"capacity", "limit", "progress", "held_elsewhere"} & set(options):
        raise ValueError("min_capacity chooses the capacity itself: pass neither capacity, limit, "
                         "held_elsewhere nor progress")
    base = replay(trace, **options)
    if base.ooms:
        raise ValueError(f"{trace}: {base.ooms} OOMs even on the default {DEFAULT_CAPACITY >> 30} GiB device")
    peak = base.peak_live_bytes
    passed: Dict[int, bool] = {}

    def passes(capacity: int) -> bool:
        if capacity not in passed:
            passed[capacity] = replay(trace, **bound_keywords(bound, capacity), **options).ooms == 0
        return passed[capacity]

    lo, hi = peak, max(base.peak_reserved_bytes, peak + 1)
    if passes(lo):  # live bytes alone fill the device: nothing lower can pass
        return MinCapacity(trace=str(trace), workload=base.workload, peak_live_bytes=peak, capacity_bytes=lo,
                           ratio=1.0, failed_below=1.0, replays=len(passed) + 1, non_monotone=False)
    while not passes(hi):  # the default device's peak reserved should pass; if not, widen
        lo, hi = hi, min(DEFAULT_CAPACITY, hi + (hi - peak) * 2 + (peak >> 7))
        if lo == DEFAULT_CAPACITY:
            raise ValueError(f"{trace}: no capacity up to the default device's passes")
    step = max(1, int(tolerance * peak))
    while hi - lo > step:
        mid = (lo + hi) // 2
        if passes(mid):
            hi = mid
        else:
            lo = mid
    non_monotone = not all(passes(hi + int(c * peak)) for c in checks)
    non_monotone = non_monotone or any(not ok and c > hi for c, ok in passed.items())
    return MinCapacity(trace=str(trace), workload=base.workload, peak_live_bytes=peak, capacity_bytes=hi,
                       ratio=hi / peak, failed_below=lo / peak, replays=len(passed) + 1,
                       non_monotone=non_monotone)


def _load(path: Path) -> _C.Trace:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such trace file")
    if _C.HAS_ZLIB or path.read_bytes()[:2] != b"\x1f\x8b":
        return _C.load_trace(str(path))
    # This build has no zlib: unpack with Python's gzip into a temporary plain-text copy.
    import gzip
    import tempfile

    with gzip.open(path, "rb") as src, tempfile.NamedTemporaryFile(suffix=".trace") as tmp:
        tmp.write(src.read())
        tmp.flush()
        return _C.load_trace(tmp.name)


def print_progress(done: int, total: int) -> None:
    """A progress callback that redraws one line on stderr."""
    end = "\n" if done == total else ""
    sys.stderr.write(f"\r  replaying: {done:,}/{total:,} operations ({100 * done // max(total, 1)}%){end}")
    sys.stderr.flush()
