// gpumem report: draws the timeline and the segment map on <canvas> and fills the tables from the
// JSON block #report-data (inlined into every report by html.py; hand-written, no library).
// Colours are fixed here and in the test that looks at the screenshot (tests/test_report_browser.py).
"use strict";
const D = JSON.parse(document.getElementById("report-data").textContent);
const C = {alloc: "#1f77b4", allocFill: "rgba(31,119,180,0.30)", res: "#ff7f0e", resFill: "rgba(255,127,14,0.15)",
           oom: "#d62728", empty: "#2ca02c", release: "#7f7f7f", hole: "#f08080", pending: "#9467bd", grid: "#e9ecf1"};
const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
function fmt(n) {
  if (n === null || n === undefined) return "?";
  let s = n < 0 ? "-" : ""; n = Math.abs(n);
  if (n < 1024) return s + n + " B";
  let u = 0; while (n >= 1024 && u < UNITS.length - 1) { n /= 1024; u++; }
  return s + n.toFixed(n < 10 ? 2 : n < 100 ? 1 : 0) + " " + UNITS[u];
}
function fmtX(x) {
  if (D.timeline.unit !== "us") return "event " + Math.round(x).toLocaleString("en");
  const s = x / 1e6; return s < 1 ? (x / 1e3).toFixed(1) + " ms" : s < 120 ? s.toFixed(2) + " s" : (s / 60).toFixed(1) + " min";
}
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const k in attrs || {}) { if (k === "text") e.textContent = attrs[k]; else e.setAttribute(k, attrs[k]); }
  for (const c of kids) e.append(c);
  return e;
}
function setupCanvas(cv, cssHeight) {
  const dpr = window.devicePixelRatio || 1, w = cv.clientWidth;
  cv.style.height = cssHeight + "px"; cv.width = Math.round(w * dpr); cv.height = Math.round(cssHeight * dpr);
  const g = cv.getContext("2d"); g.setTransform(dpr, 0, 0, dpr, 0, 0); return [g, w, cssHeight];
}
// The canvas's place on the page, for tests that look at a screenshot.
function markRect(cv) {
  const r = cv.getBoundingClientRect();
  cv.setAttribute("data-rect", [r.left + scrollX, r.top + scrollY, r.width, r.height].map(Math.round).join(","));
}
function lower(a, v) { let lo = 0, hi = a.length - 1; while (lo < hi) { const m = (lo + hi + 1) >> 1; if (a[m] <= v) lo = m; else hi = m - 1; } return lo; }

