#!/usr/bin/env bash
# Verify kvtier's CUDA paths on a CUDA machine, offline, in about 3 minutes (issues 25, 37).
#
#   scripts/gpu_check.sh [WHEEL_DIR]        (run from anywhere; works in the checkout it belongs to)
#   SUITE=1 scripts/gpu_check.sh ...        (also the whole test suite, with pytest-xdist if present)
#
# Needs python with torch (CUDA build), numpy, pyyaml, pytest, hypothesis and Cython; anything
# else (kvikio-cu13, libkvikio-cu13, rapids-logger, cuda-pathfinder, redis, ... as cp312 wheels)
# comes from WHEEL_DIR (or $KVTIER_WHEELS), installed with
# `pip install --no-index --no-deps --target DIR` and put on PYTHONPATH. It:
#   1. builds the compiled extensions in place (the memcpy loop, the job planner, the indexes);
#   2. runs the `gpu` tests, then the handler tests followed by the fork test of issue 25 in the
#      same process (tests/reliability/test_regions.py); with SUITE=1 the whole suite;
#   3. measures engine<->CPU with scattered (and consecutive) slots, 64 KiB / 256 KiB / 2 MiB pages,
#      staged and fast paths, each direction and both at once, against one contiguous pinned copy
#      (scripts/bench_gpu_copy.py -> gpu_copy.json, with the copy mechanism each handler chose by
#      timing and every candidate's figures); the host work of planning a job, old planner beside
#      the compiled one (--plan-only -> plan.json); the copy mechanisms alone on the same layout
#      (scripts/bench_gpu_copy_ceiling.py -> ceiling.json);
#   4. runs the vLLM worker's store and load path over CUDA KV tensors, with a direct file load and
#      a corrupted block (scripts/gpu_check_worker.py -> worker.json; through kvtier's standalone
#      API where vLLM does not import, and says so);
#   5. runs `kvtier bench hops` (-> hops.json) and records the engine<->CPU mechanism chosen per
#      page size and which engine<->file path `io: auto` takes here (-> paths.log);
#   6. prints ONE screen (scripts/gpu_check_summary.py -> screen.txt): each target of issue 37,
#      its figure and PASS/FAIL, each step's outcome.
# Everything goes under ${OUT:-./gpu-check-out} (relative to the checkout): one log per step,
# summary.txt (the steps), screen.txt (the one screen).
#
# Exit status: 0 every step passed and every target was met; 1 otherwise (the screen names it);
# 3 no CUDA on this machine: nothing is run, and the script says "no CUDA" (on a CPU-only machine
# that is the expected outcome, not a pass).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-check-out}
PY=${PYTHON:-python3}
WHEELS=${1:-${KVTIER_WHEELS:-}}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

if [ -n "$WHEELS" ]; then
  TARGET=${TMPDIR:-/tmp}/kvtier-gpu-wheels
  if ! "$PY" -m pip install -q --no-index --no-deps --target "$TARGET" "$WHEELS"/*.whl > "$OUT/wheels.log" 2>&1; then
    say "FAILED: installing the wheels of $WHEELS (see $OUT/wheels.log)"; exit 1
  fi
  export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' > "$OUT/cuda.log" 2>&1; then
  say "no CUDA: torch is missing or sees no GPU on this machine; nothing was run (see $OUT/cuda.log)"
  exit 3
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))' \
  | tee -a "$SUMMARY"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max \
  --format=csv,noheader >> "$SUMMARY" 2>&1

status=0
: > "$OUT/steps.txt"
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then
    say "ok      $name ($((SECONDS - start)) s)"; echo "$name ok $((SECONDS - start))" >> "$OUT/steps.txt"
  else
    local rc=$?
    say "FAILED  $name (exit $rc, $((SECONDS - start)) s; see $OUT/$name.log)"; status=1
    echo "$name FAILED $((SECONDS - start))" >> "$OUT/steps.txt"
  fi
}

step build 120 "$PY" setup.py build_ext --inplace -q
step gpu-tests 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/handlers tests/tiers
step handler-and-fork-tests 150 "$PY" -m pytest -q -p no:cacheprovider tests/handlers \
  tests/reliability/test_regions.py
if [ "${SUITE:-0}" = 1 ]; then
  XDIST=$("$PY" -c 'import xdist' > /dev/null 2>&1 && echo "-n 8")
  # shellcheck disable=SC2086
  step whole-suite 900 "$PY" -m pytest -q -x -p no:cacheprovider $XDIST tests
fi
step gpu-copy-bench 240 "$PY" scripts/bench_gpu_copy.py --json "$OUT/gpu_copy.json"
step plan-bench 90 "$PY" scripts/bench_gpu_copy.py --plan-only --pages 64KiB --slots scattered \
  --json "$OUT/plan.json"
step gpu-copy-ceiling 120 "$PY" scripts/bench_gpu_copy_ceiling.py --json "$OUT/ceiling.json"
step worker 120 "$PY" scripts/gpu_check_worker.py --device cuda --json "$OUT/worker.json"
step bench-hops 90 "$PY" -m kvtier.cli.main bench hops --no-progress --block-sizes 64KiB,256KiB,2MiB \
  --json "$OUT/hops.json"
step paths 60 "$PY" - <<'EOF'
from kvtier.transfer.handlers import fast_path
from kvtier.transfer.handlers.file_path import file_path

print(fast_path.engine_cpu_note({}))
print("engine<->file, io: auto:", *file_path("auto", cuda=True))
EOF
cat "$OUT/paths.log" >> "$SUMMARY"
say "results in $OUT (gpu_copy.json, plan.json, worker.json, hops.json, one log per step)"
echo
"$PY" scripts/gpu_check_summary.py "$OUT" | tee "$OUT/screen.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
