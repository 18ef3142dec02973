// Giving memory back to the upstream: making room under the cap, the limit and the high-water policy
// (make_room), releasing cached pages and segments (release_cached, trim), and the cap and limit
// settings that trigger it. A paged region gives back whole free pages anywhere, even between live
// blocks, without synchronising: they drain (pool_drain.cpp) and are unmapped once their stream's
// event has completed. A region of segments gives back whole free segments (cudaFree synchronises
// anyway). pool.hpp lists every file.
#include <algorithm>
#include <limits>

#include "format.hpp"
#include "pool.hpp"
#include "pool_debug.hpp"

namespace gpumem {

// Makes room for `bytes` more reserved bytes under the cap and, with the high-water policy, under the
// live high water plus the slack (best effort: it starts pages draining and never waits for them).
// False only when the cap cannot be met. Pages already draining count towards what is released; the
// cap and the limit wait for them (oldest first) only when nothing else is left to release.
// `lend_to`: the region of the block the room is for. Its draining pages back that block's new pages
// (map_from_draining) instead of new memory: they need no room, and they do not go back. They are
// counted afresh after each release, which can start more of them: pages released to make room for a
// block, in its own region, are lent to it at once rather than waited for (a block freed a moment ago,
// whose last use the device has not reached yet, is typically what the cap releases).
bool Pool::make_room(std::size_t bytes, const Region* lend_to) {
  if (!growth_allowed_) return false;
  if (!draining_.empty()) reap_drained(/*wait_oldest=*/false);
  auto reserved = [&] { return reserved_locked(); };
  auto lendable = [&] { return lend_to && !draining_.empty() ? lendable_bytes(lend_to) : 0; };
  auto fresh = [&] { return bytes - std::min(bytes, lendable()); };  // what needs new memory
  // Releases what is missing beyond the pages already draining that will go back.
  auto release = [&](std::size_t missing) {
    const std::size_t going = draining_bytes_ - std::min(lendable(), draining_bytes_);
    if (missing > going) release_cached(missing - going);
  };
  const auto allowed =
      static_cast<std::size_t>(static_cast<double>(live_high_water_) * (1.0 + options_.release_slack));
  if (options_.release == ReleasePolicy::kHighWater && reserved() + fresh() > allowed)
    release(reserved() + fresh() - allowed);
  const std::size_t cap = bound_locked();
  auto over_cap = [&] { return reserved() + fresh() > cap ? reserved() + fresh() - cap : 0; };
  release(over_cap());
  while (over_cap() && reap_waiting()) {
  }
  if (over_cap()) return false;
  // Pools sharing the budget hold memory too: this pool's own cache goes back first.
  if (!budget_->fits(fresh())) {
    release(budget_->excess(fresh()));
    while (!budget_->fits(fresh()) && reap_waiting()) {
    }
  }
  return budget_->fits(fresh());
}

// "Near the cap" for the placement of physical memory (ensure_mapped): within 1% of the effective cap
// a large arena maps single device pages rather than whole groups. Measured on the bundled traces'
// lowest 0-OOM capacity (docs/benchmarks.md): without the margin resnet50 needs 1.0028x its peak live bytes,
// with 1% (or 2-10%) 1.0019x; at 0.2-0.5% nothing changes. Far from the cap nothing changes at all.
constexpr double kNearCap = 0.01;

// How close to the effective cap a block may bring the live bytes and still be lent the pages
// make_room releases for it (lends_near_cap). Lending changes which pages stay pinned where, and
// closest to the cap that cost capacity: the lowest 0-OOM limit of the ckpt trace (CPU replay, device
// 100 operations behind) rose from 1.0109x its peak live bytes to 1.0156x, on the GPU (pressure bench)
// from 1.0100x to 1.0144x. Waiting instead once live + block pass 98% of the cap gives 1.0109x there
// again (GPU: 1.0089x), and keeps every wait lending saves at a 1.05x cap in the CPU replay
// (docs/benchmarks.md).
constexpr double kLendHeadroom = 0.02;

bool Pool::lends_near_cap(std::size_t block_bytes) const {
  const std::size_t cap = bound_locked();
  const auto live = static_cast<std::size_t>(stats_.active_bytes[kAggregate].current);
  return static_cast<double>(live + block_bytes) <= static_cast<double>(cap) * (1.0 - kLendHeadroom);
}

// When a cap or a limit is "roomy" (bound_is_roomy): at least this far above the live high water,
// and that high water settled, i.e. it has not risen by more than 1% while kSettledAfter times its
// bytes were allocated (a few steps of a training or inference loop). There the bound is not what
// decides whether the workload fits, and a large arena that remaps at the bound maps whole 8 MiB
// groups instead of single 2 MiB pages: a quarter of the driver's units, and a layout that settles.
// CPU replay of the bench traces under a limit of 1.05x their peak live bytes, last of three passes,
// device 20 / 100 / 1000 operations behind (bench/remap_at_cap.py --bound limit, docs/benchmarks.md): ckpt
// 2,312-2,666 units and 12-17 waits a pass -> 0-408 units and no wait, bert 1,004-1,312 units and
// 13-15 waits -> 0-90 and none; at 1.02x (below the 2%) and the lowest 0-OOM limits nothing changes.
// On one H100 at 1.05x the steady step (no wait left) went from 116-123 to 107-113 ms on ckpt and
// from 24.9-25.2 to 23.4-24.0 ms on bert. The settling guards the tight case of a workload still growing
// towards its peak (one long generation whose KV cache grows to the end: with 2% alone its lowest
// 0-OOM limit rose from 1.0108x to 1.0234x, with 2x instead of 4x to 1.0141x).
constexpr double kRoomyBound = 0.02;
constexpr double kSettledAfter = 4.0;

bool Pool::bound_is_roomy() const {
  if (!bounded_locked()) return false;  // nothing bounds it but the device's total memory
  const auto high_water = static_cast<double>(live_high_water_);
  return live_high_water_ > 0 &&
         high_water * (1.0 + kRoomyBound) <= static_cast<double>(bound_locked()) &&
         static_cast<double>(allocated_since_high_water_rose_) >= kSettledAfter * high_water;
}

bool Pool::fits_without_release(std::size_t bytes) const {
  if (!growth_allowed_) return false;
  const std::size_t reserved = reserved_locked();
  const std::size_t cap = bound_locked();
  if (reserved + bytes > cap - static_cast<std::size_t>(static_cast<double>(cap) * kNearCap)) return false;
  // The high-water allowance is not asked: make_room releases under it as before, whole groups
  // stay the unit there (single pages would multiply the remaps that policy already makes).
  return budget_->fits(bytes);
}

// The device refused a map: other memory on it (another process, a library's own cudaMalloc, the
// CUDA context) leaves this pool less than the cap says. What it can hold now, its reserved bytes plus
// the device's free bytes, becomes a bound like the cap (bound_locked): the next allocations make
// room under it by releasing cached pages first, and place blocks as near the cap, instead of asking
// the device, being refused and releasing the whole cache every time. On one H100 with the rest of the
// device taken (bench/pressure.py --bound device, varlen at 1.05x its peak), that refusal path made a
// step 56 ms against expandable_segments' 37 ms. It is learned again before allocate()'s retry (with
// the whole cache given back) and by trim(), so an allocation fails only where the device itself has
// no room. A driver error while asking keeps the room known before: learning is an optimisation.
void Pool::learn_device_room() {
  std::size_t free_bytes = 0;
  if (device_free_bytes(&free_bytes)) device_room_ = reserved_locked() + free_bytes;
}

// Memory outside the pool may have been freed since the room was learned: before the room makes a
// block release cached pages (ensure_mapped), the device is asked again, and the room grows to reserved
// + its free bytes less kDeviceRoomMargin; it never shrinks here (only a refusal says there is less).
// Asking both ways with no margin (9af88d0) was slower on an H100: the free bytes the device reports
// lag the pool's own releases (units released a moment before were not free yet), so the room swung by
// up to 2 GiB within a step, and each swing down made the pool give back cached pages it then mapped
// again: ckpt at 1.05x of the device took 112-121 ms a step against 104-113 without asking
// (2026-11-26, two runs each, bench/pressure_workloads.py --bound device); growing only, with the
// margin, 104-107 (docs/benchmarks.md: "When the memory outside goes"). The margin keeps a grown room off the
// device's very end, where a refusal costs a wait or a retry; its size (four 8 MiB groups) was not
// measured apart.
constexpr std::size_t kDeviceRoomMargin = 32 * MiB;

void Pool::ask_device_for_more_room() {
  std::size_t free_bytes = 0;
  if (!device_free_bytes(&free_bytes)) return;
  const std::size_t room = reserved_locked() + free_bytes - std::min(free_bytes, kDeviceRoomMargin);
  if (room > device_room_) device_room_ = room;
}

bool Pool::device_free_bytes(std::size_t* free_bytes) const {
  try {
    *free_bytes = upstream_->device_free_bytes();
    return true;
  } catch (const UpstreamError&) {
    return false;
  }
}

// Starts draining the whole mapped pages inside a free block, up to `target` bytes: each run of them
// becomes a draining block behind the mark after the block's last use (pool_drain.cpp unmaps it once
// that mark has completed; at once if it has already). Returns the bytes started.
std::size_t Pool::release_pages_of(Block* block, std::size_t target) {
  Region* region = block->region;
  PageMap& pages = region->pages;
  const PageRun inside = pages.inside(block->address, block->size);
  std::size_t started = 0;
  std::uint64_t seq = 0;
  bool marked = false;
  for (PageRun run = pages.next_mapped_run(inside.first, inside.end); !run.empty() && started < target;
       run = pages.next_mapped_run(run.end, inside.end)) {
    // Only whole units go back (a group mapped as one allocation is unmapped whole), each draining
    // block holding units of one size, which the upstream unmaps in one call.
    const PageRun whole = pages.whole_units(run);
    for (PageRun units = pages.next_uniform_run(whole.first, whole.end); !units.empty() && started < target;
         units = pages.next_uniform_run(units.end, whole.end)) {
      const std::size_t unit = pages.unit_bytes(units.first);
      const std::size_t wanted = target - started;  // only as many units as the target still needs
      const std::size_t count = std::min(pages.bytes_of(units) / unit, wanted / unit + (wanted % unit != 0));
      units.end = units.first + count * (unit / pages.page());
      const std::uintptr_t address = pages.address_of(units.first);
      const std::size_t bytes = pages.bytes_of(units);
      if (!marked) {  // one mark for the whole block: its pieces were freed together
        seq = mark_after(*region->arena, block->freed_seq);  // throws: nothing changed
        marked = true;
      }
      Block* drained = start_draining(block, address, bytes, seq);
      started += bytes;
      block = drained->next;  // the free rest after the units holds the next ones
      if (!block || block->state != BlockInfo::kFree) return started;
    }
  }
  return started;
}

// Returns cached memory (whole free pages, whole free segments) to the device until `target` bytes
// have gone back or nothing more can. Largest free blocks go first: they give the most per call.
std::size_t Pool::release_cached(std::size_t target, bool rethrow) {
  std::size_t released = 0;
  try {
    released = release_cached_units(target);
    // What the device has already finished with goes back at once (all of it on an idle device).
    if (!draining_.empty()) reap_drained(/*wait_oldest=*/false, rethrow);
  } catch (const UpstreamError&) {
    // The unit that failed stays reserved and accounted; allocation paths carry on with what they
    // have (and report an OOM if that is not enough), trim() reports the driver's error.
    if (rethrow) throw;
  }
  return released;
}

// Large arenas go first, whatever order the arenas were made in. A small arena's free pages are the
// ones small requests soon need again, and what they free is units a large block cannot be lent
// (another region), so the large block waits for them to drain: releasing them first under a limit
// made allocfree's CPU replay (seven seeds, device 100 operations behind, three passes) wait 552 /
// 479 / 73 times at 1.01x / 1.02x / 1.03x; large arenas first, 27 / 34 / 4, and no lowest limit of
// the 17 bundled and generated traces moves.
std::size_t Pool::release_cached_units(std::size_t target) {
  std::vector<Arena*> large_first;
  large_first.reserve(arenas_.size());
  for (auto& arena_ptr : arenas_)
    if (!arena_ptr->small) large_first.push_back(arena_ptr.get());
  for (auto& arena_ptr : arenas_)
    if (arena_ptr->small) large_first.push_back(arena_ptr.get());
  std::size_t released = 0;
  for (Arena* arena_in_order : large_first) {
    Arena& arena = *arena_in_order;
    if (released >= target) break;
    if (upstream_->kind() == UpstreamKind::kPages) {
      // The blocks that can hold a whole page, largest first. With pages of 1 MiB or less (a simulated
      // device's) these include binned blocks: scanning the size class lists alone, a free block of
      // 64 KiB pages that was 1 MiB kept its pages through the release before an out-of-memory
      // error, which then said no where that block fitted (the fuzzer, 2026-12-06).
      // Every paged region counts pages of the upstream's granularity (add_paged_region).
      std::vector<Block*> candidates;
      arena.free_blocks.for_each_largest_first(page_size_, [&](Block* b) { candidates.push_back(b); });
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
  // trim() says what went back: it waits for the pages it started draining (and any others).
  const std::size_t before = reserved_locked();
  release_cached(std::numeric_limits<std::size_t>::max(), /*rethrow=*/true);
  drain_all(/*rethrow=*/true);
  if (device_room_) learn_device_room();  // the device's room as it is now
  forget_high_water();
  return before - reserved_locked();
}

// After trim() the cache is what the live blocks need, and what comes next is a new phase (a training
// run after an evaluation, another model): the high water of the phase before says nothing of it.
// Kept, it would let the new phase map fresh pages up to the old peak before stitching starts
// (tests/gpu/test_stitch_gpu.py's training after its tensors: reserved 1.18x allocated instead of 1.03x,
// CPU replay of the two phases' traces 1.161x instead of 1.028x), and the high-water policy release
// only above the old peak. The live high water starts again from the live bytes.
void Pool::forget_high_water() {
  live_high_water_ = stats_.active_bytes[kAggregate].current;
  settled_high_water_ = live_high_water_;
  allocated_since_high_water_rose_ = 0;
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
  const std::size_t reserved = reserved_locked();
  if (reserved > effective_cap_locked()) {
    release_cached(reserved - effective_cap_locked());
    drain_all();  // a setting the user made: it holds when the call returns, where it can
  }
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
  if (const std::size_t excess = budget_->excess(0)) {
    release_cached(excess);
    drain_all();
  }
}

std::size_t Pool::limit() const { return budget_->limit(); }

std::size_t Pool::effective_cap() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return effective_cap_locked();
}

}  // namespace gpumem
