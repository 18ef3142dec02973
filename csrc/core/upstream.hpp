// Where the pool's memory comes from. An upstream is one of two kinds:
//   kSegments: whole regions taken and returned at once (cudaMalloc / cudaFree);
//   kPages:    a large virtual address range reserved once, whose pages are mapped and unmapped one by
//              one (cuMemCreate + cuMemMap), so a region grows in place and free pages anywhere in it,
//              even between live blocks, go back to the device.
// It also owns the stream/event calls the pool needs for cross-stream safety.
// Failure convention: running out of memory is a return value (0 / false); anything else throws.
#pragma once

#include <cstddef>
#include <memory>
#include <utility>
#include <string>
#include <vector>

#include "types.hpp"

namespace gpumem {

enum class UpstreamKind { kSegments, kPages };

class Upstream {
 public:
  virtual ~Upstream() = default;

  virtual UpstreamKind kind() const = 0;
  virtual std::string name() const = 0;
  // Granularity of every address and size passed to allocate_segment / map / unmap (2 MiB on CUDA).
  virtual std::size_t page_size() const = 0;
  virtual std::size_t device_total_bytes() const = 0;
  virtual std::size_t device_free_bytes() const = 0;

  // kSegments: returns 0 when the device has no room.
  virtual std::uintptr_t allocate_segment(std::size_t bytes);
  virtual void free_segment(std::uintptr_t address, std::size_t bytes);

  // kPages: reserve address space only (no memory); returns 0 when none is left.
  virtual std::uintptr_t reserve_address_range(std::size_t bytes);
  virtual void release_address_range(std::uintptr_t address, std::size_t bytes);
  // Back [address, address + bytes) with memory, one physical allocation per `page` bytes (a multiple
  // of page_size()); false (and nothing mapped) when the device has no room. unmap() takes the same
  // page as the map() that mapped the range.
  virtual bool map(std::uintptr_t address, std::size_t bytes, std::size_t page);
  virtual void unmap(std::uintptr_t address, std::size_t bytes, std::size_t page);
  // kPages: while on, unmap() keeps the physical allocations of the units it unmaps (they still hold
  // device memory) and map() takes kept ones of its unit size before creating any; turning it off
  // releases those still kept. The pool turns it on while it maps a block, whose room it may make by
  // unmapping other pages: a unit moved this way skips the driver's create and release, a third of
  // what remapping a unit costs (pool_map.cpp). Off by default; upstreams that cannot keep ignore it.
  virtual void keep_released_units(bool on) { (void)on; }
  // kPages: maps [address, address + bytes) onto the physical units backing the mapped range
  // [source, source + bytes) (mapped with the same `page`), which stay mapped at `source` as well: no
  // new memory. Each mapping holds the memory; it goes back when the last one is unmapped, and a unit
  // mapped twice is never kept by keep_released_units. The pool hands pages still draining to a new
  // block on the same stream this way (pool_drain.cpp): the device may still be using them at
  // `source`, and will use them at `address` only after that, in stream order. False, with nothing
  // mapped, when the upstream cannot (the default) or a unit may not be shared (exported to another
  // process); throws UpstreamError on a driver error.
  virtual bool map_from(std::uintptr_t address, std::uintptr_t source, std::size_t bytes, std::size_t page) {
    (void)address, (void)source, (void)bytes, (void)page;
    return false;
  }
  // kPages: file descriptors of the physical pages of [address, address + count * page) (mapped by
  // map() with that page), which another process can import (CUDA IPC). They stay open, owned by the
  // upstream, until the pages are unmapped. @throws UpstreamError when the pages cannot be exported.
  virtual std::vector<int> export_pages(std::uintptr_t address, std::size_t count, std::size_t page);

  // Streams and events. An event marks the work queued on a stream so far.
  virtual EventId record_event(StreamId stream) = 0;
  virtual bool event_completed(EventId event) = 0;
  virtual void destroy_event(EventId event) = 0;
  // Blocks until the event has completed (the work queued on its stream before it was recorded).
  virtual void wait_event(EventId event) = 0;
  // Waits for all work queued on `stream`; called before memory used there goes back to the device.
  virtual void synchronize(StreamId stream) = 0;
};

// An upstream that hands every call to another one: the base of upstreams that change one or two
// calls (the torch bridge's MemPool allocators, the tests' fault-injecting and checking devices).
class ForwardingUpstream : public Upstream {
 public:
  explicit ForwardingUpstream(std::shared_ptr<Upstream> inner) : inner_(std::move(inner)) {}

  UpstreamKind kind() const override { return inner_->kind(); }
  std::string name() const override { return inner_->name(); }
  std::size_t page_size() const override { return inner_->page_size(); }
  std::size_t device_total_bytes() const override { return inner_->device_total_bytes(); }
  std::size_t device_free_bytes() const override { return inner_->device_free_bytes(); }
  std::uintptr_t allocate_segment(std::size_t bytes) override { return inner_->allocate_segment(bytes); }
  void free_segment(std::uintptr_t address, std::size_t bytes) override { inner_->free_segment(address, bytes); }
  std::uintptr_t reserve_address_range(std::size_t bytes) override { return inner_->reserve_address_range(bytes); }
  void release_address_range(std::uintptr_t address, std::size_t bytes) override {
    inner_->release_address_range(address, bytes);
  }
  bool map(std::uintptr_t address, std::size_t bytes, std::size_t page) override {
    return inner_->map(address, bytes, page);
  }
  void unmap(std::uintptr_t address, std::size_t bytes, std::size_t page) override {
    inner_->unmap(address, bytes, page);
  }
  void keep_released_units(bool on) override { inner_->keep_released_units(on); }
  bool map_from(std::uintptr_t address, std::uintptr_t source, std::size_t bytes, std::size_t page) override {
    return inner_->map_from(address, source, bytes, page);
  }
  std::vector<int> export_pages(std::uintptr_t address, std::size_t count, std::size_t page) override {
    return inner_->export_pages(address, count, page);
  }
  EventId record_event(StreamId stream) override { return inner_->record_event(stream); }
  bool event_completed(EventId event) override { return inner_->event_completed(event); }
  void destroy_event(EventId event) override { inner_->destroy_event(event); }
  void wait_event(EventId event) override { inner_->wait_event(event); }
  void synchronize(StreamId stream) override { inner_->synchronize(stream); }

 protected:
  Upstream& inner() { return *inner_; }

 private:
  std::shared_ptr<Upstream> inner_;
};

}  // namespace gpumem
