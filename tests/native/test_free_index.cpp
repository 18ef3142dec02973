// free_index_tests: FreeIndex (free_index.hpp) and the SizeClassLists above 1 MiB
// (size_class_lists.hpp) on their own: best fit at the bin / class / bitmap-word boundaries, the last
// freed first among equal sizes, the largest-first walk, and a randomized run against a plain model
// (a sorted map of sizes to stacks of blocks) with the consistency checks after every step.
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "core/free_index.hpp"
#include "harness.hpp"

using namespace gpumem;

namespace {

struct FakeBlock {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  FakeBlock* bin_prev = nullptr;
  FakeBlock* bin_next = nullptr;
};

// Owns the blocks a test puts in an index.
struct Blocks {
  std::vector<std::unique_ptr<FakeBlock>> all;
  FakeBlock* make(std::size_t size) {
    all.push_back(std::make_unique<FakeBlock>());
    all.back()->size = size;
    all.back()->address = 0x10000 * all.size();
    return all.back().get();
  }
};

}  // namespace

TEST(bins_give_the_smallest_block_that_fits) {
  FreeIndex<FakeBlock> index;
  Blocks b;
  FakeBlock* b512 = b.make(512);
  FakeBlock* b4k = b.make(4 * KiB);
  FakeBlock* b1m = b.make(kBinnedLimit);  // exactly the limit: still binned
  index.insert(b4k);
  index.insert(b512);
  index.insert(b1m);
  CHECK_EQ(index.size(), std::size_t(3));
  CHECK(index.best_fit(512) == b512);
  CHECK(index.best_fit(1024) == b4k);
  CHECK(index.best_fit(4 * KiB) == b4k);
  CHECK(index.best_fit(4 * KiB + 512) == b1m);
  CHECK(index.best_fit(kBinnedLimit) == b1m);
  CHECK(index.best_fit(kBinnedLimit + 512) == nullptr);
  CHECK(index.contains(b512) && index.contains(b1m));
  CHECK(index.consistent());
  index.erase(b4k);
  CHECK(!index.contains(b4k));
  CHECK(index.best_fit(1024) == b1m);
  CHECK(index.consistent());
}

TEST(the_search_crosses_bitmap_words) {
  // Bin i holds blocks of i * 512 bytes; a word of the bitmap covers 64 bins.
  FreeIndex<FakeBlock> index;
  Blocks b;
  FakeBlock* bin63 = b.make(63 * 512);
  FakeBlock* bin64 = b.make(64 * 512);
  FakeBlock* bin2047 = b.make(2047 * 512);
  index.insert(bin2047);
  CHECK(index.best_fit(512) == bin2047);  // many empty words skipped
  index.insert(bin64);
  CHECK(index.best_fit(512) == bin64);
  CHECK(index.best_fit(64 * 512) == bin64);
  CHECK(index.best_fit(65 * 512) == bin2047);
  index.insert(bin63);
  CHECK(index.best_fit(63 * 512) == bin63);
  CHECK(index.best_fit(62 * 512) == bin63);
  index.erase(bin63);
  index.erase(bin64);
  CHECK(index.best_fit(512) == bin2047);
  index.erase(bin2047);
  CHECK(index.empty());
  CHECK(index.best_fit(512) == nullptr);
  CHECK(index.consistent());
}

TEST(equal_sizes_give_the_last_freed_first) {
  FreeIndex<FakeBlock> index;
  Blocks b;
  for (std::size_t size : {std::size_t(8 * KiB), 3 * MiB}) {
    FakeBlock* first = b.make(size);
    FakeBlock* second = b.make(size);
    FakeBlock* third = b.make(size);
    index.insert(first);
    index.insert(second);
    index.insert(third);
    CHECK(index.best_fit(size) == third);
    index.erase(third);
    CHECK(index.best_fit(size) == second);
    index.erase(first);  // from the tail
    CHECK(index.best_fit(size) == second);
    index.erase(second);
    CHECK(index.best_fit(size) == nullptr);
    CHECK(index.consistent());
  }
}

