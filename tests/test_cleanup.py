"""CPU tests of gpumem.cleanup and the IPython extension, inside a real IPython InteractiveShell.

CPU tensors are treated as the tracked kind (``include_cpu=True``) so the real traceback / output
cache / named deletion / referrer logic runs without a GPU.
"""
import gc
import sys
import types
import weakref

import pytest

torch = pytest.importorskip("torch")

from ipython_shell import make_shell, run, session  # noqa: E402  tests/ipython_shell.py

from gpumem.cleanup import CleanupReport, cleanup  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def shell_instance():
    pytest.importorskip("IPython")
    return make_shell()


@pytest.fixture
def shell(shell_instance):
    yield from session(shell_instance, "import torch, weakref\nfrom gpumem.cleanup import cleanup")


FAIL_CELL = """
def step():
    act = torch.ones(4 * 1024 * 1024)          # 16 MiB, only a local of the failing frame
    global w_act
    w_act = weakref.ref(act)
    raise RuntimeError("boom in step")
step()
"""


def test_traceback_pins_then_cleanup_frees(shell):
    r = run(shell, FAIL_CELL, ok=False)
    assert isinstance(r.error_in_exec, RuntimeError)
    gc.collect()
    assert shell.user_ns["w_act"]() is not None, "the traceback should pin the local (precondition)"
    run(shell, "rep = cleanup(include_cpu=True)")
    assert shell.user_ns["w_act"]() is None
    rep = shell.user_ns["rep"]
    assert isinstance(rep, CleanupReport)
    tb_step = next(s for s in rep.steps if s.name == "tracebacks")
    assert tb_step.freed_tensors >= 16 * MiB
    assert "boom in step" in rep.traceback_text
    # the traceback text can still be printed, user namespace intact
    assert "step" in shell.user_ns and "torch" in shell.user_ns
    import traceback

    txt = "".join(traceback.format_exception(sys.last_type, sys.last_value, sys.last_traceback))
    assert "boom in step" in txt
    # idempotent
    run(shell, "rep2 = cleanup(include_cpu=True)")
    assert shell.user_ns["rep2"].ok
    run(shell, "x = torch.ones(3) + 1")  # process fully usable


def test_frames_in_cycle_and_chained_exception(shell):
    code = """
def inner():
    t = torch.ones(1024 * 1024)
    global w_in
    w_in = weakref.ref(t)
    me = inner                      # some noise
    raise KeyError("inner")
def outer():
    try:
        inner()
    except KeyError as e:
        u = torch.ones(1024 * 1024)
        global w_out
        w_out = weakref.ref(u)
        raise ValueError("outer") from e
outer()
"""
    run(shell, code, ok=False)
    assert shell.user_ns["w_in"]() is not None and shell.user_ns["w_out"]() is not None
    run(shell, "cleanup(include_cpu=True, analyze=False)")
    assert shell.user_ns["w_in"]() is None
    assert shell.user_ns["w_out"]() is None


def test_output_cache_entries_dropped(shell):
    run(shell, "torch.ones(2 * 1024 * 1024)")
    n = shell.execution_count - 1
    run(shell, "w_o = weakref.ref(_)")
    run(shell, "'a string result'")
    assert shell.user_ns["w_o"]() is not None
    assert n in shell.user_ns["Out"]
    run(shell, "rep = cleanup(include_cpu=True)")
    assert shell.user_ns["w_o"]() is None
    assert n not in shell.user_ns["Out"]
    assert f"_{n}" not in shell.user_ns
    # non-tensor outputs survive
    assert "a string result" in shell.user_ns["Out"].values()
    assert f"Out[{n}]" in shell.user_ns["rep"].cleared


def test_output_cache_kept_by_default_without_include_cpu(shell):
    # CPU tensors are not the tracked kind by default: their cached outputs are not touched
    run(shell, "torch.ones(10)")
    n = shell.execution_count - 1
    run(shell, "cleanup()")
    assert n in shell.user_ns["Out"]


