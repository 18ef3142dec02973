// Pool's allocation and free paths: construction and teardown, allocate / free / record_stream and the
// pending events of cross-stream frees, arenas and their regions, split and merge. Where a block goes
// in its free block and mapping its pages are in pool_map.cpp. Releasing memory is in
// pool_release.cpp, the read-only views in pool_introspection.cpp (pool.hpp lists every file).
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <limits>

#include "format.hpp"
#include "pool.hpp"
#include "pool_debug.hpp"

namespace gpumem {

Pool::Pool(std::shared_ptr<Upstream> upstream, PoolOptions options)
    : upstream_(std::move(upstream)), options_(options) {
  if (!upstream_) throw InvalidArgument("Pool needs an upstream");
  own_budget_ = !options_.budget;
  budget_ = own_budget_ ? std::make_shared<Budget>() : options_.budget;
  page_size_ = upstream_->page_size();
  if (page_size_ == 0 || page_size_ % kAlignment != 0)
    throw InvalidArgument("upstream page size must be a positive multiple of 512");
  // Small arenas map the upstream's own granularity (2 MiB on CUDA), large arenas larger pages.
  small_page_ = page_size_;
  large_page_ = options_.large_page_bytes ? options_.large_page_bytes : page_size_;
  if (large_page_ % page_size_ != 0)
    throw InvalidArgument("page size " + format_bytes(large_page_) + " is not a multiple of the device's " +
                          format_bytes(page_size_) + " granularity");
  for (const auto& [name, slack] : {std::pair{"release_slack", options_.release_slack},
                                    std::pair{"stitch_slack", options_.stitch_slack},
                                    std::pair{"early_ends_by_page", options_.early_ends_by_page}})
    if (!(slack >= 0 && slack <= 1))  // NaN refused too
      throw InvalidArgument(std::string(name) + " must be in [0, 1], got " + std::to_string(slack));
  if (options_.cap_bytes && options_.cap_bytes < page_size_)
    throw InvalidArgument("cap of " + format_bytes(options_.cap_bytes) +
                          " is below one page (" + format_bytes(page_size_) + ")");
}

Pool::~Pool() {
  // Give everything back, live or not: whoever destroys the pool is done with its memory. A
  // destructor must not throw: driver errors here are ignored, the process is tearing the pool down.
  budget_->add(-stats_.reserved_bytes[kAggregate].current);
  for (auto& pending : pending_) {
    try {
      upstream_->destroy_event(pending.event);
    } catch (...) {
    }
  }
  for (auto& arena : arenas_) {  // draining pages are still mapped: unmapped below with the rest
    for (const Mark& mark : arena->marks) {
      try {
        upstream_->destroy_event(mark.event);
      } catch (...) {
      }
    }
  }
  for (auto& arena : arenas_) {
    try {
      if (!arena->regions.empty()) upstream_->synchronize(arena->stream);
    } catch (...) {
    }
    for (auto& region : arena->regions) {
      try {
        // Spans go before their memory (NCCL deregisters what it registered): see SegmentEvent.
        if (region->paged) {
          const PageMap& pages = region->pages;
          for (PageRun run = pages.next_mapped_run(0, pages.mapped_limit()); !run.empty();
               run = pages.next_mapped_run(run.end, pages.mapped_limit())) {
            notify(SegmentEvent::kSpanRemoved, pages.address_of(run.first), pages.bytes_of(run), arena->stream);
            for (PageRun units = pages.next_uniform_run(run.first, run.end); !units.empty();  // whole units
                 units = pages.next_uniform_run(units.end, run.end))
              upstream_->unmap(pages.address_of(units.first), pages.bytes_of(units), pages.unit_bytes(units.first));
          }
          for (const auto& [position, alias] : region->aliases)  // parked: mapped, owned elsewhere
            if (!alias.draining)
              upstream_->unmap(pages.address_of(position), alias.pages * pages.page(), alias.pages * pages.page());
          upstream_->release_address_range(region->base, region->size);
        } else {
          notify(SegmentEvent::kSpanRemoved, region->base, region->size, arena->stream);
          upstream_->free_segment(region->base, region->size);
        }
      } catch (...) {
      }
      for (Block* b = region->first; b;) {
        Block* next = b->next;
        delete b;
        b = next;
      }
    }
  }
  for (Block* b : spare_blocks_) delete b;
}

// ---- small helpers -------------------------------------------------------------------------------

template <typename F>
void Pool::update(StatArray& stat, StatType type, F&& op) {
  op(stat[kAggregate]);
  op(stat[type]);
}

Pool::Block* Pool::new_block() {
  if (spare_blocks_.empty()) return new Block();
  Block* b = spare_blocks_.back();
  spare_blocks_.pop_back();
  return b;
}

void Pool::delete_block(Block* block) {
  *block = Block();
  spare_blocks_.push_back(block);
}

Pool::Arena& Pool::find_arena(StreamId stream, bool small) {
  Arena*& last = last_arena_[small];
  for (auto& a : arenas_)
    if (a->stream == stream && a->small == small) return *(last = a.get());
  arenas_.push_back(std::make_unique<Arena>());
  arenas_.back()->stream = stream;
  arenas_.back()->small = small;
  return *(last = arenas_.back().get());
}

void Pool::add_reserved(Region* region, std::int64_t bytes) {
  StatType type = pool_of(region);
  bool was_empty = region->reserved == 0;
  region->reserved += bytes;
  budget_->add(bytes);
  if (bytes > 0) {
    update(stats_.reserved_bytes, type, [&](Stat& s) { s.increase(bytes); });
    if (was_empty) update(stats_.segment, type, [](Stat& s) { s.increase(1); });
  } else if (bytes < 0) {
    update(stats_.reserved_bytes, type, [&](Stat& s) { s.decrease(-bytes); });
    if (region->reserved == 0) update(stats_.segment, type, [](Stat& s) { s.decrease(1); });
  }
}

// ---- allocation ----------------------------------------------------------------------------------

std::uintptr_t Pool::allocate(std::size_t bytes, StreamId stream, bool count_oom) {
  if (bytes == 0) return 0;  // PyTorch asks for zero bytes for empty tensors: null, freed as a no-op
  if (bytes > kMaxRequest)
    throw InvalidArgument("gpumem: cannot allocate " + std::to_string(bytes) +
                          " bytes: that is more than any device has (limit " +
                          format_bytes(kMaxRequest) + "); is the size negative or uninitialised?");
  const std::size_t rounded = round_up(bytes, kAlignment);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    GPUMEM_VALIDATE_ON_RETURN();
    if (std::uintptr_t p = try_allocate(rounded, bytes, stream)) return p;
    // First fallback: everything cached goes back to the device, then try again. Nothing else can
    // serve this request: wait for the pages still draining, so that they are free blocks again,
    // merged with their neighbours, when the retry picks a block (a block picked beside a draining
    // one may need more pages than the same space merged).
    stats_.num_alloc_retries++;
    wait_pending_frees();
    release_cached(std::numeric_limits<std::size_t>::max());
    drain_all();
    if (device_room_) learn_device_room();  // the device may have more room by now: asked again
    if (std::uintptr_t p = try_allocate(rounded, bytes, stream, /*last_try=*/true)) return p;
  }
  // Second fallback: the callbacks (gc.collect() from Python) may free blocks; they re-enter free(),
  // so they run without the lock.
  std::vector<OomCallback> callbacks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [id, cb] : oom_callbacks_) callbacks.push_back(cb);
  }
  if (!callbacks.empty()) {
    for (auto& cb : callbacks) cb();
    std::lock_guard<std::mutex> lock(mutex_);
    GPUMEM_VALIDATE_ON_RETURN();
    wait_pending_frees();  // blocks the callbacks freed with record_stream()
    release_cached(std::numeric_limits<std::size_t>::max());
    drain_all();
    if (std::uintptr_t p = try_allocate(rounded, bytes, stream, /*last_try=*/true)) return p;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  GPUMEM_VALIDATE_ON_RETURN();
  if (count_oom) stats_.num_ooms++;
  throw OutOfMemoryError(oom_message(bytes, stream), bytes,
                         stats_.allocated_bytes[kAggregate].current,
                         stats_.reserved_bytes[kAggregate].current, options_.cap_bytes,
                         largest_free_block_locked());
}

