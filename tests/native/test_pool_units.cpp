// pool_tests, continued: the physical units of large arenas (page_map.hpp) and where a block is placed
// in its free block (Pool::place). Far from the cap a large arena maps whole 8 MiB groups; within 1%
// of the cap single 2 MiB pages, except the groups a block of 256 MiB or more covers whole, and except
// under a roomy cap (2% above a settled live high water), where it remaps whole groups; pages go
// back only as the units they were mapped as (the simulated device refuses to unmap part of a
// physical allocation) and, unmapped to make room for a block, back it without a new allocation; a
// block goes where it needs the fewest unmapped pages.
#include <cstdint>
#include <vector>

#include "pool_test_util.hpp"

using namespace gpumem_test;

namespace {

Setup grouped(std::size_t capacity, std::size_t cap, ReleasePolicy release = ReleasePolicy::kLazy) {
  Setup s(UpstreamKind::kPages, capacity, cap, release);  // 2 MiB pages throughout...
  PoolOptions o;
  o.cap_bytes = cap;
  o.release = release;
  o.large_page_bytes = 8 * MiB;  // ...then large arenas with groups of four, the default
  o.stitch = false;  // as Setup: the figures are the groups' alone
  s.pool = std::make_unique<Pool>(s.dev, o);
  return s;
}

}  // namespace

TEST(far_from_the_cap_large_arenas_map_whole_groups) {
  Setup s = grouped(1024 * MiB, 0);
  std::uintptr_t a = s.pool->allocate(3 * MiB, 0);  // above 1 MiB: the large arena
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), std::int64_t(8 * MiB));
  std::uintptr_t b = s.pool->allocate(4 * MiB, 0);  // on the same group
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), std::int64_t(8 * MiB));
  check_clean(*s.pool, *s.dev);
  s.pool->free(a);
  s.pool->free(b);
  check_empty_after_trim(*s.pool, *s.dev);
}

TEST(near_the_cap_large_arenas_map_single_pages_and_give_back_units_as_mapped) {
  // Cap 100 MiB: whole groups fit up to 99 MiB (1% short of the cap), so past 96 MiB reserved the
  // pool maps the 2 MiB pages a block touches.
  Setup s = grouped(1024 * MiB, 100 * MiB);
  std::vector<std::uintptr_t> blocks;
  for (int i = 0; i < 12; ++i) blocks.push_back(s.pool->allocate(8 * MiB, 0));  // 96 MiB, whole groups
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), std::int64_t(96 * MiB));
  std::uintptr_t small_tail = s.pool->allocate(3 * MiB, 0);  // a whole group would pass 99 MiB
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), std::int64_t(100 * MiB));  // two pages, not four
  check_clean(*s.pool, *s.dev);
  // Free one 8 MiB block in the middle: its group is whole and free, it can go back; the cap holds.
  s.pool->free(blocks[5]);
  std::uintptr_t c = s.pool->allocate(6 * MiB, 0);
  CHECK(c != 0);
  check_clean(*s.pool, *s.dev);
  CHECK(cur(s.pool->stats().reserved_bytes) <= std::int64_t(100 * MiB));
  s.pool->free(small_tail);
  s.pool->free(c);
  for (std::size_t i = 0; i < blocks.size(); ++i)
    if (i != 5) s.pool->free(blocks[i]);
  check_empty_after_trim(*s.pool, *s.dev);  // the device checks every unmap was of whole units
}