def test_named_deletion_exact(shell):
    run(shell, "a = torch.ones(1024); b = torch.ones(1024); c = torch.ones(1024); n = 5; s = 'str'")
    run(shell, "rep = cleanup('a', 'n', 'does_not_exist', include_cpu=True)")
    ns = shell.user_ns
    assert "a" not in ns and "n" not in ns
    assert "b" in ns and "c" in ns and "s" in ns
    rep = ns["rep"]
    assert rep.deleted == ["a", "n"]
    assert rep.missing == ["does_not_exist"]
    assert rep.not_tensors == ["n"]  # named but not a tensor: deleted, reported
    assert "does_not_exist" in str(rep)


def test_named_deletion_drops_output_cache_alias(shell):
    run(shell, "big = torch.ones(1024 * 1024)")
    run(shell, "big")  # Out[n] is big
    run(shell, "w_big = weakref.ref(big)")
    run(shell, "cleanup('big', output_cache=False, include_cpu=True)")
    assert shell.user_ns["w_big"]() is None


def test_report_names_holders(shell):
    run(shell, """
keeper = torch.ones(3 * 1024 * 1024)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.Adam(model.parameters())
model(torch.ones(4, 64)).sum().backward(); opt.step()
stuff = {'cache': [torch.ones(1024 * 1024)]}
class Trainer: pass
tr = Trainer(); tr.buf = torch.ones(512 * 1024)
""")
    run(shell, "rep = cleanup(include_cpu=True, top=40)")
    rep = shell.user_ns["rep"]
    refs = {r for h in rep.holders for r in h.refs}
    assert rep.holders[0].refs == ["keeper"]
    assert rep.holders[0].nbytes == 12 * MiB
    assert "model.0.weight" in refs
    assert "model.0.weight.grad" in refs
    assert "opt.state[model.0.weight]['exp_avg']" in refs
    assert "stuff['cache'][0]" in refs
    assert "tr.buf" in refs
    text = str(rep)
    assert "keeper" in text and "12.0 MiB" in text


def test_unnamed_holder_described(shell):
    run(shell, """
import types as _t
holder_mod = _t.ModuleType('holder_mod')
def _mk():
    data = torch.ones(5 * 1024 * 1024)
    return lambda: data
fn_closure = _mk()
""")
    run(shell, "rep = cleanup(include_cpu=True, top=3)")
    rep = shell.user_ns["rep"]
    big = rep.holders[0]
    assert big.nbytes == 20 * MiB
    assert any("closure" in r or "unnamed" in r for r in big.refs), big.refs


def test_cleanup_inside_except_block(shell):
    code = """
def f():
    t = torch.ones(1024 * 1024)
    global w_f
    w_f = weakref.ref(t)
    raise RuntimeError("in f")
try:
    f()
except RuntimeError as e:
    rep_exc = cleanup(include_cpu=True)
    alive_in_except = w_f() is not None
"""
    run(shell, code)
    assert shell.user_ns["alive_in_except"] is False
    rep = shell.user_ns["rep_exc"]
    assert any("except" in n for n in rep.notes)
    assert not rep.problems


def test_outside_ipython_caller_globals(shell_instance):
    # plain function call: names are looked up in the caller's globals (this module)
    g = globals()
    g["_gm_tmp_tensor"] = torch.ones(1024)
    g["_gm_tmp_other"] = torch.ones(1024)
    rep = cleanup("_gm_tmp_tensor", include_cpu=True, analyze=False)
    assert "_gm_tmp_tensor" not in g and "_gm_tmp_other" in g
    assert rep.deleted == ["_gm_tmp_tensor"]
    del g["_gm_tmp_other"]


def test_explicit_namespace_and_bad_input():
    ns = {"x": torch.ones(10), "y": [1, 2], "z": torch.ones(10)}
    rep = cleanup("x", "y", "nope", 42, namespace=ns, include_cpu=True)
    assert set(ns) == {"z"}
    assert rep.deleted == ["x", "y"] and rep.not_tensors == ["y"] and rep.missing == ["nope"]
    assert any("strings" in p for p in rep.problems)  # 42 is not a name: reported, not raised


