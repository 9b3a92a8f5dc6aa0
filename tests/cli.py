"""The one helper for command-line tests: run a script of scripts/ in a subprocess, and assert the
bad-input contract (exit code 2, exactly one non-empty line on stderr, no traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_script(script: str, *args: str, stdin: str | None = None, timeout: int = 600, **kw) -> subprocess.CompletedProcess:
    """`python scripts/<script> args...` from the repository root, output captured as text."""
    return subprocess.run([sys.executable, str(REPO / "scripts" / script), *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, **kw)


def assert_one_line_error(proc: subprocess.CompletedProcess, fragment: str) -> str:
    """Exit code 2, one line on stderr containing `fragment`, no traceback; returns the line."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert fragment in lines[0], proc.stderr
    return lines[0]
