#!/usr/bin/env bash
# Compiles the torch bridge (csrc/torch_bridge/*.cpp) against a CUDA build of torch's headers on a
# machine without a GPU, without linking or running anything: a bridge change that does not compile
# is caught before a GPU session spends device time on it. Nothing here proves the bridge works; the
# GPU suite does (tools/gpu_session.sh).
#
#   bash tools/check_bridge.sh [FILES...]        # default: every bridge source
#
# Env: TORCH_VERSION (default 2.11.0, the GPU machine's), HEADERS (default ~/.cache/gpumem-torch-headers):
# the CUDA wheel of that torch is downloaded from PyPI once (~530 MB) and only its include/ kept.
# Needs g++, pip, the CUDA toolkit's headers (nvcc's include/) and Python's development headers.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${TORCH_VERSION:-2.11.0}
HEADERS=${HEADERS:-$HOME/.cache/gpumem-torch-headers}/$TORCH_VERSION
PYTHON=${PYTHON:-python3}

if [ ! -f "$HEADERS/torch/include/c10/cuda/impl/cuda_cmake_macros.h" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  py=$("$PYTHON" -c "import sys; print(f'{sys.version_info[0]}{sys.version_info[1]}')")
  echo "downloading torch==$TORCH_VERSION (CUDA build, cp$py) for its headers ..." >&2
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
    --python-version "$py" "torch==$TORCH_VERSION" -d "$tmp" >&2
  mkdir -p "$HEADERS"
  "$PYTHON" - "$tmp" "$HEADERS" <<'EOF'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/torch-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    z.extractall(sys.argv[2], members=[n for n in z.namelist() if n.startswith("torch/include/")])
EOF
fi
[ -f "$HEADERS/torch/include/c10/cuda/impl/cuda_cmake_macros.h" ] || {
  echo "check_bridge: torch $TORCH_VERSION's headers have no c10/cuda: not a CUDA build" >&2; exit 2; }

nvcc=$(command -v nvcc || true)
CUDA_INCLUDE=${CUDA_INCLUDE:-$( [ -n "$nvcc" ] && readlink -f "$(dirname "$(readlink -f "$nvcc")")/../include" )}
[ -f "$CUDA_INCLUDE/cuda_runtime_api.h" ] || CUDA_INCLUDE=$(dirname "$(find /usr/local -name cuda_runtime_api.h 2>/dev/null | head -1)")
[ -f "$CUDA_INCLUDE/cuda_runtime_api.h" ] || { echo "check_bridge: no CUDA headers found (set CUDA_INCLUDE)" >&2; exit 2; }
PY_INCLUDE=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")

T=$HEADERS/torch/include
failed=0
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(csrc/torch_bridge/*.cpp)
for f in "${files[@]}"; do
  # The flags of cmake/TorchBridge.cmake (C++17 for torch <= 2.11, torch's own pybind11 first).
  if ! out=$(g++ -std=c++17 -fsyntax-only -D_GLIBCXX_USE_CXX11_ABI=1 -DUSE_CUDA=1 -DGPUMEM_WITH_CUDA=1 \
               -I csrc -I "$T" -I "$T/torch/csrc/api/include" -I "$CUDA_INCLUDE" -I "$PY_INCLUDE" "$f" 2>&1); then
    echo "== $f"; echo "$out" | grep -E "error" | head -10; failed=1
  fi
done
if [ $failed = 0 ]; then echo "check_bridge: ${#files[@]} bridge sources compile against torch $TORCH_VERSION"; fi
exit $failed
