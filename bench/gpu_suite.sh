#!/usr/bin/env bash
# On the GPU machine: build gpumem against the installed torch, then run the GPU test suite.
#   bash bench/gpu_suite.sh [pytest args...]      (default: every GPU test)
# Logs go to $OUT (when set) so they come back with the run.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpumem-out}
mkdir -p "$OUT"
# Notebook tests need IPython/ipykernel/nbclient; carried as wheels in .whl where the machine lacks them.
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install --no-build-isolation -q . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
grep -h "gpumem:" build/*/CMakeFiles/CMakeOutput.log 2>/dev/null | head -3
python3 -c "import gpumem; print(gpumem.status_line())"
python3 -m pytest -m gpu -p no:cacheprovider -rfEs "${@:-tests/gpu}" 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|error" 
