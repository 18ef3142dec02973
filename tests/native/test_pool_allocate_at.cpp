// pool_tests: allocate_at (pool_allocate_at.cpp): a block carved at a given address, its refusals,
// the pages it maps under the cap, and a round trip that restores every statistic and block.
// Every test ends with validate() and the leak check (device used bytes == pool reserved bytes).
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "pool_test_util.hpp"

using namespace gpumem;
using namespace gpumem_test;

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
