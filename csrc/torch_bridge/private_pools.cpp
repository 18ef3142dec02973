// Private pools: the memory of CUDA graph captures and torch.cuda.MemPool ids. Owns the routes that
// send allocations to them (beginAllocateToPool / endAllocateToPool), their use counts and lifetime
// (createOrIncrefPool / releasePool), the frees of their blocks, and cudagraph trees' checkpoints:
// getCheckpointState records a pool's live blocks, setCheckpointPoolState brings the pool back to
// them, freeing what was allocated since and allocating again, at the same addresses, what was freed
// since (Pool::allocate_at), as PyTorch's allocator does.
#include <algorithm>
#include <utility>

#include <c10/core/Allocator.h>

#include "torch_bridge/allocator.hpp"
#include "torch_bridge/bridge_util.hpp"

namespace gpumem::torch_bridge {

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

Pool& GpumemAllocator::private_pool_memory(PrivatePool& pp) {
  return *translate([&] {
    std::lock_guard<std::mutex> lock(pp.mutex);
    // Private pools never give memory back on their own: a graph's memory must stay mapped until the
    // graph is released.
    if (!pp.pool) {
      pp.pool = make_pool(pp.device, pp.id, ReleasePolicy::kLazy, pp.external);
      const int device = pp.device;
      pp.pool->add_oom_callback([this, device] { reclaim_for_private_pool(device); });
    }
    return pp.pool.get();
  });
}

void GpumemAllocator::remember_private(std::uintptr_t p, std::shared_ptr<PrivatePool> pp) {
  private_ptrs_[p] = std::move(pp);
  private_count_.store(static_cast<int>(private_ptrs_.size()), std::memory_order_release);
}

void GpumemAllocator::forget_private(std::uintptr_t p) {
  private_ptrs_.erase(p);
  private_count_.store(static_cast<int>(private_ptrs_.size()), std::memory_order_release);
}

std::vector<std::uintptr_t> GpumemAllocator::live_pointers_of(const std::shared_ptr<PrivatePool>& pp) {
  std::vector<std::uintptr_t> out;
  std::lock_guard<std::mutex> lock(routes_mutex_);
  for (auto& [p, owner] : private_ptrs_)
    if (owner == pp) out.push_back(p);
  std::sort(out.begin(), out.end());
  return out;
}

// ---- allocation and free -------------------------------------------------------------------------

std::shared_ptr<PrivatePool> GpumemAllocator::route(int device, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(routes_mutex_);
  for (auto it = routes_.rbegin(); it != routes_.rend(); ++it)
    if (it->device == device && it->filter(stream)) return it->pool;
  return nullptr;
}

void* GpumemAllocator::alloc_private(PrivatePool& pp, std::size_t size, cudaStream_t stream) {
  std::uintptr_t p = 0;
  {
    MaybeRelaxed relaxed(true);
    p = pool_allocate(private_pool_memory(pp), size, pp.device, stream);
  }
  std::lock_guard<std::mutex> lock(routes_mutex_);
  auto it = private_pools_.find({pp.device, pp.id});
  remember_private(p, it != private_pools_.end() ? it->second : nullptr);
  return reinterpret_cast<void*>(p);
}

bool GpumemAllocator::try_free_private(void* ptr) {
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  std::shared_ptr<PrivatePool> pp;
  {
    std::lock_guard<std::mutex> lock(routes_mutex_);
    auto it = private_ptrs_.find(p);
    if (it == private_ptrs_.end()) return false;
    pp = it->second;
    forget_private(p);
  }
  if (pp) free_private_block(pp, p);
  return true;
}

void GpumemAllocator::reclaim_for_private_pool(int device) {
  // As PyTorch's allocator: its retry releases the default pools' cached blocks, but not while a
  // graph capture is underway (nothing may be freed or synchronised then), and runs the free-memory
  // callbacks for every pool. Without this a MemPool ran out while the main pool held cached memory
  // under the same fraction (one budget per device) or on the same full device. Allocations come
  // from the current stream (malloc_on), so its capture status is the allocation's.
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) return;
  run_oom_callbacks(device, config().gc_on_oom);
  // Another thread may be capturing: the main pool's release runs in relaxed mode, as
  // empty_cache() does (its pages were free, so no capture uses them).
  trim_main_pool(device, routing_count_.load(std::memory_order_acquire) > 0);
}

