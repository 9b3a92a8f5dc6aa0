"""Two-segment survivor attention (DESIGN.md section 6): the contract, its pure-jnp reference, and the kernel.

    out = survivor_attention(q, win_k, win_v, win_pos, surv_k_raw, surv_v, surv_pos, surv_valid,
                             q_pos_win, q_pos_surv, inv_freq, *, scale=None, interpret=None)

* q [B, C, Hq, D] raw queries; Hq = G * Hkv (GQA).
* win_k / win_v [B, Hkv, W, D]: window keys already rotated at their positions; win_pos [B, W] int32
  (-1 = empty). Query c sees slot w iff 0 <= win_pos[w] <= q_pos_win[c] (causal inside a chunk).
* surv_k_raw / surv_v [B, Hkv, S, D]: raw survivor keys, rotated here at surv_pos [B, S] int32;
  surv_valid [B, S] bool. Position 0 is the exact identity, so pre-rotated keys can use this
  segment too (that is how leave_gaps / rerotate / rsqr_precompute reuse it).
* q_pos_win / q_pos_surv [B, C] int32: where the query is rotated for each segment (relocation).
* inv_freq [D/2] float32. Angles are reduced exactly (pallas_kernels.rope) when it is concrete.
* Returns [B, C, Hq, D] in q's dtype; scale defaults to D ** -0.5. A row with no visible key
  (both segments empty) returns zeros, never NaN.

Three implementations of it live here: `survivor_attention_reference` (pure jnp, simple: the
semantics), `survivor_attention` (the Pallas kernel: compiled on GPU, interpreted on CPU) and
`survivor_attention_xla` (plain XLA tuned for CPU). docs/kernel.md describes the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.rope import (
    _is_concrete,
    _mulhi_u32,
    angles_from_words,
    rope_cos_sin,
    rotate_half_split,
    turn_words,
)

# Finite mask value (as in jax.experimental.pallas.ops): -inf would turn fully masked rows into NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def survivor_attention_reference(
    q, win_k, win_v, win_pos, surv_k_raw, surv_v, surv_pos, surv_valid, q_pos_win, q_pos_surv, inv_freq,
    *, scale=None,
):
    """Pure-jnp reference of the contract above (float32 math, one softmax over both segments)."""
    B, C, Hq, D = q.shape
    Hkv = win_k.shape[1]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    hp = jax.lax.Precision.HIGHEST

    q_BxCxKxGxD = q.astype(jnp.float32).reshape(B, C, Hkv, G, D)
    cos_w, sin_w = rope_cos_sin(q_pos_win, inv_freq)  # [B, C, D/2]
    cos_s, sin_s = rope_cos_sin(q_pos_surv, inv_freq)
    qw = rotate_half_split(q_BxCxKxGxD, cos_w[:, :, None, None], sin_w[:, :, None, None])
    qs = rotate_half_split(q_BxCxKxGxD, cos_s[:, :, None, None], sin_s[:, :, None, None])
    cos_k, sin_k = rope_cos_sin(surv_pos, inv_freq)  # [B, S, D/2]
    ks = rotate_half_split(surv_k_raw, cos_k[:, None], sin_k[:, None])  # [B, Hkv, S, D] float32

    s_win = jnp.einsum("bckgd,bkwd->bkgcw", qw, win_k.astype(jnp.float32), precision=hp) * scale
    s_surv = jnp.einsum("bckgd,bksd->bkgcs", qs, ks, precision=hp) * scale
    m_win = (win_pos[:, None, :] >= 0) & (win_pos[:, None, :] <= q_pos_win[:, :, None])  # [B, C, W]
    m_surv = jnp.broadcast_to(surv_valid[:, None, :], (B, C, surv_valid.shape[-1]))  # [B, C, S]

    scores = jnp.concatenate([s_win, s_surv], axis=-1)
    mask = jnp.concatenate([m_win, m_surv], axis=-1)[:, None, None]  # [B, 1, 1, C, W+S]
    scores = jnp.where(mask, scores, MASK_VALUE)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(scores - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    W = win_k.shape[2]
    o = jnp.einsum("bkgcw,bkwd->bckgd", p[..., :W], win_v.astype(jnp.float32), precision=hp)
    o = o + jnp.einsum("bkgcs,bksd->bckgd", p[..., W:], surv_v.astype(jnp.float32), precision=hp)
    denom_BxCxKxG = jnp.moveaxis(denom[..., 0], -1, 1)[..., None]
    o = o / jnp.where(denom_BxCxKxG > 0, denom_BxCxKxG, 1.0)
    return o.reshape(B, C, Hq, D).astype(q.dtype)


# ----------------------------------------------------------------------------------------------------
# The Pallas kernel.
#
# Structure (flash-decoding, one program per (batch, kv head, query-row block, key split)):
#   * The wrapper rotates the queries (they are tiny: [B, C, Hq, D]) twice in float32 - at q_pos_win
#     for the window and at q_pos_surv for the survivors - with exact angles, regroups them so that
#     the G query heads of one KV head and all C chunk positions form one row block (row = c*G + g),
#     and pads that block to a power of two >= 16 rows.
#   * Each program walks its share of the window blocks, then its share of the survivor blocks, with
#     one online softmax (m, l, o) over both segments. Survivor keys are rotated from raw inside the
#     kernel, per key tile, at surv_pos: angles by exact integer turn reduction (rope.angles_from_words
#     on two uint32 word rows passed in as a [2, D/2] input) and the score as two half-width dots
#     s = q1 . k1' + q2 . k2'  with  k1' = k1 cos - k2 sin,  k2' = k2 cos + k1 sin,
#     the halves read with separate ref slices (no value slicing or concatenation in the kernel).
#   * A key block none of whose keys is visible to any row of the program is skipped by lax.cond
#     (its K/V are not even loaded): empty window capacity, invalid survivor slots, and window blocks in
#     the causal future of a chunk cost only their positions (skip_empty_blocks=True, the default;
#     False keeps the loop body branch-free for Triton's software pipelining - to be measured on GPU).
#   * Each split writes unnormalised (o, m, l); the wrapper merges the splits by log-sum-exp.
#
# Lowering constraints that shaped it (Pallas Triton backend):
#   * every loaded/stored array must have a power-of-two size -> row blocks padded to a power of two,
#     key blocks are powers of two, D must be a power of two (64, 128);
#   * tl.dot needs M, N, K >= 16 -> at least 16 query rows, key blocks >= 16, D/2 >= 16;
#   * no value slicing / concatenation inside the kernel -> the two rotation halves are separate ref
#     loads (pl.ds on the last axis) and two dots;
#   * -inf arithmetic makes fully masked rows NaN -> finite MASK_VALUE plus explicit zeroing of masked
#     probabilities (a fully masked row keeps l = 0 and o = 0);
#   * only the kernel body is traced for the device, so it uses ref indexing, pl.ds, jnp,
#     lax.fori_loop (dynamic bounds), lax.cond and jnp.where only - nothing backend-specific. The
#     backend-specific knobs live in `_compiler_params` alone.
#   * segments enter as whole-array blocks and the kernel indexes tiles itself, so W and S need only be
#     multiples of the key block (they are padded in the wrapper otherwise, which costs a copy of that
#     segment: capacities above block_k that are multiples of block_k / 4 - 32 by default - are used
#     in place, see _key_block).
# Dots run in the KV storage dtype (bfloat16 K/V -> bfloat16 operands, rotated survivor keys rounded
# to bfloat16 once after their float32 rotation, float32 accumulation; float32 K/V -> float32 operands
# at HIGHEST precision, IEEE on Triton).
# ----------------------------------------------------------------------------------------------------

_MIN_BLOCK = 16  # Triton: dot operands need every dimension >= 16


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _key_block(n: int, block_k: int) -> tuple[int, int]:
    """(block, padded length) for a key segment of length n (n = 0 gets one empty block).

    Prefers a power-of-two block in [max(16, block_k / 4), block_k] that divides n (no pad copy);
    otherwise pads n up to a multiple of block_k (or of the next power of two when n < block_k).
    """
    if n <= block_k:
        bk = max(_MIN_BLOCK, _next_pow2(max(n, 1)))
        return bk, bk
    bk = block_k
    while bk >= max(_MIN_BLOCK, block_k // 4):
        if n % bk == 0:
            return bk, n
        bk //= 2
    return block_k, _round_up(n, block_k)


def _default_num_splits(programs: int, n_blocks: int) -> int:
    """Enough splits to give a GPU ~256 programs, never more splits than key blocks."""
    want = _next_pow2(max(1, -(-256 // max(programs, 1))))
    return max(1, min(want, 64, n_blocks))


def _compiler_params(interpret: bool, num_warps: int | None, num_stages: int | None):
    """All backend-specific knobs live here (Pallas Triton on GPU; nothing when interpreting)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=4 if num_warps is None else num_warps, num_stages=num_stages)