TEST(near_the_cap_a_block_maps_the_groups_it_covers_whole_as_group_units) {
  // Cap 400 MiB: whole groups fit up to 396 MiB. x (100 MiB) takes 13 whole groups, [0, 104) MiB.
  // y (294 MiB, at least 256 MiB: kCoveredGroupsMinBytes) at [100, 394) needs [104, 394): whole
  // groups would reach 400 MiB, so only what it touches is mapped, but the 36 groups [104, 392) lie
  // wholly inside y: one unit each, then one single page [392, 394).
  Setup s = grouped(1024 * MiB, 400 * MiB);
  std::uintptr_t x = s.pool->allocate(100 * MiB, 0);
  CHECK_EQ(s.dev->physical_allocations(), std::uint64_t(13));
  std::uintptr_t y = s.pool->allocate(294 * MiB, 0);
  CHECK_EQ(y, x + 100 * MiB);
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), std::int64_t(394 * MiB));
  CHECK_EQ(s.dev->physical_allocations(), std::uint64_t(13 + 36 + 1));  // not 13 + 145 single pages
  check_clean(*s.pool, *s.dev);
  s.pool->free(y);
  s.pool->free(x);
  check_empty_after_trim(*s.pool, *s.dev);  // each unit went back whole, as it was mapped
  CHECK_EQ(s.dev->physical_releases(), s.dev->physical_allocations());
}

TEST(units_released_to_make_room_for_a_block_back_it_without_new_physical_allocations) {
  // Cap 560 MiB, lazy. a (272 MiB) and b (16 MiB) take 34 + 2 group units, [0, 288) MiB. a is freed
  // (cached). c (300 MiB) goes at [288, 588): under the cap that needs 28 MiB released, four of a's
  // groups; they are kept and back four of the 37 groups c covers whole, so c makes 33 new group
  // units and two single pages [584, 588), and nothing is released.
  Setup s = grouped(1024 * MiB, 560 * MiB);
  std::uintptr_t a = s.pool->allocate(272 * MiB, 0);
  std::uintptr_t b = s.pool->allocate(16 * MiB, 0);
  CHECK_EQ(s.dev->physical_allocations(), std::uint64_t(36));
  s.pool->free(a);
  std::uintptr_t c = s.pool->allocate(300 * MiB, 0);
  CHECK_EQ(c, b + 16 * MiB);
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), std::int64_t(556 * MiB));
  CHECK_EQ(s.dev->physical_allocations(), std::uint64_t(36 + 33 + 2));
  CHECK_EQ(s.dev->physical_releases(), std::uint64_t(0));  // a's four units moved, not released
  check_clean(*s.pool, *s.dev);  // nothing kept past the allocation; the device holds what is reserved
  s.pool->free(b);
  s.pool->free(c);
  check_empty_after_trim(*s.pool, *s.dev);
  CHECK_EQ(s.dev->physical_releases(), std::uint64_t(36 + 33 + 2));
}

TEST(kept_units_go_back_when_the_device_needs_their_memory_for_units_of_another_size) {
  // A 40 MiB device, no cap. a: one group unit [0, 8). b (31 MiB) at [8, 39): within 1% of the device
  // and below kCoveredGroupsMinBytes, so 16 single pages up to 40 MiB, even over the three groups it
  // covers whole. a is freed; d (8.5 MiB, too large for a's hole) goes at [39, 47.5): it needs four
  // single pages [40, 48) while the device is full. a's group is released to make room and kept, but
  // no single page can use it: the device, short of memory, must get it released first instead of
  // failing.
  Setup s = grouped(40 * MiB, 0);
  std::uintptr_t a = s.pool->allocate(8 * MiB, 0);
  std::uintptr_t b = s.pool->allocate(31 * MiB, 0);
  CHECK_EQ(s.dev->physical_allocations(), std::uint64_t(17));  // 1 group + 16 pages
  check_clean(*s.pool, *s.dev);
  s.pool->free(a);
  std::uintptr_t d = s.pool->allocate(8 * MiB + 512 * KiB, 0);
  CHECK_EQ(d, b + 31 * MiB);
  CHECK_EQ(s.pool->stats().num_ooms, std::int64_t(0));
  CHECK_EQ(s.dev->physical_allocations(), std::uint64_t(21));
  CHECK_EQ(s.dev->physical_releases(), std::uint64_t(1));  // a's group, kept, then released for d's pages
  check_clean(*s.pool, *s.dev);
  s.pool->free(b);
  s.pool->free(d);
  check_empty_after_trim(*s.pool, *s.dev);
}

