"""What growing the pool costs, per allocator: why gpumem's uncapped step can be slower on varlen.

    python bench/growth_cost.py [--allocators native,expandable,gpumem,...] [--json OUT.json]
                                [--dry-run] [--device cpu]

One process per allocator (bench/pressure_workloads.py's native, expandable, gpumem = release:lazy,
gpumem_hw = release:high_water; and two gpumem variants: gpumem_noipc = ipc:false, pages created
without the POSIX file descriptor handle type; gpumem_p20 = page_size:20MiB, PyTorch's expandable
segments' handle size for its large pool), each measuring

 (a) grow: one fresh uint8 tensor of 64 MiB, 256 MiB, 1 GiB and 4 GiB on an empty pool
     (empty_cache() before each; the reserved bytes left are recorded), synchronised: wall ms per GiB
     (median of 3), and, at 4 GiB, what writing the new memory once costs (fill ms per GiB);
 (b) varlen: bench/pressure_workloads.py's varlen workload (GPT training, a new length every step),
     each step synchronised and timed, twice over the same 14 steps: pass 1 grows the pool as the
     pressure benchmark's run does, pass 2 finds it grown. Per step, the deltas of the counters
     num_device_alloc (maps / cudaMalloc calls), num_device_free, num_sync_all_streams and
     num_alloc_retries (torch.cuda.memory_stats(); gpumem.stats() for gpumem, the same keys) and
     reserved bytes;

and one process without torch's allocator measuring

 (c) map: gpumem's map path alone (its core Pool on the vmm upstream): 1 GiB allocated on a fresh
     pool (the pages mapped: cuMemCreate + cuMemMap per page, one cuMemSetAccess) and given back
     (trim: cuMemUnmap + cuMemRelease per page), pages of 2, 8 (the default), 20 and 32 MiB, with and
     without the file descriptor handle type (cuda_upstream(exportable=...)); median of 3.

If gpumem's pass-1 steps that map pages are the slow ones and pass 2 runs at native's speed, the
growth is the cost, and (a)/(c) say how much of it the per-page driver calls are. Prints one report
(three tables); --json writes every figure, per step. About 2 minutes on an H100.
--dry-run prints the plan; --device cpu runs (a) and (b) tiny on the CPU, allocator none (the code
path CI covers; no figure means anything there).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import pressure_workloads as pw  # noqa: E402  (imports no torch)

MiB, GiB = 1 << 20, 1 << 30
# allocator -> (pressure_workloads allocator, GPUMEM_CONF or None)
ALLOCATORS = {
    "native": ("native", None),
    "expandable": ("expandable", None),
    "gpumem": ("gpumem", "release:lazy"),
    "gpumem_hw": ("gpumem_hw", "release:high_water"),
    "gpumem_noipc": ("gpumem", "release:lazy,ipc:false"),
    "gpumem_p20": ("gpumem", "release:lazy,page_size:20MiB"),
}
GROW_SIZES = (64 * MiB, 256 * MiB, 1 * GiB, 4 * GiB)
MAP_PAGES = (2 * MiB, 8 * MiB, 20 * MiB, 32 * MiB)
REPEATS = 3
COUNTERS = ("num_device_alloc", "num_device_free", "num_sync_all_streams", "num_alloc_retries")
WORKER_TIMEOUT_S = 150


# ----------------------------------------------------------------------------- the workers


def select(name: str) -> None:
    """Make `name` torch's CUDA allocator, before torch starts CUDA."""
    base, conf = ALLOCATORS[name]
    if conf is None:
        pw.select_allocator(base, None)
    else:
        os.environ["GPUMEM_CONF"] = conf  # read when gpumem is imported
        import gpumem  # noqa: F401  registers itself as torch's CUDA allocator


def shareable(torch) -> str:
    """Whether a CUDA tensor of this process can be shared with another (its storage exported):
    'yes', or the first line of the error (gpumem's ipc:false says so)."""
    t = torch.ones(1 << 20, device="cuda")
    try:
        t.untyped_storage()._share_cuda_()
        return "yes"
    except RuntimeError as e:
        return str(e).splitlines()[0][:160]


