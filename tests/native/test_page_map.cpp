// page_map_tests: PageMap (page_map.hpp) on its own: which pages a range touches or holds wholly at
// page boundaries, the holes arithmetic as runs are mapped below, across and beyond mapped_limit and
// unmapped again, the allocation fast path's bound, byte counts and runs over partly mapped ranges,
// and the self-check the invariant checker relies on.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/page_map.hpp"
#include "core/types.hpp"
#include "harness.hpp"

using namespace gpumem;

namespace {

constexpr std::uintptr_t kBase = 0x7f0000000000;
constexpr std::size_t kPage = 2 * MiB;

std::uintptr_t at(std::size_t page, std::size_t offset = 0) { return kBase + page * kPage + offset; }

std::string text(PageRun r) { return "[" + std::to_string(r.first) + ", " + std::to_string(r.end) + ")"; }

#define CHECK_RUN(run, first, end) CHECK_EQ(text(run), text(PageRun{first, end}))

// Every run of mapped pages below mapped_limit, as next_mapped_run yields them.
std::vector<std::pair<std::size_t, std::size_t>> mapped_runs(const PageMap& m) {
  std::vector<std::pair<std::size_t, std::size_t>> runs;
  for (PageRun r = m.next_mapped_run(0, m.mapped_limit()); !r.empty(); r = m.next_mapped_run(r.end, m.mapped_limit()))
    runs.emplace_back(r.first, r.end);
  return runs;
}

void check_consistent(const PageMap& m) {
  const char* wrong = m.inconsistency();
  CHECK_EQ(std::string(wrong ? wrong : "consistent"), std::string("consistent"));
}

}  // namespace

TEST(a_new_map_has_no_mapped_page) {
  PageMap m(kBase, 16 * kPage, kPage);
  CHECK_EQ(m.pages(), std::size_t(16));
  CHECK_EQ(m.page(), kPage);
  CHECK_EQ(m.mapped_limit(), std::size_t(0));
  CHECK_EQ(m.holes(), std::size_t(0));
  CHECK_EQ(m.mapped_bytes(), std::size_t(0));
  CHECK_EQ(m.count_unmapped(PageRun{0, 16}), std::size_t(16));
  CHECK(!m.below_mapped_limit(kBase, 512));
  CHECK_RUN(m.next_unmapped_run(0, 16), 0, 16);
  CHECK_RUN(m.next_mapped_run(0, 16), 16, 16);  // none: an empty run at the end
  CHECK(m.next_mapped_run(3, 9).empty());
  CHECK_EQ(m.mapped_bytes_in(kBase, 16 * kPage), std::size_t(0));
  CHECK_EQ(m.longest_mapped_run_in(kBase, 16 * kPage), std::size_t(0));
  CHECK_EQ(m.address_of(3), at(3));
  CHECK_EQ(m.bytes_of(PageRun{2, 5}), 3 * kPage);
  check_consistent(m);
}

TEST(touched_pages_at_page_boundaries) {
  PageMap m(kBase, 16 * kPage, kPage);
  CHECK_RUN(m.touched(at(0), kPage), 0, 1);              // exactly one page
  CHECK_RUN(m.touched(at(0), kPage + 512), 0, 2);        // one byte-block into the next
  CHECK_RUN(m.touched(at(1), kPage), 1, 2);
  CHECK_RUN(m.touched(at(0, kPage - 512), 1024), 0, 2);  // straddles a boundary
  CHECK_RUN(m.touched(at(3, kPage - 512), 512), 3, 4);   // the last 512 bytes of a page
  CHECK_RUN(m.touched(at(15), kPage), 15, 16);           // the region's last page
  CHECK_RUN(m.touched(at(0), 16 * kPage), 0, 16);
}

