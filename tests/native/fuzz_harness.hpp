// The fuzz harness (fuzz_pool.cpp says what it checks): one input decoded into pool operations, each
// run against the pool and the reference model (fuzz_model.hpp). Allocation and allocate_at, with
// their out-of-memory justification, are in fuzz_allocate.cpp; the rest is here.
#pragma once

#include "fuzz_model.hpp"

namespace gpumem_fuzz {

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
    // With the stitch bit (bit 6) an odd b2 sets no cap either: the pool stitches only while no cap
    // or limit bounds it (Pool::stitching), and do_set_limit bounds it midway.
    cap_ = b2 == 0 || ((b0 & 64) && b2 % 2) ? 0 : std::max(page_, round_up(capacity_ * b2 / 128, page_));
    sim_ = std::make_shared<SimulatedDevice>(kind_, capacity_, page_);
    dev_ = std::make_shared<CheckedDevice>(sim_);
    dev_->live = &live_;
    dev_->pending = &pending_;
    if (b0 & 16) dev_->set_auto_complete(false);
    // Bit 7: a device running behind the host, as the replays model a GPU (events complete 1-61
    // operations after they were recorded, or when waited for: a wait inside an allocation can
    // complete marks mid-way, which explicit complete() operations never do).
    if (b0 & 128) {
      dev_->set_auto_complete(false);
      dev_->set_lag(1 + b2 % 61);
    }
    PoolOptions o;
    o.cap_bytes = cap_;
    o.release = release_;
    // Bit 5: large arenas map groups of four pages while they fit, single pages near the cap (the
    // default's 8 MiB on 2 MiB). The OOM-justification model still counts single pages: the pool
    // maps no more than the pages a block touches when whole groups would not fit.
    o.large_page_bytes = (b0 & 32) ? 4 * page_ : page_;
    o.stitch = (b0 & 64) != 0;  // Bit 6: free units stitched under new blocks, parked positions (pool_alias.cpp)
    // b1's top bit (capacity takes b1 % 127): under a bound that is not roomy, a block's end groups
    // mapped page by page (option ends_by_page, pool_map.cpp)
    o.ends_by_page = (b1 & 128) != 0;
    // (b1 + b2) % 3: the blocks mapped while the live high water is below 10% of the bound (the
    // default), none, or below half of it map their end groups page by page (early_ends_by_page)
    static const double kEarly[3] = {0.1, 0.0, 0.5};
    o.early_ends_by_page = kEarly[(b1 + b2) % 3];
    // b1's bit 6: under a roomy cap or limit, units lent while draining parked where they were
    // (option park_lent, pool_alias.cpp)
    o.park_lent = (b1 & 64) != 0;
    pool_ = std::make_unique<Pool>(dev_, o);
    pool_->add_oom_callback([this] { on_oom(); });
    dev_->spans = &spans_;
    pool_->set_segment_observer([this](SegmentEvent e, std::uintptr_t a, std::size_t n, StreamId) { on_span(e, a, n); });
    describe("setup kind=%s release=%s page=%zu large page=%zu capacity=%zu cap=%zu auto_complete=%d stitch=%d "
             "lag=%zu ends_by_page=%d early_ends_by_page=%.1f park_lent=%d",
             kind_ == UpstreamKind::kPages ? "pages" : "segments",
             release_ == ReleasePolicy::kLazy ? "lazy" : "high_water", page_, o.large_page_bytes,
             capacity_, cap_, int(dev_->auto_complete()), int(o.stitch), std::size_t(dev_->lag()),
             int(o.ends_by_page), o.early_ends_by_page, int(o.park_lent));
    check_state();
  }

  void run() {
    std::size_t ops = 0;
    while (!in_.empty() && ops < 4000) {
      ++ops;
      ++ops_;
      if (dev_->lag()) {
        dev_->advance();
        dev_->catch_up();
      }
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
        } else if (k & 0x80) {  // one event at a time: released pages drain later than recorded
          describe("complete_one(%" PRIuPTR ")", kStreams[k % 4]);
          dev_->complete_one(kStreams[k % 4]);
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

  // Allocation and its checks (fuzz_allocate.cpp).
  void do_allocate(std::size_t bytes, StreamId s);
  void check_oom(const OutOfMemoryError& e, std::size_t bytes, std::size_t rounded, StreamId s,
                 const DeviceStats& before, bool faulted);
  std::vector<BlockInfo> paged_blocks(const std::vector<RegionInfo>& snap, StreamId s, bool small) const;
  void do_allocate_at();


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
    // Draining pages are free mapped memory, and with every stream done none is left draining.
    const std::size_t draining = pool_->draining_bytes();
    REQUIRE(draining <= std::size_t(st.reserved_bytes[kAggregate].current - st.active_bytes[kAggregate].current),
            "draining bytes " << draining << " exceed reserved - active");
    if (dev_->all_done()) REQUIRE(draining == 0, "every stream is done but " << draining << " bytes still drain");
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
    REQUIRE(pool_->draining_bytes() == 0 || fail_unmap_, "trim returned with pages still draining");
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

  // The observer runs inside the pool (which ignores its exceptions): a broken rule is kept for
  // check_state to report.
  void on_span(SegmentEvent e, std::uintptr_t a, std::size_t n) {
    if (e == SegmentEvent::kSpanAdded) {
      auto next = spans_.lower_bound(a);
      bool overlap = next != spans_.end() && next->first < a + n;
      if (next != spans_.begin()) overlap |= overlaps(a, n, std::prev(next)->first, std::prev(next)->second);
      if (overlap && span_error_.empty()) span_error_ = "a span added over a live one";
      spans_[a] = n;
    } else if (e == SegmentEvent::kSpanRemoved) {
      auto it = spans_.find(a);
      if ((it == spans_.end() || it->second != n) && span_error_.empty())
        span_error_ = "a span removed that was not added with those bytes";
      if (it != spans_.end()) spans_.erase(it);
    }
  }

  void check_state() {
    try {
      pool_->validate();
    } catch (const InvariantViolation& e) {
      fail(e.what());
    }
    REQUIRE(span_error_.empty(), span_error_);
    std::map<std::uintptr_t, std::size_t> shown;
    for (const RegionInfo& r : pool_->snapshot()) shown[r.address] = r.size;
    REQUIRE(shown == spans_, "the spans reported (" << spans_.size() << ") are not snapshot()'s regions ("
                                                     << shown.size() << ")");
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
    REQUIRE(spans_.empty() && span_error_.empty(), "spans left after the pool is destroyed");
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
  std::map<std::uintptr_t, std::size_t> spans_;  // declared before pool_: the pool's destructor reports
  std::string span_error_;
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

}  // namespace gpumem_fuzz
