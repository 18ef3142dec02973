// The pooled allocator. How it works, in brief:
//  - Requests are rounded to 512 bytes. Those up to 1 MiB go to a "small" arena, the rest to a "large"
//    one; each stream has its own pair of arenas, so a block freed on stream S is reused at once on S
//    and never handed to another stream while S may still use it.
//  - An arena's free blocks sit in a free index (exact-size bins up to 1 MiB, sorted size class lists
//    above; the last freed first among equal sizes): allocation takes the best fit and splits it;
//    free coalesces with free neighbours of the same region.
//  - On a paged upstream (CUDA VMM) an arena has one region: a virtual range four times the device,
//    whose pages (the upstream's 2 MiB granularity) are mapped when a block first needs them: one
//    physical allocation per page in small arenas; in large ones one per group of pages (8 MiB by
//    default) while whole groups fit, and within 1% of the cap one per 2 MiB page except the groups
//    a block of 256 MiB or more covers whole, so that in the tight case a block pins no more than it
//    touches (page_map.hpp: units); under a roomy cap or limit (2% above a settled live high water,
//    bound_is_roomy) whole groups again, released to make room: the bound does not decide what fits
//    there, and the driver's work goes by units. Under a cap or limit, the blocks mapped while the live
//    high water is below 10% of it (a run's weights and optimizer state) map their end groups page by
//    page (early_ends_by_page; option ends_by_page: every block, under a bound that is not roomy).
//    Units unmapped to make room for a block are kept for its map (Upstream::keep_released_units)
//    rather than released and created again. When the best fit needs pages mapped, a larger free
//    block that needs fewer takes the block (Pool::fewest_unmapped_fit), and within its free block it
//    goes where it needs the fewest (Pool::place). Free pages anywhere in it can be unmapped, so free
//    memory in the middle of a region goes back to the device ("reserved" = mapped pages). Small
//    arenas pack instead (Pool::packed_fit): a block of exactly 1 MiB (a slot, half a page) starts on
//    a slot boundary (unless, as the last try before an out-of-memory error, only a mapped hole with
//    no boundary holds it: take_mapped_slot_off_boundary), and a block goes where it opens the fewest
//    pages, then slots, that no other block uses, so that their live bytes pin few pages.
//  - On a segments upstream (cudaMalloc) an arena has many regions (segments), released only whole.
//  - Release policy "lazy" (default): free pages stay cached (mapped) for reuse until trim(), or until
//    the cap or the device runs short: then fully free pages anywhere, even between live blocks, are
//    unmapped and mapped again where the request needs them, so fragmentation never causes an OOM.
//    Policy "high_water" also does this before reserving past the highest live bytes so far (plus a
//    slack), keeping reserved within a page or two of live.
//  - Releasing pages never synchronises the device (pool_drain.cpp): the pages are carved out of their
//    free block as a "draining" block and unmapped once the device is past the block's last use: the
//    first "mark" (an event recorded on the arena's stream) recorded after the block was freed. Pages
//    freed before a mark that has completed go back at once; others drain behind the earliest mark
//    recorded after their free (a new one only if there is none), polled, never waited for. A block
//    of the same region that needs pages takes draining ones first, those released to make room for
//    it included (unless the live bytes and the block pass 98% of the cap): their memory is mapped
//    under it too (Upstream::map_from), which stream order makes safe. Only an allocation that
//    nothing else can serve waits, and then for the earliest such mark (for all of them before its
//    out-of-memory retry, so that the retry sees the released space as merged free blocks).
//  - A cap bounds reserved bytes. When the upstream or the cap says no: wait for the blocks freed
//    with record_stream() whose other streams were still running, release the whole cache and retry;
//    run the out-of-memory callbacks (gc.collect() from Python) and retry; then throw
//    OutOfMemoryError with the figures a user needs.
//  - When the device refuses a map (memory outside the pool), the room it then had bounds the pool like
//    the cap; the device is asked again before that room makes a block release cached pages, and the
//    room grows if memory outside was freed (pool_release.cpp, learn_device_room).
//  - Option stitch (on by default; pool_alias.cpp): past the live high water, a block's new pages are
//    mapped onto the units of free blocks rather than new memory; their old positions stay mapped
//    ("parked", counted as unmapped) and a later block there takes the unit back without a driver
//    call while its new owner is free. Only while no cap or limit bounds the pool (stitching()).
//  - Option park_lent (on by default; pool_alias.cpp, parks_lent_units): under a roomy cap or limit,
//    units lent to a block while they drained stay mapped where they were (parked, as stitching
//    parks them), so that a later step's block there takes them back without a driver call.
//  - record_stream(ptr, S2) makes free() record an event on S2; the block is reused only after it.
//  - allocate_at() carves a block at a given address out of free space (CUDA-graph checkpoints are
//    restored by re-allocating blocks where they were); its code is in pool_allocate_at.cpp.
//
// Where the code is (one concept per file):
//   pool.hpp                 this class, its options and what it reports (BlockInfo, RegionInfo)
//   pool.cpp                 construction and teardown, allocate / free / record_stream and pending
//                            events, arenas and regions, split and merge
//   pool_map.cpp             placing a block in its free block, mapping its pages (units), span events
//   pool_allocate_at.cpp     allocate_at: a block carved at a given address
//   pool_release.cpp         giving memory back: make_room, release_cached, trim, the cap and limit
//   pool_drain.cpp           draining pages: released pages unmapped once their stream's event completed
//   pool_alias.cpp           option stitch: free units mapped under new blocks, parked positions taken back
//   pool_introspection.cpp   stats, snapshot, largest free block, live-block queries, export, OOM text
//   pool_validate.cpp        validate(), the invariant checker
//   pool_debug.hpp           the validate-every-op check of debug builds (GPUMEM_VALIDATE_EVERY_OP)
//   page_map.hpp/.cpp        a paged region's page flags, mapped_limit and holes (PageMap)
//   free_index.hpp           an arena's free blocks by size (bins + size_class_lists.hpp)
//   address_map.hpp          live blocks by address
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "address_map.hpp"
#include "budget.hpp"
#include "errors.hpp"
#include "free_index.hpp"
#include "page_map.hpp"
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
  // on a GPU saves an event and an unmap/map round per wobble.
  double release_slack = 0.005;
  // Paged upstreams: bytes per page of the large arenas (a multiple of the upstream's granularity;
  // 0 = the granularity). Small arenas always use the granularity.
  std::size_t large_page_bytes = kDefaultPageSize;
  // Paged upstreams: keep the driver's mapping of a unit whose memory moved to another block (an alias,
  // pool_alias.cpp), and back new pages past the live high water (+ stitch_slack) with the units of
  // free blocks rather than new memory; a block that later lands on such a position takes the unit
  // back without a driver call when its new owner is free. Reserved stays near the live bytes without
  // the releases of the high-water policy; it costs unit maps and unmaps in steady steps where a
  // position's unit is busy elsewhere (README, "Stitching"; docs/benchmarks.md, "stitch_slack"). Only while
  // no cap or limit is set (Pool::stitching).
  bool stitch = true;
  // Option stitch: new pages are new memory while reserved stays within this fraction above the live
  // high water, stitched past it. Higher: fewer stitched units (fewer driver calls and waits in steady
  // steps where a stitched position's unit is busy elsewhere), reserved further above the live bytes.
  double stitch_slack = 0.01;
  // Paged upstreams, under a cap or a limit that is not roomy (bound_is_roomy): a block's end groups,
  // which it shares with its neighbours, are mapped page by page, the groups it covers whole as group
  // units, so that once a neighbour is freed its pages there can go back to the device one by one
  // instead of staying pinned in a group the block still holds (pool_map.cpp, ensure_mapped). Fewer
  // bytes pinned near the cap; more driver units to map and unmap (docs/benchmarks.md, "ends_by_page").
  bool ends_by_page = false;
  // Paged upstreams, under a cap or a limit: while the live high water is below this fraction of the
  // bound, blocks map their end groups page by page as with ends_by_page (0: never). A run's first
  // blocks are mostly its weights and optimizer state, which live as long as the run: an end group
  // such a block maps whole stays pinned, its free pages with it, when the step's blocks around it
  // come and go near the bound (pool_map.cpp, ensure_mapped; docs/benchmarks.md, "early_ends_by_page").
  double early_ends_by_page = 0.1;
  // Paged upstreams, under a roomy cap or limit (bound_is_roomy): units lent to a block while they
  // drained (map_from_draining) stay mapped at their old position, parked, as stitching parks them
  // with no bound, instead of being unmapped at their mark; a later block there takes the unit back
  // without a driver call while its owner is free. The remapping of a step whose blocks come back
  // where they were becomes no driver call at all (pool_alias.cpp, parks_lent_units). Graph pools and
  // MemPools never park (the bridge: unmapping a parked page may wait, which a capture forbids).
  // Measured (docs/benchmarks.md, "park_lent"): in lockstep at 1.05x on 2x H200, ckpt's step over
  // expandable_segments' 0.994 -> 0.970 and bert's 0.859 -> 0.794, no steady driver call left; the
  // lowest 0-OOM limits of the CPU replays unchanged (a roomy bound is never within 2% of the peak).
  bool park_lent = true;
  int device = 0;             // only used in messages and to reject frees meant for another device
  // Shared with the other pools of a device, whose reserved bytes count against one limit
  // (set_limit); null: the pool has a budget of its own.
  std::shared_ptr<Budget> budget;
};

