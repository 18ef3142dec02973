// gpumem's PyTorch allocator. See allocator.hpp for the design.
#include "torch_bridge/allocator.hpp"

#include <algorithm>
#include <array>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <utility>

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include "core/cuda_upstream.hpp"
#include "core/errors.hpp"

namespace gpumem::torch_bridge {

namespace {

using Action = CCA::TraceEntry::Action;
constexpr MempoolId kDefaultPool{0, 0};

template <int D>
void main_deleter(void* ptr) {
  GpumemAllocator::instance().free_main(D, ptr);
}
template <std::size_t... I>
constexpr std::array<c10::DeleterFnPtr, sizeof...(I)> make_main_deleters(std::index_sequence<I...>) {
  return {{&main_deleter<static_cast<int>(I)>...}};
}
// One deleter per device: a main-pool free goes to the right pool without any lookup.
constexpr std::array<c10::DeleterFnPtr, kMaxDevices> kMainDeleters =
    make_main_deleters(std::make_index_sequence<kMaxDevices>{});

void private_deleter(void* ptr) { GpumemAllocator::instance().free_private_deleter(ptr); }
void any_deleter(void* ptr) { GpumemAllocator::instance().free_any(ptr); }

int main_deleter_device(c10::DeleterFnPtr deleter) {
  for (int d = 0; d < kMaxDevices; ++d)
    if (kMainDeleters[d] == deleter) return d;
  return -1;
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

// Core exceptions -> c10 exceptions (Python: ValueError / RuntimeError).
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

void add_stat(Stat& to, const Stat& from) {
  to.current += from.current;
  to.peak += from.peak;  // an upper bound of the peak of the sum; exact with no private pool
  to.allocated += from.allocated;
  to.freed += from.freed;
}

constexpr StatArray DeviceStats::*kArrays[] = {
    &DeviceStats::allocation,      &DeviceStats::segment,      &DeviceStats::active,
    &DeviceStats::inactive_split,  &DeviceStats::allocated_bytes, &DeviceStats::reserved_bytes,
    &DeviceStats::active_bytes,    &DeviceStats::inactive_split_bytes, &DeviceStats::requested_bytes};

void add_stats(DeviceStats& to, const DeviceStats& from) {
  for (auto member : kArrays)
    for (int t = 0; t < kNumStatTypes; ++t) add_stat((to.*member)[t], (from.*member)[t]);
  to.num_alloc_retries += from.num_alloc_retries;
  to.num_ooms += from.num_ooms;
  to.num_sync_all_streams += from.num_sync_all_streams;
  to.num_device_alloc += from.num_device_alloc;
  to.num_device_free += from.num_device_free;
  add_stat(to.oversize_allocations, from.oversize_allocations);
  add_stat(to.oversize_segments, from.oversize_segments);
  to.max_split_size = std::max(to.max_split_size, from.max_split_size);
}

void to_c10(c10::CachingAllocator::Stat& to, const Stat& from) {
  to.current = from.current;
  to.peak = from.peak;
  to.allocated = from.allocated;
  to.freed = from.freed;
}

CCA::DeviceStats to_c10(const DeviceStats& s) {
  CCA::DeviceStats out;
  auto copy = [](c10::CachingAllocator::StatArray& to, const StatArray& from) {
    for (int t = 0; t < kNumStatTypes; ++t) to_c10(to[t], from[t]);
  };
  copy(out.allocation, s.allocation);
  copy(out.segment, s.segment);
  copy(out.active, s.active);
  copy(out.inactive_split, s.inactive_split);
  copy(out.allocated_bytes, s.allocated_bytes);
  copy(out.reserved_bytes, s.reserved_bytes);
  copy(out.active_bytes, s.active_bytes);
  copy(out.inactive_split_bytes, s.inactive_split_bytes);
  copy(out.requested_bytes, s.requested_bytes);
  out.num_alloc_retries = s.num_alloc_retries;
  out.num_ooms = s.num_ooms;
  out.num_sync_all_streams = s.num_sync_all_streams;
  out.num_device_alloc = s.num_device_alloc;
  out.num_device_free = s.num_device_free;
  to_c10(out.oversize_allocations, s.oversize_allocations);
  to_c10(out.oversize_segments, s.oversize_segments);
  out.max_split_size = s.max_split_size;
  return out;
}

Action parse_action(const std::string& name) {
  static const std::pair<const char*, Action> table[] = {
      {"alloc", Action::ALLOC},
      {"free_requested", Action::FREE_REQUESTED},
      {"free_completed", Action::FREE_COMPLETED},
      {"segment_alloc", Action::SEGMENT_ALLOC},
      {"segment_free", Action::SEGMENT_FREE},
      {"segment_map", Action::SEGMENT_MAP},
      {"segment_unmap", Action::SEGMENT_UNMAP},
      {"snapshot", Action::SNAPSHOT},
      {"oom", Action::OOM},
  };
  for (const auto& [key, action] : table)
    if (name == key) return action;
  TORCH_CHECK_VALUE(false, "gpumem: unknown trace action '", name, "' in skip_actions");
}

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, reinterpret_cast<std::uintptr_t>(p));
  return buf;
}

}  // namespace

// ---- construction, configuration -----------------------------------------------------------------

GpumemAllocator::GpumemAllocator()
    : torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator(
          // The base keeps these for its own malloc(); every path that would use them is overridden.
          [](std::size_t size, int device, cudaStream_t stream) -> void* {
            c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device));
            return GpumemAllocator::instance().raw_alloc_with_stream(size, stream);
          },
          [](void* ptr, std::size_t, int, cudaStream_t) { GpumemAllocator::instance().free_any(ptr); }) {
  traces_.resize(kMaxDevices);
}

GpumemAllocator& GpumemAllocator::instance() {
  static GpumemAllocator* allocator = new GpumemAllocator();  // never destroyed, on purpose
  return *allocator;
}

std::shared_ptr<CCA::CUDAAllocator> GpumemAllocator::shared() {
  static auto* ptr = new std::shared_ptr<CCA::CUDAAllocator>(&instance(), [](CCA::CUDAAllocator*) {});
  return *ptr;
}

