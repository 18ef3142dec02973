"""GPU test of gpumem.report: tools/report_gpu_check.py in a fresh process (CUDA must start after
gpumem is imported there), with a small large-trace part; it checks the live page's figures against
torch.cuda.memory_allocated(), the OOM and empty_cache markers, the traceback's bytes, the holders
and the stacks, and renders the pages where Chromium is installed."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("allocator", ["gpumem", "native"])
def test_report_gpu_check(tmp_path, allocator):
    env = dict(os.environ, OUT=str(tmp_path))
    env.pop("GPUMEM_DISABLE", None)
    if allocator == "native":
        env["GPUMEM_DISABLE"] = "1"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "report_gpu_check.py"), "--events", "30000",
                        "--tag", allocator], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "all checks passed" in r.stdout
    assert (tmp_path / f"report_live_{allocator}.html").is_file()
