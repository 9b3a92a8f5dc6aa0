"""The one decode engine: a frozen, hashable `Decoder` that owns its compiled functions.

A Decoder holds what is static about a stream (the model's pure apply function, the CacheSpec, whether
the policy is a compile-time constant or a vmapped batch, the generation block size); it is passed to
`jax.jit` as a static argument, so every Decoder that compares equal shares one compilation of each
function, and a stream of any length runs under one compilation per chunk size. Every function donates
the cache, so it is updated in place.

    dec = Decoder(apply_fn, spec)                         # policy as data (any policy of the spec)
    logits_BxCxV, cache = dec.feed(params, tokens_BxC, cache, policy, n_valid)
    nll_KxBxC, cache = dec.score(params, tokens_KxBxC, targets_KxBxC, cache, policy, n_valid_K)
    out = dec.generate(params, pending_B, cache, policy, state, sampling.values(), n_steps, eos_E)

Every method, in each mode (one policy, a vmapped policy batch, many streams), takes its arguments in one
order: params, what it consumes (tokens, targets, pending tokens), the cache, the policy, then the rest; it
returns what it computed first, then the cache (then the sampler state, where it draws).

`fixed_policy` (the policy's field values) bakes one policy in as constants: XLA then folds every mode
test of the update and drops the branches that policy never takes (what a Session wants).
`vmap_policies` runs a policy batch [P] over a cache with a leading policy axis (weights shared).
`vmap_streams` runs N independent streams (one policy) over a cache with a leading stream axis [N]: each
stream has its own positions, length and rng; `feed_streams` / `generate_streams` (a scheduler over them:
rsqr_jax.streams) take a per-stream n_valid / token budget, so streams join and leave without a recompile;
`score_streams` / `advance_streams` score each stream's own request (rsqr_jax.eval.harness.StreamsEngine).
rsqr_jax stays model-agnostic: the model comes in as `apply_fn(params, tokens_BxC, cache, plan)`.

Sampling (rsqr_jax.sampling): the functions that pick tokens take a `SamplerState` (the rng key and the ring
of the last `repeat_last_n` token ids fed, for the repetition penalties; a bare PRNG key starts an empty
ring) and the dynamic `SamplingValues` (default: greedy), so every setting but the ring size and the
candidate count (`repeat_last_n`, `max_candidates`: static Decoder fields) runs under one compilation.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rsqr_jax import policy as P
from rsqr_jax.cache import KV_FIELDS, KVCache, init_cache, init_policy_cache
from rsqr_jax.kernels.store import BITS_DTYPE
from rsqr_jax.policy import Policy
from rsqr_jax.recall import RecallConfig, config_of
from rsqr_jax.sampling import DEFAULT_MAX_CANDIDATES, Sampling, SamplingValues, push_recent, sample
from rsqr_jax.spec import CacheSpec, validate
from rsqr_jax.update import StepPlan, commit, plan_step


# ----------------------------------------------------------------------------------------------------
# One step of a chunk: plan it, run the model (whose layers apply the plan), commit it.

ApplyFn = Callable  # (params, tokens_BxC, cache, plan) -> (logits_BxCxV, cache)


def _bits_on_cpu(cache: KVCache) -> bool:
    return cache.win_k.dtype == jnp.bfloat16 and jax.default_backend() == "cpu"


def _kv_bitcast(cache: KVCache, dtype) -> KVCache:
    cast = lambda x: jax.lax.bitcast_convert_type(x, dtype)  # noqa: E731
    cold = cache.cold if cache.cold is None else cache.cold.replace(k=cast(cache.cold.k), v=cast(cache.cold.v))
    return cache.replace(cold=cold, **{f: cast(getattr(cache, f)) for f in KV_FIELDS})


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
         n_valid: jax.Array | int | None = None, *, last_logits: bool = False,
         recall: RecallConfig | None = None) -> tuple[jax.Array, KVCache]:
    """Append a chunk (its first n_valid tokens real) under `policy`: logits [B, C, V] and the new cache.

    last_logits (static): only the last real token's logits, [B, 1, V] (what sampling reads): the plan names that
    row (StepPlan.logits_row) for a model that computes only it; another model's rows are taken here.
    recall (static, rsqr_jax.recall.config_of(spec)): the recall tier's settings (`plan_step`)."""
    C = tokens_BxC.shape[1]
    plan = plan_step(cache, policy, C, n_valid, recall=recall)
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

