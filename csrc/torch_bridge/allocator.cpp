// gpumem's PyTorch allocator: construction and configuration, the main pools, routing of
// allocations, every free path (one deleter for all blocks), deferred frees, memory fraction,
// empty_cache, cacheInfo, record_stream and peer copies. See allocator.hpp for the design.
#include "torch_bridge/allocator.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <utility>

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "core/cuda_upstream.hpp"
#include "torch_bridge/bridge_util.hpp"
#include "torch_bridge/external_upstream.hpp"

namespace gpumem::torch_bridge {

namespace {

// The deleter of every gpumem DataPtr, main pool or private: raw_deleter() returns it, and torch's
// cudagraph trees compare storages' deleters with raw_deleter() before swapping them.
void gpumem_deleter(void* ptr) { GpumemAllocator::instance().free_any(ptr); }

// Requests of 1 EB or more fail before anything else, with PyTorch's own words.
constexpr std::size_t kOneExabyte = std::size_t(1) << 60;

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
  TORCH_CHECK_INDEX(device >= 0 && device < kMaxDevices, cat("gpumem: invalid CUDA device ", device));
  return device;
}

// ---- pools ---------------------------------------------------------------------------------------

std::unique_ptr<Pool> GpumemAllocator::make_pool(int device, MempoolId id, ReleasePolicy release,
                                                 std::shared_ptr<CCA::CUDAAllocator> external) {
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
  std::shared_ptr<Upstream> upstream = std::make_shared<TimedUpstream>(
      external ? make_external_upstream(make_cuda_upstream(UpstreamKind::kSegments, device),
                                        std::move(external), device)
               : make_cuda_upstream(kind, device, cfg.ipc),
      devices_[device].upstream_time);
  PoolOptions options;
  options.release = release;
  options.release_slack = cfg.release_slack;
  options.large_page_bytes = cfg.page_size;
  // Graph pools and MemPools never stitch: unmapping a parked page may wait for the device, which a
  // stream capture forbids.
  options.stitch = cfg.stitch && id == kDefaultPool;
  options.stitch_slack = cfg.stitch_slack;
  options.ends_by_page = cfg.ends_by_page;
  options.early_ends_by_page = cfg.early_ends_by_page;
  options.park_lent = cfg.park_lent && id == kDefaultPool;  // parks as stitching does: never in a capture
  options.device = device;
  options.budget = devices_[device].budget;  // one limit for all the device's pools, as torch's
  auto pool = std::make_unique<Pool>(std::move(upstream), options);
  // Maps and unmaps become torch's segment trace events (memory history, NCCL's trace trackers).
  pool->set_segment_observer([this, device, id](SegmentEvent event, std::uintptr_t address,
                                                std::size_t bytes, StreamId stream) {
    if (tracing_.load(std::memory_order_relaxed))
      on_segment_event(device, id, event, address, bytes, stream);
  });
  return pool;
}

UpstreamTime& GpumemAllocator::upstream_time(int device) {
  return *devices_[check_device(device)].upstream_time;
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
    std::unique_ptr<Pool> pool = make_pool(device, kDefaultPool, cfg.release);
    std::size_t cap = cfg.cap_bytes;
    if (cap == 0 && cfg.cap_fraction > 0 && cfg.cap_fraction < 1)
      cap = static_cast<std::size_t>(cfg.cap_fraction *
                                     static_cast<double>(pool->upstream().device_total_bytes()));
    if (cap != 0) pool->set_cap(cap);
    const bool gc_on_oom = cfg.gc_on_oom;
    state.callback_id = pool->add_oom_callback([this, device, gc_on_oom] { run_oom_callbacks(device, gc_on_oom); });
    state.owner = std::move(pool);
  });
  state.main.store(state.owner.get(), std::memory_order_release);
  return *state.owner;
}

void GpumemAllocator::run_oom_callbacks(int device, bool gc_on_oom) {
  // torch's own free-memory callbacks first (oom.cpp), as PyTorch's allocator runs them before it
  // takes more memory; then whatever callback Python set (gc.collect), unless gc_on_oom:false.
  run_torch_free_memory_callbacks(device);
  if (!gc_on_oom) return;
  std::function<void()> cb;
  {
    std::lock_guard<std::mutex> l(callback_mutex_);
    cb = oom_callback_;
  }
  if (!cb) return;
  try {
    cb();
  } catch (const std::exception& e) {
    // The allocation still gets its retry and, failing that, its OutOfMemoryError.
    TORCH_WARN(cat("gpumem: the out-of-memory callback on device ", device, " failed: ", e.what()));
  }
}

void GpumemAllocator::set_oom_callback(std::function<void()> callback) {
  std::lock_guard<std::mutex> lock(callback_mutex_);
  oom_callback_ = std::move(callback);
}

