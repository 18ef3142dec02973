// The time a pool spends in its upstream's calls, by kind: what a step pays the driver (mapping and
// unmapping pages, taking and returning segments) and the device (waiting for an event or a stream
// before memory goes back). Under memory pressure these are the allocator's whole extra cost, and
// which of them it is decides what to make cheaper: fewer driver calls, or fewer and shorter waits.
// A wrapper around any upstream, so neither the pool nor the CUDA upstream holds a clock; the torch
// bridge puts one around each of its pools' upstreams, all of a device adding to one UpstreamTime
// (gpumem.driver_time()).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <utility>

#include "upstream.hpp"

namespace gpumem {

// Calls and nanoseconds per kind of upstream call. Atomic: the pools of a device add to one from the
// threads that allocate, while another thread reads it.
struct UpstreamTime {
  enum Kind : int {
    kMap,      // map, map_from: physical memory created (or reused) and mapped, access set
    kUnmap,    // unmap: pages unmapped, their memory released (or kept for a map to come)
    kSegment,  // allocate_segment, free_segment (cudaMalloc-style upstreams)
    kWait,     // wait_event, synchronize: the host blocked until the device caught up
    kEvent,    // record_event, event_completed, destroy_event: marking and polling, never blocking
    kNumKinds
  };
  static constexpr const char* kNames[kNumKinds] = {"map", "unmap", "segment", "wait", "event"};

  struct Counter {
    std::atomic<std::uint64_t> calls{0};
    std::atomic<std::uint64_t> ns{0};
  };
  Counter counters[kNumKinds];

  void add(Kind kind, std::uint64_t ns, std::uint64_t calls = 1) {
    counters[kind].calls.fetch_add(calls, std::memory_order_relaxed);
    counters[kind].ns.fetch_add(ns, std::memory_order_relaxed);
  }
  std::uint64_t calls(Kind kind) const { return counters[kind].calls.load(std::memory_order_relaxed); }
  std::uint64_t ns(Kind kind) const { return counters[kind].ns.load(std::memory_order_relaxed); }
  void reset() {
    for (Counter& c : counters) {
      c.calls.store(0, std::memory_order_relaxed);
      c.ns.store(0, std::memory_order_relaxed);
    }
  }
};

class TimedUpstream final : public ForwardingUpstream {
 public:
  TimedUpstream(std::shared_ptr<Upstream> inner, std::shared_ptr<UpstreamTime> time)
      : ForwardingUpstream(std::move(inner)), time_(std::move(time)) {}

  std::uintptr_t allocate_segment(std::size_t bytes) override {
    return timed(UpstreamTime::kSegment, [&] { return inner().allocate_segment(bytes); });
  }
  void free_segment(std::uintptr_t address, std::size_t bytes) override {
    timed(UpstreamTime::kSegment, [&] { inner().free_segment(address, bytes); });
  }
  bool map(std::uintptr_t address, std::size_t bytes, std::size_t page) override {
    return timed(UpstreamTime::kMap, [&] { return inner().map(address, bytes, page); });
  }
  bool map_from(std::uintptr_t address, std::uintptr_t source, std::size_t bytes, std::size_t page) override {
    return timed(UpstreamTime::kMap, [&] { return inner().map_from(address, source, bytes, page); });
  }
  void unmap(std::uintptr_t address, std::size_t bytes, std::size_t page) override {
    timed(UpstreamTime::kUnmap, [&] { inner().unmap(address, bytes, page); });
  }
  // Turning keeping off releases the units still kept: the time of the unmaps that kept them (no call
  // of its own).
  void keep_released_units(bool on) override {
    timed(UpstreamTime::kUnmap, [&] { inner().keep_released_units(on); }, /*calls=*/0);
  }
  EventId record_event(StreamId stream) override {
    return timed(UpstreamTime::kEvent, [&] { return inner().record_event(stream); });
  }
  bool event_completed(EventId event) override {
    return timed(UpstreamTime::kEvent, [&] { return inner().event_completed(event); });
  }
  void destroy_event(EventId event) override {
    timed(UpstreamTime::kEvent, [&] { inner().destroy_event(event); });
  }
  void wait_event(EventId event) override {
    timed(UpstreamTime::kWait, [&] { inner().wait_event(event); });
  }
  void synchronize(StreamId stream) override {
    timed(UpstreamTime::kWait, [&] { inner().synchronize(stream); });
  }

 private:
  // Times `call` (also when it throws: a refused or failed call took the driver's time too).
  template <typename Call>
  auto timed(UpstreamTime::Kind kind, Call&& call, std::uint64_t calls = 1) -> decltype(call()) {
    using Clock = std::chrono::steady_clock;
    struct Stopwatch {
      UpstreamTime& time;
      UpstreamTime::Kind kind;
      std::uint64_t calls;
      Clock::time_point start = Clock::now();
      ~Stopwatch() {
        time.add(kind,
                 static_cast<std::uint64_t>(
                     std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count()),
                 calls);
      }
    } stopwatch{*time_, kind, calls};
    return call();
  }

  std::shared_ptr<UpstreamTime> time_;
};

}  // namespace gpumem
