// pool_tests: releasing pages without synchronising the device (core/pool_drain.cpp). On a simulated
// device whose streams run behind the host (auto_complete off), released pages drain: they stay
// mapped and reserved until an event on their stream completes, the high-water policy never waits
// for them, and a cap waits only for the oldest draining event of the stream that used them. Pages
// drain behind the first mark (an event on their stream) recorded after their block was freed: no
// later work is waited for, and pages freed before a completed mark go back at once. A block of the
// same stream (its arena's region) maps from draining pages instead: no new memory and no wait.
// Tests that watch pages drain allocate the block that needs the room on another stream (its own
// region), which cannot map from them.
#include <cstdint>

#include "pool_test_util.hpp"

using namespace gpumem;
using namespace gpumem_test;

// Streams behind the host; [a 8 free][b 8 live] on stream 0 under the high-water policy: returns b.
static std::uintptr_t a_freed_before_b(Setup& s) {
  s.dev->set_auto_complete(false);
  std::uintptr_t a = s.pool->allocate(8 * MiB, 0);
  std::uintptr_t b = s.pool->allocate(8 * MiB, 0);
  s.pool->free(a);  // 8 MiB cached at the start of the region
  return b;
}

TEST(high_water_release_drains_without_waiting) {
  Setup s(UpstreamKind::kPages, 256 * MiB, 0, ReleasePolicy::kHighWater);
  const std::uintptr_t b = a_freed_before_b(s);
  std::uintptr_t c = s.pool->allocate(12 * MiB, 1);  // past the high water: a's pages go back
  DeviceStats st = s.pool->stats();
  CHECK_EQ(st.num_sync_all_streams, std::int64_t(0));      // nobody waited
  CHECK_EQ(s.pool->draining_bytes(), std::size_t(8 * MiB));  // still mapped, still counted
  CHECK_EQ(cur(st.reserved_bytes), std::int64_t(28 * MiB));
  check_clean(*s.pool, *s.dev);
  s.pool->process_events();  // the stream has not got there yet: nothing changes
  CHECK_EQ(s.pool->draining_bytes(), std::size_t(8 * MiB));
  s.dev->complete(0);
  s.pool->process_events();
  CHECK_EQ(s.pool->draining_bytes(), std::size_t(0));
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), std::int64_t(20 * MiB));
  check_clean(*s.pool, *s.dev);
  s.pool->free(b);
  s.pool->free(c);
  check_empty_after_trim(*s.pool, *s.dev);
}

TEST(a_cap_waits_for_the_oldest_draining_event_of_one_stream_only) {
  Setup s(UpstreamKind::kPages, 256 * MiB, 12 * MiB, ReleasePolicy::kLazy);
  s.dev->set_auto_complete(false);
  std::uintptr_t a = s.pool->allocate(8 * MiB, 0);
  std::uintptr_t b = s.pool->allocate(4 * MiB, 0);
  s.pool->free(a);
  const EventId other = s.dev->record_event(2);  // work queued on another stream
  std::uintptr_t c = s.pool->allocate(6 * MiB, 1);  // another arena: a's pages must go back first
  CHECK_EQ(s.pool->stats().num_sync_all_streams, std::int64_t(1));  // one wait, for stream 0's event
  CHECK(!s.dev->event_completed(other));                              // stream 2 was not waited for
  CHECK_EQ(s.pool->draining_bytes(), std::size_t(0));
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), std::int64_t(12 * MiB));  // 6 of a's 8 MiB went back
  check_clean(*s.pool, *s.dev);
  s.dev->destroy_event(other);
  s.pool->free(b);
  s.pool->free(c);
  check_empty_after_trim(*s.pool, *s.dev);
}

