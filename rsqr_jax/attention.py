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
from pallas_kernels.survivor_attention import survivor_attention, survivor_attention_reference, survivor_attention_xla
from rsqr_jax.cache import KVCache, StepPlan

KERNELS = ("xla", "pallas", "auto", "reference")


def resolve_kernel(kernel: str) -> str:
    """'auto' -> 'pallas' on GPU, 'xla' elsewhere (Pallas only runs interpreted on CPU).

    'xla' is the CPU-tuned plain-XLA implementation of the contract, 'reference' the simple one that
    both are tested against."""
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
    kernel = resolve_kernel(kernel)
    if kernel == "pallas":
        return survivor_attention(*args)
    if kernel == "xla":
        return survivor_attention_xla(*args)
    return survivor_attention_reference(*args)


# bfloat16 K/V on CPU travel through the layer scan as their uint16 bits (rsqr_jax.stream.step does the
# bitcast once per step): XLA:CPU has no bfloat16 dynamic-update-slice/select, so it converts the
# *whole* [L, ...] buffer to float32 and back around every write - per layer, per step - and loses the
# in-place update; that made a bfloat16 cache ~2x slower per decode step than float32 (~7x under vmap).
# uint16 writes stay in place and the stored bits are identical.
BITS_DTYPE = jnp.uint16


def _logical_dtype(buf: jax.Array):
    return jnp.dtype(jnp.bfloat16) if buf.dtype == BITS_DTYPE else buf.dtype


def _get(buf: jax.Array, layer) -> jax.Array:
    """One layer of a K/V buffer, in its logical dtype."""
    x = buf[layer]
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if buf.dtype == BITS_DTYPE else x


def _set(buf: jax.Array, idx, update: jax.Array) -> jax.Array:
    """buf.at[idx].set(update, mode="drop") for a K/V buffer in its storage dtype (bits or not)."""
    update = update.astype(_logical_dtype(buf))
    if buf.dtype == BITS_DTYPE:
        update = jax.lax.bitcast_convert_type(update, BITS_DTYPE)
    return buf.at[idx].set(update, mode="drop")


def layer_attention(layer: jax.Array, q_BxCxHqxD: jax.Array, k_BxCxHkvxD: jax.Array, v_BxCxHkvxD: jax.Array,
                    cache: KVCache, plan: StepPlan, inv_freq, *, kernel: str = "xla") -> tuple[jax.Array, KVCache]:
    """Write this chunk's K/V of layer `layer` into the cache, run the policy's upkeep, attend.

    Only the K/V arrays of the returned cache change (in place under jit: dynamic-update-slices of the
    scan carry); positions are committed once per step by the caller from `plan.next_state`.
    """
    dt = _logical_dtype(cache.ring_k)
    k_BxHxCxD = jnp.swapaxes(k_BxCxHkvxD, 1, 2)
    v_BxHxCxD = jnp.swapaxes(v_BxCxHkvxD, 1, 2).astype(dt)
    ring_new = _rotate_BHND(k_BxHxCxD, plan.ring_write_pos, inv_freq).astype(dt)
    ring_k = _set(cache.ring_k, (layer, slice(None), slice(None), plan.ring_slot), jnp.moveaxis(ring_new, 2, 0))
    ring_v = _set(cache.ring_v, (layer, slice(None), slice(None), plan.ring_slot), jnp.moveaxis(v_BxHxCxD, 2, 0))
    surv_k, surv_v, surv_k_rot = cache.surv_k, cache.surv_v, cache.surv_k_rot
    has_surv = surv_k.shape[3] > 0
    if has_surv:
        surv_new = _rotate_BHND(k_BxHxCxD, plan.surv_write_pos, inv_freq).astype(dt)
        surv_k = _set(surv_k, (layer, slice(None), slice(None), plan.surv_slot), jnp.moveaxis(surv_new, 2, 0))
        surv_v = _set(surv_v, (layer, slice(None), slice(None), plan.surv_slot), jnp.moveaxis(v_BxHxCxD, 2, 0))

    # rerotate: rotate stored keys again by the rank decrease, rounding to the storage dtype each hop.
    # The conds act on this layer's slice only: under vmap (a policy sweep) a cond becomes a select of
    # its outputs, and selecting the whole [L, ...] stack in every layer made sweeps ~2.5x slower.
    def hop(k, old, new, mask):
        moved = _rotate_BHND(k, new - old, inv_freq).astype(dt)
        return jnp.where(mask[:, None], moved, k)

    ring_k = _set(ring_k, layer, jax.lax.cond(
        plan.rerotate, lambda k: hop(k, plan.ring_rot_old, plan.ring_rot_new, plan.ring_hop), lambda k: k,
        _get(ring_k, layer)))
    if has_surv:
        surv_k = _set(surv_k, layer, jax.lax.cond(
            plan.rerotate, lambda k: hop(k, plan.surv_rot_old, plan.surv_rot_new, plan.surv_hop), lambda k: k,
            _get(surv_k, layer)))

    # rsqr_precompute: rotate new/renumbered survivors from raw at their rank into the copy.
    if surv_k_rot.shape[3]:
        def refresh(copy):
            fresh = _rotate_BHND(_get(surv_k, layer), plan.surv_rank, inv_freq).astype(dt)
            return jnp.where(plan.refresh_mask[:, None], fresh, copy)

        surv_k_rot = _set(surv_k_rot, layer, jax.lax.cond(plan.refresh, refresh, lambda c: c, _get(surv_k_rot, layer)))

    # streamingllm: every cached key is rotated from raw at its rank, every step.
    win_k = jax.lax.cond(plan.rotate_window,
                         lambda k: _rotate_BHND(k, plan.ring_rank, inv_freq).astype(dt), lambda k: k,
                         _get(ring_k, layer))
    seg_k = _get(surv_k, layer)
    if surv_k_rot.shape[3]:
        seg_k = jax.lax.cond(plan.use_precompute, lambda: _get(surv_k_rot, layer), lambda: seg_k)
    out = attend(q_BxCxHqxD, win_k, _get(ring_v, layer), plan.win_pos, seg_k, _get(surv_v, layer), plan.surv_kernel_pos,
                 plan.surv_valid, plan.q_pos_win, plan.q_pos_surv, inv_freq, kernel)
    return out, cache.replace(ring_k=ring_k, ring_v=ring_v, surv_k=surv_k, surv_v=surv_v, surv_k_rot=surv_k_rot)