# How often each compiled function has been traced (a test proves one compilation per configuration).
TRACES: collections.Counter = collections.Counter()


def policy_values(policy: Policy) -> tuple[int, ...]:
    """A single concrete policy as a hashable tuple of its field values (Policy field order; `Policy.host`)."""
    values = tuple(policy.host().values())
    if any(isinstance(v, list) for v in values):
        raise ValueError("a fixed policy is one policy, not a stacked batch")
    return values


class SamplerState(NamedTuple):
    """What sampling carries from token to token: the rng key ([2]; [N, 2] over N streams) and the ring of
    the last repeat_last_n token ids fed to the model, oldest first, -1 = empty (int32 [B, R]; [N, R])."""

    rng: jax.Array
    recent: jax.Array


class Generated(NamedTuple):
    """One block of `Decoder.generate`: tokens_BxK (-1 past each row's end), n_steps run, the pending
    token of each row (sampled after its last fed token), done_B (row emitted an end-of-sequence token)."""

    tokens_BxK: jax.Array
    n_steps: jax.Array
    pending_B: jax.Array
    done_B: jax.Array
    cache: KVCache
    state: SamplerState


@dataclasses.dataclass(frozen=True)
class Decoder:
    """Static description of a stream; hashable, so it is the static argument of its jitted functions.

    apply_fn: the model, (params, tokens_BxC, cache, plan) -> (logits_BxCxV, cache).
    spec: the cache capacities. fixed_policy: `policy_values(p)` to compile one policy in as constants
    (the `policy` argument of every method is then ignored and may be None). vmap_policies: the policy
    and the cache carry a leading [P] axis. gen_block: tokens per compiled generation block (the host
    sees tokens once per block). cache_sharding: a KVCache of shardings the outputs are pinned to.
    repeat_last_n: the size of the ring of recent token ids the penalties count (0 = no ring, no penalty
    work). max_candidates: how many best tokens the sampler keeps before top-k / top-p / min-p
    (rsqr_jax.sampling); both are shapes, hence static.
    """

    apply_fn: Callable
    spec: CacheSpec
    fixed_policy: tuple[int, ...] | None = None
    vmap_policies: bool = False
    gen_block: int = 16
    cache_sharding: Any = None
    vmap_streams: bool = False
    repeat_last_n: int = 0
    max_candidates: int = DEFAULT_MAX_CANDIDATES
    # the recall tier's static settings of every step (rsqr_jax.recall.config_of(spec)), derived once here
    recall: Any = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "recall", config_of(self.spec))
        if isinstance(self.repeat_last_n, bool) or not isinstance(self.repeat_last_n, int) or self.repeat_last_n < 0:
            raise ValueError(f"repeat_last_n must be an integer >= 0, got {self.repeat_last_n!r}")
        if isinstance(self.max_candidates, bool) or not isinstance(self.max_candidates, int) or self.max_candidates < 1:
            raise ValueError(f"max_candidates must be a positive integer, got {self.max_candidates!r}")
        if self.fixed_policy is not None and self.vmap_policies:
            raise ValueError("a Decoder has either one fixed policy or a vmapped policy batch, not both")
        if self.vmap_streams and (self.vmap_policies or self.spec.batch != 1):
            raise ValueError("a vmap_streams Decoder runs one policy over streams of batch 1 (spec.batch = 1)")
        if self.gen_block < 1:
            raise ValueError(f"gen_block must be >= 1, got {self.gen_block}")

    @classmethod
    def for_policy(cls, apply_fn: Callable, spec: CacheSpec, policy: Policy, **kw) -> "Decoder":
        """A Decoder with `policy` compiled in as constants (checked against the spec)."""
        validate(policy, spec, chunk=1)
        return cls(apply_fn, spec, fixed_policy=policy_values(policy), **kw)

    def init_cache(self, n_policies: int | None = None, start: int = 0, n_streams: int | None = None) -> KVCache:
        """An empty cache for this Decoder (with a leading policy axis when vmap_policies, a leading
        stream axis [n_streams] when vmap_streams)."""
        if self.vmap_policies:
            if n_policies is None:
                raise ValueError("a vmap_policies Decoder needs n_policies for its cache")
            return init_policy_cache(self.spec, n_policies, start)
        if self.vmap_streams:
            if n_streams is None:
                raise ValueError("a vmap_streams Decoder needs n_streams for its cache")
            return init_policy_cache(self.spec, n_streams, start)  # the same stacking, over streams
        return init_cache(self.spec, start)

    def sampler_state(self, rng, rows: int) -> SamplerState:
        """A SamplerState with an empty ring of `rows` rows (batch rows, or streams when vmap_streams); `rng`
        may already be a SamplerState (returned as is)."""
        if isinstance(rng, SamplerState):
            return rng
        return SamplerState(jnp.asarray(rng), jnp.full((rows, self.repeat_last_n), -1, jnp.int32))

    def _values(self, sampling, n_streams: int | None = None) -> SamplingValues:
        """The sampling values as device arrays (greedy when None); broadcast to [n_streams] for streams."""
        v = Sampling().values() if sampling is None else sampling.values() if isinstance(sampling, Sampling) \
            else sampling
        if not isinstance(v, SamplingValues):
            raise TypeError(f"sampling must be a Sampling or SamplingValues, got {type(sampling).__name__}")
        ints = ("top_k", "repeat_last_n")
        v = SamplingValues(*(jnp.asarray(x, jnp.int32 if k in ints else jnp.float32) for k, x in zip(v._fields, v)))
        if n_streams is not None:
            v = SamplingValues(*(jnp.broadcast_to(x, (n_streams,)) for x in v))
        return v

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

    def _map(self, fn: Callable, policy_axis_of: tuple, stream_axis_of: tuple | None = None) -> Callable:
        """fn itself, or fn vmapped over the policy axis of the arguments marked 0 in policy_axis_of (or over
        the stream axis of those marked 0 in stream_axis_of, when vmap_streams)."""
        if self.vmap_policies:
            return jax.vmap(fn, in_axes=policy_axis_of)
        if self.vmap_streams:
            if stream_axis_of is None:
                raise ValueError("a vmap_streams Decoder runs feed_streams / generate_streams only")
            return jax.vmap(fn, in_axes=stream_axis_of)
        return fn

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

    def feed_and_sample(self, params, tokens_BxC, cache: KVCache, policy: Policy | None, n_valid, state,
                        sampling: Sampling | SamplingValues | None = None):
        """Append a chunk and sample the token after its last real one: (next_B, cache, state).

        state: a SamplerState (or a bare PRNG key: an empty ring); its ring takes the chunk's real tokens
        before the draw. sampling: the settings or their values (None = greedy)."""
        tokens_BxC = jnp.asarray(tokens_BxC, jnp.int32)
        return _feed_and_sample(self, params, tokens_BxC, cache, policy, jnp.asarray(n_valid, jnp.int32),
                                self.sampler_state(state, tokens_BxC.shape[0]), self._values(sampling))

    def score(self, params, tokens_KxBxC, targets_KxBxC, cache: KVCache, policy: Policy | None, n_valid_K):
        """Stream K chunks under one lax.scan: (NLL [(P,) K, B, C] of each target token, cache)."""
        cache, nll = _score(self, params, cache, policy, tokens_KxBxC, targets_KxBxC, n_valid_K)
        return nll, cache

    def generate(self, params, pending_B, cache: KVCache, policy: Policy | None, state,
                 sampling: Sampling | SamplingValues | None, n_steps, eos_ids) -> Generated:
        """Up to min(n_steps, gen_block) generation steps in one compiled lax.while_loop (no host round trip
        per token). Each step emits every row's pending token; a row that emits an end-of-sequence id is
        done (that token is not fed); otherwise the pending tokens are fed and the next ones sampled."""
        eos_E = jnp.asarray(sorted(eos_ids) or [-1], jnp.int32)
        pending_B = jnp.asarray(pending_B, jnp.int32)
        return _generate(self, params, cache, policy, pending_B, self.sampler_state(state, pending_B.shape[0]),
                         self._values(sampling), jnp.asarray(n_steps, jnp.int32), eos_E)

    def feed_streams(self, params, tokens_NxC, cache: KVCache, policy: Policy | None, n_valid_N, reset_N, state_N,
                     sampling_N: Sampling | SamplingValues | None = None):
        """vmap_streams: append each stream's chunk (its first n_valid_N[i] tokens are real; 0 = the stream
        is untouched) after resetting the streams marked in reset_N to an empty cache and ring (a stream
        joins), and sample the token after each stream's last real one: (next_N, cache, state_N). A stream's
        rng key is split only when it moves, so it sees the key sequence a lone Session would. state_N: a
        SamplerState over streams (or bare keys [N, 2]); sampling_N: values per stream ([N] arrays) or one
        setting for all."""
        tokens_NxC = jnp.asarray(tokens_NxC, jnp.int32)
        N = tokens_NxC.shape[0]
        return _feed_streams(self, params, tokens_NxC, cache, policy, jnp.asarray(n_valid_N, jnp.int32),
                             jnp.asarray(reset_N, bool), self.sampler_state(state_N, N), self._values(sampling_N, N))

    def generate_streams(self, params, pending_N, cache: KVCache, policy: Policy | None, budget_N, state_N,
                         sampling_N: Sampling | SamplingValues | None, eos_ids, feed_only_N=None,
                         reset_N=None) -> "StreamsGenerated":
        """vmap_streams: up to gen_block generation steps in one compiled while_loop. Each step, every stream
        with budget left emits its pending token (and spends one budget); a stream that emits an
        end-of-sequence id stops (budget 0, the token is not fed); the others feed it and sample the next.
        feed_only_N: streams whose pending token is their prompt's last one: the first step feeds it
        without emitting it (a 1-token prefill, so no separate 1-wide prefill compilation is needed).
        reset_N: streams reset to an empty cache and ring first (as in feed_streams)."""
        eos_E = jnp.asarray(sorted(eos_ids) or [-1], jnp.int32)
        N = int(np.shape(pending_N)[0])
        no = np.zeros(N, bool)
        return _generate_streams(self, params, cache, policy, jnp.asarray(pending_N, jnp.int32),
                                 jnp.asarray(budget_N, jnp.int32), self.sampler_state(state_N, N),
                                 self._values(sampling_N, N), eos_E,
                                 jnp.asarray(no if feed_only_N is None else feed_only_N, bool),
                                 jnp.asarray(no if reset_N is None else reset_N, bool))


    def score_streams(self, params, tokens_NxC, targets_NxC, cache: KVCache, policy: Policy | None, n_valid_N,
                      reset_N):
        """vmap_streams: append each stream's chunk (n_valid_N[i] real tokens; 0 = untouched) after resetting
        the streams in reset_N, and score it: (log p of each target [N, C] (float32), whether each target is
        the argmax [N, C], cache). Each stream scores its own request: joins and leaves are data."""
        return _score_streams(self, params, jnp.asarray(tokens_NxC, jnp.int32), jnp.asarray(targets_NxC, jnp.int32),
                              cache, policy, jnp.asarray(n_valid_N, jnp.int32), jnp.asarray(reset_N, bool))

    def advance_streams(self, params, tokens_NxC, cache: KVCache, policy: Policy | None, n_valid_N, reset_N):
        """score_streams without the scores (no vocabulary projection): the chunks before a request's first
        scored token."""
        return _advance_streams(self, params, jnp.asarray(tokens_NxC, jnp.int32), cache, policy,
                                jnp.asarray(n_valid_N, jnp.int32), jnp.asarray(reset_N, bool))


