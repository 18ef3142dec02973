#include "pool.hpp"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <limits>

#include "format.hpp"

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
  if (!(options_.release_slack >= 0 && options_.release_slack <= 1))
    throw InvalidArgument("release_slack must be in [0, 1], got " + std::to_string(options_.release_slack));
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
  for (auto& arena : arenas_) {
    try {
      if (!arena->regions.empty()) upstream_->synchronize(arena->stream);
    } catch (...) {
    }
    for (auto& region : arena->regions) {
      try {
        if (region->paged) {
          for (std::size_t p = 0; p < region->page_mapped.size(); ++p)
            if (region->page_mapped[p])
              upstream_->unmap(region->base + p * region->page, region->page, region->page);
          upstream_->release_address_range(region->base, region->size);
        } else {
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

std::uintptr_t Pool::allocate(std::size_t bytes, StreamId stream) {
  if (bytes == 0) return 0;  // PyTorch asks for zero bytes for empty tensors: null, freed as a no-op
  if (bytes > kMaxRequest)
    throw InvalidArgument("gpumem: cannot allocate " + std::to_string(bytes) +
                          " bytes: that is more than any device has (limit " +
                          format_bytes(kMaxRequest) + "); is the size negative or uninitialised?");
  const std::size_t rounded = round_up(bytes, kAlignment);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (std::uintptr_t p = try_allocate(rounded, bytes, stream)) return p;
    // First fallback: everything cached goes back to the device, then try again.
    stats_.num_alloc_retries++;
    release_cached(std::numeric_limits<std::size_t>::max());
    if (std::uintptr_t p = try_allocate(rounded, bytes, stream)) return p;
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
    release_cached(std::numeric_limits<std::size_t>::max());
    if (std::uintptr_t p = try_allocate(rounded, bytes, stream)) return p;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.num_ooms++;
  throw OutOfMemoryError(oom_message(bytes, stream), bytes,
                         stats_.allocated_bytes[kAggregate].current,
                         stats_.reserved_bytes[kAggregate].current, options_.cap_bytes,
                         largest_free_block_locked());
}

std::uintptr_t Pool::allocate_cached(std::size_t bytes, StreamId stream) {
  if (bytes == 0 || bytes > kMaxRequest) return 0;
  std::lock_guard<std::mutex> lock(mutex_);
  growth_allowed_ = false;
  struct Restore {
    bool& flag;
    ~Restore() { flag = true; }
  } restore{growth_allowed_};
  return try_allocate(round_up(bytes, kAlignment), bytes, stream);
}

std::uintptr_t Pool::try_allocate(std::size_t rounded, std::size_t requested, StreamId stream) {
  if (!pending_.empty()) recycle_completed();  // what other streams finished with, before looking
  if (rounded > effective_cap_locked()) return 0;
  Arena& arena = arena_for(stream, rounded <= kSmallLimit);
  Block* block = take_free_block(arena, rounded);
  if (!block) return 0;
  block->state = BlockInfo::kAllocated;  // before split, so the remainder does not merge back
  block->requested = requested;
  block->last_requested = requested;
  split(block, rounded);
  return commit_allocation(block, /*release_and_retry=*/false) ? block->address : 0;
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
    insert_free(block);
  };
  bool mapped;
  try {
    mapped = !block->region->paged || below_mapped_limit(block) || ensure_mapped(block);
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
  return true;
}

// Best fit among the arena's free blocks; on a segments upstream, a new segment when none fits.
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
  return r;
}

Pool::Region* Pool::add_paged_region(Arena& arena) {
  // Four times the device's memory in address space (address space costs nothing): a region never
  // needs a second range, and a large request still finds a contiguous range when free pages from
  // between live blocks are unmapped and mapped again elsewhere.
  const std::size_t page = arena.small ? small_page_ : large_page_;
  std::size_t bytes = round_up(4 * upstream_->device_total_bytes(), page);
  std::uintptr_t base = upstream_->reserve_address_range(bytes);
  if (!base) return nullptr;
  return add_region(arena, base, bytes, page);
}

// A new region of the arena, covered by one free block. `page` 0: a segment, wholly backed.
Pool::Region* Pool::add_region(Arena& arena, std::uintptr_t base, std::size_t bytes, std::size_t page) {
  auto region = std::make_unique<Region>();
  region->base = base;
  region->size = bytes;
  region->arena = &arena;
  region->paged = page != 0;
  region->page = page;
  if (page) region->page_mapped.assign(bytes / page, 0);
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

// Whether all the block's pages are mapped, cheaply (no division, inlined): no page below
// mapped_limit was ever given back, and the block lies below it.
inline bool Pool::below_mapped_limit(const Block* block) {
  const Region* r = block->region;
  return r->holes == 0 && block->address + block->size <= r->base + r->mapped_limit * r->page;
}

// Maps every page the (already allocated) block touches. On failure the pages mapped so far stay
// mapped and accounted as reserved; the caller returns the block to the free set.
bool Pool::ensure_mapped(Block* block) {
  if (below_mapped_limit(block)) return true;
  Region* region = block->region;
  std::size_t first = (block->address - region->base) / region->page;
  std::size_t last = (block->address + block->size - 1 - region->base) / region->page;
  std::size_t missing = 0;
  for (std::size_t p = first; p <= last; ++p) missing += !region->page_mapped[p];
  if (missing == 0) return true;
  if (!make_room(missing * region->page)) return false;
  for (std::size_t p = first; p <= last;) {
    if (region->page_mapped[p]) {
      ++p;
      continue;
    }
    std::size_t run_end = p;
    while (run_end <= last && !region->page_mapped[run_end]) ++run_end;
    std::size_t bytes = (run_end - p) * region->page;
    if (!upstream_->map(region->base + p * region->page, bytes, region->page)) return false;
    stats_.num_device_alloc++;
    std::fill(region->page_mapped.begin() + p, region->page_mapped.begin() + run_end, 1);
    const std::size_t old_limit = region->mapped_limit;
    region->holes -= std::min(run_end, old_limit) - std::min(p, old_limit);  // holes filled
    region->holes += p > old_limit ? p - old_limit : 0;                      // gap left below
    region->mapped_limit = std::max(old_limit, run_end);
    add_reserved(region, static_cast<std::int64_t>(bytes));
    notify(SegmentEvent::kMap, region->base + p * region->page, bytes, region->arena->stream);
    p = run_end;
  }
  return true;
}

// Makes room for `bytes` more reserved bytes under the cap and, with the high-water policy, under the
// live high water plus the slack (best effort). False only when the cap cannot be met.
bool Pool::make_room(std::size_t bytes) {
  if (!growth_allowed_) return false;
  std::size_t reserved = stats_.reserved_bytes[kAggregate].current;
  const auto allowed =
      static_cast<std::size_t>(static_cast<double>(live_high_water_) * (1.0 + options_.release_slack));
  if (options_.release == ReleasePolicy::kHighWater && reserved + bytes > allowed)
    release_cached(reserved + bytes - allowed);
  reserved = stats_.reserved_bytes[kAggregate].current;
  const std::size_t cap = effective_cap_locked();
  if (reserved + bytes > cap) {
    release_cached(reserved + bytes - cap);
    reserved = stats_.reserved_bytes[kAggregate].current;
  }
  if (reserved + bytes > cap) return false;
  // Pools sharing the budget hold memory too: this pool's own cache goes back first.
  if (!budget_->fits(bytes)) release_cached(budget_->excess(bytes));
  return budget_->fits(bytes);
}

void Pool::split(Block* block, std::size_t size) {
  if (block->size - size < kAlignment) return;
  Block* rest = new_block();
  rest->address = block->address + size;
  rest->size = block->size - size;
  rest->region = block->region;
  rest->prev = block;
  rest->next = block->next;
  if (block->next) block->next->prev = rest;
  block->next = rest;
  block->size = size;
  // Nothing to merge: `block` is taken, and the next block was not free (free neighbours are merged).
  block->region->arena->free_blocks.insert(rest);
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
    delete_block(block);
    block = p;
  }
  if (Block* n = block->next; n && n->state == BlockInfo::kFree) {
    index.erase(n);
    block->size += n->size;
    block->next = n->next;
    if (n->next) n->next->prev = block;
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
  if (!free_locked(address)) find_live(address, "free");  // throws the message for a foreign or double free
}

bool Pool::try_free(std::uintptr_t address) {
  if (address == 0) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  return free_locked(address);
}

// Frees the live allocated block at `address`; false, changing nothing, when there is none.
bool Pool::free_locked(std::uintptr_t address) {
  Block* block = nullptr;
  if (!live_.take(address, &block)) return false;
  if (block->state != BlockInfo::kAllocated) {
    live_.put(address, block);  // a pending block: put it back untouched
    return false;
  }
  StatType type = pool_of(block->region);
  const std::int64_t size = static_cast<std::int64_t>(block->size);
  update(stats_.allocation, type, [](Stat& s) { s.decrease(1); });
  update(stats_.allocated_bytes, type, [&](Stat& s) { s.decrease(size); });
  update(stats_.requested_bytes, type,
         [&](Stat& s) { s.decrease(static_cast<std::int64_t>(block->requested)); });
  block->requested = 0;
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
  Block* block = find_live(address, "record_stream");
  if (stream == block->region->arena->stream) return;  // its own stream orders itself
  auto& s = block->extra_streams;
  if (std::find(s.begin(), s.end(), stream) == s.end()) s.push_back(stream);
}

void Pool::process_events() {
  std::lock_guard<std::mutex> lock(mutex_);
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

// ---- releasing memory ----------------------------------------------------------------------------

// Unmaps the whole pages inside a free block, up to `target` bytes. Returns the bytes unmapped.
std::size_t Pool::release_pages_of(Block* block, std::size_t target) {
  Region* region = block->region;
  std::size_t first = (block->address - region->base + region->page - 1) / region->page;
  std::size_t end = std::min((block->address + block->size - region->base) / region->page,
                             region->mapped_limit);
  std::size_t released = 0;
  bool synced = false;
  for (std::size_t p = first; p < end && released < target;) {
    if (!region->page_mapped[p]) {
      ++p;
      continue;
    }
    std::size_t run_end = p;
    while (run_end < end && region->page_mapped[run_end] &&
           released + (run_end - p) * region->page < target)
      ++run_end;
    if (!synced) {
      // The block's last user may still be running on its stream: wait before the memory goes back.
      upstream_->synchronize(region->arena->stream);
      stats_.num_sync_all_streams++;
      synced = true;
    }
    std::size_t bytes = (run_end - p) * region->page;
    upstream_->unmap(region->base + p * region->page, bytes, region->page);  // throws: pages stay mapped, accounted
    stats_.num_device_free++;
    std::fill(region->page_mapped.begin() + p, region->page_mapped.begin() + run_end, 0);
    region->holes += run_end - p;  // released pages always lie below mapped_limit
    add_reserved(region, -static_cast<std::int64_t>(bytes));
    notify(SegmentEvent::kUnmap, region->base + p * region->page, bytes, region->arena->stream);
    released += bytes;
    p = run_end;
  }
  return released;
}

// Returns cached memory (whole free pages, whole free segments) to the device until `target` bytes
// have gone back or nothing more can. Largest free blocks go first: they give the most per call.
std::size_t Pool::release_cached(std::size_t target, bool rethrow) {
  std::size_t released = 0;
  try {
    released = release_cached_units(target);
  } catch (const UpstreamError&) {
    // The unit that failed stays reserved and accounted; allocation paths carry on with what they
    // have (and report an OOM if that is not enough), trim() reports the driver's error.
    if (rethrow) throw;
  }
  return released;
}

std::size_t Pool::release_cached_units(std::size_t target) {
  std::size_t released = 0;
  for (auto& arena_ptr : arenas_) {
    Arena& arena = *arena_ptr;
    if (released >= target) break;
    if (upstream_->kind() == UpstreamKind::kPages) {
      std::vector<Block*> candidates;  // only the large blocks can hold a whole page
      arena.free_blocks.for_each_large_largest_first([&](Block* b) {
        if (b->size >= b->region->page) candidates.push_back(b);
      });
      for (Block* b : candidates) {
        if (released >= target) break;
        released += release_pages_of(b, target - released);
      }
      continue;
    }
    bool synced = false;
    for (auto it = arena.regions.begin(); it != arena.regions.end() && released < target;) {
      Region* region = it->get();
      Block* b = region->first;
      if (b->state != BlockInfo::kFree || b->size != region->size) {
        ++it;
        continue;
      }
      if (!synced) {
        upstream_->synchronize(arena.stream);
        stats_.num_sync_all_streams++;
        synced = true;
      }
      upstream_->free_segment(region->base, region->size);  // throws: segment stays, accounted
      stats_.num_device_free++;
      arena.free_blocks.erase(b);
      delete_block(b);
      add_reserved(region, -static_cast<std::int64_t>(region->size));
      notify(SegmentEvent::kSegmentFree, region->base, region->size, arena.stream);
      released += region->size;
      it = arena.regions.erase(it);
    }
  }
  return released;
}

std::size_t Pool::trim() {
  std::lock_guard<std::mutex> lock(mutex_);
  return release_cached(std::numeric_limits<std::size_t>::max(), /*rethrow=*/true);
}

// ---- cap, stats, introspection -------------------------------------------------------------------

void Pool::set_cap(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t active = stats_.active_bytes[kAggregate].current;
  if (bytes != 0 && bytes < active)
    throw InvalidArgument("gpumem: cannot cap device " + std::to_string(options_.device) + " at " +
                          format_bytes(bytes) + ": live tensors already hold " +
                          format_bytes(active) + "; nothing was changed. Free them first or "
                          "choose a cap of at least that.");
  if (bytes != 0 && bytes < page_size_)
    throw InvalidArgument("gpumem: a cap of " + format_bytes(bytes) + " is below one page (" +
                          format_bytes(page_size_) + ")");
  options_.cap_bytes = bytes;
  const std::size_t reserved = stats_.reserved_bytes[kAggregate].current;
  if (reserved > effective_cap_locked()) release_cached(reserved - effective_cap_locked());
}

std::size_t Pool::cap() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return options_.cap_bytes;
}

void Pool::set_limit(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  budget_->set_limit(bytes);
  // Cached pages go back down to the limit where they can; pages under live blocks stay.
  if (const std::size_t excess = budget_->excess(0)) release_cached(excess);
}

std::size_t Pool::limit() const { return budget_->limit(); }

std::size_t Pool::effective_cap() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return effective_cap_locked();
}

Pool::ExportedBlock Pool::export_block(std::uintptr_t address) {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* block = find_live(address, "export");
  Region* r = block->region;
  if (!r->paged)
    throw UpstreamError("gpumem: only memory of a paged upstream (CUDA virtual memory) can be exported");
  const std::size_t first = (block->address - r->base) / r->page;
  const std::size_t last = (block->address + block->size - 1 - r->base) / r->page;
  ExportedBlock out{r->base + first * r->page, r->page, {}};
  out.fds = upstream_->export_pages(out.first_page, last - first + 1, r->page);
  return out;
}

void Pool::count_oom() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.num_ooms++;
}

std::size_t Pool::allocated_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<std::size_t>(stats_.allocated_bytes[kAggregate].current);
}

std::size_t Pool::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<std::size_t>(stats_.reserved_bytes[kAggregate].current);
}