void GpumemAllocator::configure(const std::string& conf) {
  Config parsed = parse_config(conf);  // throws InvalidArgument naming the key
  std::lock_guard<std::mutex> lock(config_mutex_);
  if (configured_ && conf == conf_text_) return;
  for (int d = 0; d < kMaxDevices; ++d) {
    if (devices_[d].main.load(std::memory_order_acquire))
      throw InvalidArgument("gpumem: GPUMEM_CONF cannot change once a device's pool exists (was '" +
                            conf_text_ + "', now '" + conf + "'); set it before the first allocation");
  }
  config_ = parsed;
  conf_text_ = conf;
  configured_ = true;
}

const Config& GpumemAllocator::config() {
  std::lock_guard<std::mutex> lock(config_mutex_);
  if (!configured_) {
    const char* env = std::getenv("GPUMEM_CONF");
    conf_text_ = env ? env : "";
    config_ = parse_config(conf_text_);
    configured_ = true;
  }
  return config_;
}

bool GpumemAllocator::is_current() const { return CCA::get() == this; }

int GpumemAllocator::check_device(int device) const {
  TORCH_CHECK_INDEX(device >= 0 && device < kMaxDevices, "gpumem: invalid CUDA device ", device);
  return device;
}

// ---- pools ---------------------------------------------------------------------------------------

std::unique_ptr<Pool> GpumemAllocator::make_pool(int device, ReleasePolicy release,
                                                 std::size_t cap_bytes) {
  const Config& cfg = config();
  UpstreamKind kind;
  if (cfg.upstream == "segments") {
    kind = UpstreamKind::kSegments;
  } else if (cfg.upstream == "vmm") {
    if (!cuda_vmm_supported(device))
      throw InvalidArgument("GPUMEM_CONF: upstream:vmm, but CUDA device " + std::to_string(device) +
                            " does not support virtual memory management; use upstream:auto or "
                            "upstream:segments");
    kind = UpstreamKind::kPages;
  } else {
    kind = cuda_vmm_supported(device) ? UpstreamKind::kPages : UpstreamKind::kSegments;
  }
  std::shared_ptr<Upstream> upstream = make_cuda_upstream(kind, device);
  PoolOptions options;
  options.release = release;
  options.release_slack = cfg.release_slack;
  options.large_page_bytes = cfg.page_size;
  options.device = device;
  options.cap_bytes = cap_bytes;
  return std::make_unique<Pool>(std::move(upstream), options);
}

Pool* GpumemAllocator::main_pool_if_created(int device) const {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return devices_[device].main.load(std::memory_order_acquire);
}

Pool& GpumemAllocator::main_pool(int device) {
  check_device(device);
  if (Pool* p = devices_[device].main.load(std::memory_order_acquire)) return *p;
  return create_main_pool(device);
}

Pool& GpumemAllocator::create_main_pool(int device) {
  DeviceState& state = devices_[device];
  std::lock_guard<std::mutex> lock(state.create_mutex);
  if (Pool* p = state.main.load(std::memory_order_acquire)) return *p;
  translate([&] {
    const Config& cfg = config();
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    std::unique_ptr<Pool> pool = make_pool(device, cfg.release, 0);
    std::size_t cap = cfg.cap_bytes;
    if (cap == 0 && cfg.cap_fraction > 0 && cfg.cap_fraction < 1)
      cap = static_cast<std::size_t>(cfg.cap_fraction *
                                     static_cast<double>(pool->upstream().device_total_bytes()));
    if (cap != 0) pool->set_cap(cap);
    if (cfg.gc_on_oom) {
      // Calls whatever callback Python set (gc.collect) at the time of the OOM.
      state.callback_id = pool->add_oom_callback([this] {
        std::function<void()> cb;
        {
          std::lock_guard<std::mutex> l(callback_mutex_);
          cb = oom_callback_;
        }
        if (!cb) return;
        try {
          cb();
        } catch (...) {
        }
      });
    }
    state.owner = std::move(pool);
  });
  state.main.store(state.owner.get(), std::memory_order_release);
  return *state.owner;
}

void GpumemAllocator::set_oom_callback(std::function<void()> callback) {
  std::lock_guard<std::mutex> lock(callback_mutex_);
  oom_callback_ = std::move(callback);
}

std::shared_ptr<PrivatePool> GpumemAllocator::find_private(int device, MempoolId id) {
  std::lock_guard<std::mutex> lock(routes_mutex_);
  auto it = private_pools_.find({device, id});
  return it == private_pools_.end() ? nullptr : it->second;
}

// Caller holds routes_mutex_.
std::shared_ptr<PrivatePool> GpumemAllocator::create_or_incref(int device, MempoolId id) {
  auto& slot = private_pools_[{device, id}];
  if (!slot) {
    slot = std::make_shared<PrivatePool>();
    slot->device = device;
    slot->id = id;
  }
  slot->use_count++;
  return slot;
}

std::vector<std::shared_ptr<PrivatePool>> GpumemAllocator::private_pools_of(int device) {
  std::lock_guard<std::mutex> lock(routes_mutex_);
  std::vector<std::shared_ptr<PrivatePool>> out;
  for (auto& [key, pp] : private_pools_)
    if (device < 0 || key.first == device) out.push_back(pp);
  return out;
}

// ---- allocation ----------------------------------------------------------------------------------

c10::DataPtr GpumemAllocator::allocate(std::size_t size) {
  const c10::DeviceIndex device = c10::cuda::current_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  c10::DeleterFnPtr deleter = nullptr;
  void* p = malloc_on(size, device, stream, &deleter);
  return {p, p, deleter, c10::Device(c10::DeviceType::CUDA, device)};
}

c10::DeleterFnPtr GpumemAllocator::raw_deleter() const { return &any_deleter; }

