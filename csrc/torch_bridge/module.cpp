// gpumem._bridge: the Python face of the torch allocator (see allocator.hpp).
// Built only against a CUDA torch, with torch's own pybind11 headers, so that the allocator object
// handed to Python is torch's registered `torch._C._cuda_CUDAAllocator` type.
#include <Python.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include "core/cuda_upstream.hpp"
#include "torch_bridge/allocator.hpp"

namespace py = pybind11;
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
}