void Pool::set_segment_observer(SegmentObserver observer) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    observer_.swap(observer);
  }
  // The previous observer is destroyed here, without the lock: its destructor may need other locks
  // (a Python callable's needs the GIL).
}

DeviceStats Pool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  // Inactive split blocks are derived, not tracked per operation: free blocks that share a region
  // with other blocks, counted by the memory that backs them.
  std::int64_t count[kNumStatTypes] = {0, 0, 0}, bytes[kNumStatTypes] = {0, 0, 0};
  for (auto& arena : arenas_) {
    StatType type = arena->small ? kSmallPool : kLargePool;
    arena->free_blocks.for_each([&](const Block* b) {
      if (b->size == b->region->size) return;  // a whole region: releasable, not split
      const std::size_t backed = backed_bytes(b);
      if (backed == 0) return;
      count[type]++;
      bytes[type] += static_cast<std::int64_t>(backed);
    });
  }
  count[kAggregate] = count[kSmallPool] + count[kLargePool];
  bytes[kAggregate] = bytes[kSmallPool] + bytes[kLargePool];
  for (int t = 0; t < kNumStatTypes; ++t) {
    Stat& c = stats_.inactive_split[t];
    Stat& b = stats_.inactive_split_bytes[t];
    c.current = count[t];
    c.peak = std::max(c.peak, c.current);
    b.current = bytes[t];
    b.peak = std::max(b.peak, b.current);
  }
  return stats_;
}

