"""The caller's side of a step (docs/design.md §3-5): which slot each new token goes to, which positions the
kernel sees, what upkeep each policy runs, and the positions committed afterwards.

A step is planned once (`plan_step`, shared by every layer); the model runs, and each of its layers calls
`rsqr_jax.layer_step.attend_layer` with the plan (K/V writes, upkeep, the cold store, attention); then the
new positions are committed (`commit`). `step` does all three for a chunk and never runs inside the model. Policy-specific work is read from the mode
traits table (`policy.MODE_TRAITS`) and guarded by `lax.cond`, so a single fixed policy pays only for its
own branch (under `vmap` a cond becomes a select: the price of a mixed sweep).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from rsqr_jax import policy as P
from rsqr_jax import recall as _recall
from rsqr_jax.cache import BITS_DTYPE, KV_FIELDS, KVCache, init_cache
from rsqr_jax.policy import Policy, is_flagged, mode_traits, order_index, window_start
from rsqr_jax.recall import Recall
from rsqr_jax.spec import CacheSpec

ApplyFn = Callable  # (params, tokens_BxC, cache, plan) -> (logits_BxCxV, cache)


def _dataclass(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_dataclass
class Writes:
    """Where each chunk token's K/V is written (slot out of range = not written) and the position its key
    is rotated at when written (0 = stored raw); cold_slot_C / cold_page_C: its raw copy's slot and page in
    the recall tier's cold ring; cold_first_C: it starts its page afresh."""

    win_slot_C: jax.Array
    win_rot_pos_C: jax.Array
    surv_slot_C: jax.Array
    surv_rot_pos_C: jax.Array
    cold_slot_C: jax.Array
    cold_page_C: jax.Array
    cold_first_C: jax.Array


@_dataclass
class KernelArgs:
    """The position arguments of the two-segment kernel (DESIGN section 6), shared by every layer.

    win_pos_W: position of each window slot in the window query's frame (-1 = not attended);
    surv_rot_pos_S: the position each survivor key is rotated at inside the kernel (0 = the stored key
    as is); surv_valid_S: which survivor slots are attended; q_pos_win_C / q_pos_surv_C: the query's
    position for each segment (the relocation).
    """

    win_pos_W: jax.Array
    q_pos_win_C: jax.Array
    surv_rot_pos_S: jax.Array
    surv_valid_S: jax.Array
    q_pos_surv_C: jax.Array


@_dataclass
class Upkeep:
    """Policy upkeep of the step. rerotate: rotate stored keys again by (new - old) where *_hop;
    refresh: rotate rsqr_precompute's copy at surv_rank where refresh_S; rotate_window: streamingllm's
    rotation of the raw window at win_rank; replay: consolidate (recompute K/V by a forward pass)."""

    rerotate: jax.Array
    win_hop_W: jax.Array
    surv_hop_S: jax.Array
    win_rot_old_W: jax.Array
    win_rot_new_W: jax.Array
    surv_rot_old_S: jax.Array
    surv_rot_new_S: jax.Array
    refresh: jax.Array
    refresh_S: jax.Array
    use_precompute: jax.Array
    rotate_window: jax.Array
    replay: jax.Array
    win_rank_W: jax.Array
    surv_rank_S: jax.Array
    q_rank_C: jax.Array


@_dataclass
class Positions:
    """The cache's position fields after the step (committed by `commit`)."""

    win_pos: jax.Array
    win_stored_rot: jax.Array
    surv_pos: jax.Array
    surv_rank: jax.Array
    surv_stored_rot: jax.Array
    surv_copy_pos: jax.Array
    cold_pos: jax.Array
    cold_step: jax.Array
    t: jax.Array


@_dataclass
class StepPlan:
    """Everything a layer needs to update its K/V and attend, for one chunk; identical for all layers
    (but for the recalled pages, which each layer chooses from its own queries). logits_row: None, or the one
    row of the chunk whose logits the caller reads (step's last_logits): a model may compute only that row's
    logits, [B, 1, V] (a prompt chunk's other rows would cost a fifth of its multiply-adds for nothing)."""

    writes: Writes
    kernel: KernelArgs
    upkeep: Upkeep
    recall: Recall
    next: Positions
    logits_row: jax.Array | None = None


