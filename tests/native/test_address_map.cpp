// address_map_tests: AddressMap (address_map.hpp), the pool's live blocks by address: put / find /
// take / erase, growth, keys that collide and wrap around the table's end (the backward-shift
// deletion must keep every other key findable), against std::unordered_map as the model.
#include <cstdint>
#include <random>
#include <unordered_map>
#include <vector>

#include "core/address_map.hpp"
#include "harness.hpp"

using namespace gpumem;

TEST(put_find_take_and_erase) {
  AddressMap<int> map;
  CHECK_EQ(map.size(), std::size_t(0));
  CHECK(map.find(0x1000) == nullptr);
  map.put(0x1000, 1);
  map.put(0x1200, 2);
  map.put(0, 3);  // address 0 is a key like any other
  CHECK_EQ(map.size(), std::size_t(3));
  CHECK_EQ(*map.find(0x1000), 1);
  CHECK_EQ(*map.find(0), 3);
  map.put(0x1000, 10);  // overwrite
  CHECK_EQ(map.size(), std::size_t(3));
  CHECK_EQ(*map.find(0x1000), 10);
  int out = 0;
  CHECK(map.take(0x1200, &out));
  CHECK_EQ(out, 2);
  CHECK(!map.take(0x1200, &out));
  CHECK(map.find(0x1200) == nullptr);
  CHECK(map.erase(0));
  CHECK(!map.erase(0));
  CHECK_EQ(map.size(), std::size_t(1));
  const AddressMap<int>& view = map;
  CHECK_EQ(*view.find(0x1000), 10);
}

TEST(growth_keeps_every_key) {
  AddressMap<std::uintptr_t> map;
  for (std::uintptr_t i = 0; i < 5000; ++i) map.put(0x7f0000000000 + i * 512, i);
  CHECK_EQ(map.size(), std::size_t(5000));
  for (std::uintptr_t i = 0; i < 5000; ++i) CHECK_EQ(*map.find(0x7f0000000000 + i * 512), i);
  std::size_t seen = 0;
  std::uintptr_t sum = 0;
  map.for_each([&](std::uintptr_t, std::uintptr_t v) {
    ++seen;
    sum += v;
  });
  CHECK_EQ(seen, std::size_t(5000));
  CHECK_EQ(sum, std::uintptr_t(4999) * 5000 / 2);
}

TEST(random_operations_agree_with_unordered_map) {
  // Few distinct keys in a small table: long probe runs that wrap around its end, so every take()
  // shifts entries back across the wrap.
  for (std::uint64_t seed : {1, 2, 3}) {
    AddressMap<std::uint64_t> map;
    std::unordered_map<std::uintptr_t, std::uint64_t> model;
    std::mt19937_64 rng(seed);
    const std::uintptr_t base = 0x100000000000 + seed * 0x10000000;
    for (int step = 0; step < 40000; ++step) {
      const std::uintptr_t key = base + (rng() % 100) * 512 * (step % 2 ? 1 : 4096);
      switch (rng() % 4) {
        case 0:
        case 1: {
          const std::uint64_t v = rng();
          map.put(key, v);
          model[key] = v;
          break;
        }
        case 2: {
          std::uint64_t out = 0;
          const bool had = model.count(key) != 0;
          CHECK_EQ(map.take(key, &out), had);
          if (had) CHECK_EQ(out, model[key]);
          model.erase(key);
          break;
        }
        default: {
          const std::uint64_t* found = map.find(key);
          CHECK_EQ(found != nullptr, model.count(key) != 0);
          if (found) CHECK_EQ(*found, model[key]);
        }
      }
      CHECK_EQ(map.size(), model.size());
    }
    for (auto& [key, value] : model) CHECK_EQ(*map.find(key), value);
  }
}
