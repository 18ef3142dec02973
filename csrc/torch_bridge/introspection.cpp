// What the bridge shows of its pools: statistics in torch's DeviceStats shape (main and private
// pools added up), the pool accessors gpumem's Python layer calls, memory snapshots
// (torch.cuda.memory_snapshot / _snapshot), and memory history: trace entries for allocations,
// frees, segment maps and unmaps, OOMs, with the stacks torch's context recorder gathers, the user
// metadata, the attached trace trackers (NCCL's), and the profiler's memory events.
#include <algorithm>
#include <iterator>
#include <utility>

#include <c10/core/Allocator.h>
#include <c10/util/ApproximateClock.h>

#include "torch_bridge/allocator.hpp"
#include "torch_bridge/bridge_util.hpp"

namespace gpumem::torch_bridge {

namespace {

using Action = CCA::TraceEntry::Action;

void to_c10(c10::CachingAllocator::Stat& to, const Stat& from) {
#define GPUMEM_C10_FIELD(f) to.f = from.f;
  GPUMEM_STAT_FIELDS(GPUMEM_C10_FIELD)
#undef GPUMEM_C10_FIELD
}

// gpumem's statistics as torch's: the same members (core/stats.hpp's schema), copied one by one.
CCA::DeviceStats to_c10(const DeviceStats& s) {
  CCA::DeviceStats out;
#define GPUMEM_C10_ARRAY(name) for (int t = 0; t < kNumStatTypes; ++t) to_c10(out.name[t], s.name[t]);
#define GPUMEM_C10_STAT(name) to_c10(out.name, s.name);
#define GPUMEM_C10_NUMBER(name) out.name = s.name;
  GPUMEM_STATS_SCHEMA(GPUMEM_C10_ARRAY, GPUMEM_C10_STAT, GPUMEM_C10_NUMBER, GPUMEM_C10_NUMBER)
#undef GPUMEM_C10_ARRAY
#undef GPUMEM_C10_STAT
#undef GPUMEM_C10_NUMBER
  return out;
}

Action parse_action(const std::string& name) {
  static const std::pair<const char*, Action> table[] = {
      {"alloc", Action::ALLOC},
      {"free_requested", Action::FREE_REQUESTED},
      {"free_completed", Action::FREE_COMPLETED},
      {"segment_alloc", Action::SEGMENT_ALLOC},
      {"segment_free", Action::SEGMENT_FREE},
      {"segment_map", Action::SEGMENT_MAP},
      {"segment_unmap", Action::SEGMENT_UNMAP},
      {"snapshot", Action::SNAPSHOT},
      {"oom", Action::OOM},
  };
  for (const auto& [key, action] : table)
    if (name == key) return action;
  TORCH_CHECK(false, cat("Unknown TraceEntry action: ", name, " (gpumem: in skip_actions)"));
}

}  // namespace

// ---- stats ---------------------------------------------------------------------------------------

DeviceStats GpumemAllocator::pool_stats(int device) {
  DeviceStats total;
  if (Pool* pool = main_pool_if_created(device)) total.merge(pool->stats());
  for (auto& pp : private_pools_of(device))
    if (pp->pool) total.merge(pp->pool->stats());
  return total;
}

CCA::DeviceStats GpumemAllocator::getDeviceStats(c10::DeviceIndex device) {
  return to_c10(pool_stats(check_device(device)));
}

void GpumemAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  if (Pool* pool = main_pool_if_created(check_device(device))) pool->reset_accumulated_stats();
  for (auto& pp : private_pools_of(device))
    if (pp->pool) pp->pool->reset_accumulated_stats();
}

void GpumemAllocator::resetPeakStats(c10::DeviceIndex device) {
  if (Pool* pool = main_pool_if_created(check_device(device))) pool->reset_peak_stats();
  for (auto& pp : private_pools_of(device))
    if (pp->pool) pp->pool->reset_peak_stats();
  reset_library_peaks(device);
}

