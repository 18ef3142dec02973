"""CuPy allocates from gpumem's pool: ``gpumem.cupy.use()``.

    >>> import gpumem, gpumem.cupy                   # doctest: +SKIP
    >>> gpumem.cupy.use()                             # every CuPy allocation, from now on
    >>> with gpumem.cupy.using():                     # or only inside the block (this thread)
    ...     x = cupy.ones(1 << 20)

Blocks come from the main pool of CuPy's current device, in the arena of CuPy's current stream, so
what CuPy frees is reused by torch (and the reverse), one cap (``gpumem.set_cap``,
``torch.cuda.set_per_process_memory_fraction``, ``GPUMEM_CONF``) covers both, and
``gpumem.stats()`` counts CuPy's live bytes apart (``gpumem.library.cupy.current``).

A block goes back to the pool when CuPy drops its memory (its ``CFunctionAllocatorMemory`` frees it
when it dies; on the Python path its ``UnownedMemory`` owns a ``gpumem._bridge.Block``): arrays shared
with torch through DLPack keep it until both sides let go (CuPy's DLPack export holds the array).
Out of memory: the pool releases its cache and runs the OOM callbacks (``gc.collect`` with
``GPUMEM_CONF=gc_on_oom:true``, as CuPy's own pool collects; off by default, as PyTorch's allocator),
then ``cupy.cuda.memory.OutOfMemoryError`` is raised, with gpumem's figures in its cause.

Two paths, the same pool and figures: the **C path** (``path() == "c"``) hands CuPy gpumem's C
functions through ``cupy.cuda.memory.CFunctionAllocator``, so an allocation runs no Python code of
gpumem's (CuPy's current stream comes from the C function CuPy exports,
``cupy.cuda.stream.__pyx_capi__["get_current_stream_ptr"]``, trusted only under the signature
``"intptr_t (void)"``); the **Python path** wraps each block in an ``UnownedMemory``. The C path is
taken when CuPy exports that function, has ``CFunctionAllocator``, and passes a C allocator's error on
(checked once with a probe: CuPy built with Cython 3 does, CuPy 14 included; one built with Cython
0.29 would turn it into a ``SystemError``); otherwise the Python path, and ``c_path_problem()`` says
why. ``allocator(kind="python")`` / ``use(kind="python")`` choose the Python path on purpose.

Pinned host memory stays CuPy's. Without CuPy installed, ``use()`` raises ``ImportError`` naming it;
``import gpumem`` never imports CuPy.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Any, Callable, Iterator, List, Optional, Tuple

from ._integrations import LIBRARY_IDS, bridge_for, require

__all__ = ["allocator", "use", "unuse", "using", "is_used", "path", "c_path_problem"]

_LIBRARY = LIBRARY_IDS["cupy"]
_lock = threading.Lock()
_previous: List[Any] = []  # the allocators use() replaced, most recent last
_current: Any = None  # the allocator use() installed (None: not in use)
_current_kind = ""  # its path: "c" or "python"
_c_problem: Optional[str] = None  # why the C path cannot be taken ("": it can); decided once

#: The C signature CuPy's exported ``get_current_stream_ptr`` must have (``gpumem._bridge`` checks
#: it again before it calls the function).
STREAM_SIGNATURE = "intptr_t (void)"
KINDS = ("auto", "c", "python")

# PyCapsule_GetName with the GIL held (a PYFUNCTYPE: a set error is raised), its own prototype so that
# ctypes.pythonapi's shared one is left as it is.
_capsule_get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName",
                                                                          ctypes.pythonapi))


def _cupy(what: str) -> Any:
    return require("cupy", "cupy (cupy-cuda12x / cupy-cuda13x)", what)


def capsule_problem(capsule: Any, signature: str) -> str:
    """``""`` when ``capsule`` is a ``PyCapsule`` named ``signature`` (how Cython names an exported
    C function by its C signature), else why not."""
    if type(capsule).__name__ != "PyCapsule":
        return f"it is {type(capsule).__name__}, not a PyCapsule"
    raw = _capsule_get_name(capsule)
    name = raw.decode() if raw is not None else None
    if name != signature:
        return f"its signature is {name!r}, not {signature!r}"
    return ""


def errors_propagate(memory_class: Any, malloc: int, free: int, probe_text: str) -> str:
    """``""`` when CuPy's ``memory_class`` (``CFunctionAllocatorMemory``) raises the error a C
    ``malloc`` set before it returned ``(void*)-1`` (``malloc`` sets ``LookupError(probe_text)``),
    else what it did instead."""
    try:
        memory_class(1, 0, malloc, free, 0)
    except LookupError as e:
        if str(e) == probe_text:
            return ""
        return f"it raised another LookupError ({e})"
    except Exception as e:  # what CuPy made of the error is the finding
        return f"it raised {type(e).__name__} ({str(e)[:200]}) instead of the allocator's error"
    return "it returned a Memory although the allocator failed"


def _find_c_problem(cupy: Any, bridge: Any) -> str:
    from cupy.cuda import memory as cmem

    if not hasattr(bridge, "cupy_c_allocator"):
        return "gpumem._bridge predates the C path (rebuild gpumem)"
    for name in ("CFunctionAllocator", "CFunctionAllocatorMemory"):
        if not hasattr(cmem, name):
            return f"CuPy {cupy.__version__} has no cupy.cuda.memory.{name}"
    capi = getattr(cupy.cuda.stream, "__pyx_capi__", None) or {}
    if "get_current_stream_ptr" not in capi:
        return (f"CuPy {cupy.__version__} does not export get_current_stream_ptr "
                "(cupy.cuda.stream.__pyx_capi__)")
    why = capsule_problem(capi["get_current_stream_ptr"], STREAM_SIGNATURE)
    if why:
        return f"CuPy {cupy.__version__}'s get_current_stream_ptr: {why}"
    _, _, free, _ = bridge.cupy_c_allocator(capi["get_current_stream_ptr"], cmem.OutOfMemoryError)
    why = errors_propagate(cmem.CFunctionAllocatorMemory, bridge.cupy_c_probe(), free,
                           bridge.CUPY_PROBE_TEXT)
    if why:
        return f"CuPy {cupy.__version__} does not pass a C allocator's error on: {why}"
    return ""


def c_path_problem() -> str:
    """``""`` when CuPy can allocate through gpumem's C functions (the C path), else why it cannot
    (the Python path is used then). Decided once per process."""
    global _c_problem
    cupy = _cupy("gpumem.cupy.c_path_problem()")
    bridge = bridge_for("gpumem.cupy.c_path_problem()")
    with _lock:
        if _c_problem is None:
            _c_problem = _find_c_problem(cupy, bridge)
        return _c_problem


def path() -> str:
    """``"c"`` or ``"python"``: the path of the allocator ``use()`` installed, or, when not in use,
    the one ``allocator()`` takes (``"c"`` unless ``c_path_problem()`` says why not)."""
    _cupy("gpumem.cupy.path()")
    if _current is not None:
        return _current_kind
    return "python" if c_path_problem() else "c"


def allocator(kind: str = "auto") -> Callable[[int], Any]:
    """A CuPy allocator (``size -> cupy.cuda.MemoryPointer``) drawing from gpumem's pool, for
    ``cupy.cuda.set_allocator`` / ``cupy.cuda.using_allocator``. ``kind``: ``"auto"`` (the C path
    when it can be taken, else the Python path), ``"c"`` (``RuntimeError`` saying why when it cannot)
    or ``"python"``."""
    return _allocator(kind)[0]


def _allocator(kind: str) -> Tuple[Callable[[int], Any], str]:
    if kind not in KINDS:
        raise ValueError(f"gpumem.cupy: kind must be one of {KINDS}, not {kind!r}")
    cupy = _cupy("gpumem.cupy.allocator()")
    bridge = bridge_for("gpumem.cupy.allocator()")
    from cupy.cuda import memory as cmem

    if kind != "python":
        why = c_path_problem()
        if not why:
            capsule = cupy.cuda.stream.__pyx_capi__["get_current_stream_ptr"]
            param, malloc, free, owner = bridge.cupy_c_allocator(capsule, cmem.OutOfMemoryError)
            # CuPy's Cython: size -> MemoryPointer(CFunctionAllocatorMemory), no Python of gpumem's.
            return cmem.CFunctionAllocator(param, malloc, free, owner).malloc, "c"
        if kind == "c":
            raise RuntimeError(f"gpumem.cupy: the C path cannot be taken: {why}")
    return _python_allocator(cupy, bridge, cmem), "python"


def _python_allocator(cupy: Any, bridge: Any, cmem: Any) -> Callable[[int], Any]:
    """The Python path: each block a ``gpumem._bridge.Block`` owned by CuPy's ``UnownedMemory``."""
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


