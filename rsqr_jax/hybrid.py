"""Local (sliding-window) layers of hybrid models (Gemma 2 / Gemma 3).

A local layer attends to the last w tokens (itself included) by construction, whatever the policy. Its keys are
rotated once, at their global positions, when they arrive, and never touched again: inside the window every
distance is the true distance, which is what the model was trained on. So a local layer keeps a ring of w slots
(`KVCache.loc_k` / `loc_v`, `[Lloc, B, Hkv, w, D]`, positions `loc_pos [w]` shared by all local layers and rows)
and nothing else: no survivors, no cold store, no renumbering. The policy applies to the global layers only,
which keep the policy cache (`win_*`, `surv_*`, `cold`) with one layer entry per global layer.

A chunk attends over the ring as it was before the chunk plus the chunk's own keys (so a chunk longer than the
window still sees, for each query, exactly its last w positions), through the kernel contract with an empty
survivor segment and `sliding_window=w`; afterwards the last w real tokens are written to the ring at
`position mod w`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rsqr_jax import attention
from rsqr_jax.cache import KVCache
from rsqr_jax.kernels.store import logical_dtype, read_layer, write_kv
from rsqr_jax.kernels.exact_rope import rotate_keys
from rsqr_jax.update import StepPlan


class HybridCacheError(ValueError):
    """A cache whose layout does not match the model's local / global layers."""


def check_cache(cache: KVCache, config) -> None:
    """Raise HybridCacheError (one line) unless the cache has a ring of config.local_window slots for each of the
    config.local_layers local layers and a policy-cache entry for each global layer (static shapes: also under
    jit)."""
    n_local, window = config.local_layers, config.local_window
    n_global = config.num_layers - n_local
    got = (cache.loc_k.shape[-5], cache.loc_pos.shape[-1], cache.win_k.shape[-5])
    if got != (n_local, window, n_global):
        raise HybridCacheError(
            f"the cache holds {got[0]} local rings of {got[1]} slots and {got[2]} global layers; this model has "
            f"{n_local} local layers (window {window}) and {n_global} global ones: make the cache with "
            f"CacheSpec.for_policies(..., dims=<the model config>)")


class LocalStep(NamedTuple):
    """The local layers' part of one step, identical for every local layer: where each chunk token is written
    (slot_C; out of range = not written), the position each chunk key is attended at (pos_C; -1 = a padding
    token) and the ring's positions after the step (next_pos)."""

    slot_C: jax.Array
    pos_C: jax.Array
    next_pos: jax.Array


def plan_local(cache: KVCache, plan: StepPlan, chunk: int) -> LocalStep:
    """LocalStep for appending `chunk` tokens (the real ones: plan.next.t - cache.t)."""
    w = cache.loc_pos.shape[-1]
    g_C = cache.t + jnp.arange(chunk, dtype=jnp.int32)
    n = plan.next.t  # position after the step's real tokens
    real_C = g_C < n
    slot_C = jnp.where(real_C & (g_C >= n - w), g_C % w, w)  # only the last w real tokens reach the ring
    return LocalStep(slot_C=slot_C, pos_C=jnp.where(real_C, g_C, -1),
                     next_pos=cache.loc_pos.at[slot_C].set(g_C, mode="drop"))


def attend_local(layer, q_BxCxHqxD: jax.Array, k_BxCxHkvxD: jax.Array, v_BxCxHkvxD: jax.Array, cache: KVCache,
                 local: LocalStep, inv_freq, *, window: int, kernel: str = "xla", scale: float | None = None,
                 logit_cap: float | None = None) -> tuple[jax.Array, KVCache]:
    """Local layer `layer` (its index among the local layers): attend the chunk over its window and write the
    chunk's keys (rotated once at their global positions with the local layers' inv_freq) into the ring.

    Returns the attention output [B, C, Hq, D] and the cache (only loc_k / loc_v change; loc_pos is committed
    once per step from local.next_pos by the model)."""
    B, C = q_BxCxHqxD.shape[:2]
    dt = logical_dtype(cache.loc_k)
    g_C = cache.t + jnp.arange(C, dtype=jnp.int32)
    k_new = rotate_keys(jnp.swapaxes(k_BxCxHkvxD, 1, 2), g_C, inv_freq).astype(dt)  # [B, Hkv, C, D]
    v_new = jnp.swapaxes(v_BxCxHkvxD, 1, 2).astype(dt)
    seg_k = jnp.concatenate([read_layer(cache.loc_k, layer), k_new], axis=2)
    seg_v = jnp.concatenate([read_layer(cache.loc_v, layer), v_new], axis=2)
    seg_pos = jnp.broadcast_to(jnp.concatenate([cache.loc_pos, local.pos_C]), (B, seg_k.shape[2]))
    H, D = seg_k.shape[1], seg_k.shape[3]
    empty = jnp.zeros((B, H, 0, D), dt)
    q_pos = jnp.broadcast_to(g_C, (B, C))
    out = attention.attend(q_BxCxHqxD, seg_k, seg_v, seg_pos, empty, empty, jnp.zeros((B, 0), jnp.int32),
                           jnp.zeros((B, 0), bool), q_pos, q_pos, inv_freq, kernel, scale=scale, logit_cap=logit_cap,
                           sliding_window=window)
    at = (layer, slice(None), slice(None), local.slot_C)
    loc_k = write_kv(cache.loc_k, at, jnp.moveaxis(k_new, 2, 0))
    loc_v = write_kv(cache.loc_v, at, jnp.moveaxis(v_new, 2, 0))
    return out, cache.replace(loc_k=loc_k, loc_v=loc_v)


def local_positions(cache: KVCache) -> list[int]:
    """Sorted global positions the local rings hold (host-side, for tests and debugging)."""
    return sorted(int(g) for g in jax.device_get(cache.loc_pos).reshape(-1) if g >= 0)
