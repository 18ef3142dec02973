// Allocation traces (../shared/traces/README.md format, plain or gzip) and their replay through a pool.
//   # workload <name> ... peak_live_bytes <n> ...
//   a <id> <bytes> <stream>
//   f <id>
// Parsing is in trace_parse.cpp, replay in trace_replay.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "pool.hpp"

namespace gpumem {

struct TraceOp {
  std::uint32_t slot;   // dense index of the allocation id
  bool is_alloc;
  std::uint64_t bytes;  // allocations only
  StreamId stream;      // allocations only
};

struct Trace {
  std::string path;
  std::string workload;
  std::uint64_t header_peak_live = 0;  // from the header, 0 when absent
  std::size_t allocations = 0;
  std::vector<TraceOp> ops;
};

// @throws InvalidArgument "<path>:<line>: <what is wrong>" for unreadable or malformed traces.
Trace load_trace(const std::string& path);

struct ReplayResult {
  std::uint64_t peak_live = 0;      // peak of live requested bytes (the floor for any allocator)
  std::uint64_t peak_reserved = 0;  // peak of reserved bytes
  double fragmentation = 0;         // peak_reserved / peak_live
  std::uint64_t upstream_calls = 0; // maps + unmaps, or segment allocations + frees
  double ns_per_pair = 0;           // CPU time in the pool per allocate + free pair
  std::uint64_t allocations = 0, frees = 0;
  std::uint64_t ooms = 0;
  std::string first_oom;            // message of the first OOM, empty if none
};

// Replays every operation; an allocation that fails counts as an OOM and its free is skipped.
// `progress(done, total)` is called every few thousand operations; `before_each`, when set, before
// every operation (a lagging simulated device's clock: SimulatedDevice::advance).
// `again`: the trace once more in a pool that has replayed it, as a later epoch runs the same steps:
// allocations the trace never frees (weights, state made once, still live from the first replay) are
// not made again, and count as live from the start.
ReplayResult replay(const Trace& trace, Pool& pool,
                    const std::function<void(std::size_t, std::size_t)>& progress = {},
                    const std::function<void()>& before_each = {}, bool again = false);

}  // namespace gpumem
