// Statistics with the shape of PyTorch's c10::CachingDeviceAllocator::DeviceStats, so the torch bridge
// can hand them to torch.cuda.memory_stats() unchanged.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

namespace gpumem {

// The fields of one Stat, in torch's order and with torch's names ("allocated_bytes.all.current"):
// converters walk them with GPUMEM_STAT_FIELDS(F), F(name) for each.
#define GPUMEM_STAT_FIELDS(F) F(current) F(peak) F(allocated) F(freed)

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
  void merge(const Stat& o) {
#define GPUMEM_ADD_FIELD(f) f += o.f;
    GPUMEM_STAT_FIELDS(GPUMEM_ADD_FIELD)
#undef GPUMEM_ADD_FIELD
  }
};

enum StatType : int { kAggregate = 0, kSmallPool = 1, kLargePool = 2, kNumStatTypes = 3 };
using StatArray = std::array<Stat, kNumStatTypes>;

// The schema of DeviceStats, declared once. Each entry names a member, which is also its key in
// torch.cuda.memory_stats(); the kind says how it is merged and reset:
//   ARRAY   a StatArray (all / small_pool / large_pool), summed when pools are merged;
//   STAT    a single Stat, summed;
//   COUNTER an event count, summed, cleared by reset_accumulated();
//   SETTING a configuration figure, the largest kept when merged, never reset.
// The struct below, the Python bindings' dictionaries, the torch bridge's DeviceStats (same member
// names), merging and resets are all generated from this list.
#define GPUMEM_STATS_SCHEMA(ARRAY, STAT, COUNTER, SETTING)                                          \
  ARRAY(allocation)            /* COUNT: allocations handed to callers and not yet freed */          \
  ARRAY(segment)               /* COUNT: regions holding reserved memory */                          \
  ARRAY(active)                /* COUNT: blocks allocated or waiting on other streams' events */     \
  ARRAY(inactive_split)        /* COUNT: free blocks that share a region with other blocks */        \
  ARRAY(allocated_bytes)       /* SUM: bytes of allocated blocks (rounded to 512) */                 \
  ARRAY(reserved_bytes)        /* SUM: bytes taken from the upstream (mapped pages, segments) */     \
  ARRAY(active_bytes)          /* SUM: bytes of active blocks */                                     \
  ARRAY(inactive_split_bytes)  /* SUM: bytes of inactive split blocks that are backed by memory */   \
  ARRAY(requested_bytes)       /* SUM: bytes the callers asked for */                                \
  COUNTER(num_alloc_retries)   /* allocations that released the cache and retried */                 \
  COUNTER(num_ooms)            /* allocations that failed with out-of-memory */                      \
  COUNTER(num_sync_all_streams) /* waits for a stream before releasing memory  */                \
  COUNTER(num_device_alloc)    /* upstream calls that took memory (map / segment) */                 \
  COUNTER(num_device_free)     /* upstream calls that returned memory */                             \
  STAT(oversize_allocations)   /* unused by gpumem (no max_split_size); kept for torch's shape */    \
  STAT(oversize_segments)                                                                            \
  SETTING(max_split_size)

struct DeviceStats {
#define GPUMEM_DECLARE_ARRAY(name) StatArray name;
#define GPUMEM_DECLARE_STAT(name) Stat name;
#define GPUMEM_DECLARE_COUNT(name) std::int64_t name = 0;
  GPUMEM_STATS_SCHEMA(GPUMEM_DECLARE_ARRAY, GPUMEM_DECLARE_STAT, GPUMEM_DECLARE_COUNT, GPUMEM_DECLARE_COUNT)
#undef GPUMEM_DECLARE_ARRAY
#undef GPUMEM_DECLARE_STAT
#undef GPUMEM_DECLARE_COUNT

  void reset_peak() {
#define GPUMEM_RESET_ARRAY(name) for (Stat& s : name) s.reset_peak();
#define GPUMEM_RESET_STAT(name) name.reset_peak();
#define GPUMEM_IGNORE(name)
    GPUMEM_STATS_SCHEMA(GPUMEM_RESET_ARRAY, GPUMEM_RESET_STAT, GPUMEM_IGNORE, GPUMEM_IGNORE)
#undef GPUMEM_RESET_ARRAY
#undef GPUMEM_RESET_STAT
  }
  void reset_accumulated() {
#define GPUMEM_RESET_ARRAY(name) for (Stat& s : name) s.reset_accumulated();
#define GPUMEM_RESET_STAT(name) name.reset_accumulated();
#define GPUMEM_RESET_COUNTER(name) name = 0;
    GPUMEM_STATS_SCHEMA(GPUMEM_RESET_ARRAY, GPUMEM_RESET_STAT, GPUMEM_RESET_COUNTER, GPUMEM_IGNORE)
#undef GPUMEM_RESET_ARRAY
#undef GPUMEM_RESET_STAT
#undef GPUMEM_RESET_COUNTER
  }
  // Adds another pool's statistics (the bridge's device totals: main pool plus private pools). The
  // peak of a sum is bounded by the sum of the peaks, which is what the result holds.
  void merge(const DeviceStats& o) {
#define GPUMEM_MERGE_ARRAY(name) for (int t = 0; t < kNumStatTypes; ++t) name[t].merge(o.name[t]);
#define GPUMEM_MERGE_STAT(name) name.merge(o.name);
#define GPUMEM_MERGE_COUNTER(name) name += o.name;
#define GPUMEM_MERGE_SETTING(name) name = std::max(name, o.name);
    GPUMEM_STATS_SCHEMA(GPUMEM_MERGE_ARRAY, GPUMEM_MERGE_STAT, GPUMEM_MERGE_COUNTER, GPUMEM_MERGE_SETTING)
#undef GPUMEM_MERGE_ARRAY
#undef GPUMEM_MERGE_STAT
#undef GPUMEM_MERGE_COUNTER
#undef GPUMEM_MERGE_SETTING
#undef GPUMEM_IGNORE
  }
};

// The names of the StatArray entries, in StatType order, as torch.cuda.memory_stats() spells them.
inline const char* stat_type_name(int type) {
  static const char* const names[kNumStatTypes] = {"all", "small_pool", "large_pool"};
  return names[type];
}

}  // namespace gpumem