def counters(torch, gpumem_stats) -> dict:
    stats = gpumem_stats() if gpumem_stats else torch.cuda.memory_stats()
    out = {k: int(stats.get(k, 0)) for k in COUNTERS}
    out["reserved"] = int(stats.get("reserved_bytes.all.current", 0))
    return out


def grow(torch, device, tiny) -> list:
    """(a): per size, the median ms per GiB of allocating a fresh tensor on an empty pool."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    empty = torch.cuda.empty_cache if cuda else (lambda: None)
    device_calls = (lambda: torch.cuda.memory_stats().get("num_device_alloc", 0)) if cuda else (lambda: 0)
    rows = []
    for size in GROW_SIZES:
        n = size // 1024 if tiny else size
        alloc_ms, fill_ms, reserved_before, reserved_after, calls = [], [], [], [], []
        for _ in range(REPEATS):
            empty()
            sync()
            reserved_before.append(torch.cuda.memory_reserved() if cuda else 0)
            before = device_calls()
            t0 = time.perf_counter()
            x = torch.empty(n, dtype=torch.uint8, device=device)
            sync()
            t1 = time.perf_counter()
            x.fill_(1)
            sync()
            t2 = time.perf_counter()
            reserved_after.append(torch.cuda.memory_reserved() if cuda else 0)
            calls.append(device_calls() - before)
            alloc_ms.append(1000 * (t1 - t0))
            fill_ms.append(1000 * (t2 - t1))
            del x
        rows.append(dict(bytes=n, alloc_ms=statistics.median(alloc_ms), fill_ms=statistics.median(fill_ms),
                         alloc_ms_per_gib=statistics.median(alloc_ms) * GiB / n,
                         fill_ms_per_gib=statistics.median(fill_ms) * GiB / n,
                         device_alloc_calls=max(calls), reserved_before=max(reserved_before),
                         reserved_after=max(reserved_after)))
    empty()
    return rows


def varlen(torch, device, tiny, gpumem_stats) -> list:
    """(b): every step of two passes over varlen's steps, timed, with the counters' deltas."""
    pw.DEVICE = device
    steps, _, step = pw.make_workload("varlen", torch, tiny, seed=0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cuda = device.type == "cuda"
    rows = []
    for pass_ in (1, 2):
        for i in range(steps):
            sync()
            c0 = counters(torch, gpumem_stats) if cuda else None
            t0 = time.perf_counter()
            step(i)
            sync()
            ms = 1000 * (time.perf_counter() - t0)
            row = dict(pass_=pass_, step=i, batch=step.shapes[i][0], length=step.shapes[i][1], ms=ms)
            if cuda:
                c1 = counters(torch, gpumem_stats)
                row.update({k: c1[k] - c0[k] for k in COUNTERS}, reserved=c1["reserved"],
                           reserved_delta=c1["reserved"] - c0["reserved"])
            rows.append(row)
    return rows


def worker(name: str, device_name: str) -> dict:
    if device_name == "cuda":
        select(name)
    import torch

    device = torch.device(device_name)
    tiny = device.type == "cpu"
    gpumem_stats, conf = None, None
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)
        if name.startswith("gpumem"):
            import gpumem

            if not gpumem.is_active():
                raise SystemExit(f"{name}: gpumem is not torch's allocator: {gpumem.status_line()}")
            gpumem_stats, conf = gpumem.stats, os.environ.get("GPUMEM_CONF")
    torch.backends.cudnn.benchmark = False
    out = dict(allocator=name, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               gpumem_conf=conf)
    out["grow"] = grow(torch, device, tiny)
    out["varlen"] = varlen(torch, device, tiny, gpumem_stats)
    if device.type == "cuda":  # last: exporting leaves file descriptors and a shared ref counter behind
        out["shareable"] = shareable(torch)
    return out


def map_worker() -> dict:
    """(c), gpumem's core alone: no torch allocator, so nothing else maps or holds memory."""
    from gpumem import _C

    if not _C.cuda_vmm_supported(0):
        raise SystemExit("device 0 has no virtual memory management: no map path to measure")
    rows = []
    for exportable in (True, False):
        for page in MAP_PAGES:
            pool = _C.Pool(_C.cuda_upstream("vmm", 0, exportable), page_size=page)
            pool.trim()
            map_ms, unmap_ms = [], []
            for r in range(REPEATS + 1):  # the first maps the arena's address range too: not counted
                t0 = time.perf_counter()
                p = pool.allocate(GiB, 0)
                t1 = time.perf_counter()
                pool.free(p)
                released = pool.trim()
                t2 = time.perf_counter()
                if released < GiB:
                    raise SystemExit(f"trim() gave back {released} bytes, not the 1 GiB just mapped")
                if r:
                    map_ms.append(1000 * (t1 - t0))
                    unmap_ms.append(1000 * (t2 - t1))
            del pool
            m, u = statistics.median(map_ms), statistics.median(unmap_ms)
            pages = GiB // page
            rows.append(dict(page=page, exportable=exportable, map_ms_per_gib=m, unmap_ms_per_gib=u,
                             map_us_per_page=1000 * m / pages, unmap_us_per_page=1000 * u / pages))
    return dict(map=rows)


