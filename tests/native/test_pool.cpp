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

// ---- allocate_at, try_free, live_block, the limit, the segment observer -------------------------

// The pool's observable state: statistics (current, peak, totals) and every block of every region.
static std::string fingerprint(const Pool& pool, bool with_counters = true) {
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
static std::vector<BlockInfo> blocks_around(const Pool& pool, std::uintptr_t address) {
  for (const RegionInfo& r : pool.snapshot())
    if (address >= r.address && address < r.address + r.size) return r.blocks;
  return {};
}

static std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(allocate_at_in_the_middle_at_the_start_and_at_the_end_of_a_free_block) {
  for (UpstreamKind kind : kKinds) {
    Setup s(kind, 256 * MiB, 0, ReleasePolicy::kLazy);
    std::uintptr_t a = s.pool->allocate(8 << 20, 3), hole = s.pool->allocate(8 << 20, 3);
    std::uintptr_t c = s.pool->allocate(4 << 20, 3);
    s.pool->free(hole);  // an 8 MiB free block between a and c
    const DeviceStats before = s.pool->stats();
    const std::string layout_before = fingerprint(*s.pool, false);

    // In the middle: three pieces.
    const std::size_t bytes = (1 << 20) + 1000, rounded = round_up(bytes, 512);
    CHECK_EQ(s.pool->allocate_at(hole + (2 << 20), bytes), hole + (2 << 20));
    check_clean(*s.pool, *s.dev);
    CHECK_EQ(s.pool->allocation_size(hole + (2 << 20)), rounded);
    BlockInfo info{};
    CHECK(s.pool->live_block(hole + (2 << 20), &info));
    CHECK_EQ(info.address, hole + (2 << 20));
    CHECK_EQ(info.size, rounded);
    CHECK_EQ(info.requested, bytes);
    CHECK(info.state == BlockInfo::kAllocated);
    CHECK(!s.pool->live_block(hole, &info));
    CHECK(!s.pool->live_block(hole + (2 << 20) + 512, nullptr));
    DeviceStats st = s.pool->stats();
    CHECK_EQ(cur(st.allocation), cur(before.allocation) + 1);
    CHECK_EQ(cur(st.active), cur(before.active) + 1);
    CHECK_EQ(cur(st.allocated_bytes), cur(before.allocated_bytes) + std::int64_t(rounded));
    CHECK_EQ(cur(st.active_bytes), cur(before.active_bytes) + std::int64_t(rounded));
    CHECK_EQ(cur(st.requested_bytes), cur(before.requested_bytes) + std::int64_t(bytes));
    CHECK_EQ(st.allocation[kLargePool].current, before.allocation[kLargePool].current + 1);
    CHECK_EQ(cur(st.reserved_bytes), cur(before.reserved_bytes));  // on memory already held
    CHECK_EQ(s.pool->allocated_bytes(), std::size_t(cur(st.allocated_bytes)));
    CHECK_EQ(s.pool->reserved_bytes(), std::size_t(cur(st.reserved_bytes)));
    std::vector<BlockInfo> blocks = blocks_around(*s.pool, hole);
    std::size_t i = 0;
    while (blocks[i].address != hole) ++i;
    CHECK_EQ(blocks[i].size, std::size_t(2 << 20));
    CHECK(blocks[i].state == BlockInfo::kFree);
    CHECK_EQ(blocks[i + 1].address, hole + (2 << 20));
    CHECK(blocks[i + 1].state == BlockInfo::kAllocated);
    CHECK_EQ(blocks[i + 2].address, hole + (2 << 20) + rounded);
    CHECK_EQ(blocks[i + 2].size, (6u << 20) - rounded);
    CHECK(blocks[i + 2].state == BlockInfo::kFree);
    CHECK_EQ(blocks[i + 3].address, c);
    // Its stream is the arena's: freed, it is reused on stream 3 at once.
    for (const RegionInfo& r : s.pool->snapshot())
      if (hole >= r.address && hole < r.address + r.size) CHECK_EQ(r.stream, StreamId(3));
    s.pool->free(hole + (2 << 20));
    CHECK_EQ(fingerprint(*s.pool, false).substr(fingerprint(*s.pool, false).find('|')),
             layout_before.substr(layout_before.find('|')));  // merged back as it was

    // At the start and at the end of the free block: two pieces each, then the whole block.
    CHECK_EQ(s.pool->allocate_at(hole, 512), hole);
    CHECK_EQ(s.pool->allocate_at(hole + (8 << 20) - (1 << 20), 1 << 20), hole + (7 << 20));
    check_clean(*s.pool, *s.dev);
    blocks = blocks_around(*s.pool, hole);
    i = 0;
    while (blocks[i].address != hole) ++i;
    CHECK(blocks[i - 1].address == a && blocks[i].size == 512 && blocks[i].state == BlockInfo::kAllocated);
    CHECK(blocks[i + 1].size == (7u << 20) - 512 && blocks[i + 1].state == BlockInfo::kFree);
    CHECK(blocks[i + 2].address == hole + (7 << 20) && blocks[i + 2].state == BlockInfo::kAllocated);
    CHECK_EQ(blocks[i + 3].address, c);
    CHECK_EQ(s.pool->allocate_at(hole + 512, (7 << 20) - 512), hole + 512);  // exactly the free block
    check_clean(*s.pool, *s.dev);
    // The same address on another stream is simply reused by allocate on stream 3 after a free.
    s.pool->free(hole + 512);
    CHECK_EQ(s.pool->allocate((7 << 20) - 512, 3), hole + 512);
    for (std::uintptr_t p : {a, c, hole, hole + 512, hole + (7 << 20)}) s.pool->free(p);
    check_empty_after_trim(*s.pool, *s.dev);
  }
}

TEST(allocate_at_refusals_change_nothing) {
  for (UpstreamKind kind : kKinds) {
    Setup s(kind, 256 * MiB, 0, ReleasePolicy::kLazy);
    s.dev->set_auto_complete(false);
    std::uintptr_t a = s.pool->allocate(4 << 20, 0), p = s.pool->allocate(4 << 20, 0);
    std::uintptr_t hole = s.pool->allocate(4 << 20, 0), c = s.pool->allocate(4 << 20, 0);
    s.pool->record_stream(p, 9);
    s.pool->free(p);     // pending on stream 9
    s.pool->free(hole);  // free
    RegionInfo region{};
    for (const RegionInfo& r : s.pool->snapshot())
      if (a >= r.address && a < r.address + r.size) region = r;
    const std::size_t region_size =
        kind == UpstreamKind::kPages ? round_up(4 * 256 * MiB, 2 * MiB) : region.size;
    const std::string before = fingerprint(*s.pool);
    struct Case {
      std::uintptr_t address;
      std::size_t bytes;
      const char* says;
    } cases[] = {
        {a, 512, "overlaps the live block"},
        {a + 512, 512, "overlaps the live block"},
        {hole + (2 << 20), 4 << 20, "overlaps the live block"},  // runs from the hole into c
        {hole - 512, 1024, "pending"},                          // from p's tail into the hole
        {p, 512, "pending"},
        {0x1234000, 512, "outside every region"},
        {0, 512, "outside every region"},
        {region.address + region_size - 512, 1024, "runs past the end of the region"},
        {hole + 1, 512, "not a multiple of 512"},
        {hole, 0, "must be positive"},
        {hole, kMaxRequest + 1, "more than any device has"},
    };
    for (const Case& k : cases) {
      std::string m = message_of([&] { s.pool->allocate_at(k.address, k.bytes); });
      if (m.find(k.says) == std::string::npos || m.find("nothing was changed") == std::string::npos)
        throw TestFailure("allocate_at(" + std::to_string(k.address) + ", " + std::to_string(k.bytes) +
                          "): expected '" + k.says + "', got '" + m + "'");
      CHECK_THROWS(s.pool->allocate_at(k.address, k.bytes), InvalidArgument);
      CHECK_EQ(fingerprint(*s.pool), before);
      s.pool->validate();
    }
    // Once stream 9's work is done the pending block counts as free, without process_events().
    s.dev->complete(9);
    CHECK_EQ(s.pool->allocate_at(p, 2 << 20), p);
    check_clean(*s.pool, *s.dev);
    for (std::uintptr_t x : {a, p, c}) s.pool->free(x);
    check_empty_after_trim(*s.pool, *s.dev);
  }
}

TEST(allocate_at_maps_pages_under_the_cap_and_never_releases_its_own) {
  Setup s(UpstreamKind::kPages, 256 * MiB, 16 * MiB, ReleasePolicy::kLazy);
  std::uintptr_t base = s.pool->allocate(4 << 20, 0);
  s.pool->free(base);
  s.pool->trim();  // the region stays, no page is mapped
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), 0);
  std::int64_t device_allocs = s.pool->stats().num_device_alloc;
  CHECK_EQ(s.pool->allocate_at(base + (6 << 20), 3 << 20), base + (6 << 20));  // pages 3 and 4
  check_clean(*s.pool, *s.dev);
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), std::int64_t(4 << 20));
  CHECK_EQ(s.pool->stats().num_device_alloc, device_allocs + 1);  // one run of two pages

  // Seven more pages would pass the cap: OOM, and with nothing cached to release nothing changes.
  const std::string before = fingerprint(*s.pool, false);
  const DeviceStats st0 = s.pool->stats();
  bool caught = false;
  try {
    s.pool->allocate_at(base + (20 << 20), 14 << 20);
  } catch (const OutOfMemoryError& e) {
    caught = true;
    CHECK_EQ(e.requested, std::size_t(14 << 20));
    CHECK_EQ(e.reserved, std::size_t(4 << 20));
    CHECK_EQ(e.allocated, std::size_t(3 << 20));
    CHECK_EQ(e.cap, std::size_t(16 * MiB));
    CHECK(std::string(e.what()).find("at 0x") != std::string::npos);
  }
  CHECK(caught);
  CHECK_EQ(fingerprint(*s.pool, false), before);
  CHECK_EQ(s.pool->stats().num_ooms, st0.num_ooms + 1);
  CHECK_EQ(s.pool->stats().num_alloc_retries, st0.num_alloc_retries + 1);
  check_clean(*s.pool, *s.dev);

  // A cached page elsewhere is released to make room.
  std::uintptr_t y = s.pool->allocate_at(base + (40 << 20), 2 << 20);
  s.pool->free(y);  // 2 MiB cached
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), std::int64_t(6 << 20));
  CHECK_EQ(s.pool->allocate_at(base + (20 << 20), 12 << 20), base + (20 << 20));
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), std::int64_t(16 << 20));
  check_clean(*s.pool, *s.dev);
  s.pool->free(base + (20 << 20));
  s.pool->free(base + (6 << 20));
  s.pool->trim();

  // Cached pages inside the range are kept; those before it go to make room for the rest.
  s.pool->set_cap(8 * MiB);
  std::uintptr_t z = s.pool->allocate_at(base, 8 << 20);  // pages 0-3
  s.pool->free(z);                                         // cached
  CHECK_EQ(s.pool->allocate_at(base + (4 << 20), 6 << 20), base + (4 << 20));  // pages 2-5
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), std::int64_t(8 << 20));
  check_clean(*s.pool, *s.dev);
  s.pool->free(base + (4 << 20));
  check_empty_after_trim(*s.pool, *s.dev);
}

