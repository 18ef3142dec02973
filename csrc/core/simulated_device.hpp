// A device that exists only in host memory: fake addresses, a capacity, a page size, and streams whose
// work completes when the test says so. It lets every pool behaviour run and be checked without a GPU,
// and it checks the pool in return (double maps, unmapping what was never mapped, foreign frees).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <unordered_map>
#include <vector>

#include "upstream.hpp"

namespace gpumem {

// Failures to inject into the memory calls (allocate_segment, map), for fault-injection tests.
struct FaultPlan {
  std::uint64_t fail_every = 0;      // fail every Nth memory call (0 = never)
  double fail_probability = 0.0;     // fail each memory call with this probability
  bool fail_unmap = false;           // unmap / free_segment throw UpstreamError instead of releasing
  std::uint64_t seed = 1;
  bool fail_free_query = false;      // device_free_bytes throws UpstreamError (cuMemGetInfo failing)
};

class SimulatedDevice : public Upstream {
 public:
  SimulatedDevice(UpstreamKind kind, std::size_t capacity, std::size_t page_size = 2 * MiB);

  UpstreamKind kind() const override { return kind_; }
  std::string name() const override;
  std::size_t page_size() const override { return page_size_; }
  std::size_t device_total_bytes() const override { return capacity_; }
  std::size_t device_free_bytes() const override;

  std::uintptr_t allocate_segment(std::size_t bytes) override;
  void free_segment(std::uintptr_t address, std::size_t bytes) override;
  std::uintptr_t reserve_address_range(std::size_t bytes) override;
  void release_address_range(std::uintptr_t address, std::size_t bytes) override;
  bool map(std::uintptr_t address, std::size_t bytes, std::size_t page) override;
  void unmap(std::uintptr_t address, std::size_t bytes, std::size_t page) override;
  void keep_released_units(bool on) override;
  bool map_from(std::uintptr_t address, std::uintptr_t source, std::size_t bytes, std::size_t page) override;

  EventId record_event(StreamId stream) override;
  bool event_completed(EventId event) override;
  void destroy_event(EventId event) override;
  // Completes the event's stream up to the event (later work stays queued): a device that runs behind.
  void wait_event(EventId event) override;
  void synchronize(StreamId stream) override;

  // Test controls. With auto_complete (the default) every stream's work is done as soon as it is
  // queued; without it, work on a stream completes only at complete() / complete_all().
  void set_auto_complete(bool on) { auto_complete_ = on; }
  // A device running behind the host, for replays: with a lag of N (> 0), an event completes once the
  // host has taken N more steps (advance()) since it was recorded, or once the host waited for it;
  // auto_complete no longer applies to events. While the host waits, the device runs on: within that
  // host step, a wait of k steps brings every later event k steps closer. An event seen completed
  // (event_completed) stays completed, with its stream's work before it. 0 (the default) turns the
  // lag off.
  void set_lag(std::uint64_t steps) { lag_ = steps; }
  std::uint64_t lag() const { return lag_; }
  void advance() { ++clock_; }  // one host step (a replay: one allocation or free)
  // Times the host had to wait for work not yet done (wait_event on an event not yet complete,
  // synchronize with work outstanding): with a lag, each is a stall a real GPU run would pay. And the
  // host steps those waits stood for: per wait, the steps the device still needed to reach the event
  // (its recording plus the lag, less the clock), the length of the stall in the lag's units.
  std::uint64_t waits() const { return waits_; }
  std::uint64_t waited_steps() const { return waited_steps_; }
  void complete(StreamId stream);
  // Completes the work of `stream` up to its oldest event not yet done (events complete one by one,
  // later than they were recorded, as on a device running behind the host).
  void complete_one(StreamId stream);
  void complete_all();
  void set_fault_plan(const FaultPlan& plan);
  std::uint64_t faults_injected() const { return faults_injected_; }
  std::size_t used_bytes() const { return used_; }
  // Bytes of the capacity held outside this upstream (another process, a library's own cudaMalloc):
  // its maps and segments get only what is left. Set at any time; memory already mapped stays.
  void set_held_elsewhere(std::size_t bytes) { elsewhere_ = bytes; }
  std::size_t held_elsewhere() const { return elsewhere_; }
  std::uint64_t memory_calls() const { return memory_calls_; }
  // Physical allocations made and released so far (a map of n units counts n, a segment 1): what a
  // real driver pays for per unit, whatever its size (cuMemCreate + cuMemMap + cuMemSetAccess, then
  // cuMemUnmap + cuMemRelease: about 60 us per unit of 2-20 MiB on an H100, README).
  // A unit kept by keep_released_units and mapped again counts as neither.
  std::uint64_t physical_allocations() const { return physical_allocations_; }
  std::uint64_t physical_releases() const { return physical_releases_; }
  std::uint64_t kept_units() const;  // units unmapped and kept, not yet mapped again or released
  // Units mapped (new, kept or map_from()'s alike) and unmapped so far: with the allocations and
  // releases, every per-unit driver call a CUDA run makes (cuMemMap + cuMemSetAccess, cuMemUnmap).
  std::uint64_t unit_maps() const { return unit_maps_; }
  std::uint64_t unit_unmaps() const { return unit_unmaps_; }
  // Units map_from() mapped a second time (no new memory), and those now mapped at two addresses.
  std::uint64_t aliased_units() const { return aliased_units_; }
  std::size_t units_mapped_twice() const;
  // Which physical allocation backs the mapped page holding `address`, and the page's offset in it:
  // the same number for every address mapped onto one (map_from), 0 where nothing is mapped. For
  // tests: live blocks must never see one unit's same offset at two addresses.
  std::pair<std::uint64_t, std::size_t> physical_unit_at(std::uintptr_t address) const;
  // How many addresses the memory of the page holding `address` is mapped at: 0 where nothing is
  // mapped, 1 for a unit mapped once, more while map_from() has it mapped elsewhere too.
  std::size_t mappings_at(std::uintptr_t address) const;

