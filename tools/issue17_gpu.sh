#!/usr/bin/env bash
# Issue 17's GPU proofs, on the GPU machine after gpumem is built (bash tools/gpu_session.sh build);
# builds nothing. Logs go to $OUT (default /tmp/gpumem-out); one summary line per step.
#
#   bash tools/issue17_gpu.sh            # all steps (limits 200 + 60 + 300 s: fits one 10-min call)
#   bash tools/issue17_gpu.sh run        # `gpumem run` on the GPU: tests/gpu/test_run_gpu.py, then the
#                                        # torchrun tests of tests/test_run_cli.py (gloo) (~2 min)
#   bash tools/issue17_gpu.sh sanitizer  # compute-sanitizer memcheck over tests/gpu/test_integrations_gpu.py
#                                        # (SHARDS groups at once, default 3; limit 300 s)
#
# Each step runs under `timeout -s KILL`, which kills the step's whole process group (pytest, its
# children, the tool and its targets). The `gpumem run` tests start their children in sessions of
# their own (so that a test can kill a hung torchrun whole); a KILL of the step does not reach a child
# running at that moment, which is then left to end by itself.
# Exit status: 0 when every step passed.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"  # working directory, $OUT, /tmp/site
failed=0

step() {  # step NAME LIMIT_S LOG CMD...: runs CMD under timeout -s KILL, output in LOG; one summary line
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS
  timeout -s KILL "$limit" "$@" > "$log" 2>&1
  local rc=$? verdict=PASS
  [ $rc -ne 0 ] && { verdict=FAIL; failed=1; }
  [ $rc -eq 137 ] && verdict="FAIL (killed at the ${limit} s limit)"
  # pytest's failures and skips with their reasons, the sanitizer's findings
  grep -E "^(FAILED|ERROR|SKIPPED)|^  \[(api|memory|other|untracked|incomplete)\]|^--- group" "$log" | cut -c1-300 | tail -25
  local last
  last=$(grep -E "(passed|failed|skipped|error|no tests ran).* in [0-9.]+s|^compute-sanitizer memcheck:" "$log" | tail -6 | tr '\n' ' ')
  echo "STEP $name: $verdict (exit $rc, $((SECONDS - t0)) s) ${last:-(no pytest summary: see $log)}"
}

run_steps() {
  python3 -c "import gpumem, torch; print(gpumem.status_line(), '| torch', torch.__version__)" 2>&1 | tail -1
  command -v gpumem >/dev/null && echo "console script: $(command -v gpumem)" || echo "console script: none on PATH"
  step run-gpu 200 "$OUT/run_gpu.log" \
    python3 -m pytest -m gpu -p no:cacheprovider -rfEs -q tests/gpu/test_run_gpu.py
  step run-cli-torchrun 60 "$OUT/run_cli_torchrun.log" \
    python3 -m pytest -p no:cacheprovider -rfEs -q tests/test_run_cli.py -k torchrun
}

sanitizer_step() {
  # The integration tests each start their own Python; under the tool that start dominates, so three
  # groups run at once (tools/compute_sanitizer.sh SHARDS).
  SHARDS=${SHARDS:-3} LOG_DIR="$OUT/cs_integrations" step sanitizer-integrations 300 "$OUT/cs_integrations.log" \
    bash tools/compute_sanitizer.sh -m gpu tests/gpu/test_integrations_gpu.py
}

case "${1:-all}" in
  all) run_steps; sanitizer_step ;;
  run) run_steps ;;
  sanitizer) sanitizer_step ;;
  *) sed -n 2,14p "$0"; exit 2 ;;
esac
exit $failed
