// Out of memory, as torch users and their tools expect it: torch.cuda.OutOfMemoryError whose text
// begins exactly as PyTorch's allocator's ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has
// a total capacity of 79.19 GiB of which 1.02 GiB is free. ..."), since Lightning, Accelerate and
// many scripts match that text, followed by gpumem's own figures (live, reserved, cap, largest free
// block, what to do). Before throwing: the OOM trace entry and torch's OOM observers (the memory
// snapshot on OOM relies on them), as PyTorch's allocator does. Before giving up: torch's
// free-memory callbacks (cuda_ipc_collect), run from the main pools' out-of-memory callback.
#include <cinttypes>
#include <cstdio>
#include <string>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include "torch_bridge/allocator.hpp"
#include "torch_bridge/bridge_util.hpp"

namespace gpumem::torch_bridge {

namespace {

// c10's format_size, to the character: "512 bytes", "1.50 KiB", "20.00 MiB", "800000000.00 GiB".
std::string torch_format_size(std::uint64_t size) {
  char buf[64];
  if (size <= 1024) {
    std::snprintf(buf, sizeof buf, "%" PRIu64 " bytes", size);
  } else if (size <= 1048576) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", static_cast<double>(size) / 1024.0);
  } else if (size <= 1073741824ULL) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(size) / 1048576.0);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(size) / 1073741824.0);
  }
  return buf;
}

}  // namespace

bool GpumemAllocator::run_torch_free_memory_callbacks(int device) {
  // PyTorch's allocator runs these whenever its cache cannot serve a request, before it asks the
  // driver; the pool's cache lives in mapped pages instead, so they run where the pool runs out.
  bool freed = false;
  auto* registry = c10::FreeCudaMemoryCallbacksRegistry();
  for (const std::string& name : registry->Keys()) {
    try {
      freed |= registry->Create(name)->Execute();
    } catch (const std::exception& e) {
      TORCH_WARN(cat("gpumem: torch's free-memory callback '", name, "' on device ", device,
                     " failed: ", e.what()));
    }
  }
  return freed;
}

void GpumemAllocator::raise_oom(int device, std::size_t requested, const std::string& detail,
                                std::size_t allocated, cudaStream_t stream) {
  std::size_t free_bytes = 0, total_bytes = 0, reserved = 0;
  Pool* pool = main_pool_if_created(device);
  try {
    if (pool) {
      free_bytes = pool->upstream().device_free_bytes();
      total_bytes = pool->upstream().device_total_bytes();
      reserved = pool->reserved_bytes();
    } else {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
      if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) (void)cudaGetLastError();
    }
  } catch (const std::exception&) {
    // The figures stay 0: the error being raised matters more than its numbers.
  }
  if (tracing_.load(std::memory_order_relaxed))
    record_trace(CCA::TraceEntry::Action::OOM, device, free_bytes, requested, stream, kDefaultPool,
                 nullptr);
  std::vector<CCA::OutOfMemoryObserver> observers;
  {
    std::lock_guard<std::mutex> lock(callback_mutex_);
    observers = oom_observers_;
  }
  for (auto& observer : observers) observer(device, allocated, total_bytes, free_bytes);
  c10::reportOutOfMemoryToProfiler(static_cast<std::int64_t>(requested), allocated, reserved,
                                   c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  const std::size_t shown = requested <= kMaxRequest ? round_up(requested, kAlignment) : requested;
  const std::size_t unallocated = reserved > allocated ? reserved - allocated : 0;
  C10_THROW_ERROR(OutOfMemoryError,
                  "CUDA out of memory. Tried to allocate " + torch_format_size(shown) + ". GPU " +
                      std::to_string(device) + " has a total capacity of " +
                      torch_format_size(total_bytes) + " of which " + torch_format_size(free_bytes) +
                      " is free. Of the allocated memory " + torch_format_size(allocated) +
                      " is allocated by PyTorch, and " + torch_format_size(unallocated) +
                      " is reserved by PyTorch but unallocated (PyTorch's allocator is gpumem). " +
                      detail);
}

void GpumemAllocator::attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) {
  std::lock_guard<std::mutex> lock(callback_mutex_);
  oom_observers_.push_back(std::move(observer));
}

}  // namespace gpumem::torch_bridge
