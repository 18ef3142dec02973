// CuPy's C allocator interface over gpumem's pool (cupy_c_allocator.cpp): its Python bindings.
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>

namespace gpumem::torch_bridge {

// Adds cupy_c_allocator, cupy_c_probe, CupyCAllocator, CUPY_STREAM_SIGNATURE and CUPY_PROBE_TEXT to
// `m`. `foreign_oom`: gpumem._bridge.ForeignOutOfMemoryError (held for the process's life), the
// __cause__ of CuPy's OutOfMemoryError.
void bind_cupy_c_allocator(pybind11::module_& m, PyObject* foreign_oom);

}  // namespace gpumem::torch_bridge
