"""``gpumem.report``: reading snapshots (PyTorch's pickle, gpumem's JSON), the figures, the page.

The snapshots are real pools' states: the bundled examples and, here, small pools driven through
``PoolRecorder`` on the simulated device, whose own counters (``allocated_bytes``, ``reserved_bytes``)
the report's figures must match. The page itself is opened in a real browser in test_report_browser.py.
"""
from __future__ import annotations

import gzip
import json
import pickle
import re
import subprocess
import sys

import pytest

from gpumem import _C
from gpumem.report import examples, report
from gpumem.report.analyze import analyze
from gpumem.report.load import from_gpumem, from_torch, load_snapshot
from gpumem.report.record import PoolRecorder, write_snapshot

MiB, GiB = 1 << 20, 1 << 30
EMPTY_CACHE = [{"name": "empty_cache", "filename": "/x/torch/cuda/memory.py", "line": 222},
               {"name": "<module>", "filename": "/home/u/train.py", "line": 9}]
SITE = [{"name": "at::native::empty_cuda", "filename": "aten/src/ATen/native/cuda/EmptyTensor.cpp",
         "line": 52},
        {"name": "forward", "filename": "/home/u/model.py", "line": 17}]


def small_run(upstream="vmm"):
    """A pool that allocated, freed, emptied its cache, allocated again and ran out of memory."""
    rec = PoolRecorder(_C.Pool(_C.SimulatedDevice(upstream, GiB)), source="test")
    keep = [rec.allocate(n * MiB, 0, SITE) for n in (3, 40, 100, 7)]
    tmp = [rec.allocate(64 * MiB) for _ in range(4)]
    for p in tmp:
        rec.free(p)
    rec.trim(EMPTY_CACHE)
    keep += [rec.allocate(5 * MiB, 0, SITE), rec.allocate(300 * MiB, 0, SITE)]
    rec.free(keep.pop(1))
    with pytest.raises(_C.OutOfMemoryError):
        rec.allocate(2 * GiB, 0, SITE)
    return rec


@pytest.mark.parametrize("upstream", ["vmm", "segments"])
@pytest.mark.parametrize("fmt", ["gpumem", "pytorch"])
def test_figures_match_the_pool(upstream, fmt):
    rec = small_run(upstream)
    snap = from_gpumem(rec.snapshot()) if fmt == "gpumem" else from_torch(rec.torch_snapshot())
    a = analyze(snap)
    pool = rec.pool
    assert a["totals"]["allocated"] == pool.allocated_bytes
    assert a["totals"]["reserved"] == pool.reserved_bytes
    tl = a["timeline"]
    assert tl["amax"][-1] == pool.allocated_bytes and tl["rmax"][-1] == pool.reserved_bytes
    assert tl["start_allocated"] == 0 and tl["start_reserved"] == 0  # the whole run was recorded
    assert tl["peak_allocated"] == (3 + 40 + 100 + 7 + 5 + 300) * MiB  # after the temporaries (406 MiB)
    assert tl["ooms"] == 1 and tl["empty_caches"] == 1
    kinds = [m["kind"] for m in tl["markers"]]
    assert kinds[-1] == "oom" and "empty_cache" in kinds
    oom = tl["markers"][-1]
    assert oom["bytes"] == 2 * GiB and oom["site"] == "/home/u/model.py:17 forward"
    sizes = [x["size"] for x in a["allocations"]]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 300 * MiB
    assert a["allocations"][0]["frames"][0][3] is False and a["allocations"][0]["frames"][1][3] is True
    assert a["sites"][0] == {"site": "/home/u/model.py:17 forward", "bytes": (3 + 100 + 7 + 5 + 300) * MiB,
                             "count": 5}
    free = a["totals"]["free_in_segments"]
    assert free == sum(b["size"] for r in pool.snapshot() for b in r["blocks"] if b["state"] == "inactive")
    assert 0.0 <= a["totals"]["fragmentation"] <= 1.0
    assert "It ran out of memory 1 time" in a["diagnosis"] and "asked for 2.00 GiB" in a["diagnosis"]
    assert "/home/u/model.py:17 forward" in a["diagnosis"]


def test_a_trace_missing_its_start_is_anchored_at_the_end():
    rec = small_run()
    data = rec.torch_snapshot()
    lost, data["device_traces"][0] = data["device_traces"][0][:6], data["device_traces"][0][6:]
    a = analyze(from_torch(data))
    tl = a["timeline"]
    assert tl["amax"][-1] == rec.pool.allocated_bytes  # the end is what the segments hold
    # history kept only its last entries: the start is what the lost ones had allocated
    assert tl["start_allocated"] == sum(e["size"] for e in lost if e["action"] == "alloc") > 0
    assert not any(e["action"] == "free_completed" for e in lost)
    assert "was already allocated when the trace begins" in a["diagnosis"]


