// Stitching (PoolOptions::stitch, GPUMEM_CONF stitch, on by default): physical units mapped at two
// positions of a region, so that reserved stays near the live bytes without giving memory back and
// mapping it again. Under the lazy policy a block that fits no free block goes to the region's free tail and
// maps new pages there, while free pages elsewhere stay cached: with shapes that change step to
// step, reserved settles 10-24% above live (docs/benchmarks.md). With this option:
//  - Stitching (map_from_free): past the live high water (+ PoolOptions::stitch_slack), the new pages
//    of a block are mapped onto mapped units of the region's free blocks (Upstream::map_from), the least
//    recently freed first, instead of new memory; only while no cap or limit bounds the pool
//    (stitching(): under a bound the pool releases anyway, and fitted less stitched). The unit's old
//    position stays mapped by the driver but is "parked": the PageMap counts it as unmapped (a hole,
//    not reserved), and the region remembers which position owns its unit
//    (Region::aliases, aliases_of). Safe as reusing the free block directly is: the region's stream
//    is the only one that used it, and it uses the new block after that, in stream order.
//  - Taking back (take_back_parked): a block that lands on parked pages whose unit's owner lies wholly
//    in free blocks takes the unit back, the owner's pages parked in turn: no driver call, no new
//    memory (what a step of the same shapes as an earlier one mostly meets). Where the owner is live,
//    pending or draining, the parked mapping is unmapped, once the device is past its last use there
//    (its mark: recorded when it was parked, so that a wait, if any, is for that use and not for all
//    the work queued), and the page is mapped as any unmapped page.
//  - Lent draining units (map_from_draining, pool_drain.cpp) are parked at their mark instead of
//    unmapped, as aliases of the block they were lent to: while stitching, and under a roomy cap or
//    limit with PoolOptions::park_lent (parks_lent_units), where the pool stitches nothing new but a
//    step's blocks that come back where they were take their units back without a driver call.
// The owner of a unit with aliases: when its own pages go back to the device (a draining block that
// was not lent, at its mark), its parked aliases are unmapped with it (the device is past them: the
// block drains behind their marks too, start_draining), so the memory really goes back; the destructor unmaps
// them too. Graph pools and MemPools never stitch (the bridge): unmapping a parked page may wait for
// the device, which a stream capture forbids.
// Measured (docs/benchmarks.md, "Stitching on the replays", "Stitching on by default"): the CPU replays
// and, on an H100, the pressure bench's eight workloads uncapped at 1.006-1.014x their allocated bytes
// instead of up to 1.24x, steady steps level within the runs' spread, and 4-48 unit maps/unmaps per
// steady step where a position's unit is busy.
// pool.hpp lists every file.
#include <algorithm>
#include <vector>

#include "pool.hpp"

