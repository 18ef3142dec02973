#!/usr/bin/env bash
# Downloads, on a machine with PyPI, the wheels the GPU machine lacks into .whl/ (git-ignored), for a
# session to carry there: `gpu_session.sh build` installs them under /tmp/site (gpu_env.sh puts it on
# PYTHONPATH). The GPU machine (Python 3.12, no network) has torch, pytest, transformers, Lightning,
# CuPy, Numba and NumPy, but not:
#   - RAPIDS RMM (rmm-cu13, librmm-cu13, rapids-logger: their other dependencies are there already),
#     the peer of bench/pressure.py and tests/gpu/test_integrations_gpu.py's RMM test;
#   - the notebook runner (nbclient, nbformat, ipykernel, IPython) and matplotlib (the quickstart's
#     gpumem.plot()), for tests/gpu/test_notebooks_gpu.py, with their dependencies, less NumPy,
#     Pillow and the typing/packaging helpers that the machine's torch stack brings (installed with
#     --no-deps under /tmp/site, a second NumPy would shadow the one torch was built with).
# About 40 MB; the carry of a device call holds 64 MiB in all.
#
#   bash tools/fetch_gpu_wheels.sh            # then carry .whl with the call that runs `... build`
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
mkdir -p "$DEST"
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q "${TARGET[@]}" --no-deps -d "$DEST" rmm-cu13 librmm-cu13 rapids-logger
python3 -m pip download -q "${TARGET[@]}" -d "$DEST" nbclient nbformat ipykernel ipython matplotlib
# what the GPU machine's torch stack has already (see above)
rm -f "$DEST"/numpy-*.whl "$DEST"/pillow-*.whl "$DEST"/packaging-*.whl "$DEST"/typing_extensions-*.whl
ls "$DEST"
du -sh "$DEST"