def test_a_snapshot_without_history_says_so():
    rec = small_run()
    data = rec.torch_snapshot()
    data["device_traces"] = [[]]
    a = analyze(from_torch(data))
    assert a["timeline"]["events"] == 0 and "no trace" in a["diagnosis"]
    # torch.cuda.memory_snapshot()'s list of segments is a snapshot too
    assert analyze(from_torch(data["segments"]))["totals"]["allocated"] == rec.pool.allocated_bytes


@pytest.mark.parametrize("path", examples(), ids=lambda p: p.name)
def test_the_bundled_examples(path, tmp_path):
    snap = load_snapshot(path)
    assert snap.kind == ("pytorch" if ".pickle" in path.name else "gpumem")
    a = analyze(snap)
    assert a["timeline"]["ooms"] == 1 and a["timeline"]["empty_caches"] == 1
    assert a["totals"]["allocated"] > 4 * GiB and a["allocations"][0]["frames"]
    assert a["sites"][0]["site"].startswith("/home/user/train_resnet50.py:41")
    out = report(tmp_path / "r.html", snapshot=path)
    page = out.read_text()
    # self-contained: nothing to fetch (no src/href attributes, no URLs outside the data's text)
    assert not re.search(r"""\b(src|href)\s*=""", page)
    assert "http://" not in page and "https://" not in page
    data = json.loads(re.search(r'<script type="application/json" id="report-data">(.*?)</script>',
                                page, re.S).group(1).replace("<\\/", "</"))
    assert data["totals"] == a["totals"]
    assert a["diagnosis"].split(":")[0] in page  # the diagnosis is in the HTML itself, script or not


def test_plain_and_gzip_pickles_and_dicts_give_the_same_report(tmp_path):
    rec = small_run("segments")
    data = rec.torch_snapshot()
    (tmp_path / "s.pickle").write_bytes(pickle.dumps(data))
    (tmp_path / "s.pickle.gz").write_bytes(gzip.compress(pickle.dumps(data)))
    write_snapshot(rec.snapshot(), tmp_path / "g.json")
    figures = [analyze(load_snapshot(tmp_path / n))["totals"] for n in ("s.pickle", "s.pickle.gz", "g.json")]
    figures.append(analyze(from_torch(data))["totals"])
    assert all(f == figures[0] for f in figures)
    report(tmp_path / "d.html", snapshot=data)
    report(tmp_path / "g.html", snapshot=rec.snapshot())
    assert (tmp_path / "d.html").stat().st_size > 10000


def _bad(tmp_path, name, content):
    p = tmp_path / name
    p.write_bytes(content if isinstance(content, bytes) else pickle.dumps(content))
    return p


class Opaque:
    pass


