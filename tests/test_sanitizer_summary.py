"""tools/sanitizer_summary.py, the judge of the GPU suite's compute-sanitizer run, on logs shaped like
the tool's (lines taken from real memcheck logs of the GPU machine). No GPU needed."""
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "sanitizer_summary.py"
P = "========= "
OOM_API = (P + 'Program hit CUDA_ERROR_OUT_OF_MEMORY (error 2) due to "out of memory" on CUDA API call to cuMemCreate.\n'
           + P + "    Saved host backtrace up to driver entry point at error\n")
INVALID_WRITE = (P + "Invalid __global__ write of size 4 bytes\n" + P + "    at fill(float *, int)+0x70\n"
                 + P + "    by thread (31,0,0) in block (0,0,0)\n" + P + "    Address 0x7f0000000400 is out of bounds\n"
                 + P + "    and is 1 bytes after the nearest allocation at 0x7f0000000000 of size 1023 bytes\n")
BAD_API = P + 'Program hit cudaErrorInvalidValue (error 1) due to "invalid argument" on CUDA API call to cudaMemcpyAsync.\n'
UNTRACKED = (P + "Internal Sanitizer Error: The Sanitizer encountered an error while launching _ZN2at6native29vectorized"
             "_elementwise_kernel and didn't track the launch. Errors might go undetected. (Unable to allocate enough "
             "memory to perform the requested operation)\n")


def judge(tmp_path, body, rc=0, summary=True):
    log = P + "COMPUTE-SANITIZER\n" + body + (f"{P}ERROR SUMMARY: {body.count('Program hit') + 1} errors\n" if summary else "")
    (tmp_path / "memcheck.4242.log").write_text(log)
    p = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), str(rc), "12"], capture_output=True, text=True)
    return p.returncode, p.stdout


def test_expected_oom_results_pass(tmp_path):
    code, out = judge(tmp_path, OOM_API * 3)
    assert code == 0, out
    assert "3 x CUDA_ERROR_OUT_OF_MEMORY from cuMemCreate" in out
    assert "(0 memory access, 3 CUDA API errors of which 0 not out-of-memory, 0 other, 0 kernel launches" in out


@pytest.mark.parametrize("body, what", [
    (INVALID_WRITE, "1 memory access"),
    (BAD_API, "of which 1 not out-of-memory"),
    (UNTRACKED * 2, "2 kernel launches the tool could not track"),
    (P + "Error: process didn't terminate successfully\n", "1 other"),
])
def test_each_finding_fails_the_run(tmp_path, body, what):
    code, out = judge(tmp_path, OOM_API + body)
    assert code == 1 and what in out, out


def test_a_report_counts_once_not_per_detail_line(tmp_path):
    code, out = judge(tmp_path, INVALID_WRITE * 2)
    assert code == 1 and "(2 memory access" in out, out


def test_failed_pytest_fails_a_clean_log(tmp_path):
    code, out = judge(tmp_path, "", rc=1)
    assert code == 1 and "pytest exit 1" in out


def test_unfinished_or_missing_log_fails(tmp_path):
    code, out = judge(tmp_path, OOM_API, summary=False)
    assert code == 1 and "[incomplete]" in out
    (tmp_path / "memcheck.4242.log").unlink()
    p = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "0", "1"], capture_output=True, text=True)
    assert p.returncode == 1 and "checked nothing" in p.stdout
