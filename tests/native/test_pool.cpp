// pool_tests: the pool core against the simulated device, deterministic cases with exact figures.
// Every test ends with validate() and the leak check (device used bytes == pool reserved bytes).
//   pool_tests [substring]     runs the tests whose name contains the substring
// Closing line: "N passed, M failed"; the exit status is nonzero when anything failed.
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/errors.hpp"
#include "core/format.hpp"
#include "core/pool.hpp"
#include "core/simulated_device.hpp"
#include "core/trace.hpp"

using namespace gpumem;

// ---- a tiny harness ------------------------------------------------------------------------------

namespace {

struct TestFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::vector<std::pair<const char*, void (*)()>>& registry() {
  static std::vector<std::pair<const char*, void (*)()>> r;
  return r;
}
struct Registrar {
  Registrar(const char* name, void (*fn)()) { registry().emplace_back(name, fn); }
};

#define TEST(name)                                 \
  static void name();                              \
  static Registrar registrar_##name(#name, name);  \
  static void name()

#define CHECK(cond)                                                                        \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::ostringstream _m;                                                               \
      _m << __FILE__ << ":" << __LINE__ << ": CHECK(" #cond ") failed";                    \
      throw TestFailure(_m.str());                                                         \
    }                                                                                      \
  } while (0)

#define CHECK_EQ(a, b)                                                                     \
  do {                                                                                     \
    auto _a = (a);                                                                         \
    auto _b = (b);                                                                         \
    if (!(_a == _b)) {                                                                     \
      std::ostringstream _m;                                                               \
      _m << __FILE__ << ":" << __LINE__ << ": CHECK_EQ(" #a ", " #b ") failed: " << _a     \
         << " != " << _b;                                                                  \
      throw TestFailure(_m.str());                                                         \
    }                                                                                      \
  } while (0)

#define CHECK_THROWS(expr, Type)                                                                 \
  do {                                                                                           \
    bool _threw = false;                                                                         \
    try {                                                                                        \
      (void)(expr);                                                                              \
    } catch (const Type&) {                                                                      \
      _threw = true;                                                                             \
    }                                                                                            \
    if (!_threw)                                                                                 \
      throw TestFailure(std::string(__FILE__) + ":" + std::to_string(__LINE__) + ": " #expr      \
                        " did not throw " #Type);                                                \
  } while (0)

std::int64_t cur(const StatArray& a) { return a[kAggregate].current; }

// The leak and consistency check every test ends with.
void check_clean(const Pool& pool, const SimulatedDevice& dev) {
  pool.validate();
  CHECK_EQ(static_cast<std::int64_t>(dev.used_bytes()), cur(pool.stats().reserved_bytes));
}

// Everything freed and trimmed: the device must hold nothing.
void check_empty_after_trim(Pool& pool, const SimulatedDevice& dev) {
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
    pool = std::make_unique<Pool>(dev, o);
  }
};

const UpstreamKind kKinds[] = {UpstreamKind::kPages, UpstreamKind::kSegments};

// An upstream that forwards to a simulated device and fails map / allocate_segment calls on demand.
class FlakyDevice : public Upstream {
 public:
  explicit FlakyDevice(std::shared_ptr<SimulatedDevice> sim) : sim_(std::move(sim)) {}
  std::function<bool(std::size_t call)> fail_map;  // called with the 1-based index of the map call
  std::size_t map_calls = 0, failures = 0;

  UpstreamKind kind() const override { return sim_->kind(); }
  std::string name() const override { return "flaky"; }
  std::size_t page_size() const override { return sim_->page_size(); }
  std::size_t device_total_bytes() const override { return sim_->device_total_bytes(); }
  std::size_t device_free_bytes() const override { return sim_->device_free_bytes(); }
  std::uintptr_t allocate_segment(std::size_t b) override {
    if (fail_map && fail_map(++map_calls)) return ++failures, 0;
    return sim_->allocate_segment(b);
  }
  void free_segment(std::uintptr_t a, std::size_t b) override { sim_->free_segment(a, b); }
  std::uintptr_t reserve_address_range(std::size_t b) override { return sim_->reserve_address_range(b); }
  void release_address_range(std::uintptr_t a, std::size_t b) override { sim_->release_address_range(a, b); }
  bool map(std::uintptr_t a, std::size_t b, std::size_t page) override {
    if (fail_map && fail_map(++map_calls)) return ++failures, false;
    return sim_->map(a, b, page);
  }
  void unmap(std::uintptr_t a, std::size_t b, std::size_t page) override { sim_->unmap(a, b, page); }
  EventId record_event(StreamId s) override { return sim_->record_event(s); }
  bool event_completed(EventId e) override { return sim_->event_completed(e); }
  void destroy_event(EventId e) override { sim_->destroy_event(e); }
  void synchronize(StreamId s) override { sim_->synchronize(s); }

