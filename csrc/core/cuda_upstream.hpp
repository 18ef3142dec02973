// The two CUDA upstreams: cudaMalloc-style segments (cuMemAlloc) and virtual-memory pages
// (cuMemAddressReserve / cuMemCreate / cuMemMap). Both call the CUDA driver through cuda_driver.hpp,
// which loads libcuda at first use, so building and importing gpumem needs no GPU or driver.
#pragma once

#include <memory>
#include <vector>

#include "upstream.hpp"

namespace gpumem {

// True when gpumem was built with the CUDA headers (the upstreams exist in this build).
bool cuda_upstreams_built();
// True when a driver can be loaded and reports at least one device. Never throws.
bool cuda_available();
int cuda_device_count();
// True when `device` supports virtual memory management (cuMemCreate & co). Never throws.
bool cuda_vmm_supported(int device);
// `exportable` (vmm only): create each page with a POSIX file descriptor handle type, so that
// export_pages() can share it with another process (CUDA IPC); where the driver refuses that type the
// pages are created plain and export_pages() says why. false: plain pages, export_pages() refused.
// @throws UpstreamError when there is no driver/device, InvalidArgument for a bad device ordinal.
std::shared_ptr<Upstream> make_cuda_upstream(UpstreamKind kind, int device, bool exportable = true);
// Maps into this process the pages another process exported (Upstream::export_pages), given that
// process's pid, its file descriptor numbers and the page size; the memory stays mapped until the
// returned pointer's last copy is gone. @throws UpstreamError saying what failed.
std::shared_ptr<void> cuda_import_pages(int device, int pid, const std::vector<int>& remote_fds,
                                        std::size_t page);

}  // namespace gpumem