// One block as seen from outside, for snapshots and debugging.
struct BlockInfo {
  std::uintptr_t address;
  std::size_t size;
  std::size_t requested;  // 0 unless allocated
  enum State { kFree, kAllocated, kPending, kDraining } state;
  // kDraining: free, but its pages are being given back (unmapped once an event on its stream has
  // completed); snapshots show it as an inactive block.
  // Free blocks: what the last allocation that began here asked for (0 if none), as PyTorch's
  // allocator shows inactive blocks in its memory snapshots.
  std::size_t last_requested = 0;
};

// What the segment observer is told about. The first four are what happened to the device's memory
// (torch's memory history: segment_map / segment_unmap / segment_alloc / segment_free). The span
// events describe the same changes as the entries of snapshot() (a span: a maximal run of mapped
// pages of a paged region, or a whole segment), which is what NCCL registers: the spans added minus
// those removed are always exactly snapshot()'s regions, a span removed is one added earlier (same
// address and bytes), and its removal is told before any of its memory is unmapped or freed. A
// map next to a span removes that span and adds the joined one; unmapping pages out of a span
// removes it and adds what is left on either side (or adds it back whole if the driver refused).
enum class SegmentEvent {
  kMap,           // pages of a paged region were mapped: [address, address + bytes)
  kUnmap,         // pages of a paged region were unmapped
  kSegmentAlloc,  // a segment (cudaMalloc) was taken from the upstream
  kSegmentFree,   // a segment was given back
  kSpanAdded,     // [address, address + bytes) is now one entry of snapshot()
  kSpanRemoved,   // that entry is about to stop being one (told before its memory goes back)
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
  using SegmentObserver =
      std::function<void(SegmentEvent event, std::uintptr_t address, std::size_t bytes, StreamId stream)>;
  static constexpr std::size_t kNoLimit = Budget::kNoLimit;
  // Half of CUDA's 2 MiB page: small arenas place a block of exactly this size on a slot boundary,
  // and keep smaller blocks out of empty slots where they can (pool_map.cpp, packed_placement).
  static constexpr std::size_t kSlotBytes = 1 * MiB;

