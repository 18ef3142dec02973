"""The command line, run as a user runs it: ``python -m gpumem ...`` (and the ``gpumem`` script) in a
real subprocess, from a folder outside the repository, for every command and option the README shows.

Without a GPU, ``status`` has nothing to show: it must say which of NVML, driver or GPU is missing and
exit 0. Its refresh loop and Ctrl-C run against the real NVML where it finds a GPU, and otherwise
against a stand-in ``pynvml`` module put on the child's PYTHONPATH (the only way to see the loop on a
machine without one); everything else in the child is the installed gpumem as it is.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
from pathlib import Path

import pytest

from gpumem.replay import bundled_traces
from gpumem.report import examples

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RECORD = (ROOT / "docs" / "benchmarks.md").read_text()  # the benchmark record, commands beside figures
NO_GPU = "gpumem status: no GPU to show:"


def _env(extra_path: Path | None = None) -> dict:
    env = dict(os.environ)
    env.pop("GPUMEM_CONF", None)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run(cwd: Path, *args: str, exe: list | None = None, env: dict | None = None, timeout: float = 300):
    cmd = [*(exe or [sys.executable, "-m", "gpumem"]), *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env or _env())


@pytest.fixture
def cwd(tmp_path):
    return tmp_path


def _real_gpus() -> bool:
    """Does the real NVML see a GPU here (as the child will)?"""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    try:
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return False
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


STAND_IN_NVML = textwrap.dedent("""\
    # A stand-in for nvidia-ml-py on a machine without a GPU: one H100 running one process.
    from types import SimpleNamespace
    class NVMLError(Exception):
        pass
    def nvmlInit(): pass
    def nvmlShutdown(): pass
    def nvmlDeviceGetCount(): return 1
    def nvmlDeviceGetHandleByIndex(i): return i
    def nvmlDeviceGetName(h): return b"NVIDIA H100 80GB HBM3"
    def nvmlDeviceGetMemoryInfo(h): return SimpleNamespace(used=10 << 30, total=80 << 30, free=70 << 30)
    def nvmlDeviceGetUtilizationRates(h): return SimpleNamespace(gpu=37, memory=10)
    def nvmlDeviceGetComputeRunningProcesses(h): return [SimpleNamespace(pid=1, usedGpuMemory=9 << 30)]
    def nvmlDeviceGetGraphicsRunningProcesses(h): return []
""")


@pytest.fixture
def gpu_env(tmp_path):
    """The child's environment for the refresh loop: the real NVML where it sees a GPU, else the stand-in."""
    if _real_gpus():
        return _env()
    d = tmp_path / "nvml"
    d.mkdir()
    (d / "pynvml.py").write_text(STAND_IN_NVML)
    return _env(d)


# ------------------------------------------------------------------------------------------------
# What the README shows
# ------------------------------------------------------------------------------------------------
def _readme_commands() -> dict:
    """Every ``python -m gpumem SUB ...`` the README and the benchmark record it links show (code blocks
    and inline), by subcommand, with the options each names."""
    text = (README + "\n" + RECORD).replace("\\\n", " ")
    found: dict = {}
    for m in re.finditer(r"python -m gpumem (\w+)((?:[^\n`]|\n(?=\s{8,}\[))*)", text):
        found.setdefault(m.group(1), set()).update(re.findall(r"--[a-z][a-z-]*", m.group(2)))
    return found


