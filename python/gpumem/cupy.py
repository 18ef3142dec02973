"""CuPy allocates from gpumem's pool: ``gpumem.cupy.use()``.

    >>> import gpumem, gpumem.cupy                   # doctest: +SKIP
    >>> gpumem.cupy.use()                             # every CuPy allocation, from now on
    >>> with gpumem.cupy.using():                     # or only inside the block (this thread)
    ...     x = cupy.ones(1 << 20)

Blocks come from the main pool of CuPy's current device, in the arena of CuPy's current stream, so
what CuPy frees is reused by torch (and the reverse), one cap (``gpumem.set_cap``,
``torch.cuda.set_per_process_memory_fraction``, ``GPUMEM_CONF``) covers both, and
``gpumem.stats()`` counts CuPy's live bytes apart (``gpumem.library.cupy.current``).

A block goes back to the pool when CuPy drops its memory (its ``UnownedMemory`` owns a
``gpumem._bridge.Block``): arrays shared with torch through DLPack keep it until both sides let go.
Out of memory: the pool releases its cache and runs the OOM callbacks (``gc.collect``), then
``cupy.cuda.memory.OutOfMemoryError`` is raised, with gpumem's figures in its cause.

Pinned host memory stays CuPy's. Without CuPy installed, ``use()`` raises ``ImportError`` naming it;
``import gpumem`` never imports CuPy.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, List

from ._integrations import LIBRARY_IDS, bridge_for, require

__all__ = ["allocator", "use", "unuse", "using", "is_used"]

_LIBRARY = LIBRARY_IDS["cupy"]
_lock = threading.Lock()
_previous: List[Any] = []  # the allocators use() replaced, most recent last
_current: Any = None  # the allocator use() installed (None: not in use)


def _cupy(what: str) -> Any:
    return require("cupy", "cupy (cupy-cuda12x / cupy-cuda13x)", what)


def allocator() -> Callable[[int], Any]:
    """A CuPy allocator (``size -> cupy.cuda.MemoryPointer``) drawing from gpumem's pool, for
    ``cupy.cuda.set_allocator`` / ``cupy.cuda.using_allocator``."""
    cupy = _cupy("gpumem.cupy.allocator()")
    bridge = bridge_for("gpumem.cupy.allocator()")
    from cupy.cuda import memory as cmem

    memory_pointer, unowned, memory = cmem.MemoryPointer, cmem.UnownedMemory, cmem.Memory
    out_of_memory, foreign_oom = cmem.OutOfMemoryError, bridge.ForeignOutOfMemoryError
    get_device, get_stream = cupy.cuda.runtime.getDevice, cupy.cuda.get_current_stream
    block = bridge.foreign_block

    def gpumem_malloc(size: int) -> Any:
        if size == 0:
            return memory_pointer(memory(0), 0)  # as CuPy's own pool: no device memory
        device = get_device()
        try:
            b = block(_LIBRARY, size, device, get_stream().ptr)
        except foreign_oom as e:
            # CuPy's own error (size, allocated so far, limit); gpumem's figures in the cause.
            err = out_of_memory(size, int(e.args[2]), int(e.args[3]))
            raise err from e
        # device_id given: CuPy need not ask the driver which device the pointer is on.
        return memory_pointer(unowned(b.ptr, size, b, device), 0)

    gpumem_malloc.__qualname__ = gpumem_malloc.__name__ = "gpumem_cupy_malloc"
    return gpumem_malloc


def use() -> None:
    """Make gpumem's pool CuPy's allocator (``cupy.cuda.set_allocator``) for the whole process.
    Idempotent; ``unuse()`` puts back the allocator it replaced."""
    global _current
    cupy = _cupy("gpumem.cupy.use()")
    with _lock:
        if _current is not None and cupy.cuda.get_allocator() is _current:
            return
        fn = allocator()
        _previous.append(cupy.cuda.get_allocator())
        cupy.cuda.set_allocator(fn)
        _current = fn


def unuse() -> None:
    """Give CuPy back the allocator ``use()`` replaced (its own memory pool by default). Blocks CuPy
    still holds stay valid and go back to gpumem's pool when CuPy drops them."""
    global _current
    cupy = _cupy("gpumem.cupy.unuse()")
    with _lock:
        if _current is None:
            return
        cupy.cuda.set_allocator(_previous.pop() if _previous else None)
        _current = None


def is_used() -> bool:
    """True while ``use()`` is in effect."""
    return _current is not None


@contextlib.contextmanager
def using() -> Iterator[None]:
    """CuPy allocates from gpumem inside the block, on this thread (``cupy.cuda.using_allocator``);
    the previous allocator is back afterwards."""
    cupy = _cupy("gpumem.cupy.using()")
    with cupy.cuda.using_allocator(allocator()):
        yield
