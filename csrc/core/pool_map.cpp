// Placing a block and mapping its pages on a paged upstream: which free block takes it when the best
// fit needs pages mapped (Pool::fewest_unmapped_fit) or, in a small arena, so that it opens the fewest
// empty pages and slots (Pool::packed_fit), where in its free block it goes (Pool::place: the fewest
// unmapped pages, or packed), which physical units back it (ensure_mapped: whole groups of pages
// while they fit; near the cap, single device pages except the groups a large block covers whole;
// page_map.hpp says what a unit is), and the span events of maps and unmaps (SegmentEvent). pool.hpp
// lists every file.
#include <algorithm>

#include "pool.hpp"

namespace gpumem {

// Where place() puts `rounded` bytes in the free block `b`, and how many unmapped pages that needs:
// at its start, unless `b` is a hole between other blocks (not a region's free tail) whose start lies
// on unmapped pages and whose end needs fewer of them mapped: then at its end. The one rule of place()
// and fewest_unmapped_fit(); costs one comparison when the start lies below mapped_limit.
struct Placement {
  bool at_end;
  std::size_t unmapped;
};
template <typename Block>
static Placement placement_in(const PageMap& pages, const Block* b, std::size_t rounded) {
  if (pages.below_mapped_limit(b->address, rounded)) return {false, 0};
  const std::size_t at_start = pages.count_unmapped(pages.touched(b->address, rounded));
  if (at_start == 0 || !b->next || b->size == rounded) return {false, at_start};
  const std::size_t at_end = pages.count_unmapped(pages.touched(b->address + b->size - rounded, rounded));
  return at_end < at_start ? Placement{true, at_end} : Placement{false, at_start};
}

// How many pages `rounded` bytes at the start of the free block `b` pin that no neighbour pins already:
// the pages they touch, less a first page shared with the block before and a last page shared with
// the block after (free blocks are merged, so a neighbour is live, pending or draining).
template <typename Block>
static std::size_t pages_pinned(const PageMap& pages, const Block* b, std::size_t rounded) {
  const PageRun touched = pages.touched(b->address, rounded);
  const PageRun whole_block = pages.touched(b->address, b->size);
  const std::size_t first = b->prev && b->address % pages.page() ? touched.first + 1 : touched.first;
  const bool shares_last = b->next && (b->address + b->size) % pages.page() != 0;
  const std::size_t block_end = shares_last ? whole_block.end - 1 : whole_block.end;
  const std::size_t end = std::min(touched.end, block_end);
  return end > first ? end - first : 0;
}

// A page pinned beyond the best fit's counts as this many pages to map: a larger free block is taken
// when the mapping it saves outweighs the pages it pins. Chosen on the traces of bench/traces and the
// bundled ones (bench/remap_at_cap.py: CPU replay at 1.02x and the lowest 0-OOM capacity;
// docs/benchmarks.md): with 16, the bytes remapped at the cap fall as far as with no weight on BERT inference
// (-67%, -49%) and by 8-24% on generation and checkpointed training, and the lowest 0-OOM capacity of BERT
// stays under 1.01x (1.0092; 1.0129 with no weight, 1.0073 without this choice); generation's rises from
// 1.0079x to 1.0111x; the other traces do not change.
constexpr std::size_t kPinnedPageWeight = 16;

// How many free blocks, smallest first, the placement scans below (fewest_unmapped_fit, packed_fit,
// take_mapped_slot_off_boundary) look at before they settle for the best found: a pool with
// thousands of free blocks scans 1024 of them, so that a request costs a bounded time.
constexpr std::size_t kFitScanLimit = 1024;

// Which free block of the arena takes `rounded` bytes: the best fit (`best`, the smallest that fits),
// unless it needs pages mapped and a larger free block needs fewer, counting each page it would pin
// beyond the best fit as kPinnedPageWeight pages to map.
// Why: pages released from between live blocks (near the cap, or by the high-water policy) leave
// holes whose pages are unmapped. Best fit alone takes such a hole whenever it is the tighter fit,
// and mapping it again under the cap means releasing the mapped free pages of another hole, which
// the next request of the same size takes back in turn: at the cap, every step remaps. On the GPU
// (BERT-base inference, batch 470, under a 3.17 GiB limit, one H100): 22.4 GiB remapped and 1.09 s
// per step with best fit alone, 7.7 GiB and 0.36-0.44 s with this choice. Far from the cap the best
// fit needs new pages only at the region's free tail, the largest block: nothing larger is scanned.
Pool::Block* Pool::fewest_unmapped_fit(const Arena& arena, Block* best, std::size_t rounded) const {
  if (!best->region->paged) return best;  // a paged arena has one region: all its blocks are paged
  const PageMap& pages = best->region->pages;
  auto needed = [&](const Block* b) { return placement_in(pages, b, rounded).unmapped; };
  std::size_t fewest = needed(best);
  if (fewest == 0) return best;  // the fast path: one comparison (below_mapped_limit)
  const std::size_t best_pins = pages_pinned(pages, best, rounded);
  std::size_t best_cost = fewest;
  Block* chosen = best;
  std::size_t budget = kFitScanLimit;
  arena.free_blocks.for_each_fit(rounded, [&](Block* b) {
    if (b != best) {
      const std::size_t n = needed(b);
      const std::size_t pins = pages_pinned(pages, b, rounded);
      const std::size_t cost = n + kPinnedPageWeight * (pins > best_pins ? pins - best_pins : 0);
      if (cost < best_cost) best_cost = cost, chosen = b, fewest = n;
    }
    return fewest != 0 && --budget != 0;
  });
  return chosen;
}

// How many of the `unit`-aligned stretches that [start, start + bytes) touches lie wholly inside the
// free block `b`: stretches nothing else uses yet (free blocks are merged, so a stretch with a live,
// pending or draining byte is never wholly inside one).
template <typename Block>
static std::size_t empty_units_touched(const Block* b, std::uintptr_t start, std::size_t bytes,
                                       std::size_t unit) {
  if (b->size < unit) return 0;  // most holes: none fits whole
  std::size_t n = 0;
  for (std::uintptr_t u = start / unit * unit; u < start + bytes; u += unit)
    n += u >= b->address && u + unit <= b->address + b->size;
  return n;
}

// Where a small arena's block of `rounded` bytes goes in the free block `b`, and what it opens there:
// pages and slots (half pages) that nothing used before it. A block of exactly a slot goes on a slot
// boundary (none: `fits` false), a smaller one at the start of `b`; in a hole between other blocks,
// the last slot boundary or the end instead where that opens fewer (the first on a tie).
struct PackedPlacement {
  std::uintptr_t address;
  std::size_t empty_pages;
  std::size_t empty_slots;
  bool fits;
};
static bool opens_fewer(const PackedPlacement& x, const PackedPlacement& y) {
  return x.empty_pages != y.empty_pages ? x.empty_pages < y.empty_pages : x.empty_slots < y.empty_slots;
}
static bool opens_nothing(const PackedPlacement& p) { return p.empty_pages == 0 && p.empty_slots == 0; }
// Whether `rounded` bytes in the free block `b` can open an empty page or slot at all: not in a hole
// smaller than a slot (the fast path of packed_fit and place) unless they are a slot-sized block.
template <typename Block>
static bool may_open_empty(const Block* b, std::size_t rounded, std::size_t slot) {
  return rounded == slot || b->size >= slot;
}
template <typename Block>
static PackedPlacement packed_placement(const Block* b, std::size_t rounded, std::size_t page,
                                        std::size_t slot) {
  auto at = [&](std::uintptr_t address) {
    return PackedPlacement{address, empty_units_touched(b, address, rounded, page),
                           empty_units_touched(b, address, rounded, slot), true};
  };
  const std::uintptr_t end = b->address + b->size;
  if (rounded == slot) {
    const std::uintptr_t first = round_up(b->address, slot);
    if (first + rounded > end) return {0, 0, 0, false};
    const PackedPlacement at_first = at(first);
    if (!b->next) return at_first;  // the region's free tail: its last slot is the range's far end
    const PackedPlacement at_last = at((end - rounded) / slot * slot);
    return opens_fewer(at_last, at_first) ? at_last : at_first;
  }
  const PackedPlacement at_start = at(b->address);
  if (!b->next || b->size == rounded || opens_nothing(at_start)) return at_start;
  const PackedPlacement at_end = at(end - rounded);
  return opens_fewer(at_end, at_start) ? at_end : at_start;
}

// Which free block of a small arena (paged) takes `rounded` bytes: the one where they open the fewest
// empty pages, then the fewest empty slots (packed_placement), the smallest on a tie; `best` (the best
// fit) when it is a hole smaller than a slot, which opens none (the fast path: one comparison).
// Why: the tight case's reserved bytes are the pages live blocks pin, and best fit spreads small
// blocks: a block of a slot placed right after smaller ones straddles two pages, and small blocks
// carved from the start of an empty slot leave no whole slot for the next one. Packed, the small
// arena's pages hold its live bytes more closely: on allocfree's requests (bench/pressure_workloads.py,
// 256 B to 64 MiB, at most 32 alive, seven seeds) the lowest 0-OOM limit of the CPU replay fell from
// 1.0044x to 1.0026x on average (docs/benchmarks.md, "Packed small arenas"; the training traces: equal or
// lower, but fbs_gen with a device behind). Only where the best fit is a free block of a slot or more (or
// for a slot-sized block) is anything scanned.
Pool::Block* Pool::packed_fit(const Arena& arena, Block* best, std::size_t rounded) const {
  if (!may_open_empty(best, rounded, kSlotBytes)) return best;
  const std::size_t page = upstream_->page_size();
  Block* chosen = nullptr;
  PackedPlacement fewest{};
  std::size_t budget = kFitScanLimit;
  // `best` is the smallest block that fits: the scan starts at its size, past the bins below it.
  arena.free_blocks.for_each_fit(best->size, [&](Block* b) {
    const PackedPlacement p = packed_placement(b, rounded, page, kSlotBytes);
    if (p.fits && (!chosen || opens_fewer(p, fewest))) chosen = b, fewest = p;
    return !(chosen && opens_nothing(fewest)) && --budget != 0;
  });
  return chosen ? chosen : best;
}

// The last try before an out-of-memory error for a slot-sized block of a small arena: packed_fit puts
// it on a slot boundary only, and under a full cap every free block with a boundary may need a page
// mapped while a hole between live blocks, its pages mapped but with no boundary in it, could hold
// the block (found by the fuzzer, 2026-12-06: 1 MiB refused beside a mapped hole of 1.24 MiB). Here
// it goes in the first free block where it needs no page mapped (placement_in: the start, or a hole's
// end), off the boundary: it pins only pages its neighbours pin already, and an allocation served
// beats a packing rule kept. Returns the block carved out (allocated, not yet mapped), or null.
Pool::Block* Pool::take_mapped_slot_off_boundary(Arena& arena, std::size_t rounded) {
  if (!packs(arena) || rounded != kSlotBytes) return nullptr;
  Block* chosen = nullptr;
  bool at_end = false;
  std::size_t budget = kFitScanLimit;
  arena.free_blocks.for_each_fit(rounded, [&](Block* b) {
    const Placement p = placement_in(b->region->pages, b, rounded);
    if (p.unmapped == 0) chosen = b, at_end = p.at_end;
    return !chosen && --budget != 0;
  });
  if (!chosen) return nullptr;
  return carve(chosen, at_end ? chosen->address + chosen->size - rounded : chosen->address, rounded);
}

// Where in `block` (free, out of the free index, larger than or equal to `rounded`) the allocation
// goes (placement_in: its start, or the end of a hole when that needs fewer unmapped pages); returns
// it, allocated and split to `rounded`. A block placed so that it straddles the fewest unmapped pages
// maps less and leaves the mapped pages it did not take free where they are (measured: 20% fewer
// upstream calls with release:high_water on gpt_varlen, docs/benchmarks.md). Costs one comparison on the fast
// path.
Pool::Block* Pool::place(Arena& arena, Block* block, std::size_t rounded) {
  const Region* region = block->region;
  if (packs(arena)) {
    if (may_open_empty(block, rounded, kSlotBytes)) {  // else its start, with no arithmetic
      const PackedPlacement p = packed_placement(block, rounded, upstream_->page_size(), kSlotBytes);
      if (p.fits && p.address != block->address) {
        arena.free_blocks.insert(block);  // carve takes it out of the index again
        return carve(block, p.address, rounded);
      }
    }
  } else if (region->paged && placement_in(region->pages, block, rounded).at_end) {
    arena.free_blocks.insert(block);  // carve takes it out of the index again
    return carve(block, block->address + block->size - rounded, rounded);
  }
  block->state = BlockInfo::kAllocated;  // before split, so the remainder does not merge back
  split(block, rounded);
  return block;
}

// The smallest block whose wholly covered groups are mapped as group units near the cap. A group freed
// and then reused in part by smaller blocks stays pinned whole, so this costs fit where smaller
// blocks refill the space of freed ones: on the CPU replay (bench/remap_at_cap.py) with every block,
// the lowest 0-OOM capacity of GPT-2 generation rose from 1.0111x to 1.0175x, and on the GPU (H100)
// its batch search's verification at the limit ran out of memory (find_batch_size: 872 instead of
// 1260). From 256 MiB up: 1.0111x, and 1260 verified on the GPU, while BERT inference, whose large
// blocks are the ones remapped, makes 1,245 units at 1.02x (1,068 with every block; its step at the
// cap: 0.170 s, 0.139-0.145 s with every block).
constexpr std::size_t kCoveredGroupsMinBytes = 256 * MiB;

namespace {
// While a block is mapped, units unmapped to make room for it keep their physical allocations, which
// its map takes before creating new ones (Upstream::keep_released_units); those it does not take go
// back to the device when the block is mapped (or has failed to be). Under a cap, where pages are
// remapped every step, a moved unit saves the driver's create and release: ~20 of the ~60 us that
// remapping a unit costs on an H100 (README). A failure to release a kept unit at the end is ignored
// (the pool has accounted it as released either way; the driver is failing on everything by then).
class KeepReleasedUnits {
 public:
  explicit KeepReleasedUnits(Upstream& upstream) : upstream_(upstream) { upstream_.keep_released_units(true); }
  ~KeepReleasedUnits() {
    try {
      upstream_.keep_released_units(false);
    } catch (...) {
    }
  }
  KeepReleasedUnits(const KeepReleasedUnits&) = delete;
  KeepReleasedUnits& operator=(const KeepReleasedUnits&) = delete;

