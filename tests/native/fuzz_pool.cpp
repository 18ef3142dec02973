// The fuzz harness: a byte stream decoded into pool operations (allocate with sizes and streams, free,
// bad frees, record_stream, event completion, trim, cap changes, upstream faults, OOM callbacks,
// allocate_at at recently freed or random addresses, limit changes), run against the simulated
// device, with every operation checked against a plain reference model.
//
// After each operation:
//   - Pool::validate() (the pool's own invariant checker);
//   - the model's live allocations (address -> requested, rounded, stream) agree with the stats:
//     allocation count, allocated_bytes (sum of sizes rounded to 512), requested_bytes;
//   - active - allocated lies between the bytes of pending blocks whose events are certainly not done
//     and all pending blocks (equal to the former right after process_events);
//   - the device hands out exactly the pool's reserved bytes (no leak, no double count);
//   - largest_free_block and inactive_split_bytes fit inside reserved - active.
// Per operation:
//   - a new address is 512-aligned, backed by mapped memory, and overlaps neither a live allocation
//     nor a block still waiting for another stream's event;
//   - memory goes back to the device only when no live block lies on it and after the streams that
//     last used it were synchronised;
//   - an OutOfMemoryError carries the figures stats() shows, and, when no fault was injected, it is
//     justified: no free block of the arena fits and mapping / a new segment would pass the cap;
//   - InvalidArgument for a bad free / record_stream / cap leaves the pool exactly as it was, and
//     try_free of such a pointer returns false, changing nothing;
//   - allocate_at succeeds exactly where the model says the range is free (inside a region, clear of
//     live blocks and of pending blocks whose events are not done), or fails with an OOM there that is
//     justified as above; elsewhere it throws InvalidArgument. A failure changes no live block, no
//     allocation statistic, and (when nothing was released or recycled) nothing at all;
//   - a successful allocation never takes reserved past the cap, the limit or the device.
// The same function is driven by libFuzzer (fuzz_pool) and by a plain driver (fuzz_replay, fuzz_main.cpp).
#include <algorithm>
#include <cinttypes>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "core/errors.hpp"
#include "core/format.hpp"
#include "core/pool.hpp"
#include "core/simulated_device.hpp"

using namespace gpumem;

namespace {

bool verbose() {
  static const bool v = std::getenv("GPUMEM_FUZZ_VERBOSE") != nullptr;
  return v;
}

std::string g_context;  // the operation being checked, printed with a failure

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "\nFUZZ INVARIANT FAILURE: %s\n  during: %s\n", what.c_str(), g_context.c_str());
  std::fflush(stderr);
  std::abort();
}

#define REQUIRE(cond, msg)                                             \
  do {                                                                 \
    if (!(cond)) {                                                     \
      std::ostringstream _m;                                           \
      _m << #cond << " -- " << msg;                                    \
      fail(_m.str());                                                  \
    }                                                                  \
  } while (0)

struct Reader {
  const std::uint8_t* p;
  std::size_t n;
  bool empty() const { return n == 0; }
  std::uint8_t u8() {
    if (!n) return 0;
    --n;
    return *p++;
  }
  // Each byte read in its own statement: operand order is unspecified, and the corpus must decode
  // the same way under every compiler.
  std::uint16_t u16() {
    std::uint16_t lo = u8();
    std::uint16_t hi = u8();
    return static_cast<std::uint16_t>(lo | (hi << 8));
  }
  std::uint32_t u32() {
    std::uint32_t lo = u16();
    std::uint32_t hi = u16();
    return lo | (hi << 16);
  }
};

bool overlaps(std::uintptr_t a, std::size_t an, std::uintptr_t b, std::size_t bn) {
  return a < b + bn && b < a + an;
}

// A block freed while other streams used it: the pool may reuse it only once these events are done.
struct PendingModel {
  std::uintptr_t address;
  std::size_t size;
  std::vector<std::pair<StreamId, std::uint64_t>> tickets;  // (stream, ticket of the event)
};

// Forwards to a SimulatedDevice and watches the pool through the upstream interface: which memory is
// mapped, which events exist, which freed memory may still be in use on its stream.
class CheckedDevice : public Upstream {
 public:
  CheckedDevice(std::shared_ptr<SimulatedDevice> sim) : sim_(std::move(sim)) {}

