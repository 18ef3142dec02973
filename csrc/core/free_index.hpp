// The free blocks of one arena, found by size. Blocks up to kBinnedLimit sit in exact-size bins
// (512-byte steps; doubly linked lists, with a bitmap of the non-empty bins), so inserting, removing
// and finding the best fit for them is O(1) and touches no allocator; larger blocks sit in a set
// ordered by (size, address), O(log n). Training asks for the same small sizes over and over, so most
// operations land in the bins.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "types.hpp"

namespace gpumem {

// Blocks up to this size are binned; above it they go to the ordered set. It is below every page
// size, so the blocks whose pages can be released are all in the set.
constexpr std::size_t kBinnedLimit = 1 * MiB;

// `Block` needs: size, address, bin_prev, bin_next (Block*), position (Set::iterator).
// `Set` is an ordered set of Block* by (size, address).
template <typename Block, typename Set>
class FreeIndex {
 public:
  explicit FreeIndex(Set set) : set_(std::move(set)) {}

  void insert(Block* b) {
    if (b->size > kBinnedLimit) {
      b->position = set_.insert(b).first;
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
      set_.erase(b->position);
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
    Block key;
    key.size = size;
    key.address = 0;
    auto it = set_.lower_bound(&key);
    return it == set_.end() ? nullptr : *it;
  }

  std::size_t size() const { return binned_ + set_.size(); }
  bool empty() const { return size() == 0; }

  // The set's blocks (all of size > kBinnedLimit), largest first.
  const Set& large() const { return set_; }

  Block* largest() const {
    if (!set_.empty()) return *set_.rbegin();
    for (std::size_t w = kWords; w-- > 0;)
      if (bits_[w]) return heads_[w * 64 + 63 - static_cast<std::size_t>(__builtin_clzll(bits_[w]))];
    return nullptr;
  }

  template <typename F>
  void for_each(F&& f) const {
    for (Block* b : set_) f(b);
    for (std::size_t i = 0; i < kBins; ++i)
      for (Block* b = heads_[i]; b; b = b->bin_next) f(b);
  }

  // For the invariant checker: whether `b` is where its size says it must be.
  bool contains(const Block* b) const {
    if (b->size > kBinnedLimit) return set_.count(const_cast<Block*>(b)) == 1;
    for (const Block* x = heads_[bin_of(b->size)]; x; x = x->bin_next)
      if (x == b) return true;
    return false;
  }

  // For the invariant checker: every bin holds only blocks of its size and the bitmap matches.
  bool bins_consistent() const {
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

  Set set_;
  std::array<Block*, kBins> heads_{};
  std::array<std::uint64_t, kWords> bits_{};
  std::size_t binned_ = 0;
};

}  // namespace gpumem
