"""rsqr_jax.models.blocks: a GGUF's 4- and 8-bit blocks held as int8 codes and dequantized inside the step give the
float32 path's weights and logits bit for bit (gguf-py's dequantization is the reference), on tiny quantized
GGUFs of the Llama family, and on the embedded SmolLM2 (slow)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import rsqr_jax as rj
from rsqr_jax.models import blocks as BW
from rsqr_jax.models.llama import forward_logits, load_model, read_model
from rsqr_lab.testing import drawn_seed
from tests.cli import assert_one_line_errors
from tests.hf_fixtures import TinySpec, build_hf_model, write_tiny_gguf

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_decoded_blocks_are_gguf_dequantization(kind):
    """Every value, both nibbles of a byte, negative and tiny scales: codes * scale (+ offset) == gguf-py's float32."""
    seed = drawn_seed(f"blocks {kind}")
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((6, 256)) * rng.choice([1e-4, 1.0, 30.0], (6, 1))).astype(np.float32)
    x[0] = 0.0  # an all-zero row: scale 0
    raw = gguf.quants.quantize(x, Q[kind])
    codes, scale, offset = BW.decode_blocks(raw, kind)
    assert codes.dtype == np.int8 and codes.shape == x.shape and scale.shape == (6, 256 // 32)
    assert (offset is not None) == (kind == "Q4_1")
    lo, hi = {"Q4_0": (-8, 7), "Q4_1": (0, 15), "Q8_0": (-128, 127)}[kind]
    assert codes.min() >= lo and codes.max() <= hi
    w = BW.BlockWeights.from_blocks(codes, scale, offset, block_axis=-1)
    assert w.shape == x.shape
    want = gguf.quants.dequantize(raw, Q[kind])
    np.testing.assert_array_equal(np.asarray(w.dense()), want, err_msg=f"seed {seed}")
    # the same weight transposed, blocked along axis -2 (a canonical x @ W matrix), and rows of the embedding
    t = BW.BlockWeights.from_blocks(codes.T.copy(), scale.T.copy(), None if offset is None else offset.T.copy(), -2)
    np.testing.assert_array_equal(np.asarray(t.dense()), want.T)
    idx = np.array([[3, 0], [5, 3]])
    np.testing.assert_array_equal(np.asarray(w.rows(jnp.asarray(idx))), want[idx])
    with pytest.raises(ValueError, match="rows"):
        t.rows(jnp.asarray(idx))


def test_chunked_logits_equal_one_dot():
    """The tied head dequantizes a chunk of rows at a time: the same logits as one dot over the whole matrix."""
    seed = drawn_seed("chunked head")
    rng = np.random.default_rng(seed)
    codes = rng.integers(-128, 128, (8192, 64)).astype(np.int8)
    w = BW.BlockWeights.from_blocks(codes, rng.uniform(1e-3, 1e-2, (8192, 2)).astype(np.float32), None, -1)
    h = jnp.asarray(rng.standard_normal((2, 3, 64)).astype(np.float32))
    got = np.asarray(BW.logits(h, w, jnp.float32))
    want = np.einsum("bch,vh->bcv", np.asarray(h, np.float64), np.asarray(w.dense(), np.float64))
    assert got.shape == (2, 3, 8192)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")
    np.testing.assert_allclose(got, np.asarray(BW.logits(h, w.dense(), jnp.float32)), rtol=1e-6, atol=1e-6)


QUANTIZED = {
    "tied": (TinySpec(intermediate_size=96, seed=6), {"layers": Q.Q4_1, "embed": Q.Q8_0}),
    "untied_q4_0": (TinySpec(intermediate_size=96, tie_word_embeddings=False, seed=7),
                    {"layers": Q.Q4_0, "embed": Q.Q8_0, "output": Q.Q4_0}),
}


@pytest.fixture(scope="module", params=sorted(QUANTIZED))
def quantized_gguf(request, tmp_path_factory):
    spec, quant = QUANTIZED[request.param]
    return write_tiny_gguf(build_hf_model(spec), spec, tmp_path_factory.mktemp("q") / "tiny.gguf", quant=quant)


def test_tiny_blocks_model_equals_dense(quantized_gguf):
    blocks = read_model(str(quantized_gguf), blocks=True)
    dense = read_model(str(quantized_gguf))
    assert blocks.weight_format == "blocks" and dense.weight_format == "dense"
    held = {n for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "embed", "lm_head")
            if getattr(blocks.model, n, None) is not None
            and isinstance(getattr(blocks.model, n).get_value(), BW.BlockWeights)}
    want = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "embed"} | (
        {"lm_head"} if not blocks.config.tie_word_embeddings else set())
    assert held == want
    for n in want:  # q/k rows unpermuted like the float path, every matrix transposed to x @ W
        np.testing.assert_array_equal(np.asarray(blocks.model.weight(n)), np.asarray(dense.model.weight(n)), err_msg=n)
    assert blocks.model.weight_bytes < 0.45 * dense.model.weight_bytes
    seed = drawn_seed("blocks tiny logits")
    ids = np.random.default_rng(seed).integers(3, blocks.config.vocab_size, (2, 40))
    np.testing.assert_array_equal(forward_logits(blocks, ids), forward_logits(dense, ids), err_msg=f"seed {seed}")
    # streamed under a bounded policy: the same greedy tokens and the same cache
    pol = rj.rsqr(16, 2, 4, 4)
    runs = []
    for loaded in (blocks, dense):
        apply_fn, params = loaded.split()
        s = rj.Session.create(apply_fn, params, pol, dims=loaded.config, chunk=8, max_len=128)
        s.feed(ids[0].tolist())
        runs.append((s.generate(24), s.cache))
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(np.asarray(runs[0][1].win_k), np.asarray(runs[1][1].win_k))


def test_float_gguf_and_weight_format_choice(tmp_path):
    spec = TinySpec(intermediate_size=96, seed=8)
    path = write_tiny_gguf(build_hf_model(spec), spec, tmp_path / "f32.gguf")
    assert read_model(str(path), blocks=True).weight_format == "dense"  # no blocks in the file: dense anyway
    assert load_model(str(path), weight_format="blocks").weight_format == "dense"
    with pytest.raises(ValueError, match="weight_format must be one of auto, tiled, blocks, dense"):
        load_model(str(path), weight_format="int4")
    assert_one_line_errors([("decode.py", ["--weight-format", "int4", "--prompt", "hi"],
                             "--weight-format must be auto, tiled, blocks or dense")])


@pytest.mark.slow
def test_embedded_model_blocks_equal_dense(smollm2_path):
    """SmolLM2-135M (Q4_1 layers, a Q8_0 embedding, tied): the same logits bit for bit from a quarter of the
    bytes; `auto` is the CPU kernel's layout of the same blocks where the kernel builds (tests/test_block_matvec.py)."""
    blocks = read_model(smollm2_path, blocks=True)
    dense = read_model(smollm2_path)
    assert blocks.weight_format == "blocks"
    assert blocks.model.weight_bytes < 0.35 * dense.model.weight_bytes
    ids = np.asarray(blocks.tokenizer.encode("The secret number of Ada is 4417302. It was a dark and stormy night"))
    np.testing.assert_array_equal(forward_logits(blocks, ids[None]), forward_logits(dense, ids[None]))
    from rsqr_jax.kernels import block_matvec

    auto = "tiled" if block_matvec.available() else "blocks"
    assert dataclasses.replace(load_model(smollm2_path), _tokenizer=None).weight_format == auto
