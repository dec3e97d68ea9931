#!/usr/bin/env bash
# Creates .venv-vllm033: kvtier's tests against vLLM 0.33's offloading classes (no engine).
# vLLM 0.33 has no CPU build and pins a torch that is not on this machine, but its offloading
# modules import over the CPU torch 2.13: the wheel goes in without its dependencies, then only
# the packages those modules import (none of them CUDA's). Idempotent: a second run only checks.
# Engines cannot run there; tests/integration/test_vllm_spec.py and test_vllm033.py can.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VLLM033_VENV:-.venv-vllm033}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps --no-warn-conflicts vllm==0.33.0
# What `vllm.v1.kv_offload` and the offloading connector import (found by trial; see docs/vllm.md).
"${PIP[@]}" --no-warn-conflicts packaging msgspec psutil pyzmq urllib3 regex transformers cbor2 aiohttp requests \
    openai-harmony openai pillow pybase64 cachetools cloudpickle uvloop py-cpuinfo prometheus_client fastapi \
    partial_json_parser llguidance apache-tvm-ffi pydantic
# xgrammar without its triton (1 GB, never imported here)
"${PIP[@]}" --no-deps --no-warn-conflicts xgrammar
"${PIP[@]}" --no-warn-conflicts -e '.[test]'
"$VENV/bin/python" -c 'import vllm, kvtier.integrations.vllm; print("vllm", vllm.__version__, "ok")'
"$VENV/bin/python" -c 'import vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics, vllm.logger'