 private:
  std::shared_ptr<SimulatedDevice> sim_;
};

}  // namespace

// ---- basics --------------------------------------------------------------------------------------

TEST(allocate_free_alignment_and_stats) {
  for (UpstreamKind kind : kKinds) {
    Setup s(kind);
    std::vector<std::uintptr_t> ptrs;
    std::int64_t rounded = 0, requested = 0;
    for (std::size_t bytes : {1, 511, 512, 513, 4096, 1 << 20, (1 << 20) + 1, 3 << 20, 25 << 20}) {
      std::uintptr_t p = s.pool->allocate(bytes, 0);
      CHECK(p != 0);
      CHECK_EQ(p % kAlignment, 0u);
      CHECK_EQ(s.pool->allocation_size(p), round_up(bytes, 512));
      ptrs.push_back(p);
      rounded += round_up(bytes, 512);
      requested += bytes;
    }
    DeviceStats st = s.pool->stats();
    CHECK_EQ(cur(st.allocation), std::int64_t(ptrs.size()));
    CHECK_EQ(cur(st.allocated_bytes), rounded);
    CHECK_EQ(cur(st.requested_bytes), requested);
    CHECK_EQ(cur(st.active_bytes), rounded);
    CHECK(cur(st.reserved_bytes) >= rounded);
    check_clean(*s.pool, *s.dev);
    for (std::uintptr_t p : ptrs) s.pool->free(p);
    st = s.pool->stats();
    CHECK_EQ(cur(st.allocation), 0);
    CHECK_EQ(cur(st.allocated_bytes), 0);
    CHECK_EQ(cur(st.requested_bytes), 0);
    check_empty_after_trim(*s.pool, *s.dev);
  }
}

TEST(zero_bytes_is_null_and_free_null_is_noop) {
  Setup s(UpstreamKind::kPages);
  CHECK_EQ(s.pool->allocate(0, 0), std::uintptr_t(0));
  s.pool->free(0);
  CHECK_EQ(cur(s.pool->stats().allocation), 0);
  CHECK_EQ(s.dev->memory_calls(), std::uint64_t(0));
  check_clean(*s.pool, *s.dev);
}

TEST(absurd_size_is_invalid_argument_and_changes_nothing) {
  Setup s(UpstreamKind::kPages);
  std::uintptr_t keep = s.pool->allocate(1000, 0);
  DeviceStats before = s.pool->stats();
  CHECK_THROWS(s.pool->allocate(kMaxRequest + 1, 0), InvalidArgument);
  CHECK_THROWS(s.pool->allocate(SIZE_MAX, 0), InvalidArgument);
  DeviceStats after = s.pool->stats();
  CHECK_EQ(after.num_ooms, before.num_ooms);
  CHECK_EQ(cur(after.reserved_bytes), cur(before.reserved_bytes));
  // Exactly the limit is a valid request that no device can satisfy: an OOM, not a bad argument.
  CHECK_THROWS(s.pool->allocate(kMaxRequest, 0), OutOfMemoryError);
  s.pool->free(keep);
  check_empty_after_trim(*s.pool, *s.dev);
}

