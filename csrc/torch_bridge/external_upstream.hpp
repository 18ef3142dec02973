// An upstream whose segments come from another torch CUDA allocator: the one a
// torch.cuda.MemPool(allocator) names (a pluggable allocator, NCCL's). gpumem's pool carves and caches
// those segments as it does cudaMalloc'd ones, so the MemPool's memory is counted in the device's
// statistics and limit, reused after frees, and lent on OOM (use_on_oom), as with PyTorch's allocator.
// Streams, events and device figures are the device's own (a cudaMalloc-style CUDA upstream).
#pragma once

#include <memory>

#include <c10/cuda/CUDACachingAllocator.h>

#include "core/upstream.hpp"

namespace gpumem::torch_bridge {

std::shared_ptr<Upstream> make_external_upstream(
    std::shared_ptr<Upstream> device_upstream,
    std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator, int device);

}  // namespace gpumem::torch_bridge
