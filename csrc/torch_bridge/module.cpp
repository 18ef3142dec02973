// gpumem._bridge: the Python face of the torch allocator (see allocator.hpp).
// Built only against a CUDA torch, with torch's own pybind11 headers, so that the allocator object
// handed to Python is torch's registered `torch._C._cuda_CUDAAllocator` type.
#include <Python.h>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include "core/cuda_upstream.hpp"
#include "torch_bridge/allocator.hpp"
#include "torch_bridge/cupy_c_allocator.hpp"

namespace py = pybind11;
using gpumem::UpstreamTime;
using gpumem::torch_bridge::GpumemAllocator;

namespace {

// torch.cuda.memory_stats()'s flat shape: "allocated_bytes.all.current", "num_ooms", ...; the keys
// come from the one schema in core/stats.hpp.
py::dict flat_stats(const gpumem::DeviceStats& s) {
  py::dict out;
  auto add_stat = [&](const std::string& prefix, const gpumem::Stat& st) {
#define GPUMEM_FLAT_FIELD(f) out[py::str(prefix + #f)] = st.f;
    GPUMEM_STAT_FIELDS(GPUMEM_FLAT_FIELD)
#undef GPUMEM_FLAT_FIELD
  };
#define GPUMEM_FLAT_ARRAY(name)                                      \
  for (int t = 0; t < gpumem::kNumStatTypes; ++t)                    \
    add_stat(std::string(#name ".") + gpumem::stat_type_name(t) + ".", s.name[t]);
#define GPUMEM_FLAT_STAT(name) add_stat(#name ".", s.name);
#define GPUMEM_FLAT_NUMBER(name) out[#name] = s.name;
  GPUMEM_STATS_SCHEMA(GPUMEM_FLAT_ARRAY, GPUMEM_FLAT_STAT, GPUMEM_FLAT_NUMBER, GPUMEM_FLAT_NUMBER)
#undef GPUMEM_FLAT_ARRAY
#undef GPUMEM_FLAT_STAT
#undef GPUMEM_FLAT_NUMBER
  return out;
}

// A block handed to another library (CuPy, Numba), owned by this Python object: freed into the pool
// by free() or, at the latest, when the object dies (CuPy's UnownedMemory and Numba's finalizer hold
// it for as long as the library uses the memory).
class OwnedBlock {
 public:
  OwnedBlock(std::uintptr_t ptr, std::size_t size, int device, int library)
      : ptr_(ptr), size_(size), device_(device), library_(library) {}
  OwnedBlock(const OwnedBlock&) = delete;
  OwnedBlock& operator=(const OwnedBlock&) = delete;
  ~OwnedBlock() {
    try {
      free();
    } catch (const std::exception& e) {
      // A destructor cannot raise: a warning (an error already being raised is kept aside), or, where
      // warnings are errors, an unraisable-exception report.
      py::error_scope keep;
      if (PyErr_WarnEx(PyExc_RuntimeWarning, e.what(), 1) < 0) PyErr_WriteUnraisable(Py_None);
    }
  }
  void free() {
    if (!ptr_) return;
    const std::uintptr_t p = std::exchange(ptr_, 0);
    GpumemAllocator::instance().foreign_free(reinterpret_cast<void*>(p));
  }
  std::uintptr_t ptr() const { return ptr_; }
  std::size_t size() const { return size_; }
  int device() const { return device_; }
  int library() const { return library_; }

 private:
  std::uintptr_t ptr_;
  std::size_t size_;
  int device_;
  int library_;
};

gpumem::torch_bridge::Library to_library(int library) {
  if (library <= 0 || library >= gpumem::torch_bridge::kNumLibraries)
    throw py::value_error("gpumem: library must be 1 (cupy), 2 (numba) or 3 (rmm), not " +
                          std::to_string(library));
  return static_cast<gpumem::torch_bridge::Library>(library);
}

}  // namespace

PYBIND11_MODULE(_bridge, m) {
  m.doc() = "gpumem's PyTorch allocator (CUDAPluggableAllocator subclass over gpumem's pool)";
  m.attr("TORCH_VERSION") = py::make_tuple(TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR);

  m.def(
      "init", [](const std::string& conf) { GpumemAllocator::instance().configure(conf); },
      py::arg("conf") = "",
      "Set GPUMEM_CONF for the pools (parsed once; ValueError naming a bad key).");

  m.def(
      "register",
      []() {
        auto allocator = GpumemAllocator::shared();
        torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
        // Also the allocator c10 hands out for the CUDA device type (torch.accelerator APIs).
        c10::SetAllocator(c10::DeviceType::CUDA, allocator.get(), /*priority=*/255);
      },
      "Make gpumem torch's CUDA allocator. RuntimeError if torch's allocator already started.");

  m.def(
      "allocator", []() { return py::cast(GpumemAllocator::shared()); },
      "The allocator as torch._C._cuda_CUDAAllocator (for torch.cuda.MemPool / "
      "torch.cuda.memory.change_current_allocator).");

  m.def("is_current", []() { return GpumemAllocator::instance().is_current(); });

  m.def(
      "device_stats",
      [](int device) { return flat_stats(GpumemAllocator::instance().pool_stats(device)); },
      py::arg("device"), "Stats of the device's pools, in torch.cuda.memory_stats()'s flat shape.");

  m.def(
      "trim",
      [](int device) {
        py::gil_scoped_release nogil;
        return GpumemAllocator::instance().trim(device);
      },
      py::arg("device"), "Give the device's cached memory back; returns the bytes released.");
  m.def(
      "set_cap",
      [](int device, std::size_t bytes) {
        py::gil_scoped_release nogil;
        GpumemAllocator::instance().set_cap(device, bytes);
      },
      py::arg("device"), py::arg("bytes"),
      "Cap reserved bytes (0 = none). ValueError below what live tensors hold; nothing changes.");
  m.def("cap", [](int device) { return GpumemAllocator::instance().cap(device); }, py::arg("device"));
  m.def(
      "effective_cap", [](int device) { return GpumemAllocator::instance().effective_cap(device); },
      py::arg("device"));
  m.def(
      "largest_free", [](int device) { return GpumemAllocator::instance().largest_free(device); },
      py::arg("device"));
  m.def(
      "validate", [](int device) { GpumemAllocator::instance().validate(device); },
      py::arg("device"), "Check the device's pools' structures (raises on inconsistency).");
  m.def(
      "driver_time",
      [](int device) {
        const UpstreamTime& t = GpumemAllocator::instance().upstream_time(device);
        py::dict out;
        for (int k = 0; k < UpstreamTime::kNumKinds; ++k) {
          const auto kind = static_cast<UpstreamTime::Kind>(k);
          out[UpstreamTime::kNames[k]] = py::make_tuple(t.calls(kind), t.ns(kind));
        }
        return out;
      },
      py::arg("device"), "Calls and nanoseconds the device's pools spent per kind of upstream call.");
  m.def("private_pool_count", []() { return GpumemAllocator::instance().private_pool_count(); });
  m.def("vmm_supported", [](int device) { return gpumem::cuda_vmm_supported(device); });
  m.def("start_tracker_audit", []() { GpumemAllocator::instance().start_tracker_audit(); },
        "Attach (once) a trace tracker that checks the segment entries NCCL's register hooks act on.");
  m.def("tracker_audit", []() {
    GpumemAllocator::TrackerAudit a = GpumemAllocator::instance().tracker_audit();
    py::dict out;
    py::list segments;
    for (const auto& [device, address, bytes] : a.segments) segments.append(py::make_tuple(device, address, bytes));
    out["segments"] = segments;
    out["allocs"] = a.allocs;
    out["frees"] = a.frees;
    out["mismatches"] = a.mismatches;
    out["tracker_errors"] = a.tracker_errors;
    out["first_tracker_error"] = a.first_tracker_error;
    return out;
  });

  m.def(
      "set_oom_callback",
      [](py::object fn) {
        if (fn.is_none()) {
          GpumemAllocator::instance().set_oom_callback(nullptr);
          return;
        }
        // Held without ever touching Python after it has finalized (the allocator outlives it).
        std::shared_ptr<py::object> holder(new py::object(std::move(fn)), [](py::object* o) {
          if (Py_IsInitialized()) {
            py::gil_scoped_acquire gil;
            delete o;
          } else {
            o->release();
            delete o;
          }
        });
        GpumemAllocator::instance().set_oom_callback([holder]() {
          if (!Py_IsInitialized()) return;
          py::gil_scoped_acquire gil;
          try {
            (*holder)();
          } catch (py::error_already_set& e) {
            e.discard_as_unraisable("gpumem out-of-memory callback");
          }
        });
      },
      py::arg("fn"),
      "Called before an allocation fails (gc.collect from gpumem); None removes it.");

  // ---- other libraries (foreign.cpp) ----
  // The GIL stays held around these pool calls, as around torch's allocations from Python: a pool
  // call never waits for the GIL, and the OOM callback (gc.collect) takes it again on this thread.
  m.attr("LIBRARIES") = py::make_tuple("torch", "cupy", "numba", "rmm");
  // A plain reference kept for the process's life (a static py::object would be released after
  // the interpreter finalized).
  static PyObject* foreign_oom =
      PyErr_NewException("gpumem._bridge.ForeignOutOfMemoryError", PyExc_MemoryError, nullptr);
  if (!foreign_oom) throw py::error_already_set();
  m.attr("ForeignOutOfMemoryError") = py::handle(foreign_oom);
  // args: (message, requested bytes, allocated bytes, limit bytes), for each library's own error.
  py::register_local_exception_translator([](std::exception_ptr e) {
    try {
      if (e) std::rethrow_exception(e);
    } catch (const gpumem::torch_bridge::ForeignOutOfMemory& oom) {
      py::object args = py::make_tuple(oom.what(), oom.requested, oom.allocated, oom.limit);
      PyErr_SetObject(foreign_oom, args.ptr());
    }
  });

  py::class_<OwnedBlock>(m, "Block", "A block of gpumem's pool owned by another library's object")
      .def_property_readonly("ptr", &OwnedBlock::ptr)
      .def_property_readonly("size", &OwnedBlock::size)
      .def_property_readonly("device", &OwnedBlock::device)
      .def_property_readonly("library", &OwnedBlock::library)
      .def("free", &OwnedBlock::free, "Give the block back now (idempotent)")
      .def("__call__", &OwnedBlock::free, "free(): a finalizer for numba's MemoryPointer");

  m.def(
      "foreign_block",
      [](int library, std::size_t size, int device, std::uintptr_t stream) {
        void* p = GpumemAllocator::instance().foreign_alloc(to_library(library), size, device,
                                                            reinterpret_cast<cudaStream_t>(stream));
        return std::make_unique<OwnedBlock>(reinterpret_cast<std::uintptr_t>(p), size, device, library);
      },
      py::arg("library"), py::arg("size"), py::arg("device"), py::arg("stream"),
      "A block of `size` bytes for `library` on `device`'s main pool, used on `stream` (a "
      "cudaStream_t as int); freed when the returned object dies. ForeignOutOfMemoryError when full.");
  m.def(
      "foreign_alloc",
      [](int library, std::size_t size, int device, std::uintptr_t stream) {
        return reinterpret_cast<std::uintptr_t>(GpumemAllocator::instance().foreign_alloc(
            to_library(library), size, device, reinterpret_cast<cudaStream_t>(stream)));
      },
      py::arg("library"), py::arg("size"), py::arg("device"), py::arg("stream"),
      "foreign_block's block as a bare pointer (0 for size 0), freed by foreign_free.");
  m.def(
      "foreign_free",
      [](std::uintptr_t ptr, std::optional<std::uintptr_t> stream) {
        std::optional<cudaStream_t> s;
        if (stream) s = reinterpret_cast<cudaStream_t>(*stream);
        return GpumemAllocator::instance().foreign_free(reinterpret_cast<void*>(ptr), s);
      },
      py::arg("ptr"), py::arg("stream") = py::none(),
      "Free a foreign_alloc pointer (stream: the one it is freed on; None: its own). Returns its "
      "size; ValueError for a pointer that is not a live foreign block.");
  // CuPy's C allocator interface (CFunctionAllocator): the path gpumem.cupy takes when it can.
  gpumem::torch_bridge::bind_cupy_c_allocator(m, foreign_oom);
  m.def(
      "library_stats",
      [](int device) {
        py::dict out;
        const auto usage = GpumemAllocator::instance().library_usage(device);
        for (int i = 0; i < gpumem::torch_bridge::kNumLibraries; ++i) {
          py::dict d;
          d["current"] = usage[i].current;
          d["peak"] = usage[i].peak;
          d["allocations"] = usage[i].allocations;
          d["ooms"] = usage[i].ooms;
          out[py::str(gpumem::torch_bridge::library_name(static_cast<gpumem::torch_bridge::Library>(i)))] = d;
        }
        return out;
      },
      py::arg("device"), "Live bytes, peak, live blocks and OOMs of each library on the device.");
  m.def(
      "memory_info", [](int device) { return GpumemAllocator::instance().memory_info(device); },
      py::arg("device"), "(free, total) under the device's effective cap, cached memory counted free.");
}
