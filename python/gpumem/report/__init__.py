"""``gpumem.report()``: one self-contained HTML page that shows what holds GPU memory, and why.

    >>> import gpumem
    >>> gpumem.report("report.html")                               # doctest: +SKIP  (this process)
    >>> gpumem.report("report.html", snapshot="snapshot.pickle")   # doctest: +SKIP  (a saved one)

From the live process (``torch.cuda.memory._snapshot()``, gpumem's pool or PyTorch's own allocator)
or from a snapshot file (PyTorch's ``torch.cuda.memory._dump_snapshot`` pickle, or gpumem's JSON from
:class:`PoolRecorder`), the page shows the allocated / reserved timeline with out-of-memory errors and
``empty_cache`` marked, the largest live allocations with their Python and C++ stacks, the code
holding the most, the segments with their free holes and the fragmentation, who holds memory
(parameters, gradients, optimizer state, variables, the last exception's traceback; live only), and a
one-paragraph diagnosis. Nothing is fetched from the network: styles, script and data are inline, so
the file opens on a cluster with no internet, and a trace of 10^6 events still opens at once
(downsampled here, drawn on a canvas there).

Modules: ``load`` (reading and checking snapshots), ``record`` (gpumem's format, ``PoolRecorder``),
``live`` (this process, with cleanup's holder analysis), ``series`` (the timeline), ``analyze`` (the
figures), ``diagnose`` (the paragraph), ``html`` (the page). Importing this package imports none of
them: ``report()`` does, when called.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, List, Optional, Union

__all__ = ["report", "examples", "load_snapshot", "PoolRecorder"]

EXAMPLES_DIR = Path(__file__).with_name("examples")


def examples() -> List[Path]:
    """The snapshots bundled with gpumem (synthesized from a trace replay: ``examples/README.md``
    says how)."""
    return sorted(p for p in EXAMPLES_DIR.iterdir() if p.name.startswith("resnet50"))


def report(path: Union[str, os.PathLike[str]] = "gpumem-report.html", snapshot: Any = None, *,
           device: Optional[int] = None, top: int = 20, points: int = 2000, _stacklevel: int = 1) -> Path:
    """Write the memory report to ``path`` (one HTML file) and return its path.

    ``snapshot``: None for this process (needs CUDA in use here; who holds memory is looked up in
    the caller's variables and the notebook's), a file (PyTorch's pickle or gpumem's JSON, gzip
    allowed), the dict ``torch.cuda.memory._snapshot()`` returns, or gpumem's snapshot dict.
    ``device``: the GPU to show (default: the one holding the most). ``top``: how many holders to
    list; ``points``: how many points the timeline keeps. Raises ``ValueError`` for a malformed
    snapshot (naming what is wrong), ``FileNotFoundError``, and ``RuntimeError`` when there is no
    snapshot and no CUDA memory in this process.
    """
    from .analyze import analyze
    from .html import render
    from .load import Snapshot, from_gpumem, from_torch, load_snapshot
    from .record import FORMAT

    if snapshot is None:
        from .live import live_snapshot, namespaces

        frame = sys._getframe(_stacklevel)
        try:
            spaces = namespaces(frame)
        finally:
            del frame
        snap = live_snapshot(spaces, top)
    elif isinstance(snapshot, Snapshot):
        snap = snapshot
    elif isinstance(snapshot, (str, os.PathLike)):
        snap = load_snapshot(snapshot)
    elif isinstance(snapshot, dict) and snapshot.get("format") == FORMAT:
        snap = from_gpumem(snapshot, "gpumem snapshot")
    elif isinstance(snapshot, (dict, list)):
        snap = from_torch(snapshot, "snapshot")
    else:
        raise TypeError(f"snapshot must be None, a file, or a snapshot dict, not {type(snapshot).__name__}")
    page = render(analyze(snap, device, points))
    out = Path(path)
    out.write_text(page, encoding="utf-8")
    return out


def load_snapshot(path: Union[str, os.PathLike[str]]) -> Any:
    """Read and check a snapshot file (``load.load_snapshot``); raises ``ValueError`` if malformed."""
    from .load import load_snapshot as load

    return load(path)


def __getattr__(name: str) -> Any:
    if name == "PoolRecorder":
        from .record import PoolRecorder

        return PoolRecorder
    raise AttributeError(f"module 'gpumem.report' has no attribute {name!r}")
