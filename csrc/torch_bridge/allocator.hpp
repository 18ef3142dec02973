// gpumem's PyTorch allocator: a CUDAPluggableAllocator subclass that answers every call the plain
// pluggable allocator throws on or ignores (stats, snapshots, history, empty_cache, memory fraction,
// cacheInfo, record_stream, CUDA graph pools, checkpoints), backed by one gpumem::Pool per device
// plus one private gpumem::Pool per graph / MemPool id.
//
// The class is implemented in four files, one concept each:
//   allocator.cpp      construction and configuration, routing of allocations, every free path,
//                      deferred frees, memory fraction, empty_cache, record_stream, peers;
//   private_pools.cpp  private pools (CUDA graph capture, MemPool): routes, use counts, lifetime,
//                      and cudagraph trees' checkpoints (getCheckpointState / setCheckpointPoolState);
//   introspection.cpp  statistics, snapshots, memory history (trace entries, segment events,
//                      trackers, the profiler's memory events);
//   oom.cpp            out-of-memory errors in PyTorch's words plus gpumem's figures, OOM observers;
//   ipc.cpp            CUDA IPC (torch.multiprocessing): pages exported as file descriptors;
//   foreign.cpp        other libraries' blocks (CuPy, Numba, RMM) from the main pools, and the live
//                      bytes counted per library (torch's included);
//   external_upstream  the upstream of MemPools whose memory comes from another torch allocator.
// Helpers shared by those files (error translation, capture-mode and device guards): bridge_util.hpp.
//
// Routing:
//   - allocate() on device D, stream S: if a beginAllocateToPool() filter of D accepts S (a CUDA graph
//     capture, torch.cuda.use_mem_pool, cudagraph trees), the block comes from that id's private pool;
//     otherwise from D's main pool (created on first use, configured by GPUMEM_CONF).
//   - Every DataPtr carries the one deleter raw_deleter() returns, as PyTorch's own allocator does:
//     torch compares deleters with it (cudagraph trees swap and restore them). The free looks the
//     pointer up: the current device's main pool first (the common case, no exception on a miss),
//     then the private pools, then the other devices' main pools.
//   - A free of a pointer gpumem does not own is logged once and ignored: nothing is corrupted.
// CUDA graph capture:
//   - Private pools never release memory on their own (release policy "lazy"); a pool's memory goes
//     back only when its use count (beginAllocateToPool / createOrIncrefPool minus releasePool) is 0
//     and it holds no live block.
//   - While any capture may be underway, pool calls run in cudaStreamCaptureModeRelaxed (as PyTorch
//     does around cudaMalloc) and frees of blocks that were record_stream()'d are deferred until the
//     last endAllocateToPool(), since their end-of-life events cannot be recorded/queried in capture.
//
// Lock order (a thread holding one may take only those after it; never the reverse):
//   config_mutex_ -> DeviceState::create_mutex -> routes_mutex_ -> PrivatePool::mutex
//     -> Pool's own lock -> recorded_mutex_ -> callback_mutex_ -> trace_mutex_
// foreign_mutex_ (foreign.cpp's ledger) is taken alone: never while holding another bridge lock or a
// pool's, and nothing is taken under it.
// Pools call the segment observer (which takes trace_mutex_) with their lock held, hence trace_mutex_
// last; trace trackers run under trace_mutex_ and must not call the allocator. Context recorders
// (they may take the GIL) and OOM callbacks (gc.collect, which frees) run with no bridge lock held.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAMacros.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#else
#include <torch/version.h>
#endif

#include "core/config.hpp"
#include "core/pool.hpp"
#include "core/timed_upstream.hpp"

// 211 for torch 2.11. Used to pick the allocator interface's signatures, which changed over 2.5..2.11.
#define GPUMEM_TORCH_VERSION (TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR)