TEST(allocate_at_device_refusal_is_an_oom_that_leaks_nothing) {
  auto sim = std::make_shared<SimulatedDevice>(UpstreamKind::kPages, 256 * MiB);
  auto flaky = std::make_shared<FlakyDevice>(sim);
  PoolOptions two_mib_pages;
  two_mib_pages.large_page_bytes = 2 << 20;
  Pool pool(flaky, two_mib_pages);
  std::uintptr_t b, d;
  setup_two_gaps(pool, &b, &d);  // p1 (b) and p3 (d) live, p0 and p2 unmapped
  pool.free(b);
  const std::string before = fingerprint(pool, false);
  flaky->fail_map = [](std::size_t) { return true; };
  CHECK_THROWS(pool.allocate_at(b - (2 << 20), 6 << 20), OutOfMemoryError);
  check_clean(pool, *sim);
  // The cache was released before the retry, but not p1: it lies inside the range being carved.
  CHECK_EQ(fingerprint(pool, false), before);
  CHECK_EQ(cur(pool.stats().reserved_bytes), std::int64_t(4 << 20));
  // The second map run fails only: the first run's page stays cached, accounted.
  const std::size_t base_calls = flaky->map_calls;
  flaky->fail_map = [base_calls](std::size_t call) { return call == base_calls + 2 || call == base_calls + 3; };
  CHECK_THROWS(pool.allocate_at(b - (2 << 20), 6 << 20), OutOfMemoryError);
  check_clean(pool, *sim);
  CHECK_EQ(cur(pool.stats().reserved_bytes), std::int64_t(6 << 20));  // p0 mapped before the refusal
  CHECK_EQ(cur(pool.stats().allocation), 1);
  flaky->fail_map = nullptr;
  CHECK_EQ(pool.allocate_at(b - (2 << 20), 6 << 20), b - (2 << 20));
  check_clean(pool, *sim);
  pool.free(b - (2 << 20));
  pool.free(d);
  check_empty_after_trim(pool, *sim);
}

