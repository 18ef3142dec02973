// CuPy's C allocator interface over gpumem's pool: the malloc and free functions that
// cupy.cuda.memory.CFunctionAllocator calls (malloc(param, size, device) -> void*,
// free(param, ptr, device)), and the object that owns their `param`. With them a CuPy allocation
// runs no Python code of gpumem's: CuPy's Cython builds its Memory and MemoryPointer, this file asks
// CuPy's current stream through the C function CuPy exports (cupy.cuda.stream.__pyx_capi__) and takes
// the block from the device's main pool (foreign_alloc, Library::kCupy), as gpumem.cupy's Python
// allocator does. The Python side (python/gpumem/cupy.py) decides which of the two paths runs.
//
// Errors: CuPy calls both functions with the GIL held. A failed malloc sets a Python error (CuPy's
// own OutOfMemoryError for an OOM, gpumem's figures in its __cause__) and returns (void*)-1, never
// throws: CuPy 14 (Cython 3) checks for a set error after a -1 from its _call_malloc whether or not
// its malloc_func_type is declared `except +`, and a C++ exception through a CuPy whose declaration
// lacks `except +` would end the process. CuPy built with Cython 0.29 does not look for the error;
// gpumem.cupy runs cupy_c_probe once before it trusts the C path (the probe's error must come back
// as raised) and otherwise keeps the Python allocator. free is called from CuPy's Memory.__dealloc__
// and may not raise: a failure is a RuntimeWarning (an unraisable-exception report where warnings are
// errors), any error already being raised kept aside.
//
// Lifetime: a CuPy Memory keeps only `param`'s address, not the allocator, so a block may be freed
// after the CFunctionAllocator (and the owner) died (unuse() while arrays are alive): free never reads
// `param`. malloc only runs through a live CFunctionAllocator, which holds the owner.
#include <Python.h>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <pybind11/pybind11.h>

#include <c10/util/Exception.h>

#include "torch_bridge/allocator.hpp"
#include "torch_bridge/bridge_util.hpp"
#include "torch_bridge/cupy_c_allocator.hpp"

namespace py = pybind11;

namespace gpumem::torch_bridge {
namespace {

// The C signature Cython names cupy.cuda.stream's `cdef intptr_t get_current_stream_ptr() except? -1`
// by in __pyx_capi__ (measured: CuPy 14.2.0, Cython 3.2.4); the pointer is trusted only under it.
constexpr const char* kStreamSignature = "intptr_t (void)";
constexpr const char* kProbeText = "gpumem: CuPy C allocator error-propagation probe";
using CurrentStreamFn = std::intptr_t (*)();

// What a failed malloc returns: not NULL (CuPy would take NULL for a block without checking for an
// error), never a block's address (blocks are aligned).
void* const kFailed = reinterpret_cast<void*>(static_cast<std::intptr_t>(-1));

// `param`: owned by the Python object handed to CFunctionAllocator as its owner.
struct CupyCAllocator {
  CurrentStreamFn current_stream = nullptr;
  py::object stream_capsule;  // keeps cupy.cuda.stream's capsule (and its module) referenced
  py::object oom_class;       // cupy.cuda.memory.OutOfMemoryError(size, allocated, limit)
  PyObject* foreign_oom = nullptr;  // gpumem._bridge.ForeignOutOfMemoryError (lives for the process)
};

std::string message_of(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

void set_error(const std::exception& e) {
  PyObject* type = dynamic_cast<const c10::ValueError*>(&e) ? PyExc_ValueError : PyExc_RuntimeError;
  PyErr_SetString(type, message_of(e).c_str());
}

// CuPy's OutOfMemoryError(size, allocated, limit), raised from gpumem's ForeignOutOfMemoryError (as
// the Python allocator's `raise ... from e`).
void set_oom(const CupyCAllocator& s, std::size_t size, const ForeignOutOfMemory& oom) {
  try {
    py::object cause = py::handle(s.foreign_oom)(py::str(oom.what()), oom.requested, oom.allocated,
                                                  oom.limit);
    py::object err = s.oom_class(size, oom.allocated, oom.limit);
    PyException_SetCause(err.ptr(), cause.release().ptr());  // steals; also suppresses the context
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err.ptr())), err.ptr());
  } catch (py::error_already_set& e) {
    e.restore();  // building CuPy's error failed: that error is raised instead
  } catch (const std::exception&) {
    PyErr_SetString(PyExc_MemoryError, oom.what());
  }
}

