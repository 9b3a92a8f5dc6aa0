"""The recall tier (docs/design.md §3b), the one module that writes and reads the cold store: each layer's
raw K/V into the cold ring and its page summaries (`write_cold`), page scores (the query against each page's
best or mean key, or Quest's per-channel bound; on CPU the int8 copy's through kernels.page_scores), the top-R
choice with neighbours, the recalled K/V (`read_cold_runs`), and where the recalled tokens sit
(`recalled_layout`: in the raw segment at their ranks, or in the window segment, `extend_window_segment`). Where each
token's cold slot is (the ring's bookkeeping) is planned once per step with the rest (rsqr_jax.update)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from typing import TYPE_CHECKING

from rsqr_jax.cache import BITS_DTYPE, gather_layer_slots, read_layer_runs, write_kv
from rsqr_jax.kernels import page_scores as page_scores_kernel
from rsqr_jax.kernels.exact_rope import rope_cos_sin, rotate_half_split
from rsqr_jax.policy import order_index
from rsqr_jax.rope import rotate_keys

if TYPE_CHECKING:
    from rsqr_jax.cache import KVCache
    from rsqr_jax.update import StepPlan


# Most pages scored per block while the store fills (live_page_scores): a layer scores only the blocks that hold a
# recallable token, under a loop whose trip count is their number; 0 = score every page at every step. Each trip
# costs a fixed overhead on XLA:CPU, so blocks are large; the store is cut into equal blocks of at most this many
# pages (`score_block_pages`): a default store (4096 tokens and the window's, 277 pages) is one block.
SCORE_BLOCK_PAGES = 320


def score_block_pages(n_pages: int, most: int) -> int:
    """Pages per block when a store of n_pages is scored in blocks of at most `most` pages: the fewest blocks, all of
    one size (the last one moved back to end at the last page rescores as few pages as can be), at least 2 pages (a
    dot over a single page lowers differently on XLA:CPU: the mean rule's scores moved by an ulp)."""
    n_blocks = -(-n_pages // max(most, 1))
    return min(max(-(-n_pages // n_blocks), 2), n_pages)


@functools.partial(jax.tree_util.register_dataclass,
                   meta_fields=["max_pages", "neighbors", "shortlist", "page_score", "score_block", "placement",
                                "keeps_choice", "share_from"],
                   data_fields=["k_pages", "token_valid_Nc", "surv_gpos_S", "q_global_C", "q_real_C", "in_kernel",
                                "live_pages", "fixed_pos", "reselect_now", "kept_layout"])
@dataclasses.dataclass(frozen=True)
class Recall:
    """What a layer needs to recall cold pages (DESIGN section 3b). k_pages: the policy's recall_pages;
    token_valid_Nc: cold slots holding a token that has left the window; surv_gpos_S: the survivors'
    global positions (for deduplication and ranks); q_global_C / q_real_C: the chunk's positions and
    which of its rows are real; in_kernel: survivor keys are rotated at their rank in the kernel;
    max_pages (static): pages chosen per layer (0 = no recall in this compilation); neighbors (static): pages
    on each side of a chosen page gathered with it; shortlist (static): with the "shortlist" rule, how many
    pages of best mean key are rescored by their best token; page_score (static): the rule
    (spec.PAGE_SCORES), which names the summaries the cold store keeps: per-channel bounds for "quest", a
    scoring copy of every key for "max" (never inferred from which arrays are empty); live_pages: the leading pages that may hold a
    recallable token (the ring fills from slot 0 until it wraps; 0 = nothing to recall this step, or
    k_pages = 0: the layers skip recall); score_block (static): pages scored per block of that prefix (0 =
    every page, every step); placement (static, spec.PLACEMENTS): where recalled tokens sit; fixed_pos: the
    global position the "fixed" placement rotates every recalled key at (the chunk's first position minus the
    policy's window); keeps_choice (static): layers keep their page choice in the cache between scorings
    (ColdStore.reselect > 1, or share_from); reselect_now: this step scores the store and chooses afresh;
    share_from (static, ColdStore.choice_sources; None = every layer chooses): per layer, the layer whose choice it
    attends (-1: none); kept_layout (with a kept choice; None otherwise): recalled_layout of every choosing layer's
    kept choice (a leading axis over choosers(L)), what the layers attend at a step that does not choose."""

    k_pages: jax.Array
    token_valid_Nc: jax.Array
    surv_gpos_S: jax.Array
    q_global_C: jax.Array
    q_real_C: jax.Array
    in_kernel: jax.Array
    max_pages: int = 0
    neighbors: int = 0
    shortlist: int = 0
    page_score: str = "mean"
    live_pages: jax.Array | None = None
    score_block: int = 0
    placement: str = "rank"
    fixed_pos: jax.Array | None = None
    keeps_choice: bool = False
    reselect_now: jax.Array | None = None
    share_from: tuple[int, ...] | None = None
    kept_layout: "RecalledLayout | None" = None

    def choosers(self, n_layers: int) -> tuple[int, ...]:
        """The layers that choose pages, in order (every layer unless share_from says otherwise)."""
        if self.share_from is None:
            return tuple(range(n_layers))
        return tuple(layer for layer, source in enumerate(self.share_from) if source == layer)

    def chooser_rows(self, n_layers: int) -> tuple[int, ...]:
        """Per layer, its row among choosers(n_layers) (kept_layout's leading axis); 0 for a layer that chooses
        nothing."""
        rows = {c: i for i, c in enumerate(self.choosers(n_layers))}
        return tuple(rows.get(layer, 0) for layer in range(n_layers))

def page_scores(q_BxCxHqxD, cold_sum_BxHkvxNpxD, cold_pos_Nc, recall: Recall, inv_freq, lo_BxHkvxNpxD=None,
                hi_BxHkvxNpxD=None, k_glob_BxHkvxNcxD=None) -> jax.Array:
    """Recall score of every cold page for this layer's queries, [B, Np] (-inf for pages with nothing
    recallable), maximised over the chunk's real rows, the query heads of a group and the KV heads. The
    query is rotated at its global position; a page is summarized by its keys rotated at theirs: the mean
    key (q . mean), or with lo/hi Quest's bound sum_d max(q_d lo_d, q_d hi_d) (an upper bound on q . k), or
    with k_glob every key itself: the page's best recallable token, max q . k (the "max" rule; the mean
    misses facts mid-stream, docs/recall_tier.md)."""
    return _scores(_query_BxCxHkvxGxD(q_BxCxHqxD, cold_sum_BxHkvxNpxD.shape[1], recall, inv_freq), cold_sum_BxHkvxNpxD,
                   cold_pos_Nc, recall.token_valid_Nc, recall.q_real_C, lo_BxHkvxNpxD, hi_BxHkvxNpxD, k_glob_BxHkvxNcxD)


def _query_BxCxHkvxGxD(q_BxCxHqxD, Hkv: int, recall: Recall, inv_freq) -> jax.Array:
    """The queries rotated at their global positions, grouped by KV head (float32)."""
    B, C, Hq, D = q_BxCxHqxD.shape
    cos, sin = rope_cos_sin(recall.q_global_C, inv_freq)  # [C, D/2]
    q_rot = rotate_half_split(q_BxCxHqxD.astype(jnp.float32), cos[:, None], sin[:, None])
    return q_rot.reshape(B, C, Hkv, Hq // Hkv, D)


def _scores(q_BxCxHkvxGxD, cold_sum_BxHkvxNpxD, cold_pos_Nc, valid_Nc, q_real_C, lo_BxHkvxNpxD, hi_BxHkvxNpxD,
            k_glob_BxHkvxNcxD) -> jax.Array:
    """page_scores of a run of consecutive pages (their summaries, slots' positions and validity): each page's
    score depends on that page alone, so a block of pages scores exactly as it does inside the whole store."""
    n_pages = cold_sum_BxHkvxNpxD.shape[2]
    Pg = cold_pos_Nc.shape[0] // n_pages
    count_Np = jnp.sum((cold_pos_Nc >= 0).reshape(n_pages, Pg), axis=1)
    if k_glob_BxHkvxNcxD is not None:
        return _best_token(q_BxCxHkvxGxD, k_glob_BxHkvxNcxD, valid_Nc[None], q_real_C, Pg)
    if lo_BxHkvxNpxD is None:
        mean = cold_sum_BxHkvxNpxD / jnp.maximum(count_Np, 1)[:, None]
        s = jnp.einsum("bckgd,bkpd->bckgp", q_BxCxHkvxGxD, mean, precision=jax.lax.Precision.HIGHEST)
    else:
        filled = (count_Np > 0)[:, None]
        lo, hi = jnp.where(filled, lo_BxHkvxNpxD, 0.0), jnp.where(filled, hi_BxHkvxNpxD, 0.0)
        qx = q_BxCxHkvxGxD[..., None, :]  # [B, C, Hkv, G, 1, D] against [B, 1, Hkv, 1, Np, D]
        s = jnp.sum(jnp.maximum(qx * lo[:, None, :, None], qx * hi[:, None, :, None]), axis=-1)
    s = jnp.where(q_real_C[None, :, None, None, None], s, -jnp.inf)
    s = jnp.max(s, axis=(1, 2, 3))  # [B, Np]
    valid_Np = jnp.any(valid_Nc.reshape(n_pages, Pg), axis=1)
    return jnp.where(valid_Np[None], s, -jnp.inf)


def live_page_scores(q_BxCxHqxD, cold_sum_BxHkvxNpxD, cold_pos_Nc, recall: Recall, inv_freq, lo_BxHkvxNpxD=None,
                     hi_BxHkvxNpxD=None, gather_glob=None) -> jax.Array:
    """page_scores computed only over the first recall.live_pages pages: equal blocks of at most
    recall.score_block pages (score_block_pages) under a loop whose trip count is the number of blocks that hold anything
    (the last block is moved back to end at the last page; pages it scores twice get the same score), every
    other page -inf: the same scores within float32 rounding and the same ranking (each page's score depends on
    that page alone, but XLA may sum a block's dot in another order than the whole store's: 1 ulp on an AVX2
    machine; tests/test_recall.py). gather_glob(starts_BxM, n) -> [B, Hkv, M * n, D]: the "max" rule's scoring copy
    at the runs of n slots from those starts (None for the other rules). A store that fills pays for its fill, not its capacity."""
    B = q_BxCxHqxD.shape[0]
    Hkv, n_pages = cold_sum_BxHkvxNpxD.shape[1], cold_sum_BxHkvxNpxD.shape[2]
    Pg = cold_pos_Nc.shape[0] // n_pages
    M = score_block_pages(n_pages, recall.score_block)
    q_BxCxHkvxGxD = _query_BxCxHkvxGxD(q_BxCxHqxD, Hkv, recall, inv_freq)
    quest = lo_BxHkvxNpxD is not None

    def block(j, scores_BxNp):
        p0 = jnp.minimum(j * M, n_pages - M)
        pages = lambda x: jax.lax.dynamic_slice_in_dim(x, p0, M, axis=2)  # noqa: E731
        slots = lambda x: jax.lax.dynamic_slice_in_dim(x, p0 * Pg, M * Pg)  # noqa: E731
        k = None
        if gather_glob is not None:
            k = gather_glob(jnp.broadcast_to(p0 * Pg, (B, 1)).astype(jnp.int32), M * Pg)
        s = _scores(q_BxCxHkvxGxD, pages(cold_sum_BxHkvxNpxD), slots(cold_pos_Nc), slots(recall.token_valid_Nc),
                    recall.q_real_C, pages(lo_BxHkvxNpxD) if quest else None,
                    pages(hi_BxHkvxNpxD) if quest else None, k)
        return jax.lax.dynamic_update_slice_in_dim(scores_BxNp, s, p0, axis=1)

    n_blocks = (recall.live_pages + M - 1) // M
    return jax.lax.fori_loop(0, n_blocks, block, jnp.full((B, n_pages), -jnp.inf, jnp.float32))


def pack_int8_keys(x_f32: jax.Array) -> jax.Array:
    """The int8 scoring copy's rows of keys [..., D]: int32 [..., D / 4 + 1], the codes (quantize_int8) four to a
    word, then the scale's bits (17 words at head_dim 64). XLA:CPU gathers element by element: reading 64 codes and
    a scale apart made a layer's scoring of the default store about twice as slow (measured alone)."""
    codes, scale = quantize_int8(x_f32)
    words = jax.lax.bitcast_convert_type(codes.reshape(codes.shape[:-1] + (-1, 4)), jnp.int32)
    return jnp.concatenate([words, jax.lax.bitcast_convert_type(scale, jnp.int32)[..., None]], axis=-1)


def _row_bytes(words: jax.Array) -> jax.Array:
    """pack_int8_keys' rows as they lie in memory, int8 [..., D + 4]: the codes, then the scale's 4 bytes. Dotted
    against a query padded with 4 zero codes, the scale's bytes add nothing, so the codes need no slice of their
    own (XLA:CPU still converts the gathered words to bytes once)."""
    row = jax.lax.bitcast_convert_type(words, jnp.int8)
    return row.reshape(row.shape[:-2] + (-1,))


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 codes of each vector along the last axis and its float32 scale (max |x| / 127; an all-zero
    vector gets scale 0 and codes 0): x ~ codes * scale, each value within scale / 2."""
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    codes = jnp.round(x / jnp.where(scale > 0, scale, 1.0)[..., None])
    return jnp.clip(codes, -127, 127).astype(jnp.int8), scale.astype(jnp.float32)


def _best_token(q_BxCxHkvxGxD, k_BxHkvxNxD, valid_BxN, q_real_C, Pg: int) -> jax.Array:
    """max over each run of Pg keys (a page) of q . k, over real rows and all heads; [B, N / Pg] (-inf for a
    page with no valid key). Keys in float32, or int32 rows as pack_int8_keys made them: then the query is quantized
    the same way and q . k is the int32 dot of the codes times both scales."""
    if k_BxHkvxNxD.dtype == jnp.int32:  # pack_int8_keys' rows
        q_codes, q_scale = quantize_int8(q_BxCxHkvxGxD)
        q_codes = jnp.pad(q_codes, [(0, 0)] * 4 + [(0, 4)])
        k_scale = jax.lax.bitcast_convert_type(k_BxHkvxNxD[..., -1], jnp.float32)
        # Keys first in the product ([B, Hkv, N, C, G], the dot's own order on XLA:CPU): no transpose of the scores.
        dot = jnp.einsum("bknd,bckgd->bkncg", _row_bytes(k_BxHkvxNxD), q_codes, preferred_element_type=jnp.int32)
        # q's scale, then the key's: the float32 products in the order of the scores the fact probe was measured on
        s = dot.astype(jnp.float32) * jnp.moveaxis(q_scale, 2, 1)[:, :, None] * k_scale[..., None, None]
        s = jnp.where(q_real_C[None, None, None, :, None] & valid_BxN[:, None, :, None, None], s, -jnp.inf)
        B, Hkv, N = s.shape[:3]
        return jnp.max(s.reshape(B, Hkv, N // Pg, Pg, -1), axis=(1, 3, 4))
    else:
        s = jnp.einsum("bckgd,bknd->bckgn", q_BxCxHkvxGxD, k_BxHkvxNxD, precision=jax.lax.Precision.HIGHEST)
    s = jnp.where(q_real_C[None, :, None, None, None] & valid_BxN[:, None, None, None, :], s, -jnp.inf)
    return jnp.max(s.reshape(s.shape[:4] + (s.shape[4] // Pg, Pg)), axis=(1, 2, 3, 5))


def shortlist_scores(q_BxCxHqxD, mean_scores_BxNp, cold_pos_Nc, recall: Recall, inv_freq, gather_k) -> jax.Array:
    """The "shortlist" rule: the recall.shortlist pages of best mean key (page_scores' "mean"), each rescored
    by its best recallable token, max q . k, from its raw keys (gather_k(starts_BxM, Pg) -> [B, Hkv, M * Pg, D]) rotated
    at their global positions; every other page -inf. The "max" rule's answer whenever its top pages are on
    the shortlist, at O(store / page + shortlist * page) per step and no scoring copy (docs/recall_tier.md)."""
    B, C, Hq, D = q_BxCxHqxD.shape
    n_pages = mean_scores_BxNp.shape[1]
    Pg, M = cold_pos_Nc.shape[0] // n_pages, recall.shortlist
    idx, listed = choose_pages(mean_scores_BxNp, cold_pos_Nc, jnp.int32(M), M)  # [B, M]
    slots_BxR = (idx[:, :, None] * Pg + jnp.arange(Pg)).reshape(B, M * Pg)
    k_BxHkvxRxD = gather_k(idx * Pg, Pg).astype(jnp.float32)
    Hkv = k_BxHkvxRxD.shape[1]
    base_BxM = cold_pos_Nc[idx * Pg]
    if C * Hq <= Pg * Hkv:
        # Decode: a page holds consecutive positions base + j (written in one pass; older remnants are invalid),
        # so (R_t q) . (R_{base+j} k) = (R_{t-base} q) . (R_j k): the query turns once per page, the keys only by
        # the constant within-page offsets j (XLA:CPU folds that table; in a one-layer prototype per-key angles
        # took 1.7x as long, docs/recall_tier.md).
        cj, sj = rope_cos_sin(jnp.arange(Pg, dtype=jnp.int32), inv_freq)  # [Pg, D/2]
        k_rot = rotate_half_split(k_BxHkvxRxD.reshape(B, Hkv, M, Pg, D), cj, sj)
        cq, sq = rope_cos_sin(recall.q_global_C[None, :, None] - base_BxM[:, None, :], inv_freq)  # [B, C, M, D/2]
        q_rot = rotate_half_split(q_BxCxHqxD[:, :, None].astype(jnp.float32), cq[:, :, :, None], sq[:, :, :, None])
        s_ = jnp.einsum("bcmkgd,bkmjd->bckgmj", q_rot.reshape(B, C, M, Hkv, Hq // Hkv, D), k_rot,
                        precision=jax.lax.Precision.HIGHEST)
    else:  # a chunk's many rows: turning the query per page would cost more than turning each key once
        ck, sk = rope_cos_sin(cold_pos_Nc[slots_BxR], inv_freq)  # [B, R, D/2]
        k_rot = rotate_half_split(k_BxHkvxRxD, ck[:, None], sk[:, None])
        cq, sq = rope_cos_sin(recall.q_global_C, inv_freq)
        q_rot = rotate_half_split(q_BxCxHqxD.astype(jnp.float32), cq[:, None], sq[:, None])
        s_ = jnp.einsum("bckgd,bknd->bckgn", q_rot.reshape(B, C, Hkv, Hq // Hkv, D), k_rot,
                        precision=jax.lax.Precision.HIGHEST).reshape(B, C, Hkv, Hq // Hkv, M, Pg)
    in_page = cold_pos_Nc[slots_BxR] == (base_BxM[:, :, None] + jnp.arange(Pg)).reshape(B, M * Pg)
    ok_BxR = recall.token_valid_Nc[slots_BxR] & in_page
    s_ = jnp.where(recall.q_real_C[None, :, None, None, None, None] & ok_BxR.reshape(B, 1, 1, 1, M, Pg), s_, -jnp.inf)
    best_BxM = jnp.max(s_, axis=(1, 2, 3, 5))
    rows = jnp.arange(B)[:, None]
    return jnp.full((B, n_pages), -jnp.inf, jnp.float32).at[rows, idx].set(jnp.where(listed, best_BxM, -jnp.inf))


# Up to this many pages, choose_pages picks them one at a time (a few passes over the scores each); more go through
# one sort. Both give the same pages in the same order; on XLA:CPU the sort of a 64k-token store's 4096 pages was
# a sizeable part of each layer's choice (docs/recall_tier.md section 10).
PICK_PAGES_MAX = 16


def choose_pages(scores_BxNp, cold_pos_Nc, k_pages, max_pages: int) -> tuple[jax.Array, jax.Array]:
    """Top-k_pages pages per row ([B, max_pages] indices and an active mask), by score, ties to the more recent
    page, then to the lower index (the order of a stable sort on (-score, -newest position))."""
    n_pages = scores_BxNp.shape[1]
    newest_Np = jnp.max(cold_pos_Nc.reshape(n_pages, -1), axis=1)
    if max_pages > PICK_PAGES_MAX:
        order = jnp.lexsort((jnp.broadcast_to(-newest_Np, scores_BxNp.shape), -scores_BxNp), axis=-1)
        idx = order[:, :max_pages]
    else:
        idx = _pick_best(_sort_key(scores_BxNp), jnp.broadcast_to(newest_Np, scores_BxNp.shape), max_pages)
    chosen = jnp.take_along_axis(scores_BxNp, idx, axis=1)
    active = (jnp.arange(max_pages)[None] < k_pages) & (chosen > -jnp.inf)
    return idx, active


def _sort_key(x_f32: jax.Array) -> jax.Array:
    """int32 keys in the order jax's float sort uses (-0.0 equal to +0.0, NaN below -inf): the float's bits, the
    negative ones with their magnitude bits flipped."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x_f32 == 0, jnp.float32(0), x_f32), jnp.int32)
    key = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    return jnp.where(jnp.isnan(x_f32), jnp.iinfo(jnp.int32).min + 1, key)


def _pick_best(key_BxN, newest_BxN, k: int) -> jax.Array:
    """The k best entries per row, best first: highest key, then highest newest, then lowest index ([B, k])."""
    n = key_BxN.shape[1]
    lowest = jnp.iinfo(jnp.int32).min
    index_N = jnp.arange(n, dtype=jnp.int32)
    taken = jnp.zeros(key_BxN.shape, bool)
    picks = []
    for _ in range(k):
        best_key = jnp.max(jnp.where(taken, lowest, key_BxN), axis=1, keepdims=True)
        tied = ~taken & (key_BxN == best_key)
        best_newest = jnp.max(jnp.where(tied, newest_BxN, lowest), axis=1, keepdims=True)
        tied &= newest_BxN == best_newest
        pick = jnp.min(jnp.where(tied, index_N, n), axis=1)
        taken |= index_N == pick[:, None]
        picks.append(pick)
    return jnp.stack(picks, axis=1)


def with_neighbors(idx_BxR, active_BxR, cold_pos_Nc, n_pages: int, n: int) -> tuple[jax.Array, jax.Array]:
    """The chosen pages and the n pages on each side of each ([B, R * (2n + 1)] indices and an active mask):
    a neighbour is the page of the ring that holds the tokens right before / after (at the ring's seam the
    adjacent slot holds other tokens: inactive), and a page chosen twice is active once."""
    B, R = idx_BxR.shape
    Pg = cold_pos_Nc.shape[0] // n_pages
    off_J = jnp.arange(-n, n + 1)
    pages = (idx_BxR[:, :, None] + off_J) % n_pages  # [B, R, J]
    newest_Np = jnp.max(cold_pos_Nc.reshape(n_pages, Pg), axis=1)
    adjacent = jnp.abs(newest_Np[pages] - newest_Np[idx_BxR][:, :, None] - off_J * Pg) < Pg
    pages, act = pages.reshape(B, -1), (active_BxR[:, :, None] & adjacent).reshape(B, -1)
    M = pages.shape[1]
    earlier_MxM = jnp.arange(M)[None, :] < jnp.arange(M)[:, None]  # [j, i]: i comes before j
    dup = jnp.any((pages[:, :, None] == pages[:, None, :]) & act[:, None, :] & earlier_MxM, axis=-1)
    return pages, act & ~dup


@dataclasses.dataclass(frozen=True)
class ScoringCopy:
    """One layer's reader of the "max" rule's scoring copy: called with (starts_BxM, n), its runs of n slots from each
    start, [B, Hkv, M * n, D] (or int32 rows, the int8 copy); rows is the whole [L, ...] buffer and layer the one read
    (a slice of the layer would be a copy of its whole copy, see write_cold)."""

    rows: jax.Array
    layer: jax.Array

    def __call__(self, starts_BxM, n: int) -> jax.Array:
        return read_layer_runs(self.rows, self.layer, starts_BxM, n)


def _int8_kernel_applies(q_BxCxHqxD, gather_glob, recall: Recall) -> bool:
    """Whether this layer's scores come from the CPU kernel (kernels.page_scores): the "max" rule on the int8 copy, a
    decode step's few queries, on a machine where the kernel builds."""
    if recall.page_score != "max" or not isinstance(gather_glob, ScoringCopy) or gather_glob.rows.dtype != jnp.int32:
        return False
    C, Hq = q_BxCxHqxD.shape[1:3]
    return page_scores_kernel.applies(C * Hq // gather_glob.rows.shape[2])


def _int8_kernel_scores(q_BxCxHqxD, copy: ScoringCopy, n_pages: int, cold_pos_Nc, recall: Recall, inv_freq):
    """live_page_scores' (or, without score blocks, page_scores') answer on the int8 copy, bit for bit, from one
    kernel call: the pages the blocks would cover are scored, the rest -inf."""
    Hkv = copy.rows.shape[2]
    q_codes, q_scale = quantize_int8(_query_BxCxHkvxGxD(q_BxCxHqxD, Hkv, recall, inv_freq))
    if recall.score_block:
        M = score_block_pages(n_pages, recall.score_block)
        covered = jnp.minimum((recall.live_pages + M - 1) // M * M, n_pages)
    else:
        covered = n_pages
    return page_scores_kernel.page_scores_int8(copy.rows, copy.layer, q_codes, q_scale, recall.token_valid_Nc,
                                               recall.q_real_C, covered, cold_pos_Nc.shape[0] // n_pages)


def choose_pages_to_recall(q_BxCxHqxD, gather_kv, cold_sum, cold_lo, cold_hi, gather_glob, cold_pos_Nc,
                           recall: Recall, inv_freq) -> tuple[jax.Array, jax.Array]:
    """One layer's page choice, [B, M] page indices and an active mask (M = max_pages * (1 + 2 * neighbors)).
    cold_sum / lo / hi [B, Hkv, Np or 0, D] are the layer's page summaries and gather_glob(starts_BxM, n) -> [B, Hkv,
    M * n, D] reads its scoring copy of the keys (runs of n slots); recall.page_score says which of them the rule reads ("max": the copy,
    "quest": lo / hi, "shortlist" and "mean": the sums). With recall.score_block only the filled pages are scored
    (live_page_scores; the same scores)."""
    B = q_BxCxHqxD.shape[0]
    n_pages = cold_sum.shape[2]
    quest = (cold_lo, cold_hi) if recall.page_score == "quest" else (None, None)
    if _int8_kernel_applies(q_BxCxHqxD, gather_glob, recall):
        scores = _int8_kernel_scores(q_BxCxHqxD, gather_glob, n_pages, cold_pos_Nc, recall, inv_freq)
    elif recall.score_block:
        scores = live_page_scores(q_BxCxHqxD, cold_sum, cold_pos_Nc, recall, inv_freq, *quest,
                                  gather_glob if recall.page_score == "max" else None)
    else:
        k_glob = None
        if recall.page_score == "max":
            k_glob = gather_glob(jnp.zeros((B, 1), jnp.int32), cold_pos_Nc.shape[0])
        scores = page_scores(q_BxCxHqxD, cold_sum, cold_pos_Nc, recall, inv_freq, *quest, k_glob)
    if recall.shortlist:
        scores = shortlist_scores(q_BxCxHqxD, scores, cold_pos_Nc, recall, inv_freq, lambda s, n: gather_kv(s, n)[0])
    idx, active = choose_pages(scores, cold_pos_Nc, recall.k_pages, recall.max_pages)
    if recall.neighbors:
        idx, active = with_neighbors(idx, active, cold_pos_Nc, n_pages, recall.neighbors)
    return idx, active


@functools.partial(jax.tree_util.register_dataclass, meta_fields=[],
                   data_fields=["gpos_BxR", "valid_BxR", "surv_rot_pos_BxS", "rec_rot_pos_BxR", "q_pos_surv_BxC"])
@dataclasses.dataclass(frozen=True)
class RecalledLayout:
    """Where one page choice's tokens sit (recalled_layout): their global positions and validity, and in the raw
    segment the survivors' and their rotation positions and the survivor-segment query's. The same for every layer
    that attends that choice, so a step whose choices are all kept computes it once per choosing layer, before the
    model runs (Recall.kept_layout)."""

    gpos_BxR: jax.Array
    valid_BxR: jax.Array
    surv_rot_pos_BxS: jax.Array
    rec_rot_pos_BxR: jax.Array
    q_pos_surv_BxC: jax.Array


def recalled_layout(idx_BxM, active_BxM, cold_pos_Nc, Pg: int, recall: Recall, surv_rot_pos_BxS, surv_valid_BxS,
                    q_pos_surv_BxC) -> RecalledLayout:
    """The tokens of the chosen pages (R = M * page size Pg of them, the pages' slots in order): their global
    positions, and which are valid - a token that is also an attended survivor, on a page gathered twice, or no
    longer recallable (a kept choice whose page the ring has since restarted) is not. With them in the raw segment
    (sinks + survivors + recalled, ordered by global position), in the raw-survivor modes each key is rotated at its
    rank and the survivor-segment query sits right after them (DESIGN section 3b)."""
    B, M = idx_BxM.shape
    slots_BxR = (idx_BxM[:, :, None] * Pg + jnp.arange(Pg)).reshape(B, M * Pg)
    gpos = cold_pos_Nc[slots_BxR]
    surv_att = jnp.where(surv_valid_BxS, recall.surv_gpos_S, -2)
    dup = jnp.any(gpos[:, :, None] == surv_att[:, None, :], axis=-1)
    valid = jnp.repeat(active_BxM, Pg, axis=1) & recall.token_valid_Nc[slots_BxR] & ~dup
    surv_rank, rec_rank = _union_ranks(recall.surv_gpos_S, surv_valid_BxS, surv_rot_pos_BxS, gpos, valid)
    return RecalledLayout(gpos, valid, jnp.where(recall.in_kernel & surv_valid_BxS, surv_rank, surv_rot_pos_BxS),
                          jnp.where(recall.in_kernel & valid, rec_rank, 0),
                          q_pos_surv_BxC + jnp.sum(valid, axis=1, dtype=jnp.int32)[:, None])


def kept_layouts(cold_choice_LxBxM, cold_choice_on_LxBxM, cold_pos_Nc, Pg: int, recall: Recall, surv_rot_pos_S,
                 surv_valid_S, q_pos_surv_C, choosers: tuple[int, ...]) -> RecalledLayout:
    """recalled_layout of each choosing layer's kept choice (arrays with a leading [len(choosers)] axis): what every
    layer attends at a step that scores nothing, computed once for the layers that share a choice."""
    rows = jnp.asarray(choosers, jnp.int32)
    B = cold_choice_LxBxM.shape[1]
    bc = lambda x: jnp.broadcast_to(x, (B,) + x.shape)  # noqa: E731
    one = lambda idx, active: recalled_layout(idx, active, cold_pos_Nc, Pg, recall, bc(surv_rot_pos_S),  # noqa: E731
                                              bc(surv_valid_S), bc(q_pos_surv_C))
    return jax.vmap(one)(cold_choice_LxBxM[rows], cold_choice_on_LxBxM[rows])


def _union_ranks(surv_gpos_S, surv_valid_BxS, surv_rank_BxS, rec_gpos_BxR, rec_valid_BxR):
    """Ranks by global position among the valid survivors and recalled tokens together, survivors first on a tie
    (order_index of the two concatenated; tests/test_recall.py), for the valid entries ([B, S], [B, R]; others
    arbitrary). A survivor's rank among the survivors (surv_rank_BxS, the plan's) moves up by the recalled tokens
    before it, so only survivor-against-recalled and recalled-against-recalled pairs are compared: S R + R^2
    comparisons instead of (S + R)^2."""
    rec_first_BxSxR = rec_gpos_BxR[:, None, :] < surv_gpos_S[None, :, None]
    surv_rank = surv_rank_BxS + jnp.sum(rec_first_BxSxR & rec_valid_BxR[:, None, :], axis=2, dtype=jnp.int32)
    rec_rank = (jnp.sum(~rec_first_BxSxR & surv_valid_BxS[:, :, None], axis=1, dtype=jnp.int32)
                + jax.vmap(order_index)(rec_valid_BxR, rec_gpos_BxR))
    return surv_rank, rec_rank


def extend_window_segment(win_k, win_v, win_pos_BxW, recall: Recall, rec_k, rec_v, rec_gpos_BxR, rec_valid_BxR,
                          inv_freq):
    """The window segment with the recalled tokens added, for the "true" and "fixed" placements (rsqr: the
    window's query sits at its global position t). Each recalled raw key is rotated once, at its global position
    ("true": seen at its true distance t - g) or at recall.fixed_pos ("fixed": every one at the same distance),
    in float32 and rounded to the window's dtype like a window key. Returns (k, v, pos)."""
    pos_BxR = rec_gpos_BxR if recall.placement == "true" else jnp.broadcast_to(recall.fixed_pos, rec_gpos_BxR.shape)
    pos_BxR = jnp.where(rec_valid_BxR, pos_BxR, 0)  # an empty slot's position (-1) is never attended
    cos, sin = rope_cos_sin(pos_BxR, inv_freq)  # [B, R, D/2]
    rot_k = rotate_half_split(rec_k, cos[:, None], sin[:, None]).astype(win_k.dtype)
    k = jnp.concatenate([win_k, rot_k], axis=2)
    v = jnp.concatenate([win_v, rec_v.astype(win_v.dtype)], axis=2)
    return k, v, jnp.concatenate([win_pos_BxW, jnp.where(rec_valid_BxR, pos_BxR, -1)], axis=1)


# ----------------------------------------------------------------------------------------------------
# The cold store's writes and reads (one layer's part of a step; rsqr_jax.layer_step calls them).


def write_cold(layer, k_BxHxCxD, v_BxHxCxD, cache: KVCache, plan: StepPlan, inv_freq) -> tuple[KVCache, tuple]:
    """The chunk's raw K/V into the cold ring, and what the page rule reads of its keys rotated at their global
    positions: each page's sum ("mean", "shortlist"), its per-channel min and max ("quest"), or every key in the
    scoring copy ("max"). Only these are rotated; the stored key stays raw. A restarted page's summary starts
    afresh.

    Returns the cache and this layer's readers, for recall (which runs only while something is recallable):
    of its summaries (sum, lo, hi), () -> [B, Hkv, pages, D] each, and of its scoring copy of the keys,
    (starts_BxM, n) -> [B, Hkv, M * n, D], runs of n slots (the "max" rule; None otherwise; with the int8 copy, its
    rows of words, [B, Hkv, M * n, D / 4 + 1]). Every write is a scatter at the chunk's
    slots and pages into the [L, ...] buffer, in place; every read a gather from it, or slices of runs of slots
    from it (cache.read_layer_runs) - never a slice of the layer: a slice read before or after the write made XLA copy all layers' summaries twice per layer,
    5.7 GB per token for SmolLM2 with a 64k-token store; reading the layer's summary whole and writing it
    back cost a slice, two copies and a write of it per layer and step, the store empty or not)."""
    wr = plan.writes
    at = (layer, slice(None), slice(None), wr.cold_slot_C)
    cold_k = write_kv(cache.cold_k, at, jnp.moveaxis(k_BxHxCxD, 2, 0))
    cold_v = write_kv(cache.cold_v, at, jnp.moveaxis(v_BxHxCxD, 2, 0))
    rot_BxHxCxD = rotate_keys(k_BxHxCxD, plan.recall.q_global_C, inv_freq)
    n_pages = cache.cold_sum.shape[3]
    # Out-of-range pages (tokens not stored) are dropped: reset the pages the chunk starts, then combine.
    restart = (layer, slice(None), slice(None), jnp.where(wr.cold_first_C, wr.cold_page_C, n_pages))
    page = (layer, slice(None), slice(None), wr.cold_page_C)
    rot_CxBxHxD = jnp.moveaxis(rot_BxHxCxD, 2, 0)
    B = cache.cold_sum.shape[1]
    all_pages = jnp.broadcast_to(jnp.arange(n_pages, dtype=jnp.int32), (B, n_pages))

    def summarize(buf, reset, combine):
        buf = getattr(buf.at[restart].set(reset, mode="drop").at[page], combine)(rot_CxBxHxD, mode="drop")
        return buf, lambda: gather_layer_slots(buf, layer, all_pages)

    out = dict(cold_k=cold_k, cold_v=cold_v)
    # The rule's own summaries only: a rule that reads no sums (spec.SUM_RULES) keeps none, rather than updating
    # them in every layer at every step for nothing.
    layer_sum = lambda: jnp.zeros(cache.cold_sum.shape[1:], cache.cold_sum.dtype)  # noqa: E731  (no sums kept)
    if cache.cold_sum.shape[4]:
        out["cold_sum"], layer_sum = summarize(cache.cold_sum, 0.0, "add")
    lo = hi = lambda: jnp.zeros(cache.cold_lo.shape[1:], cache.cold_lo.dtype)  # noqa: E731  (no Quest pages)
    glob = None
    rule = plan.recall.page_score
    if rule == "quest":
        (out["cold_lo"], lo), (out["cold_hi"], hi) = (summarize(cache.cold_lo, jnp.inf, "min"),
                                                      summarize(cache.cold_hi, -jnp.inf, "max"))
    if rule == "max":
        # The "max" rule's scoring copy: written in place like cold_k, and read back like the recalled K/V, as
        # gathers of this layer's slots from the [L, ...] buffer (only the filled ones: recall.live_page_scores).
        # A slice read (before or after the write) made XLA copy the whole buffer twice per layer (see the
        # docstring).
        # ColdStore.score_dtype "int8": each key's codes and scale in one row of int32 words
        rows = pack_int8_keys(rot_BxHxCxD) if cache.cold_k_glob.dtype == jnp.int32 else rot_BxHxCxD
        k_glob = out["cold_k_glob"] = write_kv(cache.cold_k_glob, at, jnp.moveaxis(rows, 2, 0))
        glob = ScoringCopy(k_glob, layer)
    return cache.replace(**out), (layer_sum, lo, hi, glob)


def read_cold_runs(cache: KVCache, layer, starts_BxM, n: int) -> tuple[jax.Array, jax.Array]:
    """Raw K and V [B, Hkv, M * n, D] of one layer's cold slots in runs of n from each start (the chosen pages), in
    their logical dtype."""
    def take(buf):
        x = read_layer_runs(buf, layer, starts_BxM, n)
        return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if buf.dtype == BITS_DTYPE else x

    return take(cache.cold_k), take(cache.cold_v)