  UpstreamKind kind() const override { return sim_->kind(); }
  std::string name() const override { return "checked-" + sim_->name(); }
  std::size_t page_size() const override { return sim_->page_size(); }
  std::size_t device_total_bytes() const override { return sim_->device_total_bytes(); }
  std::size_t device_free_bytes() const override { return sim_->device_free_bytes(); }

  std::uintptr_t allocate_segment(std::size_t bytes) override {
    std::uintptr_t a = sim_->allocate_segment(bytes);
    if (a) segments_[a] = bytes;
    return a;
  }
  void free_segment(std::uintptr_t address, std::size_t bytes) override {
    check_release(address, bytes, "free_segment");
    sim_->free_segment(address, bytes);
    segments_.erase(address);
  }
  std::uintptr_t reserve_address_range(std::size_t bytes) override {
    std::uintptr_t a = sim_->reserve_address_range(bytes);
    if (a) range_bytes_[a] = bytes;
    return a;
  }
  void release_address_range(std::uintptr_t address, std::size_t bytes) override {
    sim_->release_address_range(address, bytes);
  }
  bool map(std::uintptr_t address, std::size_t bytes, std::size_t page) override {
    if (!sim_->map(address, bytes, page)) return false;
    for (std::size_t off = 0; off < bytes; off += page_size()) mapped_.insert(address + off);
    return true;
  }
  void unmap(std::uintptr_t address, std::size_t bytes, std::size_t page) override {
    check_release(address, bytes, "unmap");
    sim_->unmap(address, bytes, page);
    for (std::size_t off = 0; off < bytes; off += page_size()) mapped_.erase(address + off);
  }

  EventId record_event(StreamId stream) override {
    EventId e = sim_->record_event(stream);
    std::uint64_t ticket = ++queued_[stream];
    if (auto_complete_) completed_[stream] = queued_[stream];
    events_[e] = {stream, ticket};
    recorded_.push_back({stream, ticket});
    return e;
  }
  bool event_completed(EventId event) override {
    bool done = sim_->event_completed(event);
    auto it = events_.find(event);
    REQUIRE(it != events_.end(), "pool queried an event it never recorded or already destroyed");
    bool mine = completed_[it->second.first] >= it->second.second;
    REQUIRE(done == mine, "event completion disagrees with the model");
    return done;
  }
  void destroy_event(EventId event) override {
    REQUIRE(events_.erase(event) == 1, "pool destroyed an unknown event");
    sim_->destroy_event(event);
  }
  void synchronize(StreamId stream) override {
    sim_->synchronize(stream);
    mark_complete(stream);
  }

  // Test controls, mirrored.
  void set_auto_complete(bool on) {
    auto_complete_ = on;
    sim_->set_auto_complete(on);
  }
  bool auto_complete() const { return auto_complete_; }
  void complete(StreamId s) {
    sim_->complete(s);
    mark_complete(s);
  }
  void complete_all() {
    sim_->complete_all();
    for (auto& [s, q] : queued_) completed_[s] = q;
    unsynced_.clear();
  }
  bool done(const std::pair<StreamId, std::uint64_t>& t) { return completed_[t.first] >= t.second; }

  bool backed(std::uintptr_t a, std::size_t n) const {
    if (kind() == UpstreamKind::kPages) {
      std::size_t ps = page_size();
      for (std::uintptr_t p = a / ps * ps; p < a + n; p += ps)
        if (!mapped_.count(p)) return false;
      return true;
    }
    auto it = segments_.upper_bound(a);
    if (it == segments_.begin()) return false;
    --it;
    return a + n <= it->first + it->second;
  }
  std::size_t missing_pages(std::uintptr_t a, std::size_t n) const {
    std::size_t ps = page_size(), missing = 0;
    for (std::uintptr_t p = a / ps * ps; p < a + n; p += ps) missing += !mapped_.count(p);
    return missing;
  }

  // The regions the pool holds (paged address ranges, or segments): base -> bytes.
  const std::map<std::uintptr_t, std::size_t>& regions() const {
    return kind() == UpstreamKind::kPages ? range_bytes_ : segments_;
  }
  // The region holding `a`, as {base, bytes}; {0, 0} when none does.
  std::pair<std::uintptr_t, std::size_t> region_of(std::uintptr_t a) const {
    const auto& r = regions();
    auto it = r.upper_bound(a);
    if (it == r.begin()) return {0, 0};
    --it;
    if (a - it->first >= it->second) return {0, 0};
    return {it->first, it->second};
  }