std::size_t GpumemAllocator::trim(int device) {
  Pool* pool = main_pool_if_created(check_device(device));
  if (!pool) return 0;
  return translate([&] {
    DeviceSwitch on(device);
    pool->process_events();
    return pool->trim();
  });
}

void GpumemAllocator::set_cap(int device, std::size_t bytes) {
  Pool& pool = main_pool(device);
  translate([&] {
    DeviceSwitch on(device);
    pool.set_cap(bytes);
  });
}

std::size_t GpumemAllocator::cap(int device) {
  Pool* pool = main_pool_if_created(check_device(device));
  return pool ? pool->cap() : 0;
}

std::size_t GpumemAllocator::effective_cap(int device) {
  return translate([&] { return main_pool(device).effective_cap(); });
}

std::size_t GpumemAllocator::largest_free(int device) {
  Pool* pool = main_pool_if_created(check_device(device));
  return pool ? pool->largest_free_block() : 0;
}

void GpumemAllocator::validate(int device) {
  translate([&] {
    if (Pool* pool = main_pool_if_created(check_device(device))) pool->validate();
    for (auto& pp : private_pools_of(device))
      if (pp->pool) pp->pool->validate();
  });
}

std::size_t GpumemAllocator::private_pool_count() {
  std::lock_guard<std::mutex> lock(routes_mutex_);
  return private_pools_.size();
}

// ---- snapshot & history --------------------------------------------------------------------------

void GpumemAllocator::append_segments(CCA::SnapshotInfo& out, int device, Pool& pool,
                                      MempoolId owner) {
  const bool paged = pool.upstream().kind() == UpstreamKind::kPages;
  std::vector<RegionInfo> regions = pool.snapshot();
  std::lock_guard<std::mutex> lock(trace_mutex_);
  for (const RegionInfo& r : regions) {
    CCA::SegmentInfo seg;
    seg.device = static_cast<c10::DeviceIndex>(device);
    seg.address = r.address;
    seg.total_size = r.size;
    seg.stream = reinterpret_cast<void*>(r.stream);
    seg.is_large = !r.small;
    seg.is_expandable = paged;
    seg.owner_private_pool_id = owner;
    for (const BlockInfo& b : r.blocks) {
      CCA::BlockInfo info;
      info.size = b.size;
      info.requested_size = b.state == BlockInfo::kAllocated ? b.requested : b.last_requested;
      info.allocated = b.state == BlockInfo::kAllocated;
      info.active = b.state != BlockInfo::kFree;
      if (info.allocated) {
        seg.allocated_size += b.size;
        seg.requested_size += b.requested;
        auto it = alloc_context_.find(b.address);
        if (it != alloc_context_.end()) info.context_when_allocated = it->second;
      }
      if (info.active) seg.active_size += b.size;
      seg.blocks.push_back(std::move(info));
    }
    out.segments.push_back(std::move(seg));
  }
}

CCA::SnapshotInfo GpumemAllocator::snapshot_impl(MempoolId mempool_id, bool include_traces) {
  CCA::SnapshotInfo out{};
  const bool all = mempool_id == kDefaultPool;
  bool paged = false;
  int devices = std::max(device_count_.load(), 1);
  for (int d = 0; d < kMaxDevices; ++d) {
    Pool* pool = main_pool_if_created(d);
    if (!pool) continue;
    devices = std::max(devices, d + 1);
    paged = paged || pool->upstream().kind() == UpstreamKind::kPages;
    if (all) append_segments(out, d, *pool, kDefaultPool);
  }
  for (auto& pp : private_pools_of(-1)) {
    if (!all && pp->id != mempool_id) continue;
    if (pp->pool) append_segments(out, pp->device, *pp->pool, pp->id);
  }
#if GPUMEM_TORCH_VERSION >= 206
  {
    std::lock_guard<std::mutex> lock(config_mutex_);
    out.config_metadata.last_allocator_settings = "gpumem:" + conf_text_;
  }
  out.config_metadata.expandable_segments = paged;
#endif
  out.device_traces.resize(static_cast<std::size_t>(devices));
  if (include_traces) {
    static c10::ApproximateClockToUnixTimeConverter* clock =
        new c10::ApproximateClockToUnixTimeConverter();
    auto to_ns = clock->makeConverter();
    std::lock_guard<std::mutex> lock(trace_mutex_);
    for (int d = 0; d < devices && d < kMaxDevices; ++d) {
      for (const CCA::TraceEntry& te : traces_[d]) {
        out.device_traces[d].push_back(te);
        auto& copy = out.device_traces[d].back();
        copy.time_.t_ = to_ns(te.time_.approx_t_) / 1000;  // what torch's snapshot reader expects
      }
    }
  }
  return out;
}