std::uintptr_t Pool::allocate_cached(std::size_t bytes, StreamId stream) {
  if (bytes == 0 || bytes > kMaxRequest) return 0;
  std::lock_guard<std::mutex> lock(mutex_);
  GPUMEM_VALIDATE_ON_RETURN();
  growth_allowed_ = false;
  struct Restore {
    bool& flag;
    ~Restore() { flag = true; }
  } restore{growth_allowed_};
  return try_allocate(round_up(bytes, kAlignment), bytes, stream);
}

// `last_try`: allocate()'s tries after everything cached went back, where a slot-sized block of a small
// arena may also go off its slot boundary (take_mapped_slot_off_boundary) rather than fail.
std::uintptr_t Pool::try_allocate(std::size_t rounded, std::size_t requested, StreamId stream,
                                  bool last_try) {
  if (!pending_.empty()) recycle_completed();  // what other streams finished with, before looking
  if (rounded > effective_cap_locked()) return 0;
  Arena& arena = arena_for(stream, rounded <= kSmallLimit);
  auto commit = [&](Block* block) {
    block->requested = requested;
    block->last_requested = requested;
    return commit_allocation(block, /*release_and_retry=*/false) ? block->address : 0;
  };
  Block* block = take_free_block(arena, rounded);
  if (!block) return 0;
  if (std::uintptr_t p = commit(place(arena, block, rounded))) return p;
  if (!last_try || !(block = take_mapped_slot_off_boundary(arena, rounded))) return 0;
  return commit(block);
}