  // A block the model freed on its own stream: the memory may be used there until a synchronisation.
  void freed_on(std::uintptr_t a, std::size_t n, StreamId s) { unsynced_.push_back({a, n, s}); }

  // What the harness must not see released: live allocations and blocks waiting for events.
  const std::map<std::uintptr_t, std::size_t>* live = nullptr;
  std::vector<PendingModel>* pending = nullptr;
  std::vector<std::pair<StreamId, std::uint64_t>> recorded_;  // events recorded since the last clear

  std::shared_ptr<SimulatedDevice> sim_;

 private:
  void mark_complete(StreamId s) {
    completed_[s] = queued_[s];
    unsynced_.erase(std::remove_if(unsynced_.begin(), unsynced_.end(),
                                   [s](const Unsynced& u) { return u.stream == s; }),
                    unsynced_.end());
  }
  void check_release(std::uintptr_t a, std::size_t n, const char* what) {
    if (live) {
      auto it = live->lower_bound(a + n);
      if (it != live->begin()) {
        --it;
        REQUIRE(!overlaps(a, n, it->first, it->second),
                what << " returns memory under a live allocation at 0x" << std::hex << it->first);
      }
    }
    if (pending)
      for (auto& p : *pending) {
        bool incomplete = false;
        for (auto& t : p.tickets) incomplete |= !done(t);
        REQUIRE(!(incomplete && overlaps(a, n, p.address, p.size)),
                what << " returns memory of a block whose other-stream events are not done");
      }
    for (auto& u : unsynced_)
      REQUIRE(!overlaps(a, n, u.address, u.size),
              what << " returns memory freed on stream " << u.stream
                   << " without synchronising that stream first");
  }

  struct Unsynced {
    std::uintptr_t address;
    std::size_t size;
    StreamId stream;
  };
  std::vector<Unsynced> unsynced_;
  std::set<std::uintptr_t> mapped_;                 // page addresses
  std::map<std::uintptr_t, std::size_t> segments_;  // address -> bytes
  std::map<std::uintptr_t, std::size_t> range_bytes_;  // reserved address ranges: base -> bytes
  std::unordered_map<StreamId, std::uint64_t> queued_, completed_;
  std::unordered_map<EventId, std::pair<StreamId, std::uint64_t>> events_;
  bool auto_complete_ = true;
};

struct Live {
  std::size_t requested;
  std::size_t rounded;
  StreamId stream;
  std::vector<StreamId> extra;  // streams recorded with record_stream (not the block's own)
};

constexpr StreamId kStreams[4] = {0, 1, 7, 0xdead0000};

// The pool's observable state, to prove that a rejected call changed nothing. Without `counters`, the
// OOM / retry / upstream call counts are left out.
std::string fingerprint(const Pool& pool, bool counters = true) {
  DeviceStats s = pool.stats();
  std::ostringstream o;
  auto arr = [&](const StatArray& a) {
    for (const Stat& x : a) o << x.current << ',' << x.peak << ',' << x.allocated << ',' << x.freed << ';';
  };
  arr(s.allocation), arr(s.segment), arr(s.active), arr(s.allocated_bytes), arr(s.reserved_bytes),
      arr(s.active_bytes), arr(s.requested_bytes), arr(s.inactive_split_bytes);
  if (counters) o << s.num_alloc_retries << ',' << s.num_ooms << ',' << s.num_device_alloc << ',' << s.num_device_free;
  for (const RegionInfo& r : pool.snapshot()) {
    o << '|' << r.address << ',' << r.size << ',' << r.reserved;
    for (const BlockInfo& b : r.blocks) o << ' ' << b.address << ',' << b.size << ',' << b.requested << ',' << b.state;
  }
  return o.str();
}

// What no failed allocation may change, whatever it released or recycled: the allocation statistics
// and the allocated blocks.
std::string live_fingerprint(const Pool& pool) {
  DeviceStats s = pool.stats();
  std::ostringstream o;
  for (const StatArray* a : {&s.allocation, &s.allocated_bytes, &s.requested_bytes})
    for (const Stat& x : *a) o << x.current << ',' << x.peak << ',' << x.allocated << ',' << x.freed << ';';
  for (const RegionInfo& r : pool.snapshot())
    for (const BlockInfo& b : r.blocks)
      if (b.state == BlockInfo::kAllocated) o << ' ' << b.address << ',' << b.size << ',' << b.requested;
  return o.str();
}

