"""rsqr_jax.kernels.survivor_attention: the Pallas kernel (interpret mode on CPU) against the pure-jnp
reference and against the independent float64 numpy implementation of docs/design.md §6
(rsqr_lab.testing.kernel.oracle_f64, on its seeded inputs kernel_inputs)."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from rsqr_jax.kernels.store import RawSegment
from rsqr_jax.kernels import survivor_attention
from rsqr_jax.kernels import survivor_attention_reference
from rsqr_jax.kernels.survivor_attention import (_angle_input, _survivor_attention_parts, rotation_table,
                                               survivor_attention_xla)
from rsqr_lab.testing.kernel import (KERNEL_ARGS, args_of, kernel_inputs, oracle_f64, rel_err, rope_inv_freq,
                                     rope_f64)


def reference(inp, inv):
    return jax.jit(lambda *a: survivor_attention_reference(*a, inv))(*args_of(inp))  # inv concrete: exact angles


def xla_path(inp, inv):
    return jax.jit(lambda *a: survivor_attention_xla(*a, inv))(*args_of(inp))


# name: (B, C, Hq, Hkv, D, W, S, dtype, extra kernel_inputs kwargs, kernel kwargs)
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
    inp, inv = kernel_inputs(zlib.crc32(name.encode()), B=B, C=C, Hq=Hq, Hkv=Hkv, D=D, W=W, S=S, dtype=dtype,
                           **extra)
    out = survivor_attention(*args_of(inp), inv, interpret=True, **kw)
    assert out.shape == (B, C, Hq, D) and out.dtype == dtype
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    ref = np.asarray(reference(inp, inv), np.float64)
    xla = np.asarray(xla_path(inp, inv), np.float64)
    o64 = oracle_f64(*args_of(inp), inv)
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

    inp, inv = kernel_inputs(7, B=1, C=3, Hq=9, Hkv=3, D=64, W=21, S=5, dtype=jnp.float32, empty_window=4)
    freq, exact = _angle_input(inv, None)
    table = rotation_table(inv, 21 + 5, exact)
    o, m, l = _survivor_attention_parts(*args_of(inp), freq, table, scale=64**-0.5, interpret=True, block_k=16,
                                        block_s=16, block_q=16, num_splits=4, exact=exact, num_warps=4,
                                        num_stages=2)
    assert o.shape[2] == 4  # 4 splits, of which some see no key block at all
    for x in (o, m, l):
        assert np.isfinite(np.asarray(x)).all()


def test_vmap_over_policy_axis():
    P, B, C, Hq, Hkv, D, W, S = 3, 1, 2, 9, 3, 64, 20, 12
    per = [kernel_inputs(100 + p, B=B, C=C, Hq=Hq, Hkv=Hkv, D=D, W=W, S=S, dtype=jnp.float32, t0=5000,
                       empty_window=p)[0] for p in range(P)]
    inv = rope_inv_freq(D)
    stacked = {k: jnp.stack([d[k] for d in per]) for k in KERNEL_ARGS}
    f = jax.vmap(lambda *a: survivor_attention(*a, inv, interpret=True, block_k=16, num_splits=2))
    out = np.asarray(f(*args_of(stacked)))
    for p in range(P):
        assert rel_err(out[p], oracle_f64(*args_of(per[p]), inv)) < 1e-4
        assert rel_err(out[p], reference(per[p], inv)) < 1e-5


def test_traced_inv_freq_falls_back_to_float32_angles():
    """Under jit with inv_freq as an argument the kernel uses float32 pos * inv_freq, like the
    reference; survivors' logical positions are small, global window positions are moderate here."""
    inp, inv = kernel_inputs(11, B=1, C=1, Hq=3, Hkv=1, D=64, W=19, S=9, dtype=jnp.float32, t0=3000)
    f = jax.jit(lambda inv_, *a: survivor_attention(*a, inv_, interpret=True, block_k=16))
    g = jax.jit(lambda inv_, *a: survivor_attention_reference(*a, inv_))
    out = f(jnp.asarray(inv), *args_of(inp))
    ref = g(jnp.asarray(inv), *args_of(inp))
    assert rel_err(out, ref) < 1e-5
    assert rel_err(out, oracle_f64(*args_of(inp), inv)) < 1e-3
    with pytest.raises(ValueError):
        jax.jit(lambda inv_, *a: survivor_attention(*a, inv_, interpret=True, exact_angles=True))(
            jnp.asarray(inv), *args_of(inp))


