"""Streaming loops: one jitted step per chunk, token-by-token NLL scans, and generation.

The loops take the model's pure apply function `apply_fn(params, tokens_BxC, cache, plan) ->
(logits_BxCxV, cache)` as an argument; they never import a model. `replay` lives here because its
consolidation is a forward pass of the model over the cached token ids.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from rsqr_jax import policy as P
from rsqr_jax.attention import BITS_DTYPE
from rsqr_jax.cache import CacheSpec, KVCache, init_cache, plan_step
from rsqr_jax.policy import Policy
from rsqr_jax.sampling import sample

ApplyFn = Callable  # (params, tokens_BxC, cache, plan) -> (logits_BxCxV, cache)


def _replay(apply_fn, params, cache: KVCache, plan):
    """Consolidation: recompute K/V of every cached token by a forward pass over the cached ids at their
    ranks 0..n-1 (fresh full-attention cache), scatter them back, and take this chunk's logits from it."""
    L, B, H, Wc, D = cache.ring_k.shape
    S = cache.surv_k.shape[3]
    n_cap = Wc + S
    ring_in = plan.ring_rank >= 0
    surv_att = plan.surv_valid
    ids = jnp.zeros((B, n_cap), jnp.int32)
    ids = ids.at[:, jnp.where(ring_in, plan.ring_rank, n_cap)].set(cache.ring_tok, mode="drop")
    if S:
        ids = ids.at[:, jnp.where(surv_att, plan.surv_rank, n_cap)].set(cache.surv_tok, mode="drop")
    n_cached = jnp.sum(ring_in) + jnp.sum(surv_att)
    spec = CacheSpec(L, B, H, D, n_cap, 0, str(cache.ring_k.dtype), max_chunk=n_cap)
    fresh = init_cache(spec)
    full = P.full()
    logits_all, fresh = apply_fn(params, ids, fresh, plan_step(fresh, full, n_cap, n_cached))

    def gather(fresh_kv, dst, mask, rank):
        """dst with the entries in `mask` replaced by the fresh K or V of the token at `rank`."""
        src = jnp.take(fresh_kv, jnp.clip(rank, 0, n_cap - 1), axis=3)
        return jnp.where(mask[:, None], src, dst)

    surv_live = plan.surv_rank >= 0
    ring_k = gather(fresh.ring_k, cache.ring_k, ring_in, plan.ring_rank)
    ring_v = gather(fresh.ring_v, cache.ring_v, ring_in, plan.ring_rank)
    surv_k = gather(fresh.ring_k, cache.surv_k, surv_live, plan.surv_rank) if S else cache.surv_k
    surv_v = gather(fresh.ring_v, cache.surv_v, surv_live, plan.surv_rank) if S else cache.surv_v
    logits = jnp.take(logits_all, jnp.clip(plan.q_rank, 0, n_cap - 1), axis=1)
    return logits, cache.replace(ring_k=ring_k, ring_v=ring_v, surv_k=surv_k, surv_v=surv_v)


_KV_FIELDS = ("ring_k", "ring_v", "surv_k", "surv_v", "surv_k_rot")


def _bits_on_cpu(cache: KVCache) -> bool:
    """bfloat16 K/V on CPU run through the model as uint16 bits (see rsqr_jax.attention.BITS_DTYPE)."""
    return cache.ring_k.dtype == jnp.bfloat16 and jax.default_backend() == "cpu"


def _kv_bitcast(cache: KVCache, dtype) -> KVCache:
    return cache.replace(**{f: jax.lax.bitcast_convert_type(getattr(cache, f), dtype) for f in _KV_FIELDS})


def step(apply_fn: ApplyFn, params, tokens_BxC: jax.Array, cache: KVCache, policy: Policy,
         n_valid: jax.Array | int | None = None) -> tuple[jax.Array, KVCache]:
    """Append a chunk (its first n_valid tokens real) under `policy`: logits [B, C, V] and the new cache."""
    C = tokens_BxC.shape[1]
    plan = plan_step(cache, policy, C, n_valid)
    if cache.ring_tok.shape[1]:
        cache = cache.replace(ring_tok=cache.ring_tok.at[:, plan.ring_slot].set(tokens_BxC, mode="drop"))
    if cache.surv_tok.shape[1]:
        cache = cache.replace(surv_tok=cache.surv_tok.at[:, plan.surv_slot].set(tokens_BxC, mode="drop"))

    def normal(cache):
        if not _bits_on_cpu(cache):
            return apply_fn(params, tokens_BxC, cache, plan)
        logits, bits = apply_fn(params, tokens_BxC, _kv_bitcast(cache, BITS_DTYPE), plan)
        return logits, _kv_bitcast(bits, jnp.bfloat16)

    if cache.ring_tok.shape[1]:
        logits, cache = jax.lax.cond(plan.replay_event, lambda c: _replay(apply_fn, params, c, plan),
                                     normal, cache)
    else:
        logits, cache = normal(cache)
    return logits, cache.replace(**plan.next_state)