  explicit Pool(std::shared_ptr<Upstream> upstream, PoolOptions options = {});
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Returns an address aligned to 512 bytes, or 0 for a zero-byte request (which frees as a no-op).
  // `count_oom` false: an out-of-memory is thrown without counting it in num_ooms, for a caller that
  // may still serve the request elsewhere (the bridge borrows from MemPool(use_on_oom=True)) and
  // counts it with count_oom() only if that fails too, as PyTorch counts OOMs.
  // @throws OutOfMemoryError when the memory cannot be had; InvalidArgument for absurd sizes.
  std::uintptr_t allocate(std::size_t bytes, StreamId stream, bool count_oom = true);
  // Like allocate(), but only from memory this pool has already reserved: nothing is mapped or taken
  // from the upstream, no cache is released, no callback runs. Returns 0 when nothing cached fits.
  // (PyTorch's MemPool(use_on_oom=True): another pool's OOM borrows a pool's cached memory.)
  std::uintptr_t allocate_cached(std::size_t bytes, StreamId stream);
  // Allocates exactly [address, address + round_up(bytes, 512)) and returns `address`: the block is
  // then what allocate() would have left (requested = bytes, same statistics), on the stream of the
  // arena whose region holds the range. The range must lie in one region of this pool and inside one
  // free block (pending frees whose events are done count as free). Pages it touches are mapped as
  // allocate() maps them, under the cap and the limit; memory already mapped (or a segment) needs no
  // room. For restoring CUDA-graph checkpoints: the bridge re-allocates blocks at their old addresses.
  // Does not run the OOM callbacks.
  // @throws InvalidArgument (nothing changed) for a misaligned address, a size of 0 or above
  //   kMaxRequest, a range outside every region or overlapping a live or pending block.
  // @throws OutOfMemoryError when the pages cannot be mapped even after releasing cached pages
  //   elsewhere (never inside the range): no block changes; reserved may differ, as after allocate().
  std::uintptr_t allocate_at(std::uintptr_t address, std::size_t bytes);
  // @throws InvalidArgument for a pointer this pool did not hand out or already freed.
  void free(std::uintptr_t address);
  // free() for a pointer that may belong to another pool: false, changing nothing, when `address` is
  // not a live allocated block of this pool (0 included); true when it was freed. The bridge probes
  // its pools with one deleter, without paying for an exception per miss. `freed_bytes` (when not
  // null) receives the freed block's size, so that callers counting bytes need no second lookup.
  bool try_free(std::uintptr_t address, std::size_t* freed_bytes = nullptr);
  // Marks the block as used on `stream` as well: free() will wait for that stream's work.
  void record_stream(std::uintptr_t address, StreamId stream);
  // Polls pending events and recycles the blocks whose streams are done.
  void process_events();
  // Returns every fully free page / segment to the device. Returns the bytes released. The live high
  // water (stitching's and the high-water policy's reference) starts again from the live bytes.
  std::size_t trim();

