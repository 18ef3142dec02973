"""``python -m gpumem run`` and ``gpumem run``, run as a user runs them: real subprocesses from a folder
outside the repository, a real script (or module) that reports what it sees, no mocks.

The script must see what ``python SCRIPT`` / ``python -m MODULE`` would show it (argv, ``__main__``,
``__file__``, ``sys.path[0]``), gpumem already imported, and its exit status must come back as its own.
Under ``torchrun`` (gloo), every rank's script runs so. The GPU side: tests/gpu/test_run_gpu.py.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

REPORT = textwrap.dedent("""\
    import json, os, sys
    print("REPORT " + json.dumps({
        "argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0],
        "gpumem_first": "gpumem" in sys.modules,
        "main_is_me": sys.modules["__main__"].__dict__ is globals(),
    }), flush=True)
    if __name__ == "__main__":
        print("MAIN BLOCK RAN", flush=True)
        if "--exit" in sys.argv:
            sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
        if "--raise" in sys.argv:
            print("about to fail", file=sys.stderr, flush=True)
            raise RuntimeError("the script failed on purpose")
""")


def _env(extra_path: Path | None = None, **extra: str) -> dict:
    env = dict(os.environ)
    env.pop("GPUMEM_CONF", None)
    env.pop("GPUMEM_DISABLE", None)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def run(cwd: Path, *args: str, exe: list | None = None, env: dict | None = None):
    cmd = [*(exe or [sys.executable, "-m", "gpumem"]), "run", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env or _env())


def report(r) -> dict:
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("REPORT ")]
    return json.loads(line[len("REPORT "):])


@pytest.fixture
def script(tmp_path) -> Path:
    d = tmp_path / "scripts"
    d.mkdir()
    p = d / "train.py"
    p.write_text(REPORT)
    return p


@pytest.fixture
def cwd(tmp_path) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    return d


def test_argv_main_file_and_path0_as_python_script_sets_them(cwd, script):
    rel = os.path.relpath(script, cwd)
    r = run(cwd, rel, "--help", "-x", "--lr=3", "plain")
    assert r.returncode == 0, r.stderr
    rep = report(r)
    assert rep["argv"] == [rel, "--help", "-x", "--lr=3", "plain"]  # --help went to the script
    assert "usage:" not in r.stdout
    assert rep["name"] == "__main__" and rep["main_is_me"] and "MAIN BLOCK RAN" in r.stdout
    assert os.path.isabs(rep["file"]) and os.path.samefile(rep["file"], script)  # as Python 3.9+
    assert rep["path0"] == os.path.realpath(script.parent)
    # The same as `python SCRIPT` shows it
    direct = subprocess.run([sys.executable, rel, "--help", "-x", "--lr=3", "plain"], cwd=cwd,
                            capture_output=True, text=True, timeout=300, env=_env())
    want = report(direct)
    for key in ("argv", "name", "file", "path0"):
        assert rep[key] == want[key], key


def test_gpumem_is_imported_before_the_script(cwd, script):
    r = run(cwd, str(script))
    assert r.returncode == 0, r.stderr
    assert report(r)["gpumem_first"] is True
    assert r.stderr.startswith("gpumem: ")  # the banner: gpumem.status_line()


def test_quiet_drops_the_banner_and_status_prints_it(cwd, script):
    r = run(cwd, "--quiet", str(script))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert report(r)["gpumem_first"] is True
    r = run(cwd, "--quiet", "--status", str(script))
    assert r.returncode == 0 and r.stderr.startswith("gpumem: "), r.stderr


@pytest.mark.parametrize("args, code", [([], 0), (["--exit", "0"], 0), (["--exit", "3"], 3)])
def test_exit_status_is_the_scripts(cwd, script, args, code):
    r = run(cwd, "--quiet", str(script), *args)
    assert r.returncode == code, r.stderr
    assert "MAIN BLOCK RAN" in r.stdout and "Traceback" not in r.stderr


def test_an_uncaught_exception_exits_1_with_its_traceback(cwd, script):
    r = run(cwd, "--quiet", str(script), "--raise")
    assert r.returncode == 1
    assert "about to fail" in r.stderr  # the script's own stderr is kept
    assert "Traceback (most recent call last):" in r.stderr
    assert f'File "{script}", line ' in r.stderr
    assert r.stderr.rstrip().endswith("RuntimeError: the script failed on purpose")
    assert "runpy" not in r.stderr and "gpumem" not in r.stderr  # the launcher's frames left out


def test_keyboard_interrupt_exits_130(cwd, tmp_path):
    p = tmp_path / "interrupted.py"
    p.write_text("raise KeyboardInterrupt\n")
    r = run(cwd, "--quiet", str(p))
    assert r.returncode == 130
    assert r.stderr.rstrip().endswith("KeyboardInterrupt")


def test_dash_m_runs_a_module_as_python_dash_m(cwd, tmp_path):
    pkg_root = tmp_path / "pkgs"
    (pkg_root / "mypkg").mkdir(parents=True)
    (pkg_root / "mypkg" / "__init__.py").write_text("")
    (pkg_root / "mypkg" / "trainer.py").write_text(REPORT)
    env = _env(pkg_root)
    r = run(cwd, "--quiet", "-m", "mypkg.trainer", "--help", "--exit", "4", env=env)
    assert r.returncode == 4, r.stderr
    rep = report(r)
    module_file = str(pkg_root / "mypkg" / "trainer.py")
    assert rep["argv"] == [module_file, "--help", "--exit", "4"]
    assert rep["name"] == "__main__" and rep["file"] == module_file and "MAIN BLOCK RAN" in r.stdout
    assert rep["path0"] == str(cwd) and rep["gpumem_first"] is True
    direct = subprocess.run([sys.executable, "-m", "mypkg.trainer", "a"], cwd=cwd, capture_output=True,
                            text=True, timeout=300, env=env)
    want = report(direct)
    assert (want["argv"][0], want["path0"]) == (rep["argv"][0], rep["path0"])
    r = run(cwd, "-mmypkg.trainer", "b", env=env)  # the joined form, as python accepts it
    assert r.returncode == 0 and report(r)["argv"][1:] == ["b"], r.stderr


def test_a_missing_script_exits_2_with_a_clear_message(cwd):
    r = run(cwd, "no_such_script.py", "--flag")
    assert r.returncode == 2
    assert "can't open file" in r.stderr and "no_such_script.py" in r.stderr
    assert "No such file or directory" in r.stderr and "Traceback" not in r.stderr


def test_a_missing_module_says_so(cwd):
    r = run(cwd, "-m", "no_such_module_for_gpumem")
    assert r.returncode == 1
    assert "No module named no_such_module_for_gpumem" in r.stderr and "Traceback" not in r.stderr


def test_a_bad_gpumem_conf_exits_2_naming_the_key_before_the_script_runs(cwd, script):
    r = run(cwd, str(script), env=_env(GPUMEM_CONF="no_such_key:1"))
    assert r.returncode == 2
    assert "GPUMEM_CONF" in r.stderr and "no_such_key" in r.stderr and "Traceback" not in r.stderr
    assert "REPORT" not in r.stdout  # the script never started
    r = run(cwd, str(script), env=_env(GPUMEM_CONF="upstream:vmm"))  # a good one is accepted
    assert r.returncode == 0, r.stderr


def test_usage_errors_exit_2(cwd):
    for args in ([], ["--bogus", "x.py"], ["-m"]):
        r = run(cwd, *args)
        assert r.returncode == 2, args
        assert r.stderr.startswith("usage: python -m gpumem run") and "error:" in r.stderr
    r = run(cwd, "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m gpumem run")
    assert "--quiet" in r.stdout and "--status" in r.stdout and "-m MODULE" in r.stdout


def _script() -> str | None:
    name = "gpumem.exe" if os.name == "nt" else "gpumem"
    path = Path(sysconfig.get_path("scripts")) / name
    return str(path) if path.is_file() else shutil.which("gpumem")


def test_console_script_run(cwd, script):
    exe = _script()
    if exe is None:
        pytest.skip("no `gpumem` script on this environment (gpumem not installed with pip)")
    r = run(cwd, str(script), "--help", "--exit", "5", exe=[exe])
    assert r.returncode == 5, r.stderr
    rep = report(r)
    assert rep["argv"] == [str(script), "--help", "--exit", "5"]
    assert rep["gpumem_first"] is True and rep["name"] == "__main__"
    assert rep["path0"] == os.path.realpath(script.parent)  # not the script's bin folder
    r = run(cwd, str(script), exe=[exe], env=_env(GPUMEM_CONF="no_such_key:1"))
    assert r.returncode == 2 and "no_such_key" in r.stderr and "Traceback" not in r.stderr
    r = run(cwd, "--bogus", exe=[exe])
    assert r.returncode == 2 and r.stderr.startswith("usage: gpumem run")


@pytest.mark.parametrize("flag, package", [("--cupy", "cupy"), ("--numba", "numba-cuda"), ("--rmm", "rmm")])
def test_an_integration_flag_whose_library_is_missing_exits_2_naming_it(cwd, script, flag, package):
    module = {"--cupy": "cupy", "--numba": "numba", "--rmm": "rmm"}[flag]
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here: this checks the error where it is not")
    r = run(cwd, flag, str(script), "--cupy")  # (after SCRIPT, --cupy is the script's)
    assert r.returncode == 2, r.stderr
    assert f"needs {package}" in r.stderr and "Traceback" not in r.stderr
    assert "REPORT" not in r.stdout  # the script never started
    r = run(cwd, "--help")
    assert flag in r.stdout


DIST = textwrap.dedent("""\
    import json, os, sys
    gpumem_first = "gpumem" in sys.modules
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.full((8,), float(rank + 1))
    dist.all_reduce(t)
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump({"argv": sys.argv, "name": __name__, "gpumem_first": gpumem_first,
                   "world": dist.get_world_size(), "env_rank": os.environ["RANK"], "sum": float(t[0])}, f)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("launcher, nproc", [("-m", 2), ("--no-python", 1)])
def test_torchrun_starts_gpumem_run_on_every_rank(cwd, tmp_path, launcher, nproc):
    """torchrun -m gpumem run SCRIPT and torchrun --no-python gpumem run SCRIPT (the console script as
    the program), on gloo: every rank runs the script as __main__ with gpumem first and its own argv."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    p = tmp_path / "dist_script.py"
    p.write_text(DIST)
    out = tmp_path / "ranks"
    out.mkdir()
    if launcher == "-m":
        program = ["-m", "gpumem"]
    else:
        exe = _script()
        if exe is None:
            pytest.skip("no `gpumem` script on this environment (gpumem not installed with pip)")
        program = ["--no-python", exe]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           *program, "run", "--quiet", str(p), str(out), "--flag"]
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=_env())
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    for rank in range(nproc):
        rep = json.loads((out / f"rank{rank}.json").read_text())
        assert rep["argv"] == [str(p), str(out), "--flag"] and rep["name"] == "__main__"
        assert rep["gpumem_first"] is True and rep["env_rank"] == str(rank)
        assert rep["world"] == nproc and rep["sum"] == nproc * (nproc + 1) / 2
