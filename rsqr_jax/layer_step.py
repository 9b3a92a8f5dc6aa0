"""One layer's part of a step, the model's one entry point into the cache (`attend_layer`): write this chunk's
K/V, run the policy's upkeep on the layer, write the cold store and recall from it, then attend over both kernel
segments. The step is planned before the model runs and committed after it (rsqr_jax.update); nothing here
calls the model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rsqr_jax import attention
from rsqr_jax import recall as R
from rsqr_jax.cache import KVCache
from rsqr_jax.kernels.store import logical_dtype, read_layer, write_kv
from rsqr_jax.kernels.exact_rope import rotate_keys
from rsqr_jax.update import StepPlan


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
