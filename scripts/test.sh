#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh), then runs ruff, mypy and the whole test suite; with no
# arguments also the vLLM adapter's and connector's unit tests against vLLM 0.33's classes (.venv-vllm033,
# scripts/setup_vllm033.sh: 0.33 has no CPU build, so no engine runs there).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# lint and types first: both configured in pyproject.toml, both pinned in the test extra
.venv/bin/ruff check .
.venv/bin/mypy
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest -q "$@"
fi
.venv/bin/python -m pytest -q
scripts/setup_vllm033.sh
exec .venv-vllm033/bin/python -m pytest -q -p no:cacheprovider tests/integration/test_vllm_spec.py \
    tests/integration/test_vllm033.py tests/integration/test_vllm_expedited.py tests/integration/test_vllm_connector.py \
    tests/integration/test_vllm_direct_file_loads.py tests/integration/test_vllm_tp_file_loads.py \
    tests/integration/test_vllm_host.py
