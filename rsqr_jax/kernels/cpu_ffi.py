"""Building and registering this package's CPU kernels (block_matvec.cc, page_scores.cc, recalled_attention.cc):
each C++ source ships with the package and is compiled on first use, for this machine (`-march=native`), into a
cache directory (RSQR_JAX_CACHE, else $XDG_CACHE_HOME/rsqr_jax, else ~/.cache/rsqr_jax) keyed by the source, the
jaxlib, the compiler (CXX, else c++) and the CPU's instruction sets (a cache shared between machines never hands one
a library built for another's), then registered with XLA as an FFI target. A caller that cannot build stays on its
XLA path and says why: once per process, a RuntimeWarning naming the cause and the cost (`warn_off`), since a
decode without its kernels is up to twice as slow; rsqr_jax.kernels.cpu_status reports each kernel's state.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax

from rsqr_jax.host import cache_dir

# A library of another source, jaxlib or machine not used for this long is deleted when a new one is built.
STALE_DAYS = 30

FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """What a CPU kernel is for, in a few words (`label`), roughly what running without it costs (`cost`), and
    the CPU flags its AVX-512 path needs (`avx512`) and its AVX2 build (`avx2`): without them it is built for a
    plainer path."""

    label: str
    cost: str
    avx512: tuple[str, ...]
    avx2: tuple[str, ...] = ("avx2",)


# Keyed by the C++ source's stem (the module's name).
KERNELS = {
    "block_matvec": Kernel("weights", "decoding runs about 2x slower", ("avx512f", "avx2", "fma"), ("avx2", "fma")),
    "page_scores": Kernel("page scores", "the recall tier's page scores run on XLA, somewhat slower",
                          ("avx512f", "avx512_vnni")),
    "recalled_attention": Kernel("recalled attention", "recall's added time per token grows about 1.5x",
                                 ("avx512f",)),
}

# The reasons load() gives that need no warning: the user turned the kernels off, or they do not apply here.
QUIET_REASONS = ("turned off", "the default backend is")


def compiler() -> str | None:
    """The C++ compiler to build with (CXX, else c++), None when it is not on PATH."""
    return shutil.which(os.environ.get("CXX") or "c++")


def _cpu_features() -> bytes:
    """The CPU's instruction-set flags (Linux's /proc/cpuinfo; elsewhere the processor's name): -march=native builds
    for them."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith((b"flags", b"Features"))), b"")
    except OSError:
        return platform.processor().encode()


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str] | None:
    """The CPU's instruction-set flags as /proc/cpuinfo names them (avx2, avx512f, ...); None where they cannot be
    read (not Linux)."""
    line = _cpu_features().decode(errors="replace")
    if ":" not in line:
        return None
    return frozenset(line.split(":", 1)[1].split())


def cpu_isa() -> str:
    """The widest x86 vector instruction set of this CPU that the kernels use: "avx512", "avx2", "none" (an x86-64
    CPU without AVX2, or another architecture), "unknown" where the flags cannot be read."""
    flags = cpu_flags()
    if flags is None:
        return "unknown"
    return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "none"


def built_isa(name: str) -> str:
    """What kernel `name` (a KERNELS key) is built for on this CPU with -march=native: "avx512" (its AVX-512 path),
    "avx2" (its AVX2 path, or its loops vectorised by the compiler for AVX2), "plain" (a CPU without AVX2: its plain
    loops), "unknown" where the CPU's flags cannot be read."""
    flags, kernel = cpu_flags(), KERNELS[name]
    if flags is None:
        return "unknown"
    return ("avx512" if flags.issuperset(kernel.avx512) else "avx2" if flags.issuperset(kernel.avx2)
            else "plain")


def library_path(source: Path, cxx: str) -> Path:
    """Where build() keeps the shared library of `source` for this jaxlib, compiler and machine (whether or not it
    is built yet)."""
    import jaxlib

    key = hashlib.sha256(b"\0".join([source.read_bytes(), jaxlib.__version__.encode(), cxx.encode(),
                                     " ".join(FLAGS).encode(), platform.machine().encode(), _cpu_features()])
                         ).hexdigest()[:16]
    return cache_dir(f"{source.stem}-{key}.so")


def _first_error(stderr: str) -> str:
    """The line of a compiler's output that says what went wrong first (its first "error" line, else its first
    line), cut to a line's length."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()] or ["?"]
    line = next((x for x in lines if "error" in x.lower()), lines[0])
    return line if len(line) <= 200 else line[:197] + "..."


def build(source: Path, cxx: str) -> Path:
    """The shared library of `source` for this jaxlib, compiler and machine, named after the source
    (`<stem>-<key>.so`): compiled once, then reused (written under a temporary name and renamed, so concurrent
    processes never load a half-written file). RuntimeError with the compiler's first error line when it fails."""
    out = library_path(source, cxx)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", tmp],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {_first_error(proc.stderr)}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    prune(out)
    return out


def prune(keep: Path) -> None:
    """Delete the cache's other libraries of the same source that no process has used for STALE_DAYS (a new source
    or jaxlib builds a new one; the old ones would pile up). A library in use elsewhere stays: loading one marks it
    used."""
    import time

    horizon = time.time() - STALE_DAYS * 86400
    stem = keep.name.rsplit("-", 1)[0]
    for old in keep.parent.glob(f"{stem}-*.so"):
        try:
            st = old.stat()
            if old != keep and max(st.st_atime, st.st_mtime) < horizon:
                old.unlink()
        except OSError:  # gone already, or not ours to delete
            pass


@functools.lru_cache(maxsize=None)
def register(library: Path, symbol: str, target: str) -> None:
    """Register the library's handler `symbol` with XLA as the CPU FFI target `target`, once per process."""
    import ctypes

    lib = ctypes.cdll.LoadLibrary(str(library))
    try:
        os.utime(library)  # used now (prune keeps what is used; a file system's atime may not say so)
    except OSError:
        pass
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")


def precheck(switch: str = "RSQR_CPU_KERNEL") -> str | None:
    """Why load() would give up before building (one line), or None when it would build: the environment variable
    `switch` = 0, a backend other than the CPU, no compiler."""
    if os.environ.get(switch, "1") == "0":
        return f"turned off ({switch}=0)"
    if jax.default_backend() != "cpu":
        return f"the default backend is {jax.default_backend()}, not cpu"
    if compiler() is None:
        return f"no C++ compiler ({os.environ.get('CXX') or 'c++'}) on PATH: install g++ or set CXX"
    return None


def load(source: Path, symbol: str, target: str, switch: str = "RSQR_CPU_KERNEL") -> str | None:
    """Build and register one kernel: None when it is registered, else why not (one line, precheck's or the
    build's). The environment variable `switch` = 0 turns it off."""
    if (reason := precheck(switch)) is not None:
        return reason
    try:
        register(build(source, compiler()), symbol, target)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return f"could not build the CPU kernel: {e}"
    return None


_WARNED: set[str] = set()


def warn_off(name: str, reason: str | None) -> None:
    """Say once per process, as a RuntimeWarning, that kernel `name` (a KERNELS key) would run here but cannot
    (`reason`, load()'s) and what that costs; nothing for a kernel turned off or off the CPU. One warning per
    reason: without a compiler the kernels would all repeat it."""
    if reason is None or reason.startswith(QUIET_REASONS) or reason in _WARNED:
        return
    _WARNED.add(reason)
    kernel = KERNELS[name]
    warnings.warn(f"rsqr_jax: the CPU {kernel.label} kernel is off ({reason}); {kernel.cost} "
                  f"(python -m rsqr_jax.info shows every kernel)", RuntimeWarning, stacklevel=3)
