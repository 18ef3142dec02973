// A memory budget that several pools share. PyTorch's set_per_process_memory_fraction bounds the
// process's memory on a device, whichever pool holds it (the main pool, CUDA graph pools, MemPools),
// so the pools of one device report their reserved bytes here and check the limit here before they
// reserve more. A pool made without one gets a budget of its own (then the limit is the pool's).
//
// Checked, not reserved: two pools that reserve at the same moment can pass the check together and
// overshoot the limit by one unit (page or segment) each. The limit is a policy bound, not the
// device's capacity (which the upstream enforces), so that race costs nothing worse.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace gpumem {

class Budget {
 public:
  static constexpr std::size_t kNoLimit = SIZE_MAX;

  void set_limit(std::size_t bytes) { limit_.store(bytes, std::memory_order_relaxed); }
  std::size_t limit() const { return limit_.load(std::memory_order_relaxed); }
  // Reserved bytes of every pool that shares this budget.
  std::size_t reserved() const { return reserved_.load(std::memory_order_relaxed); }
  // Whether `bytes` more reserved bytes stay within the limit.
  bool fits(std::size_t bytes) const {
    const std::size_t limit = this->limit();
    return limit == kNoLimit || (bytes <= limit && reserved() <= limit - bytes);
  }
  // How far reserved bytes would exceed the limit with `bytes` more (0 when they fit).
  std::size_t excess(std::size_t bytes) const {
    const std::size_t limit = this->limit(), want = reserved() + bytes;
    return limit == kNoLimit || want <= limit ? 0 : want - limit;
  }
  void add(std::int64_t delta) {
    if (delta >= 0) reserved_.fetch_add(static_cast<std::size_t>(delta), std::memory_order_relaxed);
    else reserved_.fetch_sub(static_cast<std::size_t>(-delta), std::memory_order_relaxed);
  }

 private:
  std::atomic<std::size_t> limit_{kNoLimit};
  std::atomic<std::size_t> reserved_{0};
};

}  // namespace gpumem
