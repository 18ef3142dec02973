"""What the pool remaps at a cap, on the CPU: each trace replayed on a simulated device uncapped and at
1.02x and 1.05x its peak live bytes, with the bytes mapped over the whole replay (the first mapping
included: uncapped, that is all there is), the physical allocations made and released ("units": what the
driver's time goes by, ~60 us each on an H100 whatever their size), the driver's time for every unit
call (``driver ms``: units created, mapped, unmapped and released, at the per-unit costs measured on an
H100, ``gpumem.replay.DRIVER_US_PER_UNIT``), the upstream calls and the allocations that had to give
the whole cache back and retry (``retries``; JSON only) and OOMs; then the lowest
capacity with 0 OOMs (``gpumem.replay.min_capacity``, 0.25% resolution). With ``--device-lag N`` the
simulated device runs N operations behind the replay (as a GPU runs behind the host) and the table adds
the waits at 1.02x and 1.05x: the times the pool made the host wait because pages it had to give back
were still in use (each a stall on a GPU), and in brackets the operations the device still had to run
for them (the stalls' length). Several lags (``--device-lag 20,100,1000``) give a row per trace and lag:
a layout whose remapping changes with the lag is one the GPU may not reproduce (docs/benchmarks.md).
``--passes N`` replays each trace N times in one pool and reports the last pass (mapped bytes, units, driver
time, waits), as the steady steps of a run; the lowest capacity is always one pass's. ``--bound limit`` bounds
the pool with a limit on a full-size device instead of the device's capacity: what a memory fraction
does on the GPU (bench/pressure.py), where the pool knows the user set a bound and, when it leaves room
above the settled live high water, remaps whole 8 MiB groups (pool_release.cpp, ``bound_is_roomy``).
``--bound device`` leaves the pool that much of a full-size device, the rest held outside it (another
process, a library's own cudaMalloc): nothing tells the pool where the device ends until a map is refused
(pool_release.cpp, ``learn_device_room``); ``--elsewhere-freed-after K`` gives that memory back to the
device after pass K, and the passes after it show whether the pool grows into it or keeps remapping.

    python bench/remap_at_cap.py                       # bench/traces/*.trace.gz and the bundled traces
    python bench/remap_at_cap.py bench/traces/fbs_bert.trace.gz --release high_water
    python bench/remap_at_cap.py --release high_water --release-slack 0.03 --device-lag 100 --passes 6
    python bench/remap_at_cap.py --device-lag 100      # and the waits for a device running behind
    python bench/remap_at_cap.py --device-lag 20,100,1000 --passes 3 bench/traces/ckpt.trace.gz
    python bench/remap_at_cap.py --device-lag 20,100,1000 --passes 3 --bound limit   # as the GPU bench
    python bench/remap_at_cap.py --device-lag 20,100,1000 --passes 4 --bound limit --no-park-lent
    python bench/remap_at_cap.py --device-lag 100 --passes 3 --bound device --elsewhere-freed-after 1

Bytes mapped beyond the uncapped figure are pages given back and mapped again because of the cap:
each such unit costs driver calls on the GPU (and, when its last use may still be running, a wait).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pressure_workloads import release_slack_arg  # the same check as the GPU benches' (no torch)

HERE = Path(__file__).resolve().parent


def measure(trace: str, release: str, factors=(1.02, 1.05), device_lag: int = 0,
            passes: int = 1, bound: str = "capacity", release_slack: float | None = None,
            elsewhere_freed_after: int | None = None, stitch: bool = True,
            ends_by_page: bool = False, early_ends_by_page: float | None = None,
            park_lent: bool = True) -> dict:
    from gpumem.replay import bound_keywords, min_capacity, replay

    policy = dict(release=release, release_slack=release_slack, stitch=stitch, ends_by_page=ends_by_page,
                  early_ends_by_page=early_ends_by_page, park_lent=park_lent)
    uncapped = replay(trace, device_lag=device_lag, passes=passes, **policy)
    peak = uncapped.peak_live_bytes
    row = dict(trace=Path(trace).name.split(".")[0], release=release, release_slack=release_slack,
               device_lag=device_lag, passes=passes, bound=bound, peak_live_bytes=peak,
               elsewhere_freed_after=elsewhere_freed_after)
    reports = [("uncapped", uncapped)] + [
        (f"x{factor}", replay(trace, device_lag=device_lag, passes=passes, **policy,
                              **bound_keywords(bound, int(factor * peak)),
                              elsewhere_freed_after=elsewhere_freed_after))
        for factor in factors]
    for key, report in reports:
        row[key] = dict(mapped_bytes=report.mapped_bytes, upstream_calls=report.upstream_calls,
                        retries=report.retries,
                        physical_units=report.physical_units, ooms=report.ooms,
                        fragmentation=report.fragmentation, waits=report.waits,
                        waited_operations=report.waited_operations, driver_ms=report.driver_ms)
    row["min_capacity"] = min_capacity(trace, device_lag=device_lag, bound=bound, **policy).ratio
    return row


def table_line(row: dict, lagged: bool) -> str:
    """One row of the table: a trace at one device lag."""
    cols = [row[k] for k in ("uncapped", "x1.02", "x1.05")]
    gib = [c["mapped_bytes"] / 2**30 for c in cols]
    units = [c["physical_units"] for c in cols]
    waits = (f"{cols[1]['waits']:10d} ({cols[1]['waited_operations']:5d}) "
             f"{cols[2]['waits']:3d} ({cols[2]['waited_operations']:5d})  ") if lagged else ""
    driver = [c["driver_ms"] or 0.0 for c in cols]
    ooms = cols[1]["ooms"] + cols[2]["ooms"]
    return (f"{row['trace']:11s} {row['device_lag']:5d} {gib[0]:20.2f} {gib[1]:7.2f} {gib[2]:7.2f}   "
            f"{units[0]:15d} {units[1]:6d} {units[2]:6d}  {driver[1]:16.1f} {driver[2]:6.1f}  {ooms:4d}  "
            f"{waits}{row['min_capacity']:.4f}x")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*",
                    help="trace files (default: bench/traces/ and gpumem's bundled ones)")
    ap.add_argument("--release", default="lazy", choices=("lazy", "high_water"))
    ap.add_argument("--release-slack", type=release_slack_arg, default=None, metavar="S",
                    help="high_water's slack above the live high water (default gpumem's, 0.005)")
    ap.add_argument("--device-lag", default="0", metavar="OPS[,OPS...]",
                    help="the device runs OPS operations behind the replay; adds the waits; several: a row "
                         "per trace and lag (default 0)")
    ap.add_argument("--no-stitch", dest="stitch", action="store_false",
                    help="the pool's stitch option off (GPUMEM_CONF stitch:false), as in "
                         "docs/benchmarks.md's figures of this bench measured before 2026-11-27")
    ap.add_argument("--ends-by-page", action="store_true",
                    help="the pool's ends_by_page option on (GPUMEM_CONF ends_by_page:true): under a bound "
                         "that is not roomy, a block's end pages mapped one by one")
    ap.add_argument("--early-ends-by-page", type=release_slack_arg, default=None, metavar="F",
                    help="the pool's early_ends_by_page option (GPUMEM_CONF early_ends_by_page; default the "
                         "pool's, 0.1): under a bound, the blocks mapped while the live high water is below F "
                         "of it map their end pages one by one; 0 never")
    ap.add_argument("--no-park-lent", dest="park_lent", action="store_false",
                    help="the pool's park_lent option off (GPUMEM_CONF park_lent:false; on by default: "
                         "under a roomy bound, units lent while draining stay mapped where they were, "
                         "taken back with no driver call), as in docs/benchmarks.md's figures of this bench "
                         "measured before 2026-11-28")
    ap.add_argument("--passes", type=int, default=1, metavar="N",
                    help="replay each trace N times in one pool, report the last pass (default 1)")
    ap.add_argument("--bound", default="capacity", choices=("capacity", "limit", "device"),
                    help="what 1.02x and 1.05x (and the lowest 0-OOM bound) set: the simulated device's "
                         "capacity (default); a limit on its default size, as "
                         "set_per_process_memory_fraction sets on a GPU (what bench/pressure.py caps); or "
                         "the default device with the rest held outside the pool, which learns where the "
                         "device ends only when it refuses a map (bench/pressure.py --bound device)")
    ap.add_argument("--elsewhere-freed-after", type=int, default=None, metavar="K",
                    help="--bound device: the memory held outside the pool goes back to the device after "
                         "pass K of --passes (the 1.02x and 1.05x rows; the pool should grow into it)")
    ap.add_argument("--json", action="store_true",
                    help="one JSON line per trace (and lag) instead of the table")
    args = ap.parse_args(argv)
    try:
        lags = [int(x) for x in args.device_lag.split(",")]
    except ValueError:
        ap.error("--device-lag takes whole numbers of operations separated by commas, "
                 f"got {args.device_lag!r}")
    if any(lag < 0 for lag in lags):
        ap.error(f"--device-lag {args.device_lag}: {min(lags)} is negative")
    if args.passes < 1:
        ap.error(f"--passes {args.passes}: at least 1")
    if args.elsewhere_freed_after is not None:
        if args.bound != "device":
            ap.error("--elsewhere-freed-after applies to --bound device")
        if not 1 <= args.elsewhere_freed_after < args.passes:
            ap.error(f"--elsewhere-freed-after {args.elsewhere_freed_after}: a pass from 1 to --passes - 1 "
                     f"({args.passes - 1})")
    if args.release_slack is not None and args.release != "high_water":
        ap.error("--release-slack applies to --release high_water")
    lagged = any(lag > 0 for lag in lags)
    from gpumem.replay import bundled_traces

    traces = args.traces or sorted(str(p) for p in (HERE / "traces").glob("*.trace.gz")) + \
        [str(p) for p in bundled_traces()]
    if not args.json:
        print(f"{'trace':11s} {'lag':>5s} {'GiB mapped: uncapped':>20s} {'1.02x':>7s} {'1.05x':>7s}   "
              f"{'units: uncapped':>15s} {'1.02x':>6s} {'1.05x':>6s}  {'driver ms: 1.02x':>16s} "
              f"{'1.05x':>6s}  {'OOMs':>4s}  "
              + (f"{'waits (ops): 1.02x':>18s} {'1.05x':>11s}  " if lagged else "")
              + {"capacity": "min capacity", "limit": "min limit", "device": "min room"}[args.bound])
    for trace in traces:
        for lag in lags:
            try:
                row = measure(trace, args.release, device_lag=lag, passes=args.passes, bound=args.bound,
                              release_slack=args.release_slack, elsewhere_freed_after=args.elsewhere_freed_after,
                              stitch=args.stitch, ends_by_page=args.ends_by_page,
                              early_ends_by_page=args.early_ends_by_page, park_lent=args.park_lent)
            except ValueError as e:  # a malformed or unreadable trace: said once, the others go on
                print(f"{trace}: {e}", file=sys.stderr)
                break
            print(json.dumps(row) if args.json else table_line(row, lagged), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
