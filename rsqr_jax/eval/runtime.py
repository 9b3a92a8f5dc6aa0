"""What every long run shares, written once: bad-config errors, status lines and progress bars, memory checks,
token reading, timing, atomic JSON writes and turning SIGTERM into an orderly interruption (the statistics
are `rsqr_jax.eval.stats`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from rsqr_jax import data


class ConfigError(ValueError):
    """An experiment configuration that cannot run (reported by the scripts as one line, exit code 2)."""


def status(msg: str) -> None:
    """A status line on stderr (stdout is kept for results and --json)."""
    print(msg, file=sys.stderr, flush=True)


def progress(total: int, desc: str, *, enabled: bool = True, unit: str = "tok"):
    """The one progress mechanism (tqdm on stderr); a disabled bar costs nothing and prints nothing."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, file=sys.stderr, leave=False,
                dynamic_ncols=True)


def check_stream_shape(tokens: int, chunk: int, segment: int, bucket: int) -> None:
    """The streaming flags every perplexity experiment shares, checked once (ConfigError, one line)."""
    if tokens < 2:
        raise ConfigError(f"--tokens must be >= 2, got {tokens}")
    if chunk < 1 or segment < 1 or segment % chunk:
        raise ConfigError("--chunk must be >= 1 and divide --segment")
    if bucket < 1:
        raise ConfigError(f"--bucket must be >= 1, got {bucket}")


def available_memory_bytes() -> int | None:
    """Memory a cache can use: the accelerator's limit, or the host's available memory (None if unknown)."""
    try:
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    except Exception:  # noqa: BLE001 - no stats on this backend
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(cache_bytes: int) -> None:
    """ConfigError (one line) for a cache (cold store included) that cannot fit in memory, before allocating it."""
    avail = available_memory_bytes()
    if avail is not None and cache_bytes > avail:
        raise ConfigError(f"the cache needs {cache_bytes / 2**30:.1f} GiB but only {avail / 2**30:.1f} GiB of memory "
                          f"is available: use a smaller --window / --max-survivors / --cold-capacity (or --tokens "
                          f"for full)")


# ----------------------------------------------------------------------------------------------------
# Token reading.


def read_text(path: str | os.PathLike) -> str:
    """The text of a UTF-8 file through the one text reader (`rsqr_jax.data.read_text`: a Project Gutenberg
    file yields its body only); ConfigError (one line) if it is missing or empty."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"text file not found: {path}")
    text = data.read_text(path)
    if not text.strip():
        raise ConfigError(f"text file {path} is empty")
    return text


def read_tokens(tokenizer, path: str | os.PathLike, n: int, *, add_special_tokens: bool = False) -> np.ndarray:
    """The first n token ids (int32) of a text file, tokenizing only as much of the text as needed.

    The prefix grows until it yields n tokens; a prefix can tokenize its last word differently from the
    whole text, so n tokens of a longer prefix are taken (the result equals encoding the whole text
    whenever the n-th token is not at the cut)."""
    text = read_text(path)
    chars = 4 * n + 1000
    while True:
        ids = tokenizer.encode(text[:chars], add_special_tokens=add_special_tokens)
        if len(ids) > n or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n:
        raise ConfigError(f"{os.fspath(path)} has only {len(ids)} tokens; {n} are needed")
    return np.asarray(ids[:n], np.int32)


# ----------------------------------------------------------------------------------------------------
# Input files named in results.

# The directory that holds the package: a checkout's root (it has pyproject.toml), or site-packages.
_TOP = Path(data.__file__).resolve().parent.parent.parent


def portable_path(path: str | os.PathLike) -> str:
    """How a result names an input file: by its path in the repository when it lies in the checkout (in an
    installed package, the package's own data: rsqr_jax/data/...), so that a result reads the same from any
    working directory and machine; any other file by its absolute path."""
    real = Path(path).resolve()
    inside = _TOP if (_TOP / "pyproject.toml").is_file() else _TOP / "rsqr_jax"
    return real.relative_to(_TOP).as_posix() if real.is_relative_to(inside) else os.path.abspath(path)


def recorded_file(name: str) -> Path:
    """The file a result names (portable_path's form, or the absolute path older results hold), resolved."""
    named = Path(name)
    if not named.is_absolute() and (_TOP / named).exists():
        named = _TOP / named
    return named.resolve()


def same_input(recorded: str | None, path: str | os.PathLike | None) -> bool:
    """Whether a result's recorded input file is the file `path` (compared as resolved real paths, so a result
    written from another working directory, or with an older absolute name, matches); None matches None only."""
    if recorded is None or path is None:
        return recorded is None and path is None
    return recorded_file(recorded) == Path(path).resolve()


# ----------------------------------------------------------------------------------------------------
# Timing, files, interruption.


class Timer:
    """Wall and process-CPU seconds of a block (CPU time counts every thread of this process)."""

    def __enter__(self):
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.w0
        self.cpu = time.process_time() - self.c0


def write_json_atomic(path, obj: dict) -> None:
    """Write JSON to a temporary file beside `path`, then rename: a killed run never leaves a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


@contextlib.contextmanager
def sigterm_interrupts():
    """Inside the block SIGTERM raises KeyboardInterrupt, so a killed run unwinds like Ctrl-C and keeps
    what it finished; the previous handler comes back afterwards. The block gets a check to call once per unit of
    work: it raises KeyboardInterrupt if SIGTERM came and its own raise was lost (a signal that lands in a
    garbage-collection callback, such as jax's, has its exception printed and ignored)."""
    received = []

    def on_term(signum, frame):
        received.append(signum)
        raise KeyboardInterrupt

    def check():
        if received:
            raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield check
    finally:
        signal.signal(signal.SIGTERM, old)