TEST(pages_inside_a_range_are_whole_and_below_mapped_limit) {
  PageMap m(kBase, 16 * kPage, kPage);
  CHECK(m.inside(at(0), 16 * kPage).empty());  // nothing was ever mapped: nothing to unmap
  m.mark_mapped(PageRun{0, 6});
  CHECK_RUN(m.inside(at(0), 6 * kPage), 0, 6);
  CHECK_RUN(m.inside(at(0, 512), 3 * kPage - 512), 1, 3);  // partial first page left out
  CHECK_RUN(m.inside(at(1), 2 * kPage - 512), 1, 2);       // partial last page left out
  CHECK_RUN(m.inside(at(2), 10 * kPage), 2, 6);            // clipped at mapped_limit
  CHECK(m.inside(at(0, 512), kPage).empty());              // straddles two pages, holds neither
  CHECK(m.inside(at(1, 512), 1024).empty());               // inside one page
  CHECK(m.inside(at(7), 2 * kPage).empty());               // beyond mapped_limit
}

TEST(mapping_from_the_start_keeps_the_fast_path) {
  PageMap m(kBase, 16 * kPage, kPage);
  m.mark_mapped(PageRun{0, 4});
  CHECK_EQ(m.mapped_limit(), std::size_t(4));
  CHECK_EQ(m.holes(), std::size_t(0));
  CHECK(m.below_mapped_limit(at(0), 4 * kPage));
  CHECK(m.below_mapped_limit(at(3), kPage));
  CHECK(m.below_mapped_limit(at(4) - 512, 512));   // ends exactly at the limit
  CHECK(!m.below_mapped_limit(at(4) - 512, 1024));  // one block past it
  CHECK(!m.below_mapped_limit(at(4), 512));
  m.mark_mapped(PageRun{4, 5});  // growing in place
  CHECK_EQ(m.mapped_limit(), std::size_t(5));
  CHECK(m.below_mapped_limit(at(4), kPage));
  CHECK_EQ(m.mapped_bytes(), 5 * kPage);
  check_consistent(m);
}

TEST(holes_arithmetic_as_runs_are_mapped_and_unmapped) {
  PageMap m(kBase, 16 * kPage, kPage);
  m.mark_mapped(PageRun{0, 4});
  m.mark_mapped(PageRun{6, 8});  // beyond the limit: pages 4 and 5 are left as holes
  CHECK_EQ(m.mapped_limit(), std::size_t(8));
  CHECK_EQ(m.holes(), std::size_t(2));
  CHECK(!m.below_mapped_limit(at(0), kPage));  // any hole turns the fast path off
  CHECK_EQ(m.count_unmapped(PageRun{0, 8}), std::size_t(2));
  CHECK_EQ(m.count_unmapped(PageRun{3, 7}), std::size_t(2));
  CHECK_RUN(m.next_unmapped_run(0, 8), 4, 6);
  check_consistent(m);

  m.mark_mapped(PageRun{4, 5});  // half the gap
  CHECK_EQ(m.holes(), std::size_t(1));
  CHECK_EQ(m.mapped_limit(), std::size_t(8));
  m.mark_mapped(PageRun{5, 6});  // the rest: dense again
  CHECK_EQ(m.holes(), std::size_t(0));
  CHECK(m.below_mapped_limit(at(0), 8 * kPage));
  check_consistent(m);

  m.mark_unmapped(PageRun{2, 3});  // a page in the middle goes back: a hole; the limit stays
  CHECK_EQ(m.holes(), std::size_t(1));
  CHECK_EQ(m.mapped_limit(), std::size_t(8));
  CHECK(!m.below_mapped_limit(at(6), kPage));
  m.mark_unmapped(PageRun{7, 8});  // the top page too: still below the limit, a hole
  CHECK_EQ(m.holes(), std::size_t(2));
  CHECK_EQ(m.mapped_limit(), std::size_t(8));
  check_consistent(m);

  m.mark_mapped(PageRun{10, 12});  // beyond again: pages 8 and 9 join the holes
  CHECK_EQ(m.holes(), std::size_t(4));
  CHECK_EQ(m.mapped_limit(), std::size_t(12));
  m.mark_mapped(PageRun{7, 10});  // fills three holes, one of them the old top page
  CHECK_EQ(m.holes(), std::size_t(1));
  m.mark_mapped(PageRun{2, 3});
  CHECK_EQ(m.holes(), std::size_t(0));
  CHECK(m.below_mapped_limit(at(0), 12 * kPage));
  CHECK_EQ(m.mapped_bytes(), 12 * kPage);
  check_consistent(m);
}