// ---- allocation ----------------------------------------------------------------------------------

c10::DataPtr GpumemAllocator::allocate(std::size_t size) {
  const c10::DeviceIndex device = c10::cuda::current_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  void* p = malloc_on(size, device, stream);
  return {p, p, &gpumem_deleter, c10::Device(c10::DeviceType::CUDA, device)};
}

c10::DeleterFnPtr GpumemAllocator::raw_deleter() const { return &gpumem_deleter; }

void* GpumemAllocator::raw_alloc(std::size_t nbytes) {
  const c10::DeviceIndex device = c10::cuda::current_device();
  return raw_alloc_with_stream(nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
}

void* GpumemAllocator::raw_alloc_with_stream(std::size_t nbytes, cudaStream_t stream) {
  const c10::DeviceIndex device = c10::cuda::current_device();
  if (!is_current()) {
    // Backing a torch.cuda.MemPool of torch's own allocator, which expects null on OOM so that it
    // can report the failure itself.
    try {
      return malloc_on(nbytes, device, stream);
    } catch (const c10::OutOfMemoryError&) {
      return nullptr;
    }
  }
  return malloc_on(nbytes, device, stream);
}

void* GpumemAllocator::malloc_on(std::size_t size, int device, cudaStream_t stream) {
  check_device(device);
  if (size == 0) return nullptr;
  if (C10_UNLIKELY(size >= kOneExabyte)) {
    // PyTorch's allocator refuses these before anything else, with these words.
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate more than 1EB memory.");
  }
  if (C10_UNLIKELY(size > kMaxRequest)) {
    Pool& pool = main_pool(device);
    pool.count_oom();
    raise_oom(device, size,
              "gpumem: the request is larger than any device's memory; is the size negative or "
              "uninitialised?", pool.allocated_bytes(), stream);
  }
  // With history on, the Python (and C++) stack is gathered once, before any lock: the ALLOC entry
  // and the segment_map events this allocation causes share it.
  std::shared_ptr<c10::GatheredContext> context;
  const bool tracing = tracing_.load(std::memory_order_relaxed);
  if (C10_UNLIKELY(tracing)) context = gather_context(CCA::RecordContext::STATE);
  std::optional<CallContextScope> scope;
  if (C10_UNLIKELY(tracing)) scope.emplace(context);

  const bool routing = routing_count_.load(std::memory_order_acquire) > 0;
  if (routing) {
    if (std::shared_ptr<PrivatePool> pp = route(device, stream)) {
      void* p = alloc_private(*pp, size, stream);
      count_torch(device, static_cast<std::int64_t>(round_up(size, kAlignment)));
      if (C10_UNLIKELY(tracing))
        trace_alloc(device, reinterpret_cast<std::uintptr_t>(p), size, stream, pp->id, context);
      if (C10_UNLIKELY(c10::memoryProfilingEnabled()))
        report_to_profiler(device, reinterpret_cast<std::uintptr_t>(p), static_cast<std::int64_t>(size));
      return p;
    }
  }
  Pool& pool = main_pool(device);
  std::uintptr_t p = 0;
  {
    MaybeRelaxed relaxed(routing);
    p = pool_allocate(pool, size, device, stream, /*may_borrow=*/true);
  }
  count_torch(device, static_cast<std::int64_t>(round_up(size, kAlignment)));
  if (C10_UNLIKELY(tracing)) trace_alloc(device, p, size, stream, kDefaultPool, context);
  if (C10_UNLIKELY(c10::memoryProfilingEnabled()))
    report_to_profiler(device, p, static_cast<std::int64_t>(round_up(size, kAlignment)));
  return reinterpret_cast<void*>(p);
}

std::uintptr_t GpumemAllocator::pool_allocate(Pool& pool, std::size_t size, int device,
                                              cudaStream_t stream, bool may_borrow) {
  return translate([&]() -> std::uintptr_t {
    try {
      // A request a MemPool lends to is no OOM: counted only once borrowing failed too.
      return pool.allocate(size, reinterpret_cast<StreamId>(stream), /*count_oom=*/!may_borrow);
    } catch (const OutOfMemoryError& e) {
      if (may_borrow) {
        if (std::uintptr_t p = borrow_from_oom_pools(device, size, stream)) return p;
        pool.count_oom();
      }
      // torch.cuda.OutOfMemoryError in PyTorch's words, after the OOM observers.
      raise_oom(device, e.requested, e.what(), e.allocated, stream);
    }
  });
}

// ---- free ----------------------------------------------------------------------------------------

void GpumemAllocator::free_any(void* ptr) noexcept {
  if (!ptr) return;
  try {
    if (C10_UNLIKELY(recorded_count_.load(std::memory_order_acquire) > 0) && defer_if_recorded(ptr))
      return;
    if (free_now(ptr)) return;
    if (!warned_foreign_.exchange(true)) {
      TORCH_WARN(cat("gpumem: ignored the free of ", hex(ptr),
                 ", which gpumem did not allocate (memory from before gpumem was registered, or a "
                 "double free); nothing was changed. Further such frees are ignored silently."));
    }
  } catch (const std::exception& e) {
    // A deleter cannot throw (it runs in destructors): the failure is reported, nothing is freed.
    TORCH_WARN(cat("gpumem: the free of ", hex(ptr), " failed: ", e.what()));
  }
}

// Finds the pool that owns `ptr` and frees it there: the current device's main pool (most frees),
// the private pools, then the other devices' main pools. Each probe is a lookup, not an exception.
// False when no pool owns it (foreign, interior or already freed pointer): nothing changed.
bool GpumemAllocator::free_now(void* ptr) {
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) {
    (void)cudaGetLastError();
    current = -1;
  }
  if (current >= 0 && try_free_main(current, p)) return true;
  if (private_count_.load(std::memory_order_acquire) > 0 && try_free_private(ptr)) return true;
  for (int d = 0; d < kMaxDevices; ++d)
    if (d != current && main_pool_if_created(d) && try_free_main(d, p)) return true;
  return false;
}

