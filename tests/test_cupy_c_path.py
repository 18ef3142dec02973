"""gpumem.cupy's C path on the CPU: the checks that decide between it and the Python path. The
capsule-signature check runs against real capsules; where CuPy is installed (its import needs no
GPU), against CuPy's own exported get_current_stream_ptr, and the error-propagation probe against
CuPy's real CFunctionAllocatorMemory with C allocators compiled here (a failing malloc that sets an
error and returns (void*)-1, as the bridge's does; one that returns NULL, which CuPy cannot see).
The allocations themselves are in tests/gpu/test_integrations_gpu.py."""
import ctypes
import importlib.util
import shutil
import subprocess
import sysconfig

import pytest

import gpumem.cupy as gcupy

PyCapsule_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))


def capsule(name):
    """A real PyCapsule named `name` (its name buffer kept alive with it)."""
    buf = ctypes.create_string_buffer(name.encode())
    cap = PyCapsule_New(ctypes.addressof(buf), buf, None)
    return cap, buf


def test_capsule_with_the_signature_passes():
    cap, _buf = capsule(gcupy.STREAM_SIGNATURE)
    assert type(cap).__name__ == "PyCapsule"
    assert gcupy.capsule_problem(cap, gcupy.STREAM_SIGNATURE) == ""


def test_capsule_of_another_signature_is_refused_naming_both():
    cap, _buf = capsule("long (void)")
    why = gcupy.capsule_problem(cap, gcupy.STREAM_SIGNATURE)
    assert "'long (void)'" in why and repr(gcupy.STREAM_SIGNATURE) in why


def test_not_a_capsule_is_refused():
    assert "int, not a PyCapsule" in gcupy.capsule_problem(1234, gcupy.STREAM_SIGNATURE)


def test_bad_kind_is_a_value_error_before_anything_is_imported():
    with pytest.raises(ValueError, match="kind must be one of"):
        gcupy.allocator(kind="fast")


# ---- against the installed CuPy (skipped where it is absent) ----------------------------------------

needs_cupy = pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="cupy is not installed here")


@needs_cupy
def test_cupy_exports_the_current_stream_function_under_the_signature():
    import cupy.cuda.memory as cmem
    import cupy.cuda.stream as cstream

    cap = cstream.__pyx_capi__["get_current_stream_ptr"]
    assert gcupy.capsule_problem(cap, gcupy.STREAM_SIGNATURE) == ""
    assert hasattr(cmem, "CFunctionAllocator") and hasattr(cmem, "CFunctionAllocatorMemory")


SHIM = r"""
#include <Python.h>
#include <stdint.h>
int frees = 0;
void* last_free = 0;
static const char* text = "probe text";
void* fail_minus_one(void* param, size_t size, int device) {
  PyErr_SetString(PyExc_LookupError, text);
  return (void*)(intptr_t)-1;
}
void* fail_null(void* param, size_t size, int device) {
  PyErr_SetString(PyExc_LookupError, text);
  return 0;
}
void* succeed(void* param, size_t size, int device) { return (void*)(intptr_t)0x1000; }
void count_free(void* param, void* ptr, int device) { frees++; last_free = ptr; }
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler here")
    d = tmp_path_factory.mktemp("shim")
    (d / "shim.c").write_text(SHIM)
    r = subprocess.run([cc, "-shared", "-fPIC", "-O1", f"-I{sysconfig.get_paths()['include']}",
                        str(d / "shim.c"), "-o", str(d / "shim.so")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return ctypes.PyDLL(str(d / "shim.so"))


def addr(fn):
    return ctypes.cast(fn, ctypes.c_void_p).value


@needs_cupy
def test_cupy_raises_the_error_a_c_malloc_set_before_returning_minus_one(shim):
    import cupy.cuda.memory as cmem

    frees = ctypes.c_int.in_dll(shim, "frees")
    before = frees.value
    assert gcupy.errors_propagate(cmem.CFunctionAllocatorMemory, addr(shim.fail_minus_one),
                                  addr(shim.count_free), "probe text") == ""
    assert frees.value == before  # the failed Memory frees nothing


@needs_cupy
def test_probe_reports_what_cupy_did_otherwise(shim):
    import cupy.cuda.memory as cmem

    # NULL: CuPy takes it for no block, the error is left set (Python: SystemError).
    why = gcupy.errors_propagate(cmem.CFunctionAllocatorMemory, addr(shim.fail_null), addr(shim.count_free),
                                 "probe text")
    assert "SystemError" in why, why
    why = gcupy.errors_propagate(cmem.CFunctionAllocatorMemory, addr(shim.fail_minus_one),
                                 addr(shim.count_free), "another text")
    assert "another LookupError" in why, why
    frees = ctypes.c_int.in_dll(shim, "frees")
    before = frees.value
    why = gcupy.errors_propagate(cmem.CFunctionAllocatorMemory, addr(shim.succeed), addr(shim.count_free),
                                 "probe text")
    assert "returned a Memory" in why, why
    # The Memory died at once and CuPy freed its block through the C free, with its pointer.
    assert frees.value == before + 1
    assert ctypes.c_void_p.in_dll(shim, "last_free").value == 0x1000


def test_c_path_problem_needs_cupy_and_says_so_when_absent():
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("cupy is installed here: this checks the error where it is not")
    with pytest.raises(ImportError, match="needs cupy"):
        gcupy.c_path_problem()