 private:
  Upstream& upstream_;
};
}  // namespace

// Maps every page the (already allocated) block touches. On failure the pages mapped so far stay
// mapped and accounted as reserved; the caller returns the block to the free set.
// Placement of physical memory (page_map.hpp, units): in a region with groups (a large arena's 8 MiB
// pages), each group the block touches that is wholly unmapped is mapped whole, as one physical
// allocation, when all of them fit without releasing anything (under the cap, the limit and the
// high-water allowance) or, under a roomy cap or limit (bound_is_roomy), when releasing cached pages
// makes room for them; otherwise only the pages the block touches are mapped, one device page
// each except, in a block of kCoveredGroupsMinBytes or more, the groups it covers whole (one group
// unit each), so that near the cap a block reserves at most 2 MiB past its end instead of up to
// 8 MiB, and the pages it shares with its neighbours can be given back one by one. Units unmapped
// meanwhile to make room are kept for this block's map (KeepReleasedUnits), and units of the region
// still draining are mapped from first (map_from_draining): they need no room and no wait.
bool Pool::ensure_mapped(Block* block) {
  Region* region = block->region;
  PageMap& pages = region->pages;
  if (pages.below_mapped_limit(block->address, block->size)) return true;
  const PageRun touched = pages.touched(block->address, block->size);
  std::size_t missing = pages.count_unmapped(touched);
  if (missing == 0) return true;
  if (!region->aliases.empty()) {  // parked pages (stitch): taken back, or unmapped (pool_alias.cpp)
    take_back_parked(block);
    missing = pages.count_unmapped(touched);
    if (missing == 0) return true;
  }
  const PageRun groups = pages.widened(touched);
  // A room the device taught the pool earlier may have grown since (memory outside it freed): asked
  // again before it makes this block release cached pages (before any unit is kept for the map).
  if (device_room_ && device_room_ < effective_cap_locked() &&
      reserved_locked() + pages.bytes_of(groups) > device_room_)
    ask_device_for_more_room();
  KeepReleasedUnits keep(*upstream_);
  // Room is made up front for what the draining pages of the region cannot back, those make_room
  // starts included (their unit sizes may not match: then map_run makes room for the rest as it
  // goes, so the cap always holds).
  std::size_t room = 0;   // new bytes the cap has room for (make_room)
  std::size_t fresh = 0;  // new bytes mapped so far
  const Region* lend_to = lends_near_cap(block->size) ? region : nullptr;
  auto make_room_for = [&](std::size_t bytes) {
    if (!make_room(bytes, lend_to)) return false;
    const std::size_t lendable = draining_.empty() ? 0 : lendable_bytes(region);
    room = fresh + bytes - std::min(bytes, lendable);
    return true;
  };
  const std::size_t group = pages.group();
  // A group is mapped whole only when the driver maps none of its pages: parked pages count as
  // unmapped (holes, not reserved) but are still mapped there. take_back_parked cleared the groups
  // the block touches, but making room (below, and in map_run) can park more there: a lent draining
  // block beside the block reaches its mark and is parked where it lies (park_drained). Such a group
  // is partly mapped: only the pages the block touches are mapped, never a draining block's. Found by
  // the CPU replay of fbs_gen on a device of 1.0x its peak live bytes, 100 operations behind (the
  // simulated device refused the map: "page mapped twice"; on a GPU the driver refuses it too).
  auto wholly_unmapped = [&](std::size_t g) {
    return pages.count_unmapped({g, g + group}) == group && pages.count_parked({g, g + group}) == 0;
  };
  auto touched_in = [&](std::size_t g) {  // the pages of group g the block touches
    return PageRun{std::max(g, touched.first), std::min(g + group, touched.end)};
  };
  // Option ends_by_page (PoolOptions), under a bound that is not roomy (a cap, a limit or the device's
  // learned room, bound_is_roomy): only the groups the block covers whole go as group units; those at
  // its ends, which it shares with its neighbours, go page by page, so that once a neighbour is freed
  // its pages there can go back to the device one by one instead of staying pinned in a group the block
  // still holds. The bound may be reached later in the step, after these groups were mapped. On the
  // CPU replay (bench/remap_at_cap.py --bound limit, device 20, 100 and 1000 operations behind) the
  // lowest 0-OOM limit of bench/traces/ddp_mlp fell from 1.0183x its peak live bytes to 1.0056x,
  // fbs_gen's from 1.0125x to 1.0075x, ckpt's from 1.0120x to 1.0102x; at 1.05x ckpt mapped and
  // unmapped 1,429 units instead of 408 at lag 20 (docs/benchmarks.md, "ends_by_page").
  // PoolOptions::early_ends_by_page does the same for every block while the live high water is below
  // that fraction of the bound: the run's first blocks (weights, optimizer state), which live as long
  // as the run. Most of the option's gain on the traces comes from those, little of its steady cost: on
  // the CPU replay ckpt's lowest 0-OOM limit is 1.0102x with either (1.0120x without), bert's 1.0104x
  // (1.0121x), fbs_gen's 1.0100x at lags 20 and 100 (1.0075x with the option, 1.0125x without); at
  // 1.05x, passes 8, 12 and 20 at lags 20-1000, ckpt maps 190 units a pass against 178 without it
  // and the option's 437. A smaller fraction gives none of the gain (5%: ckpt and bert as without), a
  // larger one the option's cost back (30%: 251 units on ckpt; 70%: 437) (docs/benchmarks.md,
  // "early_ends_by_page").
  const PageRun covered = pages.covered(block->address, block->size);
  const bool ends_by_page =
      bounded_locked() && !bound_is_roomy() &&
      (options_.ends_by_page || static_cast<double>(live_high_water_) <
                                    options_.early_ends_by_page * static_cast<double>(bound_locked()));
  auto maps_whole = [&](std::size_t g) {  // group g goes as one group unit
    return wholly_unmapped(g) && (!ends_by_page || (g >= covered.first && g + group <= covered.end));
  };
  bool whole_groups = false;
  if (group > 1) {
    // What mapping whole groups would reserve: the groups that go whole, and of the others (partly
    // mapped, page by page earlier, or at the block's ends under a bound) only the pages it touches.
    std::size_t coarse_pages = 0;
    for (std::size_t g = groups.first; g < groups.end; g += group) {
      coarse_pages += maps_whole(g) ? group : pages.count_unmapped(touched_in(g));
    }
    const std::size_t coarse_bytes = coarse_pages * pages.page();
    if (fits_without_release(coarse_bytes)) {
      whole_groups = true;
      if (!make_room_for(coarse_bytes)) return false;
    } else if (bound_is_roomy()) {
      // Room for whole groups under a roomy bound, where releasing can make it; else single pages.
      whole_groups = make_room_for(coarse_bytes);
    }
  }
  if (!whole_groups && !make_room_for(missing * pages.page())) return false;
  auto map_run = [&](PageRun run, bool coarse) {
    const std::size_t unit = coarse ? group * pages.page() : pages.page();
    if (!draining_.empty()) {  // make_room may have started more: any of the region's will do
      run.first += map_from_draining(region, run, unit) / pages.page();
      if (run.empty()) return true;
    }
    if (stitching()) {  // free blocks' units, parked where they were (pool_alias.cpp)
      run.first += map_from_free(region, run, unit, groups) / pages.page();
      if (run.empty()) return true;
    }
    const std::uintptr_t address = pages.address_of(run.first);
    const std::size_t bytes = pages.bytes_of(run);
    // More new memory than room was made for (the draining pages did not match): room for it now.
    if (fresh + bytes > room) {
      if (!make_room(bytes)) return false;
      room = fresh + bytes;
    }
    // The device says no: pages still draining hold memory it will have back; wait for them, oldest
    // first, before giving up.
    while (!upstream_->map(address, bytes, unit)) {
      learn_device_room();  // the next allocations keep under what the device has (pool_release.cpp)
      if (!reap_waiting()) return false;
    }
    fresh += bytes;
    stats_.num_device_alloc++;
    pages.mark_mapped(run, coarse);
    add_reserved(region, static_cast<std::int64_t>(bytes));
    notify(SegmentEvent::kMap, address, bytes, region->arena->stream);
    notify_mapped_run(region, run);
    return true;
  };
  // The groups that go whole in one call per run of them; the touched pages of the others (partly
  // mapped groups, mapped page by page earlier near the cap; a bounded block's ends) one by one.
  auto map_groups = [&] {
    for (std::size_t g = groups.first; g < groups.end;) {
      if (maps_whole(g)) {
        std::size_t end = g + group;
        while (end < groups.end && maps_whole(end)) end += group;
        if (!map_run({g, end}, true)) return false;
        g = end;
        continue;
      }
      const PageRun part = touched_in(g);
      for (PageRun run = pages.next_unmapped_run(part.first, part.end); !run.empty();
           run = pages.next_unmapped_run(run.end, part.end))
        if (!map_run(run, false)) return false;
      g += group;
    }
    return true;
  };
  if (whole_groups && map_groups()) return true;
  // Near the cap, or the device refused a whole group (short of memory below the cap: other
  // processes, or a cap above the device): what the block still needs, page by page, except, in a
  // block that covers at least kCoveredGroupsMinBytes, the groups it covers whole, which go as one
  // group unit each. The block pins every page of those anyway, and the driver's work goes by units,
  // not bytes: creating, mapping and giving access to a unit, then unmapping and releasing it, costs
  // about 60 us for 2 MiB and for 20 MiB alike (H100). Under the cap, where pages are remapped every
  // step, that was most of a step's time.
  if (whole_groups && !make_room_for(pages.count_unmapped(touched) * pages.page())) return false;
  const bool big_enough = pages.bytes_of(covered) >= kCoveredGroupsMinBytes;
  auto whole_group_at = [&](std::size_t p, std::size_t run_end) {
    return big_enough && group > 1 && p % group == 0 && p >= covered.first &&
           p + group <= std::min(run_end, covered.end);
  };
  for (PageRun run = pages.next_unmapped_run(touched.first, touched.end); !run.empty();
       run = pages.next_unmapped_run(run.end, touched.end)) {
    for (std::size_t p = run.first; p < run.end;) {
      const bool coarse = whole_group_at(p, run.end);
      std::size_t end = p + (coarse ? group : 1);
      while (end < run.end && whole_group_at(end, run.end) == coarse) end += coarse ? group : 1;
      if (!map_run({p, end}, coarse)) return false;
      p = end;
    }
  }
  return true;
}

// Span events (see SegmentEvent). Computed only for an observer: each walks the pages either side.
// A map of `run` joins the spans either side of it: those go, the joined one comes.
void Pool::notify_mapped_run(const Region* region, PageRun run) {
  if (!observer_) return;
  const PageMap& pages = region->pages;
  const StreamId stream = region->arena->stream;
  const PageRun span = pages.mapped_run_around(run);
  if (span.first < run.first)
    notify(SegmentEvent::kSpanRemoved, pages.address_of(span.first), pages.bytes_of({span.first, run.first}), stream);
  if (run.end < span.end)
    notify(SegmentEvent::kSpanRemoved, pages.address_of(run.end), pages.bytes_of({run.end, span.end}), stream);
  notify(SegmentEvent::kSpanAdded, pages.address_of(span.first), pages.bytes_of(span), stream);
}

// Before the (mapped) pages of `run` are unmapped, the span holding them goes; returns that span.
PageRun Pool::notify_unmapping_run(const Region* region, PageRun run) {
  if (!observer_) return run;
  const PageMap& pages = region->pages;
  const PageRun span = pages.mapped_run_around(run);
  notify(SegmentEvent::kSpanRemoved, pages.address_of(span.first), pages.bytes_of(span), region->arena->stream);
  return span;
}

// After: what is left of the span either side comes back, or all of it when the unmap failed.
void Pool::notify_unmapped_run(const Region* region, PageRun run, PageRun span, bool unmapped) {
  if (!observer_) return;
  const PageMap& pages = region->pages;
  const StreamId stream = region->arena->stream;
  if (!unmapped) {
    notify(SegmentEvent::kSpanAdded, pages.address_of(span.first), pages.bytes_of(span), stream);
    return;
  }
  if (span.first < run.first)
    notify(SegmentEvent::kSpanAdded, pages.address_of(span.first), pages.bytes_of({span.first, run.first}), stream);
  if (run.end < span.end)
    notify(SegmentEvent::kSpanAdded, pages.address_of(run.end), pages.bytes_of({run.end, span.end}), stream);
}

}  // namespace gpumem