TEST(bad_free_and_record_stream_leave_state_unchanged) {
  for (UpstreamKind kind : kKinds) {
    Setup s(kind);
    std::uintptr_t a = s.pool->allocate(4096, 0);
    std::uintptr_t b = s.pool->allocate(8192, 0);
    s.pool->free(a);
    auto fp = [&] {
      DeviceStats st = s.pool->stats();
      std::ostringstream o;
      o << cur(st.allocation) << ' ' << cur(st.allocated_bytes) << ' ' << cur(st.reserved_bytes) << ' '
        << cur(st.active_bytes) << ' ' << st.allocation[kAggregate].freed;
      for (auto& r : s.pool->snapshot())
        for (auto& blk : r.blocks) o << ' ' << blk.address << ':' << blk.size << ':' << blk.state;
      return o.str();
    };
    const std::string before = fp();
    CHECK_THROWS(s.pool->free(a), InvalidArgument);            // double free
    CHECK_THROWS(s.pool->free(b + 512), InvalidArgument);      // interior pointer
    CHECK_THROWS(s.pool->free(0x1234000), InvalidArgument);    // foreign
    CHECK_THROWS(s.pool->free(b + 1), InvalidArgument);        // misaligned
    CHECK_THROWS(s.pool->record_stream(a, 5), InvalidArgument);
    try {
      s.pool->free(a);
    } catch (const InvalidArgument& e) {
      CHECK(std::string(e.what()).find("nothing was changed") != std::string::npos);
    }
    CHECK_EQ(fp(), before);
    s.pool->free(b);
    check_empty_after_trim(*s.pool, *s.dev);
  }
}

TEST(streams_do_not_share_free_blocks) {
  Setup s(UpstreamKind::kPages);
  std::uintptr_t a = s.pool->allocate(4096, 1);
  s.pool->free(a);
  std::uintptr_t b = s.pool->allocate(4096, 2);
  CHECK(b != a);
  std::uintptr_t c = s.pool->allocate(4096, 1);
  CHECK_EQ(c, a);  // reused at once on its own stream
  s.pool->free(b);
  s.pool->free(c);
  check_empty_after_trim(*s.pool, *s.dev);
}

// Above 1 MiB free blocks sit in size class lists (1/64 of a size per class): the four blocks below
// share one class, and the pick must still be the smallest that fits, the lowest address among equals,
// whatever order they were freed in.
TEST(large_best_fit_is_smallest_then_last_freed) {
  for (UpstreamKind kind : kKinds) {
    Setup s(kind, 1024 * MiB, 0, ReleasePolicy::kLazy);
    const std::size_t sizes[] = {4 * MiB + 16 * KiB, 4 * MiB, 4 * MiB + 8 * KiB, 4 * MiB + 8 * KiB};
    std::uintptr_t x[4], sep[4];
    for (int i = 0; i < 4; ++i) {
      x[i] = s.pool->allocate(sizes[i], 0);
      sep[i] = s.pool->allocate(2 * MiB, 0);  // keeps the freed blocks apart
    }
    for (int i : {2, 3, 1, 0}) s.pool->free(x[i]);  // smaller x[1] after x[3]: not just last-freed-first
    s.pool->validate();
    CHECK_EQ(s.pool->allocate(4 * MiB + 4 * KiB, 0), x[3]);  // the two 4 MiB + 8 KiB: last freed
    CHECK_EQ(s.pool->allocate(4 * MiB + 4 * KiB, 0), x[2]);
    CHECK_EQ(s.pool->allocate(4 * MiB, 0), x[1]);            // exact fit
    CHECK_EQ(s.pool->allocate(4 * MiB + 1, 0), x[0]);        // the only one left that fits
    s.pool->validate();
    for (int i = 0; i < 4; ++i) {
      s.pool->free(x[i]);
      s.pool->free(sep[i]);
    }
    check_empty_after_trim(*s.pool, *s.dev);
  }
}

