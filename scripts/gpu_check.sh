#!/usr/bin/env bash
# GPU check of the survivor-attention kernel (correctness, then timing). Run from the repo root:
#     bash scripts/gpu_check.sh            # results in $OUT (default runs/gpu_check)
# Needs only a preinstalled jax with CUDA (no network, no pip install); < 8 minutes on an H200.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OUT="${OUT:-$PWD/runs/gpu_check}"
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.85}"
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null 2>&1 || PY=python
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/nvidia_smi.csv" 2>&1 || true
# the python part keeps its own budget (--budget, seconds before optional parts are skipped);
# the hard limit here leaves time to collect $OUT.
timeout -k 10 460 "$PY" scripts/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
echo "gpu_check exit status: $rc"
exit "$rc"
