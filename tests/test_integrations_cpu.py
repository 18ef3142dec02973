"""CPU tests of the integrations with other GPU libraries (gpumem.cupy, gpumem.numba, gpumem.rmm)
and of the per-library figures in the views: what holds where those libraries are absent (the
ImportError naming the package; `import gpumem` importing none of them), RMM's stream reading, and
the summary / timeline drawing each library's live bytes. The real allocations are in
tests/gpu/test_integrations_gpu.py."""
import importlib.util
import io
import subprocess
import sys

import pytest

import gpumem
from gpumem import views
from gpumem._stats import library_bytes
from gpumem.timeline import Timeline

GiB = 1 << 30
MiB = 1 << 20


def absent(module):
    return pytest.mark.skipif(importlib.util.find_spec(module) is not None,
                              reason=f"{module} is installed here: this checks the error where it is not")


def test_import_gpumem_imports_no_other_gpu_library():
    code = ("import sys, gpumem; gpumem.summary(); "
            "print(sorted(m for m in ('cupy', 'numba', 'rmm') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_integration_submodules_load_on_attribute_access():
    import gpumem.cupy as gc
    import gpumem.numba as gn
    import gpumem.rmm as gr

    assert gpumem.cupy is gc and gpumem.numba is gn and gpumem.rmm is gr
    assert {"cupy", "numba", "rmm"} <= set(dir(gpumem))
    with pytest.raises(AttributeError):
        gpumem.tensorflow  # noqa: B018


@absent("cupy")
@pytest.mark.parametrize("call", ["use", "unuse", "allocator", "using", "path", "c_path_problem"])
def test_cupy_calls_name_the_missing_package(call):
    fn = getattr(gpumem.cupy, call)
    with pytest.raises(ImportError, match=r"gpumem\.cupy\.\w+\(\) needs cupy .*pip install cupy") as info:
        r = fn()
        if call == "using":
            r.__enter__()
    assert info.value.name == "cupy"
    assert not gpumem.cupy.is_used()


@absent("numba")
def test_numba_plugin_names_the_missing_package():
    with pytest.raises(ImportError, match=r"gpumem\.numba\.use\(\) needs numba-cuda"):
        gpumem.numba.use()
    # What NUMBA_CUDA_MEMORY_MANAGER=gpumem.numba reads: the same error, not an AttributeError.
    with pytest.raises(ImportError, match="needs numba-cuda"):
        gpumem.numba._numba_memory_manager  # noqa: B018
    with pytest.raises(AttributeError):
        gpumem.numba.no_such_name  # noqa: B018


@absent("rmm")
@pytest.mark.parametrize("call", ["use", "memory_resource"])
def test_rmm_calls_name_the_missing_package(call):
    with pytest.raises(ImportError, match=rf"gpumem\.rmm\.{call}\(\) needs rmm"):
        getattr(gpumem.rmm, call)()


def test_rmm_reads_the_stream_through_the_cuda_stream_protocol():
    from gpumem.rmm import _stream_handle

    class Proto:
        def __cuda_stream__(self):
            return (0, 0x7F00)

    assert _stream_handle(Proto()) == 0x7F00
    assert _stream_handle(0) == 0
    with pytest.raises(TypeError, match="__cuda_stream__"):
        _stream_handle(object())


def test_integrations_refuse_when_gpumem_is_disabled(monkeypatch):
    from gpumem._integrations import bridge_for

    monkeypatch.setenv("GPUMEM_DISABLE", "1")
    with pytest.raises(RuntimeError, match="GPUMEM_DISABLE=1"):
        bridge_for("gpumem.cupy.use()")


def test_integrations_say_why_without_a_cuda_torch():
    torch = pytest.importorskip("torch")
    if torch.version.cuda is not None:
        pytest.skip("checks the message of a CPU-only torch")
    from gpumem._integrations import bridge_for

    with pytest.raises(RuntimeError, match=r"gpumem\.rmm\.use\(\): .*CPU-only build"):
        bridge_for("gpumem.rmm.use()")


FAKE = {"allocated_bytes.all.current": 3 * GiB, "allocated_bytes.all.peak": 5 * GiB,
        "reserved_bytes.all.current": 4 * GiB, "reserved_bytes.all.peak": 6 * GiB,
        "gpumem.cap_bytes": 0, "gpumem.largest_free_bytes": 0,
        "gpumem.library.torch.current": 2 * GiB, "gpumem.library.torch.peak": 4 * GiB,
        "gpumem.library.torch.allocations": 7, "gpumem.library.torch.ooms": 0,
        "gpumem.library.cupy.current": 1 * GiB, "gpumem.library.cupy.peak": 3 * GiB,
        "gpumem.library.cupy.allocations": 1, "gpumem.library.cupy.ooms": 1,
        "gpumem.library.numba.current": 0, "gpumem.library.numba.peak": 0,
        "gpumem.library.numba.allocations": 0, "gpumem.library.numba.ooms": 0}


def test_library_bytes_sums_devices_and_is_empty_for_torchs_allocator():
    other = dict(FAKE, **{"gpumem.library.cupy.current": 512 * MiB})
    assert library_bytes([0, 1], [FAKE, other]) == {"torch": 4 * GiB, "cupy": GiB + 512 * MiB, "numba": 0}
    assert library_bytes([0], [{"allocated_bytes.all.current": 5}]) == {}


def test_summary_shows_each_library_beside_the_totals(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(gpumem, "stats", lambda device=None: dict(FAKE))
    monkeypatch.setattr(gpumem, "is_active", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=None: (70 * GiB, 80 * GiB))
    lines = str(views.summary()).splitlines()
    i = next(k for k, line in enumerate(lines) if "by library" in line)
    assert lines[i + 1].split()[:3] == ["torch", "2.00", "GiB"] and "peak 4.00 GiB" in lines[i + 1]
    assert "(7 blocks)" in lines[i + 1]
    assert lines[i + 2].split()[:3] == ["cupy", "1.00", "GiB"] and "(1 block)" in lines[i + 2]
    assert not any(line.split()[:1] == ["numba"] for line in lines)  # never allocated: not shown
    assert not any(line.split()[:1] == ["rmm"] for line in lines)  # not counted at all


def test_timeline_keeps_and_draws_library_bytes():
    pytest.importorskip("matplotlib")
    tl = Timeline(sampler=lambda: (3 * GiB, 4 * GiB, {"torch": 2 * GiB, "cupy": GiB}))
    tl.sample(label="a")
    tl.add(1 * GiB, 4 * GiB, t=tl.snapshot()[0].t + 1)  # no library figures: allowed
    d = tl.to_dict()
    assert d["libraries"] == [{"torch": 2 * GiB, "cupy": GiB}, None]
    fig = tl.plot()
    legend = {t.get_text() for t in fig.axes[0].get_legend().get_texts()}
    assert legend == {"allocated", "reserved", "torch", "cupy"}
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue()[:4] == b"\x89PNG"
    # torch alone: the totals are torch's, no extra lines.
    only_torch = Timeline(sampler=lambda: (GiB, GiB, {"torch": GiB}))
    only_torch.sample()
    legend = {t.get_text() for t in only_torch.plot().axes[0].get_legend().get_texts()}
    assert legend == {"allocated", "reserved"}