 private:
  bool inject_fault();
  struct Range;
  Range& range_of(std::uintptr_t address, std::size_t bytes, std::size_t* first);
  // Throws unless [first, end) of `mapped` is made of whole physical allocations of `unit` pages.
  static void check_whole_units(const std::vector<std::uint16_t>& mapped, std::size_t first, std::size_t end,
                                std::size_t unit, const char* what);
  // The first address of the mapped unit holding `address` and the page's offset in it; false where
  // nothing is mapped.
  bool mapped_unit_at(std::uintptr_t address, std::uintptr_t* start, std::size_t* offset) const;

  UpstreamKind kind_;
  std::size_t capacity_;
  std::size_t page_size_;
  std::size_t used_ = 0;
  std::size_t elsewhere_ = 0;  // set_held_elsewhere
  std::uintptr_t next_address_;  // fake, never dereferenced; distinct across simulated devices
  std::map<std::uintptr_t, std::size_t> segments_;
  // Per page of a range: 0 unmapped; the first page of a physical allocation (the `page` of map)
  // holds its length in pages, the others kMember. unmap must name whole allocations, as on CUDA.
  // Grown to the highest page mapped: a range spans four times the device, little of it is used.
  static constexpr std::uint16_t kMember = 0x8000;
  struct Range { std::size_t bytes; std::vector<std::uint16_t> mapped; };
  std::map<std::uintptr_t, Range> ranges_;

  struct StreamWork { std::uint64_t queued = 0, completed = 0; };
  std::unordered_map<StreamId, StreamWork> streams_;
  struct Event { StreamId stream; std::uint64_t ticket; std::uint64_t recorded_at; };
  std::unordered_map<EventId, Event> events_;
  EventId next_event_ = 1;
  bool auto_complete_ = true;
  std::uint64_t lag_ = 0;    // host steps an event takes to complete (0: no lag)
  std::uint64_t clock_ = 0;  // host steps so far (advance())
  std::uint64_t waits_ = 0;
  std::uint64_t waited_steps_ = 0;
  // The device's position: the host's clock, plus, within the host step in which the host waited, the
  // steps the device ran meanwhile (a second wait in that step is only as long as what is left). Once
  // the host takes its next step the device is `lag` behind again: the model keeps it that far behind,
  // as a GPU stays behind a host that queues work faster than it runs.
  std::uint64_t wait_clock_ = 0;     // the host step of the last wait
  std::uint64_t waited_in_step_ = 0; // how far the device ran during that step's waits
  std::uint64_t device_clock() const { return clock_ + (wait_clock_ == clock_ ? waited_in_step_ : 0); }
  void wait_steps(std::uint64_t steps);  // a wait of the host until the device has run `steps` more
  bool done_by_clock(const Event& e) const { return lag_ != 0 && device_clock() >= e.recorded_at + lag_; }
  // Steps the device still needs to reach `e` (0 without a lag: it is there once the host waits).
  std::uint64_t steps_left(const Event& e) const {
    return lag_ == 0 || done_by_clock(e) ? 0 : e.recorded_at + lag_ - device_clock();
  }

  FaultPlan faults_;
  std::mt19937_64 rng_{1};
  std::uint64_t memory_calls_ = 0;
  std::uint64_t physical_allocations_ = 0;
  std::uint64_t physical_releases_ = 0;
  std::uint64_t unit_maps_ = 0;
  std::uint64_t unit_unmaps_ = 0;
  bool keep_ = false;
  std::map<std::size_t, std::uint64_t> kept_;  // kept units by bytes (they count in used_)
  // Physical units that map_from() shared: the address of each mapping's unit -> the unit's id, and
  // per id how many mappings hold it. Its memory goes back with its last mapping, never kept (as
  // the CUDA upstream does with a unit mapped twice). Units never shared are not listed.
  std::map<std::uintptr_t, std::uint64_t> shared_unit_at_;
  std::unordered_map<std::uint64_t, std::uint32_t> shared_mappings_;
  std::uint64_t next_shared_id_ = 1;
  std::uint64_t aliased_units_ = 0;
  void release_kept();
  std::size_t free_bytes() const { return capacity_ - std::min(capacity_, used_ + elsewhere_); }
  std::uint64_t faults_injected_ = 0;
};

}  // namespace gpumem