void Pool::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.reset_peak();
}

void Pool::reset_accumulated_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.reset_accumulated();
}

std::size_t Pool::largest_free_block() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return largest_free_block_locked();
}

std::size_t Pool::largest_free_block_locked() const {
  std::size_t best = 0;
  for (auto& arena : arenas_)
    arena->free_blocks.for_each([&](const Block* b) {
      if (b->size > best) best = std::max(best, longest_backed_run(b));
    });
  return best;
}

std::size_t Pool::backed_bytes(const Block* b) const {
  const Region* r = b->region;
  if (!r->paged) return b->size;
  std::size_t backed = 0;
  const std::size_t first = (b->address - r->base) / r->page;
  const std::size_t end = std::min((b->address + b->size - 1 - r->base) / r->page + 1, r->mapped_limit);
  for (std::size_t p = first; p < end; ++p) {
    if (!r->page_mapped[p]) continue;
    const std::uintptr_t lo = std::max<std::uintptr_t>(b->address, r->base + p * r->page);
    const std::uintptr_t hi = std::min<std::uintptr_t>(b->address + b->size, r->base + (p + 1) * r->page);
    backed += hi - lo;
  }
  return backed;
}

std::size_t Pool::longest_backed_run(const Block* b) const {
  const Region* r = b->region;
  if (!r->paged) return b->size;
  std::size_t best = 0;
  std::uintptr_t run_start = b->address;
  const std::uintptr_t end =
      std::min<std::uintptr_t>(b->address + b->size, r->base + r->mapped_limit * r->page);
  for (std::uintptr_t a = b->address; a < end;) {
    const std::size_t p = (a - r->base) / r->page;
    const std::uintptr_t page_end = std::min<std::uintptr_t>(end, r->base + (p + 1) * r->page);
    if (!r->page_mapped[p]) run_start = page_end;
    else best = std::max<std::size_t>(best, page_end - run_start);
    a = page_end;
  }
  return best;
}