TEST(allocate_at_round_trip_restores_every_statistic_and_block) {
  for (UpstreamKind kind : kKinds) {
    for (ReleasePolicy release : {ReleasePolicy::kLazy, ReleasePolicy::kHighWater}) {
      Setup s(kind, 1024 * MiB, 0, release);
      std::vector<std::pair<std::uintptr_t, std::size_t>> blocks;
      std::uint64_t x = 99;
      for (int i = 0; i < 60; ++i) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        std::size_t bytes = 1 + (x >> 33) % ((x >> 20) % 3 ? (256 << 10) : (12 << 20));
        blocks.emplace_back(s.pool->allocate(bytes, StreamId((x >> 10) % 3)), bytes);
        if (i % 7 == 3) {  // some holes
          s.pool->free(blocks.back().first);
          blocks.pop_back();
        }
      }
      const std::string before = fingerprint(*s.pool, false);
      const DeviceStats st = s.pool->stats();
      std::vector<std::uintptr_t> order;
      for (auto& [p, n] : blocks) order.push_back(p);
      for (std::size_t i = order.size(); i > 1; --i) {  // a shuffled order of frees
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        std::swap(order[i - 1], order[(x >> 33) % i]);
      }
      for (std::uintptr_t p : order) s.pool->free(p);
      CHECK_EQ(cur(s.pool->stats().allocation), 0);
      for (std::size_t i = blocks.size(); i-- > 0;)
        CHECK_EQ(s.pool->allocate_at(blocks[i].first, blocks[i].second), blocks[i].first);
      check_clean(*s.pool, *s.dev);
      const DeviceStats after = s.pool->stats();
      for (auto pair : {std::make_pair(&st.allocation, &after.allocation), {&st.active, &after.active},
                        {&st.segment, &after.segment}, {&st.allocated_bytes, &after.allocated_bytes},
                        {&st.active_bytes, &after.active_bytes}, {&st.reserved_bytes, &after.reserved_bytes},
                        {&st.requested_bytes, &after.requested_bytes}, {&st.inactive_split, &after.inactive_split},
                        {&st.inactive_split_bytes, &after.inactive_split_bytes}})
        for (int t = 0; t < kNumStatTypes; ++t) {
          CHECK_EQ((*pair.first)[t].current, (*pair.second)[t].current);
          CHECK_EQ((*pair.first)[t].peak, (*pair.second)[t].peak);
        }
      const std::string now = fingerprint(*s.pool, false);
      CHECK_EQ(now.substr(now.find('|')), before.substr(before.find('|')));  // the same blocks
      for (auto& [p, n] : blocks) CHECK_EQ(s.pool->allocation_size(p), round_up(n, 512));
      for (auto& [p, n] : blocks) s.pool->free(p);
      check_empty_after_trim(*s.pool, *s.dev);
    }
  }
}

