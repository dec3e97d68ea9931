#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the main job: `kvtier bench` on the embedded default config.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/kvtier bench "$@"
