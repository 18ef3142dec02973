// The configuration string (GPUMEM_CONF), e.g. "upstream:vmm,cap:0.9,release:lazy,page_size:8MiB,ipc:true".
// Parsed here, in the core, so that a bad string is rejected the same way with or without a GPU.
#pragma once

#include <cstddef>
#include <string>

#include "pool.hpp"

namespace gpumem {

struct Config {
  std::string upstream = "auto";  // auto (vmm where the driver supports it) | vmm | segments
  std::size_t cap_bytes = 0;      // cap as bytes (0 = none) ...
  double cap_fraction = 0.0;      // ... or as a fraction of the device's memory (0 = none)
  ReleasePolicy release = PoolOptions().release;
  double release_slack = PoolOptions().release_slack;  // see PoolOptions
  std::size_t page_size = kDefaultPageSize;  // vmm upstream: bytes per physical page (multiple of 2 MiB)
  bool gc_on_oom = false;         // run the registered OOM callbacks (Python: gc.collect) before failing:
                                  // off by default, as PyTorch's allocator never collects
  // vmm upstream: create pages exportable as POSIX file descriptors, so that CUDA tensors can be
  // shared with other processes (torch.multiprocessing); false: plain pages, sharing refused.
  bool ipc = true;
  bool stitch = PoolOptions().stitch;  // see PoolOptions (the main pools only; graph pools and MemPools never)
  double stitch_slack = PoolOptions().stitch_slack;  // see PoolOptions
  bool ends_by_page = PoolOptions().ends_by_page;    // see PoolOptions
  double early_ends_by_page = PoolOptions().early_ends_by_page;  // see PoolOptions
  bool park_lent = PoolOptions().park_lent;  // see PoolOptions (the main pools only, as stitch)
};

// @throws InvalidArgument naming the key and the accepted values.
Config parse_config(const std::string& text, const std::string& source = "GPUMEM_CONF");
// "512", "64KiB", "1.5 GB", "8GiB" -> bytes. @throws InvalidArgument.
std::size_t parse_size(const std::string& text);
std::string to_string(ReleasePolicy policy);

}  // namespace gpumem
