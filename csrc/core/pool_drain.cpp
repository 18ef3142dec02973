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
//
// Lending: a map in the same region need not wait at all. The region's stream is the only one that
// can still be using a draining block (its last user), and a new block of the region is used on that
// stream too, after whatever was queued before: in stream order, exactly as a free block is reused
// at once. So map_from_draining maps the new block's pages onto the draining block's physical units
// (Upstream::map_from): no new memory, no wait, and the draining block, now "lent", is unmapped at
// its mark as before, which then frees nothing. Without it, pages released under the high-water
// policy on a GPU running behind the host stayed reserved while fresh ones were mapped: reserved
// rose past live by what was draining (BERT inference, H100: 1.29-1.46x live instead of ~1.01x).
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

void Pool::wait_for_mark(Arena& arena, std::uint64_t seq) {
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
  // Option stitch: a unit here may be mapped at parked positions too, whose last use can be later
  // than this block's (a free unit stitched under a block that went back unused); they are unmapped
  // with these pages (drop_aliases_of), so these drain behind their marks as well.
  const PageRun run = block->region->pages.touched(address, bytes);
  for (auto it = block->region->aliases_of.lower_bound(run.first);
       it != block->region->aliases_of.end() && it->first < run.end; ++it)
    for (std::size_t a : it->second) {
      const Alias& alias = block->region->aliases.at(a);
      if (!alias.draining) seq = std::max(seq, alias.seq);
    }
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
    // The earliest that gives memory back; a lent one (its unmap frees nothing) only when none does.
    else if (!earliest || (earliest->lent && !d.lent) || (earliest->lent == d.lent && d.seq < earliest->seq))
      earliest = &d;
  }
  // Its mark is still recorded (done_seq is below it): wait for it, the least wait that frees pages.
  if (!any_done && wait_oldest && earliest) wait_for_mark(*earliest->block->region->arena, earliest->seq);
  std::size_t unmapped = 0;
  for (auto it = draining_.begin(); it != draining_.end();) {
    Block* block = it->block;
    Region* region = block->region;
    if (it->seq > region->arena->done_seq) {
      ++it;
      continue;
    }
    const bool lent = it->lent;
    PageMap& pages = region->pages;
    const PageRun run = pages.touched(block->address, block->size);  // whole pages: exactly its own
    const PageRun span = notify_unmapping_run(region, run);  // span trackers hear before the unmap
    bool parked = false;  // a lent block whose units' owners all hold them still (pool_alias.cpp)
    try {
      // Parked where its units still have their owners (stitching, or park_lent under a roomy bound,
      // when it was lent: parks_lent_units); else its parked aliases go back with it (a block lent
      // unrecorded, under a bound, may own some).
      if (lent && (options_.stitch || options_.park_lent)) parked = park_drained(region, block, it->seq);
      if (!parked) {
        drop_aliases_of(region, run);
        upstream_->unmap(block->address, block->size, pages.unit_bytes(run.first));  // units of one size
      }
    } catch (const UpstreamError&) {
      notify_unmapped_run(region, run, span, false);  // the span is whole again
      if (lent) {
        ++it;  // its units back a live block: never a free block; it stays draining, tried again later
      } else {
        it = draining_.erase(it);
        draining_bytes_ -= block->size;
        block->state = BlockInfo::kFree;
        insert_free(block);  // the pages stay mapped: cached again, accounted as before
      }
      if (rethrow) throw;
      continue;
    }
    it = draining_.erase(it);
    if (lent) {
      region->lent -= block->size;  // the memory stays, under the block it was lent to
    } else {
      draining_bytes_ -= block->size;
      add_reserved(region, -static_cast<std::int64_t>(block->size));
      unmapped += block->size;
    }
    block->state = BlockInfo::kFree;
    if (!parked) {
      stats_.num_device_free++;
      pages.mark_unmapped(run);
    }
    notify(SegmentEvent::kUnmap, block->address, block->size, region->arena->stream);
    notify_unmapped_run(region, run, span, true);
    insert_free(block);
  }
  return unmapped;
}

std::size_t Pool::drain_all(bool rethrow) {
  std::size_t unmapped = 0;
  while (reap_waiting(&unmapped, rethrow)) {
  }
  return unmapped;
}

bool Pool::reap_waiting(std::size_t* unmapped, bool rethrow) {
  if (draining_.empty()) return false;
  const std::size_t before = draining_.size();
  const std::size_t bytes = reap_drained(/*wait_oldest=*/true, rethrow);
  if (unmapped) *unmapped += bytes;
  return draining_.size() < before;
}

std::size_t Pool::lendable_bytes(const Region* region) const {
  std::size_t bytes = 0;
  for (const Draining& d : draining_)
    if (!d.lent && d.block->region == region) bytes += d.block->size;
  return bytes;
}

std::size_t Pool::map_from_draining(Region* region, PageRun run, std::size_t unit) {
  PageMap& pages = region->pages;
  const std::size_t bytes = pages.bytes_of(run);
  std::size_t mapped = 0;
  // By index: splitting a draining block appends to the list.
  for (std::size_t i = 0; i < draining_.size() && mapped < bytes; ++i) {
    Block* source = draining_[i].block;
    if (draining_[i].lent || source->region != region) continue;
    if (pages.unit_bytes(pages.touched(source->address, source->size).first) != unit) continue;
    const std::size_t take = std::min(source->size, bytes - mapped);  // whole units: both are
    const std::uintptr_t address = pages.address_of(run.first) + mapped;
    if (!upstream_->map_from(address, source->address, take, unit)) break;  // fresh memory instead
    const std::size_t page = pages.page();
    const PageRun now{run.first + mapped / page, run.first + (mapped + take) / page};
    if (parks_lent_units()) lend_aliases(region, pages.touched(source->address, take), now, unit / page);
    if (take < source->size) {  // the rest drains on, behind the same mark
      Block* rest = split_off(source, take);
      rest->state = BlockInfo::kDraining;
      draining_.push_back(Draining{rest, draining_[i].seq, false});
    }
    draining_[i].lent = true;
    draining_bytes_ -= take;
    region->lent += take;
    stats_.num_device_alloc++;
    pages.mark_mapped(now, unit > page);
    notify(SegmentEvent::kMap, address, take, region->arena->stream);
    notify_mapped_run(region, now);
    mapped += take;
  }
  return mapped;
}

}  // namespace gpumem
