"""Building and registering this package's CPU kernels (block_matvec.cc, page_scores.cc, recalled_attention.cc):
each C++ source ships with the package and is compiled on first use, for this machine (`-march=native`), into a
cache directory (RSQR_JAX_CACHE, else $XDG_CACHE_HOME/rsqr_jax, else ~/.cache/rsqr_jax) keyed by the source, the
jaxlib, the compiler (CXX, else c++) and the CPU's instruction sets (a cache shared between machines never hands one
a library built for another's), then registered with XLA as an FFI target. A caller that cannot build stays on its
XLA path and says why.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

from rsqr_jax.host import cache_dir

# A library of another source, jaxlib or machine not used for this long is deleted when a new one is built.
STALE_DAYS = 30

FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")


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


def build(source: Path, cxx: str) -> Path:
    """The shared library of `source` for this jaxlib, compiler and machine, named after the source
    (`<stem>-<key>.so`): compiled once, then reused (written under a temporary name and renamed, so concurrent
    processes never load a half-written file). RuntimeError with the compiler's last line when it fails."""
    import jaxlib

    key = hashlib.sha256(b"\0".join([source.read_bytes(), jaxlib.__version__.encode(), cxx.encode(),
                                     " ".join(FLAGS).encode(), platform.machine().encode(), _cpu_features()])
                         ).hexdigest()[:16]
    out = cache_dir(f"{source.stem}-{key}.so")
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", tmp],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
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


def load(source: Path, symbol: str, target: str, switch: str = "RSQR_CPU_KERNEL") -> str | None:
    """Build and register one kernel: None when it is registered, else why not (one line). The environment variable
    `switch` = 0 turns it off."""
    if os.environ.get(switch, "1") == "0":
        return f"turned off ({switch}=0)"
    if jax.default_backend() != "cpu":
        return f"the default backend is {jax.default_backend()}, not cpu"
    cxx = compiler()
    if cxx is None:
        return f"no C++ compiler ({os.environ.get('CXX') or 'c++'}) on PATH"
    try:
        register(build(source, cxx), symbol, target)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return f"could not build the CPU kernel: {e}"
    return None