std::uintptr_t GpumemAllocator::borrow_from_oom_pools(int device, std::size_t size, cudaStream_t stream) {
  for (auto& pp : private_pools_of(device)) {
    {
      // Only a live MemPool lends: one whose Python object is gone (use count 0) keeps its blocks
      // until they die, and then its memory goes back to the device.
      std::lock_guard<std::mutex> lock(routes_mutex_);
      if (!pp->use_on_oom || pp->use_count <= 0) continue;
    }
    std::uintptr_t p = 0;
    {
      std::lock_guard<std::mutex> lock(pp->mutex);  // the pool stays while it lends
      if (pp->pool) p = pp->pool->allocate_cached(size, reinterpret_cast<StreamId>(stream));
    }
    if (!p) continue;
    std::lock_guard<std::mutex> lock(routes_mutex_);
    remember_private(p, pp);  // freed back into the lending pool
    return p;
  }
  return 0;
}

void GpumemAllocator::free_private_block(const std::shared_ptr<PrivatePool>& pp, std::uintptr_t p) {
  {
    MaybeRelaxed relaxed(routing_count_.load(std::memory_order_acquire) > 0);
    DeviceSwitch on(pp->device);
    if (pp->pool) {
      const bool tracing = tracing_.load(std::memory_order_relaxed);
      const bool profiling = c10::memoryProfilingEnabled();
      // (Always looked up: torch's per-library live bytes count it.)
      const std::size_t size = pp->pool->allocation_size(p);
      std::shared_ptr<c10::GatheredContext> context;
      if (C10_UNLIKELY(tracing)) context = gather_context(CCA::RecordContext::ALL);
      pp->pool->free(p);
      count_torch(pp->device, -static_cast<std::int64_t>(size));
      if (C10_UNLIKELY(tracing && size)) trace_free(pp->device, p, size, pp->id, std::move(context));
      if (C10_UNLIKELY(profiling && size))
        report_to_profiler(pp->device, p, -static_cast<std::int64_t>(size));
    }
  }
  maybe_destroy(pp);
}

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

// ---- routes and use counts -----------------------------------------------------------------------

void GpumemAllocator::beginAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                                          std::function<bool(cudaStream_t)> filter) {
  check_device(device);
  std::lock_guard<std::mutex> lock(routes_mutex_);
  for (const Route& r : routes_)
    TORCH_CHECK(!(r.device == device && r.id == mempool_id),
                cat("gpumem: beginAllocateToPool: already allocating to pool (", mempool_id.first, ", ",
                mempool_id.second, ") on device ", static_cast<int>(device)));
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
    TORCH_CHECK(it != routes_.end(), cat("gpumem: endAllocateToPool: not allocating to pool (",
                mempool_id.first, ", ", mempool_id.second, ") on device ", static_cast<int>(device)));
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
  // A main-pool allocation that runs out of memory then borrows this pool's cached memory.
  std::lock_guard<std::mutex> lock(routes_mutex_);
  auto it = private_pools_.find({static_cast<int>(device), mempool_id});
  if (it != private_pools_.end()) it->second->use_on_oom = use_on_oom;
}

void GpumemAllocator::setNoSplit(c10::DeviceIndex, c10::cuda::MempoolId_t) {
  // gpumem has no segments to keep unsplit: a block is always exactly the rounded request.
}

// ---- cudagraph trees' checkpoints ----------------------------------------------------------------

bool GpumemAllocator::checkPoolLiveAllocations(
    c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
    const std::unordered_set<void*>& expected_live_allocations) {
  std::shared_ptr<PrivatePool> pp = find_private(device, mempool_id);
  TORCH_CHECK(pp, cat("gpumem: no memory pool (", mempool_id.first, ", ", mempool_id.second,
              ") on device ", static_cast<int>(device)));
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
  TORCH_CHECK(pp, cat("gpumem: no memory pool (", id.first, ", ", id.second, ") on device ",
              static_cast<int>(device), " to checkpoint"));
  for (std::uintptr_t p : live_pointers_of(pp)) {
    BlockInfo info{};
    if (pp->pool && pp->pool->live_block(p, &info))
      state->live.push_back({p, info.size, info.requested ? info.requested : info.size});
  }
  return state;
}