class Harness {
 public:
  explicit Harness(Reader& in) : in_(in) {
    std::uint8_t b0 = in.u8(), b1 = in.u8(), b2 = in.u8();
    kind_ = (b0 & 1) ? UpstreamKind::kSegments : UpstreamKind::kPages;
    release_ = (b0 & 2) ? ReleasePolicy::kLazy : ReleasePolicy::kHighWater;
    static const std::size_t kPageSizes[4] = {2 * MiB, 64 * KiB, 4 * KiB, 2 * MiB};
    page_ = kPageSizes[(b0 >> 2) & 3];
    capacity_ = round_up((2 + b1 % 127) * MiB, page_);
    if (page_ < 64 * KiB) capacity_ = std::min(capacity_, 8 * MiB);  // keeps validate()'s page walk fast
    cap_ = b2 == 0 ? 0 : std::max(page_, round_up(capacity_ * b2 / 128, page_));
    sim_ = std::make_shared<SimulatedDevice>(kind_, capacity_, page_);
    dev_ = std::make_shared<CheckedDevice>(sim_);
    dev_->live = &live_;
    dev_->pending = &pending_;
    if (b0 & 16) dev_->set_auto_complete(false);
    PoolOptions o;
    o.cap_bytes = cap_;
    o.release = release_;
    o.large_page_bytes = page_;  // the OOM-justification model counts pages of one size
    pool_ = std::make_unique<Pool>(dev_, o);
    pool_->add_oom_callback([this] { on_oom(); });
    describe("setup kind=%s release=%s page=%zu capacity=%zu cap=%zu auto_complete=%d",
             kind_ == UpstreamKind::kPages ? "pages" : "segments",
             release_ == ReleasePolicy::kLazy ? "lazy" : "high_water", page_, capacity_, cap_,
             int(dev_->auto_complete()));
    check_state();
  }

  void run() {
    std::size_t ops = 0;
    while (!in_.empty() && ops < 4000) {
      ++ops;
      ++ops_;
      step();
      check_state();
    }
    finish();
  }

 private:
  __attribute__((format(printf, 2, 3))) void describe(const char* fmt, ...) {
    char buf[256];
    va_list args;
    va_start(args, fmt);
    std::vsnprintf(buf, sizeof buf, fmt, args);
    va_end(args);
    g_context = buf;
    if (verbose()) std::fprintf(stderr, "%s\n", buf);
  }

  std::size_t effective_cap() const { return std::min(cap_ ? cap_ : capacity_, limit_); }
  std::size_t limit() const { return std::min(effective_cap(), capacity_); }

  std::size_t pick_size() {
    std::uint8_t c = in_.u8();
    switch (c % 10) {
      case 0: return 1 + in_.u16() % 1024;
      case 1: return 1 + std::size_t(in_.u16()) * 16;  // up to 1 MiB
      case 2: {
        const std::size_t edges[] = {kSmallLimit, kSmallLimit + 1, page_, page_ - 1, page_ + 1, kMidLimit,
                                     kMidLimit + 1, 512, 511, 513, kSmallLimit - 511, 2 * page_ + 512};
        return edges[in_.u8() % (sizeof edges / sizeof edges[0])];
      }
      case 3: return 1 + std::size_t(in_.u16()) * 256;  // up to 16 MiB
      case 4: {
        std::size_t pages = 1 + in_.u8() % 8;
        std::size_t extra = in_.u8() % 3 == 0 ? 0 : in_.u16() % page_;
        return pages * page_ + extra;
      }
      case 5: return 1 + std::size_t(in_.u8()) * (capacity_ / 64);  // up to 4x the device
      case 6: return 0;
      case 7: {
        std::uint8_t k = in_.u8() % 4;
        return k == 0 ? kMaxRequest : k == 1 ? kMaxRequest + 1 : k == 2 ? SIZE_MAX : SIZE_MAX / 2;
      }
      default: return 1 + in_.u32() % (4 * MiB);
    }
  }

