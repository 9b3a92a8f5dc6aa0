"""Two-segment survivor attention: the contract, its pure-jnp reference, and the kernel.

    out = survivor_attention(q, win_k, win_v, win_pos, surv_k, surv_v, surv_rot_pos, surv_valid,
                             q_pos_win, q_pos_surv, inv_freq, *, scale=None, logit_cap=None,
                             sliding_window=None, interpret=None)

* q [B, C, Hq, D] raw queries; Hq = G * Hkv (GQA).
* win_k / win_v [B, Hkv, W, D]: window keys already rotated at their positions; win_pos [B, W] int32
  (-1 = empty). Query c sees slot w iff 0 <= win_pos[w] <= q_pos_win[c] (causal inside a chunk).
* surv_k / surv_v [B, Hkv, S, D]: the survivor segment's keys, rotated here at their rotation position
  surv_rot_pos [B, S] int32 (a rank; the cache's global positions never reach the kernel); surv_valid [B, S]
  bool. RSQR's survivors are raw; rotation position 0 is the exact identity, so pre-rotated keys use this
  segment too (that is how leave_gaps / rerotate / rsqr_precompute reuse it).
* q_pos_win / q_pos_surv [B, C] int32: where the query is rotated for each segment (relocation).
* inv_freq [D/2] float32. Angles are reduced exactly (rsqr_jax.kernels.exact_rope) when it is concrete.
* Survivor positions are ranks, bounded by the capacity: they must lie in [0, rank_limit), default
  W + S; the survivor keys are rotated from a cos/sin table over that range (see rotation_table).
* Returns [B, C, Hq, D] in q's dtype; scale defaults to D ** -0.5. A row with no visible key
  (both segments empty) returns zeros, never NaN.
* logit_cap (static, None = off): every score s = scale * q.k becomes tanh(s / cap) * cap before the
  softmax (Gemma 2's attention-logit soft-capping).
* sliding_window (static, None = off): query c also needs win_pos[w] > q_pos_win[c] - sliding_window, i.e. it
  sees the last sliding_window window positions, itself included (a local layer's window; the survivor
  segment is not affected).

Three implementations of it live here: `survivor_attention_reference` (pure jnp, simple: the
semantics), `survivor_attention` (the Pallas kernel: compiled on GPU, interpreted on CPU) and
`survivor_attention_xla` (plain XLA tuned for CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from rsqr_jax.kernels import recalled_attention
from rsqr_jax.kernels.store import StoredRuns
from rsqr_jax.kernels.exact_rope import _is_concrete, angles_from_words, rope_cos_sin, rope_table, rotate_half_split, turn_words

# Finite mask value (as in jax.experimental.pallas.ops): -inf would turn fully masked rows into NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _cap(s, logit_cap):
    """Soft-capped scores tanh(s / cap) * cap (s itself when logit_cap is None)."""
    return s if logit_cap is None else jnp.tanh(s / logit_cap) * logit_cap


def _window_mask(win_pos_BxW, q_pos_BxC, sliding_window):
    """[B, C, W]: which window slots each query sees (causal; within sliding_window positions when set)."""
    k, q = win_pos_BxW[:, None, :], q_pos_BxC[:, :, None]
    mask = (k >= 0) & (k <= q)
    return mask if sliding_window is None else mask & (k > q - sliding_window)


def survivor_attention_reference(
    q, win_k, win_v, win_pos, surv_k, surv_v, surv_rot_pos, surv_valid, q_pos_win, q_pos_surv, inv_freq,
    *, scale=None, logit_cap=None, sliding_window=None,
):
    """Pure-jnp reference of the contract above (float32 math, one softmax over both segments)."""
    B, C, Hq, D = q.shape
    Hkv = win_k.shape[1]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    hp = jax.lax.Precision.HIGHEST

    q_BxCxHkvxGxD = q.astype(jnp.float32).reshape(B, C, Hkv, G, D)
    cos_w, sin_w = rope_cos_sin(q_pos_win, inv_freq)  # [B, C, D/2]
    cos_s, sin_s = rope_cos_sin(q_pos_surv, inv_freq)
    qw = rotate_half_split(q_BxCxHkvxGxD, cos_w[:, :, None, None], sin_w[:, :, None, None])
    qs = rotate_half_split(q_BxCxHkvxGxD, cos_s[:, :, None, None], sin_s[:, :, None, None])
    cos_k, sin_k = rope_cos_sin(surv_rot_pos, inv_freq)  # [B, S, D/2]
    ks = rotate_half_split(surv_k, cos_k[:, None], sin_k[:, None])  # [B, Hkv, S, D] float32

    s_win = _cap(jnp.einsum("bckgd,bkwd->bkgcw", qw, win_k.astype(jnp.float32), precision=hp) * scale, logit_cap)
    s_surv = _cap(jnp.einsum("bckgd,bksd->bkgcs", qs, ks, precision=hp) * scale, logit_cap)
    m_win = _window_mask(win_pos, q_pos_win, sliding_window)  # [B, C, W]
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
    denom_BxCxHkvxG = jnp.moveaxis(denom[..., 0], -1, 1)[..., None]
    o = o / jnp.where(denom_BxCxHkvxG > 0, denom_BxCxHkvxG, 1.0)
    return o.reshape(B, C, Hq, D).astype(q.dtype)


# ----------------------------------------------------------------------------------------------------
# Survivor rotations from a table (shared by the kernel and the XLA path).
#
# Every position the survivor segment rotates a key at is a rank on the compressed timeline, so it is
# bounded by the static capacity of the segments (W + S; update.plan_step gives ranks < S). A float32
# cos/sin table over [0, W + S), built once per trace on the host with float64 angles
# (rope.rope_table), replaces the per-key exact integer reduction and sin/cos: one gathered row per key,
# shared by every KV head, query head and split. Query positions stay unbounded (leave_gaps rotates the
# survivor-segment query at its global position) and are rotated in the wrappers with the exact
# reduction, once per call. A position outside the table is a contract violation and gives NaN scores
# (loud, never a silently wrong rotation); masked (invalid) slots are unaffected.
# ----------------------------------------------------------------------------------------------------


def _table_len(W: int, S: int, rank_limit: int | None) -> int:
    return max(1, W + S if rank_limit is None else int(rank_limit))


def rotation_table(inv_freq, n: int, exact: bool):
    """[n, D] float32 (cos | sin) rows for positions 0..n-1.

    exact (inv_freq concrete): a host constant with float64 angles, built once per trace - under jit it
    is a compile-time constant of the step, so no device work per call and no cache field. Otherwise
    (traced inv_freq) float32 pos * inv_freq computed in the graph, as accurate as the query fallback."""
    if exact:
        return rope_table(np.asarray(inv_freq, np.float32), n)
    ang = jnp.arange(n, dtype=jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32).reshape(1, -1)
    return jnp.concatenate([jnp.cos(ang), jnp.sin(ang)], axis=1)


def _table_rows(table, pos):
    """(cos, sin) [..., D/2] for int32 positions [...]; NaN outside [0, len(table))."""
    n, D = table.shape
    inside = (pos >= 0) & (pos < n)
    rows = jnp.where(inside[..., None], jnp.asarray(table)[jnp.where(inside, pos, 0)], jnp.nan)
    return rows[..., : D // 2], rows[..., D // 2:]


# ----------------------------------------------------------------------------------------------------
# The Pallas kernel.
#
# Structure (flash-decoding, one program per (batch, kv head, query-row block, key split)):
#   * The wrapper rotates the queries (they are tiny: [B, C, Hq, D]) twice in float32 - at q_pos_win
#     for the window and at q_pos_surv for the survivors - with exact angles, regroups them so that
#     the G query heads of one KV head and all C chunk positions form one row block (row = c*G + g),
#     and pads that block to a power of two >= 16 rows.
#   * The key axis is one list of blocks: the window blocks (block_w keys each), then the survivor
#     blocks (block_s keys: a size of their own, smaller by default because a survivor tile also holds
#     its cos/sin rows and the rotated halves in registers). Split j takes a contiguous share of that
#     list, so window and survivor blocks are spread over all splits alike. One online softmax
#     (m, l, o) runs over whatever part of both segments a program holds.
#   * Survivor keys are rotated from raw inside the kernel, per key tile: cos/sin rows gathered from
#     the rotation table at surv_rot_pos (no integer reduction, no transcendental per key) and the score as
#     two half-width dots  s = q1 . k1' + q2 . k2'  with  k1' = k1 cos - k2 sin,  k2' = k2 cos + k1 sin,
#     the halves read with separate ref slices (no value slicing or concatenation in the kernel).
#   * The loops are branch-free (no lax.cond, so every load sits in the loop body where Triton can
#     software-pipeline it, num_stages): keys nobody in the program can see (empty window slots, invalid
#     survivors, the causal future of a chunk) are fetched with masked loads, so they cost no memory
#     traffic, only their positions (mask_empty_keys=True, the default; False loads every key).
#   * Each split writes unnormalised (o, m, l); the wrapper merges the splits by log-sum-exp. The split
#     count follows the GPU: enough programs to fill every SM at the occupancy the warp count allows.
#
# Lowering constraints that shaped it (Pallas Triton backend):
#   * every loaded/stored array must have a power-of-two size -> row blocks padded to a power of two,
#     key blocks are powers of two, D must be a power of two (64, 128);
#   * tl.dot needs M, N, K >= 16 -> at least 16 query rows, key blocks >= 16, D/2 >= 16;
#   * no value slicing / concatenation inside the kernel -> the two rotation halves are separate ref
#     loads (pl.ds on the last axis) and two dots;
#   * -inf arithmetic makes fully masked rows NaN -> finite MASK_VALUE plus explicit zeroing of masked
#     probabilities (a fully masked row keeps l = 0 and o = 0);
#   * only the kernel body is traced for the device, so it uses ref indexing (a gather for the table
#     rows), pl.ds, masked loads, jnp, lax.fori_loop (dynamic bounds) and jnp.where only. The
#     backend-specific knobs live in `_compiler_params` alone.
#   * segments enter as whole-array blocks and the kernel indexes tiles itself, so W and S need only be
#     multiples of their key block (they are padded in the wrapper otherwise, which costs a copy of that
#     segment: capacities above the block that are multiples of a quarter of it are used in place).
# Dots run in the KV storage dtype (bfloat16 K/V -> bfloat16 operands, rotated survivor keys rounded
# to bfloat16 once after their float32 rotation, float32 accumulation; float32 K/V -> float32 operands
# at HIGHEST precision, IEEE on Triton).
# ----------------------------------------------------------------------------------------------------

_MIN_BLOCK = 16  # Triton: dot operands need every dimension >= 16
H200_SMS = 132  # SM count assumed when no GPU is visible (interpret mode, cross-lowering on CPU)


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


def default_num_warps(D: int, rows: int, kv_dtype) -> int:
    """4 warps for a decode tile at head_dim 64; 8 at head_dim 128 or a float32 chunk row block
    (rows * D * itemsize >= 8 KiB): its query and accumulator tiles spill at 4 (the H200 compile report)."""
    return 8 if D >= 128 or rows * D * jnp.dtype(kv_dtype).itemsize >= 8192 else 4


def default_blocks(kv_dtype) -> tuple[int, int]:
    """(block_k, block_s): the same tile bytes for every K/V dtype (float32 tiles hold half the keys); the
    survivor tile is half the window's (it also holds the cos/sin rows and both rotated halves)."""
    block_k = 128 if jnp.dtype(kv_dtype).itemsize <= 2 else 64
    return block_k, block_k // 2


