// Helpers of the pool's native tests (test_pool*.cpp): a pool on a simulated device, the leak and
// consistency checks every test ends with, an upstream that fails on demand, and a fingerprint of
// everything the pool shows (to prove a refused call changed nothing).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "core/errors.hpp"
#include "core/format.hpp"
#include "core/pool.hpp"
#include "core/simulated_device.hpp"
#include "harness.hpp"

namespace gpumem_test {

using namespace gpumem;

inline std::int64_t cur(const StatArray& a) { return a[kAggregate].current; }

// The leak and consistency check every test ends with.
inline void check_clean(const Pool& pool, const SimulatedDevice& dev) {
  pool.validate();
  CHECK_EQ(static_cast<std::int64_t>(dev.used_bytes()), cur(pool.stats().reserved_bytes));
  CHECK_EQ(dev.kept_units(), std::uint64_t(0));  // units kept for a map never outlive it
}

// Everything freed and trimmed: the device must hold nothing.
inline void check_empty_after_trim(Pool& pool, const SimulatedDevice& dev) {
  pool.trim();
  check_clean(pool, dev);
  CHECK_EQ(cur(pool.stats().reserved_bytes), 0);
  CHECK_EQ(dev.used_bytes(), std::size_t(0));
}

struct Setup {
  std::shared_ptr<SimulatedDevice> dev;
  std::unique_ptr<Pool> pool;
  Setup(UpstreamKind kind, std::size_t capacity = 256 * MiB, std::size_t cap = 0,
        ReleasePolicy release = ReleasePolicy::kHighWater, std::size_t page = 2 * MiB) {
    dev = std::make_shared<SimulatedDevice>(kind, capacity, page);
    PoolOptions o;
    o.cap_bytes = cap;
    o.release = release;
    o.large_page_bytes = page;  // one page size throughout: the figures below count pages
    o.stitch = false;  // the figures are those of the mechanism each test names (stitching: test_stitch.py)
    pool = std::make_unique<Pool>(dev, o);
  }
};

inline const UpstreamKind kKinds[] = {UpstreamKind::kPages, UpstreamKind::kSegments};

// An upstream that forwards to a simulated device and fails map / allocate_segment calls on demand.
class FlakyDevice : public ForwardingUpstream {
 public:
  explicit FlakyDevice(std::shared_ptr<SimulatedDevice> sim) : ForwardingUpstream(std::move(sim)) {}
  std::function<bool(std::size_t call)> fail_map;  // called with the 1-based index of the map call
  std::size_t map_calls = 0, failures = 0;

  std::string name() const override { return "flaky"; }
  std::uintptr_t allocate_segment(std::size_t b) override {
    if (fail_map && fail_map(++map_calls)) return ++failures, 0;
    return inner().allocate_segment(b);
  }
  bool map(std::uintptr_t a, std::size_t b, std::size_t page) override {
    if (fail_map && fail_map(++map_calls)) return ++failures, false;
    return inner().map(a, b, page);
  }
};

// A pool whose next block needs two runs of pages mapped, on a FlakyDevice (the page layout is drawn
// in 2 MiB pages): pages p0..p3 of the large arena, with p1 (b) and p3 (d) live and p0 and p2
// unmapped. Freeing b leaves a free block p0..p2 with only p1 mapped.
struct TwoGapsPool {
  static PoolOptions two_mib_pages() {
    PoolOptions o;
    o.large_page_bytes = 2 << 20;
    return o;
  }
  std::shared_ptr<SimulatedDevice> sim = std::make_shared<SimulatedDevice>(UpstreamKind::kPages, 256 * MiB);
  std::shared_ptr<FlakyDevice> flaky = std::make_shared<FlakyDevice>(sim);
  Pool pool{flaky, two_mib_pages()};
  std::uintptr_t b = 0, d = 0;
  TwoGapsPool() {
    const std::uintptr_t a = pool.allocate(2 << 20, 0);
    b = pool.allocate(2 << 20, 0);
    const std::uintptr_t c = pool.allocate(2 << 20, 0);
    d = pool.allocate(2 << 20, 0);
    pool.free(a);
    pool.free(c);
    pool.trim();
  }
};

// The pool's observable state: statistics (current, peak, totals) and every block of every region.
inline std::string fingerprint(const Pool& pool, bool with_counters = true) {
  DeviceStats st = pool.stats();
  std::ostringstream o;
  for (const StatArray* a : {&st.allocation, &st.segment, &st.active, &st.inactive_split, &st.allocated_bytes,
                             &st.reserved_bytes, &st.active_bytes, &st.inactive_split_bytes, &st.requested_bytes})
    for (const Stat& x : *a) o << x.current << ',' << x.peak << ',' << x.allocated << ',' << x.freed << ';';
  if (with_counters)
    o << st.num_alloc_retries << ',' << st.num_ooms << ',' << st.num_device_alloc << ',' << st.num_device_free;
  for (const RegionInfo& r : pool.snapshot()) {
    o << '|' << r.address << ',' << r.size << ',' << r.reserved << ',' << r.stream;
    for (const BlockInfo& b : r.blocks) o << ' ' << b.address << ',' << b.size << ',' << b.requested << ',' << b.state;
  }
  return o.str();
}

// The blocks of the region holding `address`, as (address, size, state) triples.
inline std::vector<BlockInfo> blocks_around(const Pool& pool, std::uintptr_t address) {
  for (const RegionInfo& r : pool.snapshot())
    if (address >= r.address && address < r.address + r.size) return r.blocks;
  return {};
}

}  // namespace gpumem_test