@pytest.mark.parametrize("name, content, message", [
    ("empty.pickle", b"", "the file is empty"),
    ("text.pickle", b"hello world", "not a memory snapshot"),
    ("cut.pickle", pickle.dumps({"segments": []})[:-3], "not a readable snapshot pickle"),
    ("object.pickle", pickle.dumps({"segments": [], "x": Opaque()}), "holds a Python object"),
    ("list.pickle", ["x"], r"segments\[0\] is str, not a dict"),
    ("nokey.pickle", {"traces": []}, "no 'segments' key"),
    ("noblocks.pickle", {"segments": [{"address": 0, "total_size": 5}]}, r"segments\[0\]: 'blocks'"),
    ("state.pickle",
     {"segments": [{"address": 0, "total_size": 5, "blocks": [{"size": 5, "state": "gone"}]}]},
     r"segments\[0\]\.blocks\[0\]: state 'gone'"),
    ("size.pickle", {"segments": [{"address": 0, "total_size": "5", "blocks": []}]}, "'total_size' is str"),
    ("event.pickle", {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": "9"}]]},
     r"device_traces\[0\]\[0\]: 'size' is '9'"),
    ("traces.pickle", {"segments": [], "device_traces": {}}, "'device_traces' is dict"),
    ("v.json", json.dumps({"format": "gpumem.snapshot", "version": 7}).encode(), "version 7"),
    ("stack.json", json.dumps({"format": "gpumem.snapshot", "version": 1, "regions": [], "stacks": [],
                               "events": {"action": ["alloc"], "addr": [1], "size": [2], "time_us": [0],
                                          "stack": [4]}}).encode(), "event 0 .* stack 4"),
    ("other.json", b'{"a": 1}', "neither gpumem's snapshot"),
    ("gz.pickle", b"\x1f\x8b\x08\x00junk", "damaged gzip"),
])
def test_malformed_snapshots_say_what_is_wrong(tmp_path, name, content, message):
    p = _bad(tmp_path, name, content)
    with pytest.raises(ValueError, match=message) as e:
        report(tmp_path / "r.html", snapshot=p)
    assert str(p) in str(e.value)
    assert not (tmp_path / "r.html").exists()


def test_missing_file_and_live_without_cuda(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such snapshot file"):
        report(tmp_path / "r.html", snapshot=tmp_path / "nope.pickle")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the live report is tested under tests/gpu")
    with pytest.raises(RuntimeError, match="pass a snapshot file"):
        report(tmp_path / "r.html")


def test_importing_gpumem_loads_none_of_the_report_modules():
    code = ("import sys, gpumem; print(sorted(m for m in sys.modules if m.startswith('gpumem.report.')));"
            "print(callable(gpumem.report), 'report' in gpumem.__all__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "True True"], out


def test_a_large_trace_becomes_a_small_page(tmp_path):
    """10^5 events: the timeline keeps at most `points` buckets with the extremes of each."""
    rec = PoolRecorder(_C.Pool(_C.SimulatedDevice("vmm", 8 * GiB)))
    live = []
    for i in range(25000):
        live.append(rec.allocate((1 + i % 17) * MiB))
        if len(live) > 50:
            rec.free(live.pop(i % 7))
    a = analyze(from_gpumem(rec.snapshot()), points=1000)
    tl = a["timeline"]
    assert tl["events"] >= 50000 and len(tl["x"]) <= 1001
    level, exact_peak = 0, 0
    for action, size in zip(rec.cols["action"], rec.cols["size"]):
        level += size if action == "alloc" else -size if action == "free_completed" else 0
        exact_peak = max(exact_peak, level)
    assert max(tl["amax"]) == tl["peak_allocated"] == exact_peak
    out = report(tmp_path / "big.html", snapshot=rec.snapshot(), points=1000)
    assert out.stat().st_size < 600_000


def test_who_holds_memory_names_parameters_state_variables_and_the_traceback():
    """live.holders on CPU tensors (the CUDA ones of a live process are tested on the GPU machine,
    tests/gpu/test_report_gpu.py): the kinds add up to the bytes each kind really holds."""
    import torch

    from gpumem.report import live

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    model.zero_grad(set_to_none=True)
    batch = {"x": torch.randn(300, 500)}

    # Only this test's tensors count: CPU tensors other tests left alive in the process (the whole
    # suite runs in one) must not rank among the holders. Known by storage address, not by reference.
    ours = {t.untyped_storage().data_ptr() for t in [*model.parameters(), batch["x"]]}
    ours |= {v.untyped_storage().data_ptr() for st in opt.state.values() for v in st.values()
             if isinstance(v, torch.Tensor)}

    def failing_step():
        pinned = torch.empty(1 << 20, dtype=torch.uint8)  # (kept by the traceback only)
        ours.add(pinned.untyped_storage().data_ptr())
        raise RuntimeError("step failed")

    saved = {k: getattr(sys, k, None) for k in ("last_exc", "last_value", "last_traceback")}
    try:
        try:
            failing_step()
        except RuntimeError as e:
            sys.last_exc = sys.last_value = e
            sys.last_traceback = e.__traceback__
        ns = {"model": model, "opt": opt, "batch": batch}
        h = live.holders([ns], top=5,
                         pred=lambda t: t.device.type == "cpu" and t.untyped_storage().data_ptr() in ours)
    finally:
        for k, v in saved.items():
            setattr(sys, k, v)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert h["by_kind"]["parameters and buffers"] == params
    assert h["by_kind"]["optimizer state"] == 2 * params + sum(  # exp_avg, exp_avg_sq, and Adam's steps
        s["step"].numel() * s["step"].element_size() for s in opt.state.values())
    assert h["by_kind"]["variables"] == 300 * 500 * 4
    assert h["traceback"]["bytes"] == 1 << 20 and "step failed" in h["traceback"]["exception"]
    assert any("failing_step" in f for f in h["traceback"]["frames"])
    first, second = h["holders"][:2]
    assert (first["bytes"], first["kind"]) == (1 << 20, "last exception's traceback")
    assert (second["bytes"], second["kind"], second["refs"]) == (300 * 500 * 4, "variables", ["batch['x']"])
    kinds = {r["kind"] for r in h["holders"]}
    assert {"parameters and buffers", "optimizer state"} <= kinds
