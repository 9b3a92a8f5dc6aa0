"""What the CPU kernels say about themselves (rsqr_jax.kernels.cpu_status, rsqr_jax.info): active here and built for
this CPU's instruction set; off with the reason when turned off (RSQR_CPU_KERNEL=0, quietly), when no compiler is
found or the build fails (one warning per process, naming the cause and the cost). A kernel's build state is kept
per process, so the off cases run in child processes of their own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from rsqr_jax.kernels import cpu_ffi
from rsqr_jax.kernels.cpu_status import kernel_status, status_line
from tests.cli import ENV, REPO

NAMES = ["block_matvec", "page_scores", "recalled_attention"]
LABELS = ["weights", "page scores", "recalled attention"]

# A child process: the kernels' use sites as a decode meets them (loading a GGUF's blocks, then the recall tier's
# two kernels, each asked twice), every warning recorded; prints the warnings and the status as JSON.
CHILD = r"""
import json, sys, warnings
warnings.simplefilter("always")  # every warning shown: only rsqr_jax's own once-per-process rule holds them back
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from rsqr_jax.kernels import block_matvec, page_scores, recalled_attention
    from rsqr_jax.kernels.cpu_status import kernel_status, status_line
    if len(sys.argv) > 1:
        from rsqr_jax.models.llama import load_model
        assert load_model(sys.argv[1]).weight_format in ("blocks", "tiled")
    used = [m.usable() for m in (block_matvec, page_scores, recalled_attention, block_matvec)]
    used.append(page_scores.applies(1))
    status = [s.__dict__ | {"pending": s.pending} for s in kernel_status()]
    line = status_line()
print(json.dumps({"warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
                  "used": used, "status": status, "line": line}))
