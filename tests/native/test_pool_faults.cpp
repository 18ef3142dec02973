// pool_tests: the pool when the upstream fails: every Nth call, at random, in the middle of mapping a
// multi-page block, on unmap; afterwards the pool works, validate() passes and nothing leaks.
// Every test ends with validate() and the leak check (device used bytes == pool reserved bytes).
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "pool_test_util.hpp"

using namespace gpumem;
using namespace gpumem_test;

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


TEST(fault_in_the_middle_of_growing_a_block_retries_transparently) {
  TwoGapsPool g;
  auto& [sim, flaky, pool, b, d] = g;
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
  TwoGapsPool g;
  auto& [sim, flaky, pool, b, d] = g;
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

TEST(allocate_at_device_refusal_is_an_oom_that_leaks_nothing) {
  TwoGapsPool g;
  auto& [sim, flaky, pool, b, d] = g;  // p1 (b) and p3 (d) live, p0 and p2 unmapped
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
