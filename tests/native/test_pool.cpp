// pool_tests: the pool core (pool.hpp) against the simulated device, deterministic cases with exact
// figures: allocation and free, streams, best fit, OOM handling, the cap and the limit, try_free and
// the segment observer. Faults are in test_pool_faults.cpp, allocate_at in test_pool_allocate_at.cpp.
// Every test ends with validate() and the leak check (device used bytes == pool reserved bytes).
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "pool_test_util.hpp"

using namespace gpumem;
using namespace gpumem_test;

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

// ---- try_free, the limit, the segment observer --------------------------------------------------

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
    std::size_t freed = 1;
    CHECK(!s.pool->try_free(b + 512, &freed));
    CHECK_EQ(freed, std::size_t(1));  // untouched on a miss
    CHECK(s.pool->try_free(b, &freed));
    CHECK_EQ(freed, std::size_t(8192));  // the block's size, for callers that count bytes
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

// Room under a limit comes from the large arenas' cached pages before the small arena's, even when
// the small arena was made first (pool_release.cpp, release_cached_units); the small arena's pages go
// only when the large arenas have none left.
TEST(limit_releases_large_arenas_before_the_small_one) {
  for (UpstreamKind kind : kKinds) {
    Setup s(kind, 256 * MiB, 0, ReleasePolicy::kLazy);
    std::vector<std::uintptr_t> smalls;
    for (int i = 0; i < 4; ++i) smalls.push_back(s.pool->allocate(1 << 20, 0));  // the small arena first
    std::uintptr_t large = s.pool->allocate(16 << 20, 0);
    for (std::uintptr_t x : smalls) s.pool->free(x);
    s.pool->free(large);
    const std::int64_t small_cached = s.pool->stats().reserved_bytes[kSmallPool].current;
    CHECK(small_cached >= std::int64_t(4 << 20));
    s.pool->set_limit(static_cast<std::size_t>(cur(s.pool->stats().reserved_bytes)));
    std::uintptr_t other = s.pool->allocate(16 << 20, 1);  // a new arena: room from released pages
    CHECK_EQ(s.pool->stats().reserved_bytes[kSmallPool].current, small_cached);
    check_clean(*s.pool, *s.dev);
    s.pool->free(other);
    s.pool->set_limit(Pool::kNoLimit);
    check_empty_after_trim(*s.pool, *s.dev);
  }
  Setup s(UpstreamKind::kPages, 256 * MiB, 0, ReleasePolicy::kLazy);
  std::vector<std::uintptr_t> smalls;
  for (int i = 0; i < 4; ++i) smalls.push_back(s.pool->allocate(1 << 20, 0));
  std::uintptr_t large = s.pool->allocate(16 << 20, 0);  // live: the large arena caches nothing
  for (std::uintptr_t x : smalls) s.pool->free(x);
  s.pool->set_limit(static_cast<std::size_t>(cur(s.pool->stats().reserved_bytes)));
  std::uintptr_t other = s.pool->allocate(4 << 20, 1);
  CHECK_EQ(s.pool->stats().reserved_bytes[kSmallPool].current, std::int64_t(0));
  CHECK_EQ(s.pool->stats().reserved_bytes[kLargePool].current, std::int64_t(20 << 20));
  check_clean(*s.pool, *s.dev);
  for (std::uintptr_t x : {large, other}) s.pool->free(x);
  s.pool->set_limit(Pool::kNoLimit);
  check_empty_after_trim(*s.pool, *s.dev);
}

// Pages of 1 MiB or less (a simulated device's; CUDA's are 2 MiB) fit in free blocks of 1 MiB or less,
// which the free index keeps in bins rather than in its size class lists: the release before an
// out-of-memory error skipped them, so a freed 1 MiB block kept its 64 KiB pages and a request that
// it fitted failed under the cap (found by the fuzzer, 2026-12-06).
TEST(release_before_oom_takes_pages_of_binned_free_blocks) {
  Setup s(UpstreamKind::kPages, 24 * MiB, 4 * MiB + 128 * KiB, ReleasePolicy::kLazy, 64 * KiB);
  s.dev->set_auto_complete(false);
  std::vector<std::uintptr_t> live;
  for (int i = 0; i < 3; ++i) live.push_back(s.pool->allocate(1 * MiB, 7));
  live.push_back(s.pool->allocate(1 * MiB, 1));
  live.push_back(s.pool->allocate(513, 7));
  s.pool->free(live[1]);  // 1 MiB free and mapped between two live blocks
  live.erase(live.begin() + 1);
  // Packed placement picks the free tail past the 513 bytes; it cannot map under the cap, so the
  // pool releases its cache (the freed block's pages) and places the request again.
  std::uintptr_t p = s.pool->allocate(496 * KiB, 7);
  CHECK(p != 0);
  CHECK(cur(s.pool->stats().reserved_bytes) <= std::int64_t(4 * MiB + 128 * KiB));
  CHECK_EQ(s.pool->stats().num_ooms, std::int64_t(0));
  check_clean(*s.pool, *s.dev);
  s.pool->free(p);
  for (std::uintptr_t x : live) s.pool->free(x);
  s.dev->complete_all();
  check_empty_after_trim(*s.pool, *s.dev);
}

TEST(slot_sized_block_goes_off_its_boundary_into_a_mapped_hole_rather_than_fail) {
  // Two 2 MiB pages under a 4 MiB cap, both pinned by live small blocks; the hole [0.25, 1.5) MiB of the
  // first page is mapped but holds no whole slot. Packed placement wants a slot boundary (the free tail,
  // whose pages cannot be mapped under the cap); the last try before an OOM puts the block in the hole.
  for (ReleasePolicy release : {ReleasePolicy::kLazy, ReleasePolicy::kHighWater}) {
    Setup s(UpstreamKind::kPages, 64 * MiB, 4 * MiB, release);
    const std::uintptr_t base = s.pool->allocate(256 * KiB, 7);
    CHECK_EQ(base % (2 * MiB), std::uintptr_t(0));
    std::vector<std::uintptr_t> hole = {s.pool->allocate(512 * KiB, 7), s.pool->allocate(512 * KiB, 7),
                                        s.pool->allocate(256 * KiB, 7)};
    const std::uintptr_t after_hole = s.pool->allocate(512 * KiB, 7);
    const std::uintptr_t second_page[] = {s.pool->allocate(1 * MiB, 7), s.pool->allocate(1 * MiB, 7)};
    CHECK_EQ(after_hole, base + 3 * MiB / 2);
    CHECK_EQ(second_page[1], base + 3 * MiB);
    for (std::uintptr_t x : hole) s.pool->free(x);
    CHECK_EQ(cur(s.pool->stats().reserved_bytes), std::int64_t(4 * MiB));
    const std::uintptr_t p = s.pool->allocate(1 * MiB, 7);
    CHECK_EQ(p, base + 256 * KiB);  // off the slot boundary, in mapped pages: nothing more reserved
    CHECK_EQ(s.pool->stats().num_ooms, std::int64_t(0));
    CHECK_EQ(cur(s.pool->stats().reserved_bytes), std::int64_t(4 * MiB));
    check_clean(*s.pool, *s.dev);
    for (std::uintptr_t x : {base, after_hole, second_page[0], second_page[1], p}) s.pool->free(x);
    s.dev->complete_all();
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
        if (e == SegmentEvent::kSpanAdded || e == SegmentEvent::kSpanRemoved) return;  // test_pool_spans.cpp
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
