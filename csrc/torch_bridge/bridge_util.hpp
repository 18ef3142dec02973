// Small helpers the torch bridge's files share: the core's exceptions as torch's, the capture-mode
// guard PyTorch uses around device allocations, a device switch that costs nothing when not needed,
// and the context of the current allocator call for the segment events it causes.
#pragma once

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include "core/errors.hpp"

namespace gpumem::torch_bridge {

// Core exceptions -> c10 exceptions (Python: ValueError / RuntimeError). Out-of-memory is handled
// where it can happen (pool_allocate), since torch wants its own exception type with its own text.
template <typename F>
auto translate(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error&) {
    throw;
  } catch (const InvalidArgument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
}

// Runs pool calls in relaxed capture mode while a capture may be underway (as PyTorch does around
// cudaMalloc), so that mapping memory does not invalidate another thread's global-mode capture.
class MaybeRelaxed {
 public:
  explicit MaybeRelaxed(bool on) {
    if (on) guard_.emplace(cudaStreamCaptureModeRelaxed);
  }

 private:
  std::optional<c10::cuda::CUDAStreamCaptureModeGuard> guard_;
};

// Sets the device only when it differs from the current one.
class DeviceSwitch {
 public:
  explicit DeviceSwitch(int device) {
    if (c10::cuda::current_device() != device) guard_.emplace(static_cast<c10::DeviceIndex>(device));
  }

 private:
  std::optional<c10::cuda::CUDAGuard> guard_;
};

// The stack context of the allocator call in progress on this thread, for the segment events
// (segment_map / segment_unmap) the pool reports from inside that call. Set only while tracing.
struct CallContext {
  static std::shared_ptr<c10::GatheredContext>& current() {
    thread_local std::shared_ptr<c10::GatheredContext> context;
    return context;
  }
};

class CallContextScope {
 public:
  explicit CallContextScope(std::shared_ptr<c10::GatheredContext> context)
      : previous_(std::exchange(CallContext::current(), std::move(context))) {}
  ~CallContextScope() { CallContext::current() = std::move(previous_); }
  CallContextScope(const CallContextScope&) = delete;
  CallContextScope& operator=(const CallContextScope&) = delete;

 private:
  std::shared_ptr<c10::GatheredContext> previous_;
};

inline std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, reinterpret_cast<std::uintptr_t>(p));
  return buf;
}

// Messages are built without iostreams. TORCH_CHECK / TORCH_WARN with several arguments format them
// through a std::ostringstream inlined into the bridge, from the headers of the compiler that built
// it; against the libstdc++ the torch process had loaded, that crashed the process (SIGSEGV in
// set_per_process_memory_fraction(nan), a foreign raw_delete, CUDA IPC: H100, torch 2.11, measured).
// So every message is one ready std::string: TORCH_CHECK(cond, cat(...)) passes it through untouched.
inline std::string piece(const std::string& s) { return s; }
inline std::string piece(const char* s) { return s ? s : "(null)"; }
inline std::string piece(const void* p) { return hex(p); }
inline std::string piece(void* p) { return hex(p); }
inline std::string piece(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
std::string piece(T v) {
  return std::to_string(v);
}
template <typename... Args>
std::string cat(const Args&... args) {
  std::string out;
  (out += ... += piece(args));
  return out;
}

}  // namespace gpumem::torch_bridge
