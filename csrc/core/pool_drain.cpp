// Draining pages: giving pages back without synchronising the device. A free block's last user ran on
// its arena's stream (blocks used on other streams only become free once those streams' events have
// completed), and the device may still be running that work when the pool decides to release its
// pages. Instead of waiting for the stream, the pool records an event on it, carves the pages out of
// the free block as a draining block (out of the free index: nothing is handed out of it), and unmaps
// them once the event has completed, which it only ever polls (reap_drained). Until then the pages
// stay mapped and count as reserved, so the cap, the limit and the statistics stay exact. Only an
// allocation that nothing else can serve (make_room under the cap or the limit, a map the device
// refuses) waits, oldest event first, one at a time; allocate()'s out-of-memory retry waits for all
// (drain_all). pool.hpp lists every file.
#include "pool.hpp"

namespace gpumem {

Pool::Block* Pool::start_draining(Block* free_block, std::uintptr_t address, std::size_t bytes, EventId event) {
  Block* block = carve(free_block, address, bytes);  // the pieces before and after stay free
  block->state = BlockInfo::kDraining;
  block->requested = 0;
  draining_.push_back(Draining{block, event});
  draining_bytes_ += block->size;
  return block;
}

std::size_t Pool::reap_drained(bool wait_oldest, bool rethrow) {
  std::size_t unmapped = 0;
  for (auto it = draining_.begin(); it != draining_.end();) {
    bool done = upstream_->event_completed(it->event);
    if (!done && wait_oldest) {
      upstream_->wait_event(it->event);  // the oldest one not done: waiting for it is the least wait
      stats_.num_sync_all_streams++;
      done = true;
    }
    wait_oldest = false;
    if (!done) {
      ++it;
      continue;
    }
    Block* block = it->block;
    const EventId event = it->event;
    it = draining_.erase(it);
    draining_bytes_ -= block->size;
    try {
      upstream_->destroy_event(event);
    } catch (...) {
      // The event is done with either way; a failure to destroy it leaks one driver handle at most.
    }
    Region* region = block->region;
    PageMap& pages = region->pages;
    const PageRun run = pages.touched(block->address, block->size);  // whole pages: exactly its own
    block->state = BlockInfo::kFree;
    const PageRun span = notify_unmapping_run(region, run);  // span trackers hear before the unmap
    try {
      upstream_->unmap(block->address, block->size, pages.unit_bytes(run.first));  // units of one size
    } catch (const UpstreamError&) {
      notify_unmapped_run(region, run, span, false);  // the span is whole again
      insert_free(block);  // the pages stay mapped: cached again, accounted as before
      if (rethrow) throw;
      continue;
    }
    stats_.num_device_free++;
    pages.mark_unmapped(run);
    add_reserved(region, -static_cast<std::int64_t>(block->size));
    notify(SegmentEvent::kUnmap, block->address, block->size, region->arena->stream);
    notify_unmapped_run(region, run, span, true);
    unmapped += block->size;
    insert_free(block);
  }
  return unmapped;
}

std::size_t Pool::drain_all(bool rethrow) {
  std::size_t unmapped = 0;
  while (!draining_.empty()) unmapped += reap_drained(/*wait_oldest=*/true, rethrow);
  return unmapped;
}

}  // namespace gpumem
