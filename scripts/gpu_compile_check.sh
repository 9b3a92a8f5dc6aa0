#!/usr/bin/env bash
# H200 compile check of the fused kernel on a machine without a GPU (docs/kernel.md, "GPU / H200"):
#     bash scripts/gpu_compile_check.sh [--root DIR] [compile_report flags: --only a,b  --json  --list]
# Checks the kernel of DIR (default: the current directory if it holds rsqr_jax/kernels/, else this repo),
# so another checkout checks its own kernel with `cd WT && bash /path/to/scripts/gpu_compile_check.sh`.
#  1. builds (once; a stamp file names the pins) a Python 3.12 venv with the device's jax/jaxlib 0.11.2
#     and pip Triton 3.6.0 (its ptxas compiles for sm_90a; no CUDA plugin, no torch, no project install:
#     the checked root and its lab/ go on PYTHONPATH) at $RSQR_H200_VENV (default: .venv-h200 in this repo);
#  2. runs lab/rsqr_lab/devtools/compile_report.py: registers / spills / shared memory per configuration,
#     a table + $OUT_DIR/compile_report.json (default DIR/runs/gpu_compile); exit 1 on spills in DEFAULT;
#  3. runs the export test of tests/test_survivor_attention.py under that jax (it runs under the CPU
#     venv's jax in the test suite), unless RSQR_H200_EXPORT_TEST=0.
# Exit status: 0 all passed, 1 a check failed, 2 bad input or the venv could not be built.
set -uo pipefail
TOOL="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT=""
if [ "${1:-}" = "--root" ]; then
  [ $# -ge 2 ] || { echo "gpu_compile_check: error: --root needs a directory" >&2; exit 2; }
  ROOT="$2"; shift 2
elif [ -f "$PWD/rsqr_jax/kernels/survivor_attention.py" ]; then
  ROOT="$PWD"
else
  ROOT="$TOOL"
fi
[ -f "$ROOT/rsqr_jax/kernels/survivor_attention.py" ] || {
  echo "gpu_compile_check: error: $ROOT has no rsqr_jax/kernels/survivor_attention.py" >&2; exit 2; }
ROOT="$(cd "$ROOT" && pwd)"
VENV="${RSQR_H200_VENV:-$TOOL/.venv-h200}"
PINS="jax==0.11.2 jaxlib==0.11.2 triton==3.6.0 numpy pytest"  # the device image's jax and Triton

find_python312() {
  local c
  for c in "${RSQR_PY312:-}" "$(command -v pyenv >/dev/null 2>&1 && echo "$(pyenv root)")"/versions/3.12*/bin/python3.12 \
           "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 python3.12; do
    [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo "$c"; return 0; }
  done
  return 1
}

stamp="$VENV/.rsqr-h200-$(echo "$PINS" | cksum | cut -d' ' -f1)"
if [ ! -f "$stamp" ]; then
  t0=$SECONDS
  PY312="$(find_python312)" || { echo "gpu_compile_check: error: no Python 3.12 found (set RSQR_PY312)" >&2; exit 2; }
  echo "gpu_compile_check: building $VENV with $PY312 ($PINS)" >&2
  rm -rf "$VENV"
  if ! { "$PY312" -m venv "$VENV" && "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile $PINS; }; then
    echo "gpu_compile_check: error: could not build $VENV" >&2; exit 2
  fi
  touch "$stamp"
  echo "gpu_compile_check: venv built in $((SECONDS - t0)) s" >&2
fi

OUT_DIR="${OUT_DIR:-$ROOT/runs/gpu_compile}"
cd "$ROOT"
LAB="$ROOT/lab"  # rsqr_lab: the report and the kernel test's inputs (this repo's lab/ if ROOT has none)
[ -d "$LAB/rsqr_lab" ] || LAB="$TOOL/lab"
export PYTHONPATH="$ROOT:$LAB" JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1
t0=$SECONDS
# ROOT on PYTHONPATH: the report and the kernel it compiles are ROOT's
timeout -k 10 900 "$VENV/bin/python" -m rsqr_lab.devtools.compile_report --out "$OUT_DIR" "$@"
rc_report=$?
echo "gpu_compile_check: report exit status $rc_report ($((SECONDS - t0)) s, $OUT_DIR/compile_report.json)" >&2
case " $* " in *" --list "*) exit "$rc_report" ;; esac
[ "$rc_report" -eq 2 ] && exit 2

rc_export=0
if [ "${RSQR_H200_EXPORT_TEST:-1}" != 0 ] && [ -f tests/test_survivor_attention.py ]; then
  t0=$SECONDS
  timeout -k 10 300 "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_survivor_attention.py \
    -k lowers_to_pallas_triton >&2
  rc_export=$?
  echo "gpu_compile_check: export test under jax 0.11.2: exit status $rc_export ($((SECONDS - t0)) s)" >&2
fi
[ "$rc_report" -eq 0 ] && [ "$rc_export" -eq 0 ] && exit 0
exit 1
