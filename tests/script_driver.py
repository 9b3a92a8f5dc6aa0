"""Runs several `python scripts/<script> args...` one after another in this one interpreter, so that a batch of
command-line error cases pays for Python, jax and the project's imports once instead of once per case
(tests/cli.py run_scripts starts it; a case costs ~0.05 s here against ~2 s as its own process).

Each case runs as __main__ (runpy.run_path) with its own sys.argv and stdin; what it writes is captured at
the Python level (sys.stdout / sys.stderr) and at the file-descriptor level (fds 1 and 2, e.g. C++ logging);
its exit code is what the interpreter would return: SystemExit's code, or 1 and the traceback on stderr for
any other exception. Warnings are reset per case (a warning shown once per process shows in every case).

Input: a JSON list of {"path", "args", "stdin"} on stdin; output: a JSON list of {"returncode", "stdout",
"stderr"} written to the file named by argv[1] (this process's own stdout and stderr are the cases')."""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import tempfile
import traceback
import warnings


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)  # sys.exit("message"): the interpreter prints it and returns 1
    return 1


def run_case(path: str, args: list[str], stdin: str | None) -> dict:
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_stdin = sys.argv, sys.stdin
    with tempfile.TemporaryFile("w+b") as fd_out, tempfile.TemporaryFile("w+b") as fd_err:
        saved_fds = os.dup(1), os.dup(2)
        os.dup2(fd_out.fileno(), 1)
        os.dup2(fd_err.fileno(), 2)
        sys.argv, sys.stdin = [path, *args], io.StringIO(stdin or "")
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    runpy.run_path(path, run_name="__main__")
                    code = 0
                except SystemExit as e:
                    code = _exit_code(e)
                except BaseException:  # noqa: BLE001 - what an uncaught exception does to a real process
                    traceback.print_exc()
                    code = 1
        finally:
            sys.argv, sys.stdin = saved_argv, saved_stdin
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
        fd_out.seek(0)
        fd_err.seek(0)
        return {"returncode": code, "stdout": out.getvalue() + fd_out.read().decode(errors="replace"),
                "stderr": err.getvalue() + fd_err.read().decode(errors="replace")}


def main() -> None:
    result_path, cases = sys.argv[1], json.load(sys.stdin)
    results = [run_case(c["path"], c["args"], c.get("stdin")) for c in cases]
    with open(result_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
