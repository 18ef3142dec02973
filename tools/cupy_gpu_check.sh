#!/usr/bin/env bash
# gpumem.cupy's two paths on the GPU machine, in one call of about 2-3 minutes: the integration GPU
# tests (which path is active, CuPy's current stream used, the OOM raising CuPy's OutOfMemoryError
# on both paths, DLPack lifetime, Numba/RMM beside) and the cost per CuPy allocation through the C
# path, the Python path and CuPy's own pool (bench/mixed_pipeline.py --ops-only). Builds nothing
# (run `bash tools/gpu_session.sh build` first). Logs to $OUT.
#   bash tools/cupy_gpu_check.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"  # working directory, $OUT, /tmp/site
python3 -c "import cupy, gpumem.cupy as g; print('cupy', cupy.__version__, 'path:', g.path(), \
  repr(g.c_path_problem()))" > "$OUT/cupy_path.log" 2>&1
cat "$OUT/cupy_path.log"
timeout 240 python3 -m pytest -m gpu -p no:cacheprovider -rfEs -q tests/gpu/test_integrations_gpu.py \
  > "$OUT/cupy_integration_tests.log" 2>&1
echo "tests rc=$?"; tail -8 "$OUT/cupy_integration_tests.log"
timeout 120 python3 bench/mixed_pipeline.py --ops-only --iterations 20000 > "$OUT/cupy_cost.log" 2>&1
echo "bench rc=$?"; grep -v '^{' "$OUT/cupy_cost.log" | tail -12
