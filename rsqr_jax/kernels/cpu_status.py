"""What the CPU kernels (block_matvec, page_scores, recalled_attention) are doing in this process: each one built
and registered, or off and why, and the instruction set it is built for. Without them decoding runs on XLA's
paths, up to about twice as slow, so a user should be able to ask (rsqr_jax.info, the commands' status line).

Asking builds nothing that is not built already, unless asked to (`build=True`): a kernel not used yet is
reported as such, with what would stop it (turned off, not a CPU backend, no compiler) where that is known
without building.
"""

from __future__ import annotations

import dataclasses

from rsqr_jax.kernels import block_matvec, cpu_ffi, page_scores, recalled_attention

MODULES = (block_matvec, page_scores, recalled_attention)
NOT_BUILT = "not built yet (built on its first use)"
NOT_LOADED = "built, not loaded yet (loaded on its first use)"


@dataclasses.dataclass(frozen=True)
class KernelStatus:
    """One CPU kernel: `name` (its module), `label` (what it is for), `active` (built and registered with XLA
    in this process), `reason` (why not, one line; None when active) and `isa` ("avx512", "avx2", "plain" or
    "unknown": what it is, or would be, built for on this CPU)."""

    name: str
    label: str
    active: bool
    reason: str | None
    isa: str

    @property
    def pending(self) -> bool:
        """Not used yet in this process, and nothing known that would stop it."""
        return self.reason in (NOT_BUILT, NOT_LOADED)


def _status(module, build: bool) -> KernelStatus:
    name = module.NAME
    if build or module._load.cache_info().currsize:  # used already: its answer is kept
        reason = module._load()
    else:
        reason = cpu_ffi.precheck()
        if reason is None:
            built = cpu_ffi.library_path(module.SOURCE, cpu_ffi.compiler()).is_file()
            reason = NOT_LOADED if built else NOT_BUILT
    return KernelStatus(name, cpu_ffi.KERNELS[name].label, reason is None, reason, cpu_ffi.built_isa(name))


def build_all() -> None:
    """Build and register every CPU kernel not built yet in this process (seconds the first time on a machine, then
    cached; nothing where they cannot be built, which their first use then reports)."""
    for m in MODULES:
        m._load()


def kernel_status(build: bool = False) -> tuple[KernelStatus, ...]:
    """Each CPU kernel's status (block_matvec, page_scores, recalled_attention, in that order). build=True builds
    and registers the ones not used yet (seconds the first time, then cached), so that `active` is the answer
    for all three; otherwise only what this process has used is built."""
    return tuple(_status(m, build) for m in MODULES)


def status_line(build: bool = False) -> str:
    """One short line for a command's status output, e.g. "CPU kernels: weights avx2, page scores avx2, recalled
    attention avx2", "CPU kernels off: no C++ compiler (c++) on PATH: install g++ or set CXX", or per kernel
    "page scores off (...)"; a kernel not used yet shows the instruction set it would be built for, marked
    "(first use)" (after a command's first decode step every kernel it uses has been built)."""
    statuses = kernel_status(build)
    off = {s.reason for s in statuses if not s.active and not s.pending}
    if len(off) == 1 and all(not s.active and not s.pending for s in statuses):
        return f"CPU kernels off: {off.pop()}"
    parts = []
    for s in statuses:
        if s.active:
            parts.append(f"{s.label} {s.isa}")
        elif s.pending:
            parts.append(f"{s.label} {s.isa} (first use)")
        else:
            parts.append(f"{s.label} off ({s.reason})")
    return "CPU kernels: " + ", ".join(parts)