def sm_count() -> int:
    """Streaming multiprocessors of the first GPU; H200_SMS when no GPU is visible."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return H200_SMS
    return int(getattr(dev, "core_count", 0) or H200_SMS) if dev.platform == "gpu" else H200_SMS


def default_num_splits(programs: int, n_blocks: int, num_warps: int, sms: int | None = None) -> int:
    """Key splits that fill the GPU: SMs x resident programs per SM, over the programs of the grid.

    Resident programs per SM ~ 16 / num_warps (a 64K-register file at <= 128 registers per thread);
    every split keeps >= 2 key blocks so the per-split (o, m, l) traffic stays below the K/V it saves."""
    sms = sm_count() if sms is None else sms
    want = -(-sms * max(1, 16 // num_warps) // max(programs, 1))
    return max(1, min(want, -(-n_blocks // 2)))


def _compiler_params(interpret: bool, num_warps: int, num_stages: int | None):
    """All backend-specific knobs live here (Pallas Triton on GPU; nothing when interpreting)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _load(ref, mask, masked: bool):
    """ref[...] with the rows where mask is False not fetched (zeros), or a plain load."""
    if not masked:
        return ref[...]
    from jax.experimental.pallas import triton as pltriton

    return pltriton.load(ref, mask=mask[:, None], other=0)