namespace gpumem::torch_bridge {

namespace CCA = c10::cuda::CUDACachingAllocator;
using MempoolId = std::pair<unsigned long long, unsigned long long>;  // == c10::MempoolId_t

constexpr int kMaxDevices = C10_COMPILE_TIME_MAX_GPUS;
constexpr MempoolId kDefaultPool{0, 0};

// The libraries whose live bytes the bridge counts apart. torch allocates through the allocator
// interface; the others through foreign_alloc / foreign_free (foreign.cpp), from the same main pools.
enum class Library : int { kTorch = 0, kCupy = 1, kNumba = 2, kRmm = 3 };
constexpr int kNumLibraries = 4;
const char* library_name(Library library);  // "torch", "cupy", "numba", "rmm"

// One library's figures on one device.
struct LibraryUsage {
  std::int64_t current = 0;      // SUM: live bytes (blocks rounded to 512, as allocated_bytes)
  std::int64_t peak = 0;         // SUM: highest `current` since the last peak reset
  std::int64_t allocations = 0;  // COUNT: live blocks
  std::int64_t ooms = 0;         // COUNT: requests that failed with out-of-memory (foreign only)
};

// What foreign_alloc throws when the device's main pool cannot serve a request even after releasing
// its cache and running the OOM callbacks (gc). The Python layer turns it into the library's own
// out-of-memory error (cupy.cuda.memory.OutOfMemoryError, numba's CudaAPIError, MemoryError for RMM).
class ForeignOutOfMemory : public std::runtime_error {
 public:
  ForeignOutOfMemory(const std::string& message, std::size_t requested_bytes, std::size_t allocated_bytes,
                     std::size_t limit_bytes)
      : std::runtime_error(message), requested(requested_bytes), allocated(allocated_bytes),
        limit(limit_bytes) {}
  std::size_t requested, allocated, limit;  // limit: the effective cap (cap, fraction or device)
};

// A private pool: the memory of one CUDA graph pool / torch.cuda.MemPool id on one device.
struct PrivatePool {
  int device = 0;
  MempoolId id{0, 0};
  int use_count = 0;
  bool use_on_oom = false;
  std::mutex mutex;             // guards creating `pool`
  std::unique_ptr<Pool> pool;   // created on first allocation
  // When createOrIncrefPool() names another allocator (a MemPool of a pluggable allocator, NCCL's),
  // the pool's segments come from it (ExternalUpstream); gpumem still caches and splits them.
  std::shared_ptr<CCA::CUDAAllocator> external;
};

// The state cudagraph trees checkpoint: the private pool's live blocks.
struct GpumemCheckpointState : CCA::AllocatorState {
  struct Live {
    std::uintptr_t address;
    std::size_t size;       // the block's size (rounded)
    std::size_t requested;  // what was asked for
  };
  int device = 0;
  MempoolId id{0, 0};
  std::vector<Live> live;  // sorted by address
};

class GpumemAllocator final : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  // The one allocator of the process. Never destroyed: the pools outlive torch's static teardown.
  static GpumemAllocator& instance();
  // A non-owning shared_ptr (always the same control block), as changeCurrentAllocator wants.
  static std::shared_ptr<CCA::CUDAAllocator> shared();

  // Sets GPUMEM_CONF. @throws InvalidArgument naming the bad key. A different string once a pool
  // exists is refused (pools are configured when created).
  void configure(const std::string& conf);
  const Config& config();
  // True when this allocator is c10's current CUDA allocator.
  bool is_current() const;

  // ---- accessors for gpumem's Python layer (device: a CUDA ordinal) ----
  DeviceStats pool_stats(int device);  // main + private pools; zeros if none created yet
  UpstreamTime& upstream_time(int device);  // all the device's pools' driver calls and waits
  std::size_t trim(int device);        // main pool; returns bytes released
  void set_cap(int device, std::size_t bytes);
  std::size_t cap(int device);
  std::size_t effective_cap(int device);
  std::size_t largest_free(int device);
  void validate(int device);
  std::size_t private_pool_count();
  // What trace trackers were told, checked the way NCCL's register hooks rely on it: the segments
  // allocated and not yet freed (device, address, bytes), and the entries that broke the rules (a
  // free of a segment not live with those bytes, an allocation over a live one), plus the exceptions
  // trackers threw. start_tracker_audit() attaches the auditing tracker (once; trackers cannot be
  // detached). For tests (tests/gpu/dist_nccl_register.py).
  struct TrackerAudit {
    std::vector<std::tuple<int, std::uintptr_t, std::size_t>> segments;
    std::size_t allocs = 0, frees = 0, mismatches = 0, tracker_errors = 0;
    std::string first_tracker_error;
  };
  void start_tracker_audit();
  TrackerAudit tracker_audit();
  // The OOM callback (Python: gc.collect) of every main pool, present and future. Empty = none.
  void set_oom_callback(std::function<void()> callback);
  // What runs before an allocation on `device` fails: torch's free-memory callbacks, then the
  // callback set above when `gc_on_oom`.
  void run_oom_callbacks(int device, bool gc_on_oom);