#if GPUMEM_TORCH_VERSION >= 210
CCA::SnapshotInfo GpumemAllocator::snapshot(c10::MempoolId_t mempool_id, bool include_traces) {
  return snapshot_impl(mempool_id, include_traces);
}
#elif GPUMEM_TORCH_VERSION >= 207
CCA::SnapshotInfo GpumemAllocator::snapshot(c10::MempoolId_t mempool_id) {
  return snapshot_impl(mempool_id, true);
}
#else
CCA::SnapshotInfo GpumemAllocator::snapshot() { return snapshot_impl(kDefaultPool, true); }
#endif

bool GpumemAllocator::isHistoryEnabled() {
  std::lock_guard<std::mutex> lock(trace_mutex_);
  return record_history_;
}

#if GPUMEM_TORCH_VERSION >= 209
void GpumemAllocator::recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                                    std::size_t alloc_trace_max_entries, CCA::RecordContext when,
                                    bool clearHistory, const std::vector<std::string>& skip_actions)
#elif GPUMEM_TORCH_VERSION >= 206
void GpumemAllocator::recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                                    std::size_t alloc_trace_max_entries, CCA::RecordContext when,
                                    bool clearHistory)
#else
void GpumemAllocator::recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                                    std::size_t alloc_trace_max_entries, CCA::RecordContext when)
#endif
{
#if GPUMEM_TORCH_VERSION < 206
  const bool clearHistory = false;
#endif
  TORCH_CHECK(when == CCA::RecordContext::NEVER || context_recorder,
              "gpumem: recordHistory needs a context recorder unless context is NEVER");
  std::lock_guard<std::mutex> lock(trace_mutex_);
  record_history_ = enabled;
  context_recorder_ = enabled ? context_recorder : nullptr;
  record_context_ = enabled ? when : CCA::RecordContext::NEVER;
  max_entries_ = std::max<std::size_t>(alloc_trace_max_entries, 1);
  skip_actions_.clear();
#if GPUMEM_TORCH_VERSION >= 209
  for (const std::string& a : skip_actions) skip_actions_.insert(static_cast<int>(parse_action(a)));
#endif
  if (!enabled || clearHistory) {
    for (auto& q : traces_) q.clear();
    alloc_context_.clear();
  }
  tracing_.store(record_history_ || !trackers_.empty(), std::memory_order_relaxed);
}

void GpumemAllocator::attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) {
  std::lock_guard<std::mutex> lock(trace_mutex_);
  trackers_.push_back(std::move(tracker));
  tracing_.store(true, std::memory_order_relaxed);
}

