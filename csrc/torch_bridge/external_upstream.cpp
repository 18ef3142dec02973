// See external_upstream.hpp.
#include "torch_bridge/external_upstream.hpp"

#include <string>
#include <utility>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace gpumem::torch_bridge {

namespace {

class ExternalUpstream final : public ForwardingUpstream {
 public:
  ExternalUpstream(std::shared_ptr<Upstream> device_upstream,
                   std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator, int device)
      : ForwardingUpstream(std::move(device_upstream)), allocator_(std::move(allocator)), index_(device) {}

  UpstreamKind kind() const override { return UpstreamKind::kSegments; }
  std::string name() const override { return "external(" + allocator_->name() + ")"; }

  // The other allocator's out-of-memory (an exception or null) is the upstream's "no room" (0).
  std::uintptr_t allocate_segment(std::size_t bytes) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index_));
    try {
      cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(index_)).stream();
      return reinterpret_cast<std::uintptr_t>(allocator_->raw_alloc_with_stream(bytes, stream));
    } catch (const c10::OutOfMemoryError&) {
      return 0;
    }
  }
  void free_segment(std::uintptr_t address, std::size_t) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index_));
    allocator_->raw_delete(reinterpret_cast<void*>(address));
  }

 private:
  std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator_;
  int index_;
};

}  // namespace

std::shared_ptr<Upstream> make_external_upstream(
    std::shared_ptr<Upstream> device_upstream,
    std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator, int device) {
  return std::make_shared<ExternalUpstream>(std::move(device_upstream), std::move(allocator), device);
}

}  // namespace gpumem::torch_bridge
