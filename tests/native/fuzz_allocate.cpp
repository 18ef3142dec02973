// The fuzz harness's allocations (fuzz_harness.hpp): allocate() and allocate_at() checked against the
// model, an out-of-memory error justified from the snapshot and the device, and the paged region's
// blocks rebuilt from the snapshot for that justification.
#include "fuzz_harness.hpp"

namespace gpumem_fuzz {

void Harness::do_allocate(std::size_t bytes, StreamId s) {
  describe("allocate(%zu, stream %" PRIuPTR ")", bytes, s);
  if (live_.size() >= 256) return;
  const DeviceStats before = pool_->stats();
  const std::uint64_t faults_before = sim_->faults_injected();
  const std::size_t rounded = bytes <= kMaxRequest ? round_up(bytes, kAlignment) : 0;
  std::uintptr_t a = 0;
  try {
    a = pool_->allocate(bytes, s);
  } catch (const OutOfMemoryError& e) {
    if (verbose()) std::fprintf(stderr, "  -> OOM: %s\n", e.what());
    REQUIRE(bytes > 0 && bytes <= kMaxRequest, "OOM for a size that should not reach the allocator");
    check_oom(e, bytes, rounded, s, before, sim_->faults_injected() != faults_before);
    return;
  } catch (const InvalidArgument& e) {
    REQUIRE(bytes > kMaxRequest, "InvalidArgument for a valid size: " << e.what());
    REQUIRE(pool_->stats().allocation[kAggregate].current == before.allocation[kAggregate].current,
            "rejected allocation changed the pool");
    return;
  } catch (const UpstreamError& e) {
    REQUIRE(fail_unmap_, "UpstreamError without an injected unmap failure: " << e.what());
    if (verbose()) std::fprintf(stderr, "  -> UpstreamError: %s\n", e.what());
    ++upstream_errors_;
    return;
  }
  REQUIRE(bytes <= kMaxRequest, "allocation above the limit succeeded");
  if (bytes == 0) {
    REQUIRE(a == 0, "zero-byte allocation returned a pointer");
    pool_->free(0);  // a no-op
    return;
  }
  REQUIRE(a != 0, "allocate returned null");
  REQUIRE(a % kAlignment == 0, "address not 512-aligned");
  REQUIRE(!live_.count(a), "address handed out twice");
  auto it = live_.lower_bound(a + rounded);
  if (it != live_.begin()) {
    --it;
    REQUIRE(!overlaps(a, rounded, it->first, it->second),
            "new block overlaps a live allocation at 0x" << std::hex << it->first);
  }
  for (auto p = pending_.begin(); p != pending_.end();) {
    if (!overlaps(a, rounded, p->address, p->size)) {
      ++p;
      continue;
    }
    for (auto& t : p->tickets)
      REQUIRE(dev_->done(t), "block reused while another stream's event on it is not done");
    p = pending_.erase(p);  // recycled by the pool, legitimately
  }
  REQUIRE(dev_->backed(a, rounded), "allocation not backed by device memory");
  REQUIRE(pool_->allocation_size(a) == rounded, "allocation_size disagrees");
  const std::size_t reserved = pool_->stats().reserved_bytes[kAggregate].current;
  if (reserved > std::size_t(before.reserved_bytes[kAggregate].current))
    REQUIRE(reserved <= limit(), "reserved " << reserved << " grew past the cap/device " << limit());
  live_[a] = rounded;
  live_info_[a] = Live{bytes, rounded, s, {}};
  ++allocations_;
}

void Harness::check_oom(const OutOfMemoryError& e, std::size_t bytes, std::size_t rounded, StreamId s,
                        const DeviceStats& before, bool faulted) {
  ++ooms_;
  DeviceStats st = pool_->stats();
  const std::size_t reserved = st.reserved_bytes[kAggregate].current;
  REQUIRE(e.requested == bytes, "OOM requested " << e.requested << " != " << bytes);
  REQUIRE(e.allocated == std::size_t(st.allocated_bytes[kAggregate].current), "OOM allocated figure wrong");
  REQUIRE(e.reserved == reserved, "OOM reserved figure " << e.reserved << " != stats " << reserved);
  REQUIRE(e.cap == cap_, "OOM cap figure " << e.cap << " != " << cap_);
  REQUIRE(e.largest_free == pool_->largest_free_block(), "OOM largest free block figure wrong");
  REQUIRE(st.num_ooms == before.num_ooms + 1, "num_ooms not counted");
  const std::string msg = e.what();
  REQUIRE(msg.find("out of memory") != std::string::npos, "OOM message: " << msg);
  REQUIRE(msg.find(format_bytes(bytes)) != std::string::npos, "OOM message lacks the request: " << msg);
  REQUIRE(msg.find(format_bytes(reserved)) != std::string::npos, "OOM message lacks reserved: " << msg);
  if (cap_) REQUIRE(msg.find(format_bytes(cap_)) != std::string::npos, "OOM message lacks the cap: " << msg);
  if (faulted || rounded > effective_cap()) return;
  // No fault: the OOM must be justified by the state the pool was left in.
  const bool small = rounded <= kSmallLimit;
  const std::vector<RegionInfo> snap = pool_->snapshot();
  std::uintptr_t best = 0;
  std::size_t best_size = SIZE_MAX;
  auto consider = [&](const BlockInfo& b) {
    if (b.state == BlockInfo::kFree && b.size >= rounded &&
        (b.size < best_size || (b.size == best_size && b.address < best)))
      best = b.address, best_size = b.size;
  };
  if (kind_ == UpstreamKind::kPages) {
    const std::vector<BlockInfo> blocks = paged_blocks(snap, s, small);
    if (blocks.empty()) {
      // No mapped page in the arena: everything is free, so only the cap or the device can say no.
      REQUIRE(reserved + round_up(rounded, page_) > limit(),
              "spurious OOM: empty arena, reserved " << reserved << " + " << rounded << " fits under "
                                                     << limit());
      return;
    }
    for (const BlockInfo& b : blocks) consider(b);
    if (best_size == SIZE_MAX) return;  // the arena's address range has no gap that large
    std::size_t need = dev_->pages_needing_memory(best, rounded) * page_;
    REQUIRE(reserved + need > limit(), "spurious OOM: best fit at 0x" << std::hex << best << std::dec
                                        << " needs " << need << " more bytes, reserved " << reserved
                                        << ", limit " << limit());
  } else {
    for (const RegionInfo& r : snap)
      if (r.stream == s && r.small == small)
        for (const BlockInfo& b : r.blocks) consider(b);
    REQUIRE(best_size == SIZE_MAX, "spurious OOM: a free block of " << best_size << " bytes fits " << rounded);
    std::size_t seg = small ? kSmallSegment : rounded < kMidLimit ? kMidSegment : rounded;
    seg = round_up(seg, page_);
    REQUIRE(reserved + seg > limit(), "spurious OOM: a new segment of " << seg << " bytes fits, reserved "
                                       << reserved << ", limit " << limit());
  }
}

// The blocks of arena (stream, small)'s paged region as the pool has them, rebuilt from the
// snapshot, which reports runs of mapped pages with their blocks clipped to them: the unmapped
// space between runs lies in free blocks, merged with the free pieces beside it. Empty when the
// arena has no mapped page.
std::vector<BlockInfo> Harness::paged_blocks(const std::vector<RegionInfo>& snap, StreamId s, bool small) const {
  std::vector<const RegionInfo*> runs;
  for (const RegionInfo& r : snap)
    if (r.stream == s && r.small == small) runs.push_back(&r);
  if (runs.empty()) return {};
  std::sort(runs.begin(), runs.end(), [](const RegionInfo* a, const RegionInfo* b) { return a->address < b->address; });
  const auto [base, bytes] = dev_->region_of(runs.front()->address);
  REQUIRE(bytes != 0, "a snapshot run outside every address range the pool reserved");
  std::vector<BlockInfo> out;
  auto add = [&](const BlockInfo& b) {
    BlockInfo* last = out.empty() ? nullptr : &out.back();
    REQUIRE(!last || last->address + last->size == b.address, "snapshot blocks leave a gap or overlap");
    if (last && last->state == BlockInfo::kFree && b.state == BlockInfo::kFree) last->size += b.size;
    else out.push_back(b);
  };
  std::uintptr_t cursor = base;
  for (const RegionInfo* r : runs) {
    REQUIRE(dev_->region_of(r->address).first == base, "one arena's runs lie in two address ranges");
    if (r->address > cursor) add(BlockInfo{cursor, r->address - cursor, 0, BlockInfo::kFree, 0});
    for (const BlockInfo& b : r->blocks) add(b);
    cursor = r->address + r->size;
  }
  if (base + bytes > cursor) add(BlockInfo{cursor, base + bytes - cursor, 0, BlockInfo::kFree, 0});
  return out;
}

// allocate_at at a recently freed address (its size or another), inside a free block of the
// snapshot, at a random address in a region, or at a foreign one; the model says whether the range
// is free.
void Harness::do_allocate_at() {
  std::uint8_t k = in_.u8();
  std::uintptr_t address = 0;
  std::size_t bytes = 0;
  int mode = k % 4;  // 0, 1: a recently freed block; 2: inside a free block; 3: anywhere
  if (mode < 2 && freed_sizes_.empty()) mode = 2;
  std::vector<BlockInfo> free_blocks;
  if (mode == 2)
    for (const RegionInfo& r : pool_->snapshot())
      for (const BlockInfo& b : r.blocks)
        if (b.state == BlockInfo::kFree) free_blocks.push_back(b);
  if (mode == 2 && free_blocks.empty()) mode = 3;
  if (mode < 2) {
    std::tie(address, bytes) = freed_sizes_[in_.u8() % freed_sizes_.size()];
    if ((k & 12) == 12) bytes = 1 + std::size_t(in_.u16()) * 64;  // the same start, another size
  } else if (mode == 2) {
    const BlockInfo& b = free_blocks[in_.u16() % free_blocks.size()];
    address = b.address + std::size_t(in_.u16()) % (b.size / kAlignment) * kAlignment;
    bytes = 1 + std::size_t(in_.u32()) % (b.address + b.size - address);
  } else if ((k & 24) != 24 && !dev_->regions().empty()) {
    auto it = dev_->regions().begin();
    std::advance(it, in_.u8() % dev_->regions().size());
    // In a paged region, near the pages in use: mapped and unmapped ones.
    const std::size_t span = std::min(it->second, capacity_ + 8 * page_);
    address = it->first + std::size_t(in_.u32()) % (span / kAlignment) * kAlignment;
    bytes = pick_size();
  } else {
    address = k & 32 ? 0 : 0x7f0000000000 + std::uintptr_t(in_.u32()) * 512;  // foreign
    bytes = pick_size();
  }
  if ((k & 0xe0) == 0xe0) address += 1 + in_.u8() % 511;  // misaligned
  describe("allocate_at(0x%" PRIxPTR ", %zu)", address, bytes);
  if (live_.size() >= 256) return;

  // The model's verdict.
  const bool size_ok = bytes > 0 && bytes <= kMaxRequest;
  const std::size_t rounded = size_ok ? round_up(bytes, kAlignment) : 0;
  const auto [base, region_bytes] = dev_->region_of(address);
  bool free = size_ok && address % kAlignment == 0 && region_bytes && rounded <= base + region_bytes - address;
  if (free) {
    auto it = live_.lower_bound(address + rounded);  // the last live block starting before the end
    if (it != live_.begin() && overlaps(address, rounded, std::prev(it)->first, std::prev(it)->second))
      free = false;
  }
  bool recyclable = false;  // a pending block whose events are done: the pool recycles it first
  // Free of pending blocks whose events are not done; with a lagging device, waits inside the call can
  // complete more (asked again after a success, the device's clock having moved).
  auto clear_of_pending = [&] {
    bool clear = true;
    for (auto& p : pending_) {
      bool done = true;
      for (auto& t : p.tickets) done &= dev_->done(t);
      recyclable |= done;
      if (!done && overlaps(address, rounded, p.address, p.size)) clear = false;
    }
    return clear;
  };
  const bool in_free_range = free, clear = clear_of_pending();  // asked for every block: `recyclable`
  free = free && clear;

  // Released pages still draining under the range go back first (the pool waits for them), lent ones
  // too (draining_bytes() leaves those out: their memory backs another block, so unmapping them at
  // their mark changes no statistic, only the snapshot and num_device_free).
  for (const RegionInfo& r : pool_->snapshot())
    for (const BlockInfo& b : r.blocks) recyclable |= b.state == BlockInfo::kDraining;
  const DeviceStats before = pool_->stats();
  const std::string all_before = fingerprint(*pool_), full_before = fingerprint(*pool_, false);
  const std::string live_before = live_fingerprint(*pool_);
  const std::uint64_t faults_before = sim_->faults_injected();
  std::uintptr_t a = 0;
  try {
    a = pool_->allocate_at(address, bytes);
  } catch (const InvalidArgument& e) {
    if (verbose()) std::fprintf(stderr, "  -> InvalidArgument: %s\n", e.what());
    // Pages lent to another block (mapped twice) whose unmap the driver refused stay draining.
    const bool stuck = fail_unmap_ && std::string(e.what()).find("refused to unmap") != std::string::npos;
    REQUIRE(!free || stuck, "allocate_at refused a range the model says is free: " << e.what());
    REQUIRE(std::string(e.what()).find("nothing was changed") != std::string::npos, "message: " << e.what());
    REQUIRE(live_fingerprint(*pool_) == live_before, "a refused allocate_at changed a live block");
    if (!recyclable)
      REQUIRE(fingerprint(*pool_) == all_before, "a refused allocate_at changed the pool");
    return;
  } catch (const OutOfMemoryError& e) {
    if (verbose()) std::fprintf(stderr, "  -> OOM: %s\n", e.what());
    REQUIRE(free, "allocate_at threw OOM for a range that is not free: " << e.what());
    REQUIRE(kind_ == UpstreamKind::kPages, "OOM on a segment, where nothing needs mapping");
    ++ooms_;
    DeviceStats st = pool_->stats();
    const std::size_t reserved = st.reserved_bytes[kAggregate].current;
    REQUIRE(e.requested == bytes && e.reserved == reserved && e.cap == cap_ &&
                e.allocated == std::size_t(st.allocated_bytes[kAggregate].current),
            "allocate_at OOM figures wrong");
    REQUIRE(st.num_ooms == before.num_ooms + 1, "num_ooms not counted");
    REQUIRE(live_fingerprint(*pool_) == live_before, "a failed allocate_at changed a live block");
    if (!recyclable && st.num_device_alloc == before.num_device_alloc &&
        st.num_device_free == before.num_device_free)
      REQUIRE(fingerprint(*pool_, false) == full_before, "a failed allocate_at that released nothing changed the pool");
    if (sim_->faults_injected() == faults_before) {
      const std::size_t need = dev_->pages_needing_memory(address, rounded) * page_;
      REQUIRE(need > 0 && reserved + need > limit(),
              "spurious allocate_at OOM: needs " << need << " more bytes, reserved " << reserved << ", limit "
                                                 << limit());
    }
    return;
  } catch (const UpstreamError& e) {
    REQUIRE(fail_unmap_, "UpstreamError without an injected unmap failure: " << e.what());
    ++upstream_errors_;
    REQUIRE(live_fingerprint(*pool_) == live_before, "allocate_at failing in the driver changed a live block");
    return;
  }
  if (!free && in_free_range && dev_->lag()) {
    dev_->catch_up();
    free = clear_of_pending();
  }
  REQUIRE(free, "allocate_at succeeded on a range the model says is not free");
  REQUIRE(a == address, "allocate_at returned another address");
  for (auto p = pending_.begin(); p != pending_.end();) {
    if (overlaps(a, rounded, p->address, p->size)) p = pending_.erase(p);  // recycled, events done
    else ++p;
  }
  REQUIRE(dev_->backed(a, rounded), "allocate_at block not backed by device memory");
  REQUIRE(pool_->allocation_size(a) == rounded, "allocation_size disagrees");
  BlockInfo info{};
  REQUIRE(pool_->live_block(a, &info) && info.size == rounded && info.requested == bytes,
          "live_block disagrees");
  const std::size_t reserved = pool_->stats().reserved_bytes[kAggregate].current;
  if (reserved > std::size_t(before.reserved_bytes[kAggregate].current))
    REQUIRE(reserved <= limit(), "reserved " << reserved << " grew past the cap/limit/device " << limit());
  StreamId stream = 0;
  for (const RegionInfo& r : pool_->snapshot())
    if (a >= r.address && a < r.address + r.size) stream = r.stream;
  live_[a] = rounded;
  live_info_[a] = Live{bytes, rounded, stream, {}};
  ++allocations_;
}

}  // namespace gpumem_fuzz
