"""CPU tests of gpumem.views (summary, stats accessor, plot), gpumem.timeline and gpumem.status."""
import json
import sys
import time
import types

import pytest

torch = pytest.importorskip("torch")

from gpumem import views  # noqa: E402
from gpumem.timeline import Timeline, default_timeline, record  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20


def test_fmt_bytes():
    assert views.fmt_bytes(0) == "0 B"
    assert views.fmt_bytes(1023) == "1023 B"
    assert views.fmt_bytes(1536) == "1.50 KiB"
    assert views.fmt_bytes(3 * GiB) == "3.00 GiB"
    assert views.fmt_bytes(200 * MiB) == "200 MiB"
    assert views.fmt_bytes(-5 * MiB) == "-5.00 MiB"
    assert views.fmt_bytes(5 * MiB, signed=True) == "+5.00 MiB"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_summary_without_gpu():
    s = views.summary()
    assert isinstance(s, str) and "no CUDA device" in s
    assert views.get_stats() == {}
    assert views.tracked_devices() == []


def test_get_stats_prefers_active_gpumem(monkeypatch):
    gm = sys.modules["gpumem"]
    fake = {"allocated_bytes.all.current": 5, "reserved_bytes.all.current": 7, "gpumem.cap_bytes": 0}
    monkeypatch.setattr(gm, "stats", lambda device=None: dict(fake), raising=False)
    monkeypatch.setattr(gm, "is_active", lambda: True, raising=False)
    assert views.get_stats(0) == fake
    monkeypatch.setattr(gm, "is_active", lambda: False, raising=False)
    if not torch.cuda.is_available():
        assert views.get_stats(0) == {}


def test_summary_with_fake_pool(monkeypatch):
    """Render the summary from gpumem-style stats (as on a GPU), without a GPU."""
    gm = sys.modules["gpumem"]
    fake = {"allocated_bytes.all.current": 3 * GiB, "allocated_bytes.all.peak": 5 * GiB,
            "reserved_bytes.all.current": 4 * GiB, "reserved_bytes.all.peak": 6 * GiB,
            "gpumem.cap_bytes": 40 * GiB, "gpumem.largest_free_bytes": 512 * MiB, "num_ooms": 2}
    monkeypatch.setattr(gm, "stats", lambda device=None: dict(fake), raising=False)
    monkeypatch.setattr(gm, "is_active", lambda: True, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=None: (70 * GiB, 80 * GiB))
    s = views.summary()
    assert "GPU 0 (Fake GPU) - gpumem pool" in s
    assert "3.00 GiB" in s and "peak 5.00 GiB" in s
    assert "4.00 GiB" in s and "peak 6.00 GiB" in s
    assert "fragmentation 50.0%" in s  # 1 GiB cached free, largest block 512 MiB
    assert "512 MiB" in s and "40.0 GiB" in s
    assert "OOMs" in s and "10.0 GiB used of 80.0 GiB" in s


def test_timeline_feed_and_plot():
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    tl = Timeline(sampler=lambda: (0, 0))
    t0 = 1000.0
    for i, (a, r) in enumerate([(0, 0), (1 * GiB, 2 * GiB), (3 * GiB, 4 * GiB), (1 * GiB, 4 * GiB), (1 * GiB, 1 * GiB)]):
        tl.add(a, r, t=t0 + i, label=f"[{i}]" if i % 2 else None)
    assert len(tl) == 5
    assert tl.peak() == (3 * GiB, 4 * GiB)
    d = tl.to_dict()
    assert d["allocated"][2] == 3 * GiB and d["label"][1] == "[1]"
    fig = views.plot(tl)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert ax.get_ylabel() == "GiB"
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"allocated", "reserved"}
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png")  # renders headless
    assert buf.getvalue()[:4] == b"\x89PNG"


def test_record_background_sampling():
    vals = iter(range(10 ** 6))

    def sampler():
        v = next(vals)
        return v * MiB, 2 * v * MiB

    tl = Timeline(sampler=sampler)
    with record(interval=0.01, timeline=tl) as got:
        assert got is tl and tl.running
        time.sleep(0.15)
    assert not tl.running
    assert len(tl) >= 5
    snaps = tl.snapshot()
    assert snaps[0].label == "start" and snaps[-1].label == "end"
    assert all(b.t >= a.t for a, b in zip(snaps, snaps[1:]))


def test_plot_default_timeline_empty_ok():
    pytest.importorskip("matplotlib")
    default_timeline().clear()
    fig = views.plot()  # samples "now" (zeros without a GPU) and draws
    assert fig.axes


# ---------------------------------------------------------------------------------------------
# status
# ---------------------------------------------------------------------------------------------
def _fake_pynvml(n=2, fail_init=False):
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    m.NVMLError = NVMLError

    def init():
        if fail_init:
            raise NVMLError("Driver Not Loaded")

    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: n
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=(h + 1) * 10 * GiB, total=80 * GiB, free=0)
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=37, memory=10)
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [types.SimpleNamespace(pid=999999, usedGpuMemory=9 * GiB)]
    m.nvmlDeviceGetGraphicsRunningProcesses = lambda h: []
    return m


def test_status_fake_nvml(monkeypatch, capsys):
    from gpumem.status import main

    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "GPU 0" in out and "GPU 1" in out and "H100" in out
    assert "10.0 GiB / 80.0 GiB" in out and "20.0 GiB / 80.0 GiB" in out
    assert "pid  999999" in out and "9.00 GiB" in out
    assert main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["error"] is None
    assert data["gpus"][1]["used"] == 20 * GiB and data["gpus"][0]["processes"][0]["pid"] == 999999
    assert main(["--watch", "-n", "0.01", "--count", "2"]) == 0
    assert capsys.readouterr().out.count("GPU 1") == 2
    assert main(["--watch", "0.01", "--count", "3"]) == 0
    assert capsys.readouterr().out.count("GPU 1") == 3
    assert main(["--watch", "0.01", "--count", "2", "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(json.loads(x)["gpus"][0]["name"].startswith("NVIDIA") for x in lines)


def test_status_without_gpu_says_what_is_missing(monkeypatch, capsys):
    """No driver, no GPU or no NVML bindings: one line saying which, exit 0 (nothing to show is no error),
    also under --watch (nothing will appear) and in --json's "error"."""
    from gpumem.status import main

    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail_init=True))
    assert main([]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("gpumem status: no GPU to show:") and "Driver Not Loaded" in cap.out
    assert "Traceback" not in cap.err
    assert main(["--watch", "0.01"]) == 0
    assert capsys.readouterr().out.count("Driver Not Loaded") == 1
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(n=0))
    assert main([]) == 0
    assert "no GPUs" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpus"] == [] and "nvidia-ml-py" in data["error"]


def test_status_bad_options_exit_2(capsys):
    from gpumem.status import main

    for argv in (["--bogus"], ["--count", "0"], ["--watch", "0"], ["--watch", "x"], ["-n", "-1"]):
        assert main(argv) == 2, argv
        assert "usage:" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "--watch [SECONDS]" in capsys.readouterr().out


def test_status_real_nvml_no_traceback(capsys):
    """With the real bindings on a machine without a driver: a message and 0, never a traceback."""
    pytest.importorskip("pynvml")
    from gpumem.status import main

    rc = main([])
    cap = capsys.readouterr()
    assert rc == 0 and "Traceback" not in cap.err
    assert "GPU 0" in cap.out or cap.out.startswith("gpumem status: no GPU to show:")
