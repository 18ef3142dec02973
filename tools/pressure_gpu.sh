#!/usr/bin/env bash
# The pressure benchmark (bench/pressure.py), the growth-cost diagnosis (bench/growth_cost.py) and the
# GPU tests touching page release, in calls of under 8 minutes on an H100. Builds nothing (run
# `bash tools/gpu_session.sh build` first). Logs to $OUT.
#   bash tools/pressure_gpu.sh tests       # GPU tests of the CUDA upstreams and the bridge (release paths, ipc key)
#   bash tools/pressure_gpu.sh 1|2|3       # the benchmark, one third of the workloads per call
#   RESUME=F bash tools/pressure_gpu.sh 1  # ... going on with the searches of an earlier call's JSON F
#                                          # (pressure_1.json, brought back from $OUT and carried)
#   bash tools/pressure_gpu.sh growth      # what growing the pool costs per allocator (~2 min)
#   bash tools/pressure_gpu.sh lockstep W  # step times in lockstep (bench/lockstep.py), uncapped and at
#                                          # 1.05x, workloads W (comma-separated); ROUNDS (12) and BUDGET
#                                          # (60 s a group) as in the environment. One H100 call holds
#                                          # allocfree,bert,ckpt or resnet,vit,moe,varlen; generate
#                                          # alone, with FIRST=together (its first pass takes ~50 s a
#                                          # worker: round 0's passes at once)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"  # repository root, $OUT, the carried RMM wheels on the path
case "${1:-}" in
  tests) timeout 470 python3 -m pytest -m gpu -p no:cacheprovider -rfEs -q \
           tests/gpu/test_cuda_upstreams_gpu.py tests/gpu/test_torch_bridge_gpu.py > "$OUT/release_tests.log" 2>&1
         echo "rc=$?"; tail -5 "$OUT/release_tests.log" ;;
  growth) timeout 300 python3 bench/growth_cost.py --json "$OUT/growth_cost.json" > "$OUT/growth_cost.log" 2>&1
          echo "rc=$?"; cat "$OUT/growth_cost.log" ;;
  1) W=moe,bert,generate ;;&
  2) W=ckpt,varlen,vit ;;&
  3) W=resnet,allocfree ;;&
  1|2|3) timeout 480 python3 bench/pressure.py --workloads "$W" --budget-s 400 --json "$OUT/pressure_$1.json" \
           ${RESUME:+--resume "$RESUME"} \
           > "$OUT/pressure_$1.log" 2>&1; echo "rc=$?"; tail -25 "$OUT/pressure_$1.log" ;;
  lockstep) timeout 520 python3 bench/lockstep.py --workloads "${2:-bert}" --cap 1.05 --rounds "${ROUNDS:-12}" \
              --budget-s "${BUDGET:-60}" --first-pass "${FIRST:-turns}" --json "$OUT/lockstep.json" > "$OUT/lockstep.log" 2> "$OUT/lockstep.progress"
            echo "rc=$?"; cat "$OUT/lockstep.log" ;;
  *) echo "usage: $0 tests|growth|1|2|3|lockstep W" >&2; exit 2 ;;
esac