TEST(record_stream_delays_reuse_until_the_event_completes) {
  for (UpstreamKind kind : kKinds) {
    Setup s(kind);
    s.dev->set_auto_complete(false);
    std::uintptr_t a = s.pool->allocate(1 << 20, 1);
    s.pool->record_stream(a, 2);
    s.pool->record_stream(a, 1);  // its own stream: no event needed
    s.pool->free(a);
    DeviceStats st = s.pool->stats();
    CHECK_EQ(cur(st.allocated_bytes), 0);
    CHECK_EQ(cur(st.active_bytes), std::int64_t(1 << 20));  // pending: still active
    CHECK_THROWS(s.pool->free(a), InvalidArgument);          // a pending block is not live
    std::uintptr_t b = s.pool->allocate(1 << 20, 1);
    CHECK(b != a);
    s.pool->process_events();
    CHECK_EQ(cur(s.pool->stats().active_bytes), std::int64_t(1 << 20) * 2);
    check_clean(*s.pool, *s.dev);
    s.dev->complete(2);
    s.pool->process_events();
    CHECK_EQ(cur(s.pool->stats().active_bytes), std::int64_t(1 << 20));
    std::uintptr_t c = s.pool->allocate(1 << 20, 1);
    CHECK_EQ(c, a);
    s.pool->free(b);
    s.pool->free(c);
    s.dev->complete_all();
    check_empty_after_trim(*s.pool, *s.dev);
  }
}

TEST(high_water_reuses_instead_of_growing) {
  Setup s(UpstreamKind::kPages);
  std::uintptr_t a = s.pool->allocate(8 << 20, 0);
  std::int64_t reserved = cur(s.pool->stats().reserved_bytes);
  s.pool->free(a);
  for (int i = 0; i < 20; ++i) {
    std::uintptr_t p = s.pool->allocate((8 << 20) - 512 * i, 0);
    CHECK_EQ(cur(s.pool->stats().reserved_bytes), reserved);
    s.pool->free(p);
  }
  check_empty_after_trim(*s.pool, *s.dev);
}

// ---- out of memory -------------------------------------------------------------------------------

TEST(oom_carries_the_figures) {
  for (UpstreamKind kind : kKinds) {
    Setup s(kind, 256 * MiB, 64 * MiB);
    std::uintptr_t a = s.pool->allocate(40 << 20, 0);
    bool caught = false;
    try {
      s.pool->allocate(30 << 20, 0);
    } catch (const OutOfMemoryError& e) {
      caught = true;
      DeviceStats st = s.pool->stats();
      CHECK_EQ(e.requested, std::size_t(30 << 20));
      CHECK_EQ(e.allocated, std::size_t(40 << 20));
      CHECK_EQ(e.reserved, std::size_t(cur(st.reserved_bytes)));
      CHECK_EQ(e.cap, std::size_t(64 * MiB));
      CHECK_EQ(e.largest_free, s.pool->largest_free_block());
      CHECK_EQ(st.num_ooms, 1);
      CHECK_EQ(st.num_alloc_retries, 1);
      std::string m = e.what();
      CHECK(m.find("out of memory") != std::string::npos);
      CHECK(m.find("30.00 MiB") != std::string::npos);
      CHECK(m.find("40.00 MiB held by live tensors") != std::string::npos);
      CHECK(m.find(format_bytes(e.reserved) + " reserved") != std::string::npos);
      CHECK(m.find("cap 64.00 MiB") != std::string::npos);
    }
    CHECK(caught);
    check_clean(*s.pool, *s.dev);
    // The pool still works after the OOM.
    std::uintptr_t b = s.pool->allocate(20 << 20, 0);
    s.pool->free(a);
    s.pool->free(b);
    check_empty_after_trim(*s.pool, *s.dev);
  }
}

TEST(oom_releases_cache_of_other_streams_then_succeeds) {
  for (UpstreamKind kind : kKinds) {
    Setup s(kind, 64 * MiB, 0, ReleasePolicy::kLazy);
    std::uintptr_t a = s.pool->allocate(40 << 20, 1);
    s.pool->free(a);  // cached on stream 1
    std::uintptr_t b = s.pool->allocate(40 << 20, 2);  // must release stream 1's cache to fit
    CHECK_EQ(s.pool->stats().num_ooms, 0);
    CHECK(cur(s.pool->stats().reserved_bytes) <= std::int64_t(64 * MiB));
    s.pool->free(b);
    check_empty_after_trim(*s.pool, *s.dev);
  }
}