class StreamsGenerated(NamedTuple):
    """One block of `Decoder.generate_streams`: tokens_NxK (-1 where a stream emitted nothing), n_steps
    run, each stream's pending token and remaining budget (0 = stopped: budget spent or end-of-sequence)."""

    tokens_NxK: jax.Array
    n_steps: jax.Array
    pending_N: jax.Array
    budget_N: jax.Array
    cache: KVCache
    state_N: SamplerState


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
                    recall=dec.recall)

    logits, cache = dec._map(fn, (0, 0))(cache, policy)
    cache, logits = dec._pin(cache, logits)
    return logits, cache


@_jit(donate=3)
def _feed(dec: Decoder, params, tokens_BxC, cache, policy, n_valid):
    return _feed_body(dec, params, tokens_BxC, cache, policy, n_valid)


@_jit(donate=3)
def _advance(dec: Decoder, params, tokens_BxC, cache, policy, n_valid):
    return _feed_body(dec, params, tokens_BxC, cache, policy, n_valid)[1]


def _sample_step(dec: Decoder, params, tokens_BxC, cache, policy, n_valid, state: SamplerState, values):
    logits, cache = step(dec.apply_fn, params, tokens_BxC, cache, dec._policy(policy), n_valid, last_logits=True,
                         recall=dec.recall)
    recent = push_recent(state.recent, tokens_BxC, n_valid)
    rng, sub = jax.random.split(state.rng)
    last_BxV = logits[:, 0]  # the last real token's (step's last_logits)
    return sample(last_BxV, sub, values, recent, dec.max_candidates), cache, SamplerState(rng, recent)


