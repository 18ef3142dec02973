# The environment the GPU machine's tool scripts share (sourced, not run; bash): the repository root as
# the working directory, unbuffered Python, $OUT (default /tmp/gpumem-out) created for the logs, and
# the carried wheels that `gpu_session.sh build` installed under /tmp/site (RAPIDS RMM) on the path.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpumem-out}
mkdir -p "$OUT"
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}; fi
