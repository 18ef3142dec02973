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


STAND_IN_TOOL = r"""#!/usr/bin/env bash
# compute-sanitizer's command line, without the tool: runs the program after its flags and writes the
# log --log-file names (%p: this pid), with the ERROR SUMMARY line the real tool writes when it ends.
if [ "$1" = "--version" ]; then echo "stand-in compute-sanitizer"; exit 0; fi
log=""
while [ $# -gt 0 ] && [ "$1" != python ]; do
  case "$1" in --log-file) log="$2"; shift 2 ;; *) shift ;; esac
done
log=${log//%p/$$}
echo "========= COMPUTE-SANITIZER" > "$log"
"$@"; rc=$?
echo "========= ERROR SUMMARY: 0 errors" >> "$log"
exit $rc
"""


@pytest.mark.skipif(sys.platform == "win32", reason="needs bash")
def test_a_budget_stops_the_groups_still_running_and_names_their_tests(tmp_path):
    """compute_sanitizer.sh with SANITIZER_BUDGET_S, under a stand-in for the tool (the real one needs a
    GPU): the group that finished is printed and judged, the one still running at the budget is
    stopped (its log has no ERROR SUMMARY: incomplete, exit 1), and its test that did not finish is
    written to notrun.txt, the form a later call takes back."""
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    for name in ("compute_sanitizer.sh", "sanitizer_summary.py"):
        (repo / "tools" / name).write_text((SCRIPT.parent / name).read_text())
    (repo / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_three.py").write_text(
        "import time\nimport pytest\n\n"
        "@pytest.mark.gpu\ndef test_fast():\n    pass\n\n"
        "@pytest.mark.gpu\ndef test_slow():\n    time.sleep(300)\n\n"
        "@pytest.mark.gpu\ndef test_other():\n    pass\n")
    tool = tmp_path / "compute-sanitizer"
    tool.write_text(STAND_IN_TOOL)
    tool.chmod(0o755)
    logs = tmp_path / "logs"
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "COMPUTE_SANITIZER": str(tool),
           "LOG_DIR": str(logs), "SHARDS": "2", "SANITIZER_BUDGET_S": "20", "HOME": str(tmp_path)}
    p = subprocess.run(["bash", str(repo / "tools" / "compute_sanitizer.sh"), "-m", "gpu", "tests"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "3 tests in 2 groups at once" in out and "(for at most 20 s)" in out, out
    assert "--- group 0 (pytest exit 0)" in out and "tests/test_three.py::test_other PASSED" in out, out
    assert "--- group 1 (pytest exit 124, stopped at the budget)" in out, out
    assert (logs / "notrun.txt").read_text() == "tests/test_three.py::test_slow\n"
    assert "1 of 3 tests did not finish" in out
    assert "[incomplete]" in out and "0 errors in 2 log(s)" in out and "pytest exit 124" in out, out