TEST(try_free_returns_false_and_changes_nothing_for_pointers_not_live_here) {
  for (UpstreamKind kind : kKinds) {
    Setup s(kind);
    Setup other(kind);
    s.dev->set_auto_complete(false);
    std::uintptr_t a = s.pool->allocate(4096, 0), b = s.pool->allocate(8192, 0);
    std::uintptr_t p = s.pool->allocate(4096, 0), foreign = other.pool->allocate(4096, 0);
    s.pool->free(a);
    s.pool->record_stream(p, 4);
    s.pool->free(p);  // pending
    const std::string before = fingerprint(*s.pool);
    for (std::uintptr_t bad : {a, p, b + 512, b + 1, std::uintptr_t(0x1234000), foreign, std::uintptr_t(0)}) {
      CHECK(!s.pool->try_free(bad));
      CHECK_EQ(fingerprint(*s.pool), before);
    }
    CHECK(s.pool->try_free(b));
    CHECK(!s.pool->try_free(b));  // double
    CHECK_EQ(cur(s.pool->stats().allocation), 0);
    s.pool->validate();
    CHECK(other.pool->try_free(foreign));
    s.dev->complete_all();
    s.pool->process_events();
    check_empty_after_trim(*s.pool, *s.dev);
    check_empty_after_trim(*other.pool, *other.dev);
  }
}

