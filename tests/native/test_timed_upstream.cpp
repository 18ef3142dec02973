// pool_tests: TimedUpstream (core/timed_upstream.hpp), the wrapper that times a pool's upstream calls
// by kind. Every call the pool makes reaches the device through it and is counted under exactly one
// kind, also when the device refuses or throws; the pool works through it as on the bare device.
#include <cstdint>
#include <memory>
#include <vector>

#include "core/timed_upstream.hpp"
#include "pool_test_util.hpp"

using namespace gpumem;
using namespace gpumem_test;

namespace {

// Counts the calls that reach the device, by the kind TimedUpstream should file them under, before
// forwarding (so a call that throws is counted too).
class CountingUpstream final : public ForwardingUpstream {
 public:
  explicit CountingUpstream(std::shared_ptr<SimulatedDevice> sim) : ForwardingUpstream(std::move(sim)) {}
  std::uint64_t seen[UpstreamTime::kNumKinds] = {};

  std::uintptr_t allocate_segment(std::size_t b) override {
    ++seen[UpstreamTime::kSegment];
    return inner().allocate_segment(b);
  }
  void free_segment(std::uintptr_t a, std::size_t b) override {
    ++seen[UpstreamTime::kSegment];
    inner().free_segment(a, b);
  }
  bool map(std::uintptr_t a, std::size_t b, std::size_t page) override {
    ++seen[UpstreamTime::kMap];
    return inner().map(a, b, page);
  }
  bool map_from(std::uintptr_t a, std::uintptr_t s, std::size_t b, std::size_t page) override {
    ++seen[UpstreamTime::kMap];
    return inner().map_from(a, s, b, page);
  }
  void unmap(std::uintptr_t a, std::size_t b, std::size_t page) override {
    ++seen[UpstreamTime::kUnmap];
    inner().unmap(a, b, page);
  }
  EventId record_event(StreamId s) override {
    ++seen[UpstreamTime::kEvent];
    return inner().record_event(s);
  }
  bool event_completed(EventId e) override {
    ++seen[UpstreamTime::kEvent];
    return inner().event_completed(e);
  }
  void destroy_event(EventId e) override {
    ++seen[UpstreamTime::kEvent];
    inner().destroy_event(e);
  }
  void wait_event(EventId e) override {
    ++seen[UpstreamTime::kWait];
    inner().wait_event(e);
  }
  void synchronize(StreamId s) override {
    ++seen[UpstreamTime::kWait];
    inner().synchronize(s);
  }
};

struct TimedSetup {
  std::shared_ptr<SimulatedDevice> dev;
  std::shared_ptr<CountingUpstream> counting;
  std::shared_ptr<UpstreamTime> time = std::make_shared<UpstreamTime>();
  std::unique_ptr<Pool> pool;
  TimedSetup(UpstreamKind kind, std::size_t cap, ReleasePolicy release) {
    dev = std::make_shared<SimulatedDevice>(kind, 256 * MiB);
    counting = std::make_shared<CountingUpstream>(dev);
    PoolOptions o;
    o.cap_bytes = cap;
    o.release = release;
    o.large_page_bytes = 2 * MiB;
    pool = std::make_unique<Pool>(std::make_shared<TimedUpstream>(counting, time), o);
  }
  void check_counts() const {
    for (int k = 0; k < UpstreamTime::kNumKinds; ++k) {
      const auto kind = static_cast<UpstreamTime::Kind>(k);
      CHECK_EQ(time->calls(kind), counting->seen[k]);
      // (unmap's time also holds the release of units kept for a map that did not take them: no call)
      if (time->calls(kind) == 0 && kind != UpstreamTime::kUnmap) CHECK_EQ(time->ns(kind), std::uint64_t(0));
    }
  }
};

}  // namespace

