"""Open a gpumem report in headless Chromium: its DOM after the script ran, and a screenshot.

Used by tests/test_report_browser.py, bench/report_bench.py and tools/report_images.py. The page
writes its state into the DOM (python/gpumem/report/page.js, page_trap.js): ``data-rendered``,
``data-errors``, ``data-render-ms`` on <html>, ``data-rect`` on each canvas, the errors' text in
``<pre id="errors">``; ``--dump-dom`` prints the DOM once the page has loaded, its script included.

    python tools/headless.py report.html [--png shot.png]     # prints the page's state as JSON
"""
from __future__ import annotations

import argparse
import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

WINDOW = (1280, 2200)
NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def find_browser() -> Optional[str]:
    """The path of a Chromium (Debian's `chromium` package) or Chrome, or None."""
    for name in NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _run(browser: str, args: Sequence[str], url: str, window: Tuple[int, int], timeout: float) -> str:
    with tempfile.TemporaryDirectory(prefix="gpumem-chromium-") as profile:
        cmd = [browser, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
               "--disable-extensions", "--hide-scrollbars", "--force-device-scale-factor=1",
               "--disable-dev-shm-usage", f"--user-data-dir={profile}",
               f"--window-size={window[0]},{window[1]}", *args, url]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{Path(browser).name} exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    return r.stdout


def dump_dom(page: Path, browser: Optional[str] = None, window: Tuple[int, int] = WINDOW,
             timeout: float = 120) -> str:
    """The page's DOM after its scripts ran."""
    return _run(browser or _need(), ["--dump-dom"], Path(page).resolve().as_uri(), window, timeout)


def screenshot(page: Path, png: Path, browser: Optional[str] = None, window: Tuple[int, int] = WINDOW,
               timeout: float = 120) -> Path:
    """A PNG of the top ``window`` of the page (device scale 1: CSS pixels are image pixels)."""
    _run(browser or _need(), [f"--screenshot={Path(png).resolve()}"], Path(page).resolve().as_uri(), window,
         timeout)
    if not Path(png).is_file():
        raise RuntimeError(f"the browser wrote no screenshot to {png}")
    return Path(png)


def _need() -> str:
    b = find_browser()
    if b is None:
        raise RuntimeError("no Chromium found (apt-get install chromium)")
    return b


def state(dom: str) -> Dict[str, Any]:
    """What the page wrote into its DOM: rendered, errors, render_ms, draw_ms, the canvases' rects."""
    m = re.search(r"<html\b[^>]*>", dom)
    root = m.group(0) if m else ""

    def attr(name: str) -> Optional[str]:
        a = re.search(rf'\b{name}="([^"]*)"', root)
        return a.group(1) if a else None

    rects = {}
    for cid, rect in re.findall(r'<canvas id="([^"]+)"[^>]*data-rect="([^"]+)"', dom):
        rects[cid] = tuple(int(v) for v in rect.split(","))
    body = dom[dom.find("<body"):]  # (the head's script mentions the element in its comments)
    err = re.search(r'<pre id="errors"[^>]*>(.*?)</pre>', body, re.S)
    return {"rendered": attr("data-rendered"), "errors": int(attr("data-errors") or -1),
            "error_text": html.unescape(err.group(1)) if err else "",
            "render_ms": float(attr("data-render-ms") or "nan"), "draw_ms": float(attr("data-draw-ms") or "nan"),
            "rects": rects}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="open a gpumem report in headless Chromium")
    ap.add_argument("page")
    ap.add_argument("--png", help="also save a screenshot here")
    args = ap.parse_args(argv)
    st = state(dump_dom(Path(args.page)))
    if args.png:
        screenshot(Path(args.page), Path(args.png))
    print(json.dumps(st))
    return 0 if st["rendered"] == "ok" and st["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