def _survivor_attention_kernel(
    qw_ref, qs_ref, qpos_ref,  # [R, D], [R, D] rotated queries (compute dtype), [R] int32 window pos
    wk_ref, wv_ref, wpos_ref,  # [Wp, D], [Wp, D], [Wp] int32
    sk_ref, sv_ref, spos_ref, svalid_ref,  # [Sp, D] raw, [Sp, D], [Sp] int32, [Sp] int32 (0/1)
    freq_ref,  # [2, D/2] uint32 turn words (exact) or [1, D/2] float32 inv_freq
    o_ref, m_ref, l_ref,  # [R, D] float32 (unnormalised), [R], [R] float32
    *, scale, block_w, block_s, n_blocks_w, n_blocks_s, per_split_w, per_split_s, exact, precision, skip_empty,
):
    R, D = qw_ref.shape
    F = D // 2
    split = pl.program_id(3)
    f32 = jnp.float32

    def dot_nt(a, b):  # a [M, K] . b [N, K]^T -> [M, N] float32
        return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=f32)

    def update(carry, s, mask, v):
        o, m, l = carry
        s = jnp.where(mask, s, MASK_VALUE)
        m_next = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_next)
        p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
        l_next = corr * l + jnp.sum(p, axis=1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=f32)
        return corr[:, None] * o + pv, m_next, l_next

    qpos = qpos_ref[...]  # [R]
    qpos_max = jnp.max(qpos)
    qw = qw_ref[...]

    def window_block(i, carry):
        start = i * block_w
        wpos = wpos_ref[pl.ds(start, block_w)]  # [bw]
        live = (wpos >= 0) & (wpos <= qpos_max)

        def compute(carry):
            k = wk_ref[pl.ds(start, block_w), :]
            v = wv_ref[pl.ds(start, block_w), :]
            mask = (wpos[None, :] >= 0) & (wpos[None, :] <= qpos[:, None])
            return update(carry, dot_nt(qw, k) * scale, mask, v)

        if not skip_empty:
            return compute(carry)
        return lax.cond(jnp.max(live.astype(jnp.int32)) > 0, compute, lambda c: c, carry)

    q1 = qs_ref[:, pl.ds(0, F)]
    q2 = qs_ref[:, pl.ds(F, F)]
    dot_dtype = q1.dtype

    def survivor_block(i, carry):
        start = i * block_s
        valid = svalid_ref[pl.ds(start, block_s)] != 0  # [bs]

        def compute(carry):
            pos = spos_ref[pl.ds(start, block_s)]
            if exact:
                ang = angles_from_words(pos, freq_ref[0, :], freq_ref[1, :])  # [bs, F]
            else:
                ang = pos.astype(f32)[:, None] * freq_ref[0, :][None, :]
            cos, sin = jnp.cos(ang), jnp.sin(ang)
            k1 = sk_ref[pl.ds(start, block_s), pl.ds(0, F)].astype(f32)
            k2 = sk_ref[pl.ds(start, block_s), pl.ds(F, F)].astype(f32)
            k1r = (k1 * cos - k2 * sin).astype(dot_dtype)
            k2r = (k2 * cos + k1 * sin).astype(dot_dtype)
            s = (dot_nt(q1, k1r) + dot_nt(q2, k2r)) * scale
            v = sv_ref[pl.ds(start, block_s), :]
            mask = jnp.broadcast_to(valid[None, :], s.shape)
            return update(carry, s, mask, v)

        if not skip_empty:
            return compute(carry)
        return lax.cond(jnp.max(valid.astype(jnp.int32)) > 0, compute, lambda c: c, carry)

    carry = (jnp.zeros((R, D), f32), jnp.full((R,), MASK_VALUE, f32), jnp.zeros((R,), f32))
    lo_w = split * per_split_w
    carry = lax.fori_loop(lo_w, jnp.minimum(lo_w + per_split_w, n_blocks_w), window_block, carry)
    lo_s = split * per_split_s
    carry = lax.fori_loop(lo_s, jnp.minimum(lo_s + per_split_s, n_blocks_s), survivor_block, carry)
    o, m, l = carry
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _query_angles(pos, freq, exact):
    if exact:
        return angles_from_words(pos, freq[0], freq[1])
    return pos.astype(jnp.float32)[..., None] * freq[0]