TEST(oom_callback_frees_and_the_retry_succeeds) {
  for (UpstreamKind kind : kKinds) {
    Setup s(kind, 64 * MiB);
    std::uintptr_t garbage = s.pool->allocate(40 << 20, 0);
    int calls = 0;
    int id = s.pool->add_oom_callback([&] {
      ++calls;
      if (garbage) s.pool->free(garbage);  // re-enters the pool, as gc.collect() would
      garbage = 0;
    });
    std::uintptr_t b = s.pool->allocate(40 << 20, 0);
    CHECK_EQ(calls, 1);
    CHECK(b != 0);
    s.pool->remove_oom_callback(id);
    CHECK_THROWS(s.pool->allocate(40 << 20, 0), OutOfMemoryError);
    CHECK_EQ(calls, 1);
    s.pool->free(b);
    check_empty_after_trim(*s.pool, *s.dev);
  }
}

TEST(set_cap_below_live_bytes_is_refused) {
  Setup s(UpstreamKind::kPages);
  std::uintptr_t a = s.pool->allocate(10 << 20, 0);
  CHECK_THROWS(s.pool->set_cap(4 << 20), InvalidArgument);
  CHECK_EQ(s.pool->cap(), std::size_t(0));
  CHECK_THROWS(s.pool->set_cap(4096), InvalidArgument);  // below one page
  s.pool->set_cap(16 << 20);
  CHECK_THROWS(s.pool->allocate(10 << 20, 0), OutOfMemoryError);
  s.pool->set_cap(0);
  std::uintptr_t b = s.pool->allocate(10 << 20, 0);
  s.pool->free(a);
  s.pool->free(b);
  // Lowering the cap gives the cache back.
  s.pool->set_cap(2 * MiB);
  CHECK(cur(s.pool->stats().reserved_bytes) <= std::int64_t(2 * MiB));
  check_empty_after_trim(*s.pool, *s.dev);
}

// ---- fault injection -----------------------------------------------------------------------------

TEST(faults_every_nth_call_leak_nothing) {
  for (UpstreamKind kind : kKinds) {
    for (std::uint64_t every : {1, 2, 3, 5, 7}) {
      Setup s(kind, 128 * MiB);
      s.dev->set_fault_plan(FaultPlan{every, 0.0, false, 1});
      std::vector<std::uintptr_t> live;
      std::uint64_t ooms = 0;
      for (int i = 0; i < 200; ++i) {
        std::size_t bytes = std::size_t(1 + (i * 7919) % 97) * ((i % 3) ? 64 * KiB : 512 * KiB);
        try {
          live.push_back(s.pool->allocate(bytes, StreamId(i % 3)));
        } catch (const OutOfMemoryError& e) {
          ++ooms;
          CHECK_EQ(e.requested, bytes);
          CHECK_EQ(e.reserved, std::size_t(cur(s.pool->stats().reserved_bytes)));
        }
        check_clean(*s.pool, *s.dev);
        if (live.size() > 8) {
          s.pool->free(live[i % live.size()]);
          live.erase(live.begin() + i % live.size());
        }
      }
      CHECK(s.dev->faults_injected() > 0);
      if (every == 1) CHECK_EQ(ooms, std::uint64_t(200));  // every memory call fails
      // Faults off: the pool works and gives everything back.
      s.dev->set_fault_plan(FaultPlan{});
      live.push_back(s.pool->allocate(3 << 20, 0));
      for (std::uintptr_t p : live) s.pool->free(p);
      check_empty_after_trim(*s.pool, *s.dev);
    }
  }
}

TEST(random_faults_leak_nothing) {
  for (UpstreamKind kind : kKinds) {
    Setup s(kind, 96 * MiB, 0, ReleasePolicy::kHighWater, 64 * KiB);
    s.dev->set_fault_plan(FaultPlan{0, 0.3, false, 42});
    std::vector<std::uintptr_t> live;
    std::uint64_t x = 12345;
    for (int i = 0; i < 2000; ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      std::size_t bytes = 1 + (x >> 33) % (6 << 20);
      try {
        live.push_back(s.pool->allocate(bytes, StreamId((x >> 20) % 4)));
      } catch (const OutOfMemoryError&) {
      }
      if (live.size() > 12 || (x >> 60) == 0) {
        std::size_t k = (x >> 40) % live.size();
        s.pool->free(live[k]);
        live.erase(live.begin() + k);
      }
      if (i % 50 == 0) check_clean(*s.pool, *s.dev);
    }
    CHECK(s.dev->faults_injected() > 20);
    s.dev->set_fault_plan(FaultPlan{});
    for (std::uintptr_t p : live) s.pool->free(p);
    check_empty_after_trim(*s.pool, *s.dev);
  }
}

