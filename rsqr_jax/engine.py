"""The one decode engine: a frozen, hashable `Decoder` that owns its compiled functions.

A Decoder holds what is static about a stream (the model's pure apply function, the CacheSpec, whether
the policy is a compile-time constant or a vmapped batch, the generation block size); it is passed to
`jax.jit` as a static argument, so every Decoder that compares equal shares one compilation of each
function, and a stream of any length runs under one compilation per chunk size. Every function donates
the cache, so it is updated in place.

    dec = Decoder(apply_fn, spec)                         # policy as data (any policy of the spec)
    logits_BxCxV, cache = dec.feed(params, tokens_BxC, cache, policy, n_valid)
    cache, nll_KxBxC = dec.score(params, cache, policy, tokens_KxBxC, targets_KxBxC, n_valid_K)
    out = dec.generate(params, cache, policy, pending_B, rng, temperature, top_p, n_steps, eos_E)

`fixed_policy` (the policy's field values) bakes one policy in as constants: XLA then folds every mode
test of the update and drops the branches that policy never takes (what a Session wants).
`vmap_policies` runs a policy batch [P] over a cache with a leading policy axis (weights shared).
rsqr_jax stays model-agnostic: the model comes in as `apply_fn(params, tokens_BxC, cache, plan)`.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rsqr_jax import policy as P
from rsqr_jax.cache import KVCache, init_cache, init_policy_cache
from rsqr_jax.policy import Policy
from rsqr_jax.sampling import sample
from rsqr_jax.spec import CacheSpec, validate
from rsqr_jax.update import step

# How often each compiled function has been traced (a test proves one compilation per configuration).
TRACES: collections.Counter = collections.Counter()


def policy_values(policy: Policy) -> tuple[int, ...]:
    """A single concrete policy as a hashable tuple of its field values (Policy field order)."""
    return tuple(int(np.asarray(getattr(policy, f.name))) for f in dataclasses.fields(Policy))


class Generated(NamedTuple):
    """One block of `Decoder.generate`: tokens_BxK (-1 past each row's end), n_steps run, the pending
    token of each row (sampled after its last fed token), done_B (row emitted an end-of-sequence token)."""

    tokens_BxK: jax.Array
    n_steps: jax.Array
    pending_B: jax.Array
    done_B: jax.Array
    cache: KVCache
    rng: jax.Array


@dataclasses.dataclass(frozen=True)
class Decoder:
    """Static description of a stream; hashable, so it is the static argument of its jitted functions.

    apply_fn: the model, (params, tokens_BxC, cache, plan) -> (logits_BxCxV, cache).
    spec: the cache capacities. fixed_policy: `policy_values(p)` to compile one policy in as constants
    (the `policy` argument of every method is then ignored and may be None). vmap_policies: the policy
    and the cache carry a leading [P] axis. gen_block: tokens per compiled generation block (the host
    sees tokens once per block). cache_sharding: a KVCache of shardings the outputs are pinned to.
    """

    apply_fn: Callable
    spec: CacheSpec
    fixed_policy: tuple[int, ...] | None = None
    vmap_policies: bool = False
    gen_block: int = 16
    cache_sharding: Any = None

    def __post_init__(self):
        if self.fixed_policy is not None and self.vmap_policies:
            raise ValueError("a Decoder has either one fixed policy or a vmapped policy batch, not both")
        if self.gen_block < 1:
            raise ValueError(f"gen_block must be >= 1, got {self.gen_block}")

    @classmethod
    def for_policy(cls, apply_fn: Callable, spec: CacheSpec, policy: Policy, **kw) -> "Decoder":
        """A Decoder with `policy` compiled in as constants (checked against the spec)."""
        validate(policy, spec, chunk=1)
        return cls(apply_fn, spec, fixed_policy=policy_values(policy), **kw)

    def init_cache(self, n_policies: int | None = None, start: int = 0) -> KVCache:
        """An empty cache for this Decoder (with a leading policy axis when vmap_policies)."""
        if self.vmap_policies:
            if n_policies is None:
                raise ValueError("a vmap_policies Decoder needs n_policies for its cache")
            return init_policy_cache(self.spec, n_policies, start)
        return init_cache(self.spec, start)

    def _policy(self, policy: Policy | None) -> Policy:
        if self.fixed_policy is None:
            if policy is None:
                raise ValueError("this Decoder has no fixed policy: pass one")
            return policy
        return Policy(*(jnp.asarray(v, jnp.int32) for v in self.fixed_policy))

    def _pin(self, cache: KVCache, *replicated):
        """The cache pinned to cache_sharding (and the other outputs replicated on its mesh)."""
        if self.cache_sharding is None:
            return (cache, *replicated)
        cache = jax.tree.map(jax.lax.with_sharding_constraint, cache, self.cache_sharding)
        mesh = jax.tree.leaves(self.cache_sharding)[0].mesh
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return (cache, *(jax.lax.with_sharding_constraint(x, rep) for x in replicated))

    def _map(self, fn: Callable, policy_axis_of: tuple) -> Callable:
        """fn itself, or fn vmapped over the policy axis of the arguments marked 0 in policy_axis_of."""
        return jax.vmap(fn, in_axes=policy_axis_of) if self.vmap_policies else fn

    # The public methods: thin calls of the module-level jitted functions (self is the static argument).
    def feed(self, params, tokens_BxC, cache: KVCache, policy: Policy | None, n_valid=None):
        """Append a chunk: (logits [(P,) B, C, V], new cache). n_valid: how many of its tokens are real."""
        n_valid = tokens_BxC.shape[1] if n_valid is None else n_valid
        return _feed(self, params, jnp.asarray(tokens_BxC, jnp.int32), cache, policy, jnp.asarray(n_valid, jnp.int32))

    def advance(self, params, tokens_BxC, cache: KVCache, policy: Policy | None, n_valid=None) -> KVCache:
        """Append a chunk and return only the new cache (no logits: XLA drops the vocabulary projection)."""
        n_valid = tokens_BxC.shape[1] if n_valid is None else n_valid
        return _advance(self, params, jnp.asarray(tokens_BxC, jnp.int32), cache, policy,
                        jnp.asarray(n_valid, jnp.int32))

    def feed_and_sample(self, params, tokens_BxC, cache: KVCache, policy: Policy | None, n_valid, rng,
                        temperature, top_p):
        """Append a chunk and sample the token after its last real one: (next_B, cache, rng)."""
        return _feed_and_sample(self, params, jnp.asarray(tokens_BxC, jnp.int32), cache, policy,
                                jnp.asarray(n_valid, jnp.int32), rng, jnp.float32(temperature), jnp.float32(top_p))

    def score(self, params, cache: KVCache, policy: Policy | None, tokens_KxBxC, targets_KxBxC, n_valid_K):
        """Stream K chunks under one lax.scan: (cache, NLL [(P,) K, B, C] of each target token)."""
        return _score(self, params, cache, policy, tokens_KxBxC, targets_KxBxC, n_valid_K)

    def generate(self, params, cache: KVCache, policy: Policy | None, pending_B, rng, temperature, top_p,
                 n_steps, eos_ids) -> Generated:
        """Up to min(n_steps, gen_block) generation steps in one compiled lax.while_loop (no host round trip
        per token). Each step emits every row's pending token; a row that emits an end-of-sequence id is
        done (that token is not fed); otherwise the pending tokens are fed and the next ones sampled."""
        eos_E = jnp.asarray(sorted(eos_ids) or [-1], jnp.int32)
        return _generate(self, params, cache, policy, jnp.asarray(pending_B, jnp.int32), rng,
                         jnp.float32(temperature), jnp.float32(top_p), jnp.asarray(n_steps, jnp.int32), eos_E)


def _jit(donate: int):
    def wrap(fn):
        name = fn.__name__.lstrip("_")

        def counted(*args):
            TRACES[name] += 1
            return fn(*args)

        return jax.jit(counted, static_argnums=0, donate_argnums=(donate,))
    return wrap


def _feed_body(dec: Decoder, params, tokens_BxC, cache, policy, n_valid):
    def fn(cache, policy):
        return step(dec.apply_fn, params, tokens_BxC, cache, dec._policy(policy), n_valid,
                    **dec.spec.recall_args)

    logits, cache = dec._map(fn, (0, 0))(cache, policy)
    cache, logits = dec._pin(cache, logits)
    return logits, cache


@_jit(donate=3)
def _feed(dec: Decoder, params, tokens_BxC, cache, policy, n_valid):
    return _feed_body(dec, params, tokens_BxC, cache, policy, n_valid)


@_jit(donate=3)
def _advance(dec: Decoder, params, tokens_BxC, cache, policy, n_valid):
    return _feed_body(dec, params, tokens_BxC, cache, policy, n_valid)[1]


def _sample_step(dec: Decoder, params, tokens_BxC, cache, policy, n_valid, rng, temperature, top_p):
    logits, cache = step(dec.apply_fn, params, tokens_BxC, cache, dec._policy(policy), n_valid,
                    **dec.spec.recall_args)
    rng, sub = jax.random.split(rng)
    last_BxV = jnp.take(logits, jnp.maximum(n_valid - 1, 0), axis=1)
    return sample(last_BxV, sub, temperature, top_p), cache, rng


@_jit(donate=3)
def _feed_and_sample(dec: Decoder, params, tokens_BxC, cache, policy, n_valid, rng, temperature, top_p):
    if dec.vmap_policies:
        raise ValueError("feed_and_sample runs one policy (vmap_policies=False)")
    nxt, cache, rng = _sample_step(dec, params, tokens_BxC, cache, policy, n_valid, rng, temperature, top_p)
    return nxt, dec._pin(cache)[0], rng


@_jit(donate=2)
def _score(dec: Decoder, params, cache, policy, tokens_KxBxC, targets_KxBxC, n_valid_K):
    def run(cache, policy):
        pol = dec._policy(policy)

        def body(cache, xs):
            tokens, targets, n_valid = xs
            logits, cache = step(dec.apply_fn, params, tokens, cache, pol, n_valid,
                                 **dec.spec.recall_args)
            logp = jax.nn.log_softmax(logits, axis=-1)
            return cache, -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]

        return jax.lax.scan(body, cache, (tokens_KxBxC, targets_KxBxC, n_valid_K))

    return dec._pin(*dec._map(run, (0, 0))(cache, policy))


@_jit(donate=2)
def _generate(dec: Decoder, params, cache, policy, pending_B, rng, temperature, top_p, n_steps, eos_E):
    if dec.vmap_policies:
        raise ValueError("generate runs one policy (vmap_policies=False)")
    K = dec.gen_block
    B = pending_B.shape[0]
    n_steps = jnp.minimum(n_steps, K)
    is_eos = lambda tok: jnp.isin(tok, eos_E)  # noqa: E731

    # Branch-free body: the loop stops *before* a step whose pending tokens are all end-of-sequence (or
    # done), so an end-of-sequence token is never fed; it is emitted after the loop.
    def cond(carry):
        i, pending, done, *_ = carry
        return (i < n_steps) & ~jnp.all(done | is_eos(pending))

    def body(carry):
        i, pending, done, cache, rng, out = carry
        out = out.at[:, i].set(jnp.where(done, -1, pending))
        done = done | is_eos(pending)
        nxt, cache, rng = _sample_step(dec, params, pending[:, None], cache, policy, jnp.int32(1), rng, temperature,
                                       top_p)
        return i + 1, jnp.where(done, pending, nxt), done, cache, rng, out

    init = (jnp.int32(0), pending_B, jnp.zeros((B,), bool), cache, rng, jnp.full((B, K), -1, jnp.int32))
    i, pending, done, cache, rng, out = jax.lax.while_loop(cond, body, init)
    last = (i < n_steps) & ~done & is_eos(pending)  # rows that stopped on an end-of-sequence token: emit it
    out = out.at[:, jnp.minimum(i, K - 1)].set(jnp.where(last, pending, out[:, jnp.minimum(i, K - 1)]))
    i = i + jnp.any(last).astype(jnp.int32)
    done = done | last
    return Generated(out, i, pending, done, dec._pin(cache)[0], rng)


# ----------------------------------------------------------------------------------------------------
# Streaming perplexity on top of the engine.


def stream_nll(apply_fn: Callable, params, tokens_BxT, policy: Policy, spec: CacheSpec, *, chunk: int = 1,
               segment: int = 256, progress=None, vmap_policies: bool = False, cache: KVCache | None = None,
               cache_sharding=None):
    """Per-token NLL [B, T-1] (float32 numpy) of streaming tokens_BxT through the cache under `policy`.

    Token t+1 is scored from the logits at t. The stream runs in jitted segments of `segment` tokens
    (one `Decoder.score` scan of chunk steps each; the last one padded with n_valid = 0 chunks), so a
    stream of any length compiles once. With vmap_policies, `policy` carries a leading [P] axis and the
    result is [P, B, T-1] (weights shared, not copied). `progress(n_tokens_done)` is called per segment.
    `cache` continues from a given (e.g. pre-sharded) cache; `cache_sharding` pins the cache's sharding.
    Returns (nll, final cache).
    """
    validate(policy, spec, chunk=chunk)
    tokens = np.asarray(tokens_BxT, dtype=np.int32)
    B, T = tokens.shape
    if B != spec.batch:
        raise ValueError(f"tokens have batch {B} but the cache spec has batch {spec.batch}")
    n_pred = T - 1
    if segment % chunk:
        raise ValueError(f"segment {segment} must be a multiple of chunk {chunk}")
    if P.FULL in np.atleast_1d(np.asarray(policy.mode)) and T > spec.win_capacity:
        raise ValueError(f"full attention over {T} tokens needs window capacity >= {T} (has {spec.win_capacity})")
    K = segment // chunk
    n_seg = -(-n_pred // segment)
    pad = n_seg * segment - n_pred
    inputs = np.concatenate([tokens[:, :-1], np.zeros((B, pad), np.int32)], axis=1)
    targets = np.concatenate([tokens[:, 1:], np.zeros((B, pad), np.int32)], axis=1)
    valid = np.concatenate([np.ones(n_pred, np.int32), np.zeros(pad, np.int32)]).reshape(n_seg, K, chunk).sum(-1)

    def to_KxBxC(x, s):
        return np.ascontiguousarray(x[:, s * segment:(s + 1) * segment].reshape(B, K, chunk).transpose(1, 0, 2))

    dec = Decoder(apply_fn, spec, vmap_policies=vmap_policies, cache_sharding=cache_sharding)
    if cache is None:
        cache = dec.init_cache(P.policy_size(policy) if vmap_policies else None)
    out = []
    for s in range(n_seg):
        cache, nll = dec.score(params, cache, policy, to_KxBxC(inputs, s), to_KxBxC(targets, s), jnp.asarray(valid[s]))
        out.append(np.asarray(nll))
        if progress is not None:
            progress(min((s + 1) * segment, n_pred))
    nll = np.concatenate(out, axis=-3)  # [..., n_seg*K, B, C]
    nll = np.moveaxis(nll, -2, -3)  # [..., B, n_seg*K, C]
    nll = nll.reshape(nll.shape[:-2] + (-1,))[..., :n_pred]
    return nll, cache