  // @throws InvalidArgument if `bytes` (non-zero) is below the bytes live blocks hold.
  void set_cap(std::size_t bytes);
  std::size_t cap() const;
  // A bound on reserved bytes besides the cap, with torch's set_per_process_memory_fraction meaning:
  // any value is accepted (0 and values below what live blocks hold included; kNoLimit removes it).
  // It is the limit of the pool's budget, so with a shared budget (PoolOptions::budget) it bounds the
  // reserved bytes of all the pools that share it. This pool's cached pages are released down to it
  // at once where they can be; allocations that would reserve past it fail with OutOfMemoryError,
  // and under a limit of 0 every allocate() does.
  void set_limit(std::size_t bytes);
  std::size_t limit() const;  // kNoLimit when none
  std::size_t effective_cap() const;  // min(cap or the device's total memory, limit)
  ReleasePolicy release_policy() const { return options_.release; }

  DeviceStats stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  // Largest run of free bytes backed by device memory (what could be handed out without reserving).
  std::size_t largest_free_block() const;
  std::vector<RegionInfo> snapshot() const;
  // Size of the block at `address` if this pool handed it out and it is live, else 0.
  std::size_t allocation_size(std::uintptr_t address) const;
  // True, filling *out (when not null), when `address` starts a live allocated block of this pool.
  bool live_block(std::uintptr_t address, BlockInfo* out) const;
  // The current aggregate allocated / reserved bytes, without the walk stats() makes (the bridge asks
  // for them on every allocation it reports).
  std::size_t allocated_bytes() const;
  // Counts an out-of-memory the caller detected before asking the pool (a request no device could
  // hold), so num_ooms agrees with what the user saw.
  void count_oom();
  // For CUDA IPC: the pages under the live block at `address` exported by the upstream (paged
  // upstreams only), with the first page's address and the page size.
  // @throws InvalidArgument for a pointer that is not a live block; UpstreamError when the upstream
  // cannot export.
  struct ExportedBlock {
    std::uintptr_t first_page;
    std::size_t page;
    std::vector<int> fds;
  };
  ExportedBlock export_block(std::uintptr_t address);
  std::size_t reserved_bytes() const;
  // Bytes of pages released but not yet unmapped (still reserved): they go back once the work queued
  // on their stream when they were released has completed (pool_drain.cpp).
  std::size_t draining_bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return draining_bytes_;
  }

  // Called after every successful map, unmap, segment allocation and segment free (including those
  // of trim(), set_cap(), set_limit() and releases under the cap; not those of the destructor), for
  // torch's memory history and NCCL's allocator trace trackers. It runs with the pool's lock held:
  // it must not call back into this pool (that deadlocks) and should be quick; an exception it
  // throws is ignored. An empty function removes it.
  void set_segment_observer(SegmentObserver observer);

  int add_oom_callback(OomCallback callback);
  void remove_oom_callback(int id);

  // Walks every block and checks the pool's structures and accounting.
  // @throws InvariantViolation describing the first inconsistency found.
  void validate() const;
  // Whether this build checks the pool after every public mutating call (cmake
  // -DGPUMEM_VALIDATE_EVERY_OP=ON, a debug build for CI): a violation throws InvariantViolation from
  // the call that caused it (or aborts, naming it, when the call was already throwing).
  static bool validates_every_op();

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
    std::size_t last_requested = 0;  // kept when freed, for snapshots (BlockInfo)
    Region* region = nullptr;
    Block* prev = nullptr;  // address neighbours inside the region
    Block* next = nullptr;
    BlockInfo::State state = BlockInfo::kFree;
    // Free blocks: the pool's free count (free_seq_) when the last block freed here was freed; the
    // device is past every use of its pages once a mark of that count or later has completed. 0: no
    // use since its pages were mapped. Merging keeps the larger count, splitting copies it.
    std::uint64_t freed_seq = 0;
    std::uint32_t pending_events = 0;
    std::vector<StreamId> extra_streams;
    // Its neighbours in its arena's free index while free (a bin's or a size class's list).
    Block* bin_prev = nullptr;
    Block* bin_next = nullptr;
  };
  // Option stitch (pool_alias.cpp): a position of a paged region whose pages the driver maps to a
  // physical unit that other pages of the region, its owner, hold: parked (PageMap: a hole, not
  // reserved; a free block's unit stitched under a new block, or a lent draining block after its
  // mark), taken back without a driver call when a block needs the position and the owner is free;
  // or a draining block lent to the owner (map_from_draining), parked at its mark.
  struct Alias {
    std::size_t owner = 0;   // first page of the owner's unit
    std::size_t pages = 0;   // pages of the unit (1, or a large arena's group)
    std::uint64_t seq = 0;   // parked: a mark's free count; once done, the device is past its use here
    bool draining = false;   // a lent draining block, not yet parked
  };
  struct Region {
    std::uintptr_t base = 0;
    std::size_t size = 0;
    Arena* arena = nullptr;
    bool paged = false;
    PageMap pages;                          // paged regions: which pages are mapped
    std::size_t reserved = 0;               // bytes backed by device memory
    // Bytes of draining blocks whose units also back a block mapped from them (map_from_draining):
    // mapped twice, counted once in `reserved` (mapped bytes - lent).
    std::size_t lent = 0;
    Block* first = nullptr;
    std::map<std::size_t, Alias> aliases;                        // by first page of the alias
    std::map<std::size_t, std::vector<std::size_t>> aliases_of;  // owner's first page -> its aliases
  };
  // An event recorded on an arena's stream when the pool's free count was `seq`: once it has
  // completed, the device is past the last use of every block freed by then (pool_drain.cpp).
  struct Mark {
    EventId event;
    std::uint64_t seq;
  };
  struct Arena {
    StreamId stream = 0;
    bool small = false;
    std::vector<std::unique_ptr<Region>> regions;
    FreeIndex<Block> free_blocks;
    std::deque<Mark> marks;      // recorded, not yet seen completed; oldest first (seq increasing)
    std::uint64_t done_seq = 0;  // the seq of the last mark seen completed: blocks freed by then are done
  };
  struct PendingFree {
    Block* block;
    EventId event;
  };
  // A draining block (whole mapped pages, out of the free index) and the mark of its arena after
  // which its pages can be unmapped (done once the arena's done_seq reaches `seq`). `lent`: its units
  // back another block of the region as well (map_from_draining); unmapping it then frees nothing.
  struct Draining {
    Block* block;
    std::uint64_t seq;
    bool lent = false;
  };

  class ValidateOnReturn;  // the validate-every-op debug check (pool_debug.hpp)
  void validate_locked() const;

  std::uintptr_t try_allocate(std::size_t rounded, std::size_t requested, StreamId stream,
                              bool last_try = false);
  bool commit_allocation(Block* block, bool release_and_retry);
  bool free_locked(std::uintptr_t address, std::size_t* freed_bytes = nullptr);
  // allocate_at's helpers (pool_allocate_at.cpp).
  Block* free_block_holding(std::uintptr_t address, std::size_t rounded, std::size_t bytes);
  Block* carve(Block* free_block, std::uintptr_t address, std::size_t rounded);
  Arena& arena_for(StreamId stream, bool small) {
    Arena* last = last_arena_[small];  // most calls repeat the previous stream: inline, no call
    return last && last->stream == stream ? *last : find_arena(stream, small);
  }
  Arena& find_arena(StreamId stream, bool small);  // finds or adds it, and remembers it as the last
  Block* take_free_block(Arena& arena, std::size_t rounded);
  Block* fewest_unmapped_fit(const Arena& arena, Block* best, std::size_t rounded) const;
  // Small arenas on a paged upstream: the free block that takes `rounded` bytes so that they open the
  // fewest empty pages, then the fewest empty slots (pool_map.cpp, packed_placement).
  bool packs(const Arena& arena) const { return arena.small && upstream_->kind() == UpstreamKind::kPages; }
  Block* packed_fit(const Arena& arena, Block* best, std::size_t rounded) const;
  Block* take_mapped_slot_off_boundary(Arena& arena, std::size_t rounded);  // before an OOM only
  Block* place(Arena& arena, Block* block, std::size_t rounded);
  Region* add_segment(Arena& arena, std::size_t bytes);
  Region* add_paged_region(Arena& arena);
  Region* add_region(Arena& arena, std::uintptr_t base, std::size_t bytes, std::size_t page);
  bool ensure_mapped(Block* block);
  // `lend_to`: the region whose draining pages the caller maps from (map_from_draining) rather than
  // waits for: they need no room and stay reserved, so they do not count as going back.
  bool make_room(std::size_t bytes, const Region* lend_to = nullptr);
  // Whether make_room lends the pages it releases to a block of `block_bytes` (make_room's lend_to)
  // rather than waiting for them: not when the live bytes and the block come within kLendHeadroom
  // of the effective cap (pool_release.cpp).
  bool lends_near_cap(std::size_t block_bytes) const;
  // Whether `bytes` more reserved bytes fit under the cap, the limit and the high-water allowance
  // without releasing anything (pool_release.cpp).
  bool fits_without_release(std::size_t bytes) const;
  // Whether a cap or a limit leaves room above the live bytes the pool needs: set, at least
  // kRoomyBound above the live high water, and that high water settled (pool_release.cpp). Then a
  // large arena remapping at the bound maps whole groups, not single pages.
  bool bound_is_roomy() const;
  std::size_t release_cached(std::size_t target, bool rethrow = false);
  std::size_t release_cached_units(std::size_t target);
  void forget_high_water();  // trim(): the live high water starts again from the live bytes
  std::size_t release_pages_of(Block* block, std::size_t target);
  // pool_drain.cpp. Unmaps the draining blocks whose marks have completed; with `wait_oldest`, when
  // none has, first waits for the earliest mark one of them needs. Returns the bytes unmapped. A
  // driver error on unmap leaves that block's pages mapped, as a free (cached) block; rethrown with
  // `rethrow`.
  std::size_t reap_drained(bool wait_oldest, bool rethrow = false);
  // Waits for every draining block and unmaps it. Returns the bytes unmapped.
  std::size_t drain_all(bool rethrow = false);
  // reap_drained(wait_oldest=true) when something is draining; false when nothing was or nothing left
  // the draining list (a lent block whose unmap the driver refused stays in it), so loops end.
  bool reap_waiting(std::size_t* unmapped = nullptr, bool rethrow = false);
  // Draining pages of `region` not lent yet: what map_from_draining can take for a map there.
  std::size_t lendable_bytes(const Region* region) const;
  // Maps a prefix of the unmapped `run` of `region` (units of `unit` bytes) onto the units of
  // draining blocks of the region (Upstream::map_from), without waiting for their marks: the region's
  // stream uses the new block only after the draining block's last use. Returns the bytes mapped.
  std::size_t map_from_draining(Region* region, PageRun run, std::size_t unit);
  // pool_alias.cpp. Whether new pages are stitched and lent units parked now: option stitch, and no
  // cap or limit set. Under a bound the pool keeps reserved near the live bytes by releasing anyway,
  // and the capped benches fit less with stitching (docs/benchmarks.md, "Stitching under a bound"). Parked
  // aliases made before a bound was set stay valid: they are only ever taken back or unmapped.
  bool stitching() const;
  // Whether units lent from draining blocks are parked at their old position (lend_aliases) rather
  // than unmapped at their mark: while stitching, and under a roomy bound with option park_lent.
  bool parks_lent_units() const;
  // The units of `source` (a draining block's pages) now back `target` (pages of the same count,
  // `unit_pages` a unit): each becomes a draining alias of its target, which takes over its aliases.
  void lend_aliases(Region* region, PageRun source, PageRun target, std::size_t unit_pages);
  // At a lent draining block's mark: parks it when every unit still has its owner (true, nothing
  // unmapped: the block is free on parked pages); false, with the alias records of its units
  // dropped, when the caller must unmap it as before.
  bool park_drained(Region* region, Block* block, std::uint64_t seq);
  // Before the owned pages of `run` are unmapped: their parked aliases are unmapped (the device is
  // past them: the pages drained behind their marks too, start_draining) and their lent ones forgotten.
  void drop_aliases_of(Region* region, PageRun run);
  // The parked pages `block` (allocated, mapping its pages) touches: a unit whose owner lies wholly
  // in free blocks is handed back (the owner's pages parked in turn: no driver call); the others are
  // unmapped (after the device is past their last use) and mapped again as any unmapped page.
  void take_back_parked(Block* block);
  // Maps a prefix of the unmapped `run` (units of `unit` bytes) onto mapped units of the region's free
  // blocks, past the live high water only, which are parked where they were: no new memory. Units
  // inside `keep_out` (the groups the block being mapped touches) are not taken. Returns the bytes
  // mapped.
  std::size_t map_from_free(Region* region, PageRun run, std::size_t unit, PageRun keep_out);
  // The unit mapped at `from` (the driver maps it at `to` as well) is owned at `to` from now: `from`
  // parked behind the mark `seq`, `to` mapped, the unit's aliases moved to it, with the span events.
  void move_unit(Region* region, PageRun from, PageRun to, std::uint64_t seq);
  // Whether the pages `run` lie wholly in free blocks; *seq gets the latest free count among them.
  bool run_is_free(const Region* region, PageRun run, std::uint64_t* seq) const;
  void unmap_alias(Region* region, std::size_t position);  // a parked alias, at the driver, forgotten
  void wait_done(Arena& arena, std::uint64_t seq);  // waits until the device is past free count `seq`
  // The seq of the mark after which pages of a block freed at `freed_seq` may be unmapped: done
  // already, an earlier mark's, or a new mark recorded now (throws if recording fails).
  std::uint64_t mark_after(Arena& arena, std::uint64_t freed_seq);
  void poll_marks(Arena& arena);  // moves done_seq past the marks that have completed (never waits)
  // Waits for the arena's earliest mark of `seq` or later (its stream if none is recorded), then
  // moves done_seq to at least `seq`: the device is past every block freed by then.
  void wait_for_mark(Arena& arena, std::uint64_t seq);
  // Takes the whole pages [address, address + bytes) out of the free block `free_block` holding them
  // as a draining block behind the mark `seq`; the pieces before and after stay free.
  Block* start_draining(Block* free_block, std::uintptr_t address, std::size_t bytes, std::uint64_t seq);
  void split(Block* block, std::size_t size);
  // The bytes of `block` past `size` as a new block after it (free, in no index); `block` keeps `size`.
  Block* split_off(Block* block, std::size_t size);
  void insert_free(Block* block);
  void return_to_arena(Block* block);
  void recycle_completed();  // frees pending blocks whose events have completed (lock held)
  void wait_pending_frees();  // waits for every pending block's events, then recycle_completed()
  void add_reserved(Region* region, std::int64_t bytes);
  Block* new_block();
  void delete_block(Block* block);
  Block* find_live(std::uintptr_t address, const char* what) const;
  std::size_t largest_free_block_locked() const;
  static std::size_t backed_bytes(const Block* block);        // bytes of a free block on mapped pages
  static std::size_t longest_backed_run(const Block* block);  // longest such run without a gap
  std::size_t reserved_locked() const { return static_cast<std::size_t>(stats_.reserved_bytes[kAggregate].current); }
  std::size_t effective_cap_locked() const {
    const std::size_t cap = options_.cap_bytes ? options_.cap_bytes : upstream_->device_total_bytes();
    const std::size_t limit = budget_->limit();
    return cap < limit ? cap : limit;
  }
  // What make_room and the placement keep reserved bytes under: the effective cap, or the device's
  // room learned when it last refused a map, if lower (pool_release.cpp, learn_device_room).
  std::size_t bound_locked() const {
    const std::size_t cap = effective_cap_locked();
    return device_room_ && device_room_ < cap ? device_room_ : cap;
  }
  // Whether anything but the device's total memory bounds the pool: a cap, a limit or the learned room.
  bool bounded_locked() const {
    return options_.cap_bytes != 0 || budget_->limit() != Budget::kNoLimit || device_room_ != 0;
  }
  // The device's free bytes in *free_bytes; false (nothing written) on a driver error, which callers
  // survive: the room known before stays, an out-of-memory message says "unknown" (pool_release.cpp).
  bool device_free_bytes(std::size_t* free_bytes) const;
  void learn_device_room();         // the room := reserved + the device's free bytes (pool_release.cpp)
  void ask_device_for_more_room();  // the room grows if memory outside was freed (pool_release.cpp)
  // Span events around a map or an unmap of `run` in `region` (pool_map.cpp).
  void notify_mapped_run(const Region* region, PageRun run);
  PageRun notify_unmapping_run(const Region* region, PageRun run);
  void notify_unmapped_run(const Region* region, PageRun run, PageRun span, bool unmapped);
  void notify(SegmentEvent event, std::uintptr_t address, std::size_t bytes, StreamId stream) {
    if (!observer_) return;
    try {
      observer_(event, address, bytes, stream);
    } catch (...) {
      // Documented as ignored: the pool's state is already updated, and the caller did nothing wrong.
    }
  }
  // `at` non-zero: the message names the address allocate_at() was asked for.
  std::string oom_message(std::size_t requested, StreamId stream, std::uintptr_t at = 0) const;
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
  std::deque<Draining> draining_;
  std::size_t draining_bytes_ = 0;  // bytes of the draining blocks (still mapped, still reserved)
  std::uint64_t free_seq_ = 0;      // blocks freed so far (Block::freed_seq, Mark::seq)
  // Highest active bytes since the pool was made or last trimmed (not reset by reset_peak_stats).
  std::size_t live_high_water_ = 0;
  // The live high water as of its last rise by more than kSettledRise (1%), and the bytes allocated
  // since then (bound_is_roomy: a high water that has held while several times its bytes were allocated).
  static constexpr double kSettledRise = 0.01;
  std::size_t settled_high_water_ = 0;
  std::size_t allocated_since_high_water_rose_ = 0;
  mutable DeviceStats stats_;
  std::vector<Block*> spare_blocks_;  // recycled Block objects, to keep the hot path off the heap
  std::vector<std::pair<int, OomCallback>> oom_callbacks_;
  int next_callback_id_ = 1;
  std::shared_ptr<Budget> budget_;  // the limit (set_limit) and the reserved bytes it counts
  bool own_budget_ = false;          // no other pool shares budget_ (validate() checks its count)
  bool growth_allowed_ = true;       // false inside allocate_cached(): make_room() refuses
  // Reserved bytes plus the device's free bytes when it last refused a map: the most this pool can
  // hold while other memory on the device stays as it is (0: unknown). Learned again before
  // allocate()'s retry and by trim(), grown when memory outside is freed (pool_release.cpp).
  std::size_t device_room_ = 0;
  SegmentObserver observer_;
};

}  // namespace gpumem
