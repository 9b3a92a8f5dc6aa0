"""rsqr_jax.kernels.block_matvec, the CPU kernel for decode on a GGUF's blocks: against a float64 oracle of the
dequantized matrix, under vmap, inside a model (a prompt's logits bit for bit those of XLA's dequantize-then-dot,
decode's within float32 rounding), and its fallbacks (turned off, no compiler: a one-line reason)."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rsqr_jax as rj
from rsqr_jax.kernels import block_matvec as BM
from rsqr_jax.models import blocks as BW
from rsqr_jax.cache import init_cache
from rsqr_jax.models.llama import forward_logits, read_model, split_apply
from rsqr_jax.spec import CacheSpec
from rsqr_jax.engine import step
from rsqr_lab.testing import drawn_seed
from tests.cli import assert_one_line_error, run_script, script_env
from tests.cpu_kernels import build_for_march
from tests.hf_fixtures import TinySpec, build_hf_model, write_tiny_gguf

if shutil.which("c++") is None:  # the kernel is built with the machine's C++ compiler
    pytest.skip("no C++ compiler: the CPU kernel cannot be built here", allow_module_level=True)

gguf = pytest.importorskip("gguf")


def _stack(rng, L, K, N, offset):
    codes = rng.integers(-128, 128, (L, K // 32, 32, N)).astype(np.int8)
    scale = rng.uniform(-0.02, 0.02, (L, K // 32, 1, N)).astype(np.float32)
    off = rng.uniform(-0.1, 0.1, (L, K // 32, 1, N)).astype(np.float32) if offset else None
    return codes, scale, off


def test_kernel_is_built_here():
    assert BM.available(), BM.unavailable_reason()


@pytest.mark.parametrize("K,N,M,offset", [(32, 8, 1, True), (96, 200, 3, False), (64, 1032, 8, True),
                                          (128, 64, 5, False)])
def test_kernel_equals_the_dequantized_product(K, N, M, offset):
    """Every layer of a stack, with and without Q4_1's offset, column counts that are and are not multiples of the
    kernel's 64-column chunks, 1-8 rows: within float32 rounding of x @ W in float64 (W = codes * scale + offset)."""
    seed = drawn_seed(f"block_matvec {K}x{N} M={M}")
    rng = np.random.default_rng(seed)
    L = 3
    codes, scale, off = _stack(rng, L, K, N, offset)
    x = rng.standard_normal((M, K)).astype(np.float32)
    tiled = jnp.asarray(BM.tile_codes(codes))
    np.testing.assert_array_equal(np.asarray(BM.untile_codes(tiled)), codes)
    for layer in range(L):
        w = codes[layer].astype(np.float64) * scale[layer] + (0.0 if off is None else off[layer])
        want = x.astype(np.float64) @ w.reshape(K, N)
        got = np.asarray(BM.block_matvec(jnp.asarray(x), tiled, jnp.asarray(scale),
                                         None if off is None else jnp.asarray(off), jnp.int32(layer)))
        assert got.shape == (M, N) and got.dtype == np.float32
        bound = 1e-6 * np.abs(x.astype(np.float64)) @ np.abs(w.reshape(K, N)) + 1e-30
        assert np.all(np.abs(got - want) <= 4 * bound), (f"seed {seed}", layer)


