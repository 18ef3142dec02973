// The page map of one paged region (CUDA virtual memory): which of the region's pages are mapped, and
// every question the pool asks about them. It owns the per-page flags and two summaries kept in step
// with them: `mapped_limit` (no page at or past it has ever been mapped) and `holes` (unmapped pages
// below mapped_limit). With them the allocation fast path (below_mapped_limit) is one comparison.
// It never calls the upstream: the pool maps or unmaps pages, then records it here (mark_mapped /
// mark_unmapped). Pages are indexed from the region's base; a PageRun is a half-open range of them.
// A "parked" page is mapped by the driver to a physical unit that other pages of the region own
// (Pool::Alias, pool_alias.cpp): for everything here it counts as unmapped (a hole, not reserved),
// and the pool either takes the unit back for it without a driver call or unmaps it first.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace gpumem {

// Pages [first, end) of one region.
struct PageRun {
  std::size_t first = 0;
  std::size_t end = 0;
  std::size_t count() const { return end - first; }
  bool empty() const { return end == first; }
};

class PageMap {
 public:
  PageMap() = default;  // no pages (a region of segments)
  // `bytes` pages of `page` bytes each from `base`, none mapped; groups of `group` pages (>= 1).
  // `page` > 0 and `group * page` divide `bytes`.
  PageMap(std::uintptr_t base, std::size_t bytes, std::size_t page, std::size_t group = 1);

  std::size_t page() const { return page_; }
  std::size_t group() const { return group_; }
  // Whether mapped page `p` belongs to a group unit (false for single-page units and unmapped pages).
  bool coarse(std::size_t p) const { return p < mapped_.size() && mapped_[p] == kCoarse; }
  // The bytes of the unit that holds mapped page `p`.
  std::size_t unit_bytes(std::size_t p) const { return coarse(p) ? group_ * page_ : page_; }
  // The groups [first / group, ...) that `run` touches, as pages: `run` widened to group boundaries.
  PageRun widened(PageRun run) const {
    return PageRun{run.first / group_ * group_, (run.end + group_ - 1) / group_ * group_};
  }
  // `run` (mapped pages) narrowed to whole units: a group unit it holds only part of is left out.
  PageRun whole_units(PageRun run) const;
  // The first run of mapped pages in [from, end) whose units are all of one size, as long as it goes.
  PageRun next_uniform_run(std::size_t from, std::size_t end) const;
  std::size_t pages() const { return pages_; }
  std::size_t mapped_limit() const { return mapped_limit_; }
  std::size_t holes() const { return holes_; }
  bool mapped(std::size_t p) const { return p < mapped_.size() && (mapped_[p] == kSingle || mapped_[p] == kCoarse); }
  bool parked(std::size_t p) const { return p < mapped_.size() && mapped_[p] == kParked; }
  std::size_t count_parked(PageRun run) const;
  // The first run of parked pages in [from, end); an empty run at `end` when there is none.
  PageRun next_parked_run(std::size_t from, std::size_t end) const;
  std::uintptr_t address_of(std::size_t p) const { return base_ + p * page_; }
  std::size_t bytes_of(PageRun run) const { return run.count() * page_; }

  // Whether [address, address + bytes) (bytes > 0) lies on mapped pages, decided without a walk or a
  // division: no page below mapped_limit was ever unmapped, and the range ends at or below it. False
  // says nothing (ask count_unmapped); the allocation hot path asks this first.
  bool below_mapped_limit(std::uintptr_t address, std::size_t bytes) const {
    return address + bytes <= dense_end_;
  }

  // The pages [address, address + bytes) touches, partly or wholly (bytes > 0, inside the region).
  PageRun touched(std::uintptr_t address, std::size_t bytes) const {
    return PageRun{(address - base_) / page_, (address + bytes - 1 - base_) / page_ + 1};
  }
  // The pages wholly inside [address, address + bytes) (bytes > 0, inside the region); empty when none.
  PageRun covered(std::uintptr_t address, std::size_t bytes) const {
    const std::size_t first = (address - base_ + page_ - 1) / page_;
    return PageRun{first, std::max(first, (address + bytes - base_) / page_)};
  }
  // The pages wholly inside [address, address + bytes) that lie below mapped_limit: those that can be
  // unmapped under a free block of that range. Empty when there are none.
  PageRun inside(std::uintptr_t address, std::size_t bytes) const {
    const PageRun all = covered(address, bytes);
    return PageRun{all.first, std::max(all.first, std::min(all.end, mapped_limit_))};
  }

  std::size_t count_unmapped(PageRun run) const;
  // The first run of unmapped (mapped) pages in [from, end), as long as it goes before `end`; an empty
  // run at `end` when there is none.
  PageRun next_unmapped_run(std::size_t from, std::size_t end) const { return next_run(from, end, 0); }
  PageRun next_mapped_run(std::size_t from, std::size_t end) const { return next_run(from, end, 1); }
  // The longest run of mapped pages that holds `run` (whose pages are all mapped).
  PageRun mapped_run_around(PageRun run) const {
    while (run.first > 0 && mapped(run.first - 1)) --run.first;
    while (run.end < mapped_limit_ && mapped(run.end)) ++run.end;
    return run;
  }

  // Records that the pages of `run`, all unmapped or parked, are now mapped: holes below mapped_limit are
  // filled, the pages skipped between mapped_limit and the run become holes, and mapped_limit moves
  // to the run's end if it lies beyond.
  // `coarse`: the run is whole groups, mapped as group units.
  void mark_mapped(PageRun run, bool coarse = false);
  // Records that the pages of `run`, all mapped (so below mapped_limit), are unmapped: holes now.
  void mark_unmapped(PageRun run);
  // Records that the mapped pages of `run` now alias a unit other pages own: holes, as unmapped ones.
  void mark_parked(PageRun run);
  // Records that the parked pages of `run` were unmapped by the driver (still holes).
  void mark_unparked(PageRun run);

  // Bytes of [address, address + bytes) that lie on mapped pages.
  std::size_t mapped_bytes_in(std::uintptr_t address, std::size_t bytes) const;
  // The longest part of [address, address + bytes) that lies on consecutive mapped pages, in bytes.
  std::size_t longest_mapped_run_in(std::uintptr_t address, std::size_t bytes) const;
  // Bytes of all mapped pages: the region's reserved bytes.
  std::size_t mapped_bytes() const;

  // For the invariant checker: null when the flags, mapped_limit, holes and the fast path's bound
  // agree; otherwise what disagrees.
  const char* inconsistency() const;

 private:
  PageRun next_run(std::size_t from, std::size_t end, std::uint8_t state) const;
  void update_dense_end() { dense_end_ = holes_ == 0 ? base_ + mapped_limit_ * page_ : base_; }

  std::uintptr_t dense_end_ = 0;  // base + mapped_limit * page while there are no holes, else base
  std::uintptr_t base_ = 0;
  std::size_t page_ = 0;
  std::size_t group_ = 1;
  std::size_t mapped_limit_ = 0;  // no page at or past this index has ever been mapped
  std::size_t holes_ = 0;         // unmapped pages below mapped_limit
  // One flag per page up to the highest page ever mapped (pages past it are unmapped): a region
  // spans four times the device, and only what is used is allocated (and faulted in) on the host.
  // kCoarse: part of a group unit; kParked: mapped by the driver to a unit other pages own (a hole here).
  static constexpr std::uint8_t kUnmapped = 0, kSingle = 1, kCoarse = 2, kParked = 3;
  std::vector<std::uint8_t> mapped_;
  std::size_t pages_ = 0;
};

}  // namespace gpumem
