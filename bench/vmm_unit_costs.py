"""What the CUDA driver's virtual-memory calls cost, per unit and per call, on this GPU.

The pool's remapping under a cap goes by units (one physical allocation each: a 2 MiB page or an 8 MiB
group), and its modelled driver time (gpumem.replay.DRIVER_US_PER_UNIT) by their per-unit costs. This
bench measures them with the driver API alone (ctypes on libcuda, no gpumem), for N units of U bytes
mapped side by side in one reserved range:

  create       cuMemCreate, per unit
  map          cuMemMap, per unit
  access       cuMemSetAccess: per unit, and once over the whole run (what the pool does)
  unmap        cuMemUnmap: per unit, and once over the whole run of units (if the driver accepts it)
  release      cuMemRelease, per unit

and then whether an unmap waits for work queued on the device: the same per-unit and whole-run unmaps
timed while a stream still runs about `--busy-ms` of matrix products (torch), the host's time for the
unmaps beside the time the queued work had left.

    python bench/vmm_unit_costs.py                  # 256 units of 2 MiB and of 8 MiB, 5 repeats
    python bench/vmm_unit_costs.py --units 64 --unit-mib 8 --repeats 3 --json out.json

Needs a CUDA GPU (and torch for the busy-device part, skipped without it). Prints a table of
microseconds per unit (median over the repeats) and one JSON line with every figure.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class Driver:
    """The few driver entry points the bench calls; every non-zero result raises with its name."""

    def __init__(self, device: int) -> None:
        try:
            self.cu = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise RuntimeError(f"needs the CUDA driver (libcuda.so.1), which this machine lacks: {e}") from None
        self.check(self.cu.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.check(self.cu.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        self.device = dev  # the driver's handle of the device: main() asks its name
        ctx = ctypes.c_void_p()
        self.check(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self.check(self.cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self.prop = _Prop(type=CU_MEM_ALLOCATION_TYPE_PINNED, location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, device))
        self.access = _Access(location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, device),
                              flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        gran = ctypes.c_size_t()
        self.check(self.cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(self.prop),
                                                         CU_MEM_ALLOC_GRANULARITY_MINIMUM), "granularity")
        self.granularity = gran.value

    @staticmethod
    def check(result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed: CUresult {result}")

    def reserve(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self.check(self.cu.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(nbytes),
                                               ctypes.c_size_t(self.granularity), ctypes.c_uint64(0),
                                               ctypes.c_uint64(0)), "cuMemAddressReserve")
        return ptr.value

    def free_range(self, ptr: int, nbytes: int) -> None:
        self.check(self.cu.cuMemAddressFree(ctypes.c_uint64(ptr), ctypes.c_size_t(nbytes)), "cuMemAddressFree")

    def create(self, nbytes: int) -> int:
        handle = ctypes.c_uint64()
        self.check(self.cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(nbytes), ctypes.byref(self.prop),
                                       ctypes.c_uint64(0)), "cuMemCreate")
        return handle.value

    def map(self, ptr: int, nbytes: int, handle: int) -> None:
        self.check(self.cu.cuMemMap(ctypes.c_uint64(ptr), ctypes.c_size_t(nbytes), ctypes.c_size_t(0),
                                    ctypes.c_uint64(handle), ctypes.c_uint64(0)), "cuMemMap")

    def set_access(self, ptr: int, nbytes: int) -> None:
        self.check(self.cu.cuMemSetAccess(ctypes.c_uint64(ptr), ctypes.c_size_t(nbytes), ctypes.byref(self.access),
                                          ctypes.c_size_t(1)), "cuMemSetAccess")

    def unmap(self, ptr: int, nbytes: int) -> int:
        return self.cu.cuMemUnmap(ctypes.c_uint64(ptr), ctypes.c_size_t(nbytes))

    def release(self, handle: int) -> None:
        self.check(self.cu.cuMemRelease(ctypes.c_uint64(handle)), "cuMemRelease")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def one_round(d: Driver, base: int, units: int, unit: int, whole_unmap: bool, whole_access: bool,
              busy=None) -> dict:
    """Creates, maps, gives access to, unmaps and releases `units` units at `base`; microseconds per unit."""
    handles = []
    t = {}
    t["create"] = _timed(lambda: handles.extend(d.create(unit) for _ in range(units)))
    t["map"] = _timed(lambda: [d.map(base + i * unit, unit, h) for i, h in enumerate(handles)])
    if whole_access:
        t["access"] = _timed(lambda: d.set_access(base, units * unit))
    else:
        t["access"] = _timed(lambda: [d.set_access(base + i * unit, unit) for i in range(units)])
    queued_ms = busy() if busy else None
    results = []
    if whole_unmap:
        t["unmap"] = _timed(lambda: results.append(d.unmap(base, units * unit)))
        if results[0] != 0:  # the driver wants one call per mapping: unmap them so and say so
            t["unmap"] = _timed(lambda: results.extend(d.unmap(base + i * unit, unit) for i in range(units)))
    else:
        t["unmap"] = _timed(lambda: results.extend(d.unmap(base + i * unit, unit) for i in range(units)))
    refused = whole_unmap and results[0] != 0  # then results[0] is that refusal, the rest per unit
    bad = [r for r in results[1 if refused else 0:] if r != 0]
    if bad:
        raise RuntimeError(f"cuMemUnmap failed: CUresult {bad[0]}")
    t["release"] = _timed(lambda: [d.release(h) for h in handles])
    out = {k: v / units for k, v in t.items()}
    out["whole_unmap_accepted"] = not refused if whole_unmap else None
    if queued_ms is not None:
        out["queued_ms"] = queued_ms
    return out


def busy_device(ms: float):
    """A function that queues about `ms` of matrix products on torch's current stream and returns it."""
    try:
        import torch
    except ImportError:
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ a
    end.record()
    torch.cuda.synchronize()
    per = start.elapsed_time(end) / 10
    reps = max(1, int(ms / per))

    def queue() -> float:
        for _ in range(reps):
            a @ a
        return reps * per
    return queue


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--units", type=int, default=256, help="units per round (default 256)")
    ap.add_argument("--unit-mib", default="2,8", help="unit sizes in MiB, comma-separated (default 2,8)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds per configuration (default 5)")
    ap.add_argument("--busy-ms", type=float, default=50.0, help="queued work for the busy-device rounds")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    if args.units < 1 or args.repeats < 1:
        ap.error("--units and --repeats must be at least 1")
    try:
        sizes = [int(s) for s in args.unit_mib.split(",")]
    except ValueError:
        ap.error(f"--unit-mib must be whole MiB, comma-separated, got {args.unit_mib!r}")
    busy = None
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.set_device(args.device)
            torch.zeros(1, device="cuda")  # torch's context is the primary one the driver calls use
            busy = busy_device(args.busy_ms)
    except ImportError:
        pass
    try:
        d = Driver(args.device)
    except RuntimeError as e:
        print(f"vmm_unit_costs: {e}", file=sys.stderr)
        return 2
    version = ctypes.c_int()
    d.cu.cuDriverGetVersion(ctypes.byref(version))
    gpu_name = ctypes.create_string_buffer(256)
    d.cu.cuDeviceGetName(gpu_name, 256, d.device)
    gpu = gpu_name.value.decode()
    rows = []
    for mib in sizes:
        unit = mib << 20
        if unit % d.granularity:
            ap.error(f"{mib} MiB is not a multiple of the granularity ({d.granularity} bytes)")
        base = d.reserve(args.units * unit)
        try:
            # (name, one unmap over the run, one access over the run, queue work before the unmaps).
            # The busy rounds give access over the whole run, as the pool does, and differ in the unmap.
            configs = [("per unit", False, False, None), ("whole run", True, True, None)]
            if busy:
                configs += [("per unit, busy", False, True, busy), ("whole run, busy", True, True, busy)]
            for name, whole_unmap, whole_access, b in configs:
                rounds = [one_round(d, base, args.units, unit, whole_unmap, whole_access, b)
                          for _ in range(args.repeats)]
                if b:
                    import torch
                    torch.cuda.synchronize()
                row = {"unit_mib": mib, "units": args.units, "how": name}
                for k in ("create", "map", "access", "unmap", "release"):
                    row[k] = statistics.median(r[k] for r in rounds)
                row["whole_unmap_accepted"] = rounds[0]["whole_unmap_accepted"]
                if b:
                    row["queued_ms"] = statistics.median(r["queued_ms"] for r in rounds)
                rows.append(row)
        finally:
            d.free_range(base, args.units * unit)
    print(f"{gpu}, CUDA driver {version.value}")
    print(f"{'unit':>6} {'how':<18} {'create':>8} {'map':>8} {'access':>8} {'unmap':>8} {'release':>8}"
          "   us per unit, median of %d rounds of %d units" % (args.repeats, args.units))
    for r in rows:
        note = ""
        if r["whole_unmap_accepted"] is False:
            note += " (one unmap over the run refused: per unit)"
        if "queued_ms" in r:
            note += f" (unmaps with ~{r['queued_ms']:.0f} ms queued)"
        print(f"{r['unit_mib']:>4}Mi {r['how']:<18} {r['create']:8.1f} {r['map']:8.1f} {r['access']:8.1f} "
              f"{r['unmap']:8.1f} {r['release']:8.1f}{note}")
    line = json.dumps({"device": args.device, "gpu": gpu, "driver_version": version.value,
                       "rows": rows})
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