void* cupy_malloc(void* param, std::size_t size, int device) noexcept {
  const auto& s = *static_cast<const CupyCAllocator*>(param);
  const std::intptr_t stream = s.current_stream();
  if (stream == -1 && PyErr_Occurred()) return kFailed;
  try {
    // The GIL stays held, as around the Python allocator's foreign_block: the OOM callback
    // (gc.collect) takes it again on this thread.
    void* p = GpumemAllocator::instance().foreign_alloc(Library::kCupy, size, device,
                                                        reinterpret_cast<cudaStream_t>(stream));
    if (p) return p;
    PyErr_SetString(PyExc_RuntimeError, cat("gpumem: no block for a CuPy allocation of ", size,
                                            " bytes (size 0 reached the C allocator)").c_str());
  } catch (const ForeignOutOfMemory& e) {
    set_oom(s, size, e);
  } catch (const std::exception& e) {
    set_error(e);
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "gpumem: unknown error allocating for CuPy");
  }
  return kFailed;
}

void report_free_failure(const std::string& message) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);  // an error being raised stays
  if (PyErr_WarnEx(PyExc_RuntimeWarning, message.c_str(), 1) < 0) PyErr_WriteUnraisable(Py_None);
  PyErr_Restore(type, value, traceback);
}

void cupy_free(void* /*param: may be gone*/, void* ptr, int /*device*/) noexcept {
  if (!ptr || ptr == kFailed) return;  // kFailed: a probe's or a failed malloc's Memory
  try {
    GpumemAllocator::instance().foreign_free(ptr, std::nullopt);
  } catch (const std::exception& e) {
    report_free_failure(message_of(e));
  } catch (...) {
    report_free_failure(cat("gpumem: unknown error freeing CuPy's block ", hex(ptr)));
  }
}

// Sets LookupError(kProbeText) and fails as cupy_malloc does: gpumem.cupy checks that CuPy raises it.
void* cupy_probe_malloc(void*, std::size_t, int) noexcept {
  PyErr_SetString(PyExc_LookupError, kProbeText);
  return kFailed;
}

std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
template <typename F>
std::uintptr_t function_address(F* f) {
  return reinterpret_cast<std::uintptr_t>(reinterpret_cast<void*>(f));
}

}  // namespace

void bind_cupy_c_allocator(py::module_& m, PyObject* foreign_oom) {
  py::class_<CupyCAllocator>(m, "CupyCAllocator",
                             "Owns the param of gpumem's CuPy C allocator (CFunctionAllocator's owner)");
  m.attr("CUPY_STREAM_SIGNATURE") = kStreamSignature;
  m.attr("CUPY_PROBE_TEXT") = kProbeText;
  m.def(
      "cupy_c_allocator",
      [foreign_oom](py::object stream_capsule, py::object oom_class) {
        if (!PyCapsule_CheckExact(stream_capsule.ptr()))
          throw py::type_error(cat("gpumem: the current-stream function must be a PyCapsule (cupy.cuda."
                                   "stream.__pyx_capi__['get_current_stream_ptr']), not ",
                                   Py_TYPE(stream_capsule.ptr())->tp_name));
        const char* name = PyCapsule_GetName(stream_capsule.ptr());
        if (!name && PyErr_Occurred()) throw py::error_already_set();
        if (!name || std::strcmp(name, kStreamSignature) != 0)
          throw py::type_error(cat("gpumem: CuPy's get_current_stream_ptr has the signature '",
                                   name ? name : "(none)", "', not '", kStreamSignature, "'"));
        void* fn = PyCapsule_GetPointer(stream_capsule.ptr(), name);
        if (!fn) throw py::error_already_set();
        if (!PyType_Check(oom_class.ptr()) ||
            !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(oom_class.ptr()),
                              reinterpret_cast<PyTypeObject*>(PyExc_BaseException)))
          throw py::type_error("gpumem: oom_class must be an exception class "
                               "(cupy.cuda.memory.OutOfMemoryError)");
        auto owner = std::make_unique<CupyCAllocator>();
        owner->current_stream = reinterpret_cast<CurrentStreamFn>(fn);
        owner->stream_capsule = std::move(stream_capsule);
        owner->oom_class = std::move(oom_class);
        owner->foreign_oom = foreign_oom;
        const std::uintptr_t param = address(owner.get());
        py::object held = py::cast(std::move(owner));
        return py::make_tuple(param, function_address(&cupy_malloc), function_address(&cupy_free), held);
      },
      py::arg("stream_capsule"), py::arg("oom_class"),
      "(param, malloc, free, owner) for cupy.cuda.memory.CFunctionAllocator: blocks of the main pool "
      "on CuPy's current stream (from the capsule of cupy.cuda.stream.get_current_stream_ptr, signature "
      "CUPY_STREAM_SIGNATURE); OOM raises oom_class(size, allocated, limit). TypeError for a capsule "
      "of another signature.");
  m.def(
      "cupy_c_probe", []() { return function_address(&cupy_probe_malloc); },
      "A malloc for CFunctionAllocatorMemory that sets LookupError(CUPY_PROBE_TEXT) and fails as "
      "cupy_c_allocator's does: CuPy passes C allocator errors on when constructing raises it.");
}

}  // namespace gpumem::torch_bridge
