"""The report page: one self-contained HTML file (styles, script and data inline; nothing fetched).

The analysed figures go in as one JSON block; a hand-written script draws the timeline and the
segment map on ``<canvas>`` and fills the tables. The title, the figures and the diagnosis are also
written into the HTML itself, so the page says the essentials with scripts off.

For tests and benchmarks the page reports on itself: ``window.onerror``, unhandled rejections and
``console.error`` are recorded into ``<html data-errors=N>`` and ``<pre id="errors">``; when drawing
has finished, ``<html data-rendered="ok" data-render-ms=...>`` (``performance.now()`` since the
navigation began) and each canvas's ``data-rect`` (its place on the page) are set. Headless Chromium's
``--dump-dom`` reads them back.
"""
from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any, Dict

from .._format import fmt_bytes

__all__ = ["render"]

_HERE = Path(__file__).parent


def _static(name: str) -> str:
    """A file of the page (page.css, page.js, page_trap.js), as it is inlined."""
    return (_HERE / name).read_text(encoding="utf-8")





_PAGE = """<!DOCTYPE html>
<html lang="en" data-errors="0" data-rendered="no">
<head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>gpumem report: $TITLE</title><style>$CSS</style><script>$TRAP</script></head>
<body><main>
<h1>GPU memory report</h1>
<div class="meta">$META</div>
<div class="cards">$CARDS</div>
<h2>Diagnosis</h2><p class="diag" id="diagnosis">$DIAGNOSIS</p>$NOTES
<h2>Allocated and reserved over time</h2>
<div class="legend"><span><i style="background:#1f77b4"></i>allocated</span>
<span><i style="background:#ff7f0e"></i>reserved</span>
<span><i style="background:#d62728"></i>out of memory</span>
<span><i style="background:#2ca02c"></i>empty_cache</span>
<span><i style="background:#7f7f7f"></i>cache released</span></div>
<canvas id="timeline"></canvas><div class="readout" id="tl-readout">move the pointer over the timeline</div>
<table id="markers"><tr><th>event</th><th>when</th><th>bytes</th><th>allocated / reserved then</th>
<th>where</th></tr></table>
<h2>Segments, blocks and free holes</h2>
<div class="legend"><span><i style="background:#1f77b4"></i>allocated</span>
<span><i style="background:#9467bd"></i>freed, pending a stream</span>
<span><i style="background:#f08080"></i>free hole</span></div>
<p>$SEGMENTS</p>
<canvas id="segmap"></canvas>
<div class="readout" id="seg-readout">move the pointer over a segment</div>
<h2>Largest live allocations</h2>
<label><input type="checkbox" id="cpp-toggle" checked> show C++ frames</label>
<table id="allocs"><tr><th>#</th><th>size</th><th>requested</th><th>allocated at</th><th>stack</th></tr>
</table>
<h2>Code holding the most memory</h2>
<table id="sites"><tr><th>bytes</th><th>share</th><th>blocks</th><th>site (innermost frame of your code)</th>
</tr></table>
<h2>Who holds memory</h2><div id="holders-section"></div>
<pre id="errors" hidden></pre>
<footer>gpumem report; <span id="render-time">the page's script has not run</span></footer>
</main>
<script type="application/json" id="report-data">$DATA</script>
<script>$JS</script>
</body></html>
"""


def _cards(a: Dict[str, Any]) -> str:
    t, tl = a["totals"], a["timeline"]
    ratio = t["reserved_over_allocated"]
    cards = [("allocated now", fmt_bytes(t["allocated"])), ("reserved now", fmt_bytes(t["reserved"])),
             ("peak allocated", fmt_bytes(tl["peak_allocated"])),
             ("peak reserved", fmt_bytes(tl["peak_reserved"])),
             ("fragmentation", f"{t['fragmentation']:.0%}"),
             ("reserved / allocated", f"{ratio:.2f}" if ratio else "n/a"),
             ("out-of-memory errors", str(tl.get("ooms", 0))), ("trace events", f"{tl['events']:,}")]
    return "".join(f'<div class="card"><b>{html.escape(v)}</b><span>{html.escape(k)}</span></div>'
                   for k, v in cards)


def render(a: Dict[str, Any]) -> str:
    """The page for the analysed figures ``a`` (``analyze.analyze``)."""
    t = a["totals"]
    meta = (f"{html.escape(str(a['source']))} &middot; "
            f"{'PyTorch' if a['kind'] == 'pytorch' else 'gpumem'} snapshot "
            f"&middot; GPU {a['device']}")
    if a["settings"]:
        meta += f" &middot; {html.escape(a['settings'])}"
    if a["other_devices"]:
        meta += " &middot; other devices: " + ", ".join(
            f"GPU {d['device']} ({fmt_bytes(d['reserved'])} reserved)" for d in a["other_devices"])
    segs = (f"{t['segments']:,} segments, {t['live_blocks']:,} live blocks; "
            f"{fmt_bytes(t['free_in_segments'])} free in {t['free_blocks']:,} holes, the largest "
            f"{fmt_bytes(t['largest_free'])}: fragmentation "
            f"{t['fragmentation']:.0%} (1 - largest hole / free bytes).")
    if a["segments_left_out"]:
        segs += (f" The {len(a['segments'])} largest segments are drawn; "
                 f"{a['segments_left_out']:,} smaller ones are not.")
    notes = "".join(f'<p class="note">note: {html.escape(n)}</p>' for n in a["notes"])
    # "</" inside the JSON would end the script element early; "<\\/" reads back the same.
    data = json.dumps(a, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    parts = {"TITLE": html.escape(str(a["source"])), "CSS": _static("page.css"),
             "TRAP": _static("page_trap.js"), "META": meta,
             "CARDS": _cards(a), "DIAGNOSIS": html.escape(a["diagnosis"]), "NOTES": notes,
             "SEGMENTS": html.escape(segs), "JS": _static("page.js"), "DATA": data}
    # One pass, so that nothing put in (a file name, the data) is read again as a placeholder.
    return re.sub(r"\$(TITLE|CSS|TRAP|META|CARDS|DIAGNOSIS|NOTES|SEGMENTS|JS|DATA)\b",
                  lambda m: parts[m.group(1)], _PAGE)