TEST(limit_zero_refuses_every_allocation_and_any_limit_is_accepted) {
  for (UpstreamKind kind : kKinds) {
    Setup s(kind, 256 * MiB, 0, ReleasePolicy::kLazy);
    CHECK_EQ(s.pool->limit(), Pool::kNoLimit);
    CHECK_EQ(s.pool->effective_cap(), std::size_t(256 * MiB));
    std::uintptr_t a = s.pool->allocate(10 << 20, 0), b = s.pool->allocate(30 << 20, 0);
    std::uintptr_t small = s.pool->allocate(4096, 0);
    s.pool->free(b);  // cached
    s.pool->set_limit(0);  // below live: accepted
    CHECK_EQ(s.pool->limit(), std::size_t(0));
    CHECK_EQ(s.pool->effective_cap(), std::size_t(0));
    CHECK_EQ(s.pool->cap(), std::size_t(0));  // the cap is a separate setting
    std::int64_t retries = s.pool->stats().num_alloc_retries;
    std::string m = message_of([&] { s.pool->allocate(512, 0); });
    CHECK(m.find("out of memory") != std::string::npos && m.find("limit 0 B") != std::string::npos);
    CHECK_THROWS(s.pool->allocate(40 << 20, 0), OutOfMemoryError);
    CHECK_EQ(s.pool->stats().num_alloc_retries, retries + 2);
    check_clean(*s.pool, *s.dev);
    // The cache went back at once: what remains is under live blocks.
    CHECK(cur(s.pool->stats().reserved_bytes) < std::int64_t(12 << 20) + std::int64_t(kSmallSegment));
    s.pool->set_limit(4 << 20);  // below the 10 MiB live: accepted, new pages refused
    CHECK_THROWS(s.pool->allocate(8 << 20, 0), OutOfMemoryError);
    s.pool->set_cap(128 * MiB);
    CHECK_EQ(s.pool->effective_cap(), std::size_t(4 << 20));
    s.pool->set_limit(64 << 20);
    CHECK_EQ(s.pool->effective_cap(), std::size_t(64 << 20));
    std::uintptr_t c = s.pool->allocate(30 << 20, 0);
    CHECK_THROWS(s.pool->allocate(40 << 20, 0), OutOfMemoryError);  // 10 + 30 + 40 > 64
    s.pool->set_limit(Pool::kNoLimit);
    CHECK_EQ(s.pool->effective_cap(), std::size_t(128 * MiB));
    std::uintptr_t d = s.pool->allocate(40 << 20, 0);
    check_clean(*s.pool, *s.dev);
    for (std::uintptr_t x : {a, small, c, d}) s.pool->free(x);
    s.pool->set_limit(20 << 20);  // releases the cache down to the limit
    CHECK(cur(s.pool->stats().reserved_bytes) <= std::int64_t(20 << 20));
    check_empty_after_trim(*s.pool, *s.dev);
  }
}