TEST(size_classes_give_a_true_best_fit) {
  // 4 MiB + {0, 8, 16} KiB share one class (a class spans 1/64 of a power of two): the pick is still
  // the smallest that fits, whatever order they were freed in.
  FreeIndex<FakeBlock> index;
  Blocks b;
  FakeBlock* x16 = b.make(4 * MiB + 16 * KiB);
  FakeBlock* x0 = b.make(4 * MiB);
  FakeBlock* x8 = b.make(4 * MiB + 8 * KiB);
  index.insert(x16);
  index.insert(x0);
  index.insert(x8);
  CHECK(index.best_fit(kBinnedLimit + 512) == x0);  // a request in a lower class
  CHECK(index.best_fit(4 * MiB) == x0);
  CHECK(index.best_fit(4 * MiB + 512) == x8);
  CHECK(index.best_fit(4 * MiB + 12 * KiB) == x16);
  CHECK(index.best_fit(4 * MiB + 16 * KiB + 512) == nullptr);
  // Either side of a power of two: 2 MiB - 512 and 2 MiB are in different classes.
  FakeBlock* below = b.make(2 * MiB - 512);
  FakeBlock* exact = b.make(2 * MiB);
  index.insert(exact);
  CHECK(index.best_fit(2 * MiB - 512) == exact);
  index.insert(below);
  CHECK(index.best_fit(2 * MiB - 512) == below);
  CHECK(index.best_fit(2 * MiB - 1024) == below);
  CHECK(index.best_fit(2 * MiB) == exact);
  // The largest request there is.
  FakeBlock* huge = b.make(kMaxRequest);
  index.insert(huge);
  CHECK(index.best_fit(kMaxRequest / 2 + 512) == huge);
  CHECK(index.best_fit(kMaxRequest) == huge);
  CHECK(index.consistent());
}

TEST(large_blocks_are_walked_largest_first) {
  FreeIndex<FakeBlock> index;
  Blocks b;
  for (std::size_t size : {3 * MiB, 64 * KiB, 200 * MiB, 2 * MiB, 3 * MiB + 512, 5 * GiB})
    index.insert(b.make(size));
  std::vector<std::size_t> seen;
  index.for_each_largest_first(kBinnedLimit + 512, [&](FakeBlock* x) { seen.push_back(x->size); });
  CHECK(seen == (std::vector<std::size_t>{5 * GiB, 200 * MiB, 3 * MiB + 512, 3 * MiB, 2 * MiB}));
  seen.clear();
  index.for_each_largest_first(3 * MiB, [&](FakeBlock* x) { seen.push_back(x->size); });
  CHECK(seen == (std::vector<std::size_t>{5 * GiB, 200 * MiB, 3 * MiB + 512, 3 * MiB}));
  std::size_t all = 0;
  index.for_each([&](FakeBlock*) { ++all; });
  CHECK_EQ(all, std::size_t(6));
}

// Pages of 1 MiB or less (a simulated device's) fit in binned blocks: walked after the lists, the
// largest bin first, down to the bound.
TEST(binned_blocks_are_walked_largest_first_down_to_the_bound) {
  FreeIndex<FakeBlock> index;
  Blocks b;
  for (std::size_t size : {1 * MiB, 64 * KiB, 2 * MiB, 512 * KiB, 32 * KiB, 1 * MiB, 4 * KiB})
    index.insert(b.make(size));
  std::vector<std::size_t> seen;
  index.for_each_largest_first(64 * KiB, [&](FakeBlock* x) { seen.push_back(x->size); });
  CHECK(seen == (std::vector<std::size_t>{2 * MiB, 1 * MiB, 1 * MiB, 512 * KiB, 64 * KiB}));
}

TEST(random_inserts_and_erases_agree_with_a_model) {
  FreeIndex<FakeBlock> index;
  Blocks b;
  std::map<std::size_t, std::vector<FakeBlock*>> model;  // size -> blocks, the last freed at the back
  std::vector<FakeBlock*> in;
  std::mt19937_64 rng(11);
  auto random_size = [&] {
    switch (rng() % 3) {
      case 0: return (1 + rng() % 2048) * 512;                // the bins
      case 1: return kBinnedLimit + (1 + rng() % 4096) * 512;  // just above
      default: return (1 + rng() % 20000) * 64 * KiB;         // up to ~1.2 GiB
    }
  };
  for (int step = 0; step < 20000; ++step) {
    if (in.empty() || rng() % 5 < 3) {
      FakeBlock* x = b.make(random_size());
      index.insert(x);
      model[x->size].push_back(x);
      in.push_back(x);
    } else {
      const std::size_t k = rng() % in.size();
      FakeBlock* x = in[k];
      in.erase(in.begin() + static_cast<std::ptrdiff_t>(k));
      index.erase(x);
      auto& stack = model[x->size];
      for (auto it = stack.begin(); it != stack.end(); ++it)
        if (*it == x) {
          stack.erase(it);
          break;
        }
      if (stack.empty()) model.erase(x->size);
    }
    const std::size_t want = random_size();
    auto it = model.lower_bound(want);
    FakeBlock* expected = it == model.end() ? nullptr : it->second.back();
    CHECK(index.best_fit(want) == expected);
    CHECK_EQ(index.size(), in.size());
    if (step % 500 == 0) {
      CHECK(index.consistent());
      for (FakeBlock* x : in) CHECK(index.contains(x));
    }
  }
  CHECK(index.consistent());
}
