#!/usr/bin/env bash
# GPU check of the fused kernel in three phases, each its own process, timeout and JSON file
# (lab/rsqr_lab/devtools/gpu_check.py): gate <= 90 s, correctness <= 120 s, timing <= 180 s.
#     bash scripts/gpu_check.sh                  # on the GPU machine; results in $OUT (default runs/gpu_check)
#     bash scripts/gpu_check.sh --cpu-dry-run    # tiny sizes, interpret=True, CPU (a test runs this)
# Files in $OUT: gate.json, correctness.json, timing.json (rewritten after every row), gpu_check.log,
# nvidia_smi.csv. The gate stops the run at once on a non-GPU backend (exit 3) or when no kernel variant
# passes (exit 1); a correctness failure still lets timing run, and makes the exit status 1.
# Needs the device image's jax (CUDA) and numpy only; wheels found in .whl/ are installed first.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DRY=()
if [ "${1:-}" = "--cpu-dry-run" ]; then DRY=(--cpu-dry-run); shift; fi
[ $# -eq 0 ] || { echo "gpu_check.sh: error: unknown arguments: $* (only --cpu-dry-run)" >&2; exit 2; }
export OUT="${OUT:-$PWD/runs/gpu_check}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null 2>&1 || PY=python
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:$PWD/lab${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1  # the checkout and its lab/
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.85}"
if [ ${#DRY[@]} -gt 0 ]; then export JAX_PLATFORMS=cpu; else export JAX_PLATFORMS=cuda; fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/nvidia_smi.csv" 2>&1 || true

phase() {  # phase NAME TIMEOUT_S
  local t0=$SECONDS rc
  timeout -k 5 "$2" "$PY" -m rsqr_lab.devtools.gpu_check --phase "$1" --out "$OUT" "${DRY[@]}" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "gpu_check: phase $1 exit status $rc ($((SECONDS - t0)) s of $2)" | tee -a "$LOG"
  return "$rc"
}

phase gate 90; rc=$?
if [ "$rc" -ne 0 ]; then echo "gpu_check: the gate failed (status $rc); nothing else runs" | tee -a "$LOG"; exit "$rc"; fi
phase correctness 120; rc_c=$?
[ "$rc_c" -eq 0 ] || echo "gpu_check: CORRECTNESS FAILED - the timings below are NOT trustworthy" | tee -a "$LOG"
phase timing 180; rc_t=$?
if [ "$rc_c" -ne 0 ] || [ "$rc_t" -ne 0 ]; then exit 1; fi
exit 0