@_jit(donate=3)
def _feed_and_sample(dec: Decoder, params, tokens_BxC, cache, policy, n_valid, state, values):
    if dec.vmap_policies or dec.vmap_streams:
        raise ValueError("feed_and_sample runs one policy on one stream (vmap_policies=False, vmap_streams=False)")
    nxt, cache, state = _sample_step(dec, params, tokens_BxC, cache, policy, n_valid, state, values)
    return nxt, dec._pin(cache)[0], state


def _stream_step(dec: Decoder, params, tokens_NxC, cache, policy, n_valid_N, state_N, values_N):
    """One vmap_streams step: (next_N, cache, state_N), each stream's rng split only if it moved."""
    def one(tokens_C, cache, n_valid, rng, recent_R, values):
        nxt, cache, new = _sample_step(dec, params, tokens_C[None], cache, policy, n_valid,
                                       SamplerState(rng, recent_R[None]), values)
        return nxt[0], cache, SamplerState(jnp.where(n_valid > 0, new.rng, rng), new.recent[0])

    return dec._map(one, None, (0, 0, 0, 0, 0, 0))(tokens_NxC, cache, n_valid_N, state_N.rng, state_N.recent,
                                                   values_N)


def _reset_streams(dec: Decoder, cache, reset_N, state_N: SamplerState):
    """The streams marked in reset_N replaced by an empty cache and ring (a new stream joins that slot)."""
    empty = init_cache(dec.spec)
    cache = jax.tree.map(lambda c, e: jnp.where(reset_N.reshape((-1,) + (1,) * e.ndim), e, c), cache, empty)
    if state_N is None:
        return cache
    return cache, state_N._replace(recent=jnp.where(reset_N[:, None], -1, state_N.recent))