def nll_scan(apply_fn: ApplyFn, params, cache: KVCache, policy: Policy, tokens_KxBxC: jax.Array,
             targets_KxBxC: jax.Array, n_valid_K: jax.Array) -> tuple[KVCache, jax.Array]:
    """Stream K chunks under lax.scan; returns the cache and the NLL [K, B, C] of each target token."""

    def body(cache, xs):
        tokens, targets, n_valid = xs
        logits, cache = step(apply_fn, params, tokens, cache, policy, n_valid)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return cache, nll

    return jax.lax.scan(body, cache, (tokens_KxBxC, targets_KxBxC, n_valid_K))


@dataclasses.dataclass
class SamplerState:
    """Host-visible sampler state; the rng key is what makes a resumed session bit-identical."""

    rng: jax.Array
    temperature: float = 0.0
    top_p: float = 1.0


def decode_and_sample(apply_fn: ApplyFn, params, tokens_BxC: jax.Array, cache: KVCache, policy: Policy,
                      n_valid: jax.Array, rng: jax.Array, temperature: jax.Array, top_p: jax.Array):
    """One chunk step followed by sampling the token after the last real one: (next_B, cache, rng)."""
    logits, cache = step(apply_fn, params, tokens_BxC, cache, policy, n_valid)
    rng, sub = jax.random.split(rng)
    last = jnp.take(logits, jnp.maximum(n_valid - 1, 0), axis=1)
    return sample(last, sub, temperature, top_p), cache, rng


def stream_nll(apply_fn: ApplyFn, params, tokens_BxT, policy: Policy, spec: CacheSpec, *, chunk: int = 1,
               segment: int = 256, progress=None, vmap_policies: bool = False, cache: KVCache | None = None,
               out_shardings=None):
    """Per-token NLL [B, T-1] (float32 numpy) of streaming tokens_BxT through the cache under `policy`.

    Token t+1 is scored from the logits at t. The stream runs in jitted segments of `segment` tokens
    (one `lax.scan` of chunk steps each; the last one padded with n_valid = 0 chunks), so a stream of
    any length compiles once. With vmap_policies, `policy` carries a leading [P] axis and the result
    is [P, B, T-1] (weights shared, not copied). `progress(n_tokens_done)` is called per segment.
    `cache` starts from a given (e.g. pre-sharded) cache; `out_shardings` = (cache shardings pytree,
    nll sharding) pins the segment function's outputs (rsqr_jax.sweep uses both to shard a sweep).
    """
    import numpy as np

    from rsqr_jax.cache import validate

    validate(policy, spec, chunk=chunk)
    tokens = np.asarray(tokens_BxT, dtype=np.int32)
    B, T = tokens.shape
    if B != spec.batch:
        raise ValueError(f"tokens have batch {B} but the cache spec has batch {spec.batch}")
    n_pred = T - 1
    if segment % chunk:
        raise ValueError(f"segment {segment} must be a multiple of chunk {chunk}")
    if P.FULL in np.atleast_1d(np.asarray(policy.mode)) and T > spec.ring_capacity:
        raise ValueError(f"full attention over {T} tokens needs ring capacity >= {T} (has {spec.ring_capacity})")
    K = segment // chunk
    n_seg = -(-n_pred // segment)
    pad = n_seg * segment - n_pred
    inputs = np.concatenate([tokens[:, :-1], np.zeros((B, pad), np.int32)], axis=1)
    targets = np.concatenate([tokens[:, 1:], np.zeros((B, pad), np.int32)], axis=1)
    valid = np.concatenate([np.ones(n_pred, np.int32), np.zeros(pad, np.int32)]).reshape(n_seg, K, chunk).sum(-1)

    def to_KxBxC(x, s):
        return np.ascontiguousarray(x[:, s * segment:(s + 1) * segment].reshape(B, K, chunk).transpose(1, 0, 2))

    run = _segment_runner(apply_fn, vmap_policies, out_shardings)
    if cache is None:
        cache = init_cache(spec)
        if vmap_policies:
            n_pol = int(np.asarray(policy.mode).shape[0])
            cache = jax.tree.map(lambda x: jnp.broadcast_to(x, (n_pol,) + x.shape), cache)
    out = []
    for s in range(n_seg):
        cache, nll = run(params, cache, policy, to_KxBxC(inputs, s), to_KxBxC(targets, s), jnp.asarray(valid[s]))
        out.append(np.asarray(nll))
        if progress is not None:
            progress(min((s + 1) * segment, n_pred))
    nll = np.concatenate(out, axis=-3)  # [..., n_seg*K, B, C]
    nll = np.moveaxis(nll, -2, -3)  # [..., B, n_seg*K, C]
    nll = nll.reshape(nll.shape[:-2] + (-1,))[..., :n_pred]
    return nll, cache


_RUNNERS: dict = {}


def _segment_runner(apply_fn, vmap_policies: bool, out_shardings=None):
    """One jitted segment function per apply_fn (cache donated so it is updated in place)."""
    key = (apply_fn, vmap_policies, out_shardings)
    if key not in _RUNNERS:
        def seg(params, cache, policy, tok, tgt, valid):
            return nll_scan(apply_fn, params, cache, policy, tok, tgt, valid)

        if vmap_policies:
            seg = jax.vmap(seg, in_axes=(None, 0, 0, None, None, None))
        kw = {} if out_shardings is None else {"out_shardings": out_shardings}
        _RUNNERS[key] = jax.jit(seg, donate_argnums=(1,), **kw)
    return _RUNNERS[key]
