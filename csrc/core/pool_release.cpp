// Giving memory back to the upstream: making room under the cap, the limit and the high-water policy
// (make_room), releasing cached pages and segments (release_cached, trim), and the cap and limit
// settings that trigger it. A paged region gives back whole free pages anywhere, even between live
// blocks; a region of segments gives back whole free segments (pool.hpp lists every file).
#include <algorithm>
#include <limits>

#include "format.hpp"
#include "pool.hpp"
#include "pool_debug.hpp"

namespace gpumem {

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

// Unmaps the whole pages inside a free block, up to `target` bytes. Returns the bytes unmapped.
std::size_t Pool::release_pages_of(Block* block, std::size_t target) {
  Region* region = block->region;
  PageMap& pages = region->pages;
  const PageRun inside = pages.inside(block->address, block->size);
  std::size_t released = 0;
  bool synced = false;
  for (PageRun run = pages.next_mapped_run(inside.first, inside.end); !run.empty() && released < target;
       run = pages.next_mapped_run(run.end, inside.end)) {
    const std::size_t wanted = target - released;  // only as many pages as the target still needs
    run.end = run.first + std::min(run.count(), wanted / pages.page() + (wanted % pages.page() != 0));
    if (!synced) {
      // The block's last user may still be running on its stream: wait before the memory goes back.
      upstream_->synchronize(region->arena->stream);
      stats_.num_sync_all_streams++;
      synced = true;
    }
    const std::uintptr_t address = pages.address_of(run.first);
    const std::size_t bytes = pages.bytes_of(run);
    const PageRun span = notify_unmapping_run(region, run);
    try {
      upstream_->unmap(address, bytes, pages.page());
    } catch (...) {
      notify_unmapped_run(region, run, span, false);  // the pages stay mapped, accounted
      throw;
    }
    stats_.num_device_free++;
    pages.mark_unmapped(run);
    add_reserved(region, -static_cast<std::int64_t>(bytes));
    notify(SegmentEvent::kUnmap, address, bytes, region->arena->stream);
    notify_unmapped_run(region, run, span, true);
    released += bytes;
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
        if (b->size >= b->region->pages.page()) candidates.push_back(b);
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
      notify(SegmentEvent::kSpanRemoved, region->base, region->size, arena.stream);
      try {
        upstream_->free_segment(region->base, region->size);
      } catch (...) {
        notify(SegmentEvent::kSpanAdded, region->base, region->size, arena.stream);  // stays, accounted
        throw;
      }
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
  GPUMEM_VALIDATE_ON_RETURN();
  return release_cached(std::numeric_limits<std::size_t>::max(), /*rethrow=*/true);
}

// ---- the cap and the limit -----------------------------------------------------------------------

void Pool::set_cap(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  GPUMEM_VALIDATE_ON_RETURN();
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
  GPUMEM_VALIDATE_ON_RETURN();
  budget_->set_limit(bytes);
  // Cached pages go back down to the limit where they can; pages under live blocks stay.
  if (const std::size_t excess = budget_->excess(0)) release_cached(excess);
}

std::size_t Pool::limit() const { return budget_->limit(); }

std::size_t Pool::effective_cap() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return effective_cap_locked();
}

}  // namespace gpumem
