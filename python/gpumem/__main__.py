"""Command line (``python -m gpumem`` or the ``gpumem`` script): ``replay [TRACE ...]`` replays allocation
traces through the pool on a simulated device; ``status [--watch [SECONDS]] [--json]`` shows every GPU's
memory and processes; ``run [--quiet] [--status] SCRIPT|-m MODULE [ARGS ...]`` runs an unchanged script
with gpumem as torch's allocator (``gpumem.run``); ``report SNAPSHOT [-o FILE]`` writes the HTML memory
report of a snapshot file (``gpumem.report``)."""
from __future__ import annotations

import argparse
import os
import sys
import time

from . import _C, status
from . import run as run_cmd
from ._format import fmt_in
from .replay import bundled_traces, min_capacity, print_progress, reference_ratios, replay


def _gib(n: int) -> str:
    return fmt_in(n, "GiB", digits=3)


def cmd_replay(args: argparse.Namespace) -> int:
    traces = args.trace or [str(p) for p in bundled_traces()]
    try:
        capacity = None if args.capacity is None else _C.parse_size(args.capacity)
        page_size = None if args.page_size is None else _C.parse_size(args.page_size)
        if page_size is not None and (page_size == 0 or page_size % (2 << 20)):
            raise ValueError(f"--page-size {args.page_size} is not a multiple of 2MiB (CUDA's granularity)")
    except ValueError as e:
        print(f"gpumem replay: {e}", file=sys.stderr)
        return 2
    if args.device_lag < 0:
        print(f"gpumem replay: --device-lag {args.device_lag} is negative (operations the device runs "
              "behind; 0 = none)", file=sys.stderr)
        return 2
    if args.passes < 1:
        print(f"gpumem replay: --passes {args.passes} is below 1 (times each trace is replayed)",
              file=sys.stderr)
        return 2
    if args.stitch_slack is not None and not 0 <= args.stitch_slack <= 1:  # NaN too
        print(f"gpumem replay: --stitch-slack {args.stitch_slack} is not a fraction in [0, 1]",
              file=sys.stderr)
        return 2
    if args.stitch_slack is not None and args.min_capacity:
        print("gpumem replay: --stitch-slack applies to the replay table, not to --min-capacity",
              file=sys.stderr)
        return 2
    if args.min_capacity:
        if not 0 < args.tolerance < 1:
            print(f"gpumem replay: --tolerance {args.tolerance} is not a fraction in (0, 1)", file=sys.stderr)
            return 2
        if capacity is not None:
            print("gpumem replay: --min-capacity searches the capacity itself; drop --capacity",
                  file=sys.stderr)
            return 2
        return _min_capacity(args, traces, page_size)
    refs = reference_ratios()
    reports = []
    for path in traces:
        progress = None if (args.json or args.quiet) else print_progress
        if progress:
            print(f"{path}:", file=sys.stderr)
        try:
            reports.append(replay(path, upstream=args.upstream, capacity=capacity, page_size=page_size,
                                  release=args.release, progress=progress, device_lag=args.device_lag,
                                  passes=args.passes, stitch=args.stitch, stitch_slack=args.stitch_slack))
        except (ValueError, FileNotFoundError) as e:
            print(f"gpumem replay: {e}", file=sys.stderr)
            return 1
    if args.json:
        for r in reports:
            print(r.to_json())
        return 0
    lagged = args.device_lag > 0
    print(f"\ngpumem pool, upstream={args.upstream}, release={args.release}"
          + ("" if args.stitch else ", no stitch")
          + ("" if args.stitch_slack is None else f", stitch slack {args.stitch_slack:g}")
          + ", simulated device of "
          f"{_gib(reports[0].capacity_bytes)} GiB, pages of {reports[0].page_size >> 20} MiB"
          + (f", running {args.device_lag} operations behind" if lagged else "")
          + (f", {args.passes} passes (calls and waits: the last one's)" if args.passes > 1 else ""))
    header = (f"{'trace':<14} {'peak live GiB':>13} {'peak reserved GiB':>17} {'ratio':>7} "
              f"{'upstream calls':>14} {'ns/pair':>8} {'OOMs':>5} " + (f"{'waits':>6} " if lagged else "")
              + "| PyTorch live on H200: native / expandable / async")
    print(header)
    print("-" * len(header))
    for r in reports:
        ref = refs.get(r.workload)
        ref_text = (f"{ref['native']:.3f} / {ref['expandable_segments']:.3f} / {ref['cudaMallocAsync']:.3f}"
                    if ref else "n/a")
        print(f"{r.workload:<14} {_gib(r.peak_live_bytes):>13} {_gib(r.peak_reserved_bytes):>17} "
              f"{r.fragmentation:>7.4f} {r.upstream_calls:>14,} {r.ns_per_pair:>8.1f} {r.ooms:>5} "
              + (f"{r.waits:>6} " if lagged else "") + f"| {ref_text}")
        if r.ooms:
            print(f"  first OOM: {r.first_oom}")
    print("\nratio = peak reserved / peak live (lower is better; 1.0 is the floor). "
          "ns/pair = CPU time of the pool per allocate+free."
          + (" waits = times the pool made the host wait for the device (pages it had to give back "
             "were still in use)." if lagged else ""))
    return 0


