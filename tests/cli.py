"""The helpers for command-line tests: run a script of scripts/ in a subprocess (or a batch of runs in one
subprocess), and assert the bad-input contract (exit code 2, one error line on stderr, no traceback,
nothing on stdout)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Subprocesses import this checkout's packages, rsqr_jax and lab/'s rsqr_lab (an editable install may point at
# another checkout).
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(REPO / "lab"),
                                                                 os.environ.get("PYTHONPATH")]))}


def xla_env() -> dict:
    """This process's XLA settings (tests/conftest.py: the optimizations, the code generator) for a child process:
    a script run for a tiny-model test compiles as the test does, one run for a real-model test as users do (XLA's
    defaults)."""
    import jax

    fast = jax.config.read("jax_disable_most_optimizations")
    flags = os.environ.get("XLA_FLAGS", "")
    if not fast:
        flags = " ".join(f for f in flags.split() if f != os.environ.get("RSQR_TEST_XLA_FLAG", ""))
    return {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1" if fast else "0", "XLA_FLAGS": flags}


def script_env() -> dict:
    """The environment of a script's process: this checkout's packages and this test's XLA setting."""
    return {**ENV, **xla_env()}


def run_script(script: str, *args: str, stdin: str | None = None, timeout: int = 600, **kw) -> subprocess.CompletedProcess:
    """`python scripts/<script> args...` from the repository root, output captured as text."""
    kw.setdefault("env", script_env())
    return subprocess.run([sys.executable, str(REPO / "scripts" / script), *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, **kw)


def run_scripts(cases, timeout: int = 600) -> list[subprocess.CompletedProcess]:
    """[(script, args) or (script, args, stdin), ...] run one after another in ONE subprocess
    (tests/script_driver.py): each case as its script's __main__ with its own argv, stdin and captured
    output, so N error cases pay for one interpreter and one jax import instead of N. Same results as N
    run_script calls for cases that fail before doing real work (checked when this was written); keep one
    run_script case per script so the real process (interpreter exit code, a fresh import) stays tested."""
    cases = [(c[0], list(c[1]), c[2] if len(c) > 2 else None) for c in cases]
    payload = json.dumps([{"path": str(REPO / "scripts" / s), "args": a, "stdin": i} for s, a, i in cases])
    env = script_env()
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "results.json"
        proc = subprocess.run([sys.executable, "-m", "tests.script_driver", str(result_file)], input=payload,
                              capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
        assert proc.returncode == 0 and result_file.is_file(), f"script driver failed:\n{proc.stderr[-3000:]}"
        results = json.loads(result_file.read_text())
    return [subprocess.CompletedProcess([sys.executable, str(REPO / "scripts" / s), *a], r["returncode"], r["stdout"],
                                        r["stderr"]) for (s, a, _), r in zip(cases, results)]


def run_in_process(script: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`python scripts/<script> args...` as __main__ in THIS process (tests/script_driver.py run_case: own argv,
    stdin, captured output, the exit code a process would return): no interpreter, jax import or model load
    of its own (rsqr_jax.models.llama.load_model keeps what it loaded), and the compilations of earlier runs stay in
    this process's caches. For runs whose real-process behaviour (signals, a fresh import) is tested elsewhere."""
    from tests.script_driver import run_case

    r = run_case(str(REPO / "scripts" / script), list(args), stdin)
    return subprocess.CompletedProcess([sys.executable, str(REPO / "scripts" / script), *args], r["returncode"],
                                       r["stdout"], r["stderr"])


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


def assert_one_line_errors(cases, **kw) -> None:
    """run_scripts(cases) with cases (script, args, fragment[, stdin]): every one must be a one-line error
    containing its fragment; reports every failing case, not only the first."""
    procs = run_scripts([(s, a) + tuple(rest[1:]) for s, a, *rest in cases])
    failures = []
    for (script, args, fragment, *_), proc in zip(cases, procs):
        try:
            assert_one_line_error(proc, fragment, **kw)
        except AssertionError as e:
            failures.append(f"{script} {' '.join(map(str, args))}: {e}")
    assert not failures, "\n\n".join(failures)