TEST(a_run_that_fills_a_hole_and_extends_past_the_limit) {
  PageMap m(kBase, 16 * kPage, kPage);
  m.mark_mapped(PageRun{0, 4});
  m.mark_unmapped(PageRun{3, 4});  // hole at the top page
  CHECK_EQ(m.holes(), std::size_t(1));
  m.mark_mapped(PageRun{3, 6});    // the hole plus two new pages
  CHECK_EQ(m.holes(), std::size_t(0));
  CHECK_EQ(m.mapped_limit(), std::size_t(6));
  m.mark_unmapped(PageRun{0, 6});  // everything back: six holes, nothing mapped
  CHECK_EQ(m.holes(), std::size_t(6));
  CHECK_EQ(m.mapped_bytes(), std::size_t(0));
  CHECK(m.inside(at(0), 16 * kPage).count() == 6);  // still below the limit, none mapped
  CHECK(m.next_mapped_run(0, m.mapped_limit()).empty());
  m.mark_mapped(PageRun{15, 16});  // the region's last page: the gap 6..14 becomes holes
  CHECK_EQ(m.holes(), std::size_t(15));
  CHECK_EQ(m.mapped_limit(), std::size_t(16));
  check_consistent(m);
}

TEST(runs_of_mapped_and_unmapped_pages) {
  PageMap m(kBase, 16 * kPage, kPage);
  m.mark_mapped(PageRun{0, 3});
  m.mark_mapped(PageRun{5, 6});
  m.mark_mapped(PageRun{8, 11});
  using Runs = std::vector<std::pair<std::size_t, std::size_t>>;
  CHECK(mapped_runs(m) == (Runs{{0, 3}, {5, 6}, {8, 11}}));
  CHECK_RUN(m.next_mapped_run(1, 11), 1, 3);    // starts inside a run
  CHECK_RUN(m.next_mapped_run(0, 2), 0, 2);     // cut at `end`
  CHECK_RUN(m.next_mapped_run(3, 11), 5, 6);
  CHECK_RUN(m.next_mapped_run(6, 8), 8, 8);     // none before `end`
  CHECK_RUN(m.next_unmapped_run(0, 16), 3, 5);
  CHECK_RUN(m.next_unmapped_run(6, 16), 6, 8);
  CHECK_RUN(m.next_unmapped_run(11, 16), 11, 16);  // beyond the limit, never mapped
  CHECK_RUN(m.next_unmapped_run(8, 11), 11, 11);
}

TEST(mapped_bytes_and_longest_mapped_run_of_a_range) {
  PageMap m(kBase, 16 * kPage, kPage);
  m.mark_mapped(PageRun{0, 2});  // pages 0, 1 mapped; 2 not; 3 mapped; 4.. never
  m.mark_mapped(PageRun{3, 4});
  // Half of page 0, all of page 1, none of 2, half of page 3.
  const std::uintptr_t from = at(0, kPage / 2);
  const std::size_t bytes = at(3, kPage / 2) - from;
  CHECK_EQ(m.mapped_bytes_in(from, bytes), kPage / 2 + kPage + kPage / 2);
  CHECK_EQ(m.longest_mapped_run_in(from, bytes), kPage / 2 + kPage);
  CHECK_EQ(m.mapped_bytes_in(at(2), kPage), std::size_t(0));
  CHECK_EQ(m.longest_mapped_run_in(at(2), kPage), std::size_t(0));
  CHECK_EQ(m.mapped_bytes_in(at(1, 512), 512), std::size_t(512));  // inside one mapped page
  CHECK_EQ(m.longest_mapped_run_in(at(1, 512), 512), std::size_t(512));
  // Past mapped_limit nothing counts, even in a range that starts below it.
  CHECK_EQ(m.mapped_bytes_in(at(3), 5 * kPage), kPage);
  CHECK_EQ(m.longest_mapped_run_in(at(3), 5 * kPage), kPage);
  CHECK_EQ(m.longest_mapped_run_in(at(0), 16 * kPage), 2 * kPage);
  CHECK_EQ(m.mapped_bytes(), 3 * kPage);
}