std::size_t Pool::allocation_size(std::uintptr_t address) const {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* const* found = live_.find(address);
  return !found || (*found)->state != BlockInfo::kAllocated ? 0 : (*found)->size;
}

bool Pool::live_block(std::uintptr_t address, BlockInfo* out) const {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* const* found = live_.find(address);
  if (!found || (*found)->state != BlockInfo::kAllocated) return false;
  const Block* b = *found;
  if (out) *out = BlockInfo{b->address, b->size, b->requested, b->state, b->last_requested};
  return true;
}

// Segments as PyTorch reports them: a region of segments is one segment; a paged region is one
// segment per run of mapped pages (as PyTorch does for expandable segments), its blocks clipped to
// the run, so the segments add up to the reserved bytes and unmapped address space is not drawn.
std::vector<RegionInfo> Pool::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<RegionInfo> out;
  for (auto& arena : arenas_) {
    for (auto& region : arena->regions) {
      if (region->reserved == 0) continue;
      auto info_of = [&](const Block* b) {
        return BlockInfo{b->address, b->size, b->requested, b->state, b->last_requested};
      };
      if (!region->paged) {
        RegionInfo info{region->base, region->size, region->reserved, arena->stream, arena->small, {}};
        for (Block* b = region->first; b; b = b->next) info.blocks.push_back(info_of(b));
        out.push_back(std::move(info));
        continue;
      }
      const Block* b = region->first;
      const std::size_t pages = std::min(region->mapped_limit, region->page_mapped.size());
      for (std::size_t p = 0; p < pages;) {
        if (!region->page_mapped[p]) {
          ++p;
          continue;
        }
        std::size_t end_page = p;
        while (end_page < pages && region->page_mapped[end_page]) ++end_page;
        const std::uintptr_t lo = region->base + p * region->page;
        const std::uintptr_t hi = region->base + end_page * region->page;
        RegionInfo info{lo, hi - lo, hi - lo, arena->stream, arena->small, {}};
        while (b && b->address + b->size <= lo) b = b->next;
        for (const Block* c = b; c && c->address < hi; c = c->next) {
          BlockInfo block = info_of(c);
          const std::uintptr_t from = std::max<std::uintptr_t>(c->address, lo);
          const std::uintptr_t to = std::min<std::uintptr_t>(c->address + c->size, hi);
          block.address = from;
          block.size = to - from;
          if (from != c->address) block.last_requested = 0;  // the tail of a free block
          info.blocks.push_back(block);
        }
        out.push_back(std::move(info));
        p = end_page;
      }
    }
  }
  return out;
}

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