def test_kernel_under_vmap_and_jit():
    """A batched x is more rows of one call (up to ROWS_MAX; more take XLA's dot); a batched layer index runs one call
    per element; each equals the unbatched calls, jitted or not."""
    seed = drawn_seed("block_matvec vmap")
    rng = np.random.default_rng(seed)
    codes, scale, off = _stack(rng, 4, 64, 48, True)
    args = jnp.asarray(BM.tile_codes(codes)), jnp.asarray(scale), jnp.asarray(off)
    xb = jnp.asarray(rng.standard_normal((BM.ROWS_MAX // 2, 2, 64)).astype(np.float32))  # ROWS_MAX rows in all
    one = lambda x, layer: BM.block_matvec(x, *args, layer)  # noqa: E731
    lone = np.stack([np.asarray(one(x, 2)) for x in xb])
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(lambda x: one(x, 2)))(xb)), lone)
    # more rows than a decode step's: XLA's dequantize-then-dot, the same as a dot of the dequantized matrix
    many = jnp.asarray(rng.standard_normal((3 * BM.ROWS_MAX, 1, 64)).astype(np.float32))
    got = np.asarray(jax.jit(jax.vmap(lambda x: one(x, 2)))(many))
    np.testing.assert_array_equal(got, np.asarray(jax.jit(lambda m: BM.xla_matvec(m, *args, 2))(many)))
    w64 = (codes[2].astype(np.float64) * scale[2] + off[2]).reshape(64, 48)
    np.testing.assert_allclose(got, np.asarray(many, np.float64) @ w64, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")
    per_layer = np.stack([np.asarray(one(xb[0], i)) for i in range(4)])
    np.testing.assert_array_equal(np.asarray(jax.vmap(lambda i: one(xb[0], i))(jnp.arange(4))), per_layer)


Q = gguf.GGMLQuantizationType
MODELS = {  # a tied Q8_0 embedding (the output matrix too), or an untied Q4_0 output matrix
    "tied": (TinySpec(intermediate_size=96, seed=6), {"layers": Q.Q4_1, "embed": Q.Q8_0}),
    "untied": (TinySpec(intermediate_size=96, tie_word_embeddings=False, seed=7),
               {"layers": Q.Q4_0, "embed": Q.Q8_0, "output": Q.Q4_0}),
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_model_on_the_kernel_tracks_the_blocks_it_holds(tmp_path, model):
    """A tiny quantized GGUF read in the kernel's layout: the same weights (the output matrix too); a prompt (XLA's
    dot) gives the blocks model's logits (bit for bit where the output matrix is untied); one-token steps under a bounded policy (the kernel) its
    logits within float32 rounding."""
    spec, quant = MODELS[model]
    path = write_tiny_gguf(build_hf_model(spec), spec, tmp_path / "q.gguf", quant=quant)
    kern, blocks = read_model(str(path), blocks=True, tiled=True), read_model(str(path), blocks=True)
    assert kern.weight_format == "tiled" and blocks.weight_format == "blocks"
    tiled = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"} | ({"embed"} if model == "tied" else {"lm_head"})
    for n in tiled | {"embed"}:  # the same values, the tied embedding held as its transpose
        w = getattr(kern.model, n).get_value()
        assert w.tiled == (n in tiled), n
        np.testing.assert_array_equal(np.asarray(kern.model.weight(n)), np.asarray(blocks.model.weight(n)), err_msg=n)
    seed = drawn_seed("kernel tiny logits")
    ids = np.random.default_rng(seed).integers(3, kern.config.vocab_size, (1, 24))
    prompt = forward_logits(kern, ids), forward_logits(blocks, ids)
    if model == "untied":  # the layers' and the output matrix's dots are XLA's on the same dequantized values
        np.testing.assert_array_equal(*prompt, err_msg=f"seed {seed}")
    else:  # the tied output matrix is dotted as the transpose the kernel holds: XLA may sum it in another order
        np.testing.assert_allclose(*prompt, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")
    pol = rj.rsqr(8, 2, 4, 4)  # bounded: evictions and survivors within the 24 steps
    spec = CacheSpec.for_policies(pol, dims=kern.config, batch=1, max_chunk=1, max_len=64)
    logits = []
    for loaded in (kern, blocks):
        apply_fn, params = split_apply(loaded.model)
        one = jax.jit(lambda params, tok, cache, apply_fn=apply_fn: step(apply_fn, params, tok, cache, pol))
        cache, steps = init_cache(spec), []
        for t in ids[0].tolist():  # one token per step: decode rows, the kernel's path
            out, cache = one(params, jnp.asarray([[t]], jnp.int32), cache)
            steps.append(np.asarray(out))
        logits.append(np.concatenate(steps, axis=1))
    assert not np.array_equal(logits[0], logits[1])  # the kernel ran: another summation order
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4, err_msg=f"seed {seed}")


def test_turned_off_or_unbuildable_kernel_falls_back_with_a_reason(monkeypatch, tmp_path):
    """RSQR_CPU_KERNEL=0 or a compiler that fails: one-line reasons; `--weight-format tiled` refuses with it; a
    model in the kernel's layout then runs XLA's dequantize-then-dot (the blocks model's logits bit for bit)."""
    BM._load.cache_clear()
    monkeypatch.setenv("RSQR_CPU_KERNEL", "0")
    try:
        assert not BM.available() and "RSQR_CPU_KERNEL=0" in BM.unavailable_reason()
        seed = drawn_seed("kernel off")
        rng = np.random.default_rng(seed)
        codes, scale, off = _stack(rng, 2, 64, 16, True)
        w = BW.BlockWeights(jnp.asarray(BM.tile_codes(codes)), jnp.asarray(scale), jnp.asarray(off), -2, tiled=True)
        x = jnp.asarray(rng.standard_normal((1, 64)).astype(np.float32))
        np.testing.assert_array_equal(np.asarray(BW.matmul(x, BW.StackedLayer(w, jnp.int32(1)))),
                                      np.asarray(BW.matmul(x, jax.tree.map(lambda a: a[1], w).dense())))
        head = BW.BlockWeights.from_blocks(codes[0, :, :, :8].reshape(8, 64), scale[0, :, 0, :8].T.copy(), None, -1)
        np.testing.assert_array_equal(np.asarray(BW.logits(x, head.to_tiled(), jnp.float32)),
                                      np.asarray(BW.logits(x, head, jnp.float32)))
        proc = run_script("decode.py", "--weight-format", "tiled", "--prompt", "hi",
                          env={**script_env(), "RSQR_CPU_KERNEL": "0"})
        assert_one_line_error(proc, "--weight-format tiled: turned off (RSQR_CPU_KERNEL=0)")
        monkeypatch.setenv("RSQR_CPU_KERNEL", "1")
        monkeypatch.setenv("RSQR_JAX_CACHE", str(tmp_path / "cache"))
        monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
        BM._load.cache_clear()
        assert not BM.available() and BM.unavailable_reason().startswith("could not build the CPU kernel")
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
        BM._load.cache_clear()
        assert "no C++ compiler" in BM.unavailable_reason()
    finally:
        monkeypatch.undo()
        BM._load.cache_clear()
    assert BM.available()


def test_bench_weights_compares_the_tiled_layout_with_the_other_formats(tmp_path):
    """scripts/bench_weights.py (projections only: the tiny GGUF has no tokenizer) times every format on the same
    blocks: the tiled layout reads the blocks' bytes, a third of float32's."""
    import json

    spec = TinySpec(intermediate_size=96, seed=6)
    path = write_tiny_gguf(build_hf_model(spec), spec, tmp_path / "q.gguf",
                           quant={"layers": gguf.GGMLQuantizationType.Q4_1, "embed": gguf.GGMLQuantizationType.Q8_0})
    proc = run_script("bench_weights.py", "--quick", "--no-decode", "--model", str(path), "--formats",
                      "dense,blocks,tiled", "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    micro = json.loads((tmp_path / "out" / "bench_weights.json").read_text())["micro"]["default"]
    assert set(micro["stack_ms"]) == {"dense", "blocks", "tiled"} and min(micro["stack_ms"].values()) > 0
    assert micro["bytes"]["tiled"] == micro["bytes"]["blocks"] < 0.35 * micro["bytes"]["dense"]
    assert "| tiled |" in proc.stdout


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_the_avx2_and_plain_paths_equal_the_dequantized_product(tmp_path, march):
    """The kernel's source built for machines without AVX-512 (x86-64-v3: its AVX2 path; x86-64: its plain loop),
    registered under a name of its own: the same oracle as the path this machine runs."""
    target = build_for_march(BM.SOURCE, "BlockMatvec", march, tmp_path)
    seed = drawn_seed(f"block_matvec {march}")
    rng = np.random.default_rng(seed)
    K, N, M = 96, 72, 3
    codes, scale, off = _stack(rng, 2, K, N, True)
    x = rng.standard_normal((M, K)).astype(np.float32)
    out = jax.ShapeDtypeStruct((M, N), jnp.float32)
    for offset in (off, None):
        got = np.asarray(jax.ffi.ffi_call(target, out)(jnp.asarray(x), jnp.asarray(BM.tile_codes(codes)),
                                                       jnp.asarray(scale), jnp.asarray(scale if offset is None else offset),
                                                       jnp.int32(1), has_offset=offset is not None))
        w = codes[1].astype(np.float64) * scale[1] + (0.0 if offset is None else offset[1])
        np.testing.assert_allclose(got, x.astype(np.float64) @ w.reshape(K, N), rtol=1e-5, atol=1e-5,
                                   err_msg=f"seed {seed}")


def test_a_new_build_prunes_the_libraries_nobody_used_for_a_month(monkeypatch, tmp_path):
    """Building the kernel into a cache deletes the other kernel libraries unused for BM.STALE_DAYS, keeps the
    recently used ones and anything that is not a kernel library."""
    import os
    import time

    if BM._compiler() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("RSQR_JAX_CACHE", str(tmp_path))
    now = time.time()
    files = {name: tmp_path / name for name in ("block_matvec-old.so", "block_matvec-recent.so", "other-old.so")}
    for name, path in files.items():
        path.write_bytes(b"x")
        age = 2 if name == "block_matvec-recent.so" else BM.STALE_DAYS + 5
        os.utime(path, (now - age * 86400, now - age * 86400))
    built = BM._build(BM._compiler())
    assert built.is_file() and built.parent == tmp_path
    assert not files["block_matvec-old.so"].exists()
    assert files["block_matvec-recent.so"].exists() and files["other-old.so"].exists()
