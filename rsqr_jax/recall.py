"""The recall tier: a cold store of every evicted token's raw K/V, and each layer's recall of its best pages.

It is the one module that knows the store: its state (`ColdState`, the cache's optional `cold` part: absent when
recall is off), where each new token goes in its ring (`plan_ring`, once per step), the writes of a layer's raw K/V
and of the page summaries its rule scores (`write_cold`), the scores and the top-R choice with neighbours
(`choose_pages_to_recall`), and where the recalled tokens sit (`recalled_layout`: in the raw segment at their
ranks, read where they lie as a `kernels.store.StoredRuns`; or added to the window segment,
`extend_window_segment`). The step (rsqr_jax.update) calls it; it calls only kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from rsqr_jax.kernels import page_scores as page_scores_kernel
from rsqr_jax.kernels.exact_rope import rope_cos_sin, rotate_half_split
from rsqr_jax.kernels.store import StoredRuns, as_logical, gather_layer_slots, read_layer_runs, write_kv
from rsqr_jax.policy import order_index
from rsqr_jax.kernels.exact_rope import rotate_keys
from rsqr_jax.spec import CacheSpec

# The state's arrays by their names in a session file (and in KVCache's flat view, rsqr_jax.cache.cache_arrays).
FILE_NAMES = {"k": "cold_k", "v": "cold_v", "pos": "cold_pos", "sums": "cold_sum", "lo": "cold_lo", "hi": "cold_hi",
              "scoring": "cold_k_glob", "choice": "cold_choice", "choice_on": "cold_choice_on", "step": "cold_step"}
# Each array's axis that counts ring slots, or pages (one page = page_size slots): what a session file cuts.
SLOT_AXES = {"k": 3, "v": 3, "scoring": 3, "pos": 0}
PAGE_AXES = {"sums": 3, "lo": 3, "hi": 3}


@functools.partial(jax.tree_util.register_dataclass, meta_fields=["page_size"],
                   data_fields=list(FILE_NAMES))
@dataclasses.dataclass(frozen=True)
class ColdState:
    """The cold store of every layer (L), stacked like the cache's K/V. Every non-sink token is written raw on
    arrival at ring slot (r - N) mod Nc (r: its stream-relative position, N: the sinks), so the ring is made of
    pages of page_size consecutive tokens; a token is recallable once it has left the window.

    k, v [L, B, Hkv, Nc, D]: raw K/V as stored (kernels.store). pos [Nc]: each slot's global position (-1 = empty).
    The page rule's summaries, each present only for the rules that read it (else None):
    sums [L, B, Hkv, Np, D] float32, each page's sum of its keys rotated at their global positions ("mean",
    "shortlist"); lo / hi, their per-channel minimum and maximum ("quest"); scoring [L, B, Hkv, Nc, D] float32 every
    key rotated at its global position ("max"; with score_dtype "int8" int32 [.., D / 4 + 1], each key's int8 codes
    four to a word, then its float32 scale's bits: pack_int8_keys).
    choice / choice_on [L, B, M], step [1]: with a kept choice (ColdStore.reselect > 1, or share_from), the pages
    each layer chose when it last scored the store (M = pages gathered, with an active mask) and the steps since
    a prompt (when it scores again); None otherwise."""

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    sums: jax.Array | None
    lo: jax.Array | None
    hi: jax.Array | None
    scoring: jax.Array | None
    choice: jax.Array | None
    choice_on: jax.Array | None
    step: jax.Array | None
    page_size: int

    def replace(self, **kw) -> "ColdState":
        return dataclasses.replace(self, **kw)

    @property
    def n_pages(self) -> int:
        return self.pos.shape[-1] // self.page_size


def init_cold(spec: CacheSpec, kv_dtype) -> ColdState | None:
    """An empty cold store for `spec` (None without one), K/V in kv_dtype."""
    if spec.cold is None:
        return None
    L, B, H, D = spec.num_layers, spec.batch, spec.num_kv_heads, spec.head_dim
    Nc, Np = spec.cold_slots, spec.cold_pages
    rule = spec.page_score
    pages = lambda: jnp.zeros((L, B, H, Np, D), jnp.float32)  # noqa: E731
    row_dtype, row_width = spec.scoring_copy_row
    M = spec.recall_pages_gathered
    return ColdState(
        k=jnp.zeros((L, B, H, Nc, D), kv_dtype), v=jnp.zeros((L, B, H, Nc, D), kv_dtype),
        pos=jnp.full((Nc,), -1, jnp.int32),
        sums=pages() if spec.keeps_page_sums else None,
        lo=pages() if rule == "quest" else None, hi=pages() if rule == "quest" else None,
        scoring=jnp.zeros((L, B, H, Nc, row_width), jnp.dtype(row_dtype)) if rule == "max" else None,
        choice=jnp.zeros((L, B, M), jnp.int32) if spec.reselects else None,
        choice_on=jnp.zeros((L, B, M), bool) if spec.reselects else None,
        step=jnp.zeros((1,), jnp.int32) if spec.reselects else None,
        page_size=spec.cold.page_size)


@dataclasses.dataclass(frozen=True)
class RecallConfig:
    """The static settings of recall in one compiled step: max_pages chosen per layer (0: the store is written,
    nothing recalled), neighbors on each side of a chosen page, the "shortlist" rule's page count, the rule, where
    recalled tokens sit, how often a layer chooses afresh, and per layer the layer whose choice it attends (None:
    its own; ColdStore.choice_sources)."""

    max_pages: int = 0
    neighbors: int = 0
    shortlist: int = 0
    page_score: str = "mean"
    placement: str = "rank"
    reselect: int = 1
    share_from: tuple[int, ...] | None = None


def config_of(spec: CacheSpec) -> RecallConfig | None:
    """The recall settings of a cache spec (None without a cold store)."""
    if spec.cold is None:
        return None
    return RecallConfig(max_pages=spec.max_recall_pages, neighbors=spec.cold.neighbors,
                        shortlist=spec.shortlist_pages, page_score=spec.cold.page_score,
                        placement=spec.cold.placement, reselect=spec.cold.reselect,
                        share_from=spec.cold.choice_sources(spec.num_layers))


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
                                "keeps_choice", "share_from", "page_size"],
                   data_fields=["k_pages", "token_valid_Nc", "surv_gpos_S", "q_global_C", "q_real_C", "in_kernel",
                                "live_pages", "fixed_pos", "reselect_now", "kept_layout", "slot_C", "page_C",
                                "first_C", "pos_Nc", "next_step"])
@dataclasses.dataclass(frozen=True)
class Recall:
    """One step's plan of the recall tier, shared by every layer (`plan_ring` makes it).

    k_pages: the policy's recall_pages; token_valid_Nc: cold slots holding a token that has left the window;
    surv_gpos_S: the survivors' global positions (for deduplication and ranks); q_global_C / q_real_C: the chunk's
    positions and which of its rows are real; in_kernel: survivor keys are rotated at their rank in the kernel;
    live_pages: the leading pages that may hold a recallable token (the ring fills from slot 0 until it wraps; 0 =
    nothing to recall this step, or k_pages = 0: the layers skip recall); fixed_pos: the global position the
    "fixed" placement rotates every recalled key at (the chunk's first position minus the policy's window);
    reselect_now: this step scores the store and chooses afresh; kept_layout (with a kept choice and reselect > 1;
    None otherwise): recalled_layout of every choosing layer's kept choice (a leading axis over choosers(L)), what
    the layers attend at a step that does not choose.
    The ring's writes: slot_C / page_C, each chunk token's cold slot and page (out of range: not written), first_C:
    it starts its page afresh; pos_Nc: every slot's global position after them; next_step: ColdState.step after
    the step (None without a kept choice).
    Static (RecallConfig): max_pages chosen per layer (0 = no recall in this compilation); neighbors: pages on each
    side of a chosen page gathered with it; shortlist: with the "shortlist" rule, how many pages of best mean key
    are rescored by their best token; page_score: the rule (spec.PAGE_SCORES); score_block: pages scored per block
    of the filled prefix (0 = every page, every step); placement (spec.PLACEMENTS): where recalled tokens sit;
    keeps_choice: layers keep their page choice in the cache between scorings; share_from (None = every layer
    chooses): per layer, the layer whose choice it attends (-1: none); page_size: the store's (0: read from the
    summaries' shapes)."""

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
    slot_C: jax.Array | None = None
    page_C: jax.Array | None = None
    first_C: jax.Array | None = None
    pos_Nc: jax.Array | None = None
    next_step: jax.Array | None = None
    page_size: int = 0

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


def plan_ring(cold: ColdState, config: RecallConfig | None, *, k_pages, g_C, r_C, real_C, n_valid, n_sink, w0,
              surv_gpos_S, in_kernel, window, surv_rot_pos_S, surv_valid_S, q_pos_surv_C) -> Recall:
    """The recall tier's part of a step's plan: every real non-sink token of the chunk is written raw into the cold
    ring at (r - N) mod Nc, and a page whose first slot is written starts afresh (its older remnants are no longer
    recallable); then what is recallable (the tokens that have left the window, w0 = the window's first position),
    and with a kept choice whether this step chooses afresh: every reselect-th step, and at every chunk of more
    than one token (a prompt: the question's own rows choose the pages its first answer token reads)."""
    config = RecallConfig() if config is None else config
    Nc, Pg = cold.pos.shape[0], cold.page_size
    n_pages = Nc // Pg
    cold_C = real_C & (r_C >= n_sink)
    slot_C = jnp.where(cold_C, (r_C - n_sink) % Nc, Nc)
    page_C = jnp.where(cold_C, slot_C // Pg, n_pages)
    first_C = cold_C & (slot_C % Pg == 0)
    restart = jnp.zeros((n_pages,), jnp.int32).at[page_C].max(first_C.astype(jnp.int32), mode="drop") > 0
    pos_Nc = jnp.where(jnp.repeat(restart, Pg), -1, cold.pos).at[slot_C].set(g_C, mode="drop")
    # The recallable slots, and the leading pages that hold them (once per step, for every layer): before the ring
    # wraps they are a prefix that grows with the stream, after it every page.
    token_valid = (pos_Nc >= 0) & (pos_Nc < w0)
    live_slots = jnp.max(jnp.where(token_valid, jnp.arange(1, Nc + 1, dtype=jnp.int32), 0))
    live_pages = jnp.where(k_pages > 0, (live_slots + Pg - 1) // Pg, 0).astype(jnp.int32)
    steps = jnp.sum(cold.step) if cold.step is not None else jnp.int32(0)
    # a prompt restarts the count: the first decode step after it chooses afresh too (its one row is the answer's
    # query, where the prompt's choice is a max over its rows)
    next_step = None if cold.step is None else jnp.where(n_valid > 1, 0, cold.step + 1)
    recall = Recall(k_pages=k_pages, token_valid_Nc=token_valid, surv_gpos_S=surv_gpos_S, q_global_C=g_C,
                    q_real_C=real_C, in_kernel=in_kernel, max_pages=config.max_pages, neighbors=config.neighbors,
                    shortlist=config.shortlist, page_score=config.page_score, live_pages=live_pages,
                    score_block=SCORE_BLOCK_PAGES, placement=config.placement, fixed_pos=g_C[0] - window,
                    keeps_choice=(config.reselect > 1 or config.share_from is not None) and bool(config.max_pages),
                    share_from=config.share_from,
                    reselect_now=(steps % config.reselect == 0) | (n_valid > 1),
                    slot_C=slot_C, page_C=page_C, first_C=first_C, pos_Nc=pos_Nc, next_step=next_step, page_size=Pg)
    if recall.keeps_choice and config.reselect > 1:
        # A step that chooses nothing attends the kept choices: their tokens' positions, validity and ranks once per
        # choosing layer here, not in every layer that attends them.
        recall = dataclasses.replace(recall, kept_layout=kept_layouts(
            cold.choice, cold.choice_on, pos_Nc, Pg, recall, surv_rot_pos_S, surv_valid_S, q_pos_surv_C,
            recall.choosers(cold.choice.shape[0])))
    return recall


def commit_ring(cold: ColdState, recall: Recall) -> ColdState:
    """The cold store's positions and step count after the step (its arrays were written by the layers)."""
    return cold.replace(pos=recall.pos_Nc, step=recall.next_step)


def page_scores(q_BxCxHqxD, cold_sum_BxHkvxNpxD, cold_pos_Nc, recall: Recall, inv_freq, lo_BxHkvxNpxD=None,
                hi_BxHkvxNpxD=None, k_glob_BxHkvxNcxD=None) -> jax.Array:
    """Recall score of every cold page for this layer's queries, [B, Np] (-inf for pages with nothing
    recallable), maximised over the chunk's real rows, the query heads of a group and the KV heads. The
    query is rotated at its global position; a page is summarized by its keys rotated at theirs: the mean
    key (q . mean), or with lo/hi Quest's bound sum_d max(q_d lo_d, q_d hi_d) (an upper bound on q . k), or
    with k_glob every key itself: the page's best recallable token, max q . k (the "max" rule; a page's mean key
    misses a fact that stands out only in one token). cold_sum is None where the rule reads no sums; the page size
    is the store's (Recall.page_size)."""
    Hkv = next(x for x in (cold_sum_BxHkvxNpxD, lo_BxHkvxNpxD, k_glob_BxHkvxNcxD) if x is not None).shape[1]
    return _scores(_query_BxCxHkvxGxD(q_BxCxHqxD, Hkv, recall, inv_freq), cold_sum_BxHkvxNpxD, cold_pos_Nc,
                   recall.token_valid_Nc, recall.q_real_C, lo_BxHkvxNpxD, hi_BxHkvxNpxD, k_glob_BxHkvxNcxD,
                   _n_pages(recall, cold_pos_Nc, cold_sum_BxHkvxNpxD, lo_BxHkvxNpxD))


def _n_pages(recall: Recall, cold_pos_Nc, *summaries) -> int:
    """Pages of the store: by the plan's page size, else by the page axis of the first summary given."""
    if recall.page_size:
        return cold_pos_Nc.shape[0] // recall.page_size
    return next(x for x in summaries if x is not None).shape[2]


def _query_BxCxHkvxGxD(q_BxCxHqxD, Hkv: int, recall: Recall, inv_freq) -> jax.Array:
    """The queries rotated at their global positions, grouped by KV head (float32)."""
    B, C, Hq, D = q_BxCxHqxD.shape
    cos, sin = rope_cos_sin(recall.q_global_C, inv_freq)  # [C, D/2]
    q_rot = rotate_half_split(q_BxCxHqxD.astype(jnp.float32), cos[:, None], sin[:, None])
    return q_rot.reshape(B, C, Hkv, Hq // Hkv, D)


def _scores(q_BxCxHkvxGxD, cold_sum_BxHkvxNpxD, cold_pos_Nc, valid_Nc, q_real_C, lo_BxHkvxNpxD, hi_BxHkvxNpxD,
            k_glob_BxHkvxNcxD, n_pages: int) -> jax.Array:
    """page_scores of a run of n_pages consecutive pages (their summaries, slots' positions and validity): each
    page's score depends on that page alone, so a block of pages scores exactly as it does inside the whole store."""
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
                     hi_BxHkvxNpxD=None, gather_glob=None, *, n_kv_heads: int | None = None) -> jax.Array:
    """page_scores computed only over the first recall.live_pages pages: equal blocks of at most
    recall.score_block pages (score_block_pages) under a loop whose trip count is the number of blocks that hold anything
    (the last block is moved back to end at the last page; pages it scores twice get the same score), every
    other page -inf: the same scores within float32 rounding and the same ranking (each page's score depends on
    that page alone, but XLA may sum a block's dot in another order than the whole store's: 1 ulp on an AVX2
    machine). gather_glob(starts_BxM, n) -> [B, Hkv, M * n, D]: the "max" rule's scoring copy at the runs of n slots
    from those starts (None for the other rules; then n_kv_heads says Hkv where no summary is given). A store that
    fills pays for its fill, not its capacity."""
    B = q_BxCxHqxD.shape[0]
    summary = cold_sum_BxHkvxNpxD if cold_sum_BxHkvxNpxD is not None else lo_BxHkvxNpxD
    Hkv = summary.shape[1] if summary is not None else n_kv_heads
    n_pages = _n_pages(recall, cold_pos_Nc, cold_sum_BxHkvxNpxD, lo_BxHkvxNpxD)
    Pg = cold_pos_Nc.shape[0] // n_pages
    M = score_block_pages(n_pages, recall.score_block)
    q_BxCxHkvxGxD = _query_BxCxHkvxGxD(q_BxCxHqxD, Hkv, recall, inv_freq)
    quest = lo_BxHkvxNpxD is not None

    def block(j, scores_BxNp):
        p0 = jnp.minimum(j * M, n_pages - M)
        pages = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, p0, M, axis=2)  # noqa: E731
        slots = lambda x: jax.lax.dynamic_slice_in_dim(x, p0 * Pg, M * Pg)  # noqa: E731
        k = None
        if gather_glob is not None:
            k = gather_glob(jnp.broadcast_to(p0 * Pg, (B, 1)).astype(jnp.int32), M * Pg)
        s = _scores(q_BxCxHkvxGxD, pages(cold_sum_BxHkvxNpxD), slots(cold_pos_Nc), slots(recall.token_valid_Nc),
                    recall.q_real_C, pages(lo_BxHkvxNpxD) if quest else None,
                    pages(hi_BxHkvxNpxD) if quest else None, k, M)
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
    the shortlist, at O(store / page + shortlist * page) per step and no scoring copy."""
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
        # took 1.7x as long).
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
# a sizeable part of each layer's choice.
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


def layer_pages(buf: jax.Array, layer) -> jax.Array:
    """One layer's page summaries [B, Hkv, Np, D] of a [L, B, Hkv, Np, D] stack: a gather from the whole stack (a
    slice of the layer read next to the layer's write would copy every layer's summaries)."""
    B, n_pages = buf.shape[1], buf.shape[3]
    return gather_layer_slots(buf, layer, jnp.broadcast_to(jnp.arange(n_pages, dtype=jnp.int32), (B, n_pages)))


def read_cold_runs(cold: ColdState, layer, starts_BxM, n: int) -> tuple[jax.Array, jax.Array]:
    """Raw K and V [B, Hkv, M * n, D] of one layer's cold slots in runs of n from each start (the chosen pages), in
    their logical dtype."""
    return as_logical(read_layer_runs(cold.k, layer, starts_BxM, n)), as_logical(read_layer_runs(cold.v, layer,
                                                                                                  starts_BxM, n))


def choose_pages_to_recall(q_BxCxHqxD, cold: ColdState, layer, recall: Recall, inv_freq) -> tuple[jax.Array, jax.Array]:
    """One layer's page choice, [B, M] page indices and an active mask (M = max_pages * (1 + 2 * neighbors)), from
    what the rule reads of the store as this step's layer wrote it: the scoring copy ("max"), the per-channel
    bounds ("quest") or the sums ("shortlist", "mean"). With recall.score_block only the filled pages are scored
    (live_page_scores; the same scores)."""
    B = q_BxCxHqxD.shape[0]
    n_pages, Hkv = cold.n_pages, cold.k.shape[2]
    cold_pos_Nc = recall.pos_Nc
    rule = recall.page_score
    sums = layer_pages(cold.sums, layer) if rule in ("mean", "shortlist") else None
    quest = (layer_pages(cold.lo, layer), layer_pages(cold.hi, layer)) if rule == "quest" else (None, None)
    copy = ScoringCopy(cold.scoring, layer) if rule == "max" else None
    if _int8_kernel_applies(q_BxCxHqxD, copy, recall):
        scores = _int8_kernel_scores(q_BxCxHqxD, copy, n_pages, cold_pos_Nc, recall, inv_freq)
    elif recall.score_block:
        scores = live_page_scores(q_BxCxHqxD, sums, cold_pos_Nc, recall, inv_freq, *quest, copy, n_kv_heads=Hkv)
    else:
        k_glob = copy(jnp.zeros((B, 1), jnp.int32), cold_pos_Nc.shape[0]) if copy is not None else None
        scores = page_scores(q_BxCxHqxD, sums, cold_pos_Nc, recall, inv_freq, *quest, k_glob)
    if recall.shortlist:
        scores = shortlist_scores(q_BxCxHqxD, scores, cold_pos_Nc, recall, inv_freq,
                                  lambda s, n: read_cold_runs(cold, layer, s, n)[0])
    idx, active = choose_pages(scores, cold_pos_Nc, recall.k_pages, recall.max_pages)
    if recall.neighbors:
        idx, active = with_neighbors(idx, active, cold_pos_Nc, n_pages, recall.neighbors)
    return idx, active


def stored_runs(cold: ColdState, layer, idx_BxM, layout: "RecalledLayout") -> StoredRuns:
    """The chosen pages' tokens as more slots of the raw segment, where they lie in the store."""
    Pg = cold.page_size
    return StoredRuns(cold.k, cold.v, layer, idx_BxM * Pg, Pg, layout.rec_rot_pos_BxR, layout.valid_BxR)


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
    rank and the survivor-segment query sits right after them."""
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


def write_cold(cold: ColdState, layer, k_BxHxCxD, v_BxHxCxD, recall: Recall, inv_freq) -> ColdState:
    """One layer's chunk of raw K/V into the cold ring, and what the page rule reads of its keys rotated at their
    global positions: each page's sum ("mean", "shortlist"), its per-channel min and max ("quest"), or every key in
    the scoring copy ("max"). Only these are rotated; the stored key stays raw. A restarted page's summary starts
    afresh. Every write is a scatter at the chunk's slots and pages into the [L, ...] stack, in place (a slice of
    the layer read before or after the write made XLA copy all layers' summaries twice per layer: 5.7 GB per token
    for SmolLM2 with a 64k-token store)."""
    at = (layer, slice(None), slice(None), recall.slot_C)
    out = dict(k=write_kv(cold.k, at, jnp.moveaxis(k_BxHxCxD, 2, 0)), v=write_kv(cold.v, at, jnp.moveaxis(v_BxHxCxD, 2, 0)))
    rot_BxHxCxD = rotate_keys(k_BxHxCxD, recall.q_global_C, inv_freq)
    # Out-of-range pages (tokens not stored) are dropped: reset the pages the chunk starts, then combine.
    restart = (layer, slice(None), slice(None), jnp.where(recall.first_C, recall.page_C, cold.n_pages))
    page = (layer, slice(None), slice(None), recall.page_C)
    rot_CxBxHxD = jnp.moveaxis(rot_BxHxCxD, 2, 0)

    def summarize(buf, reset, combine):
        return getattr(buf.at[restart].set(reset, mode="drop").at[page], combine)(rot_CxBxHxD, mode="drop")

    if cold.sums is not None:
        out["sums"] = summarize(cold.sums, 0.0, "add")
    if cold.lo is not None:
        out["lo"], out["hi"] = summarize(cold.lo, jnp.inf, "min"), summarize(cold.hi, -jnp.inf, "max")
    if cold.scoring is not None:
        # ColdStore.score_dtype "int8": each key's codes and scale in one row of int32 words
        rows = pack_int8_keys(rot_BxHxCxD) if cold.scoring.dtype == jnp.int32 else rot_BxHxCxD
        out["scoring"] = write_kv(cold.scoring, at, jnp.moveaxis(rows, 2, 0))
    return cold.replace(**out)
