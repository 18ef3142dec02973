// gpumem core types. Glossary, one line each:
//   Upstream  - where device memory comes from: the simulated device, cudaMalloc segments, or CUDA
//               virtual memory (VMM) pages. The pool never calls CUDA itself.
//   Region    - one contiguous address range the pool carves blocks from: a whole cudaMalloc segment,
//               or a reserved virtual address range whose pages are mapped on demand.
//   Arena     - the regions and free blocks of one (stream, size class); blocks never leave their arena.
//   Block     - a run of bytes inside a region: allocated, free, or waiting for other streams' events.
//   Page      - the mapping granularity of a paged region (2 MiB on CUDA); reserved = mapped pages.
//   Stream    - an opaque integer (a cudaStream_t on CUDA, any number on the simulated device).
#pragma once

#include <cstddef>
#include <cstdint>

namespace gpumem {

using StreamId = std::uintptr_t;
using EventId = std::uintptr_t;

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;
constexpr std::size_t GiB = 1024 * MiB;

// Every block starts and ends on this boundary, like PyTorch's allocator (kMinBlockSize).
constexpr std::size_t kAlignment = 512;
// Requests up to this size live in the small arenas, so they never pin pages of large blocks.
constexpr std::size_t kSmallLimit = 1 * MiB;
// cudaMalloc segment size for small arenas (PyTorch's kSmallBuffer).
constexpr std::size_t kSmallSegment = 2 * MiB;
// Large requests below kMidLimit share kMidSegment-sized cudaMalloc segments (PyTorch's kLargeBuffer).
constexpr std::size_t kMidLimit = 10 * MiB;
constexpr std::size_t kMidSegment = 20 * MiB;
// Mapping granularity of the CUDA virtual-memory upstream (and of replay's simulated device): one
// physical allocation per page. Larger pages mean fewer driver calls when memory grows, smaller ones
// return memory more finely; docs/benchmarks.md has the measurements it was chosen by.
constexpr std::size_t kDefaultPageSize = 8 * MiB;
// Largest request accepted at all; anything above is a caller bug, not an allocation.
constexpr std::size_t kMaxRequest = std::size_t(1) << 48;

inline std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }
inline std::size_t round_down(std::size_t n, std::size_t to) { return n / to * to; }

}  // namespace gpumem