  // ---- foreign.cpp: other libraries' blocks from the device's main pool ----
  // A block of `size` bytes for `library` (not kTorch) on `device`, used on `stream`: the main pool's
  // arena of that stream, so its free is stream-ordered as torch's are. Null for size 0.
  // @throws ForeignOutOfMemory after the pool released its cache and ran the OOM callbacks;
  //   c10 errors (ValueError / RuntimeError) for a bad device, library or size.
  void* foreign_alloc(Library library, std::size_t size, int device, cudaStream_t stream);
  // Frees a block foreign_alloc handed out (to any library); returns its size. `stream`: the stream
  // the library frees it on (RMM's deallocate), recorded on the block when it is not the one it was
  // allocated on; none: the allocation's stream (CuPy and Numba free with no stream).
  // @throws ValueError for a pointer that is not a live foreign block (nothing changes).
  std::size_t foreign_free(void* ptr, std::optional<cudaStream_t> stream = std::nullopt);
  // The live bytes of each library on `device` (index: Library). torch's are the blocks torch
  // allocated through the allocator interface (main and private pools).
  std::vector<LibraryUsage> library_usage(int device);
  // (free, total) as a library sees the device through gpumem: total is the effective cap, free what
  // can still be allocated under it (cached free memory included).
  std::pair<std::size_t, std::size_t> memory_info(int device);

  // ---- c10::Allocator ----
  c10::DataPtr allocate(std::size_t size) override;
  c10::DeleterFnPtr raw_deleter() const override;

  // ---- CUDAAllocator ----
  void* raw_alloc(std::size_t nbytes) override;
  void* raw_alloc_with_stream(std::size_t nbytes, cudaStream_t stream) override;
  void raw_delete(void* ptr) override;
  void init(int device_count) override;
  bool initialized() override;
  // No `override` on methods that are not in every supported torch: where the base has them (2.11
  // has all of them) they still override; where it does not, they are harmless extras.
  double getMemoryFraction(c10::DeviceIndex device);
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override;
  std::vector<CCA::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex device);
#if GPUMEM_TORCH_VERSION >= 208
  void emptyCache(c10::MempoolId_t mempool_id = {0, 0}) override;
#else
  void emptyCache() override;
#endif
  void cacheInfo(c10::DeviceIndex device, std::size_t* largestBlock) override;
  void* getBaseAllocation(void* ptr, std::size_t* size) override;
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override;
  CCA::DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;
#if GPUMEM_TORCH_VERSION >= 210
  CCA::SnapshotInfo snapshot(c10::MempoolId_t mempool_id = {0, 0},
                             bool include_traces = true) override;
#elif GPUMEM_TORCH_VERSION >= 207
  CCA::SnapshotInfo snapshot(c10::MempoolId_t mempool_id = {0, 0}) override;
#else
  CCA::SnapshotInfo snapshot() override;
#endif
  void beginAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override;
  void endAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id) override;
  void releasePool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id) override;
  int getPoolUseCount(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id);
  void createOrIncrefPool(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                          std::shared_ptr<CCA::CUDAAllocator> allocator = nullptr);
  void setUseOnOOM(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id, bool use_on_oom);
  void setNoSplit(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id);
  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::cuda::MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected_live_allocations) override;
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override;
  CCA::ShareableHandle shareIpcHandle(void* ptr) override;
  bool isHistoryEnabled() override;
#if GPUMEM_TORCH_VERSION >= 209
  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                     std::size_t alloc_trace_max_entries, CCA::RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) override;
#elif GPUMEM_TORCH_VERSION >= 206
  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                     std::size_t alloc_trace_max_entries, CCA::RecordContext when,
                     bool clearHistory) override;
#else
  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                     std::size_t alloc_trace_max_entries, CCA::RecordContext when) override;
