// An allocator for std::set nodes that recycles them through a free list, so inserting into and
// erasing from the free-block sets never reaches malloc on the allocate/free hot path.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace gpumem {

class NodeCache {
 public:
  NodeCache() = default;
  NodeCache(const NodeCache&) = delete;
  NodeCache& operator=(const NodeCache&) = delete;
  ~NodeCache() {
    for (void* p : free_) ::operator delete(p);
  }
  void* get(std::size_t bytes) {
    if (free_.empty() || bytes != node_bytes_) {
      node_bytes_ = bytes;
      return ::operator new(bytes);
    }
    void* p = free_.back();
    free_.pop_back();
    return p;
  }
  void put(void* p, std::size_t bytes) {
    if (bytes != node_bytes_) return ::operator delete(p);
    free_.push_back(p);
  }

 private:
  std::vector<void*> free_;
  std::size_t node_bytes_ = 0;
};

template <typename T>
struct CachedNodeAllocator {
  using value_type = T;
  NodeCache* cache;
  explicit CachedNodeAllocator(NodeCache* c) : cache(c) {}
  template <typename U>
  CachedNodeAllocator(const CachedNodeAllocator<U>& other) : cache(other.cache) {}
  T* allocate(std::size_t n) {
    return n == 1 ? static_cast<T*>(cache->get(sizeof(T)))
                  : static_cast<T*>(::operator new(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) {
    if (n == 1) cache->put(p, sizeof(T));
    else ::operator delete(p);
  }
  template <typename U>
  bool operator==(const CachedNodeAllocator<U>& o) const { return cache == o.cache; }
  template <typename U>
  bool operator!=(const CachedNodeAllocator<U>& o) const { return cache != o.cache; }
};

}  // namespace gpumem