@functools.partial(
    jax.jit,
    static_argnames=("scale", "interpret", "block_k", "block_q", "num_splits", "exact", "num_warps",
                     "num_stages", "skip_empty"),
)
def _survivor_attention_parts(
    q, win_k, win_v, win_pos, surv_k_raw, surv_v, surv_pos, surv_valid, q_pos_win, q_pos_surv, freq,
    *, scale, interpret, block_k, block_q, num_splits, exact, num_warps, num_stages, skip_empty=True,
):
    """Runs the kernel; returns the per-split (o, m, l) and the row bookkeeping needed to merge them."""
    B, C, Hq, D = q.shape
    Hkv, W = win_k.shape[1], win_k.shape[2]
    S = surv_k_raw.shape[2]
    G = Hq // Hkv
    if Hq % Hkv or D % 2 or D & (D - 1) or D < 2 * _MIN_BLOCK:
        raise ValueError(f"need Hq % Hkv == 0 and D a power of two >= 32, got {q.shape=} {win_k.shape=}")
    if block_k & (block_k - 1) or block_k < _MIN_BLOCK or block_q & (block_q - 1) or block_q < _MIN_BLOCK:
        raise ValueError(f"block_k and block_q must be powers of two >= 16, got {block_k=} {block_q=}")
    kv_dtype = win_k.dtype
    f32 = jnp.float32

    # Queries: rotate twice in float32 (exact angles), rows = c * G + g, padded to R * n_row_blocks.
    rows = C * G
    R = max(_MIN_BLOCK, _next_pow2(rows)) if rows <= block_q else block_q
    Rp = _round_up(rows, R)
    q_BxCxKxGxD = q.astype(f32).reshape(B, C, Hkv, G, D)

    def rotated_rows(pos_BxC):
        ang = _query_angles(pos_BxC, freq, exact)[:, :, None, None]  # [B, C, 1, 1, F]
        x = rotate_half_split(q_BxCxKxGxD, jnp.cos(ang), jnp.sin(ang))
        x = jnp.transpose(x, (0, 2, 1, 3, 4)).reshape(B, Hkv, rows, D)
        return jnp.pad(x, ((0, 0), (0, 0), (0, Rp - rows), (0, 0))).astype(kv_dtype)

    qw, qs = rotated_rows(q_pos_win), rotated_rows(q_pos_surv)
    qpos = jnp.repeat(q_pos_win.astype(jnp.int32), G, axis=1)  # [B, rows]
    qpos = jnp.pad(qpos, ((0, 0), (0, Rp - rows)), constant_values=-1)

    # Keys: pad each segment to a multiple of its block (no-op when the capacity is aligned).
    block_w, Wp = _key_block(W, block_k)
    block_s, Sp = _key_block(S, block_k)

    def pad_keys(x, n, n_p):
        return x if n == n_p else jnp.pad(x, ((0, 0), (0, 0), (0, n_p - n), (0, 0)))

    win_k, win_v = pad_keys(win_k, W, Wp), pad_keys(win_v, W, Wp)
    win_pos = jnp.pad(win_pos.astype(jnp.int32), ((0, 0), (0, Wp - W)), constant_values=-1)
    surv_k_raw = pad_keys(surv_k_raw.astype(kv_dtype), S, Sp)
    surv_v = pad_keys(surv_v.astype(kv_dtype), S, Sp)
    surv_pos = jnp.pad(surv_pos.astype(jnp.int32), ((0, 0), (0, Sp - S)))
    surv_valid = jnp.pad(surv_valid.astype(jnp.int32), ((0, 0), (0, Sp - S)))

    n_blocks_w, n_blocks_s = Wp // block_w, Sp // block_s
    n_row_blocks = Rp // R
    if num_splits is None:
        num_splits = _default_num_splits(B * Hkv * n_row_blocks, max(n_blocks_w, n_blocks_s))
    per_split_w = -(-n_blocks_w // num_splits)
    per_split_s = -(-n_blocks_s // num_splits)

    kernel = functools.partial(
        _survivor_attention_kernel, scale=scale, block_w=block_w, block_s=block_s,
        n_blocks_w=n_blocks_w, n_blocks_s=n_blocks_s, per_split_w=per_split_w, per_split_s=per_split_s,
        exact=exact, precision=lax.Precision.HIGHEST if kv_dtype == jnp.float32 else None,
        skip_empty=skip_empty,
    )
    rows_spec = pl.BlockSpec((None, None, R, D), lambda b, h, r, j: (b, h, r, 0))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, Hkv, n_row_blocks, num_splits),
        in_specs=[
            rows_spec,
            rows_spec,
            pl.BlockSpec((None, R), lambda b, h, r, j: (b, r)),
            pl.BlockSpec((None, None, Wp, D), lambda b, h, r, j: (b, h, 0, 0)),
            pl.BlockSpec((None, None, Wp, D), lambda b, h, r, j: (b, h, 0, 0)),
            pl.BlockSpec((None, Wp), lambda b, h, r, j: (b, 0)),
            pl.BlockSpec((None, None, Sp, D), lambda b, h, r, j: (b, h, 0, 0)),
            pl.BlockSpec((None, None, Sp, D), lambda b, h, r, j: (b, h, 0, 0)),
            pl.BlockSpec((None, Sp), lambda b, h, r, j: (b, 0)),
            pl.BlockSpec((None, Sp), lambda b, h, r, j: (b, 0)),
            pl.BlockSpec(freq.shape, lambda b, h, r, j: (0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, R, D), lambda b, h, r, j: (b, h, j, r, 0)),
            pl.BlockSpec((None, None, None, R), lambda b, h, r, j: (b, h, j, r)),
            pl.BlockSpec((None, None, None, R), lambda b, h, r, j: (b, h, j, r)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Hkv, num_splits, Rp, D), f32),
            jax.ShapeDtypeStruct((B, Hkv, num_splits, Rp), f32),
            jax.ShapeDtypeStruct((B, Hkv, num_splits, Rp), f32),
        ],
        compiler_params=_compiler_params(interpret, num_warps, num_stages),
        interpret=interpret,
        name="survivor_attention",
    )(qw, qs, qpos, win_k, win_v, win_pos, surv_k_raw, surv_v, surv_pos, surv_valid, freq)
    return o, m, l


