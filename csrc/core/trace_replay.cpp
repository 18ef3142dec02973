// Replaying a parsed trace through a pool (trace.hpp): allocations and frees in order, OOMs counted,
// the pool's CPU time per allocate + free pair measured. Parsing is trace_parse.cpp.
#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "trace.hpp"

namespace gpumem {

// Per operation: true for an allocation the trace never frees (each id is allocated once).
static std::vector<bool> never_freed(const Trace& trace) {
  std::vector<bool> freed(trace.allocations, false);
  for (const TraceOp& op : trace.ops)
    if (!op.is_alloc) freed[op.slot] = true;
  std::vector<bool> kept(trace.ops.size(), false);
  for (std::size_t i = 0; i < trace.ops.size(); ++i) kept[i] = trace.ops[i].is_alloc && !freed[trace.ops[i].slot];
  return kept;
}

ReplayResult replay(const Trace& trace, Pool& pool,
                    const std::function<void(std::size_t, std::size_t)>& progress,
                    const std::function<void()>& before_each, bool again) {
  ReplayResult r;
  std::vector<std::uintptr_t> address(trace.allocations, 0);
  std::vector<std::uint64_t> size(trace.allocations, 0);
  std::uint64_t live = 0;
  std::vector<bool> skip;  // again: the allocations made once, by the first replay
  if (again) {
    skip = never_freed(trace);
    for (std::size_t i = 0; i < trace.ops.size(); ++i)
      if (skip[i]) live += trace.ops[i].bytes;
    r.peak_live = live;
  }
  const auto before = pool.stats();
  std::chrono::nanoseconds in_pool{0};
  const std::size_t chunk = 4096;  // ops between progress calls and clock reads
  for (std::size_t start = 0; start < trace.ops.size(); start += chunk) {
    const std::size_t end = std::min(trace.ops.size(), start + chunk);
    auto t0 = std::chrono::steady_clock::now();
    for (std::size_t i = start; i < end; ++i) {
      const TraceOp& op = trace.ops[i];
      if (before_each) before_each();
      if (op.is_alloc) {
        if (again && skip[i]) continue;
        r.allocations++;
        try {
          address[op.slot] = pool.allocate(op.bytes, op.stream);
          size[op.slot] = op.bytes;
          live += op.bytes;
          r.peak_live = std::max(r.peak_live, live);
        } catch (const OutOfMemoryError& e) {
          if (r.ooms++ == 0) r.first_oom = "operation " + std::to_string(i + 1) + ": " + e.what();
        }
      } else if (address[op.slot] || size[op.slot]) {
        r.frees++;
        pool.free(address[op.slot]);
        live -= size[op.slot];
        address[op.slot] = 0;
        size[op.slot] = 0;
      }
    }
    in_pool += std::chrono::steady_clock::now() - t0;
    if (progress) progress(end, trace.ops.size());
  }
  const auto after = pool.stats();
  r.peak_reserved = static_cast<std::uint64_t>(after.reserved_bytes[kAggregate].peak);
  r.upstream_calls = static_cast<std::uint64_t>(after.num_device_alloc + after.num_device_free -
                                                before.num_device_alloc - before.num_device_free);
  r.fragmentation = r.peak_live ? static_cast<double>(r.peak_reserved) / static_cast<double>(r.peak_live) : 0;
  r.ns_per_pair = r.allocations ? static_cast<double>(in_pool.count()) / static_cast<double>(r.allocations) : 0;
  return r;
}

}  // namespace gpumem
