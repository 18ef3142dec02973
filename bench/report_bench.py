"""How long the memory report takes for a large snapshot: to write it, and to open it in a browser.

A snapshot of N trace events (default 10^6) is recorded by replaying the bundled ResNet-50 trace
over and over through gpumem's pool on a simulated device (tools/make_report_examples.py), saved in
PyTorch's format (a plain pickle, as torch.cuda.memory._dump_snapshot writes) and in gpumem's (JSON);
then for each: the time gpumem.report takes (read, check, reduce, write the page), the page's size,
and the time headless Chromium takes to open it (performance.now() when the page's script has drawn
everything, since navigation began; median of --runs). Without Chromium the render column says so.

    python bench/report_bench.py [--events 1000000] [--runs 3] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import headless  # noqa: E402
import make_report_examples  # noqa: E402

from gpumem.report import report  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3, help="browser openings per page (median)")
    ap.add_argument("--keep", help="keep the snapshots and pages in this folder")
    args = ap.parse_args()
    folder = Path(args.keep or tempfile.mkdtemp(prefix="gpumem-report-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    browser = headless.find_browser()
    rows = []
    for fmt, name in (("pytorch", "snapshot.pickle"), ("gpumem", "snapshot.json.gz")):
        t0 = time.perf_counter()
        rec = make_report_examples.record("segments" if fmt == "pytorch" else "vmm", args.events)
        snap = folder / name
        make_report_examples.write(rec, snap)
        made = time.perf_counter() - t0
        t0 = time.perf_counter()
        page = report(folder / f"report-{fmt}.html", snapshot=snap)
        write_s = time.perf_counter() - t0
        render_ms = None
        if browser:
            times = []
            for _ in range(args.runs):
                st = headless.state(headless.dump_dom(page, browser))
                if st["rendered"] != "ok" or st["errors"]:
                    raise SystemExit(f"{page} did not render: {st}")
                times.append(st["render_ms"])
            render_ms = statistics.median(times)
        rows.append({"format": fmt, "events": rec.events, "snapshot_bytes": snap.stat().st_size,
                     "record_s": round(made, 2), "write_s": round(write_s, 3),
                     "page_bytes": page.stat().st_size, "render_ms": render_ms,
                     "browser": Path(browser).name if browser else None})
    print(f"{'format':<8} {'events':>10} {'snapshot MB':>12} {'write s':>8} {'page KB':>8} {'render ms':>10}")
    for r in rows:
        render = f"{r['render_ms']:.0f}" if r["render_ms"] is not None else "no browser"
        print(f"{r['format']:<8} {r['events']:>10,} {r['snapshot_bytes'] / 1e6:>12.1f} {r['write_s']:>8.2f} "
              f"{r['page_bytes'] / 1e3:>8.0f} {render:>10}")
    print("write: gpumem.report() from the file (read, check, reduce, write the page); render: headless "
          "Chromium, from navigation to the end of drawing (median of %d)" % args.runs)
    print(json.dumps({"bench": "report", "rows": rows}))
    if not args.keep:
        print(f"(files in {folder}; --keep DIR to choose where)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