def _min_capacity(args: argparse.Namespace, traces: list, page_size: int | None) -> int:
    results = []
    for path in traces:
        if not (args.json or args.quiet):
            print(f"{path}: searching the lowest capacity with 0 OOMs", file=sys.stderr)
        try:
            results.append(min_capacity(path, tolerance=args.tolerance, upstream=args.upstream,
                                        page_size=page_size, release=args.release,
                                        device_lag=args.device_lag, passes=args.passes, stitch=args.stitch))
        except (ValueError, FileNotFoundError) as e:
            print(f"gpumem replay: {e}", file=sys.stderr)
            return 1
    if args.json:
        for m in results:
            print(m.to_json())
        return 0
    page = (page_size or _C.DEFAULT_PAGE_SIZE) >> 20
    print(f"\ngpumem pool, upstream={args.upstream}, release={args.release}"
          + ("" if args.stitch else ", no stitch") + f", pages of {page} MiB: "
          f"lowest simulated device capacity with 0 OOMs")
    header = (f"{'trace':<14} {'peak live GiB':>13} {'min capacity GiB':>16} {'x peak live':>11} "
              f"{'fails at':>9} {'replays':>7}")
    print(header)
    print("-" * len(header))
    for m in results:
        note = "  (not monotone in the capacity: a higher one failed)" if m.non_monotone else ""
        print(f"{m.workload:<14} {_gib(m.peak_live_bytes):>13} {_gib(m.capacity_bytes):>16} {m.ratio:>11.4f} "
              f"{m.failed_below:>9.4f} {m.replays:>7}{note}")
    print(f"\nx peak live = min capacity / peak live bytes, bisected to {100 * args.tolerance:g}% of peak "
          "live; fails at = the highest capacity tried below it that had an OOM.")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .report import examples, report

    if args.example:
        if args.snapshot:
            print("gpumem report: give a SNAPSHOT or --example, not both", file=sys.stderr)
            return 2
        args.snapshot = str(examples()[0])
    if not args.snapshot:
        print("gpumem report: give a snapshot file (torch.cuda.memory._dump_snapshot's pickle or gpumem's "
              "JSON); a process reports on itself with gpumem.report() inside it", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        out = report(args.output, snapshot=args.snapshot, device=args.device)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"gpumem report: {e}", file=sys.stderr)
        return 2
    print(f"{out}: report of {args.snapshot} ({out.stat().st_size:,} bytes, written in "
          f"{time.perf_counter() - t0:.2f} s)")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    return status.run(args)


