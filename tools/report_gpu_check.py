"""The memory report on a GPU (run by the lead on the GPU machine; builds nothing; about a minute).

1. A short training run (a small MLP, Adam) with memory history on (Python and C++ stacks), an
   ``empty_cache()`` after the first steps, an out-of-memory error caught, and an exception whose
   traceback pins a 256 MiB tensor (as ``sys.last_exc`` after an error in a notebook); then
   ``gpumem.report()`` of the live process, ``torch.cuda.memory._dump_snapshot`` and the report of
   that file. Checked: the page's allocated figure equals ``torch.cuda.memory_allocated()``, the
   timeline ends there, one OOM and one empty_cache are marked, the traceback's 256 MiB is named,
   the holders name the model's parameters and Adam's state.
2. A snapshot of ``--events`` (default 10^6) trace events recorded live (small allocations and
   frees, Python stacks of the allocations), dumped, and reported.

Prints the time to write each report; with Chromium present, the time to open each (headless,
``tools/headless.py``); without it the pages are left in $OUT for rendering elsewhere. Which allocator
is torch's is whatever the environment makes it: gpumem (default), or PyTorch's own with
GPUMEM_DISABLE=1 (``--tag native``).

    OUT=/tmp/out python3 tools/report_gpu_check.py [--events 1000000] [--tag gpumem]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import gpumem  # torch's CUDA allocator from here (CUDA not started yet), unless GPUMEM_DISABLE=1

sys.path.insert(0, str(Path(__file__).resolve().parent))
import headless

from gpumem.report import load_snapshot
from gpumem.report.analyze import analyze

MiB = 1 << 20
FAILS = []


def check(ok: bool, what: str) -> None:
    print(f"  {'ok  ' if ok else 'FAIL'} {what}")
    if not ok:
        FAILS.append(what)


def pinned_by_a_traceback() -> None:
    """Leaves sys.last_exc/last_value/last_traceback as an uncaught error in a notebook cell would."""
    def step():
        activations = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")  # noqa: F841
        raise RuntimeError("a failed step (its 256 MiB of activations stay with the traceback)")
    try:
        step()
    except RuntimeError as e:
        sys.last_exc = sys.last_value = e  # type: ignore[attr-defined]
        sys.last_traceback = e.__traceback__


def train(steps: int = 30):
    model = torch.nn.Sequential(torch.nn.Linear(4096, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 8192),
                                torch.nn.GELU(), torch.nn.Linear(8192, 1024)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for i in range(steps):
        x = torch.randn(512, 4096, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i == 5:
            del x, loss
            torch.cuda.empty_cache()
    try:
        torch.empty(1 << 46, dtype=torch.uint8, device="cuda")  # 64 TiB: out of memory
    except torch.cuda.OutOfMemoryError:
        pass
    return model, opt


def page_data(page: Path) -> dict:
    """The figures a report page carries (its JSON block)."""
    text = page.read_text()
    return json.loads(text.split('id="report-data">', 1)[1].split("</script>", 1)[0].replace("<\\/", "</"))


def report_and_time(out: Path, snapshot=None, **kw) -> float:
    t0 = time.perf_counter()
    gpumem.report(out, snapshot=snapshot, _stacklevel=2, **kw)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--tag", default="native" if os.environ.get("GPUMEM_DISABLE") == "1" else "gpumem")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/gpumem-out"))
    out.mkdir(parents=True, exist_ok=True)
    tag = args.tag
    print(f"{gpumem.status_line()}; torch {torch.__version__}; {torch.cuda.get_device_name()}")
    results = {"tag": tag, "gpumem_active": gpumem.is_active()}
    if tag == "gpumem" and not gpumem.is_active():
        raise SystemExit(f"FAIL gpumem is not torch's allocator: {gpumem.status_line()}")

    # 1. a live training run
    torch.cuda.memory._record_memory_history(max_entries=200_000, context="all", stacks="all")
    model, opt = train()
    pinned_by_a_traceback()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    live = out / f"report_live_{tag}.html"
    results["live_write_s"] = report_and_time(live)
    snap_path = out / f"snapshot_train_{tag}.pickle"
    torch.cuda.memory._dump_snapshot(str(snap_path))
    results["file_write_s"] = report_and_time(out / f"report_train_{tag}.html", snapshot=snap_path)
    a = analyze(load_snapshot(snap_path))
    data = page_data(live)
    print(f"live report ({tag}): {data['diagnosis']}")
    check(data["totals"]["allocated"] == allocated,
          f"page's allocated {data['totals']['allocated']} == memory_allocated() {allocated}")
    check(data["timeline"]["amax"][-1] == allocated, "the timeline ends at memory_allocated()")
    check(data["timeline"]["ooms"] >= 1, f"OOM marked ({data['timeline']['ooms']})")
    check(data["timeline"]["empty_caches"] >= 1, f"empty_cache marked ({data['timeline']['empty_caches']})")
    tb = (data["holders"] or {}).get("traceback", {})
    check(tb.get("bytes", 0) >= 256 * MiB, f"traceback holds {tb.get('bytes')} bytes (>= 256 MiB)")
    kinds = (data["holders"] or {}).get("by_kind", {})
    check(kinds.get("parameters and buffers", 0) > 0 and kinds.get("optimizer state", 0) > 0,
          f"holders by kind: {kinds}")
    check(any(f[3] is False for x in data["allocations"] for f in x["frames"]), "C++ frames present")
    check(any("report_gpu_check.py" in x["site"] for x in data["allocations"]), "sites name this script")
    check(a["totals"]["allocated"] == data["totals"]["allocated"], "the dumped snapshot's figures match")
    del model, opt
    sys.last_exc = sys.last_value = sys.last_traceback = None  # type: ignore[attr-defined]
    torch.cuda.memory._record_memory_history(enabled=None)
    torch.cuda.empty_cache()

    # 2. a large trace
    if args.events:
        torch.cuda.memory._record_memory_history(max_entries=args.events, context="alloc", stacks="python")
        t0 = time.perf_counter()
        keep = []
        for i in range(args.events // 3 + 1000):  # alloc, free_requested, free_completed per tensor
            keep.append(torch.empty(((i * 7919) % 4096 + 1) * 1024, dtype=torch.uint8, device="cuda"))
            if len(keep) > 64:
                keep.pop((i * 31) % 64)
        results["record_s"] = time.perf_counter() - t0
        big = Path("/tmp") / f"snapshot_1e6_{tag}.pickle"  # too large to bring back from $OUT
        t0 = time.perf_counter()
        torch.cuda.memory._dump_snapshot(str(big))
        results["dump_s"] = time.perf_counter() - t0
        results["big_snapshot_bytes"] = big.stat().st_size
        results["big_write_s"] = report_and_time(out / f"report_1e6_{tag}.html", snapshot=big)
        tl = page_data(out / f"report_1e6_{tag}.html")["timeline"]
        results["big_events"] = tl["events"]
        check(tl["events"] >= 0.99 * args.events, f"{tl['events']:,} events in the large snapshot")
        torch.cuda.memory._record_memory_history(enabled=None)
        del keep

    browser = headless.find_browser()
    for page_path in sorted(out.glob(f"report_*_{tag}.html")):
        size = page_path.stat().st_size
        if browser:
            st = headless.state(headless.dump_dom(page_path, browser))
            check(st["rendered"] == "ok" and st["errors"] == 0,
                  f"{page_path.name} renders: {st['error_text']}")
            results[f"render_ms:{page_path.name}"] = st["render_ms"]
        print(f"{page_path.name}: {size:,} bytes")
    if not browser:
        print("no Chromium here: render the pages in $OUT elsewhere (tools/headless.py PAGE)")
    print(json.dumps(results))
    print(f"{len(FAILS)} check(s) failed" if FAILS else "all checks passed")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