# ----------------------------------------------------------------------------- the driver


def run_worker(args_list) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *args_list]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("GPUMEM_CONF", None)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return dict(error=f"over {WORKER_TIMEOUT_S} s")
    line = next((x for x in reversed(r.stdout.splitlines()) if x.startswith("{")), None)
    if r.returncode != 0 or line is None:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return dict(error=" | ".join(tail) or f"exit {r.returncode}")
    return json.loads(line)


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def varlen_summary(rows) -> dict:
    """Per pass: mean ms of the timed steps (the first step of pass 1 is the warm-up, as in the
    pressure benchmark), how many grew reserved, their mean ms and the others', and counter totals."""
    out = {}
    for pass_ in (1, 2):
        timed = [r for r in rows if r["pass_"] == pass_ and (pass_ == 2 or r["step"] > 0)]
        grew = [r for r in timed if r.get("num_device_alloc", 0) > 0]
        rest = [r for r in timed if r.get("num_device_alloc", 0) == 0]
        out[pass_] = dict(ms=mean([r["ms"] for r in timed]), steps=len(timed), grew=len(grew),
                          ms_grew=mean([r["ms"] for r in grew]), ms_rest=mean([r["ms"] for r in rest]),
                          **{k: sum(r.get(k, 0) for r in timed) for k in COUNTERS})
    return out


