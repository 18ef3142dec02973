#include "simulated_device.hpp"

#include <algorithm>
#include <atomic>

#include "errors.hpp"

namespace gpumem {

namespace {
// Each simulated device gets its own slice of a fake address space, so a pointer from one device is
// foreign to every other one, as on real hardware.
std::atomic<std::uintptr_t> next_device_base{0x100000000000};
constexpr std::uintptr_t kDeviceAddressSpan = std::uintptr_t(1) << 44;
}  // namespace

SimulatedDevice::SimulatedDevice(UpstreamKind kind, std::size_t capacity, std::size_t page_size)
    : kind_(kind), capacity_(capacity), page_size_(page_size),
      next_address_(next_device_base.fetch_add(kDeviceAddressSpan)) {
  if (page_size == 0 || page_size % kAlignment != 0)
    throw InvalidArgument("simulated device: page_size must be a positive multiple of 512, got " +
                          std::to_string(page_size));
  if (capacity < page_size)
    throw InvalidArgument("simulated device: capacity " + std::to_string(capacity) +
                          " is smaller than one page (" + std::to_string(page_size) + ")");
}

std::string SimulatedDevice::name() const {
  return kind_ == UpstreamKind::kPages ? "simulated-vmm" : "simulated-segments";
}

bool SimulatedDevice::inject_fault() {
  ++memory_calls_;
  bool fail = (faults_.fail_every && memory_calls_ % faults_.fail_every == 0) ||
              (faults_.fail_probability > 0 &&
               std::uniform_real_distribution<double>(0, 1)(rng_) < faults_.fail_probability);
  if (fail) ++faults_injected_;
  return fail;
}

std::size_t SimulatedDevice::device_free_bytes() const {
  if (faults_.fail_free_query) throw UpstreamError("gpumem: simulated driver error asking for free memory");
  return free_bytes();
}

void SimulatedDevice::set_fault_plan(const FaultPlan& plan) {
  faults_ = plan;
  rng_.seed(plan.seed);
}

std::uintptr_t SimulatedDevice::allocate_segment(std::size_t bytes) {
  if (kind_ != UpstreamKind::kSegments) return Upstream::allocate_segment(bytes);
  if (bytes == 0 || bytes % page_size_ != 0)
    throw std::logic_error("simulated device: segment size " + std::to_string(bytes) +
                           " is not a positive multiple of the page size");
  if (inject_fault() || bytes > free_bytes()) return 0;
  std::uintptr_t address = next_address_;
  next_address_ += bytes;
  segments_[address] = bytes;
  used_ += bytes;
  ++physical_allocations_;
  return address;
}

void SimulatedDevice::free_segment(std::uintptr_t address, std::size_t bytes) {
  auto it = segments_.find(address);
  if (it == segments_.end() || it->second != bytes)
    throw std::logic_error("simulated device: free_segment of a segment it never gave out");
  if (faults_.fail_unmap) {
    ++faults_injected_;
    throw UpstreamError("simulated device: injected failure in free_segment");
  }
  used_ -= bytes;
  ++physical_releases_;
  segments_.erase(it);
}

std::uintptr_t SimulatedDevice::reserve_address_range(std::size_t bytes) {
  if (kind_ != UpstreamKind::kPages) return Upstream::reserve_address_range(bytes);
  bytes = round_up(bytes, page_size_);
  std::uintptr_t address = round_up(next_address_, page_size_);  // ranges start on a page, as on CUDA
  next_address_ = address + bytes + page_size_;  // a guard gap, so neighbouring ranges never touch
  ranges_[address] = Range{bytes, {}};
  return address;
}

void SimulatedDevice::release_address_range(std::uintptr_t address, std::size_t bytes) {
  auto it = ranges_.find(address);
  if (it == ranges_.end()) throw std::logic_error("simulated device: release of an unknown range");
  for (std::uint16_t m : it->second.mapped)
    if (m) throw std::logic_error("simulated device: address range released with pages still mapped");
  (void)bytes;
  ranges_.erase(it);
}

SimulatedDevice::Range& SimulatedDevice::range_of(std::uintptr_t address, std::size_t bytes,
                                                  std::size_t* first) {
  auto it = ranges_.upper_bound(address);
  if (it == ranges_.begin()) throw std::logic_error("simulated device: address outside every range");
  --it;
  if (address % page_size_ || bytes % page_size_ || bytes == 0 ||
      address + bytes > it->first + it->second.bytes)
    throw std::logic_error("simulated device: map/unmap of a range not page-aligned or not reserved");
  *first = (address - it->first) / page_size_;
  return it->second;
}

bool SimulatedDevice::map(std::uintptr_t address, std::size_t bytes, std::size_t page) {
  if (kind_ != UpstreamKind::kPages) return Upstream::map(address, bytes, page);
  if (page == 0 || page % page_size_ || bytes % page || page / page_size_ >= kMember)
    throw std::logic_error("simulated device: map with a page that does not divide the range");
  std::size_t first;
  auto& mapped = range_of(address, bytes, &first).mapped;
  const std::size_t end = first + bytes / page_size_, unit = page / page_size_;
  for (std::size_t p = first; p < std::min(end, mapped.size()); ++p)
    if (mapped[p]) throw std::logic_error("simulated device: page mapped twice");
  if (inject_fault()) return false;
  // Kept units of this size are mapped again; the rest are new physical allocations. Short of room,
  // the device releases what is kept first, as the CUDA upstream does.
  std::uint64_t reused = std::min<std::uint64_t>(kept_[page], bytes / page);
  if (bytes - reused * page > free_bytes()) {
    release_kept();
    reused = 0;
    if (bytes > free_bytes()) return false;
  }
  kept_[page] -= reused;
  const std::size_t fresh = bytes - reused * page;
  if (mapped.size() < end) mapped.resize(end, 0);
  for (std::size_t p = first; p < end; ++p)
    mapped[p] = (p - first) % unit == 0 ? static_cast<std::uint16_t>(unit) : kMember;
  used_ += fresh;
  physical_allocations_ += fresh / page;
  unit_maps_ += bytes / page;
  return true;
}

void SimulatedDevice::unmap(std::uintptr_t address, std::size_t bytes, std::size_t page) {
  if (page == 0 || page % page_size_ || bytes % page)
    throw std::logic_error("simulated device: unmap with a page that does not divide the range");
  std::size_t first;
  auto& mapped = range_of(address, bytes, &first).mapped;
  const std::size_t end = first + bytes / page_size_, unit = page / page_size_;
  check_whole_units(mapped, first, end, unit, "unmap");
  if (faults_.fail_unmap) {
    ++faults_injected_;
    throw UpstreamError("simulated device: injected failure in unmap");
  }
  for (std::size_t p = first; p < end; ++p) mapped[p] = 0;
  unit_unmaps_ += bytes / page;
  for (std::uintptr_t a = address; a < address + bytes; a += page) {
    auto shared = shared_unit_at_.find(a);
    if (shared != shared_unit_at_.end()) {
      const std::uint64_t id = shared->second;
      shared_unit_at_.erase(shared);
      if (--shared_mappings_[id] > 0) continue;  // another mapping still holds the memory
      shared_mappings_.erase(id);
    } else if (keep_) {
      kept_[page] += 1;  // still held: used_ unchanged
      continue;
    }
    used_ -= page;
    physical_releases_ += 1;
  }
}

void SimulatedDevice::check_whole_units(const std::vector<std::uint16_t>& mapped, std::size_t first,
                                        std::size_t end, std::size_t unit, const char* what) {
  if (end > mapped.size())
    throw std::logic_error(std::string("simulated device: ") + what + " of a page that is not mapped");
  for (std::size_t p = first; p < end; ++p) {
    if (!mapped[p]) throw std::logic_error(std::string("simulated device: ") + what + " of a page that is not mapped");
    // CUDA unmaps and releases whole physical allocations: the range must be made of them exactly.
    const std::uint16_t expect = (p - first) % unit == 0 ? static_cast<std::uint16_t>(unit) : kMember;
    if (mapped[p] != expect || (p + 1 == end && p + 1 < mapped.size() && mapped[p + 1] == kMember))
      throw std::logic_error(std::string("simulated device: ") + what +
                             " of part of a physical allocation, or with another page size");
  }
}

bool SimulatedDevice::map_from(std::uintptr_t address, std::uintptr_t source, std::size_t bytes,
                               std::size_t page) {
  if (kind_ != UpstreamKind::kPages) return false;
  if (page == 0 || page % page_size_ || bytes % page || page / page_size_ >= kMember)
    throw std::logic_error("simulated device: map_from with a page that does not divide the range");
  std::size_t source_first;
  const auto& source_mapped = range_of(source, bytes, &source_first).mapped;
  const std::size_t unit = page / page_size_;
  check_whole_units(source_mapped, source_first, source_first + bytes / page_size_, unit, "map_from");
  std::size_t first;
  auto& mapped = range_of(address, bytes, &first).mapped;
  const std::size_t end = first + bytes / page_size_;
  for (std::size_t p = first; p < std::min(end, mapped.size()); ++p)
    if (mapped[p]) throw std::logic_error("simulated device: page mapped twice");
  if (mapped.size() < end) mapped.resize(end, 0);
  for (std::size_t p = first; p < end; ++p)
    mapped[p] = (p - first) % unit == 0 ? static_cast<std::uint16_t>(unit) : kMember;
  for (std::size_t off = 0; off < bytes; off += page) {
    auto [it, added] = shared_unit_at_.try_emplace(source + off, next_shared_id_);
    if (added) shared_mappings_[next_shared_id_++] = 1;
    shared_unit_at_[address + off] = it->second;
    ++shared_mappings_[it->second];
  }
  aliased_units_ += bytes / page;
  unit_maps_ += bytes / page;
  return true;
}

bool SimulatedDevice::mapped_unit_at(std::uintptr_t address, std::uintptr_t* start, std::size_t* offset) const {
  auto it = ranges_.upper_bound(address);
  if (it == ranges_.begin()) return false;
  --it;
  if (address >= it->first + it->second.bytes) return false;
  const auto& mapped = it->second.mapped;
  const std::size_t page = (address - it->first) / page_size_;
  std::size_t p = page;
  if (p >= mapped.size() || !mapped[p]) return false;
  while (mapped[p] == kMember) --p;  // the unit's first page holds its length
  *start = it->first + p * page_size_;
  *offset = (page - p) * page_size_;
  return true;
}

std::pair<std::uint64_t, std::size_t> SimulatedDevice::physical_unit_at(std::uintptr_t address) const {
  std::uintptr_t start = 0;
  std::size_t offset = 0;
  if (!mapped_unit_at(address, &start, &offset)) return {0, 0};
  const auto shared = shared_unit_at_.find(start);
  // Shared units by their id; the others by their address, kept apart from ids by the top bit.
  return {shared != shared_unit_at_.end() ? shared->second : (std::uint64_t{1} << 63) | start, offset};
}

std::size_t SimulatedDevice::mappings_at(std::uintptr_t address) const {
  std::uintptr_t start = 0;
  std::size_t offset = 0;
  if (!mapped_unit_at(address, &start, &offset)) return 0;
  const auto shared = shared_unit_at_.find(start);
  return shared != shared_unit_at_.end() ? shared_mappings_.at(shared->second) : 1;
}

std::size_t SimulatedDevice::units_mapped_twice() const {
  std::size_t n = 0;
  for (const auto& entry : shared_mappings_) n += entry.second > 1;
  return n;
}

void SimulatedDevice::keep_released_units(bool on) {
  keep_ = on;
  if (!on) release_kept();
}

void SimulatedDevice::release_kept() {
  for (auto& [unit_bytes, count] : kept_) {
    used_ -= unit_bytes * count;
    physical_releases_ += count;
    count = 0;
  }
}

std::uint64_t SimulatedDevice::kept_units() const {
  std::uint64_t n = 0;
  for (const auto& entry : kept_) n += entry.second;
  return n;
}

EventId SimulatedDevice::record_event(StreamId stream) {
  StreamWork& w = streams_[stream];
  ++w.queued;
  if (auto_complete_ && lag_ == 0) w.completed = w.queued;
  EventId id = next_event_++;
  events_[id] = Event{stream, w.queued, clock_};
  return id;
}

bool SimulatedDevice::event_completed(EventId event) {
  auto it = events_.find(event);
  if (it == events_.end()) throw std::logic_error("simulated device: query of an unknown event");
  StreamWork& w = streams_[it->second.stream];
  // Seen done stays done, with the stream's work before it: after a wait the device runs ahead of its
  // lag for the rest of that host step only (device_clock), and what it finished meanwhile is finished.
  if (done_by_clock(it->second)) w.completed = std::max(w.completed, it->second.ticket);
  return w.completed >= it->second.ticket;
}

void SimulatedDevice::destroy_event(EventId event) {
  if (!events_.erase(event)) throw std::logic_error("simulated device: destroy of an unknown event");
}

void SimulatedDevice::wait_event(EventId event) {
  auto it = events_.find(event);
  if (it == events_.end()) throw std::logic_error("simulated device: wait for an unknown event");
  StreamWork& w = streams_[it->second.stream];
  if (w.completed < it->second.ticket && !done_by_clock(it->second)) wait_steps(steps_left(it->second));
  w.completed = std::max(w.completed, it->second.ticket);
}

void SimulatedDevice::synchronize(StreamId stream) {
  StreamWork& w = streams_[stream];
  if (w.completed < w.queued) {
    // A wait unless every event still queued on the stream is done by the clock; as long as the
    // latest of them needs.
    std::uint64_t longest = 0;
    bool outstanding = false;
    for (const auto& [id, e] : events_)
      if (e.stream == stream && e.ticket > w.completed && !done_by_clock(e)) {
        outstanding = true;
        longest = std::max(longest, steps_left(e));
      }
    if (outstanding) wait_steps(longest);
  }
  complete(stream);
}

void SimulatedDevice::wait_steps(std::uint64_t steps) {
  ++waits_;
  waited_steps_ += steps;
  // The device runs meanwhile: within this host step it is `steps` further on (device_clock).
  if (wait_clock_ != clock_) waited_in_step_ = 0;
  wait_clock_ = clock_;
  waited_in_step_ += steps;
}

void SimulatedDevice::complete(StreamId stream) {
  StreamWork& w = streams_[stream];
  w.completed = w.queued;
}

void SimulatedDevice::complete_one(StreamId stream) {
  StreamWork& w = streams_[stream];
  if (w.completed < w.queued) ++w.completed;
}

void SimulatedDevice::complete_all() {
  for (auto& [stream, w] : streams_) w.completed = w.queued;
}

}  // namespace gpumem
