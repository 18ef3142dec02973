// PageMap's walks over the page flags (page_map.hpp): runs, counts, and the holes arithmetic.
#include "page_map.hpp"

#include <algorithm>

namespace gpumem {

PageMap::PageMap(std::uintptr_t base, std::size_t bytes, std::size_t page, std::size_t group)
    : dense_end_(base), base_(base), page_(page), group_(group ? group : 1), pages_(bytes / page) {}

PageRun PageMap::whole_units(PageRun run) const {
  if (run.empty() || group_ == 1) return run;
  if (coarse(run.first) && run.first % group_) run.first = std::min(run.end, (run.first / group_ + 1) * group_);
  if (run.first < run.end && coarse(run.end - 1) && run.end % group_) run.end = std::max(run.first, run.end / group_ * group_);
  return run;
}

PageRun PageMap::next_uniform_run(std::size_t from, std::size_t end) const {
  PageRun run = next_mapped_run(from, end);
  if (run.empty() || group_ == 1) return run;
  const bool kind = coarse(run.first);
  std::size_t last = run.first;
  while (last < run.end && coarse(last) == kind) ++last;
  return PageRun{run.first, last};
}

std::size_t PageMap::count_unmapped(PageRun run) const {
  std::size_t n = 0;
  for (std::size_t p = run.first; p < std::min(run.end, mapped_.size()); ++p) n += mapped(p);
  return run.count() - n;
}

std::size_t PageMap::count_parked(PageRun run) const {
  std::size_t n = 0;
  for (std::size_t p = run.first; p < std::min(run.end, mapped_.size()); ++p) n += mapped_[p] == kParked;
  return n;
}

PageRun PageMap::next_parked_run(std::size_t from, std::size_t end) const {
  end = std::min(end, mapped_.size());
  std::size_t first = std::min(from, end);
  while (first < end && mapped_[first] != kParked) ++first;
  std::size_t last = first;
  while (last < end && mapped_[last] == kParked) ++last;
  return PageRun{first, last};
}

PageRun PageMap::next_run(std::size_t from, std::size_t end, std::uint8_t state) const {
  std::size_t first = from;
  while (first < end && mapped(first) != (state != 0)) ++first;
  std::size_t last = first;
  while (last < end && mapped(last) == (state != 0)) ++last;
  return PageRun{first, last};
}

void PageMap::mark_mapped(PageRun run, bool coarse) {
  if (run.end > mapped_.size()) mapped_.resize(run.end, kUnmapped);
  std::fill(mapped_.begin() + static_cast<std::ptrdiff_t>(run.first),
            mapped_.begin() + static_cast<std::ptrdiff_t>(run.end), coarse && group_ > 1 ? kCoarse : kSingle);
  const std::size_t old_limit = mapped_limit_;
  holes_ -= std::min(run.end, old_limit) - std::min(run.first, old_limit);  // holes filled
  holes_ += run.first > old_limit ? run.first - old_limit : 0;              // gap left below
  mapped_limit_ = std::max(old_limit, run.end);
  update_dense_end();
}

void PageMap::mark_unmapped(PageRun run) {
  std::fill(mapped_.begin() + static_cast<std::ptrdiff_t>(run.first),
            mapped_.begin() + static_cast<std::ptrdiff_t>(run.end), kUnmapped);
  holes_ += run.count();  // mapped pages always lie below mapped_limit
  update_dense_end();
}

void PageMap::mark_parked(PageRun run) {
  std::fill(mapped_.begin() + static_cast<std::ptrdiff_t>(run.first),
            mapped_.begin() + static_cast<std::ptrdiff_t>(run.end), kParked);
  holes_ += run.count();
  update_dense_end();
}

void PageMap::mark_unparked(PageRun run) {
  std::fill(mapped_.begin() + static_cast<std::ptrdiff_t>(run.first),
            mapped_.begin() + static_cast<std::ptrdiff_t>(run.end), kUnmapped);
}

std::size_t PageMap::mapped_bytes_in(std::uintptr_t address, std::size_t bytes) const {
  const PageRun run = touched(address, bytes);
  std::size_t backed = 0;
  for (std::size_t p = run.first; p < std::min(run.end, mapped_limit_); ++p) {
    if (!mapped(p)) continue;
    const std::uintptr_t lo = std::max<std::uintptr_t>(address, address_of(p));
    const std::uintptr_t hi = std::min<std::uintptr_t>(address + bytes, address_of(p + 1));
    backed += hi - lo;
  }
  return backed;
}

std::size_t PageMap::longest_mapped_run_in(std::uintptr_t address, std::size_t bytes) const {
  std::size_t best = 0;
  std::uintptr_t run_start = address;
  const std::uintptr_t end = std::min<std::uintptr_t>(address + bytes, address_of(mapped_limit_));
  for (std::uintptr_t a = address; a < end;) {
    const std::size_t p = (a - base_) / page_;
    const std::uintptr_t page_end = std::min<std::uintptr_t>(end, address_of(p + 1));
    if (!mapped(p)) run_start = page_end;
    else best = std::max<std::size_t>(best, page_end - run_start);
    a = page_end;
  }
  return best;
}

std::size_t PageMap::mapped_bytes() const {
  return static_cast<std::size_t>(std::count_if(mapped_.begin(), mapped_.end(),
                                                [](std::uint8_t f) { return f == kSingle || f == kCoarse; })) * page_;
}

const char* PageMap::inconsistency() const {
  if (mapped_limit_ > pages_ || mapped_.size() > pages_) return "mapped_limit past the region's last page";
  if (mapped_.size() < mapped_limit_) return "page flags end below mapped_limit";
  const auto limit = mapped_.begin() + static_cast<std::ptrdiff_t>(mapped_limit_);
  if (std::find_if(limit, mapped_.end(), [](std::uint8_t f) { return f != kUnmapped; }) != mapped_.end())
    return "mapped page above mapped_limit";
  if (static_cast<std::size_t>(std::count_if(mapped_.begin(), limit, [](std::uint8_t f) {
        return f == kUnmapped || f == kParked;
      })) != holes_)
    return "hole count disagrees with the page map";
  if (dense_end_ != (holes_ == 0 ? base_ + mapped_limit_ * page_ : base_))
    return "the fast path's mapped bound disagrees with mapped_limit and holes";
  if (pages_ % group_) return "the region is not whole groups";
  for (std::size_t g = 0; g < mapped_limit_; g += group_) {  // none at or past it is mapped
    std::size_t n = 0;
    for (std::size_t p = g; p < g + group_; ++p) n += coarse(p);
    if (n != 0 && n != group_) return "a group unit is not whole";
  }
  return nullptr;
}

}  // namespace gpumem
