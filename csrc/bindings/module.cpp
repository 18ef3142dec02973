// gpumem._C: thin pybind11 bindings over the core. Only argument conversion and error translation
// live here; every behaviour is in csrc/core.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>

#include "../core/config.hpp"
#include "../core/cuda_upstream.hpp"
#include "../core/pool.hpp"
#include "../core/simulated_device.hpp"
#include "../core/trace.hpp"

namespace py = pybind11;
using namespace gpumem;

namespace {

// Sizes arrive as Python ints: reject negatives and absurd values with a message, not a TypeError.
std::size_t to_size(const py::int_& value, const char* what) {
  long long v;
  try {
    v = value.cast<long long>();
  } catch (const py::cast_error&) {
    throw InvalidArgument(std::string(what) + " is too large to be a size");
  }
  if (v < 0) throw InvalidArgument(std::string(what) + " must be >= 0, got " + std::to_string(v));
  return static_cast<std::size_t>(v);
}

std::uintptr_t to_address(const py::int_& value) {
  unsigned long long v;
  try {
    v = value.cast<unsigned long long>();
  } catch (const py::cast_error&) {
    throw InvalidArgument("a pointer must be a non-negative integer");
  }
  return static_cast<std::uintptr_t>(v);
}

UpstreamKind parse_kind(const std::string& kind) {
  if (kind == "vmm" || kind == "pages") return UpstreamKind::kPages;
  if (kind == "segments") return UpstreamKind::kSegments;
  throw InvalidArgument("upstream kind must be 'vmm' or 'segments', got '" + kind + "'");
}

ReleasePolicy parse_release(const std::string& release) {
  if (release == "high_water") return ReleasePolicy::kHighWater;
  if (release == "lazy") return ReleasePolicy::kLazy;
  throw InvalidArgument("release must be 'lazy' or 'high_water', got '" + release + "'");
}

py::dict stat_dict(const Stat& s) {
  py::dict d;
#define GPUMEM_PY_FIELD(f) d[#f] = s.f;
  GPUMEM_STAT_FIELDS(GPUMEM_PY_FIELD)
#undef GPUMEM_PY_FIELD
  return d;
}

// The same nested shape as torch._C._cuda_memoryStats, so torch's flattening code applies; the keys
// come from the one schema in stats.hpp.
py::dict stats_dict(const DeviceStats& s) {
  py::dict out;
#define GPUMEM_PY_ARRAY(name)                                                           \
  {                                                                                     \
    py::dict d;                                                                         \
    for (int t = 0; t < kNumStatTypes; ++t) d[stat_type_name(t)] = stat_dict(s.name[t]); \
    out[#name] = d;                                                                     \
  }
#define GPUMEM_PY_STAT(name) out[#name] = stat_dict(s.name);
#define GPUMEM_PY_NUMBER(name) out[#name] = s.name;
  GPUMEM_STATS_SCHEMA(GPUMEM_PY_ARRAY, GPUMEM_PY_STAT, GPUMEM_PY_NUMBER, GPUMEM_PY_NUMBER)
#undef GPUMEM_PY_ARRAY
#undef GPUMEM_PY_STAT
#undef GPUMEM_PY_NUMBER
  return out;
}

// ---- the GIL and the pool's lock ----------------------------------------------------------------
// The segment observer calls Python with the pool's lock held, so it must take the GIL there. That is
// safe only if no thread ever waits for a pool's lock while holding the GIL: every Pool method below
// releases the GIL before it calls into the pool (lock order: the pool's lock, then the GIL). An
// observer that calls back into a pool would deadlock on that lock; it gets a RuntimeError instead.

thread_local bool in_segment_observer = false;

void refuse_inside_observer() {
  if (in_segment_observer)
    throw std::runtime_error("gpumem: a segment observer must not call into a pool: it runs with the "
                             "pool's lock held");
}

// Runs f() (a call into the pool) without the GIL; its result is converted after the GIL is back.
template <typename F>
auto without_gil(F&& f) -> decltype(f()) {
  refuse_inside_observer();
  py::gil_scoped_release no_gil;
  return f();
}

// A Python callable the core holds (OOM callbacks, the segment observer). The core may drop it
// without the GIL (under its lock, from a binding that released the GIL), so its destructor takes it.
struct PyCallable {
  py::object fn;
  explicit PyCallable(py::object f) : fn(std::move(f)) {}
  PyCallable(const PyCallable&) = delete;
  PyCallable& operator=(const PyCallable&) = delete;
  ~PyCallable() {
    if (!Py_IsInitialized()) {
      fn.release();  // the interpreter is gone: leak the reference rather than touch it
      return;
    }
    py::gil_scoped_acquire gil;
    fn = py::object();
  }
};

const char* event_name(SegmentEvent event) {
  switch (event) {
    case SegmentEvent::kMap: return "map";
    case SegmentEvent::kUnmap: return "unmap";
    case SegmentEvent::kSegmentAlloc: return "segment_alloc";
    case SegmentEvent::kSegmentFree: return "segment_free";
    case SegmentEvent::kSpanAdded: return "span_added";
    case SegmentEvent::kSpanRemoved: return "span_removed";
  }
  return "unknown";
}

py::object block_dict(const BlockInfo& b) {
  py::dict bd;
  bd["address"] = b.address;
  bd["size"] = b.size;
  bd["requested_size"] = b.requested;
  bd["state"] = b.state == BlockInfo::kAllocated ? "active_allocated"
                : b.state == BlockInfo::kPending ? "active_pending_free"
                                                 : "inactive";
  return std::move(bd);
}

py::dict replay_dict(const ReplayResult& r) {
  py::dict d;
  d["peak_live_bytes"] = r.peak_live;
  d["peak_reserved_bytes"] = r.peak_reserved;
  d["fragmentation"] = r.fragmentation;
  d["upstream_calls"] = r.upstream_calls;
  d["ns_per_pair"] = r.ns_per_pair;
  d["allocations"] = r.allocations;
  d["frees"] = r.frees;
  d["ooms"] = r.ooms;
  d["first_oom"] = r.first_oom;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "gpumem's C++ core: the pooled allocator, its upstreams, config parsing and trace replay.";

  py::register_exception<OutOfMemoryError>(m, "OutOfMemoryError", PyExc_MemoryError);
  py::register_exception<InvariantViolation>(m, "InvariantViolation", PyExc_AssertionError);
  py::register_exception<UpstreamError>(m, "UpstreamError", PyExc_RuntimeError);

  py::class_<Upstream, std::shared_ptr<Upstream>>(m, "Upstream")
      .def_property_readonly("name", &Upstream::name)
      .def_property_readonly("page_size", &Upstream::page_size)
      .def_property_readonly("total_bytes", &Upstream::device_total_bytes)
      .def_property_readonly("free_bytes", &Upstream::device_free_bytes);

  py::class_<SimulatedDevice, Upstream, std::shared_ptr<SimulatedDevice>>(m, "SimulatedDevice")
      .def(py::init([](const std::string& kind, const py::int_& capacity, const py::int_& page_size) {
             return std::make_shared<SimulatedDevice>(parse_kind(kind), to_size(capacity, "capacity"),
                                                      to_size(page_size, "page_size"));
           }),
           py::arg("kind") = "vmm", py::arg("capacity") = py::int_(80ull * GiB),
           py::arg("page_size") = py::int_(2 * MiB),
           "A device in host memory: fake addresses, a capacity and a page size (kind 'vmm' or 'segments').")
      .def("set_auto_complete", &SimulatedDevice::set_auto_complete, py::arg("on"))
      .def("complete", &SimulatedDevice::complete, py::arg("stream"),
           "Marks all work queued so far on `stream` as done.")
      .def("complete_all", &SimulatedDevice::complete_all)
      .def("set_fault_plan",
           [](SimulatedDevice& d, std::uint64_t every, double probability, bool fail_unmap, std::uint64_t seed,
              bool fail_free_query) {
             d.set_fault_plan(FaultPlan{every, probability, fail_unmap, seed, fail_free_query});
           },
           py::arg("fail_every") = 0, py::arg("fail_probability") = 0.0, py::arg("fail_unmap") = false,
           py::arg("seed") = 1, py::arg("fail_free_query") = false)
      .def_property_readonly("faults_injected", &SimulatedDevice::faults_injected)
      .def_property_readonly("used_bytes", &SimulatedDevice::used_bytes)
      .def_property(
          "held_elsewhere", &SimulatedDevice::held_elsewhere,
          [](SimulatedDevice& d, const py::int_& bytes) { d.set_held_elsewhere(to_size(bytes, "held_elsewhere")); },
          "Bytes of the capacity held outside this device's users (another process, a library's own "
          "cudaMalloc): maps and segments get only what is left.")
      .def_property_readonly("physical_allocations", &SimulatedDevice::physical_allocations,
                             "Physical allocations made so far (a map of n units counts n, a segment 1).")
      .def_property_readonly("physical_releases", &SimulatedDevice::physical_releases,
                             "Physical allocations released so far.")
      .def_property_readonly("unit_maps", &SimulatedDevice::unit_maps,
                             "Physical units mapped so far (new, kept or shared alike).")
      .def_property_readonly("unit_unmaps", &SimulatedDevice::unit_unmaps, "Physical units unmapped so far.")
      .def_property_readonly("aliased_units", &SimulatedDevice::aliased_units,
                             "Units mapped a second time onto memory already mapped elsewhere (map_from).")
      .def("physical_unit_at", &SimulatedDevice::physical_unit_at, py::arg("address"),
           "(unit, offset): which physical allocation backs the mapped page holding `address` (the same "
           "number at every address mapped onto it; 0 where nothing is mapped) and the page's offset in it.")
      .def_property("lag", &SimulatedDevice::lag, &SimulatedDevice::set_lag,
                    "Host steps an event takes to complete (0: none, events complete when recorded). "
                    "A replay advances the clock once per operation.")
      .def("advance", &SimulatedDevice::advance, "One host step of the lag's clock.")
      .def_property_readonly("waits", &SimulatedDevice::waits,
                             "Times the host waited for work the device had not done yet.")
      .def_property_readonly("waited_steps", &SimulatedDevice::waited_steps,
                             "Host steps those waits stood for: per wait, the steps the device still "
                             "needed to reach what was waited for.");

  m.def("cuda_upstreams_built", &cuda_upstreams_built);
  m.def("cuda_available", &cuda_available);
  m.def("cuda_device_count", &cuda_device_count);
  m.def("cuda_vmm_supported", &cuda_vmm_supported, py::arg("device") = 0);
  m.def("cuda_upstream",
        [](const std::string& kind, int device, bool exportable) {
          return make_cuda_upstream(parse_kind(kind), device, exportable);
        },
        py::arg("kind") = "vmm", py::arg("device") = 0, py::arg("exportable") = true,
        "A CUDA upstream: 'vmm' (virtual memory pages) or 'segments' (cuMemAlloc). exportable (vmm): "
        "pages created with a POSIX file descriptor handle type, shareable with other processes.");

  py::class_<Pool, std::shared_ptr<Pool>>(m, "Pool")
      .def(py::init([](std::shared_ptr<Upstream> upstream, const py::int_& cap, const std::string& release,
                       double release_slack, const py::int_& page_size, int device, bool stitch,
                       double stitch_slack, bool ends_by_page, double early_ends_by_page,
                       bool park_lent) {
             PoolOptions o;
             o.cap_bytes = to_size(cap, "cap");
             o.release = parse_release(release);
             o.release_slack = release_slack;
             o.large_page_bytes = to_size(page_size, "page_size");
             o.device = device;
             o.stitch = stitch;
             o.stitch_slack = stitch_slack;
             o.ends_by_page = ends_by_page;
             o.early_ends_by_page = early_ends_by_page;
             o.park_lent = park_lent;
             return std::make_shared<Pool>(std::move(upstream), o);
           }),
           py::arg("upstream"), py::arg("cap") = 0, py::arg("release") = "lazy",
           py::arg("release_slack") = PoolOptions().release_slack,
           py::arg("page_size") = py::int_(kDefaultPageSize), py::arg("device") = 0,
           py::arg("stitch") = PoolOptions().stitch, py::arg("stitch_slack") = PoolOptions().stitch_slack,
           py::arg("ends_by_page") = PoolOptions().ends_by_page,
           py::arg("early_ends_by_page") = PoolOptions().early_ends_by_page,
           py::arg("park_lent") = PoolOptions().park_lent,
           "A pool over `upstream`. page_size: bytes per page of large arenas on a paged upstream "
           "(a multiple of its granularity; small arenas use the granularity). stitch: new pages past the "
           "live high water (+ stitch_slack, a fraction) backed by free blocks' units (GPUMEM_CONF stitch, "
           "stitch_slack). ends_by_page: under a bound that is not roomy, a block's end groups are mapped "
           "page by page (GPUMEM_CONF ends_by_page); early_ends_by_page: so are those of the blocks mapped "
           "while the live high water is below that fraction of the bound (GPUMEM_CONF early_ends_by_page; "
           "0: never). park_lent: under a roomy bound, units lent while draining stay mapped (parked) "
           "where they were, taken back without a driver call (GPUMEM_CONF park_lent).")
      .def("allocate",
           [](Pool& p, const py::int_& size, StreamId stream, bool count_oom) {
             std::size_t bytes = to_size(size, "size");
             // OOM callbacks take the GIL
             return without_gil([&] { return p.allocate(bytes, stream, count_oom); });
           },
           py::arg("size"), py::arg("stream") = 0, py::arg("count_oom") = true,
           "Returns a 512-byte aligned address (0 for size 0). Raises OutOfMemoryError or ValueError. "
           "count_oom=False: an out-of-memory is not counted in num_ooms (the caller counts it with "
           "count_oom() if it cannot serve the request elsewhere).")
      .def("count_oom", [](Pool& p) { without_gil([&] { p.count_oom(); }); },
           "Counts one out-of-memory in num_ooms (see allocate's count_oom).")
      .def("allocate_at",
           [](Pool& p, const py::int_& ptr, const py::int_& size) {
             std::uintptr_t address = to_address(ptr);
             std::size_t bytes = to_size(size, "size");
             return without_gil([&] { return p.allocate_at(address, bytes); });
           },
           py::arg("ptr"), py::arg("size"),
           "Allocates exactly [ptr, ptr + size rounded to 512) out of this pool's free space and returns "
           "ptr, on the stream of the region that holds it (restoring CUDA-graph checkpoints). Raises "
           "ValueError, changing nothing, when the range is misaligned, outside every region or overlaps "
           "a live or pending block; OutOfMemoryError when its pages cannot be mapped.")
      .def("free",
           [](Pool& p, const py::int_& ptr) {
             std::uintptr_t address = to_address(ptr);
             without_gil([&] { p.free(address); });
           },
           py::arg("ptr"))
      .def("try_free",
           [](Pool& p, const py::int_& ptr) {
             std::uintptr_t address = to_address(ptr);
             return without_gil([&] { return p.try_free(address); });
           },
           py::arg("ptr"),
           "Frees ptr if it is a live block of this pool and returns True; otherwise returns False and "
           "changes nothing.")
      .def("record_stream",
           [](Pool& p, const py::int_& ptr, StreamId s) {
             std::uintptr_t address = to_address(ptr);
             without_gil([&] { p.record_stream(address, s); });
           },
           py::arg("ptr"), py::arg("stream"))
      .def("process_events", [](Pool& p) { without_gil([&] { p.process_events(); }); })
      .def("trim", [](Pool& p) { return without_gil([&] { return p.trim(); }); },
           "Returns every fully free page or segment to the device; returns the bytes released.")
      .def("set_cap",
           [](Pool& p, const py::int_& cap) {
             std::size_t bytes = to_size(cap, "cap");
             without_gil([&] { p.set_cap(bytes); });
           },
           py::arg("cap"))
      .def_property_readonly("cap", [](const Pool& p) { return without_gil([&] { return p.cap(); }); })
      .def("set_limit",
           [](Pool& p, const py::object& limit) {
             if (!limit.is_none() && !py::isinstance<py::int_>(limit))
               throw py::type_error("limit must be a number of bytes (int) or None");
             std::size_t bytes = limit.is_none() ? Pool::kNoLimit : to_size(limit.cast<py::int_>(), "limit");
             without_gil([&] { p.set_limit(bytes); });
           },
           py::arg("limit"),
           "A bound on reserved bytes besides the cap (torch's per-process memory fraction): any size is "
           "accepted, 0 and sizes below what live blocks hold included; None removes it. Cached memory "
           "above it is released at once.")
      .def_property_readonly(
          "limit",
          [](const Pool& p) -> py::object {
            std::size_t limit = without_gil([&] { return p.limit(); });
            if (limit == Pool::kNoLimit) return py::none();
            return py::int_(limit);
          },
          "The limit set with set_limit, in bytes, or None when there is none.")
      .def_property_readonly("effective_cap",
                             [](const Pool& p) { return without_gil([&] { return p.effective_cap(); }); },
                             "min(cap or the device's memory, limit)")
      .def_property_readonly("device", &Pool::device)
      .def_property_readonly("allocated_bytes",
                             [](const Pool& p) { return without_gil([&] { return p.allocated_bytes(); }); },
                             "Bytes of live blocks (sizes rounded to 512); cheaper than stats().")
      .def_property_readonly("reserved_bytes",
                             [](const Pool& p) { return without_gil([&] { return p.reserved_bytes(); }); },
                             "Bytes taken from the device; cheaper than stats().")
      .def("stats",
           [](const Pool& p) {
             DeviceStats s = without_gil([&] { return p.stats(); });
             return stats_dict(s);
           },
           "Statistics in the nested shape of torch._C._cuda_memoryStats.")
      .def("reset_peak_stats", [](Pool& p) { without_gil([&] { p.reset_peak_stats(); }); })
      .def("reset_accumulated_stats", [](Pool& p) { without_gil([&] { p.reset_accumulated_stats(); }); })
      .def("largest_free_block", [](const Pool& p) { return without_gil([&] { return p.largest_free_block(); }); })
      .def("allocation_size",
           [](const Pool& p, const py::int_& ptr) {
             std::uintptr_t address = to_address(ptr);
             return without_gil([&] { return p.allocation_size(address); });
           })
      .def("live_block",
           [](const Pool& p, const py::int_& ptr) -> py::object {
             std::uintptr_t address = to_address(ptr);
             BlockInfo info{};
             if (!without_gil([&] { return p.live_block(address, &info); })) return py::none();
             return block_dict(info);
           },
           py::arg("ptr"),
           "The live block starting at ptr as a snapshot block dict (address, size, requested_size, "
           "state), or None.")
      .def("snapshot",
           [](const Pool& p) {
             std::vector<RegionInfo> snapshot = without_gil([&] { return p.snapshot(); });
             py::list regions;
             for (const RegionInfo& r : snapshot) {
               py::list blocks;
               for (const BlockInfo& b : r.blocks) blocks.append(block_dict(b));
               py::dict rd;
               rd["address"] = r.address;
               rd["total_size"] = r.size;
               rd["reserved_size"] = r.reserved;
               rd["stream"] = r.stream;
               rd["segment_type"] = r.small ? "small" : "large";
               rd["blocks"] = blocks;
               regions.append(rd);
             }
             return regions;
           })
      .def("add_oom_callback",
           [](Pool& p, py::function fn) {
             // Called without the pool lock and possibly without the GIL: take it, and never let a
             // Python error escape into the allocator.
             auto holder = std::make_shared<PyCallable>(std::move(fn));
             Pool::OomCallback callback = [holder] {
               py::gil_scoped_acquire gil;
               try {
                 holder->fn();
               } catch (py::error_already_set& e) {
                 e.discard_as_unraisable("gpumem out-of-memory callback");
               }
             };
             return without_gil([&] { return p.add_oom_callback(std::move(callback)); });
           },
           py::arg("callback"), "Runs `callback()` before the last retry of an allocation that would fail.")
      .def("remove_oom_callback", [](Pool& p, int id) { without_gil([&] { p.remove_oom_callback(id); }); },
           py::arg("id"))
      .def("set_segment_observer",
           [](Pool& p, const py::object& fn) {
             refuse_inside_observer();
             Pool::SegmentObserver observer;
             if (!fn.is_none()) {
               if (!PyCallable_Check(fn.ptr()))
                 throw py::type_error("set_segment_observer takes a callable or None");
               auto holder = std::make_shared<PyCallable>(fn);
               observer = [holder](SegmentEvent event, std::uintptr_t address, std::size_t bytes,
                                   StreamId stream) {
                 // The pool's lock is held; no binding waits for it with the GIL (see without_gil).
                 py::gil_scoped_acquire gil;
                 struct Flag {
                   Flag() { in_segment_observer = true; }
                   ~Flag() { in_segment_observer = false; }
                 } flag;
                 try {
                   holder->fn(event_name(event), address, bytes, stream);
                 } catch (py::error_already_set& e) {
                   e.discard_as_unraisable("gpumem segment observer");
                 }
               };
             }
             without_gil([&] { p.set_segment_observer(std::move(observer)); });
           },
           py::arg("observer"),
           "Calls observer(event, address, bytes, stream) after every map / unmap of pages and every "
           "segment_alloc / segment_free (event is that name), and with span_added / span_removed as "
           "the entries of snapshot() change (span_removed before the memory goes back), with the "
           "pool's lock held: the observer must not call into a pool (RuntimeError). Its exceptions "
           "are reported as unraisable. None removes it.")
      .def("validate", [](const Pool& p) { without_gil([&] { p.validate(); }); },
           "Checks every invariant of the pool; raises InvariantViolation.")
      .def_property_readonly("upstream", [](Pool& p) { return &p.upstream(); }, py::return_value_policy::reference_internal);

  py::class_<Trace, std::shared_ptr<Trace>>(m, "Trace")
      .def_readonly("path", &Trace::path)
      .def_readonly("workload", &Trace::workload)
      .def_readonly("header_peak_live", &Trace::header_peak_live)
      .def_readonly("allocations", &Trace::allocations)
      .def_property_readonly("operations", [](const Trace& t) { return t.ops.size(); });
  m.def("load_trace", [](const std::string& path) {
        py::gil_scoped_release no_gil;
        return std::make_shared<Trace>(load_trace(path));
      }, py::arg("path"), "Parses a trace file (plain or gzip); raises ValueError 'file:line: ...'.");
  m.def("replay",
        [](const Trace& trace, Pool& pool, py::object progress, std::shared_ptr<SimulatedDevice> clock, bool again) {
          std::function<void(std::size_t, std::size_t)> cb;
          if (!progress.is_none())
            cb = [&progress](std::size_t done, std::size_t total) {
              py::gil_scoped_acquire gil;
              progress(done, total);
            };
          std::function<void()> tick;
          if (clock) tick = [&clock] { clock->advance(); };
          ReplayResult r = without_gil([&] { return replay(trace, pool, cb, tick, again); });
          return replay_dict(r);
        },
        py::arg("trace"), py::arg("pool"), py::arg("progress") = py::none(), py::arg("clock") = py::none(),
        py::arg("again") = false,
        "Replays `trace` through `pool`; `clock`, a SimulatedDevice, has its lag's clock advanced once "
        "per operation; `again`: once more in a pool that replayed it, without the allocations the "
        "trace never frees (a later epoch).");

  m.def("parse_config",
        [](const std::string& text, const std::string& source) {
          Config c = parse_config(text, source);
          py::dict d;
          d["upstream"] = c.upstream;
          d["cap_bytes"] = c.cap_bytes;
          d["cap_fraction"] = c.cap_fraction;
          d["release"] = to_string(c.release);
          d["release_slack"] = c.release_slack;
          d["page_size"] = c.page_size;
          d["gc_on_oom"] = c.gc_on_oom;
          d["ipc"] = c.ipc;
          d["stitch"] = c.stitch;
          d["stitch_slack"] = c.stitch_slack;
          d["ends_by_page"] = c.ends_by_page;
          d["early_ends_by_page"] = c.early_ends_by_page;
          d["park_lent"] = c.park_lent;
          return d;
        },
        py::arg("text"), py::arg("source") = "GPUMEM_CONF",
        "Parses a GPUMEM_CONF string; raises ValueError naming the key and the accepted values.");
  m.def("parse_size", &parse_size, py::arg("text"));
  m.attr("HAS_ZLIB") = bool(GPUMEM_WITH_ZLIB);
  m.attr("ALIGNMENT") = kAlignment;
  m.attr("DEFAULT_PAGE_SIZE") = kDefaultPageSize;
  m.attr("SMALL_LIMIT") = kSmallLimit;
}