def _github_anchor(title: str) -> str:
    """The anchor GitHub makes of a heading's title: lower case; what is not a letter, digit, ``_``,
    ``-`` or space dropped; spaces made ``-``."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def test_the_readmes_contents_link_every_section_in_order():
    """The Contents line under the README's introduction links each ``## `` section, in order, by the
    anchor GitHub makes of its title, so a renamed or added section that the list misses fails here."""
    titles = re.findall(r"^## (.+)$", README, re.M)
    contents = " ".join(README[README.index("Contents: "):README.index("## Install and run")].split())
    anchors = re.findall(r"\]\(#([^)]+)\)", contents)
    assert anchors == [_github_anchor(t) for t in titles]


def test_every_relative_link_of_the_readme_and_docs_resolves():
    """Each ``[text](path)`` link in README.md and docs/*.md that is not a web address names a file or
    folder of the repository (relative to the page), and each ``#anchor`` into a page names one of its
    headings, so moving a section or a file (the benchmark record, docs/benchmarks.md) cannot leave a
    link dangling."""
    anchors: dict = {}  # page -> the anchors of its headings, each page read once
    def anchors_of(page: Path) -> set:
        if page not in anchors:
            titles = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
            anchors[page] = {_github_anchor(t.strip()) for t in titles}
        return anchors[page]

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    checked = 0
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.name}: link to {target}: no such file"
            if anchor and dest.suffix == ".md":
                assert anchor in anchors_of(dest), f"{page.name}: link to {target}: no such heading"
            checked += 1
    assert checked > 40, checked  # the pages link each other: a parser that finds none is broken


def test_every_command_and_option_in_the_readme_is_accepted(cwd):
    cmds = _readme_commands()
    assert set(cmds) == {"replay", "status", "run", "report"}, cmds
    assert {"--quiet", "--status"} <= cmds["run"]
    assert {"--output", "--device", "--example"} <= cmds["report"]
    assert {"--upstream", "--release", "--page-size", "--capacity", "--json", "--quiet"} <= cmds["replay"]
    assert "--watch" in cmds["status"]
    for sub, options in cmds.items():
        r = run(cwd, sub, "--help")
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(f"usage: python -m gpumem {sub}")
        for opt in options:
            assert re.search(rf"(^|[\s\[,]){re.escape(opt)}\b", r.stdout), (sub, opt, r.stdout)


def test_top_level_help_lists_every_command(cwd):
    r = run(cwd, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: python -m gpumem")
    assert all(c in r.stdout for c in ("replay", "status", "run", "report"))


@pytest.mark.parametrize("args, usage", [
    (["--bogus"], "usage: python -m gpumem "),
    ([], "usage: python -m gpumem "),
    (["frobnicate"], "usage: python -m gpumem "),
    (["replay", "--bogus"], "usage: python -m gpumem replay"),
    (["replay", "--upstream", "cuda"], "usage: python -m gpumem replay"),
    (["status", "--bogus"], "usage: python -m gpumem status"),
    (["status", "--watch", "soon"], "usage: python -m gpumem status"),
    (["status", "--count", "0"], "usage: python -m gpumem status"),
    (["report", "--bogus"], "usage: python -m gpumem report"),
    (["report", "--device", "one"], "usage: python -m gpumem report"),
])
def test_a_bad_option_exits_2_with_the_usage(cwd, args, usage):
    r = run(cwd, *args)
    assert r.returncode == 2, (args, r.stdout, r.stderr)
    assert r.stderr.startswith(usage) and "error:" in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------------
# replay
# ------------------------------------------------------------------------------------------------
def test_replay_without_options_replays_the_bundled_traces(cwd):
    r = run(cwd, "replay")
    assert r.returncode == 0, r.stderr
    assert "gpumem pool, upstream=vmm, release=lazy" in r.stdout
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines()
            if line.split() and line.split()[0] in ("gpt_varlen", "resnet50")}
    assert set(rows) == {"gpt_varlen", "resnet50"}
    for row in rows.values():
        live, reserved, ratio = float(row[1]), float(row[2]), float(row[3])
        assert 0 < live <= reserved and 1.0 <= ratio < 1.1
    assert "replaying:" in r.stderr  # progress goes to stderr


def test_replay_with_every_option(cwd):
    trace = str(bundled_traces()[1])
    r = run(cwd, "replay", trace, "--upstream", "segments", "--release", "high_water",
            "--page-size", "2MiB", "--capacity", "80GiB", "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    (row,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert (row["upstream"], row["release"], row["page_size"], row["capacity_bytes"]) == \
        ("segments", "high_water", 2 << 20, 80 << 30)
    assert row["trace"] == trace and row["ooms"] == 0 and row["fragmentation"] >= 1.0


def test_replay_json_is_one_object_per_trace(cwd):
    r = run(cwd, "replay", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["workload"] for x in rows] == ["gpt_varlen", "resnet50"]
    assert "replaying:" not in r.stderr


def test_replay_quiet_prints_the_table_without_progress(cwd):
    r = run(cwd, "replay", "--quiet", "--release", "high_water", "--page-size", "2MiB",
            str(bundled_traces()[1]))
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and "resnet50" in r.stdout and "release=high_water" in r.stdout
    assert "pages of 2 MiB" in r.stdout


def test_a_malformed_trace_names_file_and_line(cwd):
    bad = cwd / "bad.trace"
    bad.write_text("a 1 1024 0\nf 1\nthis is not a trace line\n")
    r = run(cwd, "replay", "--quiet", str(bad))
    assert r.returncode != 0
    assert f"{bad}:3: " in r.stderr and "Traceback" not in r.stderr
    r = run(cwd, "replay", "--json", "bad.trace")  # relative to the folder it runs in
    assert r.returncode != 0 and "bad.trace:3: " in r.stderr and r.stdout == ""


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("example", examples(), ids=lambda p: p.name)
def test_report_of_each_bundled_snapshot(cwd, example):
    r = run(cwd, "report", str(example), "-o", "out.html")
    assert r.returncode == 0, r.stderr
    page = (cwd / "out.html").read_text()
    assert r.stdout.startswith(f"out.html: report of {example} (") and "written in" in r.stdout
    assert page.startswith("<!DOCTYPE html>") and 'id="report-data"' in page
    assert "It ran out of memory 1 time" in page


def test_report_options(cwd):
    r = run(cwd, "report", "--example", "--output", "ex.html", "--device", "0")
    assert r.returncode == 0, r.stderr
    assert (cwd / "ex.html").is_file()
    r = run(cwd, "report", "--example")  # default file name, in the folder it runs in
    assert r.returncode == 0 and (cwd / "gpumem-report.html").is_file(), r.stderr


@pytest.mark.parametrize("args, message", [
    ([], "gpumem report: give a snapshot file"),
    (["missing.pickle"], "gpumem report: missing.pickle: no such snapshot file"),
    (["bad.pickle"], "gpumem report: bad.pickle: not a memory snapshot"),
    (["--example", "bad.pickle"], "gpumem report: give a SNAPSHOT or --example, not both"),
    (["--example", "--device", "3"], "gpumem report: "),
])
def test_report_errors_exit_2_with_one_line(cwd, args, message):
    (cwd / "bad.pickle").write_bytes(b"these bytes are no snapshot")
    r = run(cwd, "report", *args, "-o", "r.html")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith(message) and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert not (cwd / "r.html").exists()


# ------------------------------------------------------------------------------------------------
# status
# ------------------------------------------------------------------------------------------------
def test_status(cwd):
    r = run(cwd, "status", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    if _real_gpus():
        assert r.stdout.startswith("GPU 0")
    else:  # says what is missing: the bindings, the driver or a GPU
        assert r.stdout.startswith(NO_GPU), r.stdout
        assert re.search(r"nvidia-ml-py|NVML|no GPUs", r.stdout)


def test_status_json(cwd):
    r = run(cwd, "status", "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert set(data) == {"time", "gpus", "error"}
    if _real_gpus():
        assert data["error"] is None and data["gpus"][0]["total"] > 0
    else:
        assert data["gpus"] == [] and data["error"]


def test_status_watch_with_count(cwd):
    t0 = time.monotonic()
    r = run(cwd, "status", "--watch", "0.1", "--count", "2", timeout=60)
    assert r.returncode == 0, r.stderr
    if _real_gpus():
        assert r.stdout.count("GPU 0") == 2
    else:  # nothing will appear to watch: said once, and it returns at once
        assert r.stdout.count(NO_GPU) == 1
    assert time.monotonic() - t0 < 60


def test_status_watch_refreshes_and_json_lines(cwd, gpu_env):
    r = run(cwd, "status", "--watch", "0.1", "--count", "3", env=gpu_env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("GPU 0") == 3 and re.match(r"\d\d:\d\d:\d\d\n", r.stdout)
    r = run(cwd, "status", "--watch", "0.1", "--count", "2", "--json", env=gpu_env, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 2 and all(x["error"] is None and x["gpus"][0]["total"] > 0 for x in rows)
    assert rows[0]["time"] <= rows[1]["time"]


def test_status_watch_ends_cleanly_on_ctrl_c(cwd, gpu_env):
    # Where this test runs with SIGINT ignored (a background job), the child would inherit that and
    # Python would install no Ctrl-C handler: a handler here is reset to the default in the child.
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        p = subprocess.Popen([sys.executable, "-m", "gpumem", "status", "--watch", "0.1"], cwd=cwd,
                             env=gpu_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    guard = threading.Timer(120, p.kill)  # never hang the suite on a child that prints nothing
    guard.start()
    try:
        assert p.stdout is not None
        seen: list = []
        while sum("GPU 0" in line for line in seen) < 2 and len(seen) < 1000:  # in the loop
            line = p.stdout.readline()
            if not line:
                break
            seen.append(line)
        assert sum("GPU 0" in line for line in seen) >= 2, seen
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        guard.cancel()
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


# ------------------------------------------------------------------------------------------------
# The ``gpumem`` script
# ------------------------------------------------------------------------------------------------
def _script() -> str | None:
    """The ``gpumem`` script of the environment this test runs in, if gpumem is installed there."""
    name = "gpumem.exe" if os.name == "nt" else "gpumem"
    path = Path(sysconfig.get_path("scripts")) / name
    return str(path) if path.is_file() else shutil.which("gpumem")


def test_console_script(cwd):
    script = _script()
    if script is None:
        pytest.skip("no `gpumem` script on this environment (gpumem not installed with pip)")
    r = run(cwd, "--help", exe=[script])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: gpumem ") and "replay" in r.stdout
    r = run(cwd, "status", "--json", exe=[script], timeout=60)
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout)) == {"time", "gpus", "error"}
    r = run(cwd, "replay", "--json", "--capacity", "8GiB", str(bundled_traces()[1]), exe=[script])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["capacity_bytes"] == 8 << 30
    r = run(cwd, "report", "--example", "-o", "s.html", exe=[script])
    assert r.returncode == 0 and (cwd / "s.html").is_file(), r.stderr
    r = run(cwd, "status", "--bogus", exe=[script])
    assert r.returncode == 2 and r.stderr.startswith("usage: gpumem status")
