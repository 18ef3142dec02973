// The fuzz harness: a byte stream decoded into pool operations (allocate with sizes and streams, free,
// bad frees, record_stream, event completion, trim, cap changes, upstream faults, OOM callbacks,
// allocate_at at recently freed or random addresses, limit changes), run against the simulated
// device (with setup bit 7, one running 1-61 operations behind the host: events complete by its
// clock or when waited for), with every operation checked against a plain reference model.
//
// After each operation:
//   - Pool::validate() (the pool's own invariant checker);
//   - the model's live allocations (address -> requested, rounded, stream) agree with the stats:
//     allocation count, allocated_bytes (sum of sizes rounded to 512), requested_bytes;
//   - active - allocated lies between the bytes of pending blocks whose events are certainly not done
//     and all pending blocks (equal to the former right after process_events);
//   - the device hands out exactly the pool's reserved bytes (no leak, no double count);
//   - largest_free_block and inactive_split_bytes fit inside reserved - active;
//   - the spans the segment observer reported (added minus removed) are snapshot()'s regions, each
//     removed as it was added, none added over another.
// Per operation:
//   - a new address is 512-aligned, backed by mapped memory, and overlaps neither a live allocation
//     nor a block still waiting for another stream's event;
//   - memory goes back to the device only when no live block lies on it, after the streams that
//     last used it were synchronised, and after the span holding it was removed;
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
// The harness is fuzz_harness.hpp with fuzz_allocate.cpp, its model fuzz_model.hpp; this file is the
// entry point both drivers call.
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "fuzz_harness.hpp"

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
  gpumem_fuzz::Reader in{data, size};
  try {
    gpumem_fuzz::Harness h(in);
    h.run();
    gpumem_fuzz_ops += h.ops_;
    gpumem_fuzz_faults += h.sim_->faults_injected();
    gpumem_fuzz_ooms += h.ooms_;
  } catch (const std::exception& e) {
    gpumem_fuzz::fail(std::string("unexpected exception: ") + e.what());
  }
  return 0;
}