bool GpumemAllocator::try_free_main(int device, std::uintptr_t p) {
  Pool* pool = main_pool_if_created(device);
  if (!pool) return false;
  const bool tracing = tracing_.load(std::memory_order_relaxed);
  const bool profiling = c10::memoryProfilingEnabled();
  std::size_t size = 0;
  if (C10_UNLIKELY(tracing || profiling)) {
    size = pool->allocation_size(p);
    if (size == 0) return false;
  }
  std::shared_ptr<c10::GatheredContext> context;
  std::optional<CallContextScope> scope;
  if (C10_UNLIKELY(tracing)) scope.emplace(context = gather_context(CCA::RecordContext::ALL));
  {
    // No device switch: the CUDA upstreams make their device's context current for each driver
    // call (events on the block's other streams, unmapping), whatever device this thread is on.
    MaybeRelaxed relaxed(routing_count_.load(std::memory_order_acquire) > 0);
    std::size_t freed = 0;
    if (!pool->try_free(p, &freed)) return false;
    count_torch(device, -static_cast<std::int64_t>(freed));
  }
  if (C10_UNLIKELY(tracing)) trace_free(device, p, size, kDefaultPool, std::move(context));
  if (C10_UNLIKELY(profiling)) report_to_profiler(device, p, -static_cast<std::int64_t>(size));
  return true;
}

// Frees of blocks that had record_stream() record events; while a capture may be underway they wait
// until the last capture ends. Returns true when the free was deferred.
bool GpumemAllocator::defer_if_recorded(void* ptr) {
  std::lock_guard<std::mutex> lock(recorded_mutex_);
  auto it = recorded_.find(ptr);
  if (it == recorded_.end()) return false;
  recorded_.erase(it);
  recorded_count_.store(static_cast<int>(recorded_.size()), std::memory_order_release);
  if (routing_count_.load(std::memory_order_acquire) == 0) return false;
  deferred_.push_back(ptr);
  return true;
}

void GpumemAllocator::flush_deferred() {
  std::vector<void*> todo;
  {
    std::lock_guard<std::mutex> lock(recorded_mutex_);
    if (routing_count_.load(std::memory_order_acquire) != 0) return;
    todo.swap(deferred_);
  }
  for (void* ptr : todo) free_any(ptr);
}

// An explicit call (torch.cuda.caching_allocator_delete, cudagraph trees, NCCL): a pointer gpumem does
// not own raises, as with PyTorch's allocator, and changes nothing.
void GpumemAllocator::raw_delete(void* ptr) {
  if (!ptr) return;
  if (C10_UNLIKELY(recorded_count_.load(std::memory_order_acquire) > 0) && defer_if_recorded(ptr)) return;
  TORCH_CHECK(free_now(ptr), cat("invalid device pointer: ", ptr, " (gpumem: not a live block of its pools; "
              "nothing was freed)"));
}

// ---- init, fraction, cache -----------------------------------------------------------------------

void GpumemAllocator::init(int device_count) {
  device_count_.store(device_count);
  initialized_ = true;
}

bool GpumemAllocator::initialized() { return initialized_; }

double GpumemAllocator::getMemoryFraction(c10::DeviceIndex device) {
  check_device(device);
  const double set = devices_[device].fraction.load();
  if (set >= 0) return set;  // exactly what set_per_process_memory_fraction was given
  Pool& pool = main_pool(device);
  const std::size_t cap = pool.cap();
  if (cap == 0) return 1.0;
  return static_cast<double>(cap) / static_cast<double>(pool.upstream().device_total_bytes());
}