void* GpumemAllocator::raw_alloc(std::size_t nbytes) {
  const c10::DeviceIndex device = c10::cuda::current_device();
  return raw_alloc_with_stream(nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
}

void* GpumemAllocator::raw_alloc_with_stream(std::size_t nbytes, cudaStream_t stream) {
  const c10::DeviceIndex device = c10::cuda::current_device();
  c10::DeleterFnPtr deleter = nullptr;
  if (!is_current()) {
    // Backing a torch.cuda.MemPool of torch's own allocator, which expects null on OOM so that it
    // can report the failure itself.
    try {
      return malloc_on(nbytes, device, stream, &deleter);
    } catch (const c10::OutOfMemoryError&) {
      return nullptr;
    }
  }
  return malloc_on(nbytes, device, stream, &deleter);
}

void* GpumemAllocator::malloc_on(std::size_t size, int device, cudaStream_t stream,
                                 c10::DeleterFnPtr* deleter) {
  check_device(device);
  *deleter = kMainDeleters[device];
  if (size == 0) return nullptr;
  const bool routing = routing_count_.load(std::memory_order_acquire) > 0;
  if (routing) {
    if (std::shared_ptr<PrivatePool> pp = route(device, stream)) {
      *deleter = &private_deleter;
      return alloc_private(*pp, size, stream);
    }
  }
  Pool& pool = main_pool(device);
  std::uintptr_t p = 0;
  {
    MaybeRelaxed relaxed(routing);
    p = pool_allocate(pool, size, device, stream);
  }
  if (C10_UNLIKELY(tracing_.load(std::memory_order_relaxed)))
    trace_alloc(device, p, size, stream, kDefaultPool);
  return reinterpret_cast<void*>(p);
}

std::uintptr_t GpumemAllocator::pool_allocate(Pool& pool, std::size_t size, int device,
                                              cudaStream_t stream) {
  return translate([&]() -> std::uintptr_t {
    try {
      return pool.allocate(size, reinterpret_cast<StreamId>(stream));
    } catch (const OutOfMemoryError& e) {
      raise_oom(device, e, stream);  // torch.cuda.OutOfMemoryError, after the OOM observers
    }
  });
}

std::shared_ptr<PrivatePool> GpumemAllocator::route(int device, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(routes_mutex_);
  for (auto it = routes_.rbegin(); it != routes_.rend(); ++it)
    if (it->device == device && it->filter(stream)) return it->pool;
  return nullptr;
}

void* GpumemAllocator::alloc_private(PrivatePool& pp, std::size_t size, cudaStream_t stream) {
  std::uintptr_t p = 0;
  std::shared_ptr<PrivatePool> keep;
  {
    MaybeRelaxed relaxed(true);
    if (pp.external) {
      p = translate([&] { return reinterpret_cast<std::uintptr_t>(pp.external->raw_alloc_with_stream(size, stream)); });
      TORCH_CHECK_WITH(OutOfMemoryError, p != 0, "gpumem: the allocator of MemPool (",
                       pp.id.first, ", ", pp.id.second, ") returned no memory for ", size, " bytes");
    } else {
      Pool* pool = translate([&] {
        std::lock_guard<std::mutex> lock(pp.mutex);
        // Private pools never give memory back on their own: a graph's memory must stay mapped
        // until the graph is released.
        if (!pp.pool) pp.pool = make_pool(pp.device, ReleasePolicy::kLazy, 0);
        return pp.pool.get();
      });
      p = pool_allocate(*pool, size, pp.device, stream);
    }
  }
  {
    std::lock_guard<std::mutex> lock(routes_mutex_);
    auto it = private_pools_.find({pp.device, pp.id});
    if (it != private_pools_.end()) keep = it->second;
    private_ptrs_[p] = keep;
    private_count_.store(static_cast<int>(private_ptrs_.size()), std::memory_order_release);
  }
  if (C10_UNLIKELY(tracing_.load(std::memory_order_relaxed)))
    trace_alloc(pp.device, p, size, stream, pp.id);
  return reinterpret_cast<void*>(p);
}

void GpumemAllocator::raise_oom(int device, const OutOfMemoryError& e, cudaStream_t stream) {
  std::size_t free_bytes = 0, total_bytes = 0;
  if (Pool* pool = main_pool_if_created(device)) {
    try {
      free_bytes = pool->upstream().device_free_bytes();
      total_bytes = pool->upstream().device_total_bytes();
    } catch (...) {
    }
  }
  if (tracing_.load(std::memory_order_relaxed))
    record_trace(Action::OOM, device, free_bytes, e.requested, stream, kDefaultPool, nullptr);
  std::vector<CCA::OutOfMemoryObserver> observers;
  {
    std::lock_guard<std::mutex> lock(callback_mutex_);
    observers = oom_observers_;
  }
  for (auto& observer : observers) observer(device, e.allocated, total_bytes, free_bytes);
  // "CUDA out of memory." first, as in PyTorch's message: Lightning, Accelerate and many scripts
  // recognise an OOM by that text rather than by the exception type.
  C10_THROW_ERROR(OutOfMemoryError, std::string("CUDA out of memory. ") + e.what());
}

// ---- free ----------------------------------------------------------------------------------------

// Frees of blocks that had record_stream() record events; while a capture may be underway they wait.
// Returns true when the free was deferred.
bool GpumemAllocator::defer_if_recorded(void* ptr, int device) {
  std::lock_guard<std::mutex> lock(recorded_mutex_);
  auto it = recorded_.find(ptr);
  if (it == recorded_.end()) return false;
  recorded_.erase(it);
  recorded_count_.store(static_cast<int>(recorded_.size()), std::memory_order_release);
  if (routing_count_.load(std::memory_order_acquire) == 0) return false;
  deferred_.push_back(Deferred{ptr, device});
  return true;
}

void GpumemAllocator::flush_deferred() {
  std::vector<Deferred> todo;
  {
    std::lock_guard<std::mutex> lock(recorded_mutex_);
    if (routing_count_.load(std::memory_order_acquire) != 0) return;
    todo.swap(deferred_);
  }
  for (const Deferred& d : todo) {
    if (d.device >= 0) {
      if (!try_free_main(d.device, reinterpret_cast<std::uintptr_t>(d.ptr))) free_any(d.ptr);
    } else if (!try_free_private(d.ptr)) {
      free_any(d.ptr);
    }
  }
}

bool GpumemAllocator::try_free_main(int device, std::uintptr_t p) {
  Pool* pool = main_pool_if_created(device);
  if (!pool) return false;
  std::size_t size = 0;
  const bool tracing = tracing_.load(std::memory_order_relaxed);
  if (C10_UNLIKELY(tracing)) {
    size = pool->allocation_size(p);
    if (size == 0) return false;
  }
  try {
    // No device switch: the CUDA upstreams make their device's context current for each driver
    // call (events on the block's other streams, unmapping), whatever device this thread is on.
    MaybeRelaxed relaxed(routing_count_.load(std::memory_order_acquire) > 0);
    pool->free(p);
  } catch (const InvalidArgument&) {
    return false;  // not this pool's
  }
  if (C10_UNLIKELY(tracing)) trace_free(device, p, size, kDefaultPool);
  return true;
}

bool GpumemAllocator::try_free_private(void* ptr) {
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  std::shared_ptr<PrivatePool> pp;
  {
    std::lock_guard<std::mutex> lock(routes_mutex_);
    auto it = private_ptrs_.find(p);
    if (it == private_ptrs_.end()) return false;
    pp = it->second;
    private_ptrs_.erase(it);
    private_count_.store(static_cast<int>(private_ptrs_.size()), std::memory_order_release);
  }
  if (pp) free_private_block(pp, p);
  return true;
}

void GpumemAllocator::free_private_block(const std::shared_ptr<PrivatePool>& pp, std::uintptr_t p) {
  {
    MaybeRelaxed relaxed(routing_count_.load(std::memory_order_acquire) > 0);
    DeviceSwitch on(pp->device);
    if (pp->external) {
      pp->external->raw_delete(reinterpret_cast<void*>(p));
    } else if (pp->pool) {
      std::size_t size = tracing_.load(std::memory_order_relaxed) ? pp->pool->allocation_size(p) : 0;
      pp->pool->free(p);
      if (size) trace_free(pp->device, p, size, pp->id);
    }
  }
  maybe_destroy(pp);
}

void GpumemAllocator::free_main(int device, void* ptr) noexcept {
  if (!ptr) return;
  try {
    if (C10_UNLIKELY(recorded_count_.load(std::memory_order_acquire) > 0) &&
        defer_if_recorded(ptr, device))
      return;
    if (try_free_main(device, reinterpret_cast<std::uintptr_t>(ptr))) return;
    free_any(ptr);
  } catch (const std::exception& e) {
    TORCH_WARN("gpumem: the free of ", hex(ptr), " on device ", device, " failed: ", e.what());
  }
}

void GpumemAllocator::free_private_deleter(void* ptr) noexcept {
  if (!ptr) return;
  try {
    if (C10_UNLIKELY(recorded_count_.load(std::memory_order_acquire) > 0) &&
        defer_if_recorded(ptr, -1))
      return;
    if (try_free_private(ptr)) return;
    free_any(ptr);
  } catch (const std::exception& e) {
    TORCH_WARN("gpumem: the free of ", hex(ptr), " failed: ", e.what());
  }
}

void GpumemAllocator::free_any(void* ptr) noexcept {
  if (!ptr) return;
  try {
    if (C10_UNLIKELY(recorded_count_.load(std::memory_order_acquire) > 0)) {
      // Not knowing the owner yet, defer as a private block: flush tries every pool.
      if (defer_if_recorded(ptr, -1)) return;
    }
    if (private_count_.load(std::memory_order_acquire) > 0 && try_free_private(ptr)) return;
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    int current = -1;
    try {
      current = c10::cuda::current_device();
    } catch (...) {
    }
    if (current >= 0 && try_free_main(current, p)) return;
    for (int d = 0; d < kMaxDevices; ++d)
      if (d != current && main_pool_if_created(d) && try_free_main(d, p)) return;
    if (!warned_foreign_.exchange(true)) {
      TORCH_WARN("gpumem: ignored the free of ", hex(ptr),
                 ", which gpumem did not allocate (memory from before gpumem was registered, or a "
                 "double free); nothing was changed. Further such frees are ignored silently.");
    }
  } catch (const std::exception& e) {
    TORCH_WARN("gpumem: the free of ", hex(ptr), " failed: ", e.what());
  }
}

void GpumemAllocator::raw_delete(void* ptr) { free_any(ptr); }

void GpumemAllocator::maybe_destroy(const std::shared_ptr<PrivatePool>& pp) {
  std::unique_ptr<Pool> doomed;
  {
    std::lock_guard<std::mutex> lock(routes_mutex_);
    if (pp->use_count > 0 || routing_count_.load(std::memory_order_acquire) > 0) return;
    for (auto& [p, owner] : private_ptrs_)
      if (owner == pp) return;  // live blocks
    if (pp->pool) {
      pp->pool->process_events();
      if (pp->pool->stats().active[kAggregate].current != 0) return;  // waiting on other streams
    }
    auto it = private_pools_.find({pp->device, pp->id});
    if (it != private_pools_.end() && it->second == pp) private_pools_.erase(it);
    std::lock_guard<std::mutex> pool_lock(pp->mutex);
    doomed = std::move(pp->pool);
  }
  if (doomed) {
    DeviceSwitch on(pp->device);
    doomed.reset();  // returns the pool's memory to the device
  }
}

// ---- init, fraction, cache -----------------------------------------------------------------------

void GpumemAllocator::init(int device_count) {
  device_count_.store(device_count);
  initialized_ = true;
}

bool GpumemAllocator::initialized() { return initialized_; }

double GpumemAllocator::getMemoryFraction(c10::DeviceIndex device) {
  Pool& pool = main_pool(device);
  const std::size_t cap = pool.cap();
  if (cap == 0) return 1.0;
  return static_cast<double>(cap) / static_cast<double>(pool.upstream().device_total_bytes());
}

// A fraction in (0, 1]: the pool's cap becomes fraction * device memory and is enforced (allocations
// past it raise torch.cuda.OutOfMemoryError). 1.0 removes the cap. A fraction below what live tensors
// already hold raises ValueError and changes nothing (torch's API has no error path of its own).
void GpumemAllocator::setMemoryFraction(double fraction, c10::DeviceIndex device) {
  TORCH_CHECK_VALUE(fraction > 0.0 && fraction <= 1.0, "gpumem: memory fraction ", fraction,
                    " for device ", static_cast<int>(device),
                    " must be in (0, 1]; a fraction of 0 would forbid every allocation");
  Pool& pool = main_pool(device);
  translate([&] {
    DeviceSwitch on(device);
    const std::size_t total = pool.upstream().device_total_bytes();
    const std::size_t bytes =
        fraction >= 1.0 ? 0 : static_cast<std::size_t>(fraction * static_cast<double>(total));
    pool.set_cap(bytes);
  });
}

std::vector<CCA::StreamSegmentSize> GpumemAllocator::getExpandableSegmentSizes(c10::DeviceIndex) {
  return {};  // gpumem has no expandable segments to pre-size
}

#if GPUMEM_TORCH_VERSION >= 208
void GpumemAllocator::emptyCache(c10::MempoolId_t mempool_id) { empty_cache_impl(mempool_id); }
#else
void GpumemAllocator::emptyCache() { empty_cache_impl(kDefaultPool); }
#endif

void GpumemAllocator::empty_cache_impl(MempoolId mempool_id) {
  flush_deferred();
  const bool routing = routing_count_.load(std::memory_order_acquire) > 0;
  if (mempool_id == kDefaultPool) {
    for (int d = 0; d < kMaxDevices; ++d) {
      Pool* pool = main_pool_if_created(d);
      if (!pool) continue;
      translate([&] {
        MaybeRelaxed relaxed(routing);
        DeviceSwitch on(d);
        pool->process_events();
        pool->trim();
      });
    }
  }
  // Private pools: only those no graph or MemPool uses any more; their memory is the graph's otherwise.
  for (auto& pp : private_pools_of(-1)) {
    if (mempool_id != kDefaultPool && pp->id != mempool_id) continue;
    bool unused;
    {
      std::lock_guard<std::mutex> lock(routes_mutex_);
      unused = pp->use_count <= 0;
    }
    if (!unused) continue;
    if (pp->pool && !routing) {
      translate([&] {
        DeviceSwitch on(pp->device);
        pp->pool->process_events();
        pp->pool->trim();
      });
    }
    maybe_destroy(pp);
  }
}

void GpumemAllocator::cacheInfo(c10::DeviceIndex device, std::size_t* largestBlock) {
  Pool& pool = main_pool(device);
  translate([&] {
    DeviceSwitch on(device);
    const std::size_t largest = pool.largest_free_block();
    const DeviceStats s = pool.stats();
    const auto reserved = static_cast<std::size_t>(s.reserved_bytes[kAggregate].current);
    const std::size_t cap = pool.effective_cap();
    std::size_t headroom = cap > reserved ? cap - reserved : 0;
    headroom = std::min(headroom, pool.upstream().device_free_bytes());
    *largestBlock = std::max(largest, headroom);
  });
}

void* GpumemAllocator::getBaseAllocation(void* ptr, std::size_t* size) {
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  std::size_t found = 0;
  for (int d = 0; d < kMaxDevices && found == 0; ++d)
    if (Pool* pool = main_pool_if_created(d)) found = pool->allocation_size(p);
  if (found == 0) {
    for (auto& pp : private_pools_of(-1))
      if (pp->pool && (found = pp->pool->allocation_size(p)) != 0) break;
  }
  if (size) *size = found;
  return ptr;  // every gpumem block is its own base allocation
}

void GpumemAllocator::recordStream(const c10::DataPtr& data_ptr, c10::cuda::CUDAStream stream) {
  void* ctx = data_ptr.get_context();
  if (!ctx || !data_ptr.get()) return;
  const auto p = reinterpret_cast<std::uintptr_t>(ctx);
  const auto s = reinterpret_cast<StreamId>(stream.stream());
  const c10::DeleterFnPtr deleter = data_ptr.get_deleter();
  const int device = main_deleter_device(deleter);
  try {
    if (device >= 0) {
      Pool* pool = main_pool_if_created(device);
      if (!pool) return;
      pool->record_stream(p, s);
    } else if (deleter == &private_deleter) {
      std::shared_ptr<PrivatePool> pp;
      {
        std::lock_guard<std::mutex> lock(routes_mutex_);
        auto it = private_ptrs_.find(p);
        if (it != private_ptrs_.end()) pp = it->second;
      }
      if (!pp || pp->external || !pp->pool) return;
      pp->pool->record_stream(p, s);
    } else {
      return;  // not a gpumem block
    }
  } catch (const InvalidArgument&) {
    return;  // already freed or not ours: nothing to protect
  }
  std::lock_guard<std::mutex> lock(recorded_mutex_);
  recorded_.insert(ctx);
  recorded_count_.store(static_cast<int>(recorded_.size()), std::memory_order_release);
}

// ---- stats ---------------------------------------------------------------------------------------

DeviceStats GpumemAllocator::pool_stats(int device) {
  DeviceStats total;
  if (Pool* pool = main_pool_if_created(device)) add_stats(total, pool->stats());
  for (auto& pp : private_pools_of(device))
    if (pp->pool) add_stats(total, pp->pool->stats());
  return total;
}

CCA::DeviceStats GpumemAllocator::getDeviceStats(c10::DeviceIndex device) {
  return to_c10(pool_stats(check_device(device)));
}

void GpumemAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  if (Pool* pool = main_pool_if_created(check_device(device))) pool->reset_accumulated_stats();
  for (auto& pp : private_pools_of(device))
    if (pp->pool) pp->pool->reset_accumulated_stats();
}