// A block that needs two runs of pages mapped: the first map succeeds, the second fails.
static void setup_two_gaps(Pool& pool, std::uintptr_t* keep1, std::uintptr_t* keep2) {
  // Pages p0..p3 of the large arena: keep p1 and p3 live, unmap p0 and p2; then free p1.
  std::uintptr_t a = pool.allocate(2 << 20, 0), b = pool.allocate(2 << 20, 0);
  std::uintptr_t c = pool.allocate(2 << 20, 0), d = pool.allocate(2 << 20, 0);
  pool.free(a);
  pool.free(c);
  pool.trim();
  *keep1 = b;
  *keep2 = d;
}

TEST(fault_in_the_middle_of_growing_a_block_retries_transparently) {
  auto sim = std::make_shared<SimulatedDevice>(UpstreamKind::kPages, 256 * MiB);
  auto flaky = std::make_shared<FlakyDevice>(sim);
  PoolOptions two_mib_pages;
  two_mib_pages.large_page_bytes = 2 << 20;  // the page layout below is drawn in 2 MiB pages
  Pool pool(flaky, two_mib_pages);
  std::uintptr_t b, d;
  setup_two_gaps(pool, &b, &d);
  pool.free(b);  // free block p0..p2 with only p1 mapped
  CHECK_EQ(cur(pool.stats().reserved_bytes), std::int64_t(4 << 20));
  const std::size_t base = flaky->map_calls;
  flaky->fail_map = [base](std::size_t call) { return call == base + 2; };  // the second run fails
  std::uintptr_t big = pool.allocate(6 << 20, 0);  // retried after releasing the cache
  CHECK_EQ(flaky->failures, std::size_t(1));
  CHECK(big != 0);
  check_clean(pool, *sim);
  pool.free(big);
  pool.free(d);
  check_empty_after_trim(pool, *sim);
}

TEST(fault_in_the_middle_of_growing_a_block_then_oom_leaks_nothing) {
  auto sim = std::make_shared<SimulatedDevice>(UpstreamKind::kPages, 256 * MiB);
  auto flaky = std::make_shared<FlakyDevice>(sim);
  PoolOptions two_mib_pages;
  two_mib_pages.large_page_bytes = 2 << 20;  // the page layout below is drawn in 2 MiB pages
  Pool pool(flaky, two_mib_pages);
  std::uintptr_t b, d;
  setup_two_gaps(pool, &b, &d);
  pool.free(b);
  const std::size_t base = flaky->map_calls;
  flaky->fail_map = [base](std::size_t call) { return call >= base + 2; };  // first run only
  bool caught = false;
  try {
    pool.allocate(6 << 20, 0);
  } catch (const OutOfMemoryError& e) {
    caught = true;
    DeviceStats st = pool.stats();
    CHECK_EQ(e.requested, std::size_t(6 << 20));
    CHECK_EQ(e.reserved, std::size_t(cur(st.reserved_bytes)));
    CHECK_EQ(e.allocated, std::size_t(2 << 20));  // d
  }
  CHECK(caught);
  CHECK(flaky->failures >= 1);
  check_clean(pool, *sim);  // the page mapped before the failure is accounted or was released
  flaky->fail_map = nullptr;
  std::uintptr_t big = pool.allocate(6 << 20, 0);
  pool.free(big);
  pool.free(d);
  check_empty_after_trim(pool, *sim);
}

TEST(fail_unmap_in_trim_keeps_pages_accounted) {
  for (UpstreamKind kind : kKinds) {
    Setup s(kind);
    std::uintptr_t a = s.pool->allocate(30 << 20, 0);
    s.pool->free(a);
    std::int64_t reserved = cur(s.pool->stats().reserved_bytes);
    s.dev->set_fault_plan(FaultPlan{0, 0.0, true, 1});
    CHECK_THROWS(s.pool->trim(), UpstreamError);
    CHECK(s.dev->faults_injected() >= 1);
    CHECK_EQ(cur(s.pool->stats().reserved_bytes), reserved);
    check_clean(*s.pool, *s.dev);
    s.dev->set_fault_plan(FaultPlan{});
    check_empty_after_trim(*s.pool, *s.dev);
  }
}