"""


def _child(env: dict, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**ENV, "JAX_PLATFORMS": "cpu", **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _needs_compiler():
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")


def test_the_kernels_report_themselves_active_and_built_for_this_cpu():
    _needs_compiler()
    statuses = kernel_status(build=True)
    assert [s.name for s in statuses] == NAMES and [s.label for s in statuses] == LABELS
    for s in statuses:
        assert s.active and s.reason is None and not s.pending, s
        assert s.isa == cpu_ffi.built_isa(s.name)
    isa = cpu_ffi.cpu_isa()
    if isa in ("avx512", "avx2"):  # an AVX2 machine builds every kernel for AVX2 at least
        assert {s.isa for s in statuses} <= {"avx512", "avx2"} and statuses[2].isa == isa
    assert status_line() == "CPU kernels: " + ", ".join(f"{s.label} {s.isa}" for s in statuses)
    assert kernel_status() == statuses  # built now: the status without build says the same


def test_the_cpu_isa_follows_the_flags(monkeypatch):
    """avx512 needs each kernel's own flags (page_scores' AVX-512 path also VNNI), avx2 the AVX2 path's."""
    for flags, want in [({"avx2", "fma", "avx512f"}, ["avx512", "avx2", "avx512"]),
                        ({"avx2", "fma", "avx512f", "avx512_vnni"}, ["avx512"] * 3),
                        ({"avx2", "fma"}, ["avx2"] * 3), ({"avx2"}, ["plain", "avx2", "avx2"]),
                        ({"sse4_2"}, ["plain"] * 3)]:
        monkeypatch.setattr(cpu_ffi, "cpu_flags", lambda f=frozenset(flags): f)
        assert [cpu_ffi.built_isa(n) for n in NAMES] == want, flags
        assert cpu_ffi.cpu_isa() == ("avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "none")
    monkeypatch.setattr(cpu_ffi, "cpu_flags", lambda: None)
    assert cpu_ffi.cpu_isa() == "unknown" and cpu_ffi.built_isa("page_scores") == "unknown"


def test_turned_off_reports_the_switch_and_warns_nothing():
    got = _child({"RSQR_CPU_KERNEL": "0"})
    assert got["used"] == [False] * 5 and got["warnings"] == []  # the user's choice: nothing to warn about
    for s in got["status"]:
        assert not s["active"] and s["reason"] == "turned off (RSQR_CPU_KERNEL=0)", s
    assert got["line"] == "CPU kernels off: turned off (RSQR_CPU_KERNEL=0)"


def test_no_compiler_gives_the_reason_and_exactly_one_warning(tmp_path):
    """A GGUF's blocks loaded without the weights kernel, then the recall tier's kernels: one warning in all,
    naming the cause and the cost; every kernel's status says why."""
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    import gguf

    from tests.hf_fixtures import TinySpec, build_hf_model, write_tiny_gguf

    spec = TinySpec(intermediate_size=96, seed=6)
    path = write_tiny_gguf(build_hf_model(spec), spec, tmp_path / "q.gguf",
                           quant={"layers": gguf.GGMLQuantizationType.Q4_1, "embed": gguf.GGMLQuantizationType.Q8_0})
    missing = tmp_path / "no-such-c++"
    got = _child({"CXX": str(missing), "RSQR_JAX_CACHE": str(tmp_path / "cache")}, str(path))
    assert got["used"] == [False] * 5
    reason = f"no C++ compiler ({missing}) on PATH: install g++ or set CXX"
    assert got["warnings"] == [f"rsqr_jax: the CPU weights kernel is off ({reason}); decoding runs about 2x slower "
                               f"(python -m rsqr_jax.info shows every kernel)"]
    for s in got["status"]:
        assert not s["active"] and s["reason"] == reason and not s["pending"], s
    assert got["line"] == f"CPU kernels off: {reason}"
    assert not (tmp_path / "cache").exists()  # nothing was built


def test_a_failed_build_gives_the_compilers_first_error_line(tmp_path):
    """A compiler that fails: the reason quotes its first error line (not the summary after it), and the recall
    tier's kernel warns once, with its own cost."""
    cxx = tmp_path / "bad-c++"
    cxx.write_text("#!/bin/sh\necho 'In file included from x.cc:1:' >&2\necho 'x.cc:3:5: error: no AVX here' >&2\n"
                   "echo '1 error generated.' >&2\nexit 1\n")
    cxx.chmod(0o755)
    got = _child({"CXX": str(cxx), "RSQR_JAX_CACHE": str(tmp_path / "cache")})
    reason = f"could not build the CPU kernel: {cxx} failed: x.cc:3:5: error: no AVX here"
    assert [s["reason"] for s in got["status"]] == [reason] * 3
    assert len(got["warnings"]) == 1 and got["warnings"][0].startswith(f"rsqr_jax: the CPU weights kernel is off "
                                                                        f"({reason}); decoding runs about 2x slower")


def test_info_names_every_kernel_and_the_module_prints_it():
    _needs_compiler()
    import jax

    import rsqr_jax

    text = rsqr_jax.info()
    assert rsqr_jax.info.report is not None and callable(rsqr_jax.info.print_info)
    for name, label in zip(NAMES, LABELS):
        line = next(x for x in text.splitlines() if f"({name})" in x)
        assert line.strip().startswith(label) and f"built for {cpu_ffi.built_isa(name)}" in line, line
    assert "jax " in text and f"backend {jax.default_backend()}" in text and "kernel cache:" in text and "XLA compilation cache:" in text
    proc = subprocess.run([sys.executable, "-m", "rsqr_jax.info"], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**ENV, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(f"({name}): active" in proc.stdout for name in NAMES), proc.stdout
    off = subprocess.run([sys.executable, "-m", "rsqr_jax.info"], capture_output=True, text=True, timeout=300,
                         cwd=REPO, env={**ENV, "JAX_PLATFORMS": "cpu", "RSQR_CPU_KERNEL": "0"})
    assert off.returncode == 0 and off.stdout.count("off: turned off (RSQR_CPU_KERNEL=0)") == 3, off.stdout