def test_local_variable_reported():
    def f():
        local_t = torch.ones(4)  # noqa: F841
        return cleanup("local_t", analyze=False)

    rep = f()
    assert rep.missing == ["local_t"]
    assert any("local variable" in p for p in rep.problems)


def test_no_gpu_report_says_so():
    rep = cleanup(analyze=False)
    if not torch.cuda.is_available():
        assert rep.cuda == "none" and not rep.cuda_available
        assert "no CUDA device" in str(rep)
    assert isinstance(rep.as_dict(), dict)


def test_never_raises_on_internal_error(monkeypatch):
    import gpumem.cleanup.api  # noqa: F401  (cleanup()'s steps are run from there)

    mod = sys.modules["gpumem.cleanup.api"]

    def boom(*a, **k):
        raise RuntimeError("synthetic")

    monkeypatch.setattr(mod, "_clear_output_cache", boom)
    monkeypatch.setattr(mod, "_get_shell", lambda: types.SimpleNamespace(user_ns={}))
    rep = cleanup(include_cpu=True)
    assert any("synthetic" in p for p in rep.problems)
    assert [s.name for s in rep.steps][:2] == ["tracebacks", "output cache"]


# ---------------------------------------------------------------------------------------------
# the extension
# ---------------------------------------------------------------------------------------------
def test_extension_releases_after_oom(shell):
    shell.extension_manager.load_extension("gpumem.ipython_ext")
    assert "gpumem" in shell.magics_manager.magics["line"]
    assert "gpumem_cleanup" in shell.magics_manager.magics["line"]
    code = """
def forward():
    act = torch.ones(4 * 1024 * 1024)
    global w_oom
    w_oom = weakref.ref(act)
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
forward()
"""
    r = run(shell, code, ok=False)
    assert isinstance(r.error_in_exec, torch.cuda.OutOfMemoryError)
    # nothing else run: the post_run_cell hook already released the frames
    assert shell.user_ns["w_oom"]() is None
    # the error text is still there
    import traceback

    txt = "".join(traceback.format_exception(sys.last_type, sys.last_value, sys.last_traceback))
    assert "CUDA out of memory" in txt


def test_extension_ignores_other_errors(shell):
    shell.extension_manager.load_extension("gpumem.ipython_ext")
    run(shell, FAIL_CELL, ok=False)
    gc.collect()
    assert shell.user_ns["w_act"]() is not None  # only OOMs are handled automatically


def test_extension_magics(shell, capsys):
    shell.extension_manager.load_extension("gpumem.ipython_ext")
    run(shell, "v = torch.ones(10); n = 1")
    run(shell, "%gpumem")
    run(shell, "%gpumem deltas on")
    run(shell, "%gpumem help")
    run(shell, "%gpumem_cleanup v nope --cpu")
    out = capsys.readouterr().out
    assert "gpumem" in out and "not found" in out and "nope" in out
    assert "v" not in shell.user_ns and "n" in shell.user_ns
    run(shell, "%gpumem bogus")
    assert "unknown" in capsys.readouterr().out
    shell.extension_manager.unload_extension("gpumem.ipython_ext")
    assert "gpumem" not in shell.magics_manager.magics["line"]

def test_tensor_kept_only_by_autograd_is_unexplained(shell):
    run(shell, """
a = torch.randn(1024 * 1024, requires_grad=True)
out = (a * torch.full((1024 * 1024,), 2.0)).sum()   # the 4 MiB operand lives only in the graph
""")
    run(shell, "rep = cleanup(include_cpu=True, top=5)")
    rep = shell.user_ns["rep"]
    refs = [h.refs for h in rep.holders if h.nbytes == 4 * MiB]
    assert ["a"] in refs
    assert any("C++" in r[0] for r in refs), refs