def use(kind: str = "auto") -> None:
    """Make gpumem's pool CuPy's allocator (``cupy.cuda.set_allocator``) for the whole process
    (``kind``: as ``allocator()``'s). Idempotent; ``unuse()`` puts back the allocator it replaced."""
    global _current, _current_kind
    cupy = _cupy("gpumem.cupy.use()")
    fn, taken = _allocator(kind)  # (outside _lock: c_path_problem() takes it)
    with _lock:
        installed = _current is not None and cupy.cuda.get_allocator() is _current
        if installed and kind in ("auto", _current_kind):
            return
        if not installed:  # (installed: the other path replaces it; unuse() still goes back past both)
            _previous.append(cupy.cuda.get_allocator())
        cupy.cuda.set_allocator(fn)
        _current, _current_kind = fn, taken


def unuse() -> None:
    """Give CuPy back the allocator ``use()`` replaced (its own memory pool by default). Blocks CuPy
    still holds stay valid and go back to gpumem's pool when CuPy drops them."""
    global _current, _current_kind
    cupy = _cupy("gpumem.cupy.unuse()")
    with _lock:
        if _current is None:
            return
        cupy.cuda.set_allocator(_previous.pop() if _previous else None)
        _current, _current_kind = None, ""


def is_used() -> bool:
    """True while ``use()`` is in effect."""
    return _current is not None


@contextlib.contextmanager
def using(kind: str = "auto") -> Iterator[None]:
    """CuPy allocates from gpumem inside the block, on this thread (``cupy.cuda.using_allocator``);
    the previous allocator is back afterwards. ``kind``: as ``allocator()``'s."""
    cupy = _cupy("gpumem.cupy.using()")
    with cupy.cuda.using_allocator(allocator(kind)):
        yield