def test_all_keys_in_raw_segment():
    """streamingllm through the contract: no window at all (W = 0), every key raw at its rank."""
    inp, inv = kernel_inputs(21, B=1, C=1, Hq=9, Hkv=3, D=64, W=0, S=40, dtype=jnp.float32, surv_invalid_frac=0.0)
    out = survivor_attention(*args_of(inp), inv, interpret=True, block_k=16)
    o64 = oracle_f64(*args_of(inp), inv)
    assert rel_err(out, o64) < 1e-4
    assert rel_err(xla_path(inp, inv), o64) < 1e-4


@pytest.mark.parametrize("dtype,C,S,exact", [(jnp.bfloat16, 1, 130, None), (jnp.float32, 4, 0, None),
                                             (jnp.bfloat16, 2, 40, False)])
def test_lowers_to_pallas_triton(dtype, C, S, exact):
    """Cross-lower for CUDA on this CPU machine: proves the kernel body passes the Pallas Triton lowering
    (power-of-two shapes, dot sizes, uint32 angle reduction, cond/fori_loop). jax >= 0.11 lowers Pallas
    Triton without a GPU only for an abstract GPU device, hence the H200 abstract mesh (a no-op for the
    lowering on jax 0.10, which assumes sm_90); scripts/gpu_compile_check.sh runs this test under jax
    0.11.2 and compiles the IR to sm_90a; running it needs a GPU (scripts/gpu_check.sh)."""
    from jax import export

    from rsqr_lab.devtools.compile_report import h200_lowering

    inp, inv = kernel_inputs(3, B=2, C=C, Hq=9, Hkv=3, D=64, W=1000, S=S, dtype=dtype)
    f = jax.jit(lambda *a: survivor_attention(*a, inv, interpret=False, exact_angles=exact))
    with h200_lowering():
        exp = export.export(f, platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            *args_of(inp))
    assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 1


def test_oracle_by_hand_gqa_and_masks():
    """oracle_f64 on one decode row, written out per head: query head h reads KV head h // G, window slots
    are visible iff 0 <= pos <= q_pos_win, invalid survivors are not, survivors rotate at surv_rot_pos."""
    inp, inv = kernel_inputs(5, B=1, C=1, Hq=6, Hkv=2, D=16, W=7, S=5, dtype=jnp.float32, empty_window=2)
    a = {k: np.asarray(v) for k, v in inp.items()}
    got = oracle_f64(*args_of(inp), inv)
    for h in range(6):
        kv = h // 3
        qw = rope_f64(a["q"][0, 0, h], a["q_pos_win"][0, 0], inv)
        qs = rope_f64(a["q"][0, 0, h], a["q_pos_surv"][0, 0], inv)
        surv = [rope_f64(k, p, inv) for k, p in zip(a["surv_k"][0, kv], a["surv_rot_pos"][0])]
        keys = list(a["win_k"][0, kv]) + surv
        vals = list(a["win_v"][0, kv]) + list(a["surv_v"][0, kv])
        vis = [0 <= p <= a["q_pos_win"][0, 0] for p in a["win_pos"][0]] + list(a["surv_valid"][0])
        scores = [np.dot(k, qw if i < 7 else qs) / 4.0 for i, k in enumerate(keys)]
        w = np.array([np.exp(s) if v else 0.0 for s, v in zip(scores, vis)])
        np.testing.assert_allclose(got[0, 0, h], w @ np.array(vals, np.float64) / w.sum(), rtol=1e-10)
    assert (a["win_pos"] == -1).sum() == 2 and list(a["surv_rot_pos"][0]) == [0, 1, 2, 3, 4]


