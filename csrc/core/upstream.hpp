// Where the pool's memory comes from. An upstream is one of two kinds:
//   kSegments: whole regions taken and returned at once (cudaMalloc / cudaFree);
//   kPages:    a large virtual address range reserved once, whose pages are mapped and unmapped one by
//              one (cuMemCreate + cuMemMap), so a region grows in place and free pages anywhere in it,
//              even between live blocks, go back to the device.
// It also owns the stream/event calls the pool needs for cross-stream safety.
// Failure convention: running out of memory is a return value (0 / false); anything else throws.
#pragma once

#include <cstddef>
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
  // kPages: file descriptors of the physical pages of [address, address + count * page) (mapped by
  // map() with that page), which another process can import (CUDA IPC). They stay open, owned by the
  // upstream, until the pages are unmapped. @throws UpstreamError when the pages cannot be exported.
  virtual std::vector<int> export_pages(std::uintptr_t address, std::size_t count, std::size_t page);

  // Streams and events. An event marks the work queued on a stream so far.
  virtual EventId record_event(StreamId stream) = 0;
  virtual bool event_completed(EventId event) = 0;
  virtual void destroy_event(EventId event) = 0;
  // Waits for all work queued on `stream`; called before memory used there goes back to the device.
  virtual void synchronize(StreamId stream) = 0;
};

}  // namespace gpumem