TEST(draining_events_complete_one_by_one_and_trim_waits_for_the_rest) {
  Setup s(UpstreamKind::kPages, 256 * MiB, 0, ReleasePolicy::kHighWater);
  s.dev->set_auto_complete(false);
  std::uintptr_t a = s.pool->allocate(4 * MiB, 0);
  std::uintptr_t b = s.pool->allocate(4 * MiB, 0);
  std::uintptr_t x = s.pool->allocate(4 * MiB, 0);
  s.pool->free(a);
  std::uintptr_t c = s.pool->allocate(6 * MiB, 1);  // a's pages drain (event 1)
  s.pool->free(b);
  std::uintptr_t d = s.pool->allocate(10 * MiB, 1);  // b's pages drain (event 2)
  CHECK_EQ(s.pool->draining_bytes(), std::size_t(8 * MiB));
  s.dev->complete_one(0);  // the first event only
  s.pool->process_events();
  CHECK_EQ(s.pool->draining_bytes(), std::size_t(4 * MiB));
  check_clean(*s.pool, *s.dev);
  for (std::uintptr_t p : {c, d, x}) s.pool->free(p);
  CHECK(s.pool->trim() > 0);  // waits for the rest
  CHECK_EQ(s.pool->draining_bytes(), std::size_t(0));
  check_clean(*s.pool, *s.dev);
  CHECK_EQ(s.dev->used_bytes(), std::size_t(0));
}

// Streams behind the host; two 8 MiB blocks allocated and freed on stream 0 (frees 1 and 2), kept
// apart by the live 4 MiB blocks x and y: [a 8 free][x 4][b 8 free][y 4].
struct Holes {
  std::uintptr_t x, y;
};
static Holes two_freed_holes(Setup& s) {
  s.dev->set_auto_complete(false);
  std::uintptr_t a = s.pool->allocate(8 * MiB, 0);
  std::uintptr_t x = s.pool->allocate(4 * MiB, 0);
  std::uintptr_t b = s.pool->allocate(8 * MiB, 0);
  std::uintptr_t y = s.pool->allocate(4 * MiB, 0);
  s.pool->free(a);
  s.pool->free(b);
  return {x, y};
}

TEST(pages_freed_before_a_completed_mark_go_back_at_once_without_waiting_for_later_work) {
  Setup s(UpstreamKind::kPages, 256 * MiB, 32 * MiB, ReleasePolicy::kLazy);
  const Holes h = two_freed_holes(s);
  // Past the cap: 6 MiB drain behind a new mark; on another stream, where they cannot be lent to c,
  // so the cap waits for the mark.
  std::uintptr_t c = s.pool->allocate(14 * MiB, 1);
  CHECK_EQ(s.pool->stats().num_sync_all_streams, std::int64_t(1));  // the cap waited for it
  const EventId later = s.dev->record_event(0);  // work queued after the mark, not yet done
  std::uintptr_t d = s.pool->allocate(10 * MiB, 0);  // the 10 MiB still free of a and b go back
  DeviceStats st = s.pool->stats();
  CHECK_EQ(st.num_sync_all_streams, std::int64_t(1));  // no new wait: they were freed before the mark
  CHECK(!s.dev->event_completed(later));              // and the later work was not waited for
  CHECK_EQ(s.pool->draining_bytes(), std::size_t(0));
  CHECK_EQ(cur(st.reserved_bytes), std::int64_t(32 * MiB));
  check_clean(*s.pool, *s.dev);
  s.dev->destroy_event(later);
  for (std::uintptr_t p : {h.x, h.y, c, d}) s.pool->free(p);
  check_empty_after_trim(*s.pool, *s.dev);
}

