// The pooled allocator. How it works, in brief:
//  - Requests are rounded to 512 bytes. Those up to 1 MiB go to a "small" arena, the rest to a "large"
//    one; each stream has its own pair of arenas, so a block freed on stream S is reused at once on S
//    and never handed to another stream while S may still use it.
//  - An arena's free blocks sit in a free index (exact-size bins up to 1 MiB, sorted size class lists
//    above; the last freed first among equal sizes): allocation takes the best fit and splits it;
//    free coalesces with free neighbours of the same region.
//  - On a paged upstream (CUDA VMM) an arena has one region: a virtual range four times the device,
//    whose pages (the upstream's 2 MiB granularity in small arenas, 8 MiB by default in large ones;
//    one physical allocation each) are mapped when a block first needs them. Free pages anywhere in
//    it can be unmapped, so free memory in the middle of a region goes back to the device
//    ("reserved" = mapped pages).
//  - On a segments upstream (cudaMalloc) an arena has many regions (segments), released only whole.
//  - Release policy "lazy" (default): free pages stay cached (mapped) for reuse until trim(), or until
//    the cap or the device runs short: then fully free pages anywhere, even between live blocks, are
//    unmapped and mapped again where the request needs them, so fragmentation never causes an OOM.
//    Policy "high_water" also does this before reserving past the highest live bytes so far (plus a
//    slack), keeping reserved within a page or two of live; each such release synchronises the
//    stream, which costs step time on a GPU (README, benchmarks).
//  - A cap bounds reserved bytes. When the upstream or the cap says no: release the whole cache and
//    retry; run the out-of-memory callbacks (gc.collect() from Python) and retry; then throw
//    OutOfMemoryError with the figures a user needs.
//  - record_stream(ptr, S2) makes free() record an event on S2; the block is reused only after it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "address_map.hpp"
#include "errors.hpp"
#include "free_index.hpp"
#include "stats.hpp"
#include "types.hpp"
#include "upstream.hpp"

namespace gpumem {

enum class ReleasePolicy {
  kLazy,       // keep free pages cached until trim() or until the cap / the device runs short
  kHighWater,  // also release cached pages before reserving past the live high water (+ slack)
};

struct PoolOptions {
  std::size_t cap_bytes = 0;  // upper bound on reserved bytes; 0 = the device's memory is the bound
  ReleasePolicy release = ReleasePolicy::kLazy;
  // High-water policy only: reserved may exceed the highest live bytes so far by this fraction
  // before cached pages are released. A little slack absorbs step-to-step wobble in where blocks land, which
  // on a GPU saves a stream synchronisation and an unmap/map round per wobble.
  double release_slack = 0.005;
  // Paged upstreams: bytes per page of the large arenas (a multiple of the upstream's granularity;
  // 0 = the granularity). Small arenas always use the granularity.
  std::size_t large_page_bytes = kDefaultPageSize;
  int device = 0;             // only used in messages and to reject frees meant for another device
};

// One block as seen from outside, for snapshots and debugging.
struct BlockInfo {
  std::uintptr_t address;
  std::size_t size;
  std::size_t requested;  // 0 unless allocated
  enum State { kFree, kAllocated, kPending } state;
};

// One region as seen from outside (torch's "segment" in memory snapshots).
struct RegionInfo {
  std::uintptr_t address;
  std::size_t size;            // address range
  std::size_t reserved;        // bytes backed by device memory
  StreamId stream;
  bool small;
  std::vector<BlockInfo> blocks;
};

class Pool {
 public:
  using OomCallback = std::function<void()>;

  explicit Pool(std::shared_ptr<Upstream> upstream, PoolOptions options = {});
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Returns an address aligned to 512 bytes, or 0 for a zero-byte request (which frees as a no-op).
  // @throws OutOfMemoryError when the memory cannot be had; InvalidArgument for absurd sizes.
  std::uintptr_t allocate(std::size_t bytes, StreamId stream);
  // @throws InvalidArgument for a pointer this pool did not hand out or already freed.
  void free(std::uintptr_t address);
  // Marks the block as used on `stream` as well: free() will wait for that stream's work.
  void record_stream(std::uintptr_t address, StreamId stream);
  // Polls pending events and recycles the blocks whose streams are done.
  void process_events();
  // Returns every fully free page / segment to the device. Returns the bytes released.
  std::size_t trim();

  // @throws InvalidArgument if `bytes` (non-zero) is below the bytes live blocks hold.
  void set_cap(std::size_t bytes);
  std::size_t cap() const;
  std::size_t effective_cap() const;  // cap, or the device's total memory
  ReleasePolicy release_policy() const { return options_.release; }

