// CUDA upstreams over the driver API. libcuda is opened with dlopen at first use, so this file links
// against nothing CUDA: gpumem builds and imports on machines without a GPU or driver.
#include "cuda_upstream.hpp"

#include "errors.hpp"

#if GPUMEM_WITH_CUDA

#include <cuda.h>
#include <dlfcn.h>
#include <sys/syscall.h>

#include <cerrno>
#include <unistd.h>

#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace gpumem {

namespace {

#define GPUMEM_STR2(x) #x
#define GPUMEM_STR(x) GPUMEM_STR2(x)  // expands cuda.h's versioned names (cuMemAlloc -> cuMemAlloc_v2)

// The driver entry points gpumem uses, resolved once.
struct Driver {
#define GPUMEM_DRIVER_FN(name) decltype(&::name) name = nullptr;
#define GPUMEM_DRIVER_FNS(X)                                                                        \
  X(cuInit) X(cuGetErrorString) X(cuDeviceGet) X(cuDeviceGetCount) X(cuDeviceGetAttribute)         \
  X(cuDevicePrimaryCtxRetain) X(cuCtxPushCurrent) X(cuCtxPopCurrent) X(cuMemGetInfo) X(cuMemAlloc) \
  X(cuMemFree) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemCreate) X(cuMemRelease)           \
  X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) X(cuMemGetAllocationGranularity) X(cuEventCreate)    \
  X(cuEventRecord) X(cuEventQuery) X(cuEventDestroy) X(cuEventSynchronize) X(cuStreamSynchronize)                          \
  X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle) X(cuMemRetainAllocationHandle)
  GPUMEM_DRIVER_FNS(GPUMEM_DRIVER_FN)
  bool loaded = false;
  std::string why_not;
};

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      d.why_not = std::string("cannot load the CUDA driver (libcuda.so.1): ") + dlerror();
      return;
    }
#define GPUMEM_RESOLVE(name)                                                              \
  d.name = reinterpret_cast<decltype(d.name)>(dlsym(lib, GPUMEM_STR(name)));             \
  if (!d.name) {                                                                          \
    d.why_not = "the CUDA driver lacks " GPUMEM_STR(name) "; update the NVIDIA driver";  \
    return;                                                                               \
  }
    GPUMEM_DRIVER_FNS(GPUMEM_RESOLVE)
    CUresult r = d.cuInit(0);
    if (r != CUDA_SUCCESS) {
      d.why_not = "cuInit failed with CUDA error " + std::to_string(r);
      return;
    }
    d.loaded = true;
  });
  return d;
}

[[noreturn]] void fail(CUresult r, const char* call) {
  const char* text = nullptr;
  if (driver().cuGetErrorString) driver().cuGetErrorString(r, &text);
  throw UpstreamError(std::string("gpumem: ") + call + " failed: " + (text ? text : "unknown error") +
                      " (CUDA error " + std::to_string(r) + ")");
}

void check(CUresult r, const char* call) {
  if (r != CUDA_SUCCESS) fail(r, call);
}

const Driver& loaded_driver() {
  const Driver& d = driver();
  if (!d.loaded) throw UpstreamError("gpumem: " + d.why_not);
  return d;
}

// Makes the device's primary context current for the scope of one upstream call, whatever device
// the calling thread has selected (tensors of cuda:1 may be freed while cuda:0 is current).
class ContextScope {
 public:
  explicit ContextScope(CUcontext ctx) { check(loaded_driver().cuCtxPushCurrent(ctx), "cuCtxPushCurrent"); }
  ~ContextScope() {
    CUcontext popped;
    driver().cuCtxPopCurrent(&popped);
  }
};

class CudaUpstreamBase : public Upstream {
 public:
  explicit CudaUpstreamBase(int device) : device_(device) {
    const Driver& d = loaded_driver();
    int count = 0;
    check(d.cuDeviceGetCount(&count), "cuDeviceGetCount");
    if (device < 0 || device >= count)
      throw InvalidArgument("gpumem: CUDA device " + std::to_string(device) + " does not exist (" +
                            std::to_string(count) + " visible)");
    check(d.cuDeviceGet(&cu_device_, device), "cuDeviceGet");
    check(d.cuDevicePrimaryCtxRetain(&context_, cu_device_), "cuDevicePrimaryCtxRetain");
    ContextScope scope(context_);
    std::size_t free_bytes = 0;
    check(d.cuMemGetInfo(&free_bytes, &total_), "cuMemGetInfo");
  }