std::string Pool::oom_message(std::size_t requested, StreamId stream, std::uintptr_t at) const {
  // Plain string building: iostreams crashed when a second libstdc++ was loaded in the process.
  char stream_hex[32], at_hex[48] = "";
  std::snprintf(stream_hex, sizeof stream_hex, "0x%" PRIxPTR, stream);
  if (at) std::snprintf(at_hex, sizeof at_hex, " at 0x%" PRIxPTR, at);
  const std::string cap = options_.cap_bytes
                              ? format_bytes(options_.cap_bytes)
                              : "none (device total " + format_bytes(upstream_->device_total_bytes()) + ")";
  const std::size_t limit_bytes = budget_->limit();
  const std::string limit = limit_bytes == kNoLimit
                                ? ""
                                : ", limit " + format_bytes(limit_bytes) + (own_budget_ ? "" : " (all pools of the device: " + format_bytes(budget_->reserved()) + " reserved)");
  return "gpumem: out of memory on device " + std::to_string(options_.device) + ": tried to allocate " +
         format_bytes(requested) + at_hex + " (stream " + stream_hex + "); " +
         format_bytes(stats_.allocated_bytes[kAggregate].current) + " held by live tensors, " +
         format_bytes(stats_.reserved_bytes[kAggregate].current) + " reserved by gpumem, cap " + cap +
         limit + ", device free " + format_bytes(upstream_->device_free_bytes()) + ", largest free block " +
         format_bytes(largest_free_block_locked()) +
         ". Free tensors you no longer need, use a smaller batch (gpumem.find_batch_size), or raise "
         "the cap (GPUMEM_CONF=cap:...).";
}

