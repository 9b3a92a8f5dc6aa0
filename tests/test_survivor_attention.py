"""pallas_kernels.survivor_attention: the Pallas kernel (interpret mode on CPU) against the pure-jnp
reference and against an independent float64 numpy implementation of DESIGN.md section 6."""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import survivor_attention, survivor_attention_reference
from pallas_kernels.survivor_attention import _angle_input, _survivor_attention_parts, survivor_attention_xla


def llama_inv_freq(D, base=10000.0):
    return (1.0 / base ** (np.arange(0, D, 2, dtype=np.float64) / D)).astype(np.float32)


# ---------------------------------------------------------------------------------------------------
# Independent float64 oracle of the contract (numpy only; angles pos * inv_freq in float64).
# ---------------------------------------------------------------------------------------------------
def _rot64(x, pos, inv_freq):
    """R_pos x in float64, half-split layout. x [..., D], pos broadcastable to x[..., 0]."""
    ang = np.asarray(pos, np.float64)[..., None] * inv_freq.astype(np.float64)
    c, s = np.cos(ang), np.sin(ang)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def oracle64(q, win_k, win_v, win_pos, surv_k_raw, surv_v, surv_pos, surv_valid, q_pos_win, q_pos_surv,
             inv_freq, scale=None):
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    q, win_k, win_v, surv_k_raw, surv_v = map(f, (q, win_k, win_v, surv_k_raw, surv_v))
    B, C, Hq, D = q.shape
    Hkv, W, S = win_k.shape[1], win_k.shape[2], surv_k_raw.shape[2]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    out = np.zeros((B, C, Hq, D))
    for b in range(B):
        ks = _rot64(surv_k_raw[b], np.asarray(surv_pos)[b][None, :], inv_freq)  # [Hkv, S, D]
        for c in range(C):
            for h in range(Hq):
                kv = h // G
                qw = _rot64(q[b, c, h], q_pos_win[b, c], inv_freq)
                qs = _rot64(q[b, c, h], q_pos_surv[b, c], inv_freq)
                scores = np.concatenate([win_k[b, kv] @ qw, ks[kv] @ qs]) * scale
                wp = np.asarray(win_pos)[b]
                vis = np.concatenate([(wp >= 0) & (wp <= q_pos_win[b, c]), np.asarray(surv_valid)[b]])
                if not vis.any():
                    continue
                e = np.where(vis, np.exp(scores - scores[vis].max()), 0.0)
                vals = np.concatenate([win_v[b, kv], surv_v[b, kv]])
                out[b, c, h] = (e @ vals) / e.sum()
    return out


# ---------------------------------------------------------------------------------------------------
# Random but sensible inputs.
# ---------------------------------------------------------------------------------------------------
def make_inputs(seed, *, B, C, Hq, Hkv, D, W, S, dtype, t0=None, empty_window=0, all_window_empty=False,
                surv_invalid_frac=0.2):
    """Window = ring buffer of a contiguous run of global positions ending at the chunk's last query,
    permuted; a chunk's own tokens sit in the window (causal masking inside the chunk). Survivors:
    small logical positions, some invalid. Window keys are rotated in float64 at their positions."""
    rng = np.random.default_rng(seed)
    inv = llama_inv_freq(D)
    t0 = int(rng.integers(10**5, 10**6)) if t0 is None else t0  # global position of the first query
    last = t0 + C - 1
    win_pos = np.stack([rng.permutation(np.arange(last - W + 1, last + 1)) for _ in range(B)]).astype(np.int32)
    if empty_window:
        for b in range(B):
            win_pos[b, rng.choice(W, size=min(empty_window, W), replace=False)] = -1
    if all_window_empty:
        win_pos[:] = -1
    n_sink = 4
    surv_pos = np.tile(np.arange(S, dtype=np.int32), (B, 1))
    surv_valid = rng.random((B, S)) >= surv_invalid_frac
    k_raw = rng.standard_normal((B, Hkv, W, D))
    win_k = _rot64(k_raw, np.maximum(win_pos, 0)[:, None, :], inv)
    n_cached = n_sink + S
    # the query's logical position for the survivor segment: (#sinks + #survivors) + (t - w0)
    w0 = last - W + 1
    q_pos_win = np.tile(np.arange(t0, t0 + C, dtype=np.int32), (B, 1))
    q_pos_surv = (n_cached + (q_pos_win - w0)).astype(np.int32)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return dict(
        q=cast(rng.standard_normal((B, C, Hq, D))),
        win_k=cast(win_k),
        win_v=cast(rng.standard_normal((B, Hkv, W, D))),
        win_pos=jnp.asarray(win_pos),
        surv_k_raw=cast(rng.standard_normal((B, Hkv, S, D))),
        surv_v=cast(rng.standard_normal((B, Hkv, S, D))),
        surv_pos=jnp.asarray(surv_pos),
        surv_valid=jnp.asarray(surv_valid),
        q_pos_win=jnp.asarray(q_pos_win),
        q_pos_surv=jnp.asarray(q_pos_surv),
    ), inv