def test_rotation_table_is_exact_and_out_of_table_ranks_are_loud():
    """The survivor rotations come from a float32 table over [0, W + S) built from float64 angles: within
    float32 rounding of cos/sin at every rank (the integer reduction it replaces erred ~5e-7 rad). A rank
    outside the table is a contract violation: NaN, never a silently wrong rotation; an invalid slot's
    rank does not matter. The XLA path here runs in several cache blocks plus a tail (block_bytes)."""
    inv = rope_inv_freq(64, 1e5)
    n = 3000
    table = rotation_table(inv, n, exact=True)
    ang = np.arange(n)[:, None] * inv.astype(np.float64)
    assert np.abs(table - np.concatenate([np.cos(ang), np.sin(ang)], 1)).max() < 6e-8
    inp, inv = kernel_inputs(31, B=2, C=1, Hq=9, Hkv=3, D=64, W=24, S=40, dtype=jnp.float32)
    xla_blocks = jax.jit(lambda *a: survivor_attention_xla(*a, inv, block_bytes=2 * 3 * 64 * 4 * 16,
                                                           whole_segment_bytes=0))
    assert rel_err(xla_blocks(*args_of(inp)), oracle_f64(*args_of(inp), inv)) < 1e-4  # 16-key blocks: 2 + a tail of 8
    valid = np.asarray(inp["surv_valid"])
    pos = np.asarray(inp["surv_rot_pos"]).copy()
    pos[~valid] = 10**6  # invalid slots: any rank
    pos[0, np.flatnonzero(valid[0])[0]] = 24 + 40  # one valid rank just past the table, batch row 0 only
    bad = dict(inp, surv_rot_pos=jnp.asarray(pos))
    for out in (xla_blocks(*args_of(bad)), survivor_attention(*args_of(bad), inv, interpret=True, num_splits=1)):
        out = np.asarray(out)
        assert np.isnan(out[0]).all() and rel_err(out[1], oracle_f64(*args_of(bad), inv)[1]) < 1e-4
    wide = jax.jit(lambda *a: survivor_attention_xla(*a, inv, rank_limit=24 + 41))(*args_of(bad))  # covers it
    assert rel_err(wide, oracle_f64(*args_of(bad), inv)) < 1e-4


def test_splits_fill_the_gpu_and_share_both_segments():
    """default_num_splits: SMs x programs per SM over the grid's programs, >= 2 key blocks per split; the
    block list (window blocks, then survivor blocks) is cut evenly, so with 2 + 2 blocks and 4 splits every
    split holds exactly one block and sees keys (l > 0 on the real rows)."""
    from rsqr_jax.kernels.survivor_attention import default_num_splits

    assert default_num_splits(programs=24, n_blocks=1000, num_warps=4, sms=132) == 22  # 132 * 4 / 24
    assert default_num_splits(programs=24, n_blocks=10, num_warps=4, sms=132) == 5
    assert default_num_splits(programs=10**4, n_blocks=10, num_warps=8, sms=132) == 1
    inp, inv = kernel_inputs(41, B=1, C=1, Hq=3, Hkv=1, D=64, W=32, S=32, dtype=jnp.float32, surv_invalid_frac=0.0)
    freq, exact = _angle_input(inv, None)
    o, m, l = _survivor_attention_parts(*args_of(inp), freq, rotation_table(inv, 64, exact), scale=64**-0.5,
                                        interpret=True, block_k=16, block_s=16, block_q=16, num_splits=4,
                                        exact=exact, num_warps=4, num_stages=2)
    assert (np.asarray(l)[0, 0, :, :3] > 0).all()


@pytest.mark.parametrize("C,R", [(1, 24), (3, 16)])
def test_xla_raw_tail_is_the_survivor_segment_with_it_appended(C, R):
    """survivor_attention_xla's raw_tail (the recall tier's tokens, attended as a partial softmax of their own) against
    the reference over the survivor segment with the tail appended; a tail with no valid slot changes no bit."""
    S = 20
    inp, inv = kernel_inputs(31 + C, B=2, C=C, Hq=9, Hkv=3, D=64, W=33, S=S + R, dtype=jnp.float32, empty_window=2)
    head, tail = dict(inp), {}
    for k in ("surv_k", "surv_v"):
        head[k], tail[k] = inp[k][:, :, :S], inp[k][:, :, S:]
    for k in ("surv_rot_pos", "surv_valid"):
        head[k], tail[k] = inp[k][:, :S], inp[k][:, S:]
    raw_tail = (tail["surv_k"], tail["surv_v"], tail["surv_rot_pos"], tail["surv_valid"])
    assert np.asarray(tail["surv_valid"]).any()
    got = jax.jit(lambda *a: survivor_attention_xla(*a[:-4], inv, raw_tail=RawSegment(*a[-4:])))(*args_of(head), *raw_tail)
    assert rel_err(got, reference(inp, inv)) < 1e-5
    assert rel_err(got, oracle_f64(*args_of(inp), inv)) < 1e-4
    masked = raw_tail[:3] + (jnp.zeros_like(raw_tail[3]),)
    # (the head's ranks reach past W + S: the table of the call with the tail)
    alone = jax.jit(lambda *a: survivor_attention_xla(*a, inv, rank_limit=33 + S + R))(*args_of(head))
    with_masked = jax.jit(lambda *a: survivor_attention_xla(*a[:-4], inv, raw_tail=RawSegment(*a[-4:])))(
        *args_of(head), *masked)
    np.testing.assert_array_equal(np.asarray(with_masked), np.asarray(alone))