def _merge_splits(o, m, l):
    """Log-sum-exp merge of per-split (o [.., J, R, D], m, l [.., J, R]) -> normalised [.., R, D]."""
    m_all = jnp.max(m, axis=-2, keepdims=True)
    alpha = jnp.exp(m - m_all)  # empty splits: m = MASK_VALUE -> 0 (or 1 with l = 0, o = 0)
    l_all = jnp.sum(alpha * l, axis=-2)
    o_all = jnp.sum(alpha[..., None] * o, axis=-3)
    return o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None]


def _angle_input(inv_freq, exact_angles):
    exact = _is_concrete(inv_freq) if exact_angles is None else bool(exact_angles)
    if exact:
        if not _is_concrete(inv_freq):
            raise ValueError("exact_angles=True needs a concrete inv_freq (a model constant)")
        return jnp.asarray(turn_words(np.asarray(inv_freq, np.float32))), True
    return jnp.asarray(inv_freq, jnp.float32).reshape(1, -1), False


def survivor_attention(
    q, win_k, win_v, win_pos, surv_k_raw, surv_v, surv_pos, surv_valid, q_pos_win, q_pos_surv, inv_freq,
    *, scale=None, interpret=None, block_k=128, block_q=64, num_splits=None, exact_angles=None,
    num_warps=None, num_stages=2, skip_empty_blocks=True,
):
    """Fused two-segment attention (the contract in the module docstring) as a Pallas kernel.

    block_k: key tile (power of two >= 16; smaller when a segment is shorter or a smaller power of
      two divides it). block_q: most query rows (G * C, padded) per program. num_splits: key-axis
      splits (flash-decoding); None picks enough for ~256 programs. exact_angles: None = exact
      integer angle reduction when inv_freq is concrete (a model constant), else float32
      pos * inv_freq (absolute angle error <= ~pos * 2^-23 rad: ~1e-4 rad at logical positions of
      ~1e3, which is where survivors live; global window positions only touch the query, rotated in
      the wrapper). interpret: None = interpret on CPU, compile (Pallas Triton) on GPU.
      skip_empty_blocks: skip (lax.cond) key blocks nobody can see; False keeps the loop body
      branch-free, which lets Triton software-pipeline the K/V loads (num_stages) - a GPU tuning knob.
    """
    if interpret is None:
        interpret = jax.default_backend() not in ("gpu", "cuda", "rocm")
    D = q.shape[-1]
    scale = float(D**-0.5 if scale is None else scale)
    freq, exact = _angle_input(inv_freq, exact_angles)
    B, C, Hq, _ = q.shape
    Hkv = win_k.shape[1]
    o, m, l = _survivor_attention_parts(
        q, win_k, win_v, win_pos, surv_k_raw, surv_v, surv_pos, surv_valid, q_pos_win, q_pos_surv, freq,
        scale=scale, interpret=bool(interpret), block_k=block_k, block_q=block_q, num_splits=num_splits,
        exact=exact, num_warps=num_warps, num_stages=num_stages, skip_empty=bool(skip_empty_blocks),
    )
    G = Hq // Hkv
    out = _merge_splits(o, m, l)[:, :, : C * G]  # [B, Hkv, C*G, D]
    out = jnp.transpose(out.reshape(B, Hkv, C, G, D), (0, 2, 1, 3, 4)).reshape(B, C, Hq, D)
    return out.astype(q.dtype)