function drawTimeline() {
  const T = D.timeline, cv = document.getElementById("timeline");
  const [g, W, H] = setupCanvas(cv, 320), L = 72, R = 14, TOP = 18, B = 30, pw = W - L - R, ph = H - TOP - B;
  // 1% of room on the right, so that a marker on the last event is not drawn over by the frame
  const n = T.x.length, x0 = T.x[0], x1 = Math.max(T.x[n - 1] + (T.x[n - 1] - x0) * 0.01, x0 + 1);
  let ymax = 1; for (let i = 0; i < n; i++) ymax = Math.max(ymax, T.amax[i], T.rmax[i]);
  ymax *= 1.08;
  const X = x => L + (x - x0) / (x1 - x0) * pw, Y = y => TOP + ph - y / ymax * ph;
  g.font = "11px system-ui,sans-serif"; g.fillStyle = "#5b6474"; g.strokeStyle = C.grid; g.lineWidth = 1;
  for (let k = 0; k <= 4; k++) {
    const v = ymax / 1.08 * k / 4, y = Math.round(Y(v)) + 0.5;
    g.beginPath(); g.moveTo(L, y); g.lineTo(L + pw, y); g.stroke(); g.fillText(fmt(Math.round(v)), 4, y + 4);
  }
  for (let k = 0; k <= 5; k++) { const x = x0 + (x1 - x0) * k / 5; g.fillText(fmtX(x - x0), Math.min(X(x) - 14, W - 70), H - 10); }
  function area(lo, hi, fill) {
    g.beginPath(); g.moveTo(X(T.x[0]), Y(lo[0]));
    for (let i = 0; i < n; i++) { g.lineTo(X(T.x[i]), Y(hi[i])); if (i + 1 < n) g.lineTo(X(T.x[i + 1]), Y(hi[i])); }
    for (let i = n - 1; i >= 0; i--) { if (i + 1 < n) g.lineTo(X(T.x[i + 1]), Y(lo[i])); g.lineTo(X(T.x[i]), Y(lo[i])); }
    g.closePath(); g.fillStyle = fill; g.fill();
  }
  function line(v, color, width) {
    g.beginPath(); g.strokeStyle = color; g.lineWidth = width;
    for (let i = 0; i < n; i++) { const y = Y(v[i]); if (i === 0) g.moveTo(X(T.x[0]), y); else g.lineTo(X(T.x[i]), y); if (i + 1 < n) g.lineTo(X(T.x[i + 1]), y); }
    g.stroke();
  }
  area(T.rmin, T.rmax, C.resFill);
  area(new Array(n).fill(0), T.amax, C.allocFill);
  line(T.rmax, C.res, 2); line(T.amax, C.alloc, 1.5);
  for (const m of T.markers) {
    const x = Math.round(X(m.x)) + 0.5, color = m.kind === "oom" ? C.oom : m.kind === "empty_cache" ? C.empty : C.release;
    g.strokeStyle = color; g.lineWidth = m.kind === "release" ? 1 : 2; g.setLineDash(m.kind === "release" ? [4, 3] : []);
    g.beginPath(); g.moveTo(x, TOP); g.lineTo(x, TOP + ph); g.stroke(); g.setLineDash([]);
    if (m.kind !== "release") {
      const label = m.kind === "oom" ? "OOM" : "empty_cache", tw = g.measureText(label).width;
      g.fillStyle = color; g.fillText(label, x + 3 + tw > L + pw ? x - 3 - tw : x + 3, TOP + 10);
    }
  }
  g.strokeStyle = "#9aa1ad"; g.lineWidth = 1; g.strokeRect(L + 0.5, TOP + 0.5, pw, ph);
  const out = document.getElementById("tl-readout");
  cv.addEventListener("mousemove", ev => {
    const r = cv.getBoundingClientRect(), x = x0 + (ev.clientX - r.left - L) / pw * (x1 - x0);
    if (x < x0 || x > x1) return;
    const i = lower(T.x, x);
    out.textContent = `${fmtX(T.x[i] - x0)}: allocated ${fmt(T.amin[i])}..${fmt(T.amax[i])}, reserved ${fmt(T.rmin[i])}..${fmt(T.rmax[i])}`;
  });
}

function drawSegments() {
  const S = D.segments, cv = document.getElementById("segmap");
  if (!S.length) { cv.replaceWith(el("p", {text: "No segments: the allocator holds no device memory."})); return; }
  const ROW = 14, GAP = 4, L = 190, [g, W] = setupCanvas(cv, S.length * (ROW + GAP) + GAP);
  const colors = [C.hole, C.alloc, C.pending], pw = W - L - 10;
  let big = 1; for (const s of S) big = Math.max(big, s.size);
  g.font = "11px ui-monospace,Menlo,monospace"; g.textBaseline = "middle";
  S.forEach((s, r) => {
    const y = GAP + r * (ROW + GAP), w = Math.max(4, s.size / big * pw);
    g.fillStyle = "#5b6474"; g.fillText(`${fmt(s.size).padStart(9)} ${s.type[0]}${s.expandable ? "e" : ""} ${s.address.slice(-9)}`, 4, y + ROW / 2);
    for (const [off, size, code] of s.cells) {
      const bx = L + off / s.size * w, bw = Math.max(size / s.size * w, 0.6);
      g.fillStyle = colors[code]; g.fillRect(bx, y, bw, ROW);
      if (bw >= 4) { g.fillStyle = "#fff"; g.fillRect(bx + bw - 1, y, 1, ROW); }
    }
  });
  const out = document.getElementById("seg-readout");
  cv.addEventListener("mousemove", ev => {
    const rc = cv.getBoundingClientRect(), r = Math.floor((ev.clientY - rc.top - GAP / 2) / (ROW + GAP)), s = S[r];
    if (!s) return;
    const w = Math.max(4, s.size / big * pw), off = (ev.clientX - rc.left - L) / w * s.size;
    const c = s.cells.find(([o, z]) => off >= o && off < o + z);
    out.textContent = `segment ${s.address}: ${fmt(s.size)} ${s.type}${s.expandable ? " (expandable)" : ""}, ` +
      `${fmt(s.allocated)} in use, ${s.blocks} blocks` + (c ? `; here: ${["free hole", "allocated", "freed, pending"][c[2]]} of ${fmt(c[1])}` : "");
  });
}