@_jit(donate=3)
def _feed_streams(dec: Decoder, params, tokens_NxC, cache, policy, n_valid_N, reset_N, state_N, values_N):
    if not dec.vmap_streams:
        raise ValueError("feed_streams needs a vmap_streams Decoder")
    cache, state_N = _reset_streams(dec, cache, reset_N, state_N)
    nxt, cache, state_N = _stream_step(dec, params, tokens_NxC, cache, policy, n_valid_N, state_N, values_N)
    return nxt, dec._pin(cache)[0], state_N


def _stream_feed_body(dec: Decoder, params, tokens_NxC, cache, policy, n_valid_N, reset_N):
    """(logits [N, C, V], cache) of one chunk per stream (the streams in reset_N reset first)."""
    if not dec.vmap_streams:
        raise ValueError("score_streams / advance_streams need a vmap_streams Decoder")
    cache = _reset_streams(dec, cache, reset_N, None)

    def one(tokens_C, cache, n_valid):
        logits, cache = step(dec.apply_fn, params, tokens_C[None], cache, dec._policy(policy), n_valid,
                             recall=dec.recall)
        return logits[0], cache

    return dec._map(one, None, (0, 0, 0))(tokens_NxC, cache, n_valid_N)


@_jit(donate=4)
def _score_streams(dec: Decoder, params, tokens_NxC, targets_NxC, cache, policy, n_valid_N, reset_N):
    logits, cache = _stream_feed_body(dec, params, tokens_NxC, cache, policy, n_valid_N, reset_N)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, targets_NxC[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logp, axis=-1) == targets_NxC, dec._pin(cache)[0]


@_jit(donate=3)
def _advance_streams(dec: Decoder, params, tokens_NxC, cache, policy, n_valid_N, reset_N):
    return dec._pin(_stream_feed_body(dec, params, tokens_NxC, cache, policy, n_valid_N, reset_N)[1])[0]


@_jit(donate=2)
def _generate_streams(dec: Decoder, params, cache, policy, pending_N, budget_N, state_N, values_N, eos_E,
                      feed_only_N, reset_N):
    if not dec.vmap_streams:
        raise ValueError("generate_streams needs a vmap_streams Decoder")
    cache, state_N = _reset_streams(dec, cache, reset_N, state_N)
    K, N = dec.gen_block, pending_N.shape[0]

    def cond(carry):
        i, _, budget, *_ = carry
        return (i < K) & jnp.any(budget > 0)

    def body(carry):
        i, pending, budget, feed_only, cache, state, out = carry
        live = budget > 0
        emit = live & ~feed_only
        out = out.at[:, i].set(jnp.where(emit, pending, -1))
        eos = emit & jnp.isin(pending, eos_E)
        fed = live & ~eos
        budget = jnp.where(eos, 0, budget - emit.astype(jnp.int32))
        nxt, cache, state = _stream_step(dec, params, pending[:, None], cache, policy, fed.astype(jnp.int32), state,
                                         values_N)
        return i + 1, jnp.where(fed, nxt, pending), budget, jnp.zeros_like(feed_only), cache, state, out

    init = (jnp.int32(0), pending_N, budget_N, feed_only_N, cache, state_N, jnp.full((N, K), -1, jnp.int32))
    i, pending, budget, _, cache, state, out = jax.lax.while_loop(cond, body, init)
    return StreamsGenerated(out, i, pending, budget, dec._pin(cache)[0], state)