// Maps the pages of a block just taken out of the free set (state allocated, requested set, split to
// its size) and accounts it as allocated. `release_and_retry`: when the pages cannot be mapped,
// release the cached pages of the pool (none of this block's: it is out of the free set) and try once
// more; allocate() instead retries from the start, where another block may fit. On failure (false,
// or a driver error other than OOM, which is rethrown) the block goes back to the free set, merged
// with its free neighbours as before.
bool Pool::commit_allocation(Block* block, bool release_and_retry) {
  // The high-water release policy counts this block as live while it maps its pages.
  const std::size_t previous_live_high_water = live_high_water_;
  live_high_water_ = std::max<std::size_t>(
      live_high_water_, stats_.active_bytes[kAggregate].current + block->size);
  auto give_back = [&] {
    live_high_water_ = previous_live_high_water;
    block->state = BlockInfo::kFree;
    block->requested = 0;
    // Counted as freed now: pages it had mapped before failing may hold memory lent from a draining
    // block (map_from_draining) or stitched from a free one, which that block's stream may still be
    // using; freed at its old count, they went back to the device before that stream was past them
    // once their other mapping had gone (found by the fuzzer, 2026-12-06).
    block->freed_seq = ++free_seq_;
    insert_free(block);
  };
  bool mapped;
  try {
    const Region* region = block->region;
    mapped = !region->paged || region->pages.below_mapped_limit(block->address, block->size) ||
             ensure_mapped(block);
    if (!mapped && release_and_retry) {
      stats_.num_alloc_retries++;
      release_cached(std::numeric_limits<std::size_t>::max());
      mapped = ensure_mapped(block);
    }
  } catch (...) {
    give_back();  // a driver error other than OOM: the pool stays consistent, the caller hears of it
    throw;
  }
  if (!mapped) {
    give_back();
    return false;
  }
  StatType type = pool_of(block->region);
  const std::int64_t size = static_cast<std::int64_t>(block->size);
  const auto requested = static_cast<std::int64_t>(block->requested);
  update(stats_.allocation, type, [](Stat& s) { s.increase(1); });
  update(stats_.active, type, [](Stat& s) { s.increase(1); });
  update(stats_.allocated_bytes, type, [&](Stat& s) { s.increase(size); });
  update(stats_.active_bytes, type, [&](Stat& s) { s.increase(size); });
  update(stats_.requested_bytes, type, [&](Stat& s) { s.increase(requested); });
  live_.put(block->address, block);
  allocated_since_high_water_rose_ += block->size;
  if (static_cast<double>(live_high_water_) > static_cast<double>(settled_high_water_) * (1.0 + kSettledRise)) {
    settled_high_water_ = live_high_water_;
    allocated_since_high_water_rose_ = 0;
  }
  return true;
}