  void step() {
    std::uint8_t op = in_.u8();
    switch (op % 22) {
      case 0: case 1: case 2: case 3: case 4: case 5: {
        std::size_t bytes = pick_size();
        StreamId s = kStreams[in_.u8() % 4];
        do_allocate(bytes, s);
        break;
      }
      case 6: case 7: case 8: case 9:
        if (!live_.empty()) do_free(nth_live(in_.u16()));
        break;
      case 10: do_bad_call(); break;
      case 11:
        if (!live_.empty()) {
          std::uintptr_t a = nth_live(in_.u16());
          StreamId s = kStreams[in_.u8() % 4];
          describe("record_stream(0x%" PRIxPTR ", %" PRIuPTR ")", a, s);
          pool_->record_stream(a, s);
          Live& l = live_info_[a];
          if (s != l.stream && std::find(l.extra.begin(), l.extra.end(), s) == l.extra.end())
            l.extra.push_back(s);
        }
        break;
      case 12: {
        std::uint8_t k = in_.u8();
        if (k % 5 == 4) {
          describe("complete_all()");
          dev_->complete_all();
        } else {
          describe("complete(%" PRIuPTR ")", kStreams[k % 4]);
          dev_->complete(kStreams[k % 4]);
        }
        break;
      }
      case 13: do_process_events(); break;
      case 14: do_trim(); break;
      case 15: do_set_cap(); break;
      case 16: {
        std::uint8_t a = in_.u8(), b = in_.u8();
        FaultPlan plan;
        plan.fail_every = a % 4 == 0 ? 0 : 1 + (a >> 2) % 7;
        plan.fail_probability = (b & 3) == 0 ? 0.0 : (b & 3) * 0.15;
        plan.fail_unmap = (b & 0x1c) == 0x1c;
        plan.seed = b >> 5;
        if (a & 0x80) plan = FaultPlan{};  // often: faults off again
        describe("set_fault_plan(every=%" PRIu64 ", p=%.2f, unmap=%d)", plan.fail_every, plan.fail_probability,
                 int(plan.fail_unmap));
        sim_->set_fault_plan(plan);
        fail_unmap_ = plan.fail_unmap;
        break;
      }
      case 17:
        describe("set_auto_complete(%d)", int(!dev_->auto_complete()));
        dev_->set_auto_complete(!dev_->auto_complete());
        break;
      case 18:
        oom_frees_ = in_.u8() % 4;
        describe("arm OOM callback to free %zu allocations", oom_frees_);
        break;
      case 19: {
        std::uint8_t k = in_.u8();
        if (k & 1) {
          describe("reset_peak_stats()");
          pool_->reset_peak_stats();
        } else if (k & 2) {
          describe("reset_accumulated_stats()");
          pool_->reset_accumulated_stats();
        } else {
          describe("free half of the live allocations");
          std::vector<std::uintptr_t> all;
          for (auto& [a, n] : live_) all.push_back(a);
          for (std::size_t i = 0; i < all.size(); i += 2) do_free(all[i]);
        }
        break;
      }
      case 20: do_allocate_at(); break;
      case 21: do_set_limit(); break;
    }
  }

  std::uintptr_t nth_live(std::size_t i) {
    auto it = live_.begin();
    std::advance(it, i % live_.size());
    return it->first;
  }