void GpumemAllocator::start_tracker_audit() {
  // As NCCL does when a communicator starts: the segments that already exist come from a snapshot
  // (taken before trace_mutex_: it takes the pools' locks, which come first in the lock order).
  CCA::SnapshotInfo existing = snapshot_impl(kDefaultPool, false);
  std::lock_guard<std::mutex> lock(trace_mutex_);
  if (auditing_) return;
  auditing_ = true;
  for (const CCA::SegmentInfo& seg : existing.segments)
    audit_live_[{static_cast<int>(seg.device), static_cast<std::uintptr_t>(seg.address)}] = seg.total_size;
  // Runs under trace_mutex_ (record_trace), which guards the audit's state too.
  trackers_.push_back([this](const CCA::TraceEntry& te) {
    const auto key = std::make_pair(static_cast<int>(te.device_), static_cast<std::uintptr_t>(te.addr_));
    if (te.action_ == Action::SEGMENT_ALLOC) {
      audit_counts_.allocs++;
      auto next = audit_live_.lower_bound(key);
      bool overlap = next != audit_live_.end() && next->first.first == key.first &&
                     next->first.second < key.second + te.size_;
      if (next != audit_live_.begin()) {
        auto prev = std::prev(next);
        overlap = overlap || (prev->first.first == key.first && prev->first.second + prev->second > key.second);
      }
      audit_counts_.mismatches += overlap;
      audit_live_[key] = te.size_;
    } else if (te.action_ == Action::SEGMENT_FREE) {
      audit_counts_.frees++;
      auto it = audit_live_.find(key);
      audit_counts_.mismatches += it == audit_live_.end() || it->second != te.size_;
      if (it != audit_live_.end()) audit_live_.erase(it);
    }
  });
  tracing_.store(true, std::memory_order_relaxed);
}

GpumemAllocator::TrackerAudit GpumemAllocator::tracker_audit() {
  std::lock_guard<std::mutex> lock(trace_mutex_);
  TrackerAudit out = audit_counts_;
  for (const auto& [key, bytes] : audit_live_) out.segments.emplace_back(key.first, key.second, bytes);
  out.tracker_errors = tracker_errors_;
  out.first_tracker_error = first_tracker_error_;
  return out;
}

std::shared_ptr<c10::GatheredContext> GpumemAllocator::gather_context(CCA::RecordContext level) {
  CCA::CreateContextFn recorder = nullptr;
  {
    std::lock_guard<std::mutex> lock(trace_mutex_);
    if (record_context_ >= level) recorder = context_recorder_;
  }
  return recorder ? recorder() : nullptr;  // gathered outside our locks: it may take the GIL
}

void GpumemAllocator::setUserMetadata(const std::string& metadata) {
  std::lock_guard<std::mutex> lock(trace_mutex_);
  user_metadata_ = metadata;
}

std::string GpumemAllocator::getUserMetadata() {
  std::lock_guard<std::mutex> lock(trace_mutex_);
  return user_metadata_;
}

void GpumemAllocator::record_trace(Action action, int device, std::uintptr_t addr, std::size_t size,
                                   cudaStream_t stream, MempoolId pool,
                                   std::shared_ptr<c10::GatheredContext> context, TraceTo to) {
  std::lock_guard<std::mutex> lock(trace_mutex_);
  if (device < 0 || device >= kMaxDevices) return;
  if (to == TraceTo::kTrackers && trackers_.empty()) return;
  // As PyTorch's allocator: no entry carries a stack unless history records context "alloc" or
  // "all" (with "state", stacks belong to the snapshot's live blocks only).
  if (record_context_ < CCA::RecordContext::ALLOC) context = nullptr;
#if GPUMEM_TORCH_VERSION >= 209
  CCA::TraceEntry te(action, static_cast<c10::DeviceIndex>(device), addr, size,
                     reinterpret_cast<void*>(stream), pool, c10::getApproximateTime(),
                     std::move(context));
#else
  (void)pool;
  CCA::TraceEntry te(action, static_cast<c10::DeviceIndex>(device), addr, size,
                     reinterpret_cast<void*>(stream), c10::getApproximateTime(), std::move(context));
#endif
#if GPUMEM_TORCH_VERSION >= 209
  te.user_metadata_ = user_metadata_;
#endif
  if (to != TraceTo::kHistory) {
    for (auto& tracker : trackers_) {
      // A tracker that throws (NCCL's, on a registration the driver refused) must not keep the
      // others or the history from the entry; the pool has already changed and cannot undo it.
      try {
        tracker(te);
      } catch (const std::exception& e) {
        if (tracker_errors_++ == 0) first_tracker_error_ = e.what();
      } catch (...) {
        if (tracker_errors_++ == 0) first_tracker_error_ = "an exception of unknown type";
      }
    }
  }
  if (to == TraceTo::kTrackers) return;
  if (!record_history_ || skip_actions_.count(static_cast<int>(action))) return;
  auto& q = traces_[device];
  q.push_back(std::move(te));
  while (q.size() > max_entries_) q.pop_front();
}