  std::size_t device_total_bytes() const override { return total_; }
  std::size_t device_free_bytes() const override {
    ContextScope scope(context_);
    std::size_t free_bytes = 0, total = 0;
    check(driver().cuMemGetInfo(&free_bytes, &total), "cuMemGetInfo");
    return free_bytes;
  }

  EventId record_event(StreamId stream) override {
    ContextScope scope(context_);
    CUevent event;
    check(driver().cuEventCreate(&event, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    CUresult r = driver().cuEventRecord(event, reinterpret_cast<CUstream>(stream));
    if (r != CUDA_SUCCESS) {
      driver().cuEventDestroy(event);
      fail(r, "cuEventRecord");
    }
    return reinterpret_cast<EventId>(event);
  }
  bool event_completed(EventId event) override {
    ContextScope scope(context_);
    CUresult r = driver().cuEventQuery(reinterpret_cast<CUevent>(event));
    if (r == CUDA_ERROR_NOT_READY) return false;
    check(r, "cuEventQuery");
    return true;
  }
  void destroy_event(EventId event) override {
    ContextScope scope(context_);
    check(driver().cuEventDestroy(reinterpret_cast<CUevent>(event)), "cuEventDestroy");
  }
  void wait_event(EventId event) override {
    ContextScope scope(context_);
    check(driver().cuEventSynchronize(reinterpret_cast<CUevent>(event)), "cuEventSynchronize");
  }
  void synchronize(StreamId stream) override {
    ContextScope scope(context_);
    check(driver().cuStreamSynchronize(reinterpret_cast<CUstream>(stream)), "cuStreamSynchronize");
  }

 protected:
  int device_;
  CUdevice cu_device_ = 0;
  CUcontext context_ = nullptr;
  std::size_t total_ = 0;
};

// cudaMalloc-style: each region is one cuMemAlloc, returned whole with cuMemFree.
class CudaSegmentUpstream : public CudaUpstreamBase {
 public:
  using CudaUpstreamBase::CudaUpstreamBase;
  UpstreamKind kind() const override { return UpstreamKind::kSegments; }
  std::string name() const override { return "cuda-segments"; }
  std::size_t page_size() const override { return 2 * MiB; }

  std::uintptr_t allocate_segment(std::size_t bytes) override {
    ContextScope scope(context_);
    CUdeviceptr ptr = 0;
    CUresult r = driver().cuMemAlloc(&ptr, bytes);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return 0;
    check(r, "cuMemAlloc");
    return static_cast<std::uintptr_t>(ptr);
  }
  void free_segment(std::uintptr_t address, std::size_t) override {
    ContextScope scope(context_);
    check(driver().cuMemFree(static_cast<CUdeviceptr>(address)), "cuMemFree");
  }
};

// Virtual memory: one physical allocation (handle) per page, so any single page can go back.
class CudaVmmUpstream : public CudaUpstreamBase {
 public:
  CudaVmmUpstream(int device, bool exportable) : CudaUpstreamBase(device), exportable_(exportable) {
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = device;
    std::size_t granularity = 0;
    check(driver().cuMemGetAllocationGranularity(&granularity, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
          "cuMemGetAllocationGranularity");
    page_ = std::max<std::size_t>(2 * MiB, granularity);
    // Pages can be exported as file descriptors (CUDA IPC), where the driver allows it (map() drops
    // the request if cuMemCreate refuses it), unless the configuration asked for plain pages (ipc:false).
    prop_.requestedHandleTypes =
        exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  UpstreamKind kind() const override { return UpstreamKind::kPages; }
  std::string name() const override { return "cuda-vmm"; }
  std::size_t page_size() const override { return page_; }

  std::uintptr_t reserve_address_range(std::size_t bytes) override {
    ContextScope scope(context_);
    CUdeviceptr ptr = 0;
    CUresult r = driver().cuMemAddressReserve(&ptr, bytes, page_, 0, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return 0;
    check(r, "cuMemAddressReserve");
    return static_cast<std::uintptr_t>(ptr);
  }
  void release_address_range(std::uintptr_t address, std::size_t bytes) override {
    ContextScope scope(context_);
    check(driver().cuMemAddressFree(static_cast<CUdeviceptr>(address), bytes), "cuMemAddressFree");
  }

  bool map(std::uintptr_t address, std::size_t bytes, std::size_t page) override {
    ContextScope scope(context_);
    std::vector<std::uintptr_t> done;
    auto undo = [&] {
      for (std::uintptr_t a : done) unmap_page(a);
    };
    for (std::uintptr_t a = address; a < address + bytes; a += page) {
      CUmemGenericAllocationHandle handle;
      CUresult r = take_kept(page, &handle) ? CUDA_SUCCESS : create(page, &handle);
      if (r == CUDA_ERROR_OUT_OF_MEMORY && release_kept()) r = create(page, &handle);  // kept units of other sizes held it
      if (r == CUDA_ERROR_OUT_OF_MEMORY) {
        undo();
        return false;
      }
      if (r != CUDA_SUCCESS) {
        undo();
        fail(r, "cuMemCreate");
      }
      r = driver().cuMemMap(static_cast<CUdeviceptr>(a), page, 0, handle, 0);
      if (r != CUDA_SUCCESS) {
        driver().cuMemRelease(handle);
        undo();
        if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
        fail(r, "cuMemMap");
      }
      handles_[a] = Mapping{handle, page, -1, false};
      done.push_back(a);
    }
    CUresult r = driver().cuMemSetAccess(static_cast<CUdeviceptr>(address), bytes, &access_, 1);
    if (r != CUDA_SUCCESS) {
      undo();
      if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
      fail(r, "cuMemSetAccess");
    }
    return true;
  }

  void unmap(std::uintptr_t address, std::size_t bytes, std::size_t page) override {
    ContextScope scope(context_);
    for (std::uintptr_t a = address; a < address + bytes; a += page) unmap_page(a);
  }

  // Each new mapping holds a reference of its own (cuMemRetainAllocationHandle), which its unmap
  // releases: the memory goes back with the last mapping, whichever that is.
  bool map_from(std::uintptr_t address, std::uintptr_t source, std::size_t bytes, std::size_t page) override {
    for (std::uintptr_t s = source; s < source + bytes; s += page) {
      auto it = handles_.find(s);
      if (it == handles_.end() || it->second.bytes != page)
        throw UpstreamError("gpumem: map_from of a page that gpumem did not map with that unit");
      if (it->second.fd >= 0) return false;  // another process may map it: never shared here
    }
    ContextScope scope(context_);
    std::vector<std::uintptr_t> done;
    auto undo = [&] {
      for (std::uintptr_t a : done) unmap_page(a);
    };
    for (std::size_t off = 0; off < bytes; off += page) {
      CUmemGenericAllocationHandle handle;
      CUresult r = driver().cuMemRetainAllocationHandle(&handle, reinterpret_cast<void*>(source + off));
      if (r != CUDA_SUCCESS) {
        undo();
        fail(r, "cuMemRetainAllocationHandle");
      }
      r = driver().cuMemMap(static_cast<CUdeviceptr>(address + off), page, 0, handle, 0);
      if (r != CUDA_SUCCESS) {
        driver().cuMemRelease(handle);
        undo();
        if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;  // the pool maps new memory instead
        fail(r, "cuMemMap");
      }
      handles_[address + off] = Mapping{handle, page, -1, true};
      handles_[source + off].shared = true;
      done.push_back(address + off);
    }
    const CUresult r = driver().cuMemSetAccess(static_cast<CUdeviceptr>(address), bytes, &access_, 1);
    if (r != CUDA_SUCCESS) {
      undo();
      if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
      fail(r, "cuMemSetAccess");
    }
    return true;
  }

  void keep_released_units(bool on) override {
    keep_ = on;
    if (!on && !kept_.empty()) {
      ContextScope scope(context_);
      release_kept();
    }
  }

  ~CudaVmmUpstream() override {
    keep_ = false;
    for (const Kept& k : kept_) driver().cuMemRelease(k.handle);  // the pool released its pages already
  }

  std::vector<int> export_pages(std::uintptr_t address, std::size_t count, std::size_t page) override {
    if (!exportable_)
      throw UpstreamError("gpumem: this pool's pages were created without a shareable handle "
                          "(GPUMEM_CONF ipc:false), so they cannot be shared with another process; "
                          "leave ipc at its default (true) to share CUDA tensors between processes");
    if (prop_.requestedHandleTypes != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
      throw UpstreamError("gpumem: the CUDA driver does not let this device's memory be exported as "
                          "file descriptors, so it cannot be shared with another process");
    ContextScope scope(context_);
    std::vector<int> fds;
    for (std::size_t i = 0; i < count; ++i) {
      auto it = handles_.find(address + i * page);
      if (it == handles_.end() || it->second.bytes != page)
        throw UpstreamError("gpumem: export of a page that is not mapped");
      if (it->second.fd < 0) {
        int fd = -1;
        check(driver().cuMemExportToShareableHandle(&fd, it->second.handle,
                                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
              "cuMemExportToShareableHandle");
        it->second.fd = fd;
      }
      fds.push_back(it->second.fd);
    }
    return fds;
  }

 private:
  CUresult create(std::size_t page, CUmemGenericAllocationHandle* handle) {
    CUresult r = driver().cuMemCreate(handle, page, &prop_, 0);
    if ((r == CUDA_ERROR_NOT_SUPPORTED || r == CUDA_ERROR_INVALID_VALUE) &&
        prop_.requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE) {
      prop_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;  // no IPC here; plain pages still work
      r = driver().cuMemCreate(handle, page, &prop_, 0);
    }
    return r;
  }

  bool take_kept(std::size_t page, CUmemGenericAllocationHandle* handle) {
    for (std::size_t i = kept_.size(); i-- > 0;) {
      if (kept_[i].bytes != page) continue;
      *handle = kept_[i].handle;
      kept_.erase(kept_.begin() + static_cast<std::ptrdiff_t>(i));
      return true;
    }
    return false;
  }

  // Releases every kept unit; true when there were any. Throws the first driver error after trying all.
  bool release_kept() {
    if (kept_.empty()) return false;
    CUresult first_error = CUDA_SUCCESS;
    for (const Kept& k : kept_) {
      const CUresult r = driver().cuMemRelease(k.handle);
      if (r != CUDA_SUCCESS && first_error == CUDA_SUCCESS) first_error = r;
    }
    kept_.clear();
    check(first_error, "cuMemRelease");
    return true;
  }

  void unmap_page(std::uintptr_t a) {
    auto it = handles_.find(a);
    if (it == handles_.end()) throw UpstreamError("gpumem: unmap of a page that gpumem never mapped");
    check(driver().cuMemUnmap(static_cast<CUdeviceptr>(a), it->second.bytes), "cuMemUnmap");
    // A page shared with another process (exported) is never reused here: that process may still
    // map its memory; nor is a unit mapped twice (map_from): the other mapping may still hold it.
    // Others are kept while the pool asks (keep_released_units).
    if (keep_ && it->second.fd < 0 && !it->second.shared) {
      kept_.push_back(Kept{it->second.handle, it->second.bytes});
    } else {
      if (it->second.fd >= 0) ::close(it->second.fd);
      const CUmemGenericAllocationHandle handle = it->second.handle;
      handles_.erase(it);
      check(driver().cuMemRelease(handle), "cuMemRelease");
      return;
    }
    handles_.erase(it);
  }

  bool exportable_;  // asked for exportable pages (the driver may still have refused: prop_ says)
  CUmemAllocationProp prop_ = {};
  CUmemAccessDesc access_ = {};
  std::size_t page_ = 2 * MiB;
  struct Mapping {
    CUmemGenericAllocationHandle handle;
    std::size_t bytes;
    int fd;  // exported file descriptor (export_pages), -1 until the page is first shared
    bool shared;  // mapped twice by map_from (now or before): released when unmapped, never kept
  };
  std::unordered_map<std::uintptr_t, Mapping> handles_;  // by page address
  // Units unmapped while keep_ was on, not yet mapped again or released (they hold device memory).
  struct Kept {
    CUmemGenericAllocationHandle handle;
    std::size_t bytes;
  };
  bool keep_ = false;
  std::vector<Kept> kept_;
};

}  // namespace

bool cuda_upstreams_built() { return true; }

bool cuda_available() { return cuda_device_count() > 0; }

int cuda_device_count() {
  const Driver& d = driver();
  if (!d.loaded) return 0;
  int count = 0;
  return d.cuDeviceGetCount(&count) == CUDA_SUCCESS ? count : 0;
}

bool cuda_vmm_supported(int device) {
  const Driver& d = driver();
  if (!d.loaded || device < 0 || device >= cuda_device_count()) return false;
  CUdevice dev;
  int supported = 0;
  if (d.cuDeviceGet(&dev, device) != CUDA_SUCCESS) return false;
  if (d.cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev) != CUDA_SUCCESS)
    return false;
  return supported != 0;
}

std::shared_ptr<Upstream> make_cuda_upstream(UpstreamKind kind, int device, bool exportable) {
  if (kind == UpstreamKind::kPages) {
    if (!cuda_vmm_supported(device))
      throw UpstreamError("gpumem: CUDA device " + std::to_string(device) +
                          " does not support virtual memory management; use upstream:segments");
    return std::make_shared<CudaVmmUpstream>(device, exportable);
  }
  return std::make_shared<CudaSegmentUpstream>(device);
}

// Linux 5.6+: another process's file descriptor, by pid (needs ptrace access to that process:
// same user, and under Yama ptrace_scope 1 an ancestor only through CAP_SYS_PTRACE).
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

std::shared_ptr<void> cuda_import_pages(int device, int pid, const std::vector<int>& remote_fds,
                                        std::size_t page) {
  const Driver& d = loaded_driver();
  if (remote_fds.empty() || page == 0) throw InvalidArgument("gpumem: nothing to import");
  CUdevice dev;
  check(d.cuDeviceGet(&dev, device), "cuDeviceGet");
  CUcontext context;
  check(d.cuDevicePrimaryCtxRetain(&context, dev), "cuDevicePrimaryCtxRetain");
  ContextScope scope(context);
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0)
    throw UpstreamError("gpumem: cannot reach process " + std::to_string(pid) +
                        " to import its CUDA memory (pidfd_open: errno " + std::to_string(errno) + ")");
  std::vector<CUmemGenericAllocationHandle> handles;
  CUdeviceptr base = 0;
  std::size_t mapped = 0;
  const std::size_t bytes = remote_fds.size() * page;
  auto undo = [&] {
    for (std::size_t i = 0; i < mapped; ++i) d.cuMemUnmap(base + i * page, page);
    if (base) d.cuMemAddressFree(base, bytes);
    for (auto h : handles) d.cuMemRelease(h);
    ::close(pidfd);
  };
  try {
    for (int remote : remote_fds) {
      const int fd = static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd, remote, 0));
      if (fd < 0)
        throw UpstreamError("gpumem: cannot take file descriptor " + std::to_string(remote) +
                            " of process " + std::to_string(pid) + " (pidfd_getfd: errno " +
                            std::to_string(errno) + "; the processes must run as the same user, and "
                            "ptrace access between them must be allowed)");
      CUmemGenericAllocationHandle h;
      CUresult r = d.cuMemImportFromShareableHandle(
          &h, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
      ::close(fd);
      check(r, "cuMemImportFromShareableHandle");
      handles.push_back(h);
    }
    check(d.cuMemAddressReserve(&base, bytes, page, 0, 0), "cuMemAddressReserve");
    for (; mapped < handles.size(); ++mapped)
      check(d.cuMemMap(base + mapped * page, page, 0, handles[mapped], 0), "cuMemMap");
    CUmemAccessDesc access = {};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check(d.cuMemSetAccess(base, bytes, &access, 1), "cuMemSetAccess");
  } catch (...) {
    undo();
    throw;
  }
  ::close(pidfd);
  // Unmapped and released when the last user lets go (torch: the receiving storage dies).
  return std::shared_ptr<void>(reinterpret_cast<void*>(base), [=](void*) {
    const Driver& drv = driver();
    CUcontext popped;
    if (drv.cuCtxPushCurrent(context) != CUDA_SUCCESS) return;
    for (std::size_t i = 0; i < handles.size(); ++i) drv.cuMemUnmap(base + i * page, page);
    drv.cuMemAddressFree(base, bytes);
    for (auto h : handles) drv.cuMemRelease(h);
    drv.cuCtxPopCurrent(&popped);
  });
}

}  // namespace gpumem

#else  // built without the CUDA headers

namespace gpumem {
bool cuda_upstreams_built() { return false; }
bool cuda_available() { return false; }
int cuda_device_count() { return 0; }
bool cuda_vmm_supported(int) { return false; }
std::shared_ptr<Upstream> make_cuda_upstream(UpstreamKind, int, bool) {
  throw UpstreamError("gpumem was built without the CUDA toolkit headers: rebuild with CUDA available");
}
std::shared_ptr<void> cuda_import_pages(int, int, const std::vector<int>&, std::size_t) {
  throw UpstreamError("gpumem was built without the CUDA toolkit headers: rebuild with CUDA available");
}
}  // namespace gpumem

#endif