// As PyTorch's allocator: any fraction in [0, 1]. The pool's limit becomes fraction * device memory;
// it may be below what live tensors hold (they stay; new memory is refused), and 0 refuses every
// allocation. 1.0 removes the limit. gpumem's own cap (GPUMEM_CONF cap, gpumem.set_cap) still applies.
void GpumemAllocator::setMemoryFraction(double fraction, c10::DeviceIndex device) {
  // (NaN fails the test too, as with PyTorch's allocator.)
  TORCH_CHECK(0 <= fraction && fraction <= 1, cat("invalid fraction:", fraction,
              ". Please set within [0, 1]."));
  check_device(device);
  Pool& pool = main_pool(device);
  translate([&] {
    DeviceSwitch on(device);
    const std::size_t total = pool.upstream().device_total_bytes();
    // Rounded, not truncated: a fraction computed as bytes / total gives those bytes back.
    const auto bytes = static_cast<std::size_t>(std::llround(fraction * static_cast<double>(total)));
    pool.set_limit(fraction >= 1.0 ? Pool::kNoLimit : bytes);
  });
  devices_[device].fraction.store(fraction);
}

std::vector<CCA::StreamSegmentSize> GpumemAllocator::getExpandableSegmentSizes(c10::DeviceIndex) {
  return {};  // gpumem has no expandable segments to pre-size
}

#if GPUMEM_TORCH_VERSION >= 208
void GpumemAllocator::emptyCache(c10::MempoolId_t mempool_id) { empty_cache_impl(mempool_id); }
#else
void GpumemAllocator::emptyCache() { empty_cache_impl(kDefaultPool); }
#endif

void GpumemAllocator::trim_main_pool(int device, bool relaxed_mode) {
  Pool* pool = main_pool_if_created(device);
  if (!pool) return;
  MaybeRelaxed relaxed(relaxed_mode);
  DeviceSwitch on(device);
  pool->process_events();
  pool->trim();
}

void GpumemAllocator::empty_cache_impl(MempoolId mempool_id) {
  flush_deferred();
  const bool routing = routing_count_.load(std::memory_order_acquire) > 0;
  // The segment_unmap events of this call carry its stack when history records context "all".
  std::optional<CallContextScope> scope;
  if (C10_UNLIKELY(tracing_.load(std::memory_order_relaxed)))
    scope.emplace(gather_context(CCA::RecordContext::ALL));
  if (mempool_id == kDefaultPool)
    for (int d = 0; d < kMaxDevices; ++d) translate([&] { trim_main_pool(d, routing); });
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
    const std::size_t reserved = pool.reserved_bytes();
    const std::size_t cap = pool.effective_cap();
    std::size_t headroom = cap > reserved ? cap - reserved : 0;
    headroom = std::min(headroom, pool.upstream().device_free_bytes());
    *largestBlock = std::max(largest, headroom);
  });
}

Pool* GpumemAllocator::owning_pool(std::uintptr_t p, int* device) {
  for (int d = 0; d < kMaxDevices; ++d) {
    Pool* pool = main_pool_if_created(d);
    if (pool && pool->allocation_size(p) != 0) {
      if (device) *device = d;
      return pool;
    }
  }
  std::lock_guard<std::mutex> lock(routes_mutex_);
  auto it = private_ptrs_.find(p);
  if (it == private_ptrs_.end() || !it->second || !it->second->pool) return nullptr;
  if (device) *device = it->second->device;
  return it->second->pool.get();
}

void* GpumemAllocator::getBaseAllocation(void* ptr, std::size_t* size) {
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  Pool* owner = owning_pool(p);
  if (size) *size = owner ? owner->allocation_size(p) : 0;
  return ptr;  // every gpumem block is its own base allocation
}

void GpumemAllocator::recordStream(const c10::DataPtr& data_ptr, c10::cuda::CUDAStream stream) {
  void* ctx = data_ptr.get_context();
  if (!ctx || !data_ptr.get() || data_ptr.get_deleter() != &gpumem_deleter) return;  // not ours
  const auto p = reinterpret_cast<std::uintptr_t>(ctx);
  const auto s = reinterpret_cast<StreamId>(stream.stream());
  Pool* owner = owning_pool(p);
  if (!owner) return;  // already freed: nothing to protect
  try {
    owner->record_stream(p, s);
  } catch (const InvalidArgument&) {
    return;  // freed by another thread meanwhile
  }
  std::lock_guard<std::mutex> lock(recorded_mutex_);
  recorded_.insert(ctx);
  recorded_count_.store(static_cast<int>(recorded_.size()), std::memory_order_release);
}

// ---- peers, name (IPC: ipc.cpp) ------------------------------------------------------------------

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