// `context` was gathered at RecordContext::STATE before the allocation (null below that level).
void GpumemAllocator::trace_alloc(int device, std::uintptr_t p, std::size_t size,
                                  cudaStream_t stream, MempoolId pool,
                                  std::shared_ptr<c10::GatheredContext> context) {
  {
    std::lock_guard<std::mutex> lock(trace_mutex_);
    if (context && record_history_) alloc_context_[p] = context;
  }
  record_trace(Action::ALLOC, device, p, size, stream, pool, std::move(context));
}

// `context` was gathered at RecordContext::ALL before the free (null below that level).
void GpumemAllocator::trace_free(int device, std::uintptr_t p, std::size_t size, MempoolId pool,
                                 std::shared_ptr<c10::GatheredContext> context) {
  {
    std::lock_guard<std::mutex> lock(trace_mutex_);
    alloc_context_.erase(p);
  }
  record_trace(Action::FREE_REQUESTED, device, p, size, nullptr, pool, context);
  record_trace(Action::FREE_COMPLETED, device, p, size, nullptr, pool, std::move(context));
}

// Called by a pool with its lock held: only trace_mutex_ is taken from here (see the lock order).
void GpumemAllocator::on_segment_event(int device, MempoolId pool, SegmentEvent event,
                                       std::uintptr_t address, std::size_t bytes, StreamId stream) {
  Action action = Action::SEGMENT_MAP;
  TraceTo to = TraceTo::kHistory;
  switch (event) {
    case SegmentEvent::kMap: action = Action::SEGMENT_MAP; break;
    case SegmentEvent::kUnmap: action = Action::SEGMENT_UNMAP; break;
    case SegmentEvent::kSegmentAlloc: action = Action::SEGMENT_ALLOC; break;
    case SegmentEvent::kSegmentFree: action = Action::SEGMENT_FREE; break;
    // NCCL registers whole segments by address and deregisters them by that address: trackers see
    // the spans (core/pool.hpp, SegmentEvent), each freed exactly as it was allocated.
    case SegmentEvent::kSpanAdded: action = Action::SEGMENT_ALLOC; to = TraceTo::kTrackers; break;
    case SegmentEvent::kSpanRemoved: action = Action::SEGMENT_FREE; to = TraceTo::kTrackers; break;
  }
  record_trace(action, device, address, bytes, reinterpret_cast<cudaStream_t>(stream), pool,
               to == TraceTo::kTrackers ? nullptr : CallContext::current(), to);
}

// torch.profiler(profile_memory=True) learns of allocations from the allocator, as with PyTorch's:
// the block, its size (negative for a free), and the device's allocated and reserved bytes after it.
void GpumemAllocator::report_to_profiler(int device, std::uintptr_t p, std::int64_t delta) {
  std::size_t allocated = 0, reserved = 0;
  if (Pool* pool = main_pool_if_created(device)) {
    allocated = pool->allocated_bytes();
    reserved = pool->reserved_bytes();
  }
  for (auto& pp : private_pools_of(device)) {
    if (!pp->pool) continue;
    allocated += pp->pool->allocated_bytes();
    reserved += pp->pool->reserved_bytes();
  }
  c10::reportMemoryUsageToProfiler(reinterpret_cast<void*>(p), delta, allocated, reserved,
                                   c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
}

}  // namespace gpumem::torch_bridge