#endif
  // torch.cuda.memory._set_memory_metadata: copied into every trace entry recorded afterwards.
  void setUserMetadata(const std::string& metadata);
  std::string getUserMetadata();
  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override;
  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) override;
  std::shared_ptr<CCA::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          c10::cuda::MempoolId_t id) override;
  CCA::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<CCA::AllocatorState> pps) override;
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override;
  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                          std::size_t count, cudaStream_t stream, bool p2p_enabled) override;
  std::string name() override;

  // The deleter of every DataPtr gpumem hands out (raw_deleter()): finds the owning pool and frees.
  void free_any(void* ptr) noexcept;

 private:
  GpumemAllocator();

  struct DeviceState {
    std::atomic<Pool*> main{nullptr};
    std::mutex create_mutex;
    std::unique_ptr<Pool> owner;
    int callback_id = 0;
    // What set_per_process_memory_fraction set (< 0: never set), returned as is by the getter.
    std::atomic<double> fraction{-1.0};
    // The device's limit and reserved bytes, shared by its main and private pools.
    std::shared_ptr<Budget> budget = std::make_shared<Budget>();
    // torch's live bytes (foreign.cpp's per-library view): atomics, as they change on torch's hot path.
    std::atomic<std::int64_t> torch_bytes{0};
    std::atomic<std::int64_t> torch_peak{0};
    std::atomic<std::int64_t> torch_blocks{0};
    // The time the device's pools spent in driver calls and waits (every pool's upstream is timed).
    std::shared_ptr<UpstreamTime> upstream_time = std::make_shared<UpstreamTime>();
  };
  struct Route {
    int device;
    MempoolId id;
    std::function<bool(cudaStream_t)> filter;
    std::shared_ptr<PrivatePool> pool;
  };

  // ---- allocator.cpp: pools, allocation, frees ----
  void* malloc_on(std::size_t size, int device, cudaStream_t stream);
  Pool& main_pool(int device);
  Pool* main_pool_if_created(int device) const;
  Pool& create_main_pool(int device);
  // `external`: the allocator a MemPool named, whose memory the pool carves (null: the device's).
  std::unique_ptr<Pool> make_pool(int device, MempoolId id, ReleasePolicy release,
                                  std::shared_ptr<CCA::CUDAAllocator> external = nullptr);
  // pool.allocate with the core's errors as torch's (OOM: torch.cuda.OutOfMemoryError). With
  // `may_borrow` (the main pool), an OOM first borrows from MemPools made with use_on_oom=True.
  std::uintptr_t pool_allocate(Pool& pool, std::size_t size, int device, cudaStream_t stream,
                               bool may_borrow = false);
  bool free_now(void* ptr);
  bool try_free_main(int device, std::uintptr_t p);
  bool defer_if_recorded(void* ptr);
  void flush_deferred();
  void empty_cache_impl(MempoolId mempool_id);
  // Gives `device`'s main pool's cached memory back (nothing when it was never created), in relaxed
  // capture mode when `relaxed_mode` (a capture may be underway on another thread): empty_cache(),
  // and a private pool that ran out (reclaim_for_private_pool).
  void trim_main_pool(int device, bool relaxed_mode);
  // The pool that handed out the live block at `p` (main pools, then private pools) and its device,
  // or null: one lookup for getBaseAllocation, recordStream and shareIpcHandle.
  Pool* owning_pool(std::uintptr_t p, int* device = nullptr);
  int check_device(int device) const;

  // ---- private_pools.cpp ----
  std::shared_ptr<PrivatePool> route(int device, cudaStream_t stream);
  void* alloc_private(PrivatePool& pp, std::size_t size, cudaStream_t stream);
  std::shared_ptr<PrivatePool> find_private(int device, MempoolId id);
  std::shared_ptr<PrivatePool> create_or_incref(int device, MempoolId id);
  std::vector<std::uintptr_t> live_pointers_of(const std::shared_ptr<PrivatePool>& pp);
  // The pool of a private pool id, created on first use (never releasing on its own).
  Pool& private_pool_memory(PrivatePool& pp);
  // private_ptrs_ and its lock-free count (the free path's check) changed together; the caller
  // holds routes_mutex_.
  void remember_private(std::uintptr_t p, std::shared_ptr<PrivatePool> pp);
  void forget_private(std::uintptr_t p);
  bool try_free_private(void* ptr);
  // The cached memory of MemPools made with use_on_oom=True, for a main-pool allocation that failed.
  std::uintptr_t borrow_from_oom_pools(int device, std::size_t size, cudaStream_t stream);
  // A private pool's out-of-memory callback: unless the current stream is capturing, runs the OOM
  // callbacks and gives the main pool's cache back to the device (the pool then retries).
  void reclaim_for_private_pool(int device);
  void free_private_block(const std::shared_ptr<PrivatePool>& pp, std::uintptr_t p);
  void maybe_destroy(const std::shared_ptr<PrivatePool>& pp);
  std::vector<std::shared_ptr<PrivatePool>> private_pools_of(int device);

  // ---- foreign.cpp ----
  // torch's live bytes on `device` change by `delta` (a block of |delta| bytes allocated or freed).
  void count_torch(int device, std::int64_t delta);
  void reset_library_peaks(int device);

  // ---- oom.cpp ----
  // Runs torch's FreeCudaMemoryCallbacksRegistry (torch registers cuda_ipc_collect there: blocks this
  // process shared over CUDA IPC, held until their consumers let go) before a main pool gives up, as
  // PyTorch's allocator does; a callback that throws is reported as a warning. True if one freed
  // something.
  static bool run_torch_free_memory_callbacks(int device);
  [[noreturn]] void raise_oom(int device, std::size_t requested, const std::string& detail,
                              std::size_t allocated, cudaStream_t stream);

  // ---- introspection.cpp ----
  // What a pool reports when it maps / unmaps memory (its lock held): trace entries and trackers.
  // Memory history gets the maps and unmaps as they happen (segment_map / segment_unmap, as torch's
  // expandable segments); trackers get the segments as snapshot() shows them (SEGMENT_ALLOC /
  // SEGMENT_FREE of the pool's spans, the free told before the memory goes back), which is what
  // NCCL's register hooks act on (docs/distributed.md).
  void on_segment_event(int device, MempoolId pool, SegmentEvent event, std::uintptr_t address,
                        std::size_t bytes, StreamId stream);
  enum class TraceTo { kBoth, kHistory, kTrackers };
  void record_trace(CCA::TraceEntry::Action action, int device, std::uintptr_t addr,
                    std::size_t size, cudaStream_t stream, MempoolId pool,
                    std::shared_ptr<c10::GatheredContext> context, TraceTo to = TraceTo::kBoth);
  std::shared_ptr<c10::GatheredContext> gather_context(CCA::RecordContext level);
  void trace_alloc(int device, std::uintptr_t p, std::size_t size, cudaStream_t stream,
                   MempoolId pool, std::shared_ptr<c10::GatheredContext> context);
  void trace_free(int device, std::uintptr_t p, std::size_t size, MempoolId pool,
                  std::shared_ptr<c10::GatheredContext> context);
  void report_to_profiler(int device, std::uintptr_t p, std::int64_t delta);
  void append_segments(CCA::SnapshotInfo& out, int device, Pool& pool, MempoolId owner);
  CCA::SnapshotInfo snapshot_impl(MempoolId mempool_id, bool include_traces);

  DeviceState devices_[kMaxDevices];
  std::atomic<int> device_count_{-1};

  std::mutex config_mutex_;
  bool configured_ = false;
  std::string conf_text_;
  Config config_;

  // Private pools and the routes that send allocations to them.
  std::mutex routes_mutex_;
  std::vector<Route> routes_;
  std::atomic<int> routing_count_{0};  // routes_.size(): the allocation fast path reads only this
  std::map<std::pair<int, MempoolId>, std::shared_ptr<PrivatePool>> private_pools_;
  std::unordered_map<std::uintptr_t, std::shared_ptr<PrivatePool>> private_ptrs_;
  std::atomic<int> private_count_{0};  // private_ptrs_.size()

  // Blocks that had record_stream(): their free records events, which cannot happen in capture.
  std::mutex recorded_mutex_;
  std::unordered_set<void*> recorded_;
  std::atomic<int> recorded_count_{0};
  std::vector<void*> deferred_;

  std::mutex callback_mutex_;
  std::function<void()> oom_callback_;
  std::vector<CCA::OutOfMemoryObserver> oom_observers_;

  // Memory history (torch.cuda.memory._record_memory_history), trace trackers, profiler events.
  std::mutex trace_mutex_;
  std::atomic<bool> tracing_{false};  // history on, or a tracker attached
  bool record_history_ = false;
  CCA::CreateContextFn context_recorder_ = nullptr;
  CCA::RecordContext record_context_ = CCA::RecordContext::NEVER;
  std::size_t max_entries_ = 1;
  std::vector<std::deque<CCA::TraceEntry>> traces_;  // per device
  std::unordered_set<int> skip_actions_;
  std::unordered_map<std::uintptr_t, std::shared_ptr<c10::GatheredContext>> alloc_context_;
  std::vector<CCA::AllocatorTraceTracker> trackers_;
  std::size_t tracker_errors_ = 0;
  std::string first_tracker_error_;
  bool auditing_ = false;
  std::map<std::pair<int, std::uintptr_t>, std::size_t> audit_live_;
  TrackerAudit audit_counts_;  // its segments stay empty: audit_live_ holds them
  std::string user_metadata_;

  std::atomic<bool> warned_foreign_{false};

  // Foreign blocks (foreign.cpp): pointer -> (library, size, device), and the usage of each library
  // on each device, under foreign_mutex_ (taken alone; see the lock order).
  struct ForeignBlock {
    Library library = Library::kTorch;
    std::size_t size = 0;
    int device = 0;
    cudaStream_t stream = nullptr;  // the stream it was allocated on
  };
  std::mutex foreign_mutex_;
  std::unordered_map<std::uintptr_t, ForeignBlock> foreign_blocks_;
  std::vector<std::array<LibraryUsage, kNumLibraries>> foreign_usage_ =
      std::vector<std::array<LibraryUsage, kNumLibraries>>(kMaxDevices);
};

}  // namespace gpumem::torch_bridge