namespace gpumem {

// Why PoolOptions::stitch_slack (how far reserved may exceed the live high water before new pages are
// stitched, map_from_free) is 1% by default. CPU replays (device 100 operations behind,
// docs/benchmarks.md, "Stitching on the replays"): 1% keeps every bundled and bench trace under 1.015x
// but fbs_gen (1.023x) with fewer unmaps in steady passes than 0% (bert 758 calls and 36 waits a pass
// against 878 and 35; generate 472 against 841). More slack stitches less: at 1.5% ckpt's steady passes make 8 calls instead of
// 286-536, at 2% its GPU step is within 1% of expandable_segments' where 1% is not, but gpt_varlen
// reaches 1.0150x and 1.0197x against the target of 1.01 ("stitch_slack").

namespace {
// Moves the aliases of the unit owned at `from` to its new owner `to`.
template <typename Region>
void move_owner(Region* region, std::size_t from, std::size_t to) {
  auto it = region->aliases_of.find(from);
  if (it == region->aliases_of.end()) return;
  std::vector<std::size_t> list = std::move(it->second);
  region->aliases_of.erase(it);
  for (std::size_t a : list) region->aliases[a].owner = to;
  auto& target = region->aliases_of[to];
  target.insert(target.end(), list.begin(), list.end());
}

template <typename Region>
void forget_alias(Region* region, std::size_t position) {
  auto it = region->aliases.find(position);
  if (it == region->aliases.end()) return;
  auto owner = region->aliases_of.find(it->second.owner);
  if (owner != region->aliases_of.end()) {
    auto& list = owner->second;
    list.erase(std::remove(list.begin(), list.end(), position), list.end());
    if (list.empty()) region->aliases_of.erase(owner);
  }
  region->aliases.erase(it);
}
}  // namespace

void Pool::move_unit(Region* region, PageRun from, PageRun to, std::uint64_t seq) {
  PageMap& pages = region->pages;
  const StreamId stream = region->arena->stream;
  const PageRun span = notify_unmapping_run(region, from);
  notify(SegmentEvent::kUnmap, pages.address_of(from.first), pages.bytes_of(from), stream);
  pages.mark_parked(from);
  notify_unmapped_run(region, from, span, true);
  pages.mark_mapped(to, to.count() > 1);
  notify(SegmentEvent::kMap, pages.address_of(to.first), pages.bytes_of(to), stream);
  notify_mapped_run(region, to);
  forget_alias(region, to.first);  // `to` was parked on this unit (taken back), or unmapped
  move_owner(region, from.first, to.first);
  region->aliases[from.first] = Alias{to.first, to.count(), seq, false};
  region->aliases_of[to.first].push_back(from.first);
}

void Pool::lend_aliases(Region* region, PageRun source, PageRun target, std::size_t unit_pages) {
  for (std::size_t i = 0; i < source.count(); i += unit_pages) {
    const std::size_t from = source.first + i, to = target.first + i;
    move_owner(region, from, to);
    region->aliases[from] = Alias{to, unit_pages, 0, true};
    region->aliases_of[to].push_back(from);
  }
}

bool Pool::park_drained(Region* region, Block* block, std::uint64_t seq) {
  PageMap& pages = region->pages;
  const PageRun run = pages.touched(block->address, block->size);
  const std::size_t unit_pages = pages.unit_bytes(run.first) / pages.page();
  bool all_owned = true;
  for (std::size_t p = run.first; p < run.end && all_owned; p += unit_pages) {
    auto it = region->aliases.find(p);
    all_owned = it != region->aliases.end() && it->second.draining;
  }
  if (!all_owned) {  // an owner went back meanwhile: this mapping holds its memory now; unmapped
    for (std::size_t p = run.first; p < run.end; p += unit_pages) forget_alias(region, p);
    return false;
  }
  for (std::size_t p = run.first; p < run.end; p += unit_pages) {
    Alias& alias = region->aliases[p];
    alias.draining = false;
    alias.seq = seq;
  }
  pages.mark_parked(run);
  return true;
}

void Pool::unmap_alias(Region* region, std::size_t position) {
  PageMap& pages = region->pages;
  const Alias alias = region->aliases.at(position);
  const std::size_t bytes = alias.pages * pages.page();
  upstream_->unmap(pages.address_of(position), bytes, bytes);
  stats_.num_device_free++;
  pages.mark_unparked({position, position + alias.pages});
  forget_alias(region, position);
}

void Pool::drop_aliases_of(Region* region, PageRun run) {
  for (auto it = region->aliases_of.lower_bound(run.first); it != region->aliases_of.end() && it->first < run.end;) {
    const std::vector<std::size_t> list = it->second;  // unmap_alias edits it
    ++it;  // the entry goes once its last alias does
    for (std::size_t a : list) {
      if (region->aliases.at(a).draining) forget_alias(region, a);  // its own mark unmaps it
      else unmap_alias(region, a);
    }
  }
}

bool Pool::run_is_free(const Region* region, PageRun run, std::uint64_t* seq) const {
  const PageMap& pages = region->pages;
  const std::uintptr_t begin = pages.address_of(run.first), end = pages.address_of(run.end);
  // The blocks of a region tile it in address order; a unit is a few pages, so the walk is the cost.
  for (const Block* b = region->first; b && b->address < end; b = b->next) {
    if (b->address + b->size <= begin) continue;
    if (b->state != BlockInfo::kFree) return false;
    *seq = std::max(*seq, b->freed_seq);
  }
  return true;
}

void Pool::wait_done(Arena& arena, std::uint64_t seq) {
  poll_marks(arena);
  if (seq <= arena.done_seq) return;
  wait_for_mark(arena, mark_after(arena, seq));
}

void Pool::take_back_parked(Block* block) {
  Region* region = block->region;
  PageMap& pages = region->pages;
  // The groups it touches: a wholly unmapped group may be mapped whole (ensure_mapped).
  const PageRun touched = pages.widened(pages.touched(block->address, block->size));
  for (PageRun run = pages.next_parked_run(touched.first, touched.end); !run.empty();) {
    auto it = region->aliases.upper_bound(run.first);
    --it;  // the alias holding page run.first (a parked page always has one)
    const std::size_t position = it->first;
    const Alias alias = it->second;
    const PageRun mine{position, position + alias.pages};
    const PageRun owner{alias.owner, alias.owner + alias.pages};
    std::uint64_t seq = 0;  // the last free of the owner's pages
    Arena& arena = *region->arena;
    // An owner inside the groups the block touches stays where it is: parked there, its pages would
    // count as unmapped in a group ensure_mapped may then map whole, over the parked mapping.
    const bool owner_outside = owner.end <= touched.first || owner.first >= touched.end;
    if (owner_outside && run_is_free(region, owner, &seq)) {
      // The unit is owned here now; its old owner is one of its parked aliases, behind a mark of its
      // last use (recorded now if none covers it: unmapping it later waits at most for that).
      move_unit(region, owner, mine, mark_after(arena, seq));
    } else {
      wait_done(arena, alias.seq);
      unmap_alias(region, position);
    }
    run = pages.next_parked_run(mine.end, touched.end);
  }
}

bool Pool::stitching() const {
  return options_.stitch && options_.cap_bytes == 0 && budget_->limit() == Budget::kNoLimit;
}

bool Pool::parks_lent_units() const { return stitching() || (options_.park_lent && bound_is_roomy()); }

std::size_t Pool::map_from_free(Region* region, PageRun run, std::size_t unit, PageRun keep_out) {
  PageMap& pages = region->pages;
  const std::size_t page = pages.page(), unit_pages = unit / page, bytes = pages.bytes_of(run);
  // Only past the allowance: below it, new memory costs the steady steps nothing, and every unit
  // stitched is a position that a later block may find parked on a busy unit (an unmap, a wait).
  const double allowance = static_cast<double>(live_high_water_) * (1.0 + options_.stitch_slack);
  if (static_cast<double>(reserved_locked() + bytes) <= allowance) return 0;
  std::size_t mapped = 0;
  std::vector<Block*> order;
  for (Block* b = region->first; b; b = b->next)
    if (b->state == BlockInfo::kFree && pages.inside(b->address, b->size).count() >= unit_pages)
      order.push_back(b);
  // The least recently freed first: the free blocks the best-fit search is least likely to hand out
  // next, so their positions, parked now, are the least likely to be needed while their unit is busy
  // (CPU replays, device 100 operations behind, against address order: bert's steady pass 758 -> 480
  // calls, 36 -> 1 waits; generate 472 -> 70 and 46 -> 2; ckpt 533 -> 1,326 calls; fbs_gen's ratio
  // 1.0233 -> 1.0301. One H100, uncapped steady steps: generate 45 -> 7 unit calls and 5-18 -> 1.4 ms
  // of waits a step, bert 10.6 -> 3.7 calls, ckpt 33-39 -> 44-48 at the same step time).
  std::stable_sort(order.begin(), order.end(),
                   [](const Block* x, const Block* y) { return x->freed_seq < y->freed_seq; });
  for (Block* b : order) {
    if (mapped >= bytes) break;
    const PageRun inside = pages.inside(b->address, b->size);
    for (std::size_t p = (inside.first + unit_pages - 1) / unit_pages * unit_pages;
         p + unit_pages <= inside.end && mapped < bytes; p += unit_pages) {
      const PageRun source{p, p + unit_pages};
      if (source.end > keep_out.first && source.first < keep_out.end) continue;  // see take_back_parked
      if (pages.count_unmapped(source) != 0 || pages.unit_bytes(p) != unit) continue;
      const PageRun target{run.first + mapped / page, run.first + mapped / page + unit_pages};
      // The mark recorded now (or an earlier one) is what unmapping this position waits for, if it
      // has not completed by then: recorded at need time instead, it would wait for all the work
      // queued. Recorded before the map, so that a failure to record leaves nothing mapped.
      const std::uint64_t seq = mark_after(*region->arena, b->freed_seq);
      if (!upstream_->map_from(pages.address_of(target.first), pages.address_of(p), unit, unit)) return mapped;
      stats_.num_device_alloc++;
      move_unit(region, source, target, seq);
      mapped += unit;
    }
  }
  return mapped;
}

}  // namespace gpumem
