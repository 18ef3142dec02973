"""The README's pictures of the report: docs/images/report.png (the top of the page) and
docs/images/report_timeline.png (its timeline), from the bundled PyTorch-format example snapshot,
rendered by headless Chromium.

    python tools/report_images.py            # needs gpumem installed, Chromium and Pillow
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
import headless

from gpumem.report import examples, report

OUT = Path(__file__).resolve().parents[1] / "docs" / "images"


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    example = next(p for p in examples() if ".pickle" in p.name)
    with tempfile.TemporaryDirectory() as d:
        page = report(Path(d) / "report.html", snapshot=example)
        st = headless.state(headless.dump_dom(page, window=(1280, 1500)))
        if st["rendered"] != "ok" or st["errors"]:
            raise SystemExit(f"the page did not render: {st}")
        png = headless.screenshot(page, Path(d) / "shot.png", window=(1280, 1500))
        img = Image.open(png).convert("RGB")
        img.save(OUT / "report.png", optimize=True)
        x, y, w, h = st["rects"]["timeline"]
        img.crop((x - 8, y - 34, x + w + 8, y + h + 3)).save(OUT / "report_timeline.png", optimize=True)
    for name in ("report.png", "report_timeline.png"):
        print(f"{OUT / name}: {(OUT / name).stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