TEST(a_capped_pool_fits_what_whole_groups_would_not) {
  // 9 blocks of 10 MiB under a 92 MiB cap: with whole 8 MiB groups only, the ninth, [80, 90) MiB,
  // would need the group [88, 96): 96 MiB, past the cap with nothing to release, an OOM. Near the cap
  // the pool maps its 2 MiB pages instead: 90 MiB.
  Setup s = grouped(1024 * MiB, 92 * MiB);
  std::vector<std::uintptr_t> blocks;
  for (int i = 0; i < 9; ++i) {
    blocks.push_back(s.pool->allocate(10 * MiB, 0));
    s.pool->validate();
  }
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), std::int64_t(90 * MiB));
  CHECK_EQ(s.pool->stats().num_ooms, std::int64_t(0));
  check_clean(*s.pool, *s.dev);
  for (std::uintptr_t b : blocks) s.pool->free(b);
  check_empty_after_trim(*s.pool, *s.dev);
}

namespace {

// Under a 120 MiB cap: x (48 MiB) and y (48 MiB) take 12 whole groups, [0, 96) MiB, and set the live
// high water to 96 MiB; x is freed and made again `cycles` times (in its own hole: no new page), then
// freed. z (52 MiB) does not fit the hole, so it goes at [96, 148) and raises the high water to 100 MiB:
// whole groups would reach 152 MiB, past the cap, so the pool releases x's hole (cached groups) to make
// room. Returns reserved bytes after z; y and z live.
std::int64_t reserved_after_remapping_at_the_cap(Setup& s, int cycles) {
  std::uintptr_t x = s.pool->allocate(48 * MiB, 0);
  std::uintptr_t y = s.pool->allocate(48 * MiB, 0);
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), std::int64_t(96 * MiB));
  for (int i = 0; i < cycles; ++i) {
    s.pool->free(x);
    x = s.pool->allocate(48 * MiB, 0);
  }
  s.pool->free(x);
  std::uintptr_t z = s.pool->allocate(52 * MiB, 0);
  CHECK_EQ(z, y + 48 * MiB);
  CHECK_EQ(s.pool->stats().num_ooms, std::int64_t(0));
  const std::int64_t reserved = cur(s.pool->stats().reserved_bytes);
  check_clean(*s.pool, *s.dev);
  s.pool->free(y);
  s.pool->free(z);
  check_empty_after_trim(*s.pool, *s.dev);  // every unit went back whole, as it was mapped
  return reserved;
}

}  // namespace

TEST(under_a_roomy_cap_a_settled_pool_remaps_whole_groups) {
  // 120 MiB is more than 2% above the high water (100 MiB with z), and after ten cycles 480 MiB were
  // allocated since it last rose, at least 4x its bytes: settled. z maps its 7 groups whole,
  // [96, 152) MiB: 32 MiB of x's hole go back and reserved ends at the cap.
  Setup roomy = grouped(1024 * MiB, 120 * MiB);
  CHECK_EQ(reserved_after_remapping_at_the_cap(roomy, 10), std::int64_t(120 * MiB));
  // A limit (what torch.cuda.set_per_process_memory_fraction sets) is a bound as the cap is.
  Setup limited = grouped(1024 * MiB, 0);
  limited.pool->set_limit(120 * MiB);
  CHECK_EQ(reserved_after_remapping_at_the_cap(limited, 10), std::int64_t(120 * MiB));
  // The same after two cycles (192 MiB since the rise, less than 4x): not settled, so z maps the 26
  // pages it touches, [96, 148), as before: 116 MiB.
  Setup unsettled = grouped(1024 * MiB, 120 * MiB);
  CHECK_EQ(reserved_after_remapping_at_the_cap(unsettled, 2), std::int64_t(116 * MiB));
  // A cap within 2% of the high water is tight, settled or not: single pages, and x's whole hole goes.
  Setup tight = grouped(1024 * MiB, 101 * MiB);
  CHECK_EQ(reserved_after_remapping_at_the_cap(tight, 10), std::int64_t(100 * MiB));
  // No cap: the device bounds the pool, whole groups fit without releasing anything.
  Setup free_pool = grouped(1024 * MiB, 0);
  CHECK_EQ(reserved_after_remapping_at_the_cap(free_pool, 10), std::int64_t(152 * MiB));
}

