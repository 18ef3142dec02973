// Free blocks above kBinnedLimit, found by best fit without a tree. Like TLSF: sizes fall into classes
// of 64 per power of two (a class spans 1/64 of its size, e.g. 16 KiB at 1 MiB, 1 MiB at 64 MiB); a
// bitmap per power of two and one over the powers find the next non-empty class in a few instructions.
// Unlike TLSF, each class's list is kept sorted by size, so the result is a true best fit: the smallest
// block of at least the request; among equal sizes the last freed (as in the exact-size bins below
// 1 MiB; on the recorded traces it fragments exactly as the lowest address did). Lists are short (few
// free blocks share 1/64 of a size), and an insert walks only past smaller blocks of its class, so even
// thousands of free blocks of one size (a cache of equal tensors, half freed) insert in O(1).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "types.hpp"

namespace gpumem {

// `Block` needs: size, address, bin_prev, bin_next (Block*). `min_size`: every block is larger.
template <typename Block, std::size_t min_size>
class SizeClassLists {
 public:
  void insert(Block* b) {
    const std::size_t c = class_of(b->size);
    Block* prev = nullptr;
    Block* next = heads_[c];
    while (next && next->size < b->size) prev = next, next = next->bin_next;
    b->bin_prev = prev;
    b->bin_next = next;
    if (next) next->bin_prev = b;
    if (prev) {
      prev->bin_next = b;
    } else {
      heads_[c] = b;
      sub_bits_[c / 64] |= bit(c % 64);
      top_bits_ |= bit(c / 64);
    }
    ++count_;
  }

  // `b` must be in the lists, with the size it was inserted with.
  void erase(Block* b) {
    const std::size_t c = class_of(b->size);
    if (b->bin_next) b->bin_next->bin_prev = b->bin_prev;
    if (b->bin_prev) {
      b->bin_prev->bin_next = b->bin_next;
    } else if (!(heads_[c] = b->bin_next)) {
      if (!(sub_bits_[c / 64] &= ~bit(c % 64))) top_bits_ &= ~bit(c / 64);
    }
    b->bin_prev = b->bin_next = nullptr;
    --count_;
  }

  // The smallest block of at least `size` bytes (the last freed among equals), or nullptr.
  Block* best_fit(std::size_t size) const {
    const std::size_t c = size > min_size ? class_of(size) : 0;
    for (Block* b = heads_[c]; b; b = b->bin_next)  // the request's own class may hold smaller blocks
      if (b->size >= size) return b;
    const std::size_t next = first_class_after(c);
    return next == kClasses ? nullptr : heads_[next];
  }

  // Calls f(b) on the blocks of at least `size` bytes, smallest first (best_fit's order), until f
  // returns false.
  template <typename F>
  void for_each_fit(std::size_t size, F&& f) const {
    std::size_t c = size > min_size ? class_of(size) : 0;
    for (; c < kClasses; c = first_class_after(c))
      for (Block* b = heads_[c]; b; b = b->bin_next)
        if (b->size >= size && !f(b)) return;
  }

  std::size_t size() const { return count_; }

  // Calls f(b) on every block, largest first.
  template <typename F>
  void for_each_largest_first(F&& f) const {
    for (std::size_t c = kClasses; c-- > 0;) {
      Block* b = heads_[c];
      if (!b) continue;
      while (b->bin_next) b = b->bin_next;
      for (; b; b = b->bin_prev) f(b);
    }
  }

  // For the invariant checker: whether `b` is in the list its size says.
  bool contains(const Block* b) const {
    if (b->size <= min_size) return false;
    for (const Block* x = heads_[class_of(b->size)]; x; x = x->bin_next)
      if (x == b) return true;
    return false;
  }

  // For the invariant checker: every list holds only blocks of its class, sorted by size, with consistent
  // back links; both bitmap levels match the lists; the count matches.
  bool consistent() const {
    std::size_t n = 0;
    for (std::size_t c = 0; c < kClasses; ++c) {
      if (((sub_bits_[c / 64] >> (c % 64)) & 1) != (heads_[c] != nullptr)) return false;
      const Block* prev = nullptr;
      for (const Block* b = heads_[c]; b; prev = b, b = b->bin_next, ++n) {
        if (b->size <= min_size || class_of(b->size) != c || b->bin_prev != prev) return false;
        if (prev && prev->size > b->size) return false;
      }
    }
    for (std::size_t w = 0; w < kWords; ++w)
      if (((top_bits_ >> w) & 1) != (sub_bits_[w] != 0)) return false;
    return n == count_;
  }

 private:
  static constexpr int kMinLog = 63 - __builtin_clzll(min_size / kAlignment);  // first power of two
  static constexpr std::size_t kWords = 55 - kMinLog;  // powers of two of size / 512 < 2^55
  static constexpr std::size_t kClasses = kWords * 64;
  static_assert(min_size % kAlignment == 0 && kAlignment == 512 && kMinLog >= 6 && kWords <= 64, "classes must fit the bitmaps");

  static std::uint64_t bit(std::size_t i) { return std::uint64_t(1) << i; }
  // Class of a size > min_size: its power of two, then the next 6 bits below the leading one.
  static std::size_t class_of(std::size_t size) {
    const std::uint64_t q = size / kAlignment;
    const int log = 63 - __builtin_clzll(q);
    return static_cast<std::size_t>(log - kMinLog) * 64 + ((q >> (log - 6)) & 63);
  }
  // The first non-empty class above `c`, or kClasses.
  std::size_t first_class_after(std::size_t c) const {
    std::size_t w = c / 64;
    const std::uint64_t above = c % 64 == 63 ? 0 : sub_bits_[w] & (~std::uint64_t(0) << (c % 64 + 1));
    if (above) return w * 64 + static_cast<std::size_t>(__builtin_ctzll(above));
    const std::uint64_t words = w + 1 == 64 ? 0 : top_bits_ & (~std::uint64_t(0) << (w + 1));
    if (!words) return kClasses;
    w = static_cast<std::size_t>(__builtin_ctzll(words));
    return w * 64 + static_cast<std::size_t>(__builtin_ctzll(sub_bits_[w]));
  }

  std::array<Block*, kClasses> heads_{};
  std::array<std::uint64_t, kWords> sub_bits_{};  // bit c % 64 of word c / 64: class c is non-empty
  std::uint64_t top_bits_ = 0;                    // bit w: sub_bits_[w] != 0
  std::size_t count_ = 0;
};

}  // namespace gpumem
