#!/usr/bin/env bash
# Runs the GPU test suite under NVIDIA compute-sanitizer's memcheck (out-of-bounds and misaligned
# device accesses, accesses to freed or unmapped memory, device-side hardware exceptions, CUDA API
# errors) and prints one summary line over every process the suite started.
#
#   bash tools/compute_sanitizer.sh                    # python -m pytest -m gpu tests/gpu -x -q
#   bash tools/compute_sanitizer.sh -m gpu tests/gpu/test_torch_bridge_gpu.py -q   # other pytest args
#   SHARDS=3 bash tools/compute_sanitizer.sh -m gpu tests/gpu/test_integrations_gpu.py   # 3 at once
#   SHARDS=3 SANITIZER_BUDGET_S=500 bash tools/compute_sanitizer.sh -m gpu tests/gpu   # stop in time
#
# Environment:
#   SHARDS                   N > 1: collect the tests the arguments select, deal them round-robin into N
#                            groups and run the groups at once, one tool instance each, on the same GPU
#                            (each group: python -m pytest -m gpu -q -rfEs -p no:cacheprovider NODE_IDS;
#                            its output in LOG_DIR/pytest.shardK.log, printed when all are done). The
#                            tool slows each process many times over while the GPU and the CPU cores
#                            mostly wait, so tests that each start their own Python (the integration
#                            tests) finish about N times sooner. One summary over every group's logs.
#   SANITIZER_BUDGET_S       seconds the groups may run (default 0: no limit). Past it the groups still
#                            running are stopped (their tool processes write no ERROR SUMMARY, so the
#                            verdict is "incomplete", exit 1), every group's output is still printed, and
#                            the tests that did not finish are written to LOG_DIR/notrun.txt, to pass to a
#                            later call: bash tools/compute_sanitizer.sh -m gpu $(cat notrun.txt). Why: a
#                            GPU machine's calls end at 10 minutes, and a call cut from outside (timeout)
#                            prints nothing of the groups that had finished. Runs the tests in groups as
#                            SHARDS does (one group where SHARDS is 1).
#   COMPUTE_SANITIZER        path of the compute-sanitizer binary (default: PATH, then CUDA installs)
#   COMPUTE_SANITIZER_FLAGS  extra flags, e.g. "--show-backtrace yes" to see where an error came from
#                            (see below), "--leak-check full" (gpumem keeps its pool until exit, so leak
#                            reports at exit list cached memory; off by default)
#   LOG_DIR                  where the per-process logs go (default: $OUT/compute-sanitizer if $OUT is
#                            set, else build/compute-sanitizer)
# Exit status: 0 only when pytest passed and memcheck reported no memory-access error, no CUDA API
# error other than "out of memory" and no launch it could not track (tools/sanitizer_summary.py).
#
# Flags, and why:
#   --target-processes all   pytest, torch's compile workers and torchrun children are all checked
#   --require-cuda-init no   child processes that never touch CUDA are not errors
#   --launch-timeout 600     Python + torch start slowly under the tool
#   --log-file ...%p         one log for the run (%p is the tool's pid; every tracked process writes
#                            there); pytest's own output stays on the console
#   --show-backtrace device  no host backtraces: with them, compute-sanitizer 2025.3 keeps alive the
#                            Python frames of every call that reached CUDA, and so every tensor those
#                            frames held (shown with PyTorch's own allocator, without gpumem:
#                            tools/sanitizer_frames_check.py). Tests that free memory by dropping frames
#                            (cleanup, the batch-size finder, the notebooks) then fail for the tool's
#                            reason. An error is still reported, with its device backtrace; rerun the test
#                            with COMPUTE_SANITIZER_FLAGS="--show-backtrace yes" for the host side.
#   --report-api-errors explicit (the default): CUDA calls that return errors the caller did not
#                            expect are counted; probes torch makes on purpose are reported too, and
#                            the summary lists them apart from memory errors so they can be judged
set -uo pipefail

cd "$(dirname "$0")/.."

