"""The one helper for command-line tests: run a script of scripts/ in a subprocess, and assert the
bad-input contract (exit code 2, one error line on stderr, no traceback, nothing on stdout)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Subprocesses import this checkout's packages (an editable install may point at another one).
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def run_script(script: str, *args: str, stdin: str | None = None, timeout: int = 600, **kw) -> subprocess.CompletedProcess:
    """`python scripts/<script> args...` from the repository root, output captured as text."""
    kw.setdefault("env", ENV)
    return subprocess.run([sys.executable, str(REPO / "scripts" / script), *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, **kw)


def assert_one_line_error(proc: subprocess.CompletedProcess, fragment: str, *, after_status: bool = False,
                          prog: str | None = None) -> str:
    """Exit code 2, no traceback, nothing on stdout, and the error as the only stderr line (after_status:
    the last one, status lines may precede it; prog: it starts with "<prog>: error:"). Returns the line."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines and (after_status or len(lines) == 1), proc.stderr
    if prog is not None:
        assert [ln for ln in lines if ln.startswith(f"{prog}: error:")] == [lines[-1]], proc.stderr
    assert fragment in lines[-1], lines[-1]
    assert proc.stdout == "", proc.stdout
    return lines[-1]
