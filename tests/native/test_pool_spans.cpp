// The pool's span events (SegmentEvent::kSpanAdded / kSpanRemoved), which the torch bridge hands to
// torch's allocator trace trackers as SEGMENT_ALLOC / SEGMENT_FREE (NCCL registers those ranges):
// after every operation the spans added and not removed are exactly snapshot()'s regions; a span
// removed is one added earlier with the same bytes; no span is added over a live one; and no memory
// is unmapped or freed while a span still covers it. Random operations with driver failures
// (unmap refused included), on both kinds of upstream.
#include <cstdint>
#include <map>
#include <vector>

#include "pool_test_util.hpp"

namespace gpumem_test {
namespace {

struct SpanChecker {
  std::map<std::uintptr_t, std::size_t> spans;  // address -> bytes, as the observer was told
  std::size_t added = 0, removed = 0, errors = 0;

  bool overlaps(std::uintptr_t address, std::size_t bytes) const {
    auto it = spans.upper_bound(address);
    if (it != spans.end() && it->first < address + bytes) return true;
    if (it == spans.begin()) return false;
    --it;
    return it->first + it->second > address;
  }

  void on_event(SegmentEvent e, std::uintptr_t address, std::size_t bytes) {
    switch (e) {
      case SegmentEvent::kSpanAdded:
        ++added;
        errors += overlaps(address, bytes);
        spans[address] = bytes;
        break;
      case SegmentEvent::kSpanRemoved: {
        ++removed;
        auto it = spans.find(address);
        errors += it == spans.end() || it->second != bytes;
        if (it != spans.end()) spans.erase(it);
        break;
      }
      case SegmentEvent::kUnmap:
      case SegmentEvent::kSegmentFree:
        errors += overlaps(address, bytes);  // its span must have been removed first
        break;
      default:
        break;
    }
  }

  void check_against(const Pool& pool) const {
    std::map<std::uintptr_t, std::size_t> shown;
    for (const RegionInfo& r : pool.snapshot()) shown[r.address] = r.size;
    CHECK(shown == spans);
  }
};

}  // namespace

TEST(spans_are_the_snapshot_and_go_before_their_memory) {
  for (UpstreamKind kind : kKinds) {
    for (bool faults : {false, true}) {
      SpanChecker checker;  // outlives the pool, whose destructor still reports to it
      Setup s(kind, 128 * MiB, 0, ReleasePolicy::kHighWater);
      s.pool->set_segment_observer([&](SegmentEvent e, std::uintptr_t address, std::size_t bytes, StreamId) {
        checker.on_event(e, address, bytes);
      });
      if (faults) {
        FaultPlan plan;
        plan.fail_probability = 0.08;
        plan.fail_unmap = true;
        plan.seed = 11;
        s.dev->set_fault_plan(plan);
      }
      std::vector<std::uintptr_t> live;
      std::uint64_t x = 3;
      for (int i = 0; i < 800; ++i) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const int op = int((x >> 59) % 8);
        try {
          if (op < 3 || live.empty()) {
            live.push_back(s.pool->allocate(1 + (x >> 33) % (10 << 20), StreamId((x >> 30) % 2)));
          } else if (op < 6) {
            std::size_t k = (x >> 40) % live.size();
            s.pool->free(live[k]);
            live.erase(live.begin() + k);
          } else if (op == 6) {
            s.pool->trim();
          } else {
            s.pool->set_cap(std::size_t((x >> 33) % (96 * MiB)) + 8 * MiB);
          }
        } catch (const OutOfMemoryError&) {
        } catch (const UpstreamError&) {
        } catch (const InvalidArgument&) {  // a cap below the live bytes
        }
        checker.check_against(*s.pool);
        CHECK_EQ(checker.errors, std::size_t(0));
      }
      CHECK(checker.added > 20 && checker.removed > 10);
      if (faults) CHECK(s.dev->faults_injected() > 0);
      s.dev->set_fault_plan(FaultPlan{});
      for (std::uintptr_t p : live) s.pool->free(p);
      s.pool->set_cap(0);
      check_empty_after_trim(*s.pool, *s.dev);
      checker.check_against(*s.pool);
      CHECK(checker.spans.empty());
      // The pool's destructor removes the spans of what it still holds before giving it back.
      live = {s.pool->allocate(5 << 20, 0), s.pool->allocate(3 << 10, 1)};
      CHECK(!checker.spans.empty());
      s.pool.reset();
      CHECK(checker.spans.empty());
      CHECK_EQ(checker.errors, std::size_t(0));
    }
  }
}

}  // namespace gpumem_test