def _prog() -> str:
    """``python -m gpumem`` when run so, else the script's name (``gpumem``), for usage lines."""
    arg0 = sys.argv[0] if sys.argv else ""
    if not arg0 or arg0 == "-m" or os.path.basename(arg0) == "__main__.py":
        return "python -m gpumem"
    return os.path.basename(arg0)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    prog = prog or _prog()
    parser = argparse.ArgumentParser(
        prog=prog, description="gpumem's command line: replay allocation traces through the pool on a "
                               "simulated device, show every GPU's memory and processes, run a "
                               "script with gpumem as PyTorch's CUDA allocator, or write the HTML "
                               "memory report of a snapshot.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{replay,status,run,report}")
    p = sub.add_parser("replay", help="replay allocation traces through the pool on a simulated device",
                       description="Replay allocation traces through gpumem's pool on a simulated device "
                                   "and print peak live, peak reserved, their ratio, upstream calls and "
                                   "the pool's CPU time per allocate+free.")
    p.add_argument("trace", nargs="*", metavar="TRACE",
                   help="trace files (default: the traces bundled with gpumem)")
    p.add_argument("--upstream", choices=["vmm", "segments"], default="vmm",
                   help="vmm: pages mapped on demand (default); segments: cudaMalloc-style regions")
    p.add_argument("--capacity", metavar="BYTES",
                   help="simulated device memory, e.g. 80GiB (default 141GiB, an H200)")
    p.add_argument("--page-size", metavar="BYTES",
                   help="vmm page size, a multiple of 2MiB (default: gpumem's, 8MiB)")
    p.add_argument("--release", choices=["lazy", "high_water"], default="lazy",
                   help="release policy (default lazy, gpumem's default)")
    p.add_argument("--no-stitch", dest="stitch", action="store_false",
                   help="turn off the pool's stitch option (GPUMEM_CONF stitch:false; on by default: new "
                        "pages past the live high water backed by free cached pages' memory)")
    p.add_argument("--stitch-slack", type=float, default=None, metavar="FRACTION",
                   help="how far reserved grows past the live high water before the pool stitches "
                        "(GPUMEM_CONF stitch_slack; default the pool's, 0.01)")
    p.add_argument("--device-lag", type=int, default=0, metavar="OPS",
                   help="the simulated device runs OPS operations behind the replay, as a GPU runs behind "
                        "the host, and the table counts the waits the pool made for it (default 0: "
                        "every event has completed when recorded)")
    p.add_argument("--passes", type=int, default=1, metavar="N",
                   help="replay each trace N times in one pool, as epochs repeat the same steps (allocations "
                        "a trace never frees are made once); upstream calls and waits are the last pass's, "
                        "the steady state (default 1)")
    p.add_argument("--min-capacity", action="store_true",
                   help="instead: the lowest simulated capacity at which each trace replays with 0 OOMs, "
                        "as a multiple of its peak live bytes (bisected to --tolerance)")
    p.add_argument("--tolerance", type=float, default=0.0025, metavar="FRACTION",
                   help="--min-capacity's resolution, a fraction of peak live bytes (default 0.0025)")
    p.add_argument("--json", action="store_true", help="one JSON line per trace")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_replay, subparser=p)
    s = sub.add_parser("status", help="every GPU's memory and processes (NVML)",
                       description=status.parser().description)
    status.add_arguments(s)
    s.set_defaults(func=cmd_status, subparser=s)
    # For --help and the usage line only: main() hands `run`'s arguments to gpumem.run untouched.
    r = sub.add_parser("run", help="run a script (or -m MODULE) with gpumem as torch's CUDA allocator",
                       description=run_cmd.DESCRIPTION)
    run_cmd.add_arguments(r)
    m = sub.add_parser("report", help="write the HTML memory report of a snapshot file",
                       description="Write one self-contained HTML page (no network needed to open it) "
                                   "from a memory snapshot: the allocated/reserved timeline with OOMs and "
                                   "empty_cache marked, the largest allocations and their stacks, the "
                                   "segments and their free holes, and a diagnosis.")
    m.add_argument("snapshot", nargs="?", metavar="SNAPSHOT",
                   help="torch.cuda.memory._dump_snapshot's pickle, or gpumem's JSON snapshot (gzip allowed)")
    m.add_argument("-o", "--output", default="gpumem-report.html", metavar="FILE",
                   help="the HTML file to write (default gpumem-report.html)")
    m.add_argument("--device", type=int, metavar="N",
                   help="the GPU to show (default: the one holding the most)")
    m.add_argument("--example", action="store_true", help="report the example snapshot bundled with gpumem")
    m.set_defaults(func=cmd_report, subparser=m)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (a bad option exits 2 through argparse)."""
    args_list = sys.argv[1:] if argv is None else list(argv)
    if args_list[:1] == ["run"]:  # the script's arguments must reach it untouched, `--help` included
        return run_cmd.main(args_list[1:], prog=f"{_prog()} run")
    parser = build_parser()
    args, extra = parser.parse_known_args(args_list)
    if extra:  # name the subcommand's usage, not the top level's, in the error (exit 2)
        args.subparser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args))
    except KeyboardInterrupt:  # Ctrl-C outside status's own loop (replay): no traceback
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