# ----------------------------------------------------------------------------------------------------
# A leaner XLA formulation (no Pallas) for CPU and for comparison.
#
# Same contract and math as the reference. What made the reference slow on CPU was not the attention
# but jnp.cos / jnp.sin of the survivor angles: XLA:CPU evaluates them at ~3 ns per element (a full
# range reduction per element), which for B * S * D/2 angles per step costs more than the attention
# over the same keys. Here the angle is already an exact 32-bit fraction of a turn (rope.py), so the
# quadrant is read off its top two bits and only a short polynomial on [-pi/4, pi/4] remains:
# elementwise integer / float ops that XLA fuses and vectorises with the rotation. Segments are kept
# separate (two partial softmaxes merged by log-sum-exp) instead of concatenating the scores.
# ----------------------------------------------------------------------------------------------------

# Cephes sinf / cosf minimax coefficients on [-pi/4, pi/4] (about 1 ulp in float32).
_S1, _S2, _S3 = -1.6666654611e-1, 8.3321608736e-3, -1.9515295891e-4
_C1, _C2, _C3 = 4.166664568298827e-2, -1.388731625493765e-3, 2.443315711809948e-5


def _turn_u32(pos, words_hi, words_lo):
    """frac(pos * inv_freq / 2pi) as a uint32 fraction of a turn, exactly (see rope.angles_from_words)."""
    p = pos.astype(jnp.uint32)[..., None]
    return p * words_hi + _mulhi_u32(p, words_lo)