// Best fit among the arena's free blocks, or on a paged upstream a larger one that needs fewer pages
// mapped (fewest_unmapped_fit) or, in a small arena, opens fewer empty pages and slots (packed_fit);
// on a segments upstream, a new segment when none fits.
Pool::Block* Pool::take_free_block(Arena& arena, std::size_t rounded) {
  Block* block = arena.free_blocks.best_fit(rounded);
  if (!block) {
    Region* region = nullptr;
    if (upstream_->kind() == UpstreamKind::kPages) {
      bool has_region = !arena.regions.empty();
      if (has_region) return nullptr;  // the arena's address range is exhausted
      region = add_paged_region(arena);
    } else {
      std::size_t bytes = arena.small ? kSmallSegment
                          : rounded < kMidLimit ? kMidSegment
                                                : round_up(rounded, page_size_);
      region = add_segment(arena, bytes);
    }
    if (!region) return nullptr;
    block = arena.free_blocks.best_fit(rounded);
    if (!block) return nullptr;
  }
  block = packs(arena) ? packed_fit(arena, block, rounded) : fewest_unmapped_fit(arena, block, rounded);
  arena.free_blocks.erase(block);
  return block;
}

Pool::Region* Pool::add_segment(Arena& arena, std::size_t bytes) {
  bytes = round_up(bytes, page_size_);
  if (!make_room(bytes)) return nullptr;
  std::uintptr_t base = upstream_->allocate_segment(bytes);
  if (!base) return nullptr;
  stats_.num_device_alloc++;
  Region* r = add_region(arena, base, bytes, 0);
  add_reserved(r, static_cast<std::int64_t>(bytes));
  notify(SegmentEvent::kSegmentAlloc, base, bytes, arena.stream);
  notify(SegmentEvent::kSpanAdded, base, bytes, arena.stream);
  return r;
}

Pool::Region* Pool::add_paged_region(Arena& arena) {
  // Four times the device's memory in address space (address space costs nothing): a region never
  // needs a second range, and a large request still finds a contiguous range when free pages from
  // between live blocks are unmapped and mapped again elsewhere.
  // Pages of the device's granularity; a large arena maps them in groups of large_page_ (one
  // physical allocation each) while whole groups fit, single pages near the cap (ensure_mapped).
  const std::size_t unit = arena.small ? small_page_ : large_page_;
  std::size_t bytes = round_up(4 * upstream_->device_total_bytes(), unit);
  std::uintptr_t base = upstream_->reserve_address_range(bytes);
  if (!base) return nullptr;
  Region* region = add_region(arena, base, bytes, page_size_);
  region->pages = PageMap(base, bytes, page_size_, unit / page_size_);
  return region;
}

