// The invariant checker, validate(): every block of every region (links, coverage, alignment, merged
// free neighbours, allocation state), the free index, the address map of live blocks, each paged
// region's page map and aliases, the pending frees, and every statistic against what the blocks say.
// Also the validate-every-op check of debug builds (pool_debug.hpp). pool.hpp lists every file.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <unordered_map>

#include "pool.hpp"
#include "pool_debug.hpp"

namespace gpumem {

void Pool::validate() const {
  std::lock_guard<std::mutex> lock(mutex_);
  validate_locked();
}

void Pool::validate_locked() const {
  auto fail = [](const std::string& what) { throw InvariantViolation("gpumem invariant: " + what); };
  std::int64_t allocated = 0, requested = 0, active = 0, reserved = 0, allocations = 0,
               actives = 0, segments = 0;
  std::size_t live_seen = 0, free_seen = 0, draining_seen = 0, draining_bytes = 0;
  std::unordered_map<const Region*, std::size_t> lent_in;  // lent draining bytes by region
  for (auto& arena : arenas_) {
    std::size_t free_in_arena = 0;
    for (auto& region : arena->regions) {
      if (region->arena != arena.get()) fail("region points to another arena");
      std::uintptr_t expect = region->base;
      std::size_t region_reserved = region->size;
      if (region->paged) {
        if (const char* wrong = region->pages.inconsistency()) fail(wrong);
        region_reserved = region->pages.mapped_bytes();
        // Lent pages are mapped twice (the draining block and the block mapped from it).
        if (region->lent > region_reserved) fail("region lends more bytes than it has mapped");
        region_reserved -= region->lent;
      } else if (region->lent) {
        fail("a region of segments lends pages");
      }
      if (region_reserved != region->reserved) fail("region reserved bytes disagree with its pages");
      if (!region->paged && !region->aliases.empty()) fail("a region of segments has aliases");
      if (region->paged) {  // aliases (pool_alias.cpp)
        const PageMap& pages = region->pages;
        std::size_t parked_pages = 0, listed = 0;
        for (const auto& [position, alias] : region->aliases) {
          const PageRun mine{position, position + alias.pages}, owner{alias.owner, alias.owner + alias.pages};
          if (alias.pages == 0 || position % alias.pages || alias.owner % alias.pages || mine.end > pages.pages())
            fail("an alias is not a whole unit");
          if (alias.draining ? pages.count_unmapped(mine) != 0 : pages.count_parked(mine) != alias.pages)
            fail("an alias's pages are neither mapped (lent, draining) nor parked");
          if (!alias.draining) parked_pages += alias.pages;
          if (pages.count_unmapped(owner) != 0 || pages.unit_bytes(owner.first) != alias.pages * pages.page())
            fail("an alias's owner is not a mapped unit of its size");
          if (region->aliases.count(alias.owner)) fail("an alias's owner is an alias itself");
          const auto list = region->aliases_of.find(alias.owner);
          if (list == region->aliases_of.end() ||
              std::find(list->second.begin(), list->second.end(), position) == list->second.end())
            fail("an alias missing from its owner's list");
        }
        for (const auto& [owner, list] : region->aliases_of) {
          if (list.empty()) fail("an owner's list of aliases is empty");
          listed += list.size();
        }
        if (listed != region->aliases.size()) fail("owners list aliases that do not exist, or twice");
        if (pages.count_parked({0, pages.mapped_limit()}) != parked_pages) fail("a parked page without an alias");
      }

      reserved += static_cast<std::int64_t>(region->reserved);
      segments += region->reserved > 0;
      const Block* prev = nullptr;
      for (Block* b = region->first; b; b = b->next) {
        if (b->region != region.get()) fail("block points to another region");
        if (b->prev != prev) fail("broken prev link");
        if (b->address != expect) fail("blocks overlap or leave a gap");
        if (b->size == 0 || b->size % kAlignment || b->address % kAlignment) fail("misaligned block");
        if (b->freed_seq > free_seq_) fail("block freed later than the pool's free count");
        expect += b->size;
        if (b->state == BlockInfo::kFree) {
          free_seen++;
          free_in_arena++;
          if (!arena->free_blocks.contains(b)) fail("free block missing from its arena's free index");
          if (prev && prev->state == BlockInfo::kFree) fail("two adjacent free blocks not merged");
          if (b->requested || !b->extra_streams.empty() || b->pending_events)
            fail("free block carries allocation state");
        } else if (b->state == BlockInfo::kDraining) {
          draining_seen++;
          if (!region->paged) fail("draining block in a region of segments");
          const PageRun whole = region->pages.inside(b->address, b->size);
          if (whole.count() * region->pages.page() != b->size ||
              region->pages.address_of(whole.first) != b->address)
            fail("draining block is not whole pages");
          if (region->pages.count_unmapped(whole)) fail("draining block on an unmapped page");
          if (region->pages.whole_units(whole).count() != whole.count() ||
              region->pages.next_uniform_run(whole.first, whole.end).end != whole.end)
            fail("draining block is not whole units of one size");
          if (arena->free_blocks.contains(b)) fail("draining block in the free index");
          if (live_.find(b->address)) fail("draining block in the address map");
          if (b->requested || !b->extra_streams.empty() || b->pending_events)
            fail("draining block carries allocation state");
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
          if (region->paged && region->pages.count_unmapped(region->pages.touched(b->address, b->size)))
            fail("live block on an unmapped page");
        }
        prev = b;
      }
      if (expect != region->base + region->size) fail("blocks do not cover their region");
    }
    if (free_in_arena != arena->free_blocks.size()) fail("free index holds blocks not in any region");
    std::uint64_t last_mark = arena->done_seq;
    for (const Mark& m : arena->marks) {
      if (m.seq <= last_mark || m.seq > free_seq_) fail("marks out of order or past the free count");
      last_mark = m.seq;
    }
    if (!arena->free_blocks.consistent()) fail("a free bin's or size class's list or bitmap is inconsistent");
  }
  if (live_seen != live_.size()) fail("address map holds blocks not in any region");
  for (auto& d : draining_) {
    if (d.block->state != BlockInfo::kDraining) fail("draining list holds a block that is not draining");
    (d.lent ? lent_in[d.block->region] : draining_bytes) += d.block->size;
    // Behind a mark of its arena still recorded, or one already seen completed.
    const Arena& arena = *d.block->region->arena;
    if (d.seq > arena.done_seq &&
        std::none_of(arena.marks.begin(), arena.marks.end(), [&](const Mark& m) { return m.seq == d.seq; }))
      fail("draining block behind a mark its arena does not have");
    if (d.seq < d.block->freed_seq) fail("draining block behind a mark recorded before its free");
  }
  if (draining_seen != draining_.size()) fail("the draining list disagrees with the draining blocks");
  if (draining_bytes != draining_bytes_) fail("draining bytes disagree with the draining list");
  for (auto& arena : arenas_)
    for (auto& region : arena->regions)
      if (region->lent != (lent_in.count(region.get()) ? lent_in[region.get()] : 0))
        fail("a region's lent bytes disagree with its lent draining blocks");
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

bool Pool::validates_every_op() { return GPUMEM_VALIDATE_EVERY_OP != 0; }

Pool::ValidateOnReturn::ValidateOnReturn(const Pool& pool)
    : pool_(pool), exceptions_(std::uncaught_exceptions()) {}

Pool::ValidateOnReturn::~ValidateOnReturn() noexcept(false) {
  if (std::uncaught_exceptions() == exceptions_) {
    pool_.validate_locked();  // a violation throws from the call that caused it
    return;
  }
  try {
    pool_.validate_locked();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpumem: after a call that threw: %s\n", e.what());
    std::abort();
  }
}

}  // namespace gpumem
