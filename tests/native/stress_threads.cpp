// stress_threads: many threads hammer one pool at once (run it under ThreadSanitizer).
//   stress_threads [--threads N] [--ops N] [--seed S]
// Each thread allocates random sizes (1 B .. 8 MiB, log-uniform) on its own stream and on shared ones,
// frees its own blocks and blocks handed over by other threads, records streams, completes streams,
// processes events, trims, changes the cap and calls validate() at intervals, while the simulated
// device injects random faults. A global interval map proves no two live blocks ever overlap.
// At the end: validate(), device used bytes == pool reserved, and after free all + trim, zero.
// Both upstream kinds run in turn. Closing line: "stress_threads: OK ..." (exit 0) or a failure (exit 1).
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/errors.hpp"
#include "core/pool.hpp"
#include "core/simulated_device.hpp"

using namespace gpumem;

namespace {

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "stress_threads: FAILED: %s\n", what.c_str());
  std::fflush(stderr);
  std::exit(1);
}

// The simulated device is single-threaded: serialise every call into it, from the pool and the test.
class LockedDevice : public Upstream {
 public:
  explicit LockedDevice(std::shared_ptr<SimulatedDevice> sim) : sim_(std::move(sim)) {}
  UpstreamKind kind() const override { return sim_->kind(); }
  std::string name() const override { return "locked-" + sim_->name(); }
  std::size_t page_size() const override { return sim_->page_size(); }
  std::size_t device_total_bytes() const override { return sim_->device_total_bytes(); }
  std::size_t device_free_bytes() const override {
    std::lock_guard<std::mutex> l(m_);
    return sim_->device_free_bytes();
  }
  std::uintptr_t allocate_segment(std::size_t b) override {
    std::lock_guard<std::mutex> l(m_);
    return sim_->allocate_segment(b);
  }
  void free_segment(std::uintptr_t a, std::size_t b) override {
    std::lock_guard<std::mutex> l(m_);
    sim_->free_segment(a, b);
  }
  std::uintptr_t reserve_address_range(std::size_t b) override {
    std::lock_guard<std::mutex> l(m_);
    return sim_->reserve_address_range(b);
  }
  void release_address_range(std::uintptr_t a, std::size_t b) override {
    std::lock_guard<std::mutex> l(m_);
    sim_->release_address_range(a, b);
  }
  bool map(std::uintptr_t a, std::size_t b, std::size_t page) override {
    std::lock_guard<std::mutex> l(m_);
    return sim_->map(a, b, page);
  }
  void unmap(std::uintptr_t a, std::size_t b, std::size_t page) override {
    std::lock_guard<std::mutex> l(m_);
    sim_->unmap(a, b, page);
  }
  EventId record_event(StreamId s) override {
    std::lock_guard<std::mutex> l(m_);
    return sim_->record_event(s);
  }
  bool event_completed(EventId e) override {
    std::lock_guard<std::mutex> l(m_);
    return sim_->event_completed(e);
  }
  void destroy_event(EventId e) override {
    std::lock_guard<std::mutex> l(m_);
    sim_->destroy_event(e);
  }
  void wait_event(EventId e) override {
    std::lock_guard<std::mutex> l(m_);
    sim_->wait_event(e);
  }
  void synchronize(StreamId s) override {
    std::lock_guard<std::mutex> l(m_);
    sim_->synchronize(s);
  }
  void complete(StreamId s) {
    std::lock_guard<std::mutex> l(m_);
    sim_->complete(s);
  }
  void complete_all() {
    std::lock_guard<std::mutex> l(m_);
    sim_->complete_all();
  }
  void set_fault_plan(const FaultPlan& p) {
    std::lock_guard<std::mutex> l(m_);
    sim_->set_fault_plan(p);
  }
  std::size_t used_bytes() const {
    std::lock_guard<std::mutex> l(m_);
    return sim_->used_bytes();
  }
  std::uint64_t faults_injected() const {
    std::lock_guard<std::mutex> l(m_);
    return sim_->faults_injected();
  }

 private:
  mutable std::mutex m_;
  std::shared_ptr<SimulatedDevice> sim_;
};

// Live blocks of every thread: a new block must not overlap any of them.
class Intervals {
 public:
  void add(std::uintptr_t a, std::size_t n) {
    std::lock_guard<std::mutex> l(m_);
    auto it = live_.upper_bound(a);
    if (it != live_.end() && it->first < a + n) die("new block overlaps a live block above it");
    if (it != live_.begin() && std::prev(it)->first + std::prev(it)->second > a)
      die("new block overlaps a live block below it");
    live_[a] = n;
  }
  void remove(std::uintptr_t a) {
    std::lock_guard<std::mutex> l(m_);
    if (!live_.erase(a)) die("freeing a block the test does not know");
  }

 private:
  std::mutex m_;
  std::map<std::uintptr_t, std::size_t> live_;
};

struct Totals {
  std::atomic<std::uint64_t> allocations{0}, frees{0}, ooms{0}, validations{0}, handoffs{0}, callbacks{0};
};

constexpr StreamId kShared[3] = {0, 100, 200};

