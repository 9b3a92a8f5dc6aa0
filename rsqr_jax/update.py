"""The cache's side of a step: which slot each new token goes to, which positions the kernel sees, what upkeep
each policy runs, each layer's part of it, and the positions committed afterwards.

A step is planned once (`plan_step`, shared by every layer); the model runs, and each of its layers calls its one
entry point into the cache, `attend_layer`, with the plan (K/V writes, upkeep, the cold store, attention); then the
new positions are committed (`commit`). rsqr_jax.engine.step does all three for a chunk; nothing here calls the
model. Policy-specific work is read from the mode traits table (`policy.MODE_TRAITS`) and guarded by `lax.cond`,
so a single fixed policy pays only for its own branch (under `vmap` a cond becomes a select: the price of a mixed
sweep).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rsqr_jax import attention
from rsqr_jax import policy as P
from rsqr_jax import recall as R
from rsqr_jax.cache import KVCache
from rsqr_jax.kernels.exact_rope import rotate_keys
from rsqr_jax.kernels.store import logical_dtype, read_layer, write_kv
from rsqr_jax.policy import Policy, is_flagged, mode_traits, order_index, window_start

def _dataclass(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_dataclass
class Writes:
    """Where each chunk token's K/V is written (slot out of range = not written) and the position its key
    is rotated at when written (0 = stored raw). (Its raw copy in the recall tier's cold ring: Recall.slot_C.)"""

    win_slot_C: jax.Array
    win_rot_pos_C: jax.Array
    surv_slot_C: jax.Array
    surv_rot_pos_C: jax.Array


@_dataclass
class KernelArgs:
    """The position arguments of the two-segment kernel (rsqr_jax.attention), shared by every layer.

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
    t: jax.Array


@_dataclass
class StepPlan:
    """Everything a layer needs to update its K/V and attend, for one chunk; identical for all layers
    (but for the recalled pages, which each layer chooses from its own queries). recall: the recall tier's plan
    (None without a cold store). logits_row: None, or the one row of the chunk whose logits the caller reads
    (step's last_logits): a model may compute only that row's logits, [B, 1, V] (a prompt chunk's other rows would
    cost a fifth of its multiply-adds for nothing)."""

    writes: Writes
    kernel: KernelArgs
    upkeep: Upkeep
    recall: R.Recall | None
    next: Positions
    logits_row: jax.Array | None = None


def _pinned(g_N: jax.Array, cache: KVCache) -> jax.Array:
    """Which global positions lie in a pinned span of the cache."""
    if not cache.pin_lo.shape[0]:
        return jnp.zeros(g_N.shape, bool)
    return jnp.any((cache.pin_lo <= g_N[:, None]) & (g_N[:, None] < cache.pin_hi), axis=1)


def plan_step(cache: KVCache, policy: Policy, chunk: int, n_valid: jax.Array | int | None = None, *,
              recall: R.RecallConfig | None = None) -> StepPlan:
    """Bookkeeping for appending `chunk` tokens (the first n_valid of them real) under `policy`.

    Token set semantics: the chunk attends to the cached set *after* this step's evictions (for one
    token that is exactly the set at t; for a chunk it is StreamingLLM's evict-for-space).
    recall (static, rsqr_jax.recall.config_of(spec)): how the layers recall from the cache's cold store (None:
    the store, if any, is written and nothing is recalled).
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

    kernel = KernelArgs(
        win_pos_W=jnp.where(win_in, jnp.where(mode.rank_window, win_rank, win_pos), -1),
        q_pos_win_C=jnp.where(mode.rank_window, q_rank, g_C),
        surv_rot_pos_S=jnp.where(mode.surv_in_kernel & att, surv_rank, 0),
        surv_valid_S=att,
        q_pos_surv_C=jnp.where(mode.surv_global, g_C, q_rank))
    recall_plan = None
    if cache.cold is not None:
        recall_plan = R.plan_ring(cache.cold, recall, k_pages=policy.recall_pages, g_C=g_C, r_C=r_C, real_C=real_C,
                                  n_valid=n_valid, n_sink=N, w0=w0, surv_gpos_S=surv_pos, in_kernel=mode.surv_in_kernel,
                                  window=policy.window, surv_rot_pos_S=kernel.surv_rot_pos_S,
                                  surv_valid_S=kernel.surv_valid_S, q_pos_surv_C=kernel.q_pos_surv_C)

    return StepPlan(
        writes=Writes(win_slot, win_write, surv_slot, surv_write),
        kernel=kernel,
        upkeep=Upkeep(
            rerotate=mode.rerotate & any_hop, win_hop_W=win_hop, surv_hop_S=surv_hop,
            win_rot_old_W=win_rot_old, win_rot_new_W=win_rot_new, surv_rot_old_S=surv_rot_old,
            surv_rot_new_S=surv_rot_new, refresh=refresh, refresh_S=refresh_S, use_precompute=mode.precompute,
            rotate_window=mode.raw_window, replay=mode.replay & any_hop, win_rank_W=win_rank, surv_rank_S=surv_rank,
            q_rank_C=q_rank),
        recall=recall_plan,
        next=Positions(win_pos=win_pos, win_stored_rot=win_rot_new, surv_pos=surv_pos, surv_rank=surv_rank,
                       surv_stored_rot=surv_rot_new, surv_copy_pos=copy_pos, t=n),
    )


def commit(cache: KVCache, plan: StepPlan) -> KVCache:
    """The cache with the step's new positions and counters."""
    cache = cache.replace(**{f.name: getattr(plan.next, f.name) for f in dataclasses.fields(Positions)})
    return cache if plan.recall is None else cache.replace(cold=R.commit_ring(cache.cold, plan.recall))


# ----------------------------------------------------------------------------------------------------
# One layer's part of a step: write this chunk's K/V, run the policy's upkeep on the layer, write the cold store and
# recall from it, then attend over both kernel segments.


def update_layer(layer: jax.Array, k_BxCxHkvxD: jax.Array, v_BxCxHkvxD: jax.Array, cache: KVCache,
                 plan: StepPlan, inv_freq) -> tuple[KVCache, tuple]:
    """Write this chunk's K/V of layer `layer` (into the cold store too, where there is one) and run the policy's
    upkeep on that layer.

    Returns the cache (only K/V arrays change: dynamic-update-slices of the scan carry, in place under
    jit) and this layer's kernel segments (win_k, win_v, seg_k, seg_v), each [B, Hkv, N, D].
    """
    wr, up = plan.writes, plan.upkeep
    dt = logical_dtype(cache.win_k)
    k_BxHxCxD = jnp.swapaxes(k_BxCxHkvxD, 1, 2)
    v_BxHxCxD = jnp.swapaxes(v_BxCxHkvxD, 1, 2).astype(dt)
    at = lambda slot: (layer, slice(None), slice(None), slot)  # noqa: E731
    win_new = rotate_keys(k_BxHxCxD, wr.win_rot_pos_C, inv_freq).astype(dt)
    win_k = write_kv(cache.win_k, at(wr.win_slot_C), jnp.moveaxis(win_new, 2, 0))
    win_v = write_kv(cache.win_v, at(wr.win_slot_C), jnp.moveaxis(v_BxHxCxD, 2, 0))
    surv_k, surv_v, surv_k_rot = cache.surv_k, cache.surv_v, cache.surv_k_rot
    has_surv = surv_k.shape[3] > 0
    if has_surv:
        surv_new = rotate_keys(k_BxHxCxD, wr.surv_rot_pos_C, inv_freq).astype(dt)
        surv_k = write_kv(surv_k, at(wr.surv_slot_C), jnp.moveaxis(surv_new, 2, 0))
        surv_v = write_kv(surv_v, at(wr.surv_slot_C), jnp.moveaxis(v_BxHxCxD, 2, 0))

    # rerotate: rotate stored keys again by the rank decrease, rounding to the storage dtype each hop.
    # The conds act on this layer's slice only: under vmap (a policy sweep) a cond becomes a select of
    # its outputs, and selecting the whole [L, ...] stack in every layer made sweeps ~2.5x slower.
    def hop(k, old, new, mask):
        moved = rotate_keys(k, new - old, inv_freq).astype(dt)
        return jnp.where(mask[:, None], moved, k)

    win_k = write_kv(win_k, layer, jax.lax.cond(
        up.rerotate, lambda k: hop(k, up.win_rot_old_W, up.win_rot_new_W, up.win_hop_W), lambda k: k,
        read_layer(win_k, layer)))
    if has_surv:
        surv_k = write_kv(surv_k, layer, jax.lax.cond(
            up.rerotate, lambda k: hop(k, up.surv_rot_old_S, up.surv_rot_new_S, up.surv_hop_S), lambda k: k,
            read_layer(surv_k, layer)))

    # rsqr_precompute: rotate new/renumbered survivors from raw at their rank into the copy.
    if surv_k_rot.shape[3]:
        def refresh(copy):
            fresh = rotate_keys(read_layer(surv_k, layer), up.surv_rank_S, inv_freq).astype(dt)
            return jnp.where(up.refresh_S[:, None], fresh, copy)

        surv_k_rot = write_kv(surv_k_rot, layer, jax.lax.cond(up.refresh, refresh, lambda c: c, read_layer(surv_k_rot, layer)))

    # streamingllm: every cached key is rotated from raw at its rank, every step.
    seg_win_k = jax.lax.cond(up.rotate_window,
                             lambda k: rotate_keys(k, up.win_rank_W, inv_freq).astype(dt), lambda k: k,
                             read_layer(win_k, layer))
    seg_surv_k = read_layer(surv_k, layer)
    if surv_k_rot.shape[3]:
        seg_surv_k = jax.lax.cond(up.use_precompute, lambda: read_layer(surv_k_rot, layer), lambda: seg_surv_k)
    cache = cache.replace(win_k=win_k, win_v=win_v, surv_k=surv_k, surv_v=surv_v, surv_k_rot=surv_k_rot)
    if cache.cold is not None:
        cache = cache.replace(cold=R.write_cold(cache.cold, layer, k_BxHxCxD, v_BxHxCxD, plan.recall, inv_freq))
    return cache, (seg_win_k, read_layer(win_v, layer), seg_surv_k, read_layer(surv_v, layer))


def attend_layer(layer: jax.Array, q_BxCxHqxD: jax.Array, k_BxCxHkvxD: jax.Array, v_BxCxHkvxD: jax.Array,
                 cache: KVCache, plan: StepPlan, inv_freq, *, kernel: str = "xla", scale: float | None = None,
                 logit_cap: float | None = None) -> tuple[jax.Array, KVCache]:
    """What a model layer calls: update this layer's cache (`update_layer`), then attend over both segments.

    scale / logit_cap: the model's attention scale (None: head_dim ** -0.5) and attention-logit soft-cap
    (None: none), static. The recall tier scores its pages on plain q.k, as for every other model.

    Returns the attention output [B, C, Hq, D] and the cache; positions are committed once per step
    by `step` (from `plan.next`), not here.
    """
    cache, (win_k, win_v, surv_k, surv_v) = update_layer(layer, k_BxCxHkvxD, v_BxCxHkvxD, cache, plan, inv_freq)
    ka = plan.kernel
    B = q_BxCxHqxD.shape[0]
    bc = lambda x: jnp.broadcast_to(x, (B,) + x.shape)  # noqa: E731
    surv_rot_pos, surv_valid, q_pos_surv = bc(ka.surv_rot_pos_S), bc(ka.surv_valid_S), bc(ka.q_pos_surv_C)

    plain_win = (win_k, win_v, bc(ka.win_pos_W))
    plain = (surv_k, surv_v, surv_rot_pos, surv_valid, q_pos_surv)

    def attend(win_k, win_v, win_pos, surv_k, surv_v, surv_rot_pos, surv_valid, q_pos_surv, raw_tail=None):
        return attention.attend(q_BxCxHqxD, win_k, win_v, win_pos, surv_k, surv_v, surv_rot_pos, surv_valid,
                                bc(ka.q_pos_win_C), q_pos_surv, inv_freq, kernel, scale=scale, logit_cap=logit_cap,
                                raw_tail=raw_tail)

    rc = plan.recall
    if rc is None or not rc.max_pages:
        return attend(*plain_win, *plain), cache

    cold = cache.cold
    # ColdStore.share_from: a layer attends the pages its source layer chose this step (layers run in order, so
    # the source has written its choice) and scores nothing, or, with source -1, recalls nothing; a layer that
    # is its own source chooses.
    chooser, now, recalls = layer, rc.reselect_now, None
    if rc.share_from is not None:
        source = jnp.asarray(rc.share_from, jnp.int32)[layer]
        chooser, now = jnp.maximum(source, 0), rc.reselect_now & (source == layer)
        if -1 in rc.share_from:  # static: only then does a layer's recall depend on which layer it is
            recalls = source >= 0
    kept = (cold.choice[chooser], cold.choice_on[chooser]) if rc.keeps_choice else None

    def with_recall():  # the recall tier (rsqr_jax.recall)
        def choose():
            return R.choose_pages_to_recall(q_BxCxHqxD, cold, layer, rc, inv_freq)

        # ColdStore.reselect > 1: between scorings the layer attends the pages it chose last (only the choice
        # is kept: their tokens are gathered and checked afresh every step).
        idx, active = jax.lax.cond(now, choose, lambda: kept) if kept is not None else choose()
        here = lambda: R.recalled_layout(idx, active, rc.pos_Nc, cold.page_size, rc, *plain[2:])  # noqa: E731
        if rc.kept_layout is None:
            lay = here()
        else:  # a step that chooses nothing attends the kept choices, whose layout the plan holds per chooser
            row = jnp.asarray(rc.chooser_rows(cold.choice.shape[0]), jnp.int32)[chooser]
            lay = jax.lax.cond(rc.reselect_now, here, lambda: jax.tree.map(lambda x: x[row], rc.kept_layout))
        if rc.placement == "rank":  # in the raw segment, at their ranks, read where they lie by the kernel that can
            out = attend(*plain_win, surv_k, surv_v, lay.surv_rot_pos_BxS, surv_valid, lay.q_pos_surv_BxC,
                         raw_tail=R.stored_runs(cold, layer, idx, lay))
        else:
            rec_k, rec_v = R.read_cold_runs(cold, layer, idx * cold.page_size, cold.page_size)
            out = attend(*R.extend_window_segment(*plain_win, rc, rec_k, rec_v, lay.gpos_BxR, lay.valid_BxR,
                                                  inv_freq), *plain)
        return out, (idx, active)

    if kept is None:  # the choice of this step only
        if not rc.score_block:  # every page scored at every step, the store empty or not
            return with_recall()[0], cache
        # Nothing recallable (the store is still empty, or recall_pages = 0): the layer neither scores, gathers
        # nor attends recalled slots. The recalled slots would all be invalid, and masked slots change no bit of
        # the attention (tests/test_recall.py). Only the attention output leaves the cond, so under vmap (where it
        # is a select that runs both branches) the price is one plain attention per layer, not a select of the
        # cache.
        return jax.lax.cond(rc.live_pages > 0, lambda: with_recall()[0], lambda: attend(*plain_win, *plain)), cache
    live = rc.live_pages > 0 if rc.score_block else None  # None: recall at every step
    if recalls is not None:
        live = recalls if live is None else live & recalls
    # a layer without recall this step attends as plain rsqr and keeps its choice
    out, (idx, active) = (with_recall() if live is None else
                          jax.lax.cond(live, with_recall, lambda: (attend(*plain_win, *plain), kept)))
    return out, cache.replace(cold=cold.replace(choice=cold.choice.at[layer].set(idx),
                                                choice_on=cold.choice_on.at[layer].set(active)))
