"""GPU tests of gpumem.cleanup and the extension on CUDA tensors, in a real IPython shell."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("IPython")

from ipython_shell import make_shell, run, session  # noqa: E402  tests/ipython_shell.py

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MiB = 1 << 20


@pytest.fixture
def shell():
    yield from session(make_shell(), "import torch, weakref, gpumem\nfrom gpumem.cleanup import cleanup")
    torch.cuda.empty_cache()


MODEL = """
D = 4096
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.GELU()) for _ in range(4)]).cuda()
with torch.no_grad():
    model(torch.randn(8, D, device='cuda'))
torch.cuda.synchronize()
baseline = torch.cuda.memory_allocated()
"""

OOM = """
def train_step(batch):
    x = torch.randn(batch, D, device='cuda')
    return model(x).float().pow(2).mean()
free, total = torch.cuda.mem_get_info()
train_step(int(free / (D * 4) / 5))
"""


def _alloc():
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


@pytest.mark.gpu
@needs_gpu
def test_cleanup_after_oom_cell(shell):
    run(shell, MODEL)
    base = shell.user_ns["baseline"]
    r = run(shell, OOM, ok=False)
    assert isinstance(r.error_in_exec, torch.cuda.OutOfMemoryError)
    a, _ = _alloc()
    assert a > base + 256 * MiB, "the traceback should pin the activations (precondition)"
    torch.cuda.empty_cache()
    assert _alloc()[0] > base + 256 * MiB, "empty_cache alone cannot free what the traceback holds"
    run(shell, "rep = cleanup()")
    rep = shell.user_ns["rep"]
    a, res = _alloc()
    assert abs(a - base) <= 1 * MiB, (a, base, str(rep))
    assert res - a <= 20 * MiB, (res, a)
    assert rep.freed_allocated > 256 * MiB
    tb = next(s for s in rep.steps if s.name == "tracebacks")
    assert tb.freed_allocated > 256 * MiB
    assert not rep.problems, rep.problems
    refs = {x for h in rep.holders for x in h.refs}
    assert "model.0.0.weight" in refs


@pytest.mark.gpu
@needs_gpu
def test_extension_releases_oom_without_anything(shell):
    shell.extension_manager.load_extension("gpumem.ipython_ext")
    run(shell, MODEL)
    base = shell.user_ns["baseline"]
    r = run(shell, OOM, ok=False)
    assert isinstance(r.error_in_exec, torch.cuda.OutOfMemoryError)
    a, res = _alloc()
    assert abs(a - base) <= 1 * MiB
    assert res - a <= 20 * MiB


@pytest.mark.gpu
@needs_gpu
def test_report_holders_and_unexplained(shell):
    run(shell, """
keep = torch.empty(64 << 20, dtype=torch.uint8, device='cuda')
lin = torch.nn.Linear(2048, 2048).cuda()
opt = torch.optim.Adam(lin.parameters())
lin(torch.randn(4, 2048, device='cuda')).sum().backward(); opt.step()
graph = lin(torch.randn(4096, 2048, device='cuda', requires_grad=True)).relu().sum()   # saved tensors: autograd only
""")
    run(shell, "rep = cleanup('nonexistent')")
    rep = shell.user_ns["rep"]
    assert rep.cuda == "ready" and rep.missing == ["nonexistent"]
    refs = {x for h in rep.holders for x in h.refs}
    assert "keep" in refs and "lin.weight" in refs and "lin.weight.grad" in refs
    assert "opt.state[lin.weight]['exp_avg']" in refs
    assert rep.unexplained_bytes >= 16 * MiB  # the graph's saved input/activations are not Python objects
    assert "not explained" in str(rep)


@pytest.mark.gpu
@needs_gpu
def test_output_cache_and_names_on_gpu(shell):
    run(shell, "torch.ones(64 << 20, device='cuda')")
    run(shell, "t = torch.ones(64 << 20, device='cuda'); u = torch.ones(16, device='cuda')")
    a0, _ = _alloc()
    run(shell, "rep = cleanup('t')")
    a1, _ = _alloc()
    assert a0 - a1 >= 2 * 256 * MiB - MiB
    assert "u" in shell.user_ns and "t" not in shell.user_ns


@pytest.mark.gpu
@needs_gpu
def test_summary_and_plot_on_gpu():
    import gpumem.views as views
    from gpumem.timeline import record

    x = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    s = views.summary()
    assert "GPU 0" in s and "allocated" in s and "reserved" in s
    with record(interval=0.01) as tl:
        y = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        del y
    assert len(tl) >= 2 and tl.peak()[0] >= 32 << 20
    fig = views.plot(tl)
    assert fig.axes
    del x


@pytest.mark.gpu
@needs_gpu
def test_status_cli_lists_gpus(capsys):
    pytest.importorskip("pynvml")
    from gpumem.status import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert "GPU 0" in out and "GiB" in out