TEST(timed_upstream_files_every_call_under_one_kind_with_its_time) {
  for (UpstreamKind kind : kKinds) {
    for (ReleasePolicy release : {ReleasePolicy::kLazy, ReleasePolicy::kHighWater}) {
      TimedSetup s(kind, 40 * MiB, release);  // a cap: the pool releases and waits as well
      s.dev->set_auto_complete(false);
      std::vector<std::uintptr_t> live;
      std::uint64_t x = 99, ooms = 0;
      for (int i = 0; i < 3000; ++i) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        if (live.size() < 6 && (x >> 40) % 3) {
          const std::size_t bytes = 1 + (x >> 33) % (9 * MiB);
          try {
            live.push_back(s.pool->allocate(bytes, StreamId((x >> 20) % 3)));
          } catch (const OutOfMemoryError&) {
            ++ooms;
          }
        } else if (!live.empty()) {
          const std::size_t at = (x >> 25) % live.size();
          s.pool->free(live[at]);
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(at));
        }
        if (i % 7 == 0) s.dev->complete_one(StreamId((x >> 13) % 3));
      }
      const UpstreamTime& t = *s.time;
      if (kind == UpstreamKind::kPages) {
        CHECK(t.calls(UpstreamTime::kMap) > 0);
        CHECK(t.calls(UpstreamTime::kUnmap) > 0);  // the cap made the pool give pages back
        CHECK_EQ(t.calls(UpstreamTime::kSegment), std::uint64_t(0));
      } else {
        CHECK(t.calls(UpstreamTime::kSegment) > 0);
        CHECK_EQ(t.calls(UpstreamTime::kMap), std::uint64_t(0));
      }
      // Frees the device has not reached yet: pages drain behind events (segments wait for their
      // stream instead), and the cap waits for some of them.
      if (kind == UpstreamKind::kPages) CHECK(t.calls(UpstreamTime::kEvent) > 0);
      CHECK(t.calls(UpstreamTime::kWait) > 0);
      CHECK_EQ(t.calls(UpstreamTime::kWait), std::uint64_t(s.pool->stats().num_sync_all_streams));
      for (int k = 0; k < UpstreamTime::kNumKinds; ++k) {
        const auto each = static_cast<UpstreamTime::Kind>(k);
        if (t.calls(each) > 0) CHECK(t.ns(each) > 0);
      }
      s.check_counts();
      for (std::uintptr_t p : live) s.pool->free(p);
      s.dev->complete_all();
      s.pool->trim();
      s.check_counts();
      CHECK_EQ(s.dev->used_bytes(), std::size_t(0));
      s.pool->validate();
    }
  }
}

TEST(timed_upstream_counts_refused_and_failed_calls) {
  TimedSetup s(UpstreamKind::kPages, 0, ReleasePolicy::kLazy);
  std::uintptr_t a = s.pool->allocate(8 * MiB, 0);
  s.dev->set_fault_plan(FaultPlan{1, 0.0, true, 1});  // every memory call fails, unmaps throw
  const std::uint64_t maps = s.time->calls(UpstreamTime::kMap);
  bool oom = false;
  try {
    s.pool->allocate(8 * MiB, 0);  // the device refuses the map
  } catch (const OutOfMemoryError&) {
    oom = true;
  }
  CHECK(oom);
  CHECK(s.time->calls(UpstreamTime::kMap) > maps);
  s.pool->free(a);
  bool threw = false;
  try {
    s.pool->trim();  // the unmap throws: counted all the same
  } catch (const UpstreamError&) {
    threw = true;
  }
  s.check_counts();
  s.dev->set_fault_plan(FaultPlan{});
  s.pool->trim();
  s.check_counts();
  CHECK(threw || s.time->calls(UpstreamTime::kUnmap) > 0);
  s.pool->validate();
  s.time->reset();
  CHECK_EQ(s.time->calls(UpstreamTime::kMap), std::uint64_t(0));
  CHECK_EQ(s.time->ns(UpstreamTime::kUnmap), std::uint64_t(0));
}
