// CUDA IPC: sending CUDA tensors to other processes with torch.multiprocessing. gpumem's memory is
// CUDA virtual memory, which cudaIpcGetMemHandle cannot share; its physical pages are exported as
// file descriptors instead (as PyTorch's expandable segments do), and the receiving process takes
// them with pidfd_getfd and maps them. The handle torch carries between the processes is text:
//   gpumem-ipc:1:<sender pid>:<device>:<page bytes>:<fd>,<fd>,...
// with torch's offset from the first page to the tensor's storage. Both processes must use gpumem
// (import it first in the child too); a handle of the other kind is refused with an error that says
// so, never a hang or a crash. Only the upstream "vmm" (the default where supported) can share.
#include <cerrno>
#include <cstdlib>
#include <string>
#include <vector>

#include <unistd.h>

#include "core/cuda_upstream.hpp"
#include "torch_bridge/allocator.hpp"
#include "torch_bridge/bridge_util.hpp"

namespace gpumem::torch_bridge {

namespace {
constexpr const char* kPrefix = "gpumem-ipc:1:";
}  // namespace

CCA::ShareableHandle GpumemAllocator::shareIpcHandle(void* ptr) {
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  int device = -1;
  Pool* owner = owning_pool(p, &device);
  TORCH_CHECK(owner, cat("gpumem: cannot share ", hex(ptr), " with another process: it is not a live "
              "block of gpumem's pools"));
  TORCH_CHECK(owner->upstream().kind() == UpstreamKind::kPages,
              cat("gpumem can share CUDA tensors with other processes only from CUDA virtual "
                  "memory; this pool uses '", owner->upstream().name(),
                  "' (GPUMEM_CONF upstream:segments?). Use upstream:vmm, or GPUMEM_DISABLE=1 in "
                  "both processes"));
  Pool::ExportedBlock exported = translate([&] { return owner->export_block(p); });
  std::string handle =
      cat(kPrefix, static_cast<long>(::getpid()), ":", device, ":", exported.page, ":");
  for (std::size_t i = 0; i < exported.fds.size(); ++i) handle += cat(i ? "," : "", exported.fds[i]);
  CCA::ShareableHandle out;
  out.offset = static_cast<std::ptrdiff_t>(p - exported.first_page);
  out.handle = handle;
  return out;
}

std::shared_ptr<void> GpumemAllocator::getIpcDevPtr(std::string handle) {
  TORCH_CHECK(handle.rfind(kPrefix, 0) == 0,
              "gpumem: this CUDA tensor was shared by a process that does not use gpumem (PyTorch's "
              "own allocator made its IPC handle). Import gpumem first in both processes, or set "
              "GPUMEM_DISABLE=1 in both");
  // <pid>:<device>:<page>:<fd>,<fd>,... read with strtoull (no iostreams in the bridge: bridge_util.hpp)
  const char* text = handle.c_str() + std::string(kPrefix).size();
  char* end = nullptr;
  auto number = [&](char expect_after) -> long long {
    errno = 0;
    const unsigned long long v = std::strtoull(text, &end, 10);
    const bool ok = end != text && errno == 0 && v <= (1ULL << 62) &&
                    (*end == expect_after || (expect_after == ',' && *end == '\0'));
    TORCH_CHECK(ok, cat("gpumem: malformed CUDA IPC handle '", handle, "'"));
    text = *end ? end + 1 : end;
    return static_cast<long long>(v);
  };
  const long long pid = number(':'), device = number(':'), page = number(':');
  std::vector<int> fds;
  while (*text) fds.push_back(static_cast<int>(number(',')));
  TORCH_CHECK(pid > 0 && page > 0 && !fds.empty() && device < kMaxDevices,
              cat("gpumem: malformed CUDA IPC handle '", handle, "'"));
  return translate([&] {
    return cuda_import_pages(static_cast<int>(device), static_cast<int>(pid), fds,
                             static_cast<std::size_t>(page));
  });
}

}  // namespace gpumem::torch_bridge