TEST(segment_observer_sees_every_map_unmap_and_segment) {
  for (UpstreamKind kind : kKinds) {
    for (ReleasePolicy release : {ReleasePolicy::kLazy, ReleasePolicy::kHighWater}) {
      Setup s(kind, 128 * MiB, 0, release);
      std::int64_t net = 0;
      std::size_t events = 0, wrong_kind = 0, wrong_stream = 0;
      StreamId expected_stream = 0;
      s.pool->set_segment_observer([&](SegmentEvent e, std::uintptr_t address, std::size_t bytes, StreamId stream) {
        ++events;
        const bool paged = e == SegmentEvent::kMap || e == SegmentEvent::kUnmap;
        wrong_kind += paged != (kind == UpstreamKind::kPages);
        wrong_kind += address == 0 || bytes == 0;
        const bool grows = e == SegmentEvent::kMap || e == SegmentEvent::kSegmentAlloc;
        if (grows) wrong_stream += stream != expected_stream;
        net += grows ? std::int64_t(bytes) : -std::int64_t(bytes);
      });
      std::vector<std::uintptr_t> live;
      std::uint64_t x = 7;
      for (int i = 0; i < 600; ++i) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const int op = int((x >> 59) % 8);
        try {
          if (op < 4 || live.empty()) {
            expected_stream = StreamId((x >> 30) % 3);
            live.push_back(s.pool->allocate(1 + (x >> 33) % (12 << 20), expected_stream));
          } else if (op < 6) {
            std::size_t k = (x >> 40) % live.size();
            s.pool->free(live[k]);
            live.erase(live.begin() + k);
          } else if (op == 6) {
            s.pool->trim();
          } else {
            s.pool->set_limit((x >> 40) % 2 ? Pool::kNoLimit : std::size_t((x >> 33) % (128 * MiB)));
          }
        } catch (const OutOfMemoryError&) {
        }
        CHECK_EQ(net, std::int64_t(s.pool->reserved_bytes()));
        CHECK_EQ(s.pool->reserved_bytes(), std::size_t(cur(s.pool->stats().reserved_bytes)));
        CHECK_EQ(s.pool->allocated_bytes(), std::size_t(cur(s.pool->stats().allocated_bytes)));
      }
      CHECK(events > 20);
      CHECK_EQ(wrong_kind, std::size_t(0));
      CHECK_EQ(wrong_stream, std::size_t(0));
      for (std::uintptr_t p : live) s.pool->free(p);
      s.pool->set_limit(Pool::kNoLimit);
      s.pool->trim();
      CHECK_EQ(net, 0);
      // An observer that throws is ignored; an empty one removes it.
      s.pool->set_segment_observer([](SegmentEvent, std::uintptr_t, std::size_t, StreamId) {
        throw std::runtime_error("observer failure");
      });
      std::uintptr_t p = s.pool->allocate(3 << 20, 0);
      check_clean(*s.pool, *s.dev);
      s.pool->set_segment_observer(nullptr);
      s.pool->free(p);
      check_empty_after_trim(*s.pool, *s.dev);
    }
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
