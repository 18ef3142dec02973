// The fuzz harness's reference model and its instruments (fuzz_pool.cpp says what is checked): the
// input reader, the failure report (REQUIRE), CheckedDevice (an upstream that watches the pool: what
// is mapped, which events exist, which freed memory its stream may still use), the model's live and
// pending blocks, and fingerprints of what the pool shows.
#pragma once

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


namespace gpumem_fuzz {

using namespace gpumem;

inline bool verbose() {
  static const bool v = std::getenv("GPUMEM_FUZZ_VERBOSE") != nullptr;
  return v;
}

inline std::string g_context;  // the operation being checked, printed with a failure

[[noreturn]] inline void fail(const std::string& what) {
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

inline bool overlaps(std::uintptr_t a, std::size_t an, std::uintptr_t b, std::size_t bn) {
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
  // Memory mapped a second time while its stream may still use it at `source`: only for a block of
  // the same region (one region per stream's arena on a paged device), never from under a live one;
  // until that stream's work is done, the memory is in use at `address` as well.
  bool map_from(std::uintptr_t address, std::uintptr_t source, std::size_t bytes, std::size_t page) override {
    REQUIRE(region_of(address).second != 0 && region_of(address) == region_of(source),
            "map_from across regions: another stream may still use the memory");
    if (live) {
      auto it = live->lower_bound(source + bytes);
      if (it != live->begin()) {
        --it;
        REQUIRE(!overlaps(source, bytes, it->first, it->second), "map_from of memory under a live allocation");
      }
    }
    if (!sim_->map_from(address, source, bytes, page)) return false;
    for (std::size_t off = 0; off < bytes; off += page_size()) mapped_.insert(address + off);
    const std::size_t before = unsynced_.size();
    for (std::size_t i = 0; i < before; ++i)
      if (overlaps(source, bytes, unsynced_[i].address, unsynced_[i].size))
        unsynced_.push_back({address, bytes, unsynced_[i].stream, unsynced_[i].events_before});
    return true;
  }

  EventId record_event(StreamId stream) override {
    EventId e = sim_->record_event(stream);
    std::uint64_t ticket = ++queued_[stream];
    if (auto_complete_ && lag_ == 0) completed_[stream] = queued_[stream];  // as the device: a lag rules events
    events_[e] = {stream, ticket};
    recorded_.push_back({stream, ticket});
    return e;
  }
  bool event_completed(EventId event) override {
    bool done = sim_->event_completed(event);
    auto it = events_.find(event);
    REQUIRE(it != events_.end(), "pool queried an event it never recorded or already destroyed");
    std::uint64_t& completed = completed_[it->second.first];
    // A lagging device completes events by its clock too, in the order they were recorded: the model
    // learns of it when the pool does, here (the pool knows of no other completion to act on).
    if (lag_ && done) completed = std::max(completed, it->second.second);
    bool mine = completed >= it->second.second;
    REQUIRE(done == mine, "event completion disagrees with the model");
    return done;
  }
  void destroy_event(EventId event) override {
    REQUIRE(events_.erase(event) == 1, "pool destroyed an unknown event");
    sim_->destroy_event(event);
  }
  void wait_event(EventId event) override {
    auto it = events_.find(event);
    REQUIRE(it != events_.end(), "pool waited for an event it never recorded or already destroyed");
    sim_->wait_event(event);
    auto& done_to = completed_[it->second.first];
    done_to = std::max(done_to, it->second.second);
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
  // A device running `steps` host steps behind (SimulatedDevice::set_lag, as the replays model a GPU):
  // the harness advances its clock once per operation; events complete by it, or when waited for.
  void set_lag(std::uint64_t steps) {
    lag_ = steps;
    sim_->set_lag(steps);
  }
  std::uint64_t lag() const { return lag_; }
  void advance() { sim_->advance(); }
  // With a lag, what the device's clock has completed by now, learned as the pool learns it when it
  // asks (a verdict of the model made before a call must count it: the pool asks during the call).
  void catch_up() {
    if (!lag_) return;
    for (auto& [event, ticket] : events_)
      if (sim_->event_completed(event)) completed_[ticket.first] = std::max(completed_[ticket.first], ticket.second);
  }
  void complete(StreamId s) {
    sim_->complete(s);
    mark_complete(s);
  }
  void complete_one(StreamId s) {
    sim_->complete_one(s);
    auto& c = completed_[s];
    if (c < queued_[s]) ++c;
  }
  void complete_all() {
    sim_->complete_all();
    for (auto& [s, q] : queued_) completed_[s] = q;
    unsynced_.clear();
  }
  bool done(const std::pair<StreamId, std::uint64_t>& t) { return completed_[t.first] >= t.second; }
  bool all_done() {
    for (auto& [s, q] : queued_)
      if (completed_[s] < q) return false;
    return true;
  }

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
  // The pages of [a, a + n) a block there needs memory for, as far as the model can tell: those not
  // mapped, and those mapped to memory that is mapped elsewhere too (a stitched unit's parked old
  // position, map_from): the memory may belong to a live block there, and then the position needs
  // memory of its own. Counted whoever owns the other position, so the out-of-memory justification
  // stays sound (it may accept an OOM a free owner would have avoided; it never flags a true one).
  // The simulated device says how many addresses a page's memory is mapped at.
  std::size_t pages_needing_memory(std::uintptr_t a, std::size_t n) const {
    std::size_t ps = page_size(), need = 0;
    for (std::uintptr_t p = a / ps * ps; p < a + n; p += ps)
      need += !mapped_.count(p) || sim_->mappings_at(p) > 1;
    return need;
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

  // A block the model freed on its own stream: the memory may be used there until a synchronisation,
  // or until an event recorded on that stream after the free has completed.
  void freed_on(std::uintptr_t a, std::size_t n, StreamId s) { unsynced_.push_back({a, n, s, queued_[s]}); }

  // What the harness must not see released: live allocations and blocks waiting for events.
  const std::map<std::uintptr_t, std::size_t>* live = nullptr;
  // The spans the pool's observer reported (SegmentEvent::kSpanAdded minus kSpanRemoved): memory
  // under one must not go back (NCCL would still have it registered).
  const std::map<std::uintptr_t, std::size_t>* spans = nullptr;
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
    if (spans) {
      auto it = spans->lower_bound(a + n);
      if (it != spans->begin()) {
        --it;
        REQUIRE(!overlaps(a, n, it->first, it->second),
                what << " returns memory of the span at 0x" << std::hex << it->first << " before its removal");
      }
    }
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
      REQUIRE(!overlaps(a, n, u.address, u.size) || completed_[u.stream] > u.events_before,
              what << " returns memory freed on stream " << u.stream
                   << " before that stream's work queued so far has completed");
  }

  struct Unsynced {
    std::uintptr_t address;
    std::size_t size;
    StreamId stream;
    std::uint64_t events_before;  // events recorded on the stream before the free
  };
  std::vector<Unsynced> unsynced_;
  std::set<std::uintptr_t> mapped_;                 // page addresses
  std::map<std::uintptr_t, std::size_t> segments_;  // address -> bytes
  std::map<std::uintptr_t, std::size_t> range_bytes_;  // reserved address ranges: base -> bytes
  std::unordered_map<StreamId, std::uint64_t> queued_, completed_;
  std::unordered_map<EventId, std::pair<StreamId, std::uint64_t>> events_;
  bool auto_complete_ = true;
  std::uint64_t lag_ = 0;
};

struct Live {
  std::size_t requested;
  std::size_t rounded;
  StreamId stream;
  std::vector<StreamId> extra;  // streams recorded with record_stream (not the block's own)
};

inline constexpr StreamId kStreams[4] = {0, 1, 7, 0xdead0000};

// The pool's observable state, to prove that a rejected call changed nothing. Without `counters`, the
// OOM / retry / upstream call counts are left out.
inline std::string fingerprint(const Pool& pool, bool counters = true) {
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
inline std::string live_fingerprint(const Pool& pool) {
  DeviceStats s = pool.stats();
  std::ostringstream o;
  for (const StatArray* a : {&s.allocation, &s.allocated_bytes, &s.requested_bytes})
    for (const Stat& x : *a) o << x.current << ',' << x.peak << ',' << x.allocated << ',' << x.freed << ';';
  for (const RegionInfo& r : pool.snapshot())
    for (const BlockInfo& b : r.blocks)
      if (b.state == BlockInfo::kAllocated) o << ' ' << b.address << ',' << b.size << ',' << b.requested;
  return o.str();
}

}  // namespace gpumem_fuzz
