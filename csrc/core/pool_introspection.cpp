// What the pool shows of itself, without changing its blocks: statistics (inactive split blocks are
// derived here), the snapshot of regions and blocks, the largest free block, queries about live
// blocks, pages exported for CUDA IPC, and the text of an out-of-memory error (pool.hpp lists every
// file).
#include <algorithm>
#include <cinttypes>
#include <cstdio>

#include "format.hpp"
#include "pool.hpp"
#include "pool_debug.hpp"

namespace gpumem {

Pool::ExportedBlock Pool::export_block(std::uintptr_t address) {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* block = find_live(address, "export");
  Region* r = block->region;
  if (!r->paged)
    throw UpstreamError("gpumem: only memory of a paged upstream (CUDA virtual memory) can be exported");
  const PageMap& pages = r->pages;
  // The units under the block (page_map.hpp): one file descriptor per physical allocation, all of one
  // size for the importer (cuda_import_pages maps them at one page size).
  const PageRun touched = pages.touched(block->address, block->size);
  const PageRun units = pages.coarse(touched.first) ? pages.widened(touched) : touched;
  if (pages.next_uniform_run(units.first, units.end).end != units.end)
    throw UpstreamError("gpumem: cannot export this block: it lies on physical pages of two sizes (some "
                        "mapped near the cap one device page at a time); set the pool's page size to the "
                        "device's granularity (page_size:2MiB) to share such blocks");
  ExportedBlock out{pages.address_of(units.first), pages.unit_bytes(units.first), {}};
  out.fds = upstream_->export_pages(out.first_page, pages.bytes_of(units) / out.page, out.page);
  return out;
}

void Pool::count_oom() {
  std::lock_guard<std::mutex> lock(mutex_);
  GPUMEM_VALIDATE_ON_RETURN();
  stats_.num_ooms++;
}

std::size_t Pool::allocated_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<std::size_t>(stats_.allocated_bytes[kAggregate].current);
}

std::size_t Pool::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<std::size_t>(stats_.reserved_bytes[kAggregate].current);
}

DeviceStats Pool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  // Inactive split blocks are derived, not tracked per operation: free blocks that share a region
  // with other blocks, counted by the memory that backs them.
  std::int64_t count[kNumStatTypes] = {0, 0, 0}, bytes[kNumStatTypes] = {0, 0, 0};
  for (auto& arena : arenas_) {
    StatType type = arena->small ? kSmallPool : kLargePool;
    arena->free_blocks.for_each([&](const Block* b) {
      if (b->size == b->region->size) return;  // a whole region: releasable, not split
      const std::size_t backed = backed_bytes(b);
      if (backed == 0) return;
      count[type]++;
      bytes[type] += static_cast<std::int64_t>(backed);
    });
  }
  count[kAggregate] = count[kSmallPool] + count[kLargePool];
  bytes[kAggregate] = bytes[kSmallPool] + bytes[kLargePool];
  for (int t = 0; t < kNumStatTypes; ++t) {
    Stat& c = stats_.inactive_split[t];
    Stat& b = stats_.inactive_split_bytes[t];
    c.current = count[t];
    c.peak = std::max(c.peak, c.current);
    b.current = bytes[t];
    b.peak = std::max(b.peak, b.current);
  }
  return stats_;
}

void Pool::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  GPUMEM_VALIDATE_ON_RETURN();
  stats_.reset_peak();
}

void Pool::reset_accumulated_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  GPUMEM_VALIDATE_ON_RETURN();
  stats_.reset_accumulated();
}

std::size_t Pool::largest_free_block() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return largest_free_block_locked();
}

std::size_t Pool::largest_free_block_locked() const {
  std::size_t best = 0;
  for (auto& arena : arenas_)
    arena->free_blocks.for_each([&](const Block* b) {
      if (b->size > best) best = std::max(best, longest_backed_run(b));
    });
  return best;
}

std::size_t Pool::backed_bytes(const Block* b) {
  const Region* r = b->region;
  return r->paged ? r->pages.mapped_bytes_in(b->address, b->size) : b->size;
}

std::size_t Pool::longest_backed_run(const Block* b) {
  const Region* r = b->region;
  return r->paged ? r->pages.longest_mapped_run_in(b->address, b->size) : b->size;
}

std::size_t Pool::allocation_size(std::uintptr_t address) const {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* const* found = live_.find(address);
  return !found || (*found)->state != BlockInfo::kAllocated ? 0 : (*found)->size;
}