def _pinned(g_N: jax.Array, cache: KVCache) -> jax.Array:
    """Which global positions lie in a pinned span of the cache (docs/design.md §3c)."""
    if not cache.pin_lo.shape[0]:
        return jnp.zeros(g_N.shape, bool)
    return jnp.any((cache.pin_lo <= g_N[:, None]) & (g_N[:, None] < cache.pin_hi), axis=1)


def plan_step(cache: KVCache, policy: Policy, chunk: int, n_valid: jax.Array | int | None = None, *,
              max_recall_pages: int = 0, recall_neighbors: int = 0, recall_shortlist: int = 0,
              page_score: str = "mean", placement: str = "rank", reselect: int = 1,
              share_from: tuple[int, ...] | None = None) -> StepPlan:
    """Bookkeeping for appending `chunk` tokens (the first n_valid of them real) under `policy`.

    Token set semantics: the chunk attends to the cached set *after* this step's evictions (for one
    token that is exactly DESIGN's set(t); for a chunk it is StreamingLLM's evict-for-space).
    max_recall_pages / recall_neighbors / recall_shortlist / page_score (static, CacheSpec.recall_args): how
    many cold pages a layer may choose, the pages on each side of a chosen one that come with it, the
    "shortlist" rule's page count, the rule itself (which page summaries the cold store keeps and scores) and
    where recalled tokens sit (spec.PLACEMENTS), how often a layer chooses its pages afresh (ColdStore.reselect),
    and, per layer, the layer whose choice it attends (ColdStore.choice_sources; None: its own).
    """
    C = chunk
    n_valid = jnp.asarray(C if n_valid is None else n_valid, jnp.int32)
    mode = mode_traits(policy.mode)
    g_C = cache.t + jnp.arange(C, dtype=jnp.int32)
    real_C = jnp.arange(C) < n_valid
    n = cache.t + n_valid
    W, S = cache.win_pos.shape[0], cache.surv_pos.shape[0]
    N = policy.n_sink
    w0 = window_start(n, policy.window, policy.block, cache.start)
    r_C = g_C - cache.start  # stream-relative positions: what sinks and flags are defined on

    win_slot = jnp.where(real_C, g_C % W, W)
    win_pos = cache.win_pos.at[win_slot].set(g_C, mode="drop")

    # Sinks, pinned and flagged tokens get a survivor entry on arrival (their raw shadow while in the window).
    keeps_pins = (policy.mode != P.FULL) & (policy.mode != P.WINDOW)
    pin_C = keeps_pins & _pinned(g_C, cache)
    need_C = real_C & ((r_C < N) | is_flagged(r_C, N, policy.delta) | pin_C)
    free_slots = jnp.nonzero(cache.surv_pos < 0, size=C, fill_value=S)[0] if S else jnp.full((C,), S)
    k_C = jnp.clip(jnp.cumsum(need_C) - 1, 0, C - 1)
    surv_slot = jnp.where(need_C, free_slots[k_C], S)
    surv_pos = cache.surv_pos.at[surv_slot].set(g_C, mode="drop")

    # Overflow: too many survivors that are neither sinks nor pinned (entries that left the window).
    ev = (surv_pos >= 0) & (surv_pos < w0) & (surv_pos - cache.start >= N) & ~_pinned(surv_pos, cache)
    k_ev = jnp.sum(ev)
    age = order_index(ev, surv_pos)
    cap = policy.max_survivors
    fifo_drop = ev & (age < k_ev - cap)
    k_half = k_ev - k_ev // 2
    dec_drop = ev & (k_ev > cap) & ((age % 2 == 1) | ((age // 2) < k_half - cap))
    drop = jnp.where(policy.overflow == P.OVERFLOW_ID["fifo"], fifo_drop, dec_drop)
    surv_pos = jnp.where(drop, -1, surv_pos)

    # Rank timeline: survivor segment (sinks + survivors that left the window), then the window.
    live = surv_pos >= 0
    att = live & (surv_pos < w0)
    n_seg = jnp.sum(att).astype(jnp.int32)
    surv_rank = jnp.where(live, jnp.where(att, order_index(att, surv_pos), n_seg + surv_pos - w0), -1)
    win_in = (win_pos >= 0) & (win_pos >= w0)
    win_rank = jnp.where(win_in, n_seg + win_pos - w0, -1)
    q_rank = n_seg + g_C - w0

    win_write = jnp.where(mode.rank_store, q_rank, jnp.where(mode.raw_window, 0, g_C))
    surv_write = jnp.where(mode.rank_store, q_rank, jnp.where(mode.surv_global, g_C, 0))

    # Stored-rotation bookkeeping (rerotate hops, replay events).
    win_rot_old = cache.win_stored_rot.at[win_slot].set(win_write, mode="drop")
    surv_rot_old = cache.surv_stored_rot.at[surv_slot].set(surv_write, mode="drop")
    win_hop = win_in & (win_rank != win_rot_old)
    surv_hop = live & (surv_rank != surv_rot_old)
    any_hop = jnp.any(win_hop) | jnp.any(surv_hop)
    win_rot_new = jnp.where(mode.rank_store & win_in, win_rank, win_rot_old)
    surv_rot_new = jnp.where(mode.rank_store & live, surv_rank, surv_rot_old)

    # rsqr_precompute: (re)rotate the copy of survivors whose rank is new or changed.
    if cache.surv_copy_pos.shape[0]:
        copy_pos = cache.surv_copy_pos.at[surv_slot].set(-1, mode="drop")
        refresh_S = att & (copy_pos != surv_rank)
        refresh = mode.precompute & jnp.any(refresh_S)
        copy_pos = jnp.where(mode.precompute & refresh_S, surv_rank, copy_pos)
    else:
        copy_pos, refresh_S, refresh = cache.surv_copy_pos, jnp.zeros((S,), bool), jnp.asarray(False)

    # Recall tier: every real non-sink token is written raw into the cold ring at (r - N) mod Nc; a page
    # whose first slot is written starts afresh (its older remnants are no longer recallable).
    Nc = cache.cold_pos.shape[0]
    n_pages = cache.cold_sum.shape[3]
    if Nc:
        Pg = Nc // n_pages
        cold_C = real_C & (r_C >= N)
        cold_slot = jnp.where(cold_C, (r_C - N) % Nc, Nc)
        cold_page = jnp.where(cold_C, cold_slot // Pg, n_pages)
        first_C = cold_C & (cold_slot % Pg == 0)
        restart = jnp.zeros((n_pages,), jnp.int32).at[cold_page].max(first_C.astype(jnp.int32), mode="drop") > 0
        cold_pos = jnp.where(jnp.repeat(restart, Pg), -1, cache.cold_pos).at[cold_slot].set(g_C, mode="drop")
    else:
        cold_slot = cold_page = jnp.zeros((C,), jnp.int32)
        first_C, cold_pos = jnp.zeros((C,), bool), cache.cold_pos
    # The recallable slots, and the leading pages that hold them (once per step, for every layer): before the ring
    # wraps they are a prefix that grows with the stream, after it every page; 0 (or recall_pages = 0) = the
    # layers skip recall this step.
    token_valid = (cold_pos >= 0) & (cold_pos < w0)
    live_pages = jnp.int32(0)
    if Nc:
        live_slots = jnp.max(jnp.where(token_valid, jnp.arange(1, Nc + 1, dtype=jnp.int32), 0))
        live_pages = jnp.where(policy.recall_pages > 0, (live_slots + Pg - 1) // Pg, 0).astype(jnp.int32)
    recall = Recall(k_pages=policy.recall_pages, token_valid_Nc=token_valid,
                    surv_gpos_S=surv_pos, q_global_C=g_C, q_real_C=real_C, in_kernel=mode.surv_in_kernel,
                    max_pages=max_recall_pages if Nc else 0, neighbors=recall_neighbors,
                    shortlist=recall_shortlist if Nc else 0, page_score=page_score, live_pages=live_pages,
                    score_block=_recall.SCORE_BLOCK_PAGES, placement=placement,
                    fixed_pos=g_C[0] - policy.window,
                    keeps_choice=(reselect > 1 or share_from is not None) and bool(max_recall_pages and Nc),
                    share_from=share_from,  # CacheSpec.reselects: the choice is kept
                    # choose afresh every reselect-th step and at every chunk of more than one token (a prompt: the
                    # question's own rows choose the pages its first answer token reads)
                    reselect_now=(jnp.sum(cache.cold_step) % reselect == 0) | (n_valid > 1))
    kernel = KernelArgs(
        win_pos_W=jnp.where(win_in, jnp.where(mode.rank_window, win_rank, win_pos), -1),
        q_pos_win_C=jnp.where(mode.rank_window, q_rank, g_C),
        surv_rot_pos_S=jnp.where(mode.surv_in_kernel & att, surv_rank, 0),
        surv_valid_S=att,
        q_pos_surv_C=jnp.where(mode.surv_global, g_C, q_rank))
    if recall.keeps_choice and recall.max_pages and reselect > 1:
        # A step that chooses nothing (every reselect-th step chooses) attends the kept choices: their tokens'
        # positions, validity and ranks once per choosing layer here, not in every layer that attends them.
        recall = dataclasses.replace(recall, kept_layout=_recall.kept_layouts(
            cache.cold_choice, cache.cold_choice_on, cold_pos, Nc // n_pages, recall, kernel.surv_rot_pos_S,
            kernel.surv_valid_S, kernel.q_pos_surv_C, recall.choosers(cache.cold_choice.shape[0])))

    return StepPlan(
        writes=Writes(win_slot, win_write, surv_slot, surv_write, cold_slot, cold_page, first_C),
        kernel=kernel,
        upkeep=Upkeep(
            rerotate=mode.rerotate & any_hop, win_hop_W=win_hop, surv_hop_S=surv_hop,
            win_rot_old_W=win_rot_old, win_rot_new_W=win_rot_new, surv_rot_old_S=surv_rot_old,
            surv_rot_new_S=surv_rot_new, refresh=refresh, refresh_S=refresh_S, use_precompute=mode.precompute,
            rotate_window=mode.raw_window, replay=mode.replay & any_hop, win_rank_W=win_rank, surv_rank_S=surv_rank,
            q_rank_C=q_rank),
        recall=recall,
        next=Positions(win_pos=win_pos, win_stored_rot=win_rot_new, surv_pos=surv_pos, surv_rank=surv_rank,
                       surv_stored_rot=surv_rot_new, surv_copy_pos=copy_pos, cold_pos=cold_pos,
                       # a prompt restarts the count: the first decode step after it chooses afresh too (its
                       # one row is the answer's query, where the prompt's choice is a max over its rows)
                       cold_step=jnp.where(n_valid > 1, 0, cache.cold_step + 1), t=n),
    )


def commit(cache: KVCache, plan: StepPlan) -> KVCache:
    """The cache with the step's new positions and counters."""
    return cache.replace(**{f.name: getattr(plan.next, f.name) for f in dataclasses.fields(Positions)})


def _bits_on_cpu(cache: KVCache) -> bool:
    return cache.win_k.dtype == jnp.bfloat16 and jax.default_backend() == "cpu"


def _kv_bitcast(cache: KVCache, dtype) -> KVCache:
    return cache.replace(**{f: jax.lax.bitcast_convert_type(getattr(cache, f), dtype) for f in KV_FIELDS})


# ----------------------------------------------------------------------------------------------------
# One whole step of a chunk.


def _replay(apply_fn: ApplyFn, params, cache: KVCache, plan: StepPlan):
    """Consolidation: recompute K/V of every cached token by a forward pass over the cached ids at their
    ranks 0..n-1 (fresh full-attention cache), scatter them back, and take this chunk's logits from it."""
    L, B, H, W, D = cache.win_k.shape
    S = cache.surv_k.shape[3]
    n_cap = W + S
    up = plan.upkeep
    win_in = up.win_rank_W >= 0
    surv_att = plan.kernel.surv_valid_S
    ids = jnp.zeros((B, n_cap), jnp.int32)
    ids = ids.at[:, jnp.where(win_in, up.win_rank_W, n_cap)].set(cache.win_tok, mode="drop")
    if S:
        ids = ids.at[:, jnp.where(surv_att, up.surv_rank_S, n_cap)].set(cache.surv_tok, mode="drop")
    n_cached = jnp.sum(win_in) + jnp.sum(surv_att)
    fresh = init_cache(CacheSpec(L, B, H, D, n_cap, 0, str(cache.win_k.dtype), max_chunk=n_cap))
    logits_all, fresh = apply_fn(params, ids, fresh, plan_step(fresh, P.full(), n_cap, n_cached))

    def gather(fresh_kv, dst, mask, rank):
        """dst with the entries in `mask` replaced by the fresh K or V of the token at `rank`."""
        src = jnp.take(fresh_kv, jnp.clip(rank, 0, n_cap - 1), axis=3)
        return jnp.where(mask[:, None], src, dst)

    surv_live = up.surv_rank_S >= 0
    win_k = gather(fresh.win_k, cache.win_k, win_in, up.win_rank_W)
    win_v = gather(fresh.win_v, cache.win_v, win_in, up.win_rank_W)
    surv_k = gather(fresh.win_k, cache.surv_k, surv_live, up.surv_rank_S) if S else cache.surv_k
    surv_v = gather(fresh.win_v, cache.surv_v, surv_live, up.surv_rank_S) if S else cache.surv_v
    logits = jnp.take(logits_all, jnp.clip(up.q_rank_C, 0, n_cap - 1), axis=1)
    return logits, cache.replace(win_k=win_k, win_v=win_v, surv_k=surv_k, surv_v=surv_v)


def step(apply_fn: ApplyFn, params, tokens_BxC: jax.Array, cache: KVCache, policy: Policy,
         n_valid: jax.Array | int | None = None, *, last_logits: bool = False, **recall_args) -> tuple[jax.Array, KVCache]:
    """Append a chunk (its first n_valid tokens real) under `policy`: logits [B, C, V] and the new cache.

    last_logits (static): only the last real token's logits, [B, 1, V] (what sampling reads): the plan names that
    row (StepPlan.logits_row) for a model that computes only it; another model's rows are taken here.
    recall_args (static, CacheSpec.recall_args): the recall tier's keywords of `plan_step`."""
    C = tokens_BxC.shape[1]
    plan = plan_step(cache, policy, C, n_valid, **recall_args)
    row = None
    if last_logits:
        row = jnp.maximum(jnp.asarray(C if n_valid is None else n_valid, jnp.int32) - 1, 0)
        plan = dataclasses.replace(plan, logits_row=row)

    def picked(logits):  # [B, C or 1, V] -> [B, 1, V] under last_logits
        return logits if row is None or logits.shape[1] == 1 else jax.lax.dynamic_slice_in_dim(logits, row, 1, axis=1)

    if cache.win_tok.shape[1]:
        cache = cache.replace(win_tok=cache.win_tok.at[:, plan.writes.win_slot_C].set(tokens_BxC, mode="drop"))
    if cache.surv_tok.shape[1]:
        cache = cache.replace(surv_tok=cache.surv_tok.at[:, plan.writes.surv_slot_C].set(tokens_BxC, mode="drop"))

    def forward(cache):
        if not _bits_on_cpu(cache):
            logits, cache = apply_fn(params, tokens_BxC, cache, plan)
            return picked(logits), cache
        logits, bits = apply_fn(params, tokens_BxC, _kv_bitcast(cache, BITS_DTYPE), plan)
        return picked(logits), _kv_bitcast(bits, jnp.bfloat16)

    def replay(cache):
        logits, cache = _replay(apply_fn, params, cache, plan)
        return picked(logits), cache

    if cache.win_tok.shape[1]:
        logits, cache = jax.lax.cond(plan.upkeep.replay, replay, forward, cache)
    else:
        logits, cache = forward(cache)
    return logits, commit(cache, plan)
