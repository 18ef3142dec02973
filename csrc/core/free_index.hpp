// The free blocks of one arena, found by size. Blocks up to kBinnedLimit sit in exact-size bins
// (512-byte steps; doubly linked lists, with a bitmap of the non-empty bins), so inserting, removing
// and finding the best fit for them is O(1) and touches no allocator; larger blocks sit in sorted size
// class lists (size_class_lists.hpp), which give a true best fit without a tree's allocations and
// pointer chasing.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "size_class_lists.hpp"
#include "types.hpp"

namespace gpumem {

// Blocks up to this size are binned; above it they go to the size class lists. It is below CUDA's
// pages (2 MiB), so on a GPU the blocks whose pages can be released are all in the lists; a simulated
// device's smaller pages fit in binned blocks too (for_each_largest_first walks both).
constexpr std::size_t kBinnedLimit = 1 * MiB;

// `Block` needs: size, address, bin_prev, bin_next (Block*).
template <typename Block>
class FreeIndex {
 public:
  void insert(Block* b) {
    if (b->size > kBinnedLimit) {
      large_.insert(b);
      return;
    }
    const std::size_t i = bin_of(b->size);
    b->bin_prev = nullptr;
    b->bin_next = heads_[i];
    if (heads_[i]) heads_[i]->bin_prev = b;
    else bits_[i / 64] |= std::uint64_t(1) << (i % 64);
    heads_[i] = b;
    ++binned_;
  }

  // `b` must be in the index, with the size it was inserted with.
  void erase(Block* b) {
    if (b->size > kBinnedLimit) {
      large_.erase(b);
      return;
    }
    const std::size_t i = bin_of(b->size);
    if (b->bin_prev) {
      b->bin_prev->bin_next = b->bin_next;
    } else {
      heads_[i] = b->bin_next;
      if (!heads_[i]) bits_[i / 64] &= ~(std::uint64_t(1) << (i % 64));
    }
    if (b->bin_next) b->bin_next->bin_prev = b->bin_prev;
    b->bin_prev = b->bin_next = nullptr;
    --binned_;
  }

  // The smallest block of at least `size` bytes (a multiple of 512), or nullptr.
  Block* best_fit(std::size_t size) const {
    if (size <= kBinnedLimit && binned_) {
      std::size_t w = bin_of(size) / 64;
      std::uint64_t word = bits_[w] & (~std::uint64_t(0) << (bin_of(size) % 64));
      for (;;) {
        if (word) return heads_[w * 64 + static_cast<std::size_t>(__builtin_ctzll(word))];
        if (++w == kWords) break;
        word = bits_[w];
      }
    }
    return large_.best_fit(size);
  }

  // Calls f(b) on the blocks of at least `size` bytes (a multiple of 512), smallest first, the first
  // one being best_fit's, until f returns false.
  template <typename F>
  void for_each_fit(std::size_t size, F&& f) const {
    if (size <= kBinnedLimit && binned_) {
      for (std::size_t i = bin_of(size); i < kBins; ++i)
        for (Block* b = heads_[i]; b; b = b->bin_next)
          if (!f(b)) return;
    }
    large_.for_each_fit(size, f);
  }

  std::size_t size() const { return binned_ + large_.size(); }
  bool empty() const { return size() == 0; }

  // Calls f(b) on the blocks of at least `size` bytes, largest first: the lists', then the bins' from
  // the largest down (only where `size` is within the bins: a simulated device's pages of 1 MiB or
  // less; CUDA's 2 MiB pages are above them).
  template <typename F>
  void for_each_largest_first(std::size_t size, F&& f) const {
    large_.for_each_largest_first([&](Block* b) {
      if (b->size >= size) f(b);
    });
    if (size <= kBinnedLimit && binned_)
      for (std::size_t i = kBins; i-- > bin_of(size);)
        for (Block* b = heads_[i]; b; b = b->bin_next) f(b);
  }

  template <typename F>
  void for_each(F&& f) const {
    large_.for_each_largest_first(f);
    for (std::size_t i = 0; i < kBins; ++i)
      for (Block* b = heads_[i]; b; b = b->bin_next) f(b);
  }

  // For the invariant checker: whether `b` is where its size says it must be.
  bool contains(const Block* b) const {
    if (b->size > kBinnedLimit) return large_.contains(b);
    for (const Block* x = heads_[bin_of(b->size)]; x; x = x->bin_next)
      if (x == b) return true;
    return false;
  }

  // For the invariant checker: every bin holds only blocks of its size and the bitmap matches, and
  // the size class lists are consistent.
  bool consistent() const {
    if (!large_.consistent()) return false;
    std::size_t n = 0;
    for (std::size_t i = 0; i < kBins; ++i) {
      const bool bit = (bits_[i / 64] >> (i % 64)) & 1;
      if (bit != (heads_[i] != nullptr)) return false;
      const Block* prev = nullptr;
      for (const Block* b = heads_[i]; b; prev = b, b = b->bin_next, ++n)
        if (bin_of(b->size) != i || b->size > kBinnedLimit || b->bin_prev != prev) return false;
    }
    return n == binned_;
  }

 private:
  static constexpr std::size_t kBins = kBinnedLimit / kAlignment + 1;  // bin i: blocks of i * 512 bytes
  static constexpr std::size_t kWords = (kBins + 63) / 64;
  static std::size_t bin_of(std::size_t size) { return size / kAlignment; }

  SizeClassLists<Block, kBinnedLimit> large_;
  std::array<Block*, kBins> heads_{};
  std::array<std::uint64_t, kWords> bits_{};
  std::size_t binned_ = 0;
};

}  // namespace gpumem