void GpumemAllocator::resetPeakStats(c10::DeviceIndex device) {
  if (Pool* pool = main_pool_if_created(check_device(device))) pool->reset_peak_stats();
  for (auto& pp : private_pools_of(device))
    if (pp->pool) pp->pool->reset_peak_stats();
}

std::size_t GpumemAllocator::trim(int device) {
  Pool* pool = main_pool_if_created(check_device(device));
  if (!pool) return 0;
  return translate([&] {
    DeviceSwitch on(device);
    pool->process_events();
    return pool->trim();
  });
}

void GpumemAllocator::set_cap(int device, std::size_t bytes) {
  Pool& pool = main_pool(device);
  translate([&] {
    DeviceSwitch on(device);
    pool.set_cap(bytes);
  });
}

std::size_t GpumemAllocator::cap(int device) {
  Pool* pool = main_pool_if_created(check_device(device));
  return pool ? pool->cap() : 0;
}

std::size_t GpumemAllocator::effective_cap(int device) {
  return translate([&] { return main_pool(device).effective_cap(); });
}

std::size_t GpumemAllocator::largest_free(int device) {
  Pool* pool = main_pool_if_created(check_device(device));
  return pool ? pool->largest_free_block() : 0;
}

void GpumemAllocator::validate(int device) {
  translate([&] {
    if (Pool* pool = main_pool_if_created(check_device(device))) pool->validate();
    for (auto& pp : private_pools_of(device))
      if (pp->pool) pp->pool->validate();
  });
}