find_sanitizer() {
  if [[ -n "${COMPUTE_SANITIZER:-}" ]]; then echo "$COMPUTE_SANITIZER"; return; fi
  command -v compute-sanitizer 2>/dev/null && return
  for d in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-* /opt/cuda /opt/nvidia/hpc_sdk/*/*/cuda/*; do
    [[ -n "$d" && -x "$d/bin/compute-sanitizer" ]] && { echo "$d/bin/compute-sanitizer"; return; }
    [[ -n "$d" && -x "$d/compute-sanitizer/compute-sanitizer" ]] && { echo "$d/compute-sanitizer/compute-sanitizer"; return; }
  done
  # pip's CUDA packages (nvidia-cuda-sanitizer) ship it inside site-packages/nvidia
  python - <<'EOF' 2>/dev/null
import glob, os, site
for base in site.getsitepackages() + [site.getusersitepackages()]:
    for p in glob.glob(os.path.join(base, "nvidia", "**", "compute-sanitizer"), recursive=True):
        if os.path.isfile(p) and os.access(p, os.X_OK):
            print(p); raise SystemExit
EOF
}

CS="$(find_sanitizer)"
if [[ -z "$CS" || ! -x "$CS" ]]; then
  echo "compute-sanitizer not found: install the CUDA toolkit (it ships in <cuda>/bin) or set COMPUTE_SANITIZER" >&2
  exit 2
fi

LOG_DIR="${LOG_DIR:-${OUT:+$OUT/compute-sanitizer}}"
LOG_DIR="${LOG_DIR:-build/compute-sanitizer}"
mkdir -p "$LOG_DIR"
rm -f "$LOG_DIR"/memcheck.*.log

if [[ $# -eq 0 ]]; then set -- -m gpu tests/gpu -x -q; fi

STOP=()  # a command the tool runs under: `timeout` where there is a budget (below)
memcheck() {  # memcheck ARGS: python -m pytest ARGS under the tool, logs in LOG_DIR (one per tool process)
  # shellcheck disable=SC2086
  "${STOP[@]}" "$CS" --tool memcheck --target-processes all --require-cuda-init no --launch-timeout 600 \
    --show-backtrace device --print-limit 1000 --log-file "$LOG_DIR/memcheck.%p.log" ${COMPUTE_SANITIZER_FLAGS:-} \
    python -m pytest "$@"
}

SHARDS=${SHARDS:-1}
[[ "$SHARDS" =~ ^[1-9][0-9]*$ ]] || { echo "SHARDS must be a positive integer, not '$SHARDS'" >&2; exit 2; }
BUDGET=${SANITIZER_BUDGET_S:-0}
[[ "$BUDGET" =~ ^[0-9]+$ ]] || { echo "SANITIZER_BUDGET_S must be whole seconds, not '$BUDGET'" >&2; exit 2; }
rm -f "$LOG_DIR"/pytest.shard*.log "$LOG_DIR/tests.txt" "$LOG_DIR/collect.log" "$LOG_DIR/notrun.txt"

echo "$("$CS" --version | tail -1); logs in $LOG_DIR"
start=$(date +%s)
if [[ "$SHARDS" -eq 1 && "$BUDGET" -eq 0 ]]; then
  echo "+ $CS --tool memcheck --target-processes all ... python -m pytest $*"
  memcheck "$@"
  rc=$?
else
  # The node IDs the arguments select (after -m / -k), collected without the tool.
  GPUMEM_NODE_IDS="$LOG_DIR/tests.txt" python - "$@" > "$LOG_DIR/collect.log" 2>&1 <<'EOF'
import os, sys
import pytest
ids = []
class Collect:
    def pytest_collection_finish(self, session):
        ids.extend(item.nodeid for item in session.items)
rc = pytest.main(["--collect-only", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[Collect()])
with open(os.environ["GPUMEM_NODE_IDS"], "w") as f:
    f.write("".join(i + "\n" for i in ids))
sys.exit(rc)
EOF
  crc=$?
  ids=()
  [[ -f "$LOG_DIR/tests.txt" ]] && mapfile -t ids < "$LOG_DIR/tests.txt"
  if [[ $crc -ne 0 || ${#ids[@]} -eq 0 ]]; then
    tail -20 "$LOG_DIR/collect.log"
    echo "collecting the tests failed (pytest exit $crc) or selected none: nothing ran under the tool" >&2
    exit 2
  fi
  limit=""
  if [[ "$BUDGET" -gt 0 ]]; then
    # Past the budget (counted from the start, collection included) timeout stops the group's whole
    # process group, the tool and every process under it (TERM, then KILL 5 s later), and exits 124.
    left=$(( BUDGET - ($(date +%s) - start) ))
    STOP=(timeout --kill-after=5 "$(( left > 1 ? left : 1 ))")
    limit=" (for at most $BUDGET s)"
  fi
  echo "+ ${#ids[@]} tests in $SHARDS groups at once: $CS --tool memcheck ... python -m pytest -m gpu ... NODE_IDS$limit"
  pids=()
  for ((k = 0; k < SHARDS && k < ${#ids[@]}; k++)); do
    group=()
    for ((i = k; i < ${#ids[@]}; i += SHARDS)); do group+=("${ids[i]}"); done
    # -v: a line per test with its outcome, which tells the tests a stopped group did not finish
    memcheck -m gpu -v -rfEs -p no:cacheprovider "${group[@]}" > "$LOG_DIR/pytest.shard$k.log" 2>&1 &
    pids+=($!)
  done
  rc=0
  for k in "${!pids[@]}"; do
    wait "${pids[k]}"
    r=$? how=""
    [[ $r -eq 124 && ${#STOP[@]} -gt 0 ]] && how=", stopped at the budget"
    echo "--- group $k (pytest exit $r$how): $LOG_DIR/pytest.shard$k.log"
    cat "$LOG_DIR/pytest.shard$k.log"
    [[ -n "$(tail -c 1 "$LOG_DIR/pytest.shard$k.log")" ]] && echo  # a stopped group's last line is cut
    [[ $r -ne 0 && $rc -eq 0 ]] && rc=$r
  done
  # The tests no group gave an outcome for (pytest -v: "NODE_ID PASSED"): those a stopped group did not finish.
  python - "$LOG_DIR" <<'EOF'
import glob, os, re, sys
log_dir = sys.argv[1]
ids = open(os.path.join(log_dir, "tests.txt")).read().split()
text = "".join(open(p, errors="replace").read() for p in glob.glob(os.path.join(log_dir, "pytest.shard*.log")))
done = set(re.findall(r"^(\S+) (?:PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", text, re.M))
left = [i for i in ids if i not in done]
if left:
    path = os.path.join(log_dir, "notrun.txt")
    with open(path, "w") as f:
        f.write("".join(i + "\n" for i in left))
    print(f"{len(left)} of {len(ids)} tests did not finish: {path} "
          f"(run them in a later call: bash tools/compute_sanitizer.sh -m gpu $(cat {path}))")
EOF
fi
elapsed=$(( $(date +%s) - start ))

python tools/sanitizer_summary.py "$LOG_DIR" "$rc" "$elapsed"