@_jit(donate=2)
def _score(dec: Decoder, params, cache, policy, tokens_KxBxC, targets_KxBxC, n_valid_K):
    def run(cache, policy):
        pol = dec._policy(policy)

        def body(cache, xs):
            tokens, targets, n_valid = xs
            logits, cache = step(dec.apply_fn, params, tokens, cache, pol, n_valid,
                                 recall=dec.recall)
            logp = jax.nn.log_softmax(logits, axis=-1)
            return cache, -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]

        return jax.lax.scan(body, cache, (tokens_KxBxC, targets_KxBxC, n_valid_K))

    return dec._pin(*dec._map(run, (0, 0))(cache, policy))


@_jit(donate=2)
def _generate(dec: Decoder, params, cache, policy, pending_B, state, values, n_steps, eos_E):
    if dec.vmap_policies or dec.vmap_streams:
        raise ValueError("generate runs one policy on one stream (vmap_policies=False, vmap_streams=False)")
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
        i, pending, done, cache, state, out = carry
        out = out.at[:, i].set(jnp.where(done, -1, pending))
        done = done | is_eos(pending)
        nxt, cache, state = _sample_step(dec, params, pending[:, None], cache, policy, jnp.int32(1), state, values)
        return i + 1, jnp.where(done, pending, nxt), done, cache, state, out

    init = (jnp.int32(0), pending_B, jnp.zeros((B,), bool), cache, state, jnp.full((B, K), -1, jnp.int32))
    i, pending, done, cache, state, out = jax.lax.while_loop(cond, body, init)
    last = (i < n_steps) & ~done & is_eos(pending)  # rows that stopped on an end-of-sequence token: emit it
    out = out.at[:, jnp.minimum(i, K - 1)].set(jnp.where(last, pending, out[:, jnp.minimum(i, K - 1)]))
    i = i + jnp.any(last).astype(jnp.int32)
    done = done | last
    return Generated(out, i, pending, done, dec._pin(cache)[0], state)


# ----------------------------------------------------------------------------------------------------
# Streaming perplexity on top of the engine.


def stream_nll(apply_fn: Callable, params, tokens_BxT, policy: Policy | list[Policy], spec: CacheSpec, *,
               chunk: int = 1, segment: int = 256, progress=None, vmap_policies: bool = False, cache: KVCache | None = None,
               cache_sharding=None):
    """Per-token NLL [B, T-1] (float32 numpy) of streaming tokens_BxT through the cache under `policy`.

    Token t+1 is scored from the logits at t. The stream runs in jitted segments of `segment` tokens
    (one `Decoder.score` scan of chunk steps each; the last one padded with n_valid = 0 chunks), so a
    stream of any length compiles once. With vmap_policies, `policy` carries a leading [P] axis and the
    result is [P, B, T-1] (weights shared, not copied); a list (or tuple) of policies is stacked and vmapped
    the same way, so a sweep need not stack by hand. `progress(n_tokens_done)` is called per segment.
    `cache` continues from a given (e.g. pre-sharded) cache; `cache_sharding` pins the cache's sharding.
    Returns (nll, final cache).
    """
    if isinstance(policy, (list, tuple)):
        policy, vmap_policies = P.stack_policies(list(policy)), True
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
        nll, cache = dec.score(params, to_KxBxC(inputs, s), to_KxBxC(targets, s), cache, policy, jnp.asarray(valid[s]))
        out.append(np.asarray(nll))
        if progress is not None:
            progress(min((s + 1) * segment, n_pred))
    nll = np.concatenate(out, axis=-3)  # [..., n_seg*K, B, C]
    nll = np.moveaxis(nll, -2, -3)  # [..., B, n_seg*K, C]
    nll = nll.reshape(nll.shape[:-2] + (-1,))[..., :n_pred]
    return nll, cache