TEST(a_block_goes_where_it_needs_the_fewest_unmapped_pages) {
  // High water: freed pages between live blocks are released. A hole whose start lies on released
  // pages and whose end on mapped ones takes a smaller block at its end.
  Setup s(UpstreamKind::kPages, 1024 * MiB, 0, ReleasePolicy::kHighWater);
  std::uintptr_t a = s.pool->allocate(8 * MiB, 0);
  std::uintptr_t b = s.pool->allocate(8 * MiB, 0);
  std::uintptr_t c = s.pool->allocate(8 * MiB, 0);
  s.pool->free(a);
  s.pool->trim();  // a's 4 pages go back: the hole [a, b) is unmapped
  s.pool->free(b);  // the hole is now [a, c): 4 unmapped pages, then 4 mapped ones
  const std::int64_t before = cur(s.pool->stats().reserved_bytes);
  std::uintptr_t d = s.pool->allocate(4 * MiB, 0);
  CHECK_EQ(d, b + 4 * MiB);  // at the hole's end, on b's mapped pages
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), before);  // nothing mapped
  check_clean(*s.pool, *s.dev);
  s.pool->free(d);
  s.pool->free(c);
  check_empty_after_trim(*s.pool, *s.dev);
}

TEST(a_block_takes_a_larger_mapped_hole_over_a_best_fit_that_needs_pages_mapped) {
  // Two holes: [0, 20) MiB with its pages given back (trim), [22, 62) MiB still mapped. Best fit for
  // 16 MiB is the first, which needs 8 pages mapped; the second needs none and pins no more pages:
  // the block goes there and nothing is mapped (pool_map.cpp: fewest_unmapped_fit).
  Setup s(UpstreamKind::kPages, 1024 * MiB, 0, ReleasePolicy::kLazy);
  std::uintptr_t a = s.pool->allocate(20 * MiB, 0);
  std::uintptr_t sep1 = s.pool->allocate(2 * MiB, 0);
  std::uintptr_t b = s.pool->allocate(40 * MiB, 0);
  std::uintptr_t sep2 = s.pool->allocate(2 * MiB, 0);
  s.pool->free(a);
  s.pool->trim();  // a's pages go back: the hole [0, 20) MiB is unmapped
  s.pool->free(b);  // [22, 62) MiB: free, mapped
  const std::int64_t reserved = cur(s.pool->stats().reserved_bytes);
  const std::int64_t maps = s.pool->stats().num_device_alloc;
  std::uintptr_t d = s.pool->allocate(16 * MiB, 0);
  CHECK_EQ(d, b);
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), reserved);
  CHECK_EQ(s.pool->stats().num_device_alloc, maps);
  check_clean(*s.pool, *s.dev);
  // The mapped rest, [38, 62) MiB, takes the next request that fits it, again mapping nothing.
  std::uintptr_t e = s.pool->allocate(20 * MiB, 0);
  CHECK_EQ(e, b + 16 * MiB);
  CHECK_EQ(s.pool->stats().num_device_alloc, maps);
  // 18 MiB fits no mapped block: the best fit, the unmapped hole, needs no more pages than the free
  // tail would, so it keeps the request.
  std::uintptr_t f = s.pool->allocate(18 * MiB, 0);
  CHECK_EQ(f, a);
  check_clean(*s.pool, *s.dev);
  for (std::uintptr_t p : {d, e, f, sep1, sep2}) s.pool->free(p);
  check_empty_after_trim(*s.pool, *s.dev);
}