std::size_t GpumemAllocator::private_pool_count() {
  std::lock_guard<std::mutex> lock(routes_mutex_);
  return private_pools_.size();
}

// ---- snapshot & history --------------------------------------------------------------------------

void GpumemAllocator::append_segments(CCA::SnapshotInfo& out, int device, Pool& pool,
                                      MempoolId owner) {
  const bool paged = pool.upstream().kind() == UpstreamKind::kPages;
  std::vector<RegionInfo> regions = pool.snapshot();
  std::lock_guard<std::mutex> lock(trace_mutex_);
  for (const RegionInfo& r : regions) {
    CCA::SegmentInfo seg;
    seg.device = static_cast<c10::DeviceIndex>(device);
    seg.address = r.address;
    seg.total_size = r.size;
    seg.stream = reinterpret_cast<void*>(r.stream);
    seg.is_large = !r.small;
    seg.is_expandable = paged;
    seg.owner_private_pool_id = owner;
    for (const BlockInfo& b : r.blocks) {
      CCA::BlockInfo info;
      info.size = b.size;
      info.requested_size = b.requested;
      info.allocated = b.state == BlockInfo::kAllocated;
      info.active = b.state != BlockInfo::kFree;
      if (info.allocated) {
        seg.allocated_size += b.size;
        seg.requested_size += b.requested;
        auto it = alloc_context_.find(b.address);
        if (it != alloc_context_.end()) info.context_when_allocated = it->second;
      }
      if (info.active) seg.active_size += b.size;
      seg.blocks.push_back(std::move(info));
    }
    out.segments.push_back(std::move(seg));
  }
}

