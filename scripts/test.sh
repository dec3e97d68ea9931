#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh), then runs ruff, mypy and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# lint and types first: both configured in pyproject.toml, both pinned in the test extra
.venv/bin/ruff check .
.venv/bin/mypy
exec .venv/bin/python -m pytest -q "$@"
