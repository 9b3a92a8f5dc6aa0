"""What this installation runs on, in a few lines: rsqr_jax's, jax's and jaxlib's versions, the backend and its
devices, the CPU's vector instructions, each CPU kernel's state (built for which instruction set, or off and why:
without them decoding runs up to about twice as slow), and the cache directories.

    rsqr_jax.info()          # the report, as a string
    rsqr_jax.info.report()   # printed (also print_info())
    python -m rsqr_jax.info  # printed

It builds the CPU kernels not built yet (seconds, once per machine; cached), so that their state is known.
"""

from __future__ import annotations

import os
import platform
import sys
import types

_ISA = {"avx512": "AVX-512", "avx2": "AVX2 (no AVX-512)", "none": "none (no AVX2)", "unknown": "unknown"}


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def _compile_cache() -> str:
    """Where XLA's compiled programs are kept in this process, and where the commands keep them."""
    import jax

    from rsqr_jax.host import cache_dir

    here = jax.config.jax_compilation_cache_dir
    commands = ("off (RSQR_COMPILE_CACHE=0)" if os.environ.get("RSQR_COMPILE_CACHE", "1") == "0"
                else os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(cache_dir("xla")))
    return f"{here or 'none'} in this process; the commands: {commands}"


def info(build: bool = True) -> str:
    """The report (a few lines). build=False leaves the CPU kernels this process has not used unbuilt (they
    then read "not built yet")."""
    import jax
    import jaxlib

    from rsqr_jax.host import cache_dir
    from rsqr_jax.kernels import cpu_ffi
    from rsqr_jax.kernels.cpu_status import kernel_status

    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    lines = [
        f"rsqr_jax {_version('rsqr_jax')} (python {platform.python_version()})",
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}",
        f"backend {jax.default_backend()}: {len(devices)} device(s), {', '.join(kinds)}",
        f"CPU: {platform.machine()}, {os.cpu_count()} cores, vector instructions {_ISA[cpu_ffi.cpu_isa()]}",
        f"CPU kernels (C++ compiler: {cpu_ffi.compiler() or 'none'}; RSQR_CPU_KERNEL=0 turns them off):",
    ]
    for s in kernel_status(build):
        state = (f"active, built for {s.isa}" if s.active else f"{s.reason}, for {s.isa}" if s.pending
                 else f"off: {s.reason}")
        lines.append(f"  {s.label} ({s.name}): {state}")
    lines += [f"kernel cache: {cache_dir()} (RSQR_JAX_CACHE)", f"XLA compilation cache: {_compile_cache()}"]
    return "\n".join(lines)


def report(build: bool = True) -> None:
    """Print the report."""
    print(info(build))


print_info = report

# `rsqr_jax.info` is this module where `import rsqr_jax.info` came first, else the function info (the package's
# export): both are called alike and both have report() and print_info().
info.report = report
info.print_info = print_info


class _Module(types.ModuleType):
    def __call__(self, build: bool = True) -> str:
        return info(build)


sys.modules[__name__].__class__ = _Module

if __name__ == "__main__":
    report()