CCA::SnapshotInfo GpumemAllocator::snapshot_impl(MempoolId mempool_id, bool include_traces) {
  CCA::SnapshotInfo out{};
  const bool all = mempool_id == kDefaultPool;
  bool paged = false;
  int devices = std::max(device_count_.load(), 1);
  for (int d = 0; d < kMaxDevices; ++d) {
    Pool* pool = main_pool_if_created(d);
    if (!pool) continue;
    devices = std::max(devices, d + 1);
    paged = paged || pool->upstream().kind() == UpstreamKind::kPages;
    if (all) append_segments(out, d, *pool, kDefaultPool);
  }
  for (auto& pp : private_pools_of(-1)) {
    if (!all && pp->id != mempool_id) continue;
    if (pp->pool) append_segments(out, pp->device, *pp->pool, pp->id);
  }
#if GPUMEM_TORCH_VERSION >= 206
  {
    std::lock_guard<std::mutex> lock(config_mutex_);
    out.config_metadata.last_allocator_settings = "gpumem:" + conf_text_;
  }
  out.config_metadata.expandable_segments = paged;
#endif
  out.device_traces.resize(static_cast<std::size_t>(devices));
  if (include_traces) {
    static c10::ApproximateClockToUnixTimeConverter* clock =
        new c10::ApproximateClockToUnixTimeConverter();
    auto to_ns = clock->makeConverter();
    std::lock_guard<std::mutex> lock(trace_mutex_);
    for (int d = 0; d < devices && d < kMaxDevices; ++d) {
      for (const CCA::TraceEntry& te : traces_[d]) {
        out.device_traces[d].push_back(te);
        auto& copy = out.device_traces[d].back();
        copy.time_.t_ = to_ns(te.time_.approx_t_) / 1000;  // what torch's snapshot reader expects
      }
    }
  }
  return out;
}

#if GPUMEM_TORCH_VERSION >= 210
CCA::SnapshotInfo GpumemAllocator::snapshot(c10::MempoolId_t mempool_id, bool include_traces) {
  return snapshot_impl(mempool_id, include_traces);
}
#elif GPUMEM_TORCH_VERSION >= 207
CCA::SnapshotInfo GpumemAllocator::snapshot(c10::MempoolId_t mempool_id) {
  return snapshot_impl(mempool_id, true);
}
#else
CCA::SnapshotInfo GpumemAllocator::snapshot() { return snapshot_impl(kDefaultPool, true); }
#endif

bool GpumemAllocator::isHistoryEnabled() {
  std::lock_guard<std::mutex> lock(trace_mutex_);
  return record_history_;
}

#if GPUMEM_TORCH_VERSION >= 209
void GpumemAllocator::recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                                    std::size_t alloc_trace_max_entries, CCA::RecordContext when,
                                    bool clearHistory, const std::vector<std::string>& skip_actions)
#elif GPUMEM_TORCH_VERSION >= 206
void GpumemAllocator::recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                                    std::size_t alloc_trace_max_entries, CCA::RecordContext when,
                                    bool clearHistory)
#else
void GpumemAllocator::recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                                    std::size_t alloc_trace_max_entries, CCA::RecordContext when)
#endif
{
#if GPUMEM_TORCH_VERSION < 206
  const bool clearHistory = false;
#endif
  TORCH_CHECK(when == CCA::RecordContext::NEVER || context_recorder,
              "gpumem: recordHistory needs a context recorder unless context is NEVER");
  std::lock_guard<std::mutex> lock(trace_mutex_);
  record_history_ = enabled;
  context_recorder_ = enabled ? context_recorder : nullptr;
  record_context_ = enabled ? when : CCA::RecordContext::NEVER;
  max_entries_ = std::max<std::size_t>(alloc_trace_max_entries, 1);
  skip_actions_.clear();
#if GPUMEM_TORCH_VERSION >= 209
  for (const std::string& a : skip_actions) skip_actions_.insert(static_cast<int>(parse_action(a)));
#endif
  if (!enabled || clearHistory) {
    for (auto& q : traces_) q.clear();
    alloc_context_.clear();
  }
  tracing_.store(record_history_ || !trackers_.empty(), std::memory_order_relaxed);
}

