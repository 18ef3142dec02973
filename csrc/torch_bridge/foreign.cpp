// Other libraries' memory from gpumem's pools: CuPy, Numba and RMM allocate from the device's main
// pool (the one torch's allocations use) through foreign_alloc / foreign_free, so memory one library
// freed is reused by the others, one cap and one fraction bound them all, and an out-of-memory in
// any of them first releases the cache and runs the OOM callbacks (gc.collect), as torch's does.
//
// Stream order: a foreign block is allocated on the library's stream S and lives in the main pool's
// arena of S (pool.hpp). Freed, it is reused at once only by allocations on S, which S orders after
// the library's work; another stream (torch's on T) gets its memory only once the pool releases the
// free pages of S's arena, which unmaps them only after an event recorded on S has completed
// (pool_drain.cpp). A free that names another
// stream (RMM's deallocate does) records that stream on the block first, so reuse also waits for it.
//
// Per-library live bytes: the foreign blocks are kept in a ledger (pointer -> library, size, device,
// stream) under foreign_mutex_, which is never held during a pool call (an OOM's gc.collect frees
// foreign blocks from inside the allocation). torch's live bytes are counted by the allocator's own
// paths (count_torch: atomics, the hot path); peaks are reset with torch's reset_peak_memory_stats.
#include <algorithm>
#include <optional>

#include <c10/cuda/CUDAGuard.h>

#include "torch_bridge/allocator.hpp"
#include "torch_bridge/bridge_util.hpp"

namespace gpumem::torch_bridge {

const char* library_name(Library library) {
  switch (library) {
    case Library::kTorch: return "torch";
    case Library::kCupy: return "cupy";
    case Library::kNumba: return "numba";
    case Library::kRmm: return "rmm";
  }
  return "?";
}

void GpumemAllocator::count_torch(int device, std::int64_t delta) {
  if (delta == 0) return;
  DeviceState& state = devices_[device];
  const std::int64_t now = state.torch_bytes.fetch_add(delta, std::memory_order_relaxed) + delta;
  state.torch_blocks.fetch_add(delta > 0 ? 1 : -1, std::memory_order_relaxed);
  if (delta <= 0) return;
  std::int64_t peak = state.torch_peak.load(std::memory_order_relaxed);
  while (now > peak &&
         !state.torch_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void* GpumemAllocator::foreign_alloc(Library library, std::size_t size, int device, cudaStream_t stream) {
  check_device(device);
  const int index = static_cast<int>(library);
  TORCH_CHECK_VALUE(index > 0 && index < kNumLibraries,
                    cat("gpumem: foreign_alloc is for other libraries (cupy=1, numba=2, rmm=3), not ",
                        index, "; torch allocates through its allocator"));
  if (size == 0) return nullptr;
  Pool& pool = main_pool(device);
  std::optional<OutOfMemoryError> oom;
  const std::uintptr_t p = translate([&]() -> std::uintptr_t {
    MaybeRelaxed relaxed(routing_count_.load(std::memory_order_acquire) > 0);
    DeviceSwitch on(device);
    try {
      // Releases the cache and retries, runs the OOM callbacks (gc.collect) and retries, as for
      // torch's allocations, before it throws.
      return pool.allocate(size, reinterpret_cast<StreamId>(stream));
    } catch (const OutOfMemoryError& e) {
      oom.emplace(e);  // (translate would make it a plain RuntimeError)
      return 0;
    }
  });
  if (oom) {
    {
      std::lock_guard<std::mutex> lock(foreign_mutex_);
      foreign_usage_[device][index].ooms++;
    }
    std::size_t limit = 0;
    try {
      limit = pool.effective_cap();
    } catch (const std::exception&) {
      // The limit stays 0 (unknown): the error being raised matters more than its figures.
    }
    throw ForeignOutOfMemory(cat("gpumem: out of memory for ", library_name(library), " on CUDA device ",
                                 device, " after releasing the cache and running the out-of-memory "
                                 "callbacks. ", oom->what()),
                             oom->requested, oom->allocated, limit);
  }
  const std::size_t rounded = round_up(size, kAlignment);  // the block's size (pool.hpp)
  std::lock_guard<std::mutex> lock(foreign_mutex_);
  foreign_blocks_[p] = ForeignBlock{library, rounded, device, stream};
  LibraryUsage& usage = foreign_usage_[device][index];
  usage.current += static_cast<std::int64_t>(rounded);
  usage.allocations++;
  usage.peak = std::max(usage.peak, usage.current);
  return reinterpret_cast<void*>(p);
}

std::size_t GpumemAllocator::foreign_free(void* ptr, std::optional<cudaStream_t> stream) {
  if (!ptr) return 0;
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  ForeignBlock block;
  {
    std::lock_guard<std::mutex> lock(foreign_mutex_);
    auto it = foreign_blocks_.find(p);
    TORCH_CHECK_VALUE(it != foreign_blocks_.end(),
                      cat("gpumem: ", hex(ptr), " is not a live block gpumem handed to CuPy, Numba "
                          "or RMM (a double free, or memory from another allocator); nothing was freed"));
    block = it->second;
    foreign_blocks_.erase(it);
    LibraryUsage& usage = foreign_usage_[block.device][static_cast<int>(block.library)];
    usage.current -= static_cast<std::int64_t>(block.size);
    usage.allocations--;
  }
  Pool* pool = main_pool_if_created(block.device);
  bool freed = false;
  translate([&] {
    MaybeRelaxed relaxed(routing_count_.load(std::memory_order_acquire) > 0);
    if (pool && stream && *stream != block.stream) {
      // Used on another stream up to its free: the block waits for that stream's work too.
      pool->record_stream(p, reinterpret_cast<StreamId>(*stream));
    }
    freed = pool && pool->try_free(p);
  });
  TORCH_CHECK(freed, cat("gpumem: the foreign block ", hex(ptr), " was no longer live in the pool of "
                         "CUDA device ", block.device, " (freed through torch?); its count was dropped"));
  return block.size;
}

std::vector<LibraryUsage> GpumemAllocator::library_usage(int device) {
  check_device(device);
  std::vector<LibraryUsage> out(kNumLibraries);
  {
    std::lock_guard<std::mutex> lock(foreign_mutex_);
    for (int i = 1; i < kNumLibraries; ++i) out[i] = foreign_usage_[device][i];
  }
  const DeviceState& state = devices_[device];
  out[0].current = state.torch_bytes.load(std::memory_order_relaxed);
  out[0].peak = state.torch_peak.load(std::memory_order_relaxed);
  out[0].allocations = state.torch_blocks.load(std::memory_order_relaxed);
  return out;
}

void GpumemAllocator::reset_library_peaks(int device) {
  DeviceState& state = devices_[device];
  state.torch_peak.store(state.torch_bytes.load(std::memory_order_relaxed), std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(foreign_mutex_);
  for (LibraryUsage& usage : foreign_usage_[device]) usage.peak = usage.current;
}

std::pair<std::size_t, std::size_t> GpumemAllocator::memory_info(int device) {
  Pool& pool = main_pool(device);
  return translate([&] {
    DeviceSwitch on(device);
    const std::size_t total = pool.effective_cap();
    const std::size_t reserved = pool.reserved_bytes();
    const std::size_t allocated = pool.allocated_bytes();
    const std::size_t cached = reserved > allocated ? reserved - allocated : 0;
    std::size_t headroom = total > reserved ? total - reserved : 0;
    headroom = std::min(headroom, pool.upstream().device_free_bytes());
    return std::make_pair(headroom + cached, total);
  });
}

}  // namespace gpumem::torch_bridge
