"""`import gpumem` works without torch; the parts that need torch say so when used."""
import subprocess
import sys

SCRIPT = r"""
import sys
sys.modules["torch"] = None  # as if torch were not installed
import gpumem
print("status:", gpumem.status_line())
print("summary:", gpumem.summary())
from gpumem.replay import bundled_traces
print("replay:", gpumem.replay(bundled_traces()[1]).ooms)
try:
    gpumem.find_batch_size
except ImportError as e:
    print("find_batch_size:", e)
"""


def test_import_and_replay_without_torch_and_clear_errors_for_the_rest():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "status: gpumem: PyTorch is not importable" in out
    assert "summary: gpumem: PyTorch is not importable" in out
    assert "replay: 0" in out
    assert "find_batch_size: gpumem.find_batch_size needs PyTorch" in out