// A new region of the arena, covered by one free block. `page` 0: a segment, wholly backed.
Pool::Region* Pool::add_region(Arena& arena, std::uintptr_t base, std::size_t bytes, std::size_t page) {
  auto region = std::make_unique<Region>();
  region->base = base;
  region->size = bytes;
  region->arena = &arena;
  region->paged = page != 0;
  if (page) region->pages = PageMap(base, bytes, page);
  Block* b = new_block();
  b->address = base;
  b->size = bytes;
  b->region = region.get();
  region->first = b;
  Region* r = region.get();
  arena.regions.push_back(std::move(region));
  insert_free(b);
  return r;
}

void Pool::split(Block* block, std::size_t size) {
  if (block->size - size < kAlignment) return;
  // Nothing to merge: `block` is taken, and the next block was not free (free neighbours are merged).
  block->region->arena->free_blocks.insert(split_off(block, size));
}

Pool::Block* Pool::split_off(Block* block, std::size_t size) {
  Block* rest = new_block();  // free, in no index
  rest->address = block->address + size;
  rest->size = block->size - size;
  rest->region = block->region;
  rest->freed_seq = block->freed_seq;
  rest->prev = block;
  rest->next = block->next;
  if (block->next) block->next->prev = rest;
  block->next = rest;
  block->size = size;
  return rest;
}

// Puts a free block into its arena's set, merged with free neighbours first.
void Pool::insert_free(Block* block) {
  auto& index = block->region->arena->free_blocks;
  if (Block* p = block->prev; p && p->state == BlockInfo::kFree) {
    index.erase(p);
    p->size += block->size;
    p->next = block->next;
    if (block->next) block->next->prev = p;
    // The merged block shows the just-freed block's last request, as PyTorch's merge does.
    if (block->last_requested) p->last_requested = block->last_requested;
    p->freed_seq = std::max(p->freed_seq, block->freed_seq);
    delete_block(block);
    block = p;
  }
  if (Block* n = block->next; n && n->state == BlockInfo::kFree) {
    index.erase(n);
    block->size += n->size;
    block->next = n->next;
    if (n->next) n->next->prev = block;
    block->freed_seq = std::max(block->freed_seq, n->freed_seq);
    delete_block(n);
  }
  index.insert(block);
}

// ---- free ----------------------------------------------------------------------------------------

Pool::Block* Pool::find_live(std::uintptr_t address, const char* what) const {
  Block* const* found = live_.find(address);
  if (!found || (*found)->state != BlockInfo::kAllocated) {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "gpumem: %s of pointer 0x%" PRIxPTR
                  " that this pool (device %d) did not allocate or has already freed; nothing was "
                  "changed",
                  what, address, options_.device);
    throw InvalidArgument(buf);
  }
  return *found;
}

