// Pool::allocate_at and its helpers: a block carved at a given address out of the free block that
// holds it. The PyTorch bridge restores CUDA-graph checkpoints with it, re-allocating each block where
// it was. Mapping, releasing and accounting are allocate()'s (pool.cpp: commit_allocation); this file
// owns only finding the free block, the refusals, and the split into up to three pieces.
#include <cinttypes>
#include <cstdio>
#include <string>

#include "format.hpp"
#include "pool.hpp"
#include "pool_debug.hpp"

namespace gpumem {

namespace {

std::string hex(std::uintptr_t address) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, address);
  return buf;
}

std::string range_text(std::uintptr_t address, std::size_t bytes) {
  return "[" + hex(address) + ", " + hex(address + bytes) + ")";
}

}  // namespace

std::uintptr_t Pool::allocate_at(std::uintptr_t address, std::size_t bytes) {
  const std::string call = "gpumem: allocate_at(" + hex(address) + ", " + std::to_string(bytes) + " bytes): ";
  if (bytes == 0) throw InvalidArgument(call + "the size must be positive; nothing was changed");
  if (bytes > kMaxRequest)
    throw InvalidArgument(call + "that is more than any device has (limit " + format_bytes(kMaxRequest) +
                          "); nothing was changed");
  if (address % kAlignment != 0)
    throw InvalidArgument(call + "the address is not a multiple of " + std::to_string(kAlignment) +
                          ", so no block of this pool can start there; nothing was changed");
  const std::size_t rounded = round_up(bytes, kAlignment);
  std::lock_guard<std::mutex> lock(mutex_);
  GPUMEM_VALIDATE_ON_RETURN();
  if (!pending_.empty()) recycle_completed();  // finished pending frees count as free
  // Draining pages are free memory on their way back: a range over them waits for them (restoring a
  // CUDA-graph checkpoint is rare; the wait is only as long as the device's queued work). A range
  // clear of them changes nothing here.
  for (const Draining& d : draining_)
    if (address < d.block->address + d.block->size && d.block->address < address + rounded) {
      drain_all();
      break;
    }
  Block* free_block = free_block_holding(address, rounded, bytes);  // or throws, nothing changed
  Region* region = free_block->region;
  Block* block = carve(free_block, address, rounded);
  block->requested = bytes;
  block->last_requested = bytes;
  if (commit_allocation(block, /*release_and_retry=*/true)) return address;
  // The block is back in the free set, merged as it was; only reserved may differ (cache released
  // elsewhere, or pages mapped before the upstream said no, which stay cached as after allocate()).
  stats_.num_ooms++;
  throw OutOfMemoryError(oom_message(bytes, region->arena->stream, address), bytes,
                         stats_.allocated_bytes[kAggregate].current,
                         stats_.reserved_bytes[kAggregate].current, options_.cap_bytes,
                         largest_free_block_locked());
}

// The free block that holds all of [address, address + rounded), or InvalidArgument saying why there
// is none. A walk over the region's blocks: allocate_at restores checkpoints, it is not a hot path.
Pool::Block* Pool::free_block_holding(std::uintptr_t address, std::size_t rounded, std::size_t bytes) {
  const std::string what = "gpumem: allocate_at(" + hex(address) + ", " + std::to_string(bytes) +
                           " bytes): the range " + range_text(address, rounded) + " ";
  const std::string unchanged = "; nothing was changed";
  Region* region = nullptr;
  for (auto& arena : arenas_) {
    for (auto& r : arena->regions)
      if (address >= r->base && address - r->base < r->size) {
        region = r.get();
        break;
      }
    if (region) break;
  }
  if (!region)
    throw InvalidArgument(what + "lies outside every region of this pool (device " +
                          std::to_string(options_.device) +
                          "): a block can only be allocated where the pool holds address space" + unchanged);
  if (rounded > region->base + region->size - address)
    throw InvalidArgument(what + "runs past the end of the region " + range_text(region->base, region->size) +
                          " that holds its start" + unchanged);
  Block* b = region->first;
  while (b->address + b->size <= address) b = b->next;  // the range lies in the region: b exists
  Block* conflict = b->state != BlockInfo::kFree ? b
                    : address + rounded > b->address + b->size ? b->next  // free neighbours are merged
                                                               : nullptr;
  if (!conflict) return b;
  if (conflict->state == BlockInfo::kPending)
    throw InvalidArgument(what + "overlaps the block " + range_text(conflict->address, conflict->size) +
                          ", freed but pending until work queued on other streams (record_stream) "
                          "completes; synchronise those streams and call process_events() first" +
                          unchanged);
  if (conflict->state == BlockInfo::kDraining)  // drain_all() above waited: only a failed unmap is left
    throw InvalidArgument(what + "overlaps pages " + range_text(conflict->address, conflict->size) +
                          " on their way back to the device, which the driver refused to unmap (their "
                          "memory backs another block as well); try again once the driver works" + unchanged);
  throw InvalidArgument(what + "overlaps the live block " + range_text(conflict->address, conflict->size) +
                        " (" + std::to_string(conflict->requested) + " bytes requested)" + unchanged);
}

// Takes [address, address + rounded) out of `free_block` (which holds it): the pieces before and after
// stay free, in the free index. Returns the middle piece, marked allocated, not yet mapped or counted.
Pool::Block* Pool::carve(Block* free_block, std::uintptr_t address, std::size_t rounded) {
  auto& index = free_block->region->arena->free_blocks;
  index.erase(free_block);
  Block* block = free_block;
  if (address > free_block->address) {
    block = new_block();
    block->address = address;
    block->size = free_block->address + free_block->size - address;
    block->region = free_block->region;
    block->freed_seq = free_block->freed_seq;
    block->prev = free_block;
    block->next = free_block->next;
    if (free_block->next) free_block->next->prev = block;
    free_block->next = block;
    free_block->size = address - free_block->address;
    index.insert(free_block);  // the piece before: its neighbours are not free, nothing to merge
  }
  block->state = BlockInfo::kAllocated;  // before split, so the piece after does not merge back
  split(block, rounded);
  return block;
}

}  // namespace gpumem
