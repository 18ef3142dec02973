#!/usr/bin/env bash
# GPU check of the tight case's placement (large arenas map single 2 MiB pages within 1% of the cap,
# blocks placed where they need the fewest unmapped pages): the GPU tests of the paths that map,
# unmap and export pages, and the lowest 0-OOM cap per workload at a 0.25% resolution. Each call is
# under 8 minutes on an H100. Builds nothing (the lead builds: `bash tools/gpu_session.sh build`).
# Logs to $OUT.
#   bash tools/issue16_gpu.sh tests       # CUDA upstreams, the bridge, drop-in (IPC export of pages)
#   bash tools/issue16_gpu.sh pressure1   # varlen, resnet, moe: native (P), gpumem, gpumem_hw
#   bash tools/issue16_gpu.sh pressure2   # bert, ckpt, vit: the same
# Before/after: run the same pressure command at the commit before this branch (its figures are the
# "before"); the replay's CPU figures of both are in docs/benchmarks.md.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"  # repository root, $OUT, the carried RMM wheels on the path
pressure() {
  timeout 470 python3 bench/pressure.py --quick --tolerance 0.0025 --workloads "$1" \
    --allocators native,gpumem,gpumem_hw --budget-s 380 --json "$OUT/issue16_$2.json" > "$OUT/issue16_$2.log" 2>&1
  echo "rc=$?"; tail -25 "$OUT/issue16_$2.log"
}
case "${1:-}" in
  tests) timeout 470 python3 -m pytest -m gpu -p no:cacheprovider -rfEs -q tests/gpu/test_cuda_upstreams_gpu.py \
           tests/gpu/test_torch_bridge_gpu.py tests/gpu/test_dropin_gpu.py > "$OUT/issue16_tests.log" 2>&1
         echo "rc=$?"; tail -8 "$OUT/issue16_tests.log" ;;
  pressure1) pressure varlen,resnet,moe pressure1 ;;
  pressure2) pressure bert,ckpt,vit pressure2 ;;
  *) echo "usage: $0 tests|pressure1|pressure2" >&2; exit 2 ;;
esac