// ---- invariant checker ---------------------------------------------------------------------------

void Pool::validate() const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto fail = [](const std::string& what) { throw InvariantViolation("gpumem invariant: " + what); };
  std::int64_t allocated = 0, requested = 0, active = 0, reserved = 0, allocations = 0,
               actives = 0, segments = 0;
  std::size_t live_seen = 0, free_seen = 0;
  for (auto& arena : arenas_) {
    std::size_t free_in_arena = 0;
    for (auto& region : arena->regions) {
      if (region->arena != arena.get()) fail("region points to another arena");
      std::uintptr_t expect = region->base;
      std::size_t region_reserved = 0;
      std::size_t holes = 0;
      if (region->paged) {
        const auto& pages = region->page_mapped;
        const std::size_t limit = std::min(region->mapped_limit, pages.size());
        for (std::size_t p = 0; p < limit; ++p) {
          region_reserved += pages[p] ? region->page : 0;
          holes += !pages[p];
        }
        if (std::find(pages.begin() + limit, pages.end(), 1) != pages.end())
          fail("mapped page above mapped_limit");
        if (holes != region->holes) fail("hole count disagrees with the page map");
      } else {
        region_reserved = region->size;
      }
      if (region_reserved != region->reserved) fail("region reserved bytes disagree with its pages");

      reserved += static_cast<std::int64_t>(region->reserved);
      segments += region->reserved > 0;
      const Block* prev = nullptr;
      for (Block* b = region->first; b; b = b->next) {
        if (b->region != region.get()) fail("block points to another region");
        if (b->prev != prev) fail("broken prev link");
        if (b->address != expect) fail("blocks overlap or leave a gap");
        if (b->size == 0 || b->size % kAlignment || b->address % kAlignment) fail("misaligned block");
        expect += b->size;
        if (b->state == BlockInfo::kFree) {
          free_seen++;
          free_in_arena++;
          if (!arena->free_blocks.contains(b)) fail("free block missing from its arena's free index");
          if (prev && prev->state == BlockInfo::kFree) fail("two adjacent free blocks not merged");
          if (b->requested || !b->extra_streams.empty() || b->pending_events)
            fail("free block carries allocation state");
        } else {
          live_seen++;
          Block* const* found = live_.find(b->address);
          if (!found || *found != b) fail("live block missing from the address map");
          active += static_cast<std::int64_t>(b->size);
          actives++;
          if (b->state == BlockInfo::kAllocated) {
            allocated += static_cast<std::int64_t>(b->size);
            requested += static_cast<std::int64_t>(b->requested);
            allocations++;
            if (b->requested == 0 || b->requested > b->size) fail("requested size out of range");
            if (b->pending_events) fail("allocated block has pending events");
          } else if (b->pending_events == 0) {
            fail("pending block without events");
          }
          if (region->paged) {
            std::size_t first = (b->address - region->base) / region->page;
            std::size_t last = (b->address + b->size - 1 - region->base) / region->page;
            for (std::size_t p = first; p <= last; ++p)
              if (!region->page_mapped[p]) fail("live block on an unmapped page");
          }
        }
        prev = b;
      }
      if (expect != region->base + region->size) fail("blocks do not cover their region");
    }
    if (free_in_arena != arena->free_blocks.size()) fail("free index holds blocks not in any region");
    if (!arena->free_blocks.consistent()) fail("a free bin's or size class's list or bitmap is inconsistent");
  }
  if (live_seen != live_.size()) fail("address map holds blocks not in any region");
  std::size_t pending_blocks = 0;
  for (auto& p : pending_) pending_blocks += p.block->state == BlockInfo::kPending;
  if (pending_blocks < static_cast<std::size_t>(actives - allocations)) fail("pending block lost");
  const auto& s = stats_;
  auto check = [&](const Stat& stat, std::int64_t truth, const char* name) {
    if (stat.current != truth)
      fail(std::string(name) + " is " + std::to_string(stat.current) + " but the blocks say " +
           std::to_string(truth));
    if (stat.peak < stat.current) fail(std::string(name) + " peak below current");
  };
  check(s.allocated_bytes[kAggregate], allocated, "allocated_bytes");
  check(s.requested_bytes[kAggregate], requested, "requested_bytes");
  check(s.active_bytes[kAggregate], active, "active_bytes");
  check(s.reserved_bytes[kAggregate], reserved, "reserved_bytes");
  if (own_budget_ && budget_->reserved() != static_cast<std::size_t>(reserved))
    fail("the budget counts " + std::to_string(budget_->reserved()) + " reserved bytes but the regions hold " +
         std::to_string(reserved));
  check(s.allocation[kAggregate], allocations, "allocation count");
  check(s.active[kAggregate], actives, "active count");
  check(s.segment[kAggregate], segments, "segment count");
  for (auto* a : {&s.allocated_bytes, &s.requested_bytes, &s.active_bytes, &s.reserved_bytes,
                  &s.allocation, &s.active, &s.segment})
    if ((*a)[kAggregate].current != (*a)[kSmallPool].current + (*a)[kLargePool].current)
      fail("small + large pool stats do not add up to the aggregate");
  (void)free_seen;
}

}  // namespace gpumem
