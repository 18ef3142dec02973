// Statistics with the shape of PyTorch's c10::CachingDeviceAllocator::DeviceStats, so the torch bridge
// can hand them to torch.cuda.memory_stats() unchanged.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

namespace gpumem {

struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;  // total ever added
  std::int64_t freed = 0;      // total ever removed

  void increase(std::int64_t n) {
    current += n;
    allocated += n;
    peak = std::max(peak, current);
  }
  void decrease(std::int64_t n) {
    current -= n;
    freed += n;
  }
  void reset_peak() { peak = current; }
  void reset_accumulated() { allocated = 0; freed = 0; }
};

enum StatType : int { kAggregate = 0, kSmallPool = 1, kLargePool = 2, kNumStatTypes = 3 };
using StatArray = std::array<Stat, kNumStatTypes>;

struct DeviceStats {
  StatArray allocation;            // COUNT: allocations handed to callers and not yet freed
  StatArray segment;               // COUNT: regions holding reserved memory
  StatArray active;                // COUNT: blocks allocated or waiting on other streams' events
  StatArray inactive_split;        // COUNT: free blocks that share a region with other blocks
  StatArray allocated_bytes;       // SUM: bytes of allocated blocks (rounded to 512)
  StatArray reserved_bytes;        // SUM: bytes taken from the upstream (mapped pages, segments)
  StatArray active_bytes;          // SUM: bytes of active blocks
  StatArray inactive_split_bytes;  // SUM: bytes of inactive split blocks that are backed by memory
  StatArray requested_bytes;       // SUM: bytes the callers asked for
  std::int64_t num_alloc_retries = 0;  // COUNT: allocations that released the cache and retried
  std::int64_t num_ooms = 0;           // COUNT: allocations that failed with out-of-memory
  std::int64_t num_sync_all_streams = 0;  // COUNT: stream synchronisations before releasing memory
  std::int64_t num_device_alloc = 0;   // COUNT: upstream calls that took memory (map / segment)
  std::int64_t num_device_free = 0;    // COUNT: upstream calls that returned memory
  Stat oversize_allocations;           // unused by gpumem (no max_split_size); kept for torch's shape
  Stat oversize_segments;
  std::int64_t max_split_size = 0;

  template <typename F>
  void for_each_array(F&& f) {
    for (StatArray* a : {&allocation, &segment, &active, &inactive_split, &allocated_bytes,
                         &reserved_bytes, &active_bytes, &inactive_split_bytes, &requested_bytes})
      f(*a);
  }
  void reset_peak() {
    for_each_array([](StatArray& a) { for (Stat& s : a) s.reset_peak(); });
    oversize_allocations.reset_peak();
    oversize_segments.reset_peak();
  }
  void reset_accumulated() {
    for_each_array([](StatArray& a) { for (Stat& s : a) s.reset_accumulated(); });
    num_alloc_retries = num_ooms = num_sync_all_streams = num_device_alloc = num_device_free = 0;
  }
};

}  // namespace gpumem
