"""What a process asks of the machine it runs on: a cache directory, a persistent compilation cache for the
commands, and freed heap memory handed back. Imports nothing of ours, and jax only where it is already imported:
the command-line plumbing calls it before jax is imported, and the lowest layer (the CPU kernel's build) uses it."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """This package's cache directory (RSQR_JAX_CACHE, else $XDG_CACHE_HOME/rsqr_jax, else ~/.cache/rsqr_jax),
    joined with `parts`; not created here."""
    root = os.environ.get("RSQR_JAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rsqr_jax")
    return Path(root, *parts)


# The compilation cache's cap: least recently used programs are evicted beyond it (a decode configuration's
# programs take well under 1 MB).
COMPILE_CACHE_MAX_BYTES = 1 << 30


def enable_compilation_cache() -> None:
    """Keep the programs XLA compiles in cache_dir("xla") (jax's persistent compilation cache), so that a command
    run again on the same configuration loads them instead of compiling (decode.py says how long it compiled).
    Only programs that took at least a second to compile are kept (jax's default). Every command calls it before
    its first compilation (rsqr_jax.cli.args.run_main); a library user may too, or set jax's own
    `jax_compilation_cache_dir`. A directory already set (JAX_COMPILATION_CACHE_DIR) is kept; RSQR_COMPILE_CACHE=0
    turns it off."""
    if os.environ.get("RSQR_COMPILE_CACHE", "1") == "0":
        return
    if "jax" not in sys.modules:  # jax reads these when it is imported
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache_dir("xla")))
        os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(COMPILE_CACHE_MAX_BYTES))
        return
    import jax

    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir("xla")))
        jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_MAX_BYTES)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (another C library)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim") if name else None
    except (OSError, AttributeError):
        return None


def release_free_heap() -> bool:
    """Hand the heap memory freed so far back to the operating system (glibc's malloc_trim; False where there
    is none). glibc keeps freed blocks for reuse, so the transient buffers of reading a model (a GGUF's blocks
    decoded and re-laid) and of XLA's compiler stay in the resident set after they are freed.
    Called after each."""
    trim = _malloc_trim()
    return bool(trim and trim(0) is not None)