def cos_sin_from_turns(turn_u32):
    """(cos, sin) float32 of 2 pi * turn_u32 / 2^32, with the quadrant taken exactly from the integer."""
    quad = ((turn_u32 + jnp.uint32(1 << 29)) >> 30) & jnp.uint32(3)
    r = jax.lax.bitcast_convert_type(turn_u32 - (quad << 30), jnp.int32)  # in [-2^29, 2^29]
    x = r.astype(jnp.float32) * jnp.float32(2 * np.pi / 2**32)  # in [-pi/4, pi/4]
    z = x * x
    s = x + x * z * (_S1 + z * (_S2 + z * _S3))
    c = 1.0 - 0.5 * z + z * z * (_C1 + z * (_C2 + z * _C3))
    q = quad.astype(jnp.int32)
    cos = jnp.where(q == 0, c, jnp.where(q == 1, -s, jnp.where(q == 2, -c, s)))
    sin = jnp.where(q == 0, s, jnp.where(q == 1, c, jnp.where(q == 2, -s, -c)))
    return cos, sin


def _fast_cos_sin(pos, inv_freq):
    if _is_concrete(inv_freq):
        words = turn_words(np.asarray(inv_freq, np.float32))
        return cos_sin_from_turns(_turn_u32(jnp.asarray(pos, jnp.int32), jnp.asarray(words[0]),
                                            jnp.asarray(words[1])))
    return rope_cos_sin(pos, inv_freq)