// Found by the fuzzer (corpus/regression-unmap-fault-during-allocate): an unmap failure while an
// allocation releases cache to make room must leave the block it had taken back in the free set.
TEST(fail_unmap_during_allocate_leaves_pool_consistent) {
  for (UpstreamKind kind : kKinds) {
    Setup s(kind, 64 * MiB, 0, ReleasePolicy::kLazy);
    std::uintptr_t a = s.pool->allocate(40 << 20, 1);
    s.pool->free(a);  // 40 MiB cached on stream 1
    std::uintptr_t keep = s.pool->allocate(4096, 2);
    s.dev->set_fault_plan(FaultPlan{0, 0.0, true, 1});
    bool upstream_error = false;
    try {
      s.pool->allocate(40 << 20, 2);  // needs stream 1's cache back, whose unmap / free fails
    } catch (const UpstreamError&) {
      upstream_error = true;
    } catch (const OutOfMemoryError&) {
    }
    CHECK(upstream_error || s.pool->stats().num_ooms == 1);
    check_clean(*s.pool, *s.dev);
    s.dev->set_fault_plan(FaultPlan{});
    std::uintptr_t b = s.pool->allocate(40 << 20, 2);
    check_clean(*s.pool, *s.dev);
    s.pool->free(b);
    s.pool->free(keep);
    check_empty_after_trim(*s.pool, *s.dev);
  }
}

TEST(destroying_the_pool_returns_everything) {
  for (UpstreamKind kind : kKinds) {
    auto dev = std::make_shared<SimulatedDevice>(kind, 256 * MiB);
    {
      Pool pool(dev);
      pool.allocate(3 << 20, 0);
      pool.allocate(4096, 1);
      std::uintptr_t p = pool.allocate(5 << 20, 2);
      pool.record_stream(p, 3);
      dev->set_auto_complete(false);
      pool.free(p);  // pending at destruction
    }
    CHECK_EQ(dev->used_bytes(), std::size_t(0));
  }
}

// ---- traces --------------------------------------------------------------------------------------

#ifndef GPUMEM_SOURCE_DIR
#define GPUMEM_SOURCE_DIR "."
#endif

TEST(replay_recorded_traces_consistently) {
#if GPUMEM_WITH_ZLIB
  for (const char* name : {"gpt_varlen", "resnet50"}) {
    std::string path = std::string(GPUMEM_SOURCE_DIR) + "/python/gpumem/traces/" + name + ".trace.gz";
    if (std::FILE* f = std::fopen(path.c_str(), "rb")) std::fclose(f);
    else continue;
    Trace trace = load_trace(path);
    for (UpstreamKind kind : kKinds) {
      auto dev = std::make_shared<SimulatedDevice>(kind, 80 * GiB);
      Pool pool(dev);
      ReplayResult r = replay(trace, pool);
      CHECK_EQ(r.ooms, std::uint64_t(0));
      std::printf("  replayed %s on %s: %llu allocations\n", name, dev->name().c_str(), (unsigned long long)r.allocations);
      CHECK(r.allocations > 0);
      check_clean(pool, *dev);
      CHECK(std::uint64_t(pool.stats().reserved_bytes[kAggregate].peak) == r.peak_reserved);
    }
  }
#endif
}

// ---- main ----------------------------------------------------------------------------------------

int main(int argc, char** argv) {
  const char* filter = argc > 1 ? argv[1] : nullptr;
  int passed = 0, failed = 0;
  for (auto& [name, fn] : registry()) {
    if (filter && std::string(name).find(filter) == std::string::npos) continue;
    try {
      fn();
      ++passed;
      std::printf("PASS %s\n", name);
    } catch (const std::exception& e) {
      ++failed;
      std::printf("FAIL %s: %s\n", name, e.what());
    }
    std::fflush(stdout);
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
