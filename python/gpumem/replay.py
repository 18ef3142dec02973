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
from typing import Any, Callable, Dict, Optional, Union

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
    ns_per_pair: float
    ooms: int
    first_oom: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))


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
) -> ReplayReport:
    """Replay ``trace`` through a fresh pool on a simulated device and report what happened.

    ``upstream`` is ``"vmm"`` (pages mapped on demand, gpumem's default) or ``"segments"``
    (cudaMalloc-style regions); ``capacity`` is the simulated device's memory in bytes; ``page_size``
    the bytes per page of large arenas (a multiple of 2 MiB; small arenas use 2 MiB pages).
    Raises ``ValueError`` with ``file:line`` for a malformed trace.
    """
    capacity = DEFAULT_CAPACITY if capacity is None else capacity
    page_size = _C.DEFAULT_PAGE_SIZE if page_size is None else page_size
    loaded = _load(Path(trace))
    device = _C.SimulatedDevice(upstream, capacity)  # CUDA's 2 MiB granularity
    options: Dict[str, Any] = {} if release_slack is None else {"release_slack": release_slack}
    pool = _C.Pool(device, release=release, page_size=page_size, **options)
    result = _C.replay(loaded, pool, progress)
    return ReplayReport(
        trace=str(trace),
        workload=loaded.workload or Path(trace).name.split(".")[0],
        upstream=upstream,
        release=release,
        page_size=page_size,
        capacity_bytes=capacity,
        operations=loaded.operations,
        allocations=loaded.allocations,
        **{k: result[k] for k in ("peak_live_bytes", "peak_reserved_bytes", "fragmentation",
                                  "upstream_calls", "ns_per_pair", "ooms", "first_oom")},
    )


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