TEST(a_region_the_size_of_four_devices) {
  // Replay's large arenas: 4 x 141 GiB of address space in 8 MiB pages.
  const std::size_t page = 8 * MiB, bytes = round_up(4 * 141 * GiB, page);
  PageMap m(kBase, bytes, page);
  CHECK_EQ(m.pages(), bytes / page);
  const std::size_t last = m.pages() - 1;
  m.mark_mapped(PageRun{0, 1});
  m.mark_mapped(PageRun{last, last + 1});
  CHECK_EQ(m.holes(), last - 1);
  CHECK_EQ(m.mapped_limit(), m.pages());
  CHECK_EQ(m.longest_mapped_run_in(m.address_of(last), page), page);
  CHECK_EQ(m.mapped_bytes_in(kBase, bytes), 2 * page);
  m.mark_unmapped(PageRun{last, last + 1});
  CHECK_EQ(m.holes(), last);
  check_consistent(m);
}

TEST(the_self_check_catches_a_run_marked_mapped_twice) {
  PageMap m(kBase, 16 * kPage, kPage);
  m.mark_mapped(PageRun{0, 4});
  m.mark_unmapped(PageRun{1, 2});
  check_consistent(m);
  // Breaking mark_mapped's precondition (page 0 is already mapped) miscounts the holes, and the
  // check the pool's validate() runs says so.
  m.mark_mapped(PageRun{0, 2});
  const char* wrong = m.inconsistency();
  CHECK(wrong != nullptr);
  CHECK_EQ(std::string(wrong), std::string("hole count disagrees with the page map"));
}

// ---- units: pages mapped as groups (one physical allocation) or one by one -----------------------

TEST(units_are_whole_groups_or_single_pages) {
  PageMap m(kBase, 16 * kPage, kPage, 4);  // groups of four pages: [0,4) [4,8) [8,12) [12,16)
  CHECK_EQ(m.group(), std::size_t(4));
  CHECK_RUN(m.widened(PageRun{5, 9}), 4, 12);
  CHECK_RUN(m.widened(PageRun{4, 8}), 4, 8);
  m.mark_mapped(PageRun{0, 8}, /*coarse=*/true);  // two groups
  m.mark_mapped(PageRun{9, 11});                  // two single pages in the third group
  check_consistent(m);
  CHECK(m.coarse(0) && m.coarse(7) && !m.coarse(9) && !m.coarse(12));
  CHECK_EQ(m.unit_bytes(5), 4 * kPage);
  CHECK_EQ(m.unit_bytes(9), kPage);
  // A run narrowed to whole units: a group it holds only part of is left out, single pages stay.
  CHECK_RUN(m.whole_units(PageRun{2, 11}), 4, 11);
  CHECK_RUN(m.whole_units(PageRun{0, 6}), 0, 4);
  CHECK(m.whole_units(PageRun{1, 3}).empty());
  CHECK_RUN(m.whole_units(PageRun{9, 10}), 9, 10);
  // Runs of one unit size: the two groups, then the single pages.
  CHECK_RUN(m.next_uniform_run(0, 16), 0, 8);
  CHECK_RUN(m.next_uniform_run(8, 16), 9, 11);
  CHECK_RUN(m.next_uniform_run(2, 16), 2, 8);
  // Unmapping clears the group flags with the pages.
  m.mark_unmapped(PageRun{4, 8});
  CHECK(!m.coarse(4));
  check_consistent(m);
  m.mark_mapped(PageRun{4, 6});  // single pages where a group was
  CHECK_RUN(m.next_uniform_run(0, 16), 0, 4);
  CHECK_RUN(m.next_uniform_run(4, 16), 4, 6);
  check_consistent(m);
}

TEST(the_self_check_catches_a_group_unit_that_is_not_whole) {
  PageMap m(kBase, 8 * kPage, kPage, 4);
  m.mark_mapped(PageRun{0, 2}, /*coarse=*/true);  // half a group flagged as one allocation
  const char* wrong = m.inconsistency();
  CHECK_EQ(std::string(wrong ? wrong : "consistent"), std::string("a group unit is not whole"));
}
