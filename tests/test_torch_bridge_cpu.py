"""The torch bridge on a machine without a GPU / with a CPU-only torch: gpumem still imports, says
why the bridge is skipped, honours GPUMEM_DISABLE, and rejects a bad GPUMEM_CONF at import."""
import os
import subprocess
import sys

import pytest


def run(code, **env):
    full = dict(os.environ)
    full.pop("GPUMEM_DISABLE", None)
    full.pop("GPUMEM_CONF", None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          timeout=300)


def torch_has_cuda():
    try:
        import torch
    except Exception:
        return False
    return torch.version.cuda is not None


def test_import_works_and_status_names_what_is_missing():
    r = run("import gpumem, gpumem._torch as t; print(t.status_line()); print(t.is_active())")
    assert r.returncode == 0, r.stderr
    line, active = r.stdout.strip().splitlines()[-2:]
    # is_active() and the status line agree, whatever the machine
    assert active == str(line == "gpumem: active as torch's CUDA allocator"), (line, active)
    if not torch_has_cuda():
        assert active == "False"
        assert "CPU-only" in line or "not importable" in line, line
        assert "skipped" in line


def test_no_torch_still_imports():
    r = run("import sys; sys.modules['torch'] = None\n"
            "import gpumem, gpumem._torch as t; print(t.status_line())")
    assert r.returncode == 0, r.stderr
    assert "not importable" in r.stdout


def test_disable_is_honoured():
    r = run("import gpumem, gpumem._torch as t; print(t.status_line()); print(t.is_active())",
            GPUMEM_DISABLE="1")
    assert r.returncode == 0, r.stderr
    assert "GPUMEM_DISABLE" in r.stdout
    assert r.stdout.strip().endswith("False")


@pytest.mark.parametrize("conf, key", [("cap:banana", "cap"), ("upstream:floppy", "upstream"),
                                       ("bogus_key:1", "bogus_key")])
def test_bad_conf_raises_at_import_naming_the_key(conf, key):
    r = run("import gpumem", GPUMEM_CONF=conf)
    assert r.returncode != 0
    assert "ValueError" in r.stderr
    assert key in r.stderr.splitlines()[-1]


def test_bad_conf_check_needs_no_gpu():
    from gpumem import _C  # the core extension validates the string
    with pytest.raises(ValueError, match="cap"):
        _C.parse_config("cap:banana", "GPUMEM_CONF")


def test_good_conf_imports():
    r = run("import gpumem, gpumem._torch as t; print(t.status_line())",
            GPUMEM_CONF="cap:0.5,upstream:segments,release:lazy,gc_on_oom:false")
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(torch_has_cuda(), reason="checks the CPU-only torch path")
def test_pool_and_stats_say_why_on_cpu_torch():
    r = run("import gpumem, gpumem._torch as t\n"
            "for f in (lambda: t.pool().__enter__(), lambda: t.stats(0)):\n"
            "    try:\n        f()\n    except RuntimeError as e:\n        print('ERR', e)\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("ERR") == 2 and "CPU-only" in r.stdout


def test_gc_on_oom_skips_a_collect_that_cannot_help():
    """A run of failed allocations with no Python in between (cuDNN trying algorithms) collects once;
    garbage made since, or time passing, brings the collect back."""
    import gc

    from gpumem._torch import _GcOnOom

    g = _GcOnOom()
    gc.collect()
    for _ in range(3):  # the first collect finds nothing (or the second, if the test left garbage)
        g()
    assert g.skipped >= 1 and g.collected <= 2
    collected = g.collected
    for _ in range(10):
        g()
    assert g.collected == collected  # still nothing new: every call skipped

    cycles = []
    for _ in range(200):  # garbage: reference cycles, more objects than NEW_OBJECTS
        c = []
        c.append(c)
        cycles.append(c)
    del cycles, c
    g()
    assert g.collected == collected + 1

    g.QUIET_S = 0.0  # no quiet period: every call collects
    before = g.collected
    g()
    g()
    assert g.collected == before + 2