def report(results: dict, map_result: dict | None) -> str:
    lines = ["(a) grow: ms per GiB to allocate one fresh tensor on an empty pool (median of 3); fill: ms per "
             "GiB to write the new 4 GiB once; calls: device allocation calls for the 4 GiB tensor; "
             "res64: MiB reserved holding the 64 MiB tensor (page rounding); left: most MiB still reserved "
             "after empty_cache() before a measurement (0: the pool was empty); share: a tensor exported "
             "for IPC",
             f"{'allocator':13s} {'64MiB':>7s} {'256MiB':>7s} {'1GiB':>7s} {'4GiB':>7s} {'fill':>6s} "
             f"{'calls':>5s} {'res64':>5s} {'left':>5s}  share"]
    for name, res in results.items():
        if res.get("error"):
            lines.append(f"{name:13s} error: {res['error']}")
            continue
        g = res["grow"]
        left = max(r["reserved_before"] for r in g) // MiB
        lines.append(f"{name:13s} " + " ".join(f"{fmt(r['alloc_ms_per_gib'], '.2f'):>7s}" for r in g)
                     + f" {fmt(g[-1]['fill_ms_per_gib'], '.2f'):>6s} {g[-1]['device_alloc_calls']:>5d} "
                     f"{g[0]['reserved_after'] // MiB:>5d} {left:>5d}  {res.get('shareable', '-')}")
    lines += ["", "(b) varlen, its steps twice: ms/step (pass 1: all but the first step, as pressure.py "
              "times; pass 2: the same steps on the grown pool); grew: steps that took device memory; "
              "maps/frees/syncs/retries: counter totals over the timed steps; max res: most bytes reserved",
              f"{'allocator':13s} {'pass':>4s} {'ms/step':>8s} {'grew':>5s} {'ms grew':>8s} {'ms rest':>8s} "
              f"{'maps':>6s} {'frees':>6s} {'syncs':>6s} {'retries':>7s} {'max res GiB':>11s}"]
    for name, res in results.items():
        if res.get("error"):
            continue
        s = varlen_summary(res["varlen"])
        top = max((r.get("reserved", 0) for r in res["varlen"]), default=0) / GiB
        for pass_ in (1, 2):
            p = s[pass_]
            lines.append(f"{name:13s} {pass_:>4d} {fmt(p['ms']):>8s} {p['grew']:>2d}/{p['steps']:<2d} "
                         f"{fmt(p['ms_grew']):>8s} {fmt(p['ms_rest']):>8s} {p['num_device_alloc']:>6d} "
                         f"{p['num_device_free']:>6d} {p['num_sync_all_streams']:>6d} "
                         f"{p['num_alloc_retries']:>7d} {top:>11.2f}")
    lines += ["", "(c) gpumem's map path alone (core Pool, vmm upstream, 1 GiB, median of 3): fd = pages "
              "created with the POSIX file descriptor handle type (ipc:true, the default)"]
    if map_result is None:
        lines.append("not run (no CUDA device)")
    elif map_result.get("error"):
        lines.append(f"error: {map_result['error']}")
    else:
        lines.append(f"{'page MiB':>8s} {'fd':>3s} {'map ms/GiB':>10s} {'unmap ms/GiB':>12s} "
                     f"{'map us/page':>11s} {'unmap us/page':>13s}")
        for r in map_result["map"]:
            lines.append(f"{r['page'] // MiB:>8d} {'yes' if r['exportable'] else 'no':>3s} "
                         f"{r['map_ms_per_gib']:>10.2f} {r['unmap_ms_per_gib']:>12.2f} "
                         f"{r['map_us_per_page']:>11.1f} {r['unmap_us_per_page']:>13.1f}")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--allocators", default=",".join(ALLOCATORS),
                    help=f"comma-separated, from {','.join(ALLOCATORS)} (default: all)")
    ap.add_argument("--json", help="write every figure, per step, to this file")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: (a) and (b) tiny on the CPU, allocator none, no (c) (CI)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)      # one allocator's process
    ap.add_argument("--map-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.allocators = [a for a in args.allocators.split(",") if a]
    bad = [a for a in args.allocators if a not in ALLOCATORS]
    if bad or not args.allocators:
        ap.error(f"unknown allocator(s) {bad}; choose from {','.join(ALLOCATORS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.device)), flush=True)
        return 0
    if args.map_worker:
        print(json.dumps(map_worker()), flush=True)
        return 0
    allocators = args.allocators if args.device == "cuda" else ["none"]
    pages = ", ".join(f"{p // MiB}" for p in MAP_PAGES)
    print(f"device {args.device}; allocators {', '.join(allocators)}: (a) grow {len(GROW_SIZES)} sizes x "
          f"{REPEATS}, (b) varlen twice" + (f"; (c) map path, pages {pages} MiB, with and without the fd "
                                            "handle type" if args.device == "cuda" else ""), flush=True)
    if args.dry_run:
        return 0
    start = time.monotonic()
    results = {}
    for name in allocators:
        t0 = time.monotonic()
        worker_name = name if name != "none" else "native"  # on the CPU no allocator is selected
        results[name] = run_worker(["--worker", worker_name, "--device", args.device])
        print(f"{name}: {time.monotonic() - t0:.0f} s" + (f"  error: {results[name]['error']}"
                                                          if results[name].get("error") else ""), flush=True)
    map_result = run_worker(["--map-worker"]) if args.device == "cuda" else None
    print(report(results, map_result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(results=results, map=map_result, seconds=time.monotonic() - start), f, indent=1)
    return 0 if all(not r.get("error") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