void Pool::free(std::uintptr_t address) {
  if (address == 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  GPUMEM_VALIDATE_ON_RETURN();
  if (!free_locked(address)) find_live(address, "free");  // throws the message for a foreign or double free
}

bool Pool::try_free(std::uintptr_t address, std::size_t* freed_bytes) {
  if (address == 0) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  GPUMEM_VALIDATE_ON_RETURN();
  return free_locked(address, freed_bytes);
}

// Frees the live allocated block at `address`; false, changing nothing, when there is none.
bool Pool::free_locked(std::uintptr_t address, std::size_t* freed_bytes) {
  Block* block = nullptr;
  if (!live_.take(address, &block)) return false;
  if (block->state != BlockInfo::kAllocated) {
    live_.put(address, block);  // a pending block: put it back untouched
    return false;
  }
  if (freed_bytes) *freed_bytes = block->size;
  StatType type = pool_of(block->region);
  const std::int64_t size = static_cast<std::int64_t>(block->size);
  update(stats_.allocation, type, [](Stat& s) { s.decrease(1); });
  update(stats_.allocated_bytes, type, [&](Stat& s) { s.decrease(size); });
  update(stats_.requested_bytes, type,
         [&](Stat& s) { s.decrease(static_cast<std::int64_t>(block->requested)); });
  block->requested = 0;
  block->freed_seq = ++free_seq_;  // its last use on its own stream is queued by now
  if (block->extra_streams.empty()) {
    return_to_arena(block);
    return true;
  }
  // Used on other streams too: reuse only once their work queued so far has completed.
  std::vector<EventId> events;
  try {
    for (StreamId s : block->extra_streams) events.push_back(upstream_->record_event(s));
  } catch (...) {
    // Without events, wait for those streams here rather than risk early reuse.
    try {
      for (EventId e : events) upstream_->destroy_event(e);
      for (StreamId s : block->extra_streams) upstream_->synchronize(s);
    } catch (...) {
      // The driver is failing; the block is still returned so the pool's accounting stays exact.
    }
    block->extra_streams.clear();
    return_to_arena(block);
    return true;
  }
  live_.put(address, block);  // stays findable while its events are pending
  block->state = BlockInfo::kPending;
  for (EventId e : events) pending_.push_back(PendingFree{block, e});
  block->pending_events = static_cast<std::uint32_t>(events.size());
  block->extra_streams.clear();
  return true;
}

void Pool::return_to_arena(Block* block) {
  StatType type = pool_of(block->region);
  const std::int64_t size = static_cast<std::int64_t>(block->size);
  update(stats_.active, type, [](Stat& s) { s.decrease(1); });
  update(stats_.active_bytes, type, [&](Stat& s) { s.decrease(size); });
  if (block->state == BlockInfo::kPending) live_.erase(block->address);
  block->state = BlockInfo::kFree;
  insert_free(block);
}

void Pool::record_stream(std::uintptr_t address, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  GPUMEM_VALIDATE_ON_RETURN();
  Block* block = find_live(address, "record_stream");
  if (stream == block->region->arena->stream) return;  // its own stream orders itself
  auto& s = block->extra_streams;
  if (std::find(s.begin(), s.end(), stream) == s.end()) s.push_back(stream);
}

void Pool::process_events() {
  std::lock_guard<std::mutex> lock(mutex_);
  GPUMEM_VALIDATE_ON_RETURN();
  recycle_completed();
  if (!draining_.empty()) reap_drained(/*wait_oldest=*/false);
}

// Before an out-of-memory retry: waits for the events of every pending free (a block freed while a
// stream of record_stream() may still use it) and gives those blocks back to their arenas, as
// PyTorch's allocator synchronises its outstanding events before it releases its cache
// (synchronize_and_free_events). Without it a request those blocks could hold failed with nothing
// live. The bridge defers such frees while a CUDA graph capture may be underway, so none of these
// events belongs to a capture.
void Pool::wait_pending_frees() {
  if (pending_.empty()) return;
  for (const PendingFree& pending : pending_) upstream_->wait_event(pending.event);
  recycle_completed();
}

void Pool::recycle_completed() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (upstream_->event_completed(it->event)) {
      upstream_->destroy_event(it->event);
      Block* b = it->block;
      it = pending_.erase(it);
      if (--b->pending_events == 0) return_to_arena(b);
    } else {
      ++it;
    }
  }
}

// ---- out-of-memory callbacks, the segment observer -----------------------------------------------

int Pool::add_oom_callback(OomCallback callback) {
  std::lock_guard<std::mutex> lock(mutex_);
  oom_callbacks_.emplace_back(next_callback_id_, std::move(callback));
  return next_callback_id_++;
}

void Pool::remove_oom_callback(int id) {
  std::lock_guard<std::mutex> lock(mutex_);
  oom_callbacks_.erase(std::remove_if(oom_callbacks_.begin(), oom_callbacks_.end(),
                                      [id](auto& e) { return e.first == id; }),
                       oom_callbacks_.end());
}

void Pool::set_segment_observer(SegmentObserver observer) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    observer_.swap(observer);
  }
  // The previous observer is destroyed here, without the lock: its destructor may need other locks
  // (a Python callable's needs the GIL).
}

}  // namespace gpumem