ORDER = ("q", "win_k", "win_v", "win_pos", "surv_k_raw", "surv_v", "surv_pos", "surv_valid", "q_pos_win",
         "q_pos_surv")


def args_of(inp):
    return tuple(inp[k] for k in ORDER)


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-30))


@functools.lru_cache(maxsize=None)
def _jit_reference(inv_bytes, D):
    inv = np.frombuffer(inv_bytes, np.float32)  # concrete constant -> exact angles in the reference
    return jax.jit(lambda *a: survivor_attention_reference(*a, inv))


def reference(inp, inv):
    return _jit_reference(inv.tobytes(), inv.size)(*args_of(inp))


def xla_path(inp, inv):
    return jax.jit(lambda *a: survivor_attention_xla(*a, inv))(*args_of(inp))


# name: (B, C, Hq, Hkv, D, W, S, dtype, extra make_inputs kwargs, kernel kwargs)
CASES = {
    "decode_smollm_gqa": (2, 1, 9, 3, 64, 40, 23, jnp.float32, {"empty_window": 3}, dict(block_k=16, num_splits=2)),
    "decode_mha_d128": (1, 1, 2, 2, 128, 37, 19, jnp.float32, {}, dict(block_k=16, num_splits=3)),
    "chunk_causal": (1, 5, 3, 1, 128, 37, 11, jnp.float32, {}, dict(block_k=16, num_splits=2,
                                                                    skip_empty_blocks=False)),
    "chunk_two_row_blocks": (1, 8, 6, 2, 64, 45, 9, jnp.float32, {"empty_window": 5}, dict(block_k=16, block_q=16)),
    "no_survivors": (2, 1, 3, 1, 64, 29, 0, jnp.float32, {}, dict(block_k=16, num_splits=2)),
    "window_of_one": (1, 1, 3, 3, 64, 1, 21, jnp.float32, {}, dict(block_k=16)),
    "window_empty": (1, 2, 9, 3, 64, 24, 18, jnp.float32, {"all_window_empty": True},
                     dict(block_k=16, skip_empty_blocks=False)),
    "nothing_visible": (1, 1, 3, 1, 64, 17, 5, jnp.float32,
                        {"all_window_empty": True, "surv_invalid_frac": 1.1}, dict(block_k=16)),
    "default_blocks": (1, 1, 9, 3, 64, 300, 130, jnp.float32, {"empty_window": 40}, {}),
    "bf16_decode": (2, 1, 9, 3, 64, 50, 30, jnp.bfloat16, {"empty_window": 2}, dict(block_k=16, num_splits=2)),
    "bf16_chunk_d128": (1, 4, 3, 1, 128, 33, 20, jnp.bfloat16, {}, dict(block_k=16, num_splits=2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_and_float64(name):
    B, C, Hq, Hkv, D, W, S, dtype, extra, kw = CASES[name]
    inp, inv = make_inputs(zlib.crc32(name.encode()), B=B, C=C, Hq=Hq, Hkv=Hkv, D=D, W=W, S=S, dtype=dtype,
                           **extra)
    out = survivor_attention(*args_of(inp), inv, interpret=True, **kw)
    assert out.shape == (B, C, Hq, D) and out.dtype == dtype
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    ref = np.asarray(reference(inp, inv), np.float64)
    xla = np.asarray(xla_path(inp, inv), np.float64)
    o64 = oracle64(*args_of(inp), inv)
    if name == "nothing_visible":
        assert (out == 0).all() and (ref == 0).all() and (xla == 0).all()
        return
    if dtype == jnp.float32:
        assert rel_err(out, o64) < 1e-4, rel_err(out, o64)
        assert rel_err(ref, o64) < 1e-4, rel_err(ref, o64)
        assert rel_err(xla, o64) < 1e-4, rel_err(xla, o64)
        assert rel_err(out, ref) < 1e-5
    else:  # bfloat16 operands: rotated q / keys and probabilities rounded to bf16 in the kernel
        assert rel_err(out, ref) < 2e-2, rel_err(out, ref)
        assert rel_err(out, o64) < 2e-2, rel_err(out, o64)
        assert rel_err(xla, ref) < 8e-3, rel_err(xla, ref)  # both float32 inside: differ by output rounding
    # rows that see nothing (fully empty window and no valid survivor) return exact zeros
    if extra.get("all_window_empty") and S:
        no_surv = ~np.asarray(inp["surv_valid"]).any(-1)
        assert (out[no_surv] == 0).all()


def test_every_output_element_written():
    """Interpret mode fills pallas outputs with NaN before the kernel runs (checked first), so finite
    per-split (o, m, l) everywhere, padded rows and empty splits included, prove each was written."""

    def writes_nothing(x_ref, o_ref):
        del x_ref, o_ref

    poisoned = pl.pallas_call(writes_nothing, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                              interpret=True)(jnp.zeros((16,), jnp.float32))
    assert np.isnan(np.asarray(poisoned)).all()

    inp, inv = make_inputs(7, B=1, C=3, Hq=9, Hkv=3, D=64, W=21, S=5, dtype=jnp.float32, empty_window=4)
    freq, exact = _angle_input(inv, None)
    o, m, l = _survivor_attention_parts(*args_of(inp), freq, scale=64**-0.5, interpret=True, block_k=16,
                                        block_q=16, num_splits=4, exact=exact, num_warps=None, num_stages=2)
    assert o.shape[2] == 4  # 4 splits, of which some see no key block at all
    for x in (o, m, l):
        assert np.isfinite(np.asarray(x)).all()


def test_vmap_over_policy_axis():
    P, B, C, Hq, Hkv, D, W, S = 3, 1, 2, 9, 3, 64, 20, 12
    per = [make_inputs(100 + p, B=B, C=C, Hq=Hq, Hkv=Hkv, D=D, W=W, S=S, dtype=jnp.float32, t0=5000,
                       empty_window=p)[0] for p in range(P)]
    inv = llama_inv_freq(D)
    stacked = {k: jnp.stack([d[k] for d in per]) for k in ORDER}
    f = jax.vmap(lambda *a: survivor_attention(*a, inv, interpret=True, block_k=16, num_splits=2))
    out = np.asarray(f(*args_of(stacked)))
    for p in range(P):
        assert rel_err(out[p], oracle64(*args_of(per[p]), inv)) < 1e-4
        assert rel_err(out[p], reference(per[p], inv)) < 1e-5


def test_traced_inv_freq_falls_back_to_float32_angles():
    """Under jit with inv_freq as an argument the kernel uses float32 pos * inv_freq, like the
    reference; survivors' logical positions are small, global window positions are moderate here."""
    inp, inv = make_inputs(11, B=1, C=1, Hq=3, Hkv=1, D=64, W=19, S=9, dtype=jnp.float32, t0=3000)
    f = jax.jit(lambda inv_, *a: survivor_attention(*a, inv_, interpret=True, block_k=16))
    g = jax.jit(lambda inv_, *a: survivor_attention_reference(*a, inv_))
    out = f(jnp.asarray(inv), *args_of(inp))
    ref = g(jnp.asarray(inv), *args_of(inp))
    assert rel_err(out, ref) < 1e-5
    assert rel_err(out, oracle64(*args_of(inp), inv)) < 1e-3
    with pytest.raises(ValueError):
        jax.jit(lambda inv_, *a: survivor_attention(*a, inv_, interpret=True, exact_angles=True))(
            jnp.asarray(inv), *args_of(inp))


def test_all_keys_in_raw_segment():
    """streamingllm through the contract: no window at all (W = 0), every key raw at its rank."""
    inp, inv = make_inputs(21, B=1, C=1, Hq=9, Hkv=3, D=64, W=0, S=40, dtype=jnp.float32, surv_invalid_frac=0.0)
    out = survivor_attention(*args_of(inp), inv, interpret=True, block_k=16)
    o64 = oracle64(*args_of(inp), inv)
    assert rel_err(out, o64) < 1e-4
    assert rel_err(xla_path(inp, inv), o64) < 1e-4


@pytest.mark.parametrize("dtype,C,S,exact", [(jnp.bfloat16, 1, 130, None), (jnp.float32, 4, 0, None),
                                             (jnp.bfloat16, 2, 40, False)])
def test_lowers_to_pallas_triton(dtype, C, S, exact):
    """Cross-lower for CUDA on this CPU machine: proves the kernel body passes the Pallas Triton lowering
    (power-of-two shapes, dot sizes, uint32 angle reduction, cond/fori_loop). Compiling the Triton IR
    to PTX and running it needs a GPU (scripts/gpu_check.sh)."""
    from jax import export

    inp, inv = make_inputs(3, B=2, C=C, Hq=9, Hkv=3, D=64, W=1000, S=S, dtype=dtype)
    f = jax.jit(lambda *a: survivor_attention(*a, inv, interpret=False, exact_angles=exact))
    exp = export.export(f, platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        *args_of(inp))
    assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 1
