"""Static checks of the Python package, run by the test suite so CI runs them: ``ruff check`` and
``mypy`` over python/gpumem, with the configuration in pyproject.toml. Each is skipped, saying so,
where its tool is not installed (``pip install -r requirements-dev.txt`` installs both)."""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tool(module, *args):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -r requirements-dev.txt)")
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"{module} {' '.join(args)} reported:\n{r.stdout}{r.stderr}"
    return r.stdout


def test_ruff_finds_nothing():
    run_tool("ruff", "check", "--no-cache", "python/gpumem")


def test_mypy_finds_nothing(tmp_path):
    out = run_tool("mypy", "--cache-dir", str(tmp_path / "mypy_cache"), "python/gpumem")
    assert "Success" in out, out