bool Pool::live_block(std::uintptr_t address, BlockInfo* out) const {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* const* found = live_.find(address);
  if (!found || (*found)->state != BlockInfo::kAllocated) return false;
  const Block* b = *found;
  if (out) *out = BlockInfo{b->address, b->size, b->requested, b->state, b->last_requested};
  return true;
}

// Segments as PyTorch reports them: a region of segments is one segment; a paged region is one
// segment per run of mapped pages (as PyTorch does for expandable segments), its blocks clipped to
// the run, so the segments add up to the reserved bytes and unmapped address space is not drawn;
// except while draining pages are lent (pool_drain.cpp): until their mark completes their memory is
// mapped at two addresses and shows in both segments, once as the draining (inactive) block.
std::vector<RegionInfo> Pool::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<RegionInfo> out;
  for (auto& arena : arenas_) {
    for (auto& region : arena->regions) {
      if (region->reserved == 0) continue;
      auto info_of = [&](const Block* b) {
        return BlockInfo{b->address, b->size, b->requested, b->state, b->last_requested};
      };
      if (!region->paged) {
        RegionInfo info{region->base, region->size, region->reserved, arena->stream, arena->small, {}};
        for (Block* b = region->first; b; b = b->next) info.blocks.push_back(info_of(b));
        out.push_back(std::move(info));
        continue;
      }
      const Block* b = region->first;
      const PageMap& pages = region->pages;
      for (PageRun run = pages.next_mapped_run(0, pages.mapped_limit()); !run.empty();
           run = pages.next_mapped_run(run.end, pages.mapped_limit())) {
        const std::uintptr_t lo = pages.address_of(run.first);
        const std::uintptr_t hi = pages.address_of(run.end);
        RegionInfo info{lo, hi - lo, hi - lo, arena->stream, arena->small, {}};
        while (b && b->address + b->size <= lo) b = b->next;
        for (const Block* c = b; c && c->address < hi; c = c->next) {
          BlockInfo block = info_of(c);
          const std::uintptr_t from = std::max<std::uintptr_t>(c->address, lo);
          const std::uintptr_t to = std::min<std::uintptr_t>(c->address + c->size, hi);
          block.address = from;
          block.size = to - from;
          if (from != c->address) block.last_requested = 0;  // the tail of a free block
          info.blocks.push_back(block);
        }
        out.push_back(std::move(info));
      }
    }
  }
  return out;
}

std::string Pool::oom_message(std::size_t requested, StreamId stream, std::uintptr_t at) const {
  // Plain string building: iostreams crashed when a second libstdc++ was loaded in the process.
  char stream_hex[32], at_hex[48] = "";
  std::snprintf(stream_hex, sizeof stream_hex, "0x%" PRIxPTR, stream);
  if (at) std::snprintf(at_hex, sizeof at_hex, " at 0x%" PRIxPTR, at);
  const std::string cap = options_.cap_bytes
                              ? format_bytes(options_.cap_bytes)
                              : "none (device total " + format_bytes(upstream_->device_total_bytes()) + ")";
  // The message must not turn an out-of-memory into another error: a device that cannot say what is
  // free (a driver error) is reported as such.
  std::size_t free_bytes = 0;
  std::string device_free = "unknown (the driver did not say)";
  if (device_free_bytes(&free_bytes)) {
    device_free = format_bytes(free_bytes);
    // What neither this device's pools (the budget counts them all) nor the free bytes account for:
    // on a shared GPU the usual reason the device ran out before the cap or the limit did.
    const std::size_t total = upstream_->device_total_bytes(), inside = budget_->reserved();
    if (total > free_bytes && total - free_bytes > inside)
      device_free += " (" + format_bytes(total - free_bytes - inside) +
                     " of the device held outside gpumem: the CUDA context, other processes, other "
                     "libraries' own allocations)";
  }
  const std::size_t limit_bytes = budget_->limit();
  const std::string limit = limit_bytes == kNoLimit
                                ? ""
                                : ", limit " + format_bytes(limit_bytes) + (own_budget_ ? "" : " (all pools of the device: " + format_bytes(budget_->reserved()) + " reserved)");
  return "gpumem: out of memory on device " + std::to_string(options_.device) + ": tried to allocate " +
         format_bytes(requested) + at_hex + " (stream " + stream_hex + "); " +
         format_bytes(stats_.allocated_bytes[kAggregate].current) + " held by live tensors, " +
         format_bytes(reserved_locked()) + " reserved by gpumem, cap " + cap +
         limit + ", device free " + device_free + ", largest free block " +
         format_bytes(largest_free_block_locked()) +
         ". Free tensors you no longer need, use a smaller batch (gpumem.find_batch_size), or raise "
         "the cap (GPUMEM_CONF=cap:...).";
}

}  // namespace gpumem
