#!/usr/bin/env bash
# Distributed checks on the GPU machine (docs/distributed.md), in calls of a few minutes each. Builds
# nothing: build first (bash tools/gpu_session.sh build). Logs go to $OUT (default /tmp/gpumem-out).
# Every torchrun uses all the machine's GPUs; multigpu tests skip, saying so, with fewer than 2.
#
#   bash tools/gpu_distributed.sh tests-a        # FSDP2 vs native, NCCL register hook on/off (~3 min, 1 GPU)
#   bash tools/gpu_distributed.sh tests-b        # find_batch_size, one rank out of memory (~3 min, 1 GPU)
#   bash tools/gpu_distributed.sh bench [STEPS]  # fsdp_bench: native, expandable, gpumem; compare (~3 min)
#   bash tools/gpu_distributed.sh soak [MINUTES] # fsdp_bench with gpumem for MINUTES (default 5)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"  # working directory, $OUT, /tmp/site
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
T=tests/gpu/test_distributed_gpu.py
suite() {
  python3 -m pytest -m gpu -p no:cacheprovider -rfEs -q -s "$T" -k "$1" > "$OUT/$2.log" 2>&1
  rc=$?
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/$2.log" | tail -15
  return $rc
}
case "${1:-}" in
  tests-a) suite "fsdp2_training or nccl" dist_tests_a ;;
  tests-b) suite "batch_size or oom" dist_tests_b ;;
  bench)
    steps=${2:-120}
    for a in native expandable gpumem; do
      torchrun --standalone --nproc_per_node "$N" bench/fsdp_bench.py --allocator $a --steps "$steps" \
        --out "$OUT/fsdp_$a.json" > "$OUT/fsdp_$a.log" 2>&1 || { tail -20 "$OUT/fsdp_$a.log"; exit 1; }
    done
    python3 bench/fsdp_bench.py --compare "$OUT/fsdp_native.json" "$OUT/fsdp_gpumem.json" \
      "$OUT/fsdp_expandable.json" | tee "$OUT/fsdp_compare.txt"
    ;;
  soak)
    minutes=${2:-5}
    torchrun --standalone --nproc_per_node "$N" bench/fsdp_bench.py --allocator gpumem --minutes "$minutes" \
      --out "$OUT/fsdp_soak.json" > "$OUT/fsdp_soak.log" 2>&1 || { tail -20 "$OUT/fsdp_soak.log"; exit 1; }
    python3 - "$OUT/fsdp_soak.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
keys = ("allocator", "world_size", "steps", "seconds", "median_step_ms", "max_reserved", "max_allocated",
        "reserved_after_warmup", "reserved_at_end", "reserved_growth_after_warmup", "flat")
print({k: s[k] for k in keys})
PY
    ;;
  *) sed -n 2,10p "$0"; exit 2 ;;
esac