void GpumemAllocator::attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) {
  std::lock_guard<std::mutex> lock(callback_mutex_);
  oom_observers_.push_back(std::move(observer));
}

void GpumemAllocator::attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) {
  std::lock_guard<std::mutex> lock(trace_mutex_);
  trackers_.push_back(std::move(tracker));
  tracing_.store(true, std::memory_order_relaxed);
}

std::shared_ptr<c10::GatheredContext> GpumemAllocator::gather_context(CCA::RecordContext level) {
  CCA::CreateContextFn recorder = nullptr;
  {
    std::lock_guard<std::mutex> lock(trace_mutex_);
    if (record_context_ >= level) recorder = context_recorder_;
  }
  return recorder ? recorder() : nullptr;  // gathered outside our locks: it may take the GIL
}

void GpumemAllocator::record_trace(Action action, int device, std::uintptr_t addr, std::size_t size,
                                   cudaStream_t stream, MempoolId pool,
                                   std::shared_ptr<c10::GatheredContext> context) {
  std::lock_guard<std::mutex> lock(trace_mutex_);
  if (device < 0 || device >= kMaxDevices) return;
#if GPUMEM_TORCH_VERSION >= 209
  CCA::TraceEntry te(action, static_cast<c10::DeviceIndex>(device), addr, size,
                     reinterpret_cast<void*>(stream), pool, c10::getApproximateTime(),
                     std::move(context));
#else
  (void)pool;
  CCA::TraceEntry te(action, static_cast<c10::DeviceIndex>(device), addr, size,
                     reinterpret_cast<void*>(stream), c10::getApproximateTime(), std::move(context));
#endif
  for (auto& tracker : trackers_) tracker(te);
  if (!record_history_ || skip_actions_.count(static_cast<int>(action))) return;
  auto& q = traces_[device];
  q.push_back(std::move(te));
  while (q.size() > max_entries_) q.pop_front();
}

void GpumemAllocator::trace_alloc(int device, std::uintptr_t p, std::size_t size,
                                  cudaStream_t stream, MempoolId pool) {
  auto context = gather_context(CCA::RecordContext::STATE);
  bool keep;
  {
    std::lock_guard<std::mutex> lock(trace_mutex_);
    keep = context && record_history_;
    if (keep) alloc_context_[p] = context;
  }
  // ALLOC entries carry the stack only from RecordContext::ALLOC up, like PyTorch's allocator.
  bool with_stack;
  {
    std::lock_guard<std::mutex> lock(trace_mutex_);
    with_stack = record_context_ >= CCA::RecordContext::ALLOC;
  }
  record_trace(Action::ALLOC, device, p, size, stream, pool, with_stack ? context : nullptr);
}

void GpumemAllocator::trace_free(int device, std::uintptr_t p, std::size_t size, MempoolId pool) {
  auto context = gather_context(CCA::RecordContext::ALL);
  {
    std::lock_guard<std::mutex> lock(trace_mutex_);
    alloc_context_.erase(p);
  }
  record_trace(Action::FREE_REQUESTED, device, p, size, nullptr, pool, context);
  record_trace(Action::FREE_COMPLETED, device, p, size, nullptr, pool, context);
}

// ---- graph pools ---------------------------------------------------------------------------------

void GpumemAllocator::beginAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                                          std::function<bool(cudaStream_t)> filter) {
  check_device(device);
  std::lock_guard<std::mutex> lock(routes_mutex_);
  for (const Route& r : routes_)
    TORCH_CHECK(!(r.device == device && r.id == mempool_id),
                "gpumem: beginAllocateToPool: already allocating to pool (", mempool_id.first, ", ",
                mempool_id.second, ") on device ", static_cast<int>(device));
  std::shared_ptr<PrivatePool> pp = create_or_incref(device, mempool_id);
  routes_.push_back(Route{device, mempool_id, std::move(filter), std::move(pp)});
  routing_count_.store(static_cast<int>(routes_.size()), std::memory_order_release);
}

void GpumemAllocator::endAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id) {
  {
    std::lock_guard<std::mutex> lock(routes_mutex_);
    auto it = std::find_if(routes_.begin(), routes_.end(), [&](const Route& r) {
      return r.device == device && r.id == mempool_id;
    });
    TORCH_CHECK(it != routes_.end(), "gpumem: endAllocateToPool: not allocating to pool (",
                mempool_id.first, ", ", mempool_id.second, ") on device ", static_cast<int>(device));
    routes_.erase(it);
    routing_count_.store(static_cast<int>(routes_.size()), std::memory_order_release);
  }
  flush_deferred();  // no-op while other captures / routes remain
}

void GpumemAllocator::releasePool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id) {
  std::shared_ptr<PrivatePool> pp;
  {
    std::lock_guard<std::mutex> lock(routes_mutex_);
    auto it = private_pools_.find({static_cast<int>(device), mempool_id});
    if (it == private_pools_.end()) return;  // never allocated into: nothing to release
    pp = it->second;
    pp->use_count = std::max(0, pp->use_count - 1);
  }
  maybe_destroy(pp);
}

int GpumemAllocator::getPoolUseCount(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id) {
  std::lock_guard<std::mutex> lock(routes_mutex_);
  auto it = private_pools_.find({static_cast<int>(device), mempool_id});
  return it == private_pools_.end() ? 0 : it->second->use_count;
}

void GpumemAllocator::createOrIncrefPool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                                         std::shared_ptr<CCA::CUDAAllocator> allocator) {
  check_device(device);
  std::lock_guard<std::mutex> lock(routes_mutex_);
  std::shared_ptr<PrivatePool> pp = create_or_incref(device, mempool_id);
  if (allocator && allocator.get() != this && !pp->external) pp->external = std::move(allocator);
}

