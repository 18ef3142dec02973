// Live blocks by address: an open-addressing hash map (linear probing, backward-shift deletion).
// It replaces std::unordered_map on the allocate/free hot path, where a node allocation per insert
// cost more than the rest of the pool's bookkeeping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gpumem {

template <typename Value>
class AddressMap {
 public:
  AddressMap() { slots_.resize(64); }  // shift_ matches 64 slots

  std::size_t size() const { return size_; }

  // Inserts or overwrites.
  void put(std::uintptr_t key, Value value) {
    if ((size_ + 1) * 2 > slots_.size()) grow();  // at most half full: short probe runs
    place(key, value);
  }

  Value* find(std::uintptr_t key) {
    for (std::size_t i = index(key);; i = (i + 1) & mask()) {
      Slot& s = slots_[i];
      if (s.key == key && s.used) return &s.value;
      if (!s.used) return nullptr;
    }
  }
  const Value* find(std::uintptr_t key) const { return const_cast<AddressMap*>(this)->find(key); }

  bool erase(std::uintptr_t key) { return take(key, nullptr); }

  // Finds and removes `key` in one probe; stores its value in *out (if given). False if absent.
  bool take(std::uintptr_t key, Value* out) {
    std::size_t i = index(key);
    for (;; i = (i + 1) & mask()) {
      if (!slots_[i].used) return false;
      if (slots_[i].key == key) break;
    }
    if (out) *out = slots_[i].value;
    // Backward-shift: pull later entries of the probe run into the hole so lookups never need tombstones.
    std::size_t hole = i;
    for (std::size_t j = (hole + 1) & mask(); slots_[j].used; j = (j + 1) & mask()) {
      std::size_t home = index(slots_[j].key);
      bool movable = hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
      if (movable) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole].used = false;
    --size_;
    return true;
  }

  template <typename F>
  void for_each(F&& f) const {
    for (const Slot& s : slots_)
      if (s.used) f(s.key, s.value);
  }

 private:
  struct Slot {
    std::uintptr_t key = 0;
    Value value{};
    bool used = false;
  };
  std::size_t mask() const { return slots_.size() - 1; }
  std::size_t index(std::uintptr_t key) const {
    // Addresses are 512-aligned: drop the zero bits, then Fibonacci hashing (keep the top bits).
    return static_cast<std::size_t>(((key >> 9) * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  void place(std::uintptr_t key, Value value) {
    for (std::size_t i = index(key);; i = (i + 1) & mask()) {
      Slot& s = slots_[i];
      if (!s.used || s.key == key) {
        if (!s.used) ++size_;
        s = Slot{key, value, true};
        return;
      }
    }
  }
  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    --shift_;
    size_ = 0;
    for (const Slot& s : old)
      if (s.used) place(s.key, s.value);
  }

  std::vector<Slot> slots_;
  std::size_t size_ = 0;
  int shift_ = 64 - 6;  // 64 - log2(slots_.size())
};

}  // namespace gpumem