void run_kind(UpstreamKind kind, int threads, int ops, std::uint64_t seed, Totals& totals,
              std::uint64_t* faults) {
  auto sim = std::make_shared<SimulatedDevice>(kind, 768 * MiB, 2 * MiB);
  auto dev = std::make_shared<LockedDevice>(sim);
  sim->set_auto_complete(false);  // before any thread runs
  dev->set_fault_plan(FaultPlan{0, 0.02, false, seed});
  PoolOptions o;
  o.cap_bytes = 512 * MiB;
  o.large_page_bytes = 4 * sim->page_size();  // small and large arenas with different pages
  Pool pool(dev, o);
  pool.add_oom_callback([&] { totals.callbacks++; });
  Intervals intervals;
  std::mutex handoff_mutex;
  std::deque<std::uintptr_t> handoff;  // blocks one thread allocated and another frees

  auto worker = [&](int t) {
    std::mt19937_64 rng(seed * 1000003 + t);
    auto pick = [&](std::uint64_t n) { return rng() % n; };
    const StreamId home = 1 + t;
    std::vector<std::uintptr_t> mine;
    auto free_one = [&](std::uintptr_t p) {
      intervals.remove(p);
      pool.free(p);
      totals.frees++;
    };
    for (int i = 0; i < ops; ++i) {
      const std::uint64_t r = pick(1000);
      if (r < 450) {
        double lg = std::uniform_real_distribution<double>(0, 23)(rng);  // 1 B .. 8 MiB
        std::size_t bytes = 1 + static_cast<std::size_t>(std::exp2(lg));
        StreamId s = pick(4) ? home : kShared[pick(3)];
        std::uintptr_t p;
        try {
          p = pool.allocate(bytes, s);
        } catch (const OutOfMemoryError&) {
          totals.ooms++;
          // Make room: free half of what this thread holds.
          for (std::size_t k = 0; k < mine.size() / 2; ++k) free_one(mine[k]);
          mine.erase(mine.begin(), mine.begin() + mine.size() / 2);
          continue;
        }
        if (p % kAlignment) die("unaligned address");
        intervals.add(p, round_up(bytes, kAlignment));
        mine.push_back(p);
        totals.allocations++;
      } else if (r < 800) {
        if (mine.empty()) continue;
        std::size_t k = pick(mine.size());
        std::uintptr_t p = mine[k];
        mine[k] = mine.back();
        mine.pop_back();
        if (pick(8) == 0) pool.record_stream(p, kShared[pick(3)]);
        free_one(p);
      } else if (r < 850) {
        if (mine.empty()) continue;
        std::lock_guard<std::mutex> l(handoff_mutex);
        handoff.push_back(mine.back());
        mine.pop_back();
        totals.handoffs++;
      } else if (r < 900) {
        std::uintptr_t p = 0;
        {
          std::lock_guard<std::mutex> l(handoff_mutex);
          if (!handoff.empty()) {
            p = handoff.front();
            handoff.pop_front();
          }
        }
        if (p) free_one(p);
      } else if (r < 930) {
        if (!mine.empty()) pool.record_stream(mine[pick(mine.size())], pick(2) ? kShared[pick(3)] : 1 + pick(threads));
      } else if (r < 960) {
        dev->complete(pick(2) ? home : kShared[pick(3)]);
      } else if (r < 975) {
        pool.process_events();
      } else if (r < 980) {
        pool.trim();
      } else if (r < 990) {
        DeviceStats st = pool.stats();
        if (st.allocated_bytes[kAggregate].current > st.active_bytes[kAggregate].current)
          die("allocated bytes above active bytes");
        if (pool.largest_free_block() % kAlignment) die("largest free block not aligned");
      } else if (r < 995) {
        try {
          pool.validate();
        } catch (const InvariantViolation& e) {
          die(e.what());
        }
        totals.validations++;
      } else if (r < 997) {
        try {
          pool.set_cap(pick(2) ? 0 : 512 * MiB);
        } catch (const InvalidArgument&) {
        }
      } else {
        (void)pool.snapshot();
      }
    }
    for (std::uintptr_t p : mine) free_one(p);
  };

  std::vector<std::thread> pool_threads;
  for (int t = 0; t < threads; ++t) pool_threads.emplace_back(worker, t);
  for (auto& th : pool_threads) th.join();

  for (std::uintptr_t p : handoff) {
    intervals.remove(p);
    pool.free(p);
    totals.frees++;
  }
  dev->set_fault_plan(FaultPlan{});
  dev->complete_all();
  pool.process_events();
  try {
    pool.validate();
  } catch (const InvariantViolation& e) {
    die(e.what());
  }
  DeviceStats st = pool.stats();
  if (st.allocation[kAggregate].current != 0) die("allocations left after every thread freed its blocks");
  if (st.active_bytes[kAggregate].current != 0) die("active bytes left after process_events");
  if (std::int64_t(dev->used_bytes()) != st.reserved_bytes[kAggregate].current)
    die("device used bytes != pool reserved bytes (a leak)");
  pool.trim();
  if (pool.stats().reserved_bytes[kAggregate].current != 0 || dev->used_bytes() != 0)
    die("memory left on the device after free all + trim");
  *faults += dev->faults_injected();
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 8, ops = 20000;
  std::uint64_t seed = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--ops")) ops = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--seed")) seed = std::strtoull(argv[i + 1], nullptr, 10);
    else die(std::string("unknown argument ") + argv[i]);
  }
  Totals totals;
  std::uint64_t faults = 0;
  for (UpstreamKind kind : {UpstreamKind::kPages, UpstreamKind::kSegments})
    run_kind(kind, threads, ops, seed, totals, &faults);
  std::printf("stress_threads: OK: %d threads x %d ops x 2 upstreams, %llu allocations, %llu frees "
              "(%llu handed across threads), %llu OOMs, %llu OOM callbacks, %llu faults injected, "
              "%llu concurrent validate() calls, 0 leaked bytes\n",
              threads, ops, (unsigned long long)totals.allocations, (unsigned long long)totals.frees,
              (unsigned long long)totals.handoffs, (unsigned long long)totals.ooms,
              (unsigned long long)totals.callbacks, (unsigned long long)faults,
              (unsigned long long)totals.validations);
  return 0;
}
