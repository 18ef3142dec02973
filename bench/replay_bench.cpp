// Replays allocation traces through the pool on the simulated device and prints, per trace and
// upstream kind: peak live, peak reserved, their ratio, upstream calls and CPU ns per alloc+free pair.
//   replay_bench [--repeat N] TRACE...
// The ns figure is the median of N replays (each on a fresh pool), so it is the pool's own CPU cost.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../csrc/core/pool.hpp"
#include "../csrc/core/simulated_device.hpp"
#include "../csrc/core/trace.hpp"

using namespace gpumem;

int main(int argc, char** argv) {
  int repeat = 5;
  std::vector<std::string> paths;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--repeat") && i + 1 < argc) repeat = std::atoi(argv[++i]);
    else paths.push_back(argv[i]);
  }
  if (paths.empty()) {
    std::fprintf(stderr, "usage: replay_bench [--repeat N] TRACE...\n");
    return 2;
  }
  const std::size_t capacity = 141ull * GiB;  // an H200
  std::printf("%-28s %-9s %12s %12s %8s %10s %10s\n", "trace", "upstream", "peak_live", "peak_resv",
              "ratio", "up_calls", "ns/pair");
  for (const auto& path : paths) {
    Trace trace = load_trace(path);
    for (UpstreamKind kind : {UpstreamKind::kPages, UpstreamKind::kSegments}) {
      std::vector<double> ns;
      ReplayResult r;
      for (int k = 0; k < repeat; ++k) {
        auto device = std::make_shared<SimulatedDevice>(kind, capacity);
        Pool pool(device);
        r = replay(trace, pool);
        ns.push_back(r.ns_per_pair);
      }
      std::sort(ns.begin(), ns.end());
      std::string name = path.substr(path.find_last_of('/') + 1);
      std::printf("%-28s %-9s %12.3f %12.3f %8.4f %10llu %10.1f\n", name.c_str(),
                  kind == UpstreamKind::kPages ? "vmm" : "segments", r.peak_live / double(GiB),
                  r.peak_reserved / double(GiB), r.fragmentation,
                  static_cast<unsigned long long>(r.upstream_calls), ns[ns.size() / 2]);
      std::printf("{\"trace\":\"%s\",\"upstream\":\"%s\",\"peak_live\":%llu,\"peak_reserved\":%llu,"
                  "\"ratio\":%.5f,\"upstream_calls\":%llu,\"ns_per_pair\":%.1f,\"ooms\":%llu}\n",
                  name.c_str(), kind == UpstreamKind::kPages ? "vmm" : "segments",
                  (unsigned long long)r.peak_live, (unsigned long long)r.peak_reserved, r.fragmentation,
                  (unsigned long long)r.upstream_calls, ns[ns.size() / 2], (unsigned long long)r.ooms);
    }
  }
  return 0;
}