def _survivor_attention_kernel(
    qw_ref, qs_ref, qpos_ref,  # [R, D], [R, D] rotated queries (compute dtype), [R] int32 window pos
    wk_ref, wv_ref, wpos_ref,  # [Wp, D], [Wp, D], [Wp] int32
    sk_ref, sv_ref, spos_ref, svalid_ref,  # [Sp, D] raw, [Sp, D], [Sp] int32, [Sp] int32 (0/1)
    table_ref,  # [T, D] float32 rotation table: cos | sin
    o_ref, m_ref, l_ref,  # [R, D] float32 (unnormalised), [R], [R] float32
    *, scale, block_w, block_s, n_blocks_w, n_blocks_s, per_split, precision, masked, logit_cap=None,
    sliding_window=None,
):
    R, D = qw_ref.shape
    T = table_ref.shape[0]
    F = D // 2
    split = pl.program_id(3)
    f32 = jnp.float32

    def dot_nt(a, b):  # a [M, K] . b [N, K]^T -> [M, N] float32
        return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=f32)

    def update(carry, s, mask, v):
        o, m, l = carry
        s = jnp.where(mask, _cap(s, logit_cap), MASK_VALUE)
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
        k = _load(wk_ref.at[pl.ds(start, block_w), :], live, masked)
        v = _load(wv_ref.at[pl.ds(start, block_w), :], live, masked)
        mask = (wpos[None, :] >= 0) & (wpos[None, :] <= qpos[:, None])
        if sliding_window is not None:
            mask = mask & (wpos[None, :] > qpos[:, None] - sliding_window)
        return update(carry, dot_nt(qw, k) * scale, mask, v)

    q1 = qs_ref[:, pl.ds(0, F)]
    q2 = qs_ref[:, pl.ds(F, F)]
    dot_dtype = q1.dtype

    def survivor_block(i, carry):
        start = i * block_s
        valid = svalid_ref[pl.ds(start, block_s)] != 0  # [bs]
        pos = spos_ref[pl.ds(start, block_s)]
        inside = (pos >= 0) & (pos < T)
        row = jnp.where(inside, pos, 0)
        nan_out = jnp.where(inside, 0.0, jnp.nan).astype(f32)[:, None]  # out-of-table positions -> NaN
        cos = table_ref[row, pl.ds(0, F)] + nan_out  # [bs, F] gathered rows
        sin = table_ref[row, pl.ds(F, F)] + nan_out
        k1 = _load(sk_ref.at[pl.ds(start, block_s), pl.ds(0, F)], valid, masked).astype(f32)
        k2 = _load(sk_ref.at[pl.ds(start, block_s), pl.ds(F, F)], valid, masked).astype(f32)
        k1r = (k1 * cos - k2 * sin).astype(dot_dtype)
        k2r = (k2 * cos + k1 * sin).astype(dot_dtype)
        s = (dot_nt(q1, k1r) + dot_nt(q2, k2r)) * scale
        v = _load(sv_ref.at[pl.ds(start, block_s), :], valid, masked)
        mask = jnp.broadcast_to(valid[None, :], s.shape)
        return update(carry, s, mask, v)

    # This split's share [lo, hi) of the block list (window blocks, then survivor blocks).
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, n_blocks_w + n_blocks_s)
    carry = (jnp.zeros((R, D), f32), jnp.full((R,), MASK_VALUE, f32), jnp.zeros((R,), f32))
    carry = lax.fori_loop(jnp.minimum(lo, n_blocks_w), jnp.minimum(hi, n_blocks_w), window_block, carry)
    carry = lax.fori_loop(jnp.maximum(lo - n_blocks_w, 0), jnp.maximum(hi - n_blocks_w, 0), survivor_block, carry)
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
    static_argnames=("scale", "interpret", "block_k", "block_s", "block_q", "num_splits", "exact", "num_warps",
                     "num_stages", "masked", "logit_cap", "sliding_window"),
)
def _survivor_attention_parts(
    q, win_k, win_v, win_pos, surv_k, surv_v, surv_rot_pos, surv_valid, q_pos_win, q_pos_surv, freq, table,
    *, scale, interpret, block_k, block_s, block_q, num_splits, exact, num_warps, num_stages, masked=True,
    logit_cap=None, sliding_window=None,
):
    """Runs the kernel; returns the per-split (o, m, l) [B, Hkv, J, Rp, (D)] to merge.

    freq: the query angles' input (turn words, or inv_freq when not exact); table: [T, D] rotations."""
    B, C, Hq, D = q.shape
    Hkv, W = win_k.shape[1], win_k.shape[2]
    S = surv_k.shape[2]
    G = Hq // Hkv
    if Hq % Hkv or D % 2 or D & (D - 1) or D < 2 * _MIN_BLOCK:
        raise ValueError(f"need Hq % Hkv == 0 and D a power of two >= 32, got {q.shape=} {win_k.shape=}")
    for name, blk in (("block_k", block_k), ("block_s", block_s), ("block_q", block_q)):
        if blk & (blk - 1) or blk < _MIN_BLOCK:
            raise ValueError(f"{name} must be a power of two >= 16, got {blk}")
    kv_dtype = win_k.dtype
    f32 = jnp.float32

    # Queries: rotate twice in float32 (exact angles), rows = c * G + g, padded to R * n_row_blocks.
    rows = C * G
    R = max(_MIN_BLOCK, _next_pow2(rows)) if rows <= block_q else block_q
    Rp = _round_up(rows, R)
    q_BxCxHkvxGxD = q.astype(f32).reshape(B, C, Hkv, G, D)

    def rotated_rows(pos_BxC):
        ang = _query_angles(pos_BxC, freq, exact)[:, :, None, None]  # [B, C, 1, 1, F]
        x = rotate_half_split(q_BxCxHkvxGxD, jnp.cos(ang), jnp.sin(ang))
        x = jnp.transpose(x, (0, 2, 1, 3, 4)).reshape(B, Hkv, rows, D)
        return jnp.pad(x, ((0, 0), (0, 0), (0, Rp - rows), (0, 0))).astype(kv_dtype)

    qw, qs = rotated_rows(q_pos_win), rotated_rows(q_pos_surv)
    qpos = jnp.repeat(q_pos_win.astype(jnp.int32), G, axis=1)  # [B, rows]
    qpos = jnp.pad(qpos, ((0, 0), (0, Rp - rows)), constant_values=-1)

    # Keys: pad each segment to a multiple of its block (no-op when the capacity is aligned).
    block_w, Wp = _key_block(W, block_k)
    block_s, Sp = _key_block(S, block_s)

    def pad_keys(x, n, n_p):
        return x if n == n_p else jnp.pad(x, ((0, 0), (0, 0), (0, n_p - n), (0, 0)))

    win_k, win_v = pad_keys(win_k, W, Wp), pad_keys(win_v, W, Wp)
    win_pos = jnp.pad(win_pos.astype(jnp.int32), ((0, 0), (0, Wp - W)), constant_values=-1)
    surv_k = pad_keys(surv_k.astype(kv_dtype), S, Sp)
    surv_v = pad_keys(surv_v.astype(kv_dtype), S, Sp)
    surv_rot_pos = jnp.pad(surv_rot_pos.astype(jnp.int32), ((0, 0), (0, Sp - S)))
    surv_valid = jnp.pad(surv_valid.astype(jnp.int32), ((0, 0), (0, Sp - S)))
    table = jnp.asarray(table, f32)

    n_blocks_w, n_blocks_s = Wp // block_w, Sp // block_s
    n_blocks = n_blocks_w + n_blocks_s
    n_row_blocks = Rp // R
    num_warps = default_num_warps(D, R, kv_dtype) if num_warps is None else num_warps
    if num_splits is None:
        num_splits = default_num_splits(B * Hkv * n_row_blocks, n_blocks, num_warps)
    per_split = -(-n_blocks // num_splits)

    kernel = functools.partial(
        _survivor_attention_kernel, scale=scale, block_w=block_w, block_s=block_s, n_blocks_w=n_blocks_w,
        n_blocks_s=n_blocks_s, per_split=per_split,
        precision=lax.Precision.HIGHEST if kv_dtype == jnp.float32 else None, masked=masked, logit_cap=logit_cap,
        sliding_window=sliding_window,
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
            pl.BlockSpec(table.shape, lambda b, h, r, j: (0, 0)),
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
    )(qw, qs, qpos, win_k, win_v, win_pos, surv_k, surv_v, surv_rot_pos, surv_valid, table)
    return o, m, l


def _merge_splits(o, m, l):
    """Log-sum-exp merge of per-split (o [.., J, R, D], m, l [.., J, R]) -> normalised [.., R, D]."""
    m_all = jnp.max(m, axis=-2, keepdims=True)
    alpha = jnp.exp(m - m_all)  # empty splits: m = MASK_VALUE -> 0 (or 1 with l = 0, o = 0)
    l_all = jnp.sum(alpha * l, axis=-2)
    o_all = jnp.sum(alpha[..., None] * o, axis=-3)
    return o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None]


