"""Helpers for the CPU kernels' tests (tests/test_block_matvec.py, test_page_scores.py, test_recalled_attention.py):
a kernel's source built for another machine, and a recall decode to compare a kernel against XLA's path."""

from __future__ import annotations

import ctypes
import platform
import subprocess

import jax
import numpy as np
import pytest


def build_for_march(source, symbol: str, march: str, tmp_path) -> str:
    """Build `source` for -march=`march` (a machine without this one's instruction sets: the kernel's other paths) and
    register its handler `symbol` under a target name of its own; returns that name. Skips off x86-64."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("these builds need an x86-64 machine")
    lib = tmp_path / f"{source.stem}_{march}.so"
    proc = subprocess.run(["c++", "-O2", f"-march={march}", "-std=c++17", "-shared", "-fPIC", "-w",
                           f"-I{jax.ffi.include_dir()}", str(source), "-o", str(lib)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    target = f"rsqr_{source.stem}_test_{march.replace('-', '_')}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(ctypes.cdll.LoadLibrary(str(lib)), symbol)),
                                platform="cpu")
    return target


def recall_decode_logits(apply_fn, params, cfg, tokens, cold, recall_pages: int = 2) -> np.ndarray:
    """Logits of 32 decode steps after a 40-token prompt fed as one chunk, rsqr with the recall tier (`cold`, a
    ColdStore) on the tiny model: the prompt's rows take XLA's paths, each decode step the CPU kernels where they
    apply. `apply_fn` is traced anew for each new function object (how a test compares the kernel with XLA)."""
    import rsqr_jax as rj
    from rsqr_jax import policy as P

    pol = P.rsqr(8, 2, 3, 3, recall_pages=recall_pages)
    spec = rj.CacheSpec.for_policies([pol], max_chunk=40, cold=cold, num_layers=cfg.num_layers,
                                     num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    dec = rj.Decoder(apply_fn, spec)
    _, cache = dec.feed(params, tokens[:, :40], dec.init_cache(), pol)
    out = []
    for t in range(40, 72):
        logits, cache = dec.feed(params, tokens[:, t:t + 1], cache, pol)
        out.append(np.asarray(logits))
    return np.concatenate(out)