def survivor_attention_xla(
    q, win_k, win_v, win_pos, surv_k_raw, surv_v, surv_pos, surv_valid, q_pos_win, q_pos_surv, inv_freq,
    *, scale=None,
):
    """The contract above in plain XLA, tuned for CPU (see the comment block above)."""
    B, C, Hq, D = q.shape
    Hkv = win_k.shape[1]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    hp = jax.lax.Precision.HIGHEST
    f32 = jnp.float32

    q_BxCxKxGxD = q.astype(f32).reshape(B, C, Hkv, G, D)
    cos_w, sin_w = rope_cos_sin(q_pos_win, inv_freq)  # tiny: [B, C, D/2]
    cos_s, sin_s = rope_cos_sin(q_pos_surv, inv_freq)
    qw = rotate_half_split(q_BxCxKxGxD, cos_w[:, :, None, None], sin_w[:, :, None, None]) * scale
    qs = rotate_half_split(q_BxCxKxGxD, cos_s[:, :, None, None], sin_s[:, :, None, None]) * scale
    F = D // 2
    cos_k, sin_k = _fast_cos_sin(surv_pos, inv_freq)  # [B, S, D/2]
    cos_k, sin_k = cos_k[:, None], sin_k[:, None]
    # survivor keys rotated from raw, as two halves (no concatenate): s = q1.k1' + q2.k2'
    k1, k2 = surv_k_raw[..., :F].astype(f32), surv_k_raw[..., F:].astype(f32)
    k1r, k2r = k1 * cos_k - k2 * sin_k, k2 * cos_k + k1 * sin_k  # [B, Hkv, S, D/2]

    def scores(qx, k):
        return jnp.einsum("bckgd,bknd->bkgcn", qx, k.astype(f32), precision=hp)

    def partial(s, v, mask):  # s [B, Hkv, G, C, N], mask [B, C, N]
        mask = mask[:, None, None]
        s = jnp.where(mask, s, MASK_VALUE)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.where(mask, jnp.exp(s - m), 0.0)
        o = jnp.einsum("bkgcn,bknd->bkgcd", p, v.astype(f32), precision=hp)
        return o, m, jnp.sum(p, axis=-1, keepdims=True)

    m_win = (win_pos[:, None, :] >= 0) & (win_pos[:, None, :] <= q_pos_win[:, :, None])
    m_surv = jnp.broadcast_to(surv_valid[:, None, :], (B, C, surv_valid.shape[-1]))
    parts = []  # an empty segment (W = 0 or S = 0, static) is skipped
    if win_k.shape[2]:
        parts.append(partial(scores(qw, win_k), win_v, m_win))
    if surv_k_raw.shape[2]:
        parts.append(partial(scores(qs[..., :F], k1r) + scores(qs[..., F:], k2r), surv_v, m_surv))
    if not parts:
        return jnp.zeros_like(q)
    m = functools.reduce(jnp.maximum, [p[1] for p in parts])
    alphas = [jnp.exp(p[1] - m) for p in parts]
    l = sum(a * p[2] for a, p in zip(alphas, parts))
    o = sum(a * p[0] for a, p in zip(alphas, parts)) / jnp.where(l > 0, l, 1.0)  # [B, Hkv, G, C, D]
    return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(B, C, Hq, D).astype(q.dtype)