def _angle_input(inv_freq, exact_angles):
    """(query-angle input, exact): the turn words of a concrete inv_freq, else inv_freq as [1, D/2]."""
    exact = _is_concrete(inv_freq) if exact_angles is None else bool(exact_angles)
    if exact:
        if not _is_concrete(inv_freq):
            raise ValueError("exact_angles=True needs a concrete inv_freq (a model constant)")
        return jnp.asarray(turn_words(np.asarray(inv_freq, np.float32))), True
    return jnp.asarray(inv_freq, jnp.float32).reshape(1, -1), False


def survivor_attention(
    q, win_k, win_v, win_pos, surv_k, surv_v, surv_rot_pos, surv_valid, q_pos_win, q_pos_surv, inv_freq,
    *, scale=None, interpret=None, block_k=None, block_s=None, block_q=32, num_splits=None, exact_angles=None,
    num_warps=None, num_stages=2, skip_empty_blocks=True, rank_limit=None, logit_cap=None, sliding_window=None,
):
    """Fused two-segment attention (the contract in the module docstring) as a Pallas kernel.

    block_k: window key tile; block_s: survivor key tile (None: default_blocks: 128 / 64 keys for 2-byte
      K/V, 64 / 32 for float32; block_s alone None: min(block_k, the default)); powers of two >= 16,
      smaller when a segment is shorter or a smaller power of two divides it. block_q: most query rows
      (G * C, padded) per program. num_splits: key-axis splits (flash-decoding); None fills the GPU's
      SMs (default_num_splits). num_warps: None = default_num_warps (4; 8 at head_dim 128 or a
      float32 chunk).
      exact_angles: None = exact when inv_freq is concrete (a model constant): query angles by exact
      integer reduction, survivor rotations from a float64-built table; False (or a traced inv_freq):
      float32 pos * inv_freq for both (absolute error ~pos * 2^-23 rad). rank_limit: survivor positions
      must lie in [0, rank_limit) (default W + S, the capacity; outside gives NaN scores).
      skip_empty_blocks: keys nobody can see are not fetched (masked loads; the loop stays branch-free
      either way); False loads every key. interpret: None = interpret on CPU, compile on GPU.
    """
    if interpret is None:
        interpret = jax.default_backend() not in ("gpu", "cuda", "rocm")
    D = q.shape[-1]
    scale = float(D**-0.5 if scale is None else scale)
    freq, exact = _angle_input(inv_freq, exact_angles)
    B, C, Hq, _ = q.shape
    Hkv, W, S = win_k.shape[1], win_k.shape[2], surv_k.shape[2]
    table = rotation_table(inv_freq, _table_len(W, S, rank_limit), exact)
    default_k, default_s = default_blocks(win_k.dtype)
    block_k = default_k if block_k is None else block_k
    block_s = min(block_k, default_s) if block_s is None else block_s
    o, m, l = _survivor_attention_parts(
        q, win_k, win_v, win_pos, surv_k, surv_v, surv_rot_pos, surv_valid, q_pos_win, q_pos_surv, freq, table,
        scale=scale, interpret=bool(interpret), block_k=block_k, block_s=block_s, block_q=block_q,
        num_splits=num_splits, exact=exact, num_warps=num_warps, num_stages=num_stages,
        masked=bool(skip_empty_blocks), logit_cap=None if logit_cap is None else float(logit_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
    )
    G = Hq // Hkv
    out = _merge_splits(o, m, l)[:, :, : C * G]  # [B, Hkv, C*G, D]
    out = jnp.transpose(out.reshape(B, Hkv, C, G, D), (0, 2, 1, 3, 4)).reshape(B, C, Hq, D)
    return out.astype(q.dtype)


# ----------------------------------------------------------------------------------------------------
# A leaner XLA formulation (no Pallas) for CPU and for comparison.
#
# Same contract and math as the reference. On XLA:CPU two things made the survivor segment expensive:
# jnp.cos / jnp.sin per survivor angle (~3 ns per element: a full range reduction each), and the
# rotated keys themselves - XLA does not fuse an elementwise producer into a dot, so the rotated
# [B, Hkv, S, D] keys were written out and read back, a fresh multi-MB temporary (page faults, DRAM
# traffic) every call. Here the angles come from the rotation table (one gathered row per key, shared
# by the KV heads), and the survivor scores are formed block by block in a fori_loop: each block of
# keys is rotated into a buffer small enough to stay in cache (`block_bytes`) and dotted at once.
# Segments are kept separate (two partial softmaxes merged by log-sum-exp) instead of concatenated.
# ----------------------------------------------------------------------------------------------------


# Rotated survivor keys up to this size are formed in one piece (they stay in the last-level cache and
# glibc reuses the buffer); larger ones in blocks of `block_bytes`. Measured on the 2-core EPYC (32 MiB L3):
# B = 1, S = 16k (12 MiB) is fastest in one piece; B = 16, S = 8k (96 MiB) 1.3-1.4x faster in 1-4 MiB blocks.
WHOLE_SEGMENT_BYTES = 16 << 20


def _survivor_scores(qs_BxCxHkvxGxD, surv_k, surv_rot_pos, table, block_bytes, whole_bytes):
    """[B, Hkv, G, C, S] scores of the (scaled, rotated) queries against survivors rotated at surv_rot_pos."""
    B, C, Hkv, G, D = qs_BxCxHkvxGxD.shape
    S = surv_k.shape[2]
    hp = jax.lax.Precision.HIGHEST
    f32 = jnp.float32
    F = D // 2
    key_bytes = B * Hkv * D * 4
    if S * key_bytes <= max(whole_bytes, block_bytes):
        block = S
    else:
        block = min(S, max(16, 1 << max(1, int(block_bytes // key_bytes)).bit_length() - 1))

    def scores(start, n):
        k = lax.dynamic_slice_in_dim(surv_k, start, n, axis=2).astype(f32)  # [B, Hkv, n, D]
        cos, sin = _table_rows(table, lax.dynamic_slice_in_dim(surv_rot_pos, start, n, axis=1))  # [B, n, F]
        cos_D = jnp.concatenate([cos, cos], axis=-1)[:, None]  # [B, 1, n, D]: shared by the KV heads
        sin_D = jnp.concatenate([-sin, sin], axis=-1)[:, None]
        # (k1, k2) -> (k1 cos - k2 sin, k2 cos + k1 sin) as k * cos_D + swap_halves(k) * sin_D: one
        # multiply-add over whole rows, ~20% faster on XLA:CPU than forming the halves and concatenating.
        k_rot = k * cos_D + jnp.concatenate([k[..., F:], k[..., :F]], axis=-1) * sin_D
        return jnp.einsum("bckgd,bknd->bkgcn", qs_BxCxHkvxGxD, k_rot, precision=hp)

    n_full = S // block
    if n_full <= 1 and S % block == 0:
        return scores(0, S)
    out = jnp.zeros((B, Hkv, G, C, S), f32)
    out = lax.fori_loop(0, n_full, lambda i, o: lax.dynamic_update_slice_in_dim(
        o, scores(i * block, block), i * block, axis=4), out)
    if S % block:
        out = lax.dynamic_update_slice_in_dim(out, scores(n_full * block, S % block), n_full * block, axis=4)
    return out


def survivor_attention_xla(
    q, win_k, win_v, win_pos, surv_k, surv_v, surv_rot_pos, surv_valid, q_pos_win, q_pos_surv, inv_freq,
    *, scale=None, rank_limit=None, block_bytes=4 << 20, whole_segment_bytes=WHOLE_SEGMENT_BYTES, logit_cap=None,
    sliding_window=None, raw_tail=None,
):
    """The contract above in plain XLA, tuned for CPU (see the comment block above).

    rank_limit: survivor positions lie in [0, rank_limit) (default W + S; outside gives NaN scores);
    block_bytes: size of one block of rotated survivor keys (float32, all batch rows and KV heads) when
    all of them would exceed whole_segment_bytes. raw_tail: None, or more slots of the survivor segment given apart
    (kernels.store.RawSegment, or kernels.store.StoredRuns where they still lie in a store): the contract over the
    survivor segment with these R slots appended (the default rank_limit counts them), as a partial softmax of their
    own, merged with the window's and the survivors'; stored slots go through the CPU kernel recalled_attention where
    it applies (a decode step), and are read out of the store otherwise."""
    B, C, Hq, D = q.shape
    Hkv, W, S = win_k.shape[1], win_k.shape[2], surv_k.shape[2]
    stored = isinstance(raw_tail, StoredRuns)
    R = 0 if raw_tail is None else raw_tail.rot_pos_BxR.shape[1]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    hp = jax.lax.Precision.HIGHEST
    f32 = jnp.float32

    q_BxCxHkvxGxD = q.astype(f32).reshape(B, C, Hkv, G, D)
    cos_w, sin_w = rope_cos_sin(q_pos_win, inv_freq)  # tiny: [B, C, D/2]
    cos_s, sin_s = rope_cos_sin(q_pos_surv, inv_freq)
    qw = rotate_half_split(q_BxCxHkvxGxD, cos_w[:, :, None, None], sin_w[:, :, None, None]) * scale
    qs = rotate_half_split(q_BxCxHkvxGxD, cos_s[:, :, None, None], sin_s[:, :, None, None]) * scale

    def partial(s, v, mask):  # s [B, Hkv, G, C, N], mask [B, C, N]
        mask = mask[:, None, None]
        s = jnp.where(mask, _cap(s, logit_cap), MASK_VALUE)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.where(mask, jnp.exp(s - m), 0.0)
        o = jnp.einsum("bkgcn,bknd->bkgcd", p, v.astype(f32), precision=hp)
        return o, m, jnp.sum(p, axis=-1, keepdims=True)

    m_win = _window_mask(win_pos, q_pos_win, sliding_window)
    m_surv = jnp.broadcast_to(surv_valid[:, None, :], (B, C, S))
    parts = []  # an empty segment (W = 0 or S = 0, static) is skipped
    if W:
        parts.append(partial(jnp.einsum("bckgd,bknd->bkgcn", qw, win_k.astype(f32), precision=hp), win_v, m_win))
    if S or R:
        table = rotation_table(inv_freq, _table_len(W, S + R, rank_limit), _is_concrete(inv_freq))
    if S:
        s_surv = _survivor_scores(qs, surv_k, surv_rot_pos, table, block_bytes, whole_segment_bytes)
        parts.append(partial(s_surv, surv_v, m_surv))
    if R and stored and recalled_attention.applies(raw_tail, C * G, logit_cap):
        parts.append(recalled_attention.recalled_partial(raw_tail, qs, table))
    elif R:
        tail_k, tail_v, tail_rot_pos, tail_valid = raw_tail.arrays()
        s_tail = _survivor_scores(qs, tail_k, tail_rot_pos, table, block_bytes, whole_segment_bytes)
        parts.append(partial(s_tail, tail_v, jnp.broadcast_to(tail_valid[:, None, :], (B, C, R))))
    if not parts:
        return jnp.zeros_like(q)
    m = functools.reduce(jnp.maximum, [p[1] for p in parts])
    alphas = [jnp.exp(p[1] - m) for p in parts]
    l = sum(a * p[2] for a, p in zip(alphas, parts))
    o = sum(a * p[0] for a, p in zip(alphas, parts)) / jnp.where(l > 0, l, 1.0)  # [B, Hkv, G, C, D]
    return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(B, C, Hq, D).astype(q.dtype)