void GpumemAllocator::setUseOnOOM(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                                  bool use_on_oom) {
  // Accepted and remembered; gpumem's OOM path does not borrow from private pools (documented).
  std::lock_guard<std::mutex> lock(routes_mutex_);
  auto it = private_pools_.find({static_cast<int>(device), mempool_id});
  if (it != private_pools_.end()) it->second->use_on_oom = use_on_oom;
}

void GpumemAllocator::setNoSplit(c10::DeviceIndex, c10::cuda::MempoolId_t) {
  // gpumem has no segments to keep unsplit: a block is always exactly the rounded request.
}

bool GpumemAllocator::checkPoolLiveAllocations(
    c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
    const std::unordered_set<void*>& expected_live_allocations) {
  std::shared_ptr<PrivatePool> pp = find_private(device, mempool_id);
  std::size_t live = 0;
  std::lock_guard<std::mutex> lock(routes_mutex_);
  for (auto& [p, owner] : private_ptrs_) {
    if (owner != pp) continue;
    if (!expected_live_allocations.count(reinterpret_cast<void*>(p))) return false;
    ++live;
  }
  return live == expected_live_allocations.size();
}

std::shared_ptr<CCA::AllocatorState> GpumemAllocator::getCheckpointState(
    c10::DeviceIndex device, c10::cuda::MempoolId_t id) {
  auto state = std::make_shared<GpumemCheckpointState>();
  state->device = device;
  state->id = id;
  std::shared_ptr<PrivatePool> pp = find_private(device, id);
  if (!pp) return state;
  std::vector<std::uintptr_t> ptrs;
  {
    std::lock_guard<std::mutex> lock(routes_mutex_);
    for (auto& [p, owner] : private_ptrs_)
      if (owner == pp) ptrs.push_back(p);
  }
  for (std::uintptr_t p : ptrs)
    state->live.emplace_back(p, pp->pool ? pp->pool->allocation_size(p) : 0);
  std::sort(state->live.begin(), state->live.end());
  return state;
}

// Restores a private pool to a checkpoint (cudagraph trees). Blocks allocated since the checkpoint
// are freed; blocks the checkpoint had that were freed since would have to be re-allocated at their
// old addresses, which gpumem's pool cannot do: that case raises a clear error, changing nothing.
CCA::CheckpointDelta GpumemAllocator::setCheckpointPoolState(
    c10::DeviceIndex device, std::shared_ptr<CCA::AllocatorState> pps) {
  auto state = std::dynamic_pointer_cast<GpumemCheckpointState>(pps);
  TORCH_CHECK(state, "gpumem: setCheckpointPoolState got a state gpumem did not make");
  std::shared_ptr<PrivatePool> pp = find_private(state->device, state->id);
  TORCH_CHECK(pp || state->live.empty(), "gpumem: the pool of the checkpoint no longer exists");
  std::vector<std::uintptr_t> current;
  if (pp) {
    std::lock_guard<std::mutex> lock(routes_mutex_);
    for (auto& [p, owner] : private_ptrs_)
      if (owner == pp) current.push_back(p);
  }
  std::sort(current.begin(), current.end());
  std::vector<std::uintptr_t> missing, extra;
  for (auto& [p, size] : state->live)
    if (!std::binary_search(current.begin(), current.end(), p)) missing.push_back(p);
  for (std::uintptr_t p : current) {
    auto it = std::lower_bound(state->live.begin(), state->live.end(),
                               std::make_pair(p, std::size_t{0}));
    if (it == state->live.end() || it->first != p) extra.push_back(p);
  }
  TORCH_CHECK(missing.empty(), "gpumem: cannot restore a CUDA graph tree checkpoint: ",
              missing.size(),
              " block(s) freed since the checkpoint would have to be re-allocated at their old "
              "addresses, which gpumem does not support. Workarounds: "
              "torch._inductor.config.triton.cudagraph_trees = False, or GPUMEM_DISABLE=1.");
  CCA::CheckpointDelta delta;
  for (std::uintptr_t p : extra) {
    {
      std::lock_guard<std::mutex> lock(routes_mutex_);
      private_ptrs_.erase(p);
      private_count_.store(static_cast<int>(private_ptrs_.size()), std::memory_order_release);
    }
    free_private_block(pp, p);
  }
  // Like PyTorch's allocator: every block of the checkpoint is handed back as a fresh DataPtr.
  for (std::uintptr_t p : current) delta.ptrs_freed.push_back(reinterpret_cast<void*>(p));
  for (auto& [p, size] : state->live) {
    void* ptr = reinterpret_cast<void*>(p);
    delta.dataptrs_allocd.emplace_back(ptr, ptr, &private_deleter,
                                       c10::Device(c10::DeviceType::CUDA, device));
  }
  return delta;
}

// ---- IPC, peers, name ----------------------------------------------------------------------------

std::shared_ptr<void> GpumemAllocator::getIpcDevPtr(std::string) {
  TORCH_CHECK(false, "gpumem does not support CUDA IPC (sharing CUDA tensors between processes with "
                     "torch.multiprocessing); run that process with GPUMEM_DISABLE=1");
}

CCA::ShareableHandle GpumemAllocator::shareIpcHandle(void*) {
  TORCH_CHECK(false, "gpumem does not support CUDA IPC (sharing CUDA tensors between processes with "
                     "torch.multiprocessing); run that process with GPUMEM_DISABLE=1");
}

void GpumemAllocator::enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) {
  c10::cuda::CUDAGuard guard(dev);
  cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();  // clear the sticky-free error state
  } else {
    C10_CUDA_CHECK(err);
  }
}

cudaError_t GpumemAllocator::memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                                         std::size_t count, cudaStream_t stream, bool) {
  if (dstDevice == srcDevice)
    return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  // The peer copy works for virtual-memory (cuMemMap) blocks whether or not peer access is on.
  return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
}

std::string GpumemAllocator::name() { return "gpumem"; }

}  // namespace gpumem::torch_bridge