TEST(pages_drain_behind_the_earliest_mark_after_their_free_not_a_new_one) {
  Setup s(UpstreamKind::kPages, 256 * MiB, 0, ReleasePolicy::kHighWater);
  const Holes h = two_freed_holes(s);
  std::uintptr_t c = s.pool->allocate(12 * MiB, 1);  // past the high water: pages of a and b drain
  CHECK(s.pool->draining_bytes() > 0);
  CHECK(s.pool->draining_bytes() < std::size_t(16 * MiB));  // some of them are still cached
  const EventId later = s.dev->record_event(0);             // work queued after that mark
  s.pool->set_cap(24 * MiB);  // the rest of a and b must go: behind the same mark, which it waits for
  CHECK(!s.dev->event_completed(later));  // the later work was not waited for
  CHECK_EQ(s.pool->draining_bytes(), std::size_t(0));
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), std::int64_t(20 * MiB));  // x, y and c's pages only
  check_clean(*s.pool, *s.dev);
  s.dev->destroy_event(later);
  for (std::uintptr_t p : {h.x, h.y, c}) s.pool->free(p);
  check_empty_after_trim(*s.pool, *s.dev);
}

TEST(pages_the_cap_releases_for_a_block_of_their_stream_back_it_without_a_wait) {
  // Lazy, capped at 24 MiB: 4 MiB of a (8 MiB, freed a moment ago, still in use on the device) must
  // go back for c (12 MiB), which does not fit its hole. Those pages are c's at once, as pages
  // draining before c's allocation would be: no wait, no new memory for them, the cap kept throughout.
  Setup s(UpstreamKind::kPages, 256 * MiB, 24 * MiB, ReleasePolicy::kLazy);
  const std::uintptr_t b = a_freed_before_b(s);
  const std::uint64_t created = s.dev->physical_allocations();
  std::uintptr_t c = s.pool->allocate(12 * MiB, 0);
  DeviceStats st = s.pool->stats();
  CHECK_EQ(st.num_sync_all_streams, std::int64_t(0));  // nobody waited
  CHECK_EQ(cur(st.reserved_bytes), std::int64_t(24 * MiB));
  CHECK_EQ(s.dev->used_bytes(), std::size_t(24 * MiB));
  CHECK_EQ(s.dev->physical_allocations() - created, std::uint64_t(4));  // c's other 8 MiB
  CHECK_EQ(s.dev->units_mapped_twice(), std::size_t(2));               // two of a's units, lent
  check_clean(*s.pool, *s.dev);
  s.dev->complete(0);
  s.pool->process_events();
  CHECK_EQ(s.dev->units_mapped_twice(), std::size_t(0));
  CHECK_EQ(s.dev->used_bytes(), std::size_t(24 * MiB));
  check_clean(*s.pool, *s.dev);
  s.pool->free(b);
  s.pool->free(c);
  check_empty_after_trim(*s.pool, *s.dev);
}

TEST(closest_to_the_cap_the_pages_released_for_a_block_are_waited_for_not_lent) {
  // As above, but c (16 MiB) brings the live bytes to the cap itself (8 + 16 = 24 MiB, past 98% of
  // it, kLendHeadroom): a's pages go back to the device first, after a wait, and c's are all new.
  Setup s(UpstreamKind::kPages, 256 * MiB, 24 * MiB, ReleasePolicy::kLazy);
  const std::uintptr_t b = a_freed_before_b(s);
  std::uintptr_t c = s.pool->allocate(16 * MiB, 0);
  DeviceStats st = s.pool->stats();
  CHECK_EQ(st.num_sync_all_streams, std::int64_t(1));  // the cap waited for a's mark
  CHECK_EQ(s.dev->units_mapped_twice(), std::size_t(0));
  CHECK_EQ(cur(st.reserved_bytes), std::int64_t(24 * MiB));
  CHECK_EQ(s.dev->used_bytes(), std::size_t(24 * MiB));
  check_clean(*s.pool, *s.dev);
  s.pool->free(b);
  s.pool->free(c);
  s.dev->complete_all();
  check_empty_after_trim(*s.pool, *s.dev);
}

