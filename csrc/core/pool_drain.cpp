// Draining pages: giving pages back without synchronising the device. A free block's last user ran on
// its arena's stream (blocks used on other streams only become free once those streams' events have
// completed), and the device may still be running that work when the pool decides to release its
// pages. The pool carves the pages out of the free block as a draining block (out of the free index:
// nothing is handed out of it) and unmaps them once the device is past the block's last use. Until
// then the pages stay mapped and count as reserved, so the cap, the limit and the statistics stay
// exact.
//
// Marks: "past the last use" is an event recorded on the arena's stream after the block was freed.
// Each free counts (Pool::free_seq_, Block::freed_seq); a mark records the count when it was
// recorded, and once it has completed every block freed by then is done with (Arena::done_seq).
// Pages of such a block go back at once; others drain behind the earliest mark recorded after their
// block's free, and a new mark is recorded only when there is none. Why not an event recorded at
// release time: it waits for all the work queued so far, while the block's last use is often much
// older; at a cap, where the pool releases and waits every step, that made every wait a full drain
// of the stream. Marks are only ever polled (reap_drained); only an allocation that nothing else can
// serve (make_room under the cap or the limit, a map the device refuses) waits, for the earliest mark
// a draining block needs, one at a time; allocate()'s out-of-memory retry waits for all (drain_all).
// pool.hpp lists every file.
#include <algorithm>

#include "pool.hpp"

namespace gpumem {

void Pool::poll_marks(Arena& arena) {
  while (!arena.marks.empty() && upstream_->event_completed(arena.marks.front().event)) {
    arena.done_seq = arena.marks.front().seq;  // stream order: the marks before it are done too
    try {
      upstream_->destroy_event(arena.marks.front().event);
    } catch (...) {
      // The event is done with either way; a failure to destroy it leaks one driver handle at most.
    }
    arena.marks.pop_front();
  }
}

std::uint64_t Pool::mark_after(Arena& arena, std::uint64_t freed_seq) {
  poll_marks(arena);
  if (freed_seq <= arena.done_seq) return freed_seq;
  for (const Mark& mark : arena.marks)
    if (mark.seq >= freed_seq) return mark.seq;
  // Every block freed so far is covered by a mark recorded now.
  arena.marks.push_back(Mark{upstream_->record_event(arena.stream), free_seq_});
  return free_seq_;
}

Pool::Block* Pool::start_draining(Block* free_block, std::uintptr_t address, std::size_t bytes,
                                  std::uint64_t seq) {
  Block* block = carve(free_block, address, bytes);  // the pieces before and after stay free
  block->state = BlockInfo::kDraining;
  block->requested = 0;
  draining_.push_back(Draining{block, seq});
  draining_bytes_ += block->size;
  return block;
}

std::size_t Pool::reap_drained(bool wait_oldest, bool rethrow) {
  bool any_done = false;
  const Draining* earliest = nullptr;  // the draining block whose mark comes first
  for (const Draining& d : draining_) {
    Arena& arena = *d.block->region->arena;
    if (!arena.marks.empty() && d.seq > arena.done_seq) poll_marks(arena);
    if (d.seq <= arena.done_seq) any_done = true;
    else if (!earliest || d.seq < earliest->seq) earliest = &d;
  }
  if (!any_done && wait_oldest && earliest) {
    Arena& arena = *earliest->block->region->arena;
    const std::uint64_t seq = earliest->seq;
    // Its mark is still recorded (done_seq is below it): wait for it, the least wait that frees pages.
    const auto mark = std::find_if(arena.marks.begin(), arena.marks.end(),
                                   [&](const Mark& m) { return m.seq >= seq; });
    if (mark != arena.marks.end()) {
      upstream_->wait_event(mark->event);
    } else {  // never (validate() checks that the mark is there); if it were, the stream is the bound
      upstream_->synchronize(arena.stream);
    }
    stats_.num_sync_all_streams++;
    poll_marks(arena);
    arena.done_seq = std::max(arena.done_seq, seq);
  }
  std::size_t unmapped = 0;
  for (auto it = draining_.begin(); it != draining_.end();) {
    Block* block = it->block;
    Region* region = block->region;
    if (it->seq > region->arena->done_seq) {
      ++it;
      continue;
    }
    it = draining_.erase(it);
    draining_bytes_ -= block->size;
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
