"""The one attention dispatch point of the model: update one layer's K/V in the cache, then attend.

Every policy reuses the two-segment contract of DESIGN section 6 (pallas_kernels.survivor_attention):
the ring is the pre-rotated window segment, the survivor array the segment rotated inside the
kernel (at position 0, the identity, when its keys are stored pre-rotated). Policy-specific work is
behind `lax.cond` on plan flags, so a single policy pays only for its own branch (under `vmap` the
branches become selects, which is the price of a mixed sweep).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.rope import rope_cos_sin, rotate_half_split
from pallas_kernels.survivor_attention import survivor_attention_reference
from rsqr_jax.cache import KVCache, StepPlan

KERNELS = ("xla", "pallas", "auto")


def resolve_kernel(kernel: str) -> str:
    """'auto' -> 'pallas' on GPU, 'xla' elsewhere (Pallas only runs interpreted on CPU)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}: choose one of {', '.join(KERNELS)}")
    if kernel == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return kernel


def _rotate_BHND(k, pos_N, inv_freq):
    """R_pos k for keys [B, H, N, D] at positions pos_N [N] (float32 result)."""
    cos, sin = rope_cos_sin(pos_N, inv_freq)  # [N, D/2]
    return rotate_half_split(k, cos, sin)


def attend(q, win_k, win_v, win_pos, surv_k, surv_v, surv_pos, surv_valid, q_pos_win, q_pos_surv, inv_freq,
           kernel: str):
    """Call the contract with per-cache positions broadcast over the batch."""
    B = q.shape[0]
    bc = lambda x: jnp.broadcast_to(x, (B,) + x.shape)  # noqa: E731
    args = (q, win_k, win_v, bc(win_pos), surv_k, surv_v, bc(surv_pos), bc(surv_valid), bc(q_pos_win),
            bc(q_pos_surv), inv_freq)
    if resolve_kernel(kernel) == "pallas":
        from pallas_kernels.survivor_attention import survivor_attention

        return survivor_attention(*args)
    return survivor_attention_reference(*args)


def layer_attention(layer: jax.Array, q_BxCxHqxD: jax.Array, k_BxCxHkvxD: jax.Array, v_BxCxHkvxD: jax.Array,
                    cache: KVCache, plan: StepPlan, inv_freq, *, kernel: str = "xla") -> tuple[jax.Array, KVCache]:
    """Write this chunk's K/V of layer `layer` into the cache, run the policy's upkeep, attend.

    Only the K/V arrays of the returned cache change (in place under jit: dynamic-update-slices of the
    scan carry); positions are committed once per step by the caller from `plan.next_state`.
    """
    dt = cache.ring_k.dtype
    k_BxHxCxD = jnp.swapaxes(k_BxCxHkvxD, 1, 2)
    v_BxHxCxD = jnp.swapaxes(v_BxCxHkvxD, 1, 2).astype(dt)
    ring_new = _rotate_BHND(k_BxHxCxD, plan.ring_write_pos, inv_freq).astype(dt)
    ring_k = cache.ring_k.at[layer, :, :, plan.ring_slot].set(jnp.moveaxis(ring_new, 2, 0), mode="drop")
    ring_v = cache.ring_v.at[layer, :, :, plan.ring_slot].set(jnp.moveaxis(v_BxHxCxD, 2, 0), mode="drop")
    surv_k, surv_v, surv_k_rot = cache.surv_k, cache.surv_v, cache.surv_k_rot
    has_surv = surv_k.shape[3] > 0
    if has_surv:
        surv_new = _rotate_BHND(k_BxHxCxD, plan.surv_write_pos, inv_freq).astype(dt)
        surv_k = surv_k.at[layer, :, :, plan.surv_slot].set(jnp.moveaxis(surv_new, 2, 0), mode="drop")
        surv_v = surv_v.at[layer, :, :, plan.surv_slot].set(jnp.moveaxis(v_BxHxCxD, 2, 0), mode="drop")

    # rerotate: rotate stored keys again by the rank decrease, rounding to the storage dtype each hop.
    def rerotate(ring_k, surv_k):
        def hop(k_all, old, new, mask):
            k = k_all[layer]
            moved = _rotate_BHND(k, new - old, inv_freq).astype(dt)
            return k_all.at[layer].set(jnp.where(mask[:, None], moved, k))

        ring_k = hop(ring_k, plan.ring_rot_old, plan.ring_rot_new, plan.ring_hop)
        if has_surv:
            surv_k = hop(surv_k, plan.surv_rot_old, plan.surv_rot_new, plan.surv_hop)
        return ring_k, surv_k

    ring_k, surv_k = jax.lax.cond(plan.rerotate, rerotate, lambda a, b: (a, b), ring_k, surv_k)

    # rsqr_precompute: rotate new/renumbered survivors from raw at their rank into the copy.
    if surv_k_rot.shape[3]:
        def refresh(copy):
            fresh = _rotate_BHND(surv_k[layer], plan.surv_rank, inv_freq).astype(dt)
            return copy.at[layer].set(jnp.where(plan.refresh_mask[:, None], fresh, copy[layer]))

        surv_k_rot = jax.lax.cond(plan.refresh, refresh, lambda c: c, surv_k_rot)

    # streamingllm: every cached key is rotated from raw at its rank, every step.
    win_k = jax.lax.cond(plan.rotate_window,
                         lambda k: _rotate_BHND(k, plan.ring_rank, inv_freq).astype(dt), lambda k: k, ring_k[layer])
    seg_k = surv_k[layer]
    if surv_k_rot.shape[3]:
        seg_k = jax.lax.cond(plan.use_precompute, lambda: surv_k_rot[layer], lambda: seg_k)
    out = attend(q_BxCxHqxD, win_k, ring_v[layer], plan.win_pos, seg_k, surv_v[layer], plan.surv_kernel_pos,
                 plan.surv_valid, plan.q_pos_win, plan.q_pos_surv, inv_freq, kernel)
    return out, cache.replace(ring_k=ring_k, ring_v=ring_v, surv_k=surv_k, surv_v=surv_v, surv_k_rot=surv_k_rot)