function frameList(frames) {
  const ol = el("ol", {class: "frames"});
  for (const [name, file, line, py] of frames) ol.append(el("li", {class: py ? "py" : "cpp", text: file ? `${name}  ${file}:${line}` : name}));
  return ol;
}
function fillTables() {
  const A = document.getElementById("allocs");
  D.allocations.forEach((a, i) => {
    const st = a.frames.length ? el("details", {}, el("summary", {text: `${a.frames.filter(f => f[3]).length} Python, ${a.frames.filter(f => !f[3]).length} C++ frames`}), frameList(a.frames)) : "no stack";
    A.append(el("tr", {}, el("td", {class: "n", text: i + 1}), el("td", {class: "n", text: fmt(a.size)}), el("td", {class: "n", text: fmt(a.requested)}),
      el("td", {class: "site", text: a.site}), el("td", {}, st)));
  });
  const Si = document.getElementById("sites"), tot = D.totals.allocated || 1;
  for (const s of D.sites) Si.append(el("tr", {}, el("td", {class: "n", text: fmt(s.bytes)}), el("td", {class: "n", text: (100 * s.bytes / tot).toFixed(1) + "%"}),
    el("td", {class: "n", text: s.count.toLocaleString("en")}), el("td", {class: "site", text: s.site})));
  const M = document.getElementById("markers");
  for (const m of D.timeline.markers.filter(m => m.kind !== "release").slice(0, 50)) M.append(el("tr", {},
    el("td", {text: m.kind}), el("td", {class: "n", text: fmtX(m.x)}), el("td", {class: "n", text: fmt(m.bytes)}),
    el("td", {class: "n", text: `${fmt(m.allocated)} / ${fmt(m.reserved)}`}), el("td", {class: "site", text: m.site || ""})));
  if (!M.rows.length) M.replaceWith(el("p", {text: "No out-of-memory error and no empty_cache in the trace."}));
  const H = D.holders, hs = document.getElementById("holders-section");
  if (!H) { hs.append(el("p", {text: "Who holds memory is known only in a live process: call gpumem.report() in it."})); return; }
  const Ht = el("table", {}, el("tr", {}, ...["bytes", "kind", "tensor", "device", "held by"].map(t => el("th", {text: t}))));
  for (const h of H.holders) Ht.append(el("tr", {}, el("td", {class: "n", text: fmt(h.bytes)}), el("td", {text: h.kind}),
    el("td", {text: `${h.dtype}[${h.shape.join("x") || "scalar"}]`}), el("td", {text: h.device}), el("td", {class: "refs", text: h.refs.join("; ")})));
  hs.append(Ht);
}

const t0 = performance.now();
drawTimeline(); drawSegments(); fillTables();
for (const cv of document.querySelectorAll("canvas")) markRect(cv);  // once the tables above them are filled
document.getElementById("cpp-toggle").addEventListener("change", e => document.body.classList.toggle("hide-cpp", !e.target.checked));
const now = performance.now();
document.documentElement.setAttribute("data-draw-ms", (now - t0).toFixed(1));
document.documentElement.setAttribute("data-render-ms", now.toFixed(1));
document.getElementById("render-time").textContent = `drawn in ${(now - t0).toFixed(0)} ms, ${now.toFixed(0)} ms after the page began loading`;
document.documentElement.setAttribute("data-rendered", "ok");