  DeviceStats stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  // Largest run of free bytes backed by device memory (what could be handed out without reserving).
  std::size_t largest_free_block() const;
  std::vector<RegionInfo> snapshot() const;
  // Size of the block at `address` if this pool handed it out and it is live, else 0.
  std::size_t allocation_size(std::uintptr_t address) const;

  int add_oom_callback(OomCallback callback);
  void remove_oom_callback(int id);

  // Walks every block and checks the pool's structures and accounting.
  // @throws InvariantViolation describing the first inconsistency found.
  void validate() const;

  Upstream& upstream() { return *upstream_; }
  int device() const { return options_.device; }

 private:
  struct Region;
  struct Arena;
  struct Block;
  struct Block {
    std::uintptr_t address = 0;
    std::size_t size = 0;
    std::size_t requested = 0;
    Region* region = nullptr;
    Block* prev = nullptr;  // address neighbours inside the region
    Block* next = nullptr;
    BlockInfo::State state = BlockInfo::kFree;
    std::uint32_t pending_events = 0;
    std::vector<StreamId> extra_streams;
    // Its neighbours in its arena's free index while free (a bin's or a size class's list).
    Block* bin_prev = nullptr;
    Block* bin_next = nullptr;
  };
  struct Region {
    std::uintptr_t base = 0;
    std::size_t size = 0;
    Arena* arena = nullptr;
    bool paged = false;
    std::size_t page = 0;                   // paged regions: bytes per page (one physical allocation)
    std::vector<std::uint8_t> page_mapped;  // paged regions: one flag per page
    std::size_t reserved = 0;               // bytes backed by device memory
    std::size_t mapped_limit = 0;           // no page at or past this index has ever been mapped
    std::size_t holes = 0;                  // unmapped pages below mapped_limit
    Block* first = nullptr;
  };
  struct Arena {
    StreamId stream = 0;
    bool small = false;
    std::vector<std::unique_ptr<Region>> regions;
    FreeIndex<Block> free_blocks;
  };
  struct PendingFree {
    Block* block;
    EventId event;
  };

  std::uintptr_t try_allocate(std::size_t rounded, std::size_t requested, StreamId stream);
  Arena& arena_for(StreamId stream, bool small) {
    Arena* last = last_arena_[small];  // most calls repeat the previous stream: inline, no call
    return last && last->stream == stream ? *last : find_arena(stream, small);
  }
  Arena& find_arena(StreamId stream, bool small);  // finds or adds it, and remembers it as the last
  Block* take_free_block(Arena& arena, std::size_t rounded);
  Region* add_segment(Arena& arena, std::size_t bytes);
  Region* add_paged_region(Arena& arena);
  Region* add_region(Arena& arena, std::uintptr_t base, std::size_t bytes, std::size_t page);
  static bool below_mapped_limit(const Block* block);
  bool ensure_mapped(Block* block);
  bool make_room(std::size_t bytes);
  std::size_t release_cached(std::size_t target, bool rethrow = false);
  std::size_t release_cached_units(std::size_t target);
  std::size_t release_pages_of(Block* block, std::size_t target);
  void split(Block* block, std::size_t size);
  void insert_free(Block* block);
  void return_to_arena(Block* block);
  void recycle_completed();  // frees pending blocks whose events have completed (lock held)
  void add_reserved(Region* region, std::int64_t bytes);
  Block* new_block();
  void delete_block(Block* block);
  Block* find_live(std::uintptr_t address, const char* what) const;
  std::size_t largest_free_block_locked() const;
  std::size_t backed_bytes(const Block* block) const;      // bytes of a free block on mapped pages
  std::size_t longest_backed_run(const Block* block) const;  // longest such run without a gap
  std::string oom_message(std::size_t requested, StreamId stream) const;
  StatType pool_of(const Region* region) const { return region->arena->small ? kSmallPool : kLargePool; }
  template <typename F> void update(StatArray& stat, StatType type, F&& op);

  std::shared_ptr<Upstream> upstream_;
  PoolOptions options_;
  std::size_t page_size_;   // the upstream's granularity (segment sizes round to it)
  std::size_t small_page_;  // page of the small arenas' regions
  std::size_t large_page_;  // page of the large arenas' regions
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<Arena>> arenas_;
  Arena* last_arena_[2] = {nullptr, nullptr};  // last arena used, large [0] and small [1]
  AddressMap<Block*> live_;  // allocated and pending blocks by address
  std::deque<PendingFree> pending_;
  std::size_t live_high_water_ = 0;  // highest active bytes so far (not reset by reset_peak_stats)
  mutable DeviceStats stats_;
  std::vector<Block*> spare_blocks_;  // recycled Block objects, to keep the hot path off the heap
  std::vector<std::pair<int, OomCallback>> oom_callbacks_;
  int next_callback_id_ = 1;
};

}  // namespace gpumem