TEST(a_block_of_the_same_stream_maps_from_draining_pages_without_new_memory_or_a_wait) {
  Setup s(UpstreamKind::kPages, 256 * MiB, 0, ReleasePolicy::kHighWater);
  const std::uintptr_t b = a_freed_before_b(s);
  const std::uint64_t created = s.dev->physical_allocations();
  std::uintptr_t c = s.pool->allocate(12 * MiB, 0);  // past the high water: a's pages go back
  DeviceStats st = s.pool->stats();
  CHECK_EQ(st.num_sync_all_streams, std::int64_t(0));  // nobody waited
  // c took a's memory while the device may still be using it at a's address (stream order makes
  // that safe): reserved is what b and c hold, and only c's last 4 MiB are new memory.
  CHECK_EQ(cur(st.reserved_bytes), std::int64_t(20 * MiB));
  CHECK_EQ(s.dev->used_bytes(), std::size_t(20 * MiB));
  CHECK_EQ(s.dev->physical_allocations() - created, std::uint64_t(2));  // 2 MiB units
  CHECK_EQ(s.dev->units_mapped_twice(), std::size_t(4));               // a's four 2 MiB units
  CHECK_EQ(s.pool->draining_bytes(), std::size_t(0));  // nothing more goes back: it moved
  check_clean(*s.pool, *s.dev);
  s.dev->complete(0);
  s.pool->process_events();  // a's address is unmapped now; the memory stays with c
  CHECK_EQ(s.dev->units_mapped_twice(), std::size_t(0));
  CHECK_EQ(cur(s.pool->stats().reserved_bytes), std::int64_t(20 * MiB));
  CHECK_EQ(s.dev->used_bytes(), std::size_t(20 * MiB));
  check_clean(*s.pool, *s.dev);
  s.pool->free(b);
  s.pool->free(c);
  check_empty_after_trim(*s.pool, *s.dev);
}

// The simulated device's lag (the replays' model of a GPU behind the host, bench/remap_at_cap.py
// --device-lag): events complete `lag` host steps after they were recorded, or when waited for; a wait
// counts, with the steps the device still needed; two waits in one host step are as long as the longer.
TEST(a_lagging_device_completes_events_by_its_clock_and_counts_the_waits_and_their_length) {
  SimulatedDevice dev(UpstreamKind::kPages, 64 * MiB);
  dev.set_lag(10);
  const EventId a = dev.record_event(0);  // step 0
  for (int i = 0; i < 4; ++i) dev.advance();
  const EventId b = dev.record_event(0);  // step 4
  const EventId other = dev.record_event(1);
  CHECK(!dev.event_completed(a) && !dev.event_completed(b));
  for (int i = 0; i < 6; ++i) dev.advance();  // step 10: a's lag has passed, b's not
  CHECK(dev.event_completed(a) && !dev.event_completed(b));
  dev.wait_event(a);  // done already: no wait
  CHECK_EQ(dev.waits(), std::uint64_t(0));
  dev.wait_event(b);  // 4 steps left
  CHECK_EQ(dev.waits(), std::uint64_t(1));
  CHECK_EQ(dev.waited_steps(), std::uint64_t(4));
  CHECK(dev.event_completed(b));
  const EventId c = dev.record_event(0);  // step 10, due at 20; the device ran 4 steps meanwhile
  dev.wait_event(c);                      // so 6 are left
  CHECK_EQ(dev.waited_steps(), std::uint64_t(10));
  CHECK(dev.event_completed(other));  // stream 1 is as far as the device got: step 14 >= 4 + 10
  dev.advance();  // the host runs ahead again: the device is 10 steps behind
  // ... but what it was seen to finish stays finished (`other` is due at step 14 by the clock, 11 now).
  CHECK(dev.event_completed(other));
  const EventId d = dev.record_event(0);
  dev.synchronize(0);  // a wait as long as d needs
  CHECK_EQ(dev.waits(), std::uint64_t(3));
  CHECK_EQ(dev.waited_steps(), std::uint64_t(20));
  dev.synchronize(0);  // nothing left on the stream: no wait
  CHECK_EQ(dev.waits(), std::uint64_t(3));
  for (EventId e : {a, b, c, d, other}) dev.destroy_event(e);
}