// Brings a private pool back to a checkpoint, as PyTorch's allocator does: every block allocated now
// is freed (reported in ptrs_freed) and every block of the checkpoint is allocated again at its
// address (handed back in dataptrs_allocd, with gpumem's deleter). Blocks that are live now with the
// checkpoint's address and size are kept as they are, which is the same memory at the same address.
CCA::CheckpointDelta GpumemAllocator::setCheckpointPoolState(
    c10::DeviceIndex device, std::shared_ptr<CCA::AllocatorState> pps) {
  auto state = std::dynamic_pointer_cast<GpumemCheckpointState>(pps);
  TORCH_CHECK(state, "gpumem: setCheckpointPoolState got a state gpumem did not make");
  TORCH_CHECK(state->device == device, cat("gpumem: setCheckpointPoolState: the checkpoint is of device ",
              state->device, ", not ", static_cast<int>(device)));
  std::shared_ptr<PrivatePool> pp = find_private(state->device, state->id);
  TORCH_CHECK(pp || state->live.empty(), cat("gpumem: cannot restore a checkpoint of pool (",
              state->id.first, ", ", state->id.second, "): the pool no longer exists"));
  CCA::CheckpointDelta delta;
  if (!pp) return delta;

  const std::vector<std::uintptr_t> current = live_pointers_of(pp);
  auto in_checkpoint = [&](std::uintptr_t p, std::size_t size) {
    auto it = std::lower_bound(state->live.begin(), state->live.end(), p,
                               [](const GpumemCheckpointState::Live& l, std::uintptr_t a) {
                                 return l.address < a;
                               });
    return it != state->live.end() && it->address == p && it->size == size;
  };
  DeviceSwitch on(pp->device);
  MaybeRelaxed relaxed(routing_count_.load(std::memory_order_acquire) > 0);
  std::unordered_set<std::uintptr_t> kept;
  for (std::uintptr_t p : current) {
    delta.ptrs_freed.push_back(reinterpret_cast<void*>(p));
    const std::size_t size = pp->pool ? pp->pool->allocation_size(p) : 0;
    if (size && in_checkpoint(p, size)) {
      kept.insert(p);
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(routes_mutex_);
      forget_private(p);
    }
    if (pp->pool) translate([&] { pp->pool->free(p); });
    if (size) count_torch(pp->device, -static_cast<std::int64_t>(size));
    if (tracing_.load(std::memory_order_relaxed) && size) trace_free(pp->device, p, size, pp->id, nullptr);
  }
  if (!state->live.empty()) {
    Pool* pool = &private_pool_memory(*pp);
    pool->process_events();
    for (const auto& block : state->live) {
      if (kept.count(block.address)) continue;
      try {
        pool->allocate_at(block.address, block.requested);
      } catch (const std::exception& e) {
        TORCH_CHECK(false, cat("gpumem: cannot restore the checkpoint of pool (", state->id.first, ", ",
                    state->id.second, "): the block at ", hex(reinterpret_cast<void*>(block.address)),
                    " (", block.size, " bytes) cannot be allocated again: ", e.what()));
      }
      {
        std::lock_guard<std::mutex> lock(routes_mutex_);
        remember_private(block.address, pp);
      }
      count_torch(pp->device, static_cast<std::int64_t>(block.size));
      if (tracing_.load(std::memory_order_relaxed))
        trace_alloc(pp->device, block.address, block.requested, nullptr, pp->id, nullptr);
    }
  }
  for (const auto& block : state->live) {
    void* ptr = reinterpret_cast<void*>(block.address);
    delta.dataptrs_allocd.emplace_back(ptr, ptr, raw_deleter(),
                                       c10::Device(c10::DeviceType::CUDA, device));
  }
  return delta;
}

}  // namespace gpumem::torch_bridge