  void do_allocate(std::size_t bytes, StreamId s) {
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

  void check_oom(const OutOfMemoryError& e, std::size_t bytes, std::size_t rounded, StreamId s,
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
      std::size_t need = dev_->missing_pages(best, rounded) * page_;
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
  std::vector<BlockInfo> paged_blocks(const std::vector<RegionInfo>& snap, StreamId s, bool small) const {
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

  void do_free(std::uintptr_t a) {
    describe("free(0x%" PRIxPTR ")", a);
    Live l = live_info_.at(a);
    dev_->recorded_.clear();
    if (ops_ % 2) {
      REQUIRE(pool_->try_free(a), "try_free of a live allocation returned false");
    } else {
      pool_->free(a);
    }
    live_.erase(a);
    live_info_.erase(a);
    freed_.push_back(a);
    if (freed_.size() > 16) freed_.erase(freed_.begin());
    freed_sizes_.emplace_back(a, l.requested);
    if (freed_sizes_.size() > 16) freed_sizes_.erase(freed_sizes_.begin());
    dev_->freed_on(a, l.rounded, l.stream);
    REQUIRE(dev_->recorded_.size() == l.extra.size(),
            "free recorded " << dev_->recorded_.size() << " events for " << l.extra.size() << " extra streams");
    if (!l.extra.empty()) pending_.push_back(PendingModel{a, l.rounded, dev_->recorded_});
    ++frees_;
  }

  // A free / record_stream / set_cap the pool must refuse, leaving everything as it was.
  void do_bad_call() {
    std::uint8_t k = in_.u8();
    std::uintptr_t bad;
    switch (k % 4) {
      case 0: bad = freed_.empty() ? 0x1000 : freed_[in_.u8() % freed_.size()]; break;  // double free
      case 1: bad = live_.empty() ? 0x7f0000000200 : nth_live(in_.u8()) + 512; break;   // interior
      case 2: bad = 0x7f0000000000 + std::uintptr_t(in_.u32()) * 512; break;             // foreign
      default: bad = std::uintptr_t(in_.u32()) | 1; break;                              // misaligned
    }
    if (live_.count(bad) || bad == 0) return;
    // A pending block (freed, waiting for events) is not live either: freeing it again is a double free.
    const std::string before = fingerprint(*pool_);
    bool threw = false;
    if (k & 4) {
      std::uint8_t c = in_.u8();
      std::size_t active = pool_->stats().active_bytes[kAggregate].current;
      std::size_t cap = c & 1 ? page_ - 512 : active - (active ? 512 : 0);
      if (cap == 0 || (cap >= active && cap >= page_)) return;  // would be accepted
      describe("set_cap(%zu) below active %zu or a page", cap, active);
      try {
        pool_->set_cap(cap);
      } catch (const InvalidArgument&) {
        threw = true;
      }
      REQUIRE(threw, "set_cap below live bytes / one page was accepted");
      REQUIRE(pool_->cap() == cap_, "rejected set_cap changed the cap");
    } else if (k & 8) {
      describe("record_stream(bad 0x%" PRIxPTR ")", bad);
      try {
        pool_->record_stream(bad, kStreams[k % 4]);
      } catch (const InvalidArgument&) {
        threw = true;
      }
      REQUIRE(threw, "record_stream of a pointer not live was accepted");
    } else if (k & 16) {
      describe("try_free(bad 0x%" PRIxPTR ")", bad);
      REQUIRE(!pool_->try_free(bad), "try_free of a pointer not live returned true");
      threw = true;
    } else {
      describe("free(bad 0x%" PRIxPTR ")", bad);
      try {
        pool_->free(bad);
      } catch (const InvalidArgument& e) {
        threw = true;
        REQUIRE(std::string(e.what()).find("nothing was changed") != std::string::npos, "message: " << e.what());
      }
      REQUIRE(threw, "free of a pointer not live was accepted");
    }
    REQUIRE(fingerprint(*pool_) == before, "a rejected call changed the pool");
  }

  // allocate_at at a recently freed address (its size or another), inside a free block of the
  // snapshot, at a random address in a region, or at a foreign one; the model says whether the range
  // is free.
  void do_allocate_at() {
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
    for (auto& p : pending_) {
      bool done = true;
      for (auto& t : p.tickets) done &= dev_->done(t);
      recyclable |= done;
      if (!done && free && overlaps(address, rounded, p.address, p.size)) free = false;
    }

    const DeviceStats before = pool_->stats();
    const std::string all_before = fingerprint(*pool_), full_before = fingerprint(*pool_, false);
    const std::string live_before = live_fingerprint(*pool_);
    const std::uint64_t faults_before = sim_->faults_injected();
    std::uintptr_t a = 0;
    try {
      a = pool_->allocate_at(address, bytes);
    } catch (const InvalidArgument& e) {
      if (verbose()) std::fprintf(stderr, "  -> InvalidArgument: %s\n", e.what());
      REQUIRE(!free, "allocate_at refused a range the model says is free: " << e.what());
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
        const std::size_t need = dev_->missing_pages(address, rounded) * page_;
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

  void do_set_limit() {
    std::uint8_t c = in_.u8();
    const std::size_t reserved = pool_->stats().reserved_bytes[kAggregate].current;
    std::size_t limit = c % 4 == 0   ? 0
                        : c % 4 == 1 ? Pool::kNoLimit
                        : c % 4 == 2 ? reserved / 32 * (c >> 2) / 2  // around what is reserved
                                     : capacity_ * (c >> 2) / 64;
    describe("set_limit(%zu)", limit);
    try {
      pool_->set_limit(limit);
    } catch (const UpstreamError&) {
      REQUIRE(fail_unmap_, "set_limit threw UpstreamError without an injected failure");
      ++upstream_errors_;
    }
    limit_ = limit;
    REQUIRE(pool_->limit() == limit, "limit not set");
    REQUIRE(pool_->cap() == cap_, "set_limit changed the cap");
    REQUIRE(pool_->effective_cap() == std::min(cap_ ? cap_ : capacity_, limit), "effective cap wrong");
    REQUIRE(std::size_t(pool_->stats().reserved_bytes[kAggregate].current) <= reserved, "set_limit reserved more");
  }

  void do_process_events() {
    describe("process_events()");
    pool_->process_events();
    // Every pending block whose events are done is back in its arena now.
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                  [&](const PendingModel& p) {
                                    for (auto& t : p.tickets)
                                      if (!dev_->done(t)) return false;
                                    return true;
                                  }),
                   pending_.end());
    DeviceStats st = pool_->stats();
    std::size_t waiting = 0;
    for (auto& p : pending_) waiting += p.size;
    REQUIRE(std::size_t(st.active_bytes[kAggregate].current - st.allocated_bytes[kAggregate].current) == waiting,
            "after process_events, pending bytes " << st.active_bytes[kAggregate].current -
                                                          st.allocated_bytes[kAggregate].current
                                                   << " != model " << waiting);
  }

  void do_trim() {
    describe("trim()");
    std::size_t before = pool_->stats().reserved_bytes[kAggregate].current;
    std::size_t released;
    try {
      released = pool_->trim();
    } catch (const UpstreamError&) {
      REQUIRE(fail_unmap_, "trim threw UpstreamError without an injected failure");
      ++upstream_errors_;
      return;
    }
    std::size_t after = pool_->stats().reserved_bytes[kAggregate].current;
    REQUIRE(before - after == released, "trim says " << released << " released, reserved went " << before
                                                     << " -> " << after);
  }

  void do_set_cap() {
    std::uint8_t c = in_.u8();
    std::size_t active = pool_->stats().active_bytes[kAggregate].current;
    std::size_t cap = c == 0 ? 0 : std::max<std::size_t>({page_, active, round_up(capacity_ * c / 128, 512)});
    describe("set_cap(%zu)", cap);
    try {
      pool_->set_cap(cap);
    } catch (const UpstreamError&) {
      REQUIRE(fail_unmap_, "set_cap threw UpstreamError without an injected failure");
      ++upstream_errors_;
    }
    cap_ = cap;
    REQUIRE(pool_->cap() == cap, "cap not set");
  }

  // The OOM callback frees some allocations, as gc.collect() would.
  void on_oom() {
    ++callbacks_;
    for (; oom_frees_ > 0 && !live_.empty(); --oom_frees_) do_free(live_.rbegin()->first);
  }

  void check_state() {
    try {
      pool_->validate();
    } catch (const InvariantViolation& e) {
      fail(e.what());
    }
    DeviceStats st = pool_->stats();
    std::int64_t allocated = 0, requested = 0;
    for (auto& [a, l] : live_info_) allocated += l.rounded, requested += l.requested;
    REQUIRE(st.allocation[kAggregate].current == std::int64_t(live_.size()),
            "allocation count " << st.allocation[kAggregate].current << " != model " << live_.size());
    REQUIRE(st.allocated_bytes[kAggregate].current == allocated,
            "allocated_bytes " << st.allocated_bytes[kAggregate].current << " != model " << allocated);
    REQUIRE(st.requested_bytes[kAggregate].current == requested,
            "requested_bytes " << st.requested_bytes[kAggregate].current << " != model " << requested);
    const std::int64_t active = st.active_bytes[kAggregate].current;
    const std::int64_t reserved = st.reserved_bytes[kAggregate].current;
    std::int64_t pending_all = 0, pending_waiting = 0;
    for (auto& p : pending_) {
      pending_all += p.size;
      bool waiting = false;
      for (auto& t : p.tickets) waiting |= !dev_->done(t);
      if (waiting) pending_waiting += p.size;
    }
    REQUIRE(active - allocated <= pending_all && active - allocated >= pending_waiting,
            "pending bytes " << active - allocated << " outside the model's [" << pending_waiting << ", "
                             << pending_all << "]");
    REQUIRE(std::int64_t(sim_->used_bytes()) == reserved,
            "device hands out " << sim_->used_bytes() << " bytes, pool reserved " << reserved);
    REQUIRE(reserved >= active, "reserved below active");
    std::size_t lfb = pool_->largest_free_block();
    REQUIRE(std::int64_t(lfb) <= reserved - active, "largest free block " << lfb << " > reserved - active");
    REQUIRE(st.inactive_split_bytes[kAggregate].current <= reserved - active, "inactive split bytes too large");
    if (kind_ == UpstreamKind::kSegments)
      REQUIRE(lfb % 512 == 0, "largest free block not a multiple of 512");
  }

  // Everything freed, events done, cache trimmed: the device must be empty again.
  void finish() {
    describe("finish: faults off, free all, complete_all, process_events, trim");
    sim_->set_fault_plan(FaultPlan{});
    fail_unmap_ = false;
    std::vector<std::uintptr_t> all;
    for (auto& [a, n] : live_) all.push_back(a);
    for (std::uintptr_t a : all) do_free(a);
    dev_->complete_all();
    do_process_events();
    pool_->trim();
    check_state();
    DeviceStats st = pool_->stats();
    REQUIRE(st.active_bytes[kAggregate].current == 0, "active bytes left after freeing everything");
    REQUIRE(st.reserved_bytes[kAggregate].current == 0,
            "reserved " << st.reserved_bytes[kAggregate].current << " after free all + trim");
    REQUIRE(sim_->used_bytes() == 0, "device still hands out " << sim_->used_bytes() << " bytes");
    pool_.reset();
    REQUIRE(sim_->used_bytes() == 0, "device not empty after the pool is destroyed");
    if (verbose())
      std::fprintf(stderr, "done: %zu allocations, %zu frees, %zu OOMs, %zu callbacks, %zu upstream errors, %" PRIu64
                           " faults\n",
                   allocations_, frees_, ooms_, callbacks_, upstream_errors_, sim_->faults_injected());
  }

 public:
  std::size_t ops_ = 0, allocations_ = 0, frees_ = 0, ooms_ = 0, callbacks_ = 0, upstream_errors_ = 0;
  std::shared_ptr<SimulatedDevice> sim_;

 private:
  Reader& in_;
  UpstreamKind kind_;
  ReleasePolicy release_;
  std::size_t page_, capacity_, cap_;
  std::shared_ptr<CheckedDevice> dev_;
  std::unique_ptr<Pool> pool_;
  std::map<std::uintptr_t, std::size_t> live_;  // address -> rounded size, ordered for overlap checks
  std::map<std::uintptr_t, Live> live_info_;
  std::vector<PendingModel> pending_;
  std::vector<std::uintptr_t> freed_;
  std::vector<std::pair<std::uintptr_t, std::size_t>> freed_sizes_;  // (address, requested), last 16 frees
  std::size_t limit_ = Pool::kNoLimit;
  std::size_t oom_frees_ = 0;
  bool fail_unmap_ = false;
};

}  // namespace

// Totals across inputs, for the replay driver's summary line.
extern "C" {
std::uint64_t gpumem_fuzz_ops = 0, gpumem_fuzz_faults = 0, gpumem_fuzz_ooms = 0;
}

namespace {
// With GPUMEM_FUZZ_STATS=1 the totals are printed at exit (libFuzzer exits through exit()).
struct PrintTotals {
  ~PrintTotals() {
    if (std::getenv("GPUMEM_FUZZ_STATS"))
      std::fprintf(stderr, "gpumem fuzz totals: %" PRIu64 " operations, %" PRIu64 " faults injected, %" PRIu64
                           " OOMs, 0 invariant failures\n",
                   gpumem_fuzz_ops, gpumem_fuzz_faults, gpumem_fuzz_ooms);
  }
} print_totals;
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Reader in{data, size};
  try {
    Harness h(in);
    h.run();
    gpumem_fuzz_ops += h.ops_;
    gpumem_fuzz_faults += h.sim_->faults_injected();
    gpumem_fuzz_ooms += h.ooms_;
  } catch (const std::exception& e) {
    fail(std::string("unexpected exception: ") + e.what());
  }
  return 0;
}
