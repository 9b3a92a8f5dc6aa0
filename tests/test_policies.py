"""docs/design.md §4 consequences on a tiny random model and on the attention alone."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rsqr_jax.models.llama import Llama, split_apply
from rsqr_jax import policy as P
from rsqr_jax.cache import init_cache
from rsqr_jax.spec import CacheSpec
from rsqr_jax.engine import step
from rsqr_jax.update import attend_layer, commit, plan_step
from rsqr_lab.testing.oracle import reference_token_sets, stream_logits_f64
from rsqr_jax.models.tiny import tiny_config, tiny_weights

CFG = tiny_config()


@functools.lru_cache(maxsize=None)
def _model(seed=0, dtype="float32"):
    w = tiny_weights(CFG, seed)
    apply_fn, params = split_apply(Llama(CFG, w, dtype=jnp.dtype(dtype)))
    return w, apply_fn, params


@functools.lru_cache(maxsize=None)
def _runner(spec: CacheSpec, chunk: int, n_chunks: int):
    _, apply_fn, _ = _model(0, spec.dtype)

    @jax.jit
    def run(params, tokens_KxBxC, policy):
        def body(cache, tok):
            logits, cache = step(apply_fn, params, tok, cache, policy)
            return cache, logits

        return jax.lax.scan(body, init_cache(spec), tokens_KxBxC)

    return run


def stream(policy, tokens, *, dtype="float32", chunk=1, spec=None, seed=0):
    """Logits [T, V] of one sequence streamed under `policy` (the same compiled code for every policy)."""
    tokens = np.asarray(tokens)
    T = tokens.shape[0]
    if spec is None:
        spec = CacheSpec.for_policies(policy, num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                                      head_dim=CFG.head_dim, dtype=dtype, max_chunk=chunk, max_len=T)
    _, _, params = _model(seed, spec.dtype)
    cache, logits = _runner(spec, chunk, T // chunk)(params, jnp.asarray(tokens.reshape(T // chunk, 1, chunk)),
                                                     policy)
    return np.asarray(logits, np.float64).reshape(T, -1), cache


def sets_for(policy, T, chunk=1):
    h = policy.host()
    if h["mode"] == P.FULL:
        return [list(range(t + 1)) for t in range(T)]
    return [s for _, s in reference_token_sets(T, window=h["window"], n_sink=h["n_sink"], delta=h["delta"],
                                               max_survivors=h["max_survivors"], block=h["block"],
                                               overflow=P.OVERFLOWS[h["overflow"]], chunk=chunk)]


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


TOKENS = np.random.default_rng(1).integers(0, CFG.vocab_size, size=96)

POLICIES = {
    "window": P.window(10, block=2),
    "streamingllm": P.streamingllm(10, 3, block=2),
    "leave_gaps": P.leave_gaps(10, 3, 3, 5, block=2),
    "rerotate": P.rerotate(10, 3, 3, 5, block=2),
    "replay": P.replay(10, 3, 3, 5, block=2),
    "rsqr": P.rsqr(10, 3, 3, 5, block=2),
    "rsqr_precompute": P.rsqr_precompute(10, 3, 3, 5, block=2),
}


@functools.lru_cache(maxsize=None)
def _before_first_eviction():
    """Logits [P, 11, V] of every policy of POLICIES and of full over the first 11 tokens, in one jit(vmap)
    over the stacked policies on their union spec (one compilation; no ring wraps before an eviction,
    so the larger capacities change nothing here)."""
    pols = [P.full()] + [POLICIES[m] for m in sorted(POLICIES)]
    T = 11
    spec = CacheSpec.for_policies(pols, num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                                  head_dim=CFG.head_dim, max_chunk=1, max_len=T)
    _, apply_fn, params = _model()

    def one(policy, tokens_TxBxC):
        def body(cache, tok):
            logits, cache = step(apply_fn, params, tok, cache, policy)
            return cache, logits

        return jax.lax.scan(body, init_cache(spec), tokens_TxBxC)[1]

    tokens = jnp.asarray(TOKENS[:T].reshape(T, 1, 1))
    logits = jax.jit(jax.vmap(one, in_axes=(0, None)))(P.stack_policies(pols), tokens)
    return np.asarray(logits, np.float64).reshape(len(pols), T, -1)


@pytest.mark.parametrize("mode", sorted(POLICIES))
def test_every_policy_equals_full_before_first_eviction(mode):
    # Consequence 5: window 10 + block 2 - 1 = 11 tokens fit without any eviction.
    logits = _before_first_eviction()
    full, got = logits[0], logits[1 + sorted(POLICIES).index(mode)]
    assert rel_err(got, full) < 1e-5


@pytest.mark.parametrize("block", [1, 4])
def test_rsqr_without_survivors_equals_streamingllm(block):
    # Consequence 1, through many eviction events.
    sllm, _ = stream(P.streamingllm(12, 3, block=block), TOKENS)
    rsqr, _ = stream(P.make_policy("rsqr", window=12, n_sink=3, delta=0, block=block), TOKENS)
    assert rel_err(rsqr, sllm) < 1e-5
    full, _ = stream(P.full(), TOKENS)
    assert rel_err(rsqr, full) > 1e-2  # evictions really happened


@pytest.mark.parametrize("overflow", ["fifo", "decimate"])
def test_rsqr_precompute_equals_rsqr(overflow):
    # Consequence 3, with survivor overflow so the precomputed copies are renumbered many times.
    kw = dict(window=10, n_sink=2, delta=3, max_survivors=4, block=1, overflow=overflow)
    a, _ = stream(P.make_policy("rsqr", **kw), TOKENS)
    b, _ = stream(P.make_policy("rsqr_precompute", **kw), TOKENS)
    assert rel_err(b, a) < 1e-5


@pytest.mark.parametrize("mode,semantics", [("rsqr", "rank"), ("rsqr_precompute", "rank"), ("streamingllm", "rank"),
                                            ("rerotate", "rank"), ("leave_gaps", "global"), ("full", "global"),
                                            ("window", "global")])
def test_float32_stream_matches_float64_oracle(mode, semantics):
    # Consequences 2 and 4: rank-timeline policies equal the float64 rank oracle, leave_gaps equals full
    # attention restricted to the same token set at global positions.
    pol = P.full() if mode == "full" else POLICIES.get(mode) if mode in ("window", "streamingllm") else \
        P.make_policy(mode, window=10, n_sink=3, delta=3, max_survivors=4, block=2, overflow="decimate")
    T = 80
    got, _ = stream(pol, TOKENS[:T])
    w, _, _ = _model()
    ref = stream_logits_f64(w, CFG, TOKENS[:T], [set(s) for s in sets_for(pol, T)], semantics)
    assert rel_err(got, ref) < 2e-5


def test_leave_gaps_is_not_the_rank_oracle():
    # The two timelines really differ once gaps exist (guards the test above against a vacuous pass).
    pol = P.leave_gaps(10, 3, 3, 4, block=2)
    got, _ = stream(pol, TOKENS[:60])
    w, _, _ = _model()
    rank = stream_logits_f64(w, CFG, TOKENS[:60], [set(s) for s in sets_for(pol, 60)], "rank")
    assert rel_err(got, rank) > 1e-3


def test_replay_equals_a_fresh_forward_over_the_cached_tokens_at_each_eviction_event():
    pol = P.replay(8, 2, 3, 3, block=4)
    T = 48
    got, _ = stream(pol, TOKENS[:T])
    sets = sets_for(pol, T)
    w, apply_fn, params = _model()
    from rsqr_jax.models.llama import LoadedModel, forward_logits

    loaded = LoadedModel(CFG, Llama(CFG, w), "tiny", "float32")
    events = [t for t in range(1, T) if sets[t] != sets[t - 1] + [t]]
    assert len(events) >= 8
    # One batched forward for every event (forward_logits compiles per call): row i holds event i's cached
    # tokens, right-padded; causal attention makes the logits at its last real token those of the row alone.
    n = max(len(sets[t]) for t in events)
    ids = np.stack([np.pad(TOKENS[np.array(sets[t])], (0, n - len(sets[t]))) for t in events])
    ref = forward_logits(loaded, ids)
    for i, t in enumerate(events):
        assert rel_err(got[t], ref[i, len(sets[t]) - 1]) < 1e-5, t


# ---------------------------------------------------------------------------------------------------------
# Attention alone: numerics of each storage scheme against a float64 rank oracle, in bfloat16.


def _attention_stream(mode, T, dtype, seed=0, window=16, n_sink=2, block=1):
    """Stream random raw q/k/v through one layer's cache update + attention; outputs [T, Hq, D]."""
    Hq, Hkv, D = 2, 1, 64
    inv_freq = (1.0 / (1e5 ** (np.arange(0, D, 2) / D))).astype(np.float32)
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(T, Hq, D)).astype(np.float32)
    k = rng.normal(size=(T, Hkv, D)).astype(np.float32)
    v = rng.normal(size=(T, Hkv, D)).astype(np.float32)
    pol = P.make_policy(mode, window=window, n_sink=n_sink, delta=0, block=block)
    spec = CacheSpec.for_policies(pol, num_layers=1, num_kv_heads=Hkv, head_dim=D, dtype=dtype)

    @jax.jit
    def run(q, k, v):
        def body(cache, x):
            qt, kt, vt = x
            plan = plan_step(cache, pol, 1)
            out, cache = attend_layer(jnp.int32(0), qt[None, None], kt[None, None], vt[None, None], cache, plan,
                                         inv_freq)
            return commit(cache, plan), out[0, 0]

        return jax.lax.scan(body, init_cache(spec), (q, k, v))[1]

    out = np.asarray(run(q, k, v), np.float64)
    # float64 rank oracle over the same token sets (keys from the bf16-rounded raw values where stored in bf16)
    sets = sets_for(pol, T)
    kk = np.asarray(jnp.asarray(k).astype(dtype).astype(jnp.float32), np.float64)
    vv = np.asarray(jnp.asarray(v).astype(dtype).astype(jnp.float32), np.float64)
    ref = np.empty_like(out)
    f = inv_freq.astype(np.float64)

    def rot(x, p):
        a = p * f
        return np.concatenate([x[..., :32] * np.cos(a) - x[..., 32:] * np.sin(a),
                               x[..., 32:] * np.cos(a) + x[..., :32] * np.sin(a)], -1)

    for t in range(T):
        cached = sets[t]
        K = np.stack([rot(kk[g, 0], i) for i, g in enumerate(cached)])
        for h in range(Hq):
            s = K @ rot(q[t, h].astype(np.float64), len(cached) - 1) / 8.0
            p = np.exp(s - s.max())
            ref[t, h] = p @ vv[np.array(cached), 0] / p.sum()
    return np.max(np.abs(out - ref), axis=(1, 2))


def test_rsqr_stays_at_the_storage_rounding_while_rerotate_drifts_in_bfloat16():
    # In a bounded cache a window key is re-rotated once per eviction event while it is in the window,
    # so its hop count is ~W/block. Growing W from 4 to 64 multiplies rerotate's hops by 16; rsqr and
    # streamingllm rotate every key exactly once from raw, so their error stays at the bf16 storage floor.
    def late_err(mode, W):
        return _attention_stream(mode, W + 150, "bfloat16", window=W)[-100:].mean()

    rsqr4, rsqr64 = late_err("rsqr", 4), late_err("rsqr", 64)
    rerot4, rerot64 = late_err("rerotate", 4), late_err("rerotate", 64)
    sllm64 = late_err("streamingllm", 64)
    assert max(rsqr4, rsqr64, sllm64) < 5e-3
    assert rsqr64 < 1.5 * rsqr4
    assert rerot64 > 2.5 * rerot4
    assert rerot64 > 4.0 * rsqr64


def test_rsqr_float32_attention_matches_oracle_at_every_step():
    err = _attention_stream("rsqr", 200, "float32")
    assert err.max() < 1e-5


# ---------------------------------------------------------------------------------------------------------
# Which tokens stay: the cache bookkeeping against the pure-Python model of docs/design.md §3.

SET_SPEC = CacheSpec(num_layers=1, batch=1, num_kv_heads=1, head_dim=2, win_capacity=24, surv_capacity=64,
                     max_chunk=4, pins=24)


@functools.lru_cache(maxsize=None)
def _positions_runner(chunk: int, n_steps: int):
    @jax.jit
    def run(policy, cache):
        def body(cache, _):
            plan = plan_step(cache, policy, chunk)
            cache = commit(cache, plan)
            return cache, (cache.win_pos, cache.surv_pos, cache.t)

        return jax.lax.scan(body, cache, None, length=n_steps)[1]

    return run


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 12), n_sink=st.integers(0, 4), delta=st.integers(0, 5), cap=st.integers(1, 6),
       block=st.integers(1, 4), overflow=st.sampled_from(["fifo", "decimate"]), chunk=st.sampled_from([1, 1, 2, 4]),
       mode=st.sampled_from(["rsqr", "leave_gaps", "rerotate", "streamingllm", "window"]),
       spans=st.lists(st.tuples(st.integers(0, 44), st.integers(1, 8)), max_size=3))
def test_token_set_matches_design_model(window, n_sink, delta, cap, block, overflow, chunk, mode, spans):
    """spans: pinned [start, start + length) ranges (docs/design.md §3c; `window` keeps no pins by definition)."""
    chunk = min(chunk, window)
    pol = P.make_policy(mode, window=window, n_sink=n_sink, delta=delta, max_survivors=cap, block=block,
                        overflow=overflow)
    h = pol.host()
    from rsqr_jax.cache import pin_span
    from rsqr_jax.spec import validate

    validate(pol, SET_SPEC, chunk=chunk)
    cache = init_cache(SET_SPEC)
    for a, n in spans:
        cache = pin_span(cache, SET_SPEC, a, a + n)  # no policy given: the plan itself must leave `window` alone
    pinned = {g for a, n in spans for g in range(a, a + n)} if mode != "window" else set()
    n_steps = 48 // chunk
    ring, surv, ts = (np.asarray(x) for x in _positions_runner(chunk, n_steps)(pol, cache))
    ref = reference_token_sets(n_steps * chunk, window=h["window"], n_sink=h["n_sink"], delta=h["delta"],
                               max_survivors=h["max_survivors"], block=h["block"], overflow=overflow, chunk=chunk,
                               pinned=pinned)
    for i, (n, expected) in enumerate(ref):
        assert ts[i] == n
        from rsqr_jax.policy import window_start

        w0 = int(window_start(jnp.int32(n), pol.window, pol.block))
        got = sorted(set(int(g) for g in ring[i] if g >= w0) | set(int(g) for g in surv[i] if 0 <= g < w0))
        assert got == expected, (i, n)


# ---------------------------------------------------------------------------------------------------------
# One compilation per configuration; policies are data.


def test_a_whole_stream_compiles_once_for_any_policy_of_a_spec():
    _, apply_fn, params = _model()
    pols = [P.rsqr(8, 2, 3, 4), P.rerotate(8, 2, 3, 4), P.leave_gaps(8, 2, 3, 4), P.streamingllm(8, 2)]
    spec = CacheSpec.for_policies(pols, num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                                  head_dim=CFG.head_dim)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def one_step(params, tok, cache, policy):
        return step(apply_fn, params, tok, cache, policy)

    for pol in pols:
        cache = init_cache(spec)
        for t in range(30):
            _, cache = one_step(params, jnp.asarray(TOKENS[t:t + 1][None]), cache, pol)
    assert int(cache.t) == 30


def test_validation_rejects_impossible_policies():
    with pytest.raises(P.PolicyError, match="unknown policy"):
        P.make_policy("sink_cache")
    with pytest.raises(P.PolicyError, match="window must be >= 1"):
        P.rsqr(window=0)
    with pytest.raises(P.PolicyError, match="delta must be >= 0"):
        P.rsqr(delta=-1)
    with pytest.raises(P.PolicyError, match="overflow"):
        P.rsqr(overflow="lifo")
    from rsqr_jax.spec import validate

    small = CacheSpec(1, 1, 1, 2, win_capacity=8, surv_capacity=4)
    with pytest.raises(P.PolicyError, match="window capacity"):
        validate(P.rsqr(window=16, sinks=1, delta=4, max_survivors=1), small)
    with pytest.raises(P.PolicyError, match="survivor capacity"):
        validate(P.rsqr(window=8, sinks=2, delta=2, max_survivors=8), small)
    with pytest.raises(P.PolicyError, match="chunk"):
        validate(P.rsqr(window=4, sinks=0, delta=0), CacheSpec(1, 1, 1, 2, 8, 0, max_chunk=8), chunk=8)
    with pytest.raises(P.PolicyError, match="precompute"):
        validate(P.rsqr_precompute(window=4, sinks=0, delta=0), CacheSpec(1, 1, 1, 2, 8, 0))


def test_one_set_of_defaults_and_derived_policies_are_checked():
    """Every constructor and make_policy take the library's defaults (DEFAULTS, the command lines' too);
    Policy.replace rebuilds through make_policy, so a derived policy is validated and a named mode forces what
    its name implies."""
    d = P.DEFAULTS
    assert (d["window"], d["n_sink"], d["delta"], d["max_survivors"], d["block"], d["overflow"]) == \
        (256, 4, 8, 64, 1, "fifo")
    want = dict(window=256, n_sink=4, delta=8, max_survivors=64, block=1, overflow="fifo", recall_pages=0)
    for mode, ctor in [("leave_gaps", P.leave_gaps), ("rerotate", P.rerotate), ("replay", P.replay),
                       ("rsqr", P.rsqr), ("rsqr_precompute", P.rsqr_precompute)]:
        assert ctor().settings() == P.make_policy(mode).settings() == {"mode": mode, **want}, mode
    assert P.streamingllm().settings() == {"mode": "streamingllm", **want, "delta": 0, "max_survivors": 0}
    assert P.window().settings()["window"] == 256
    base = P.rsqr(32, 2, 4, 8)
    assert base.replace(window=64).name == "rsqr(W=64, N=2, delta=4, S=8, fifo)"
    assert base.replace(mode="rerotate", block=4).name == "rerotate(W=32, N=2, delta=4, S=8, fifo, b=4)"
    assert base.replace(mode="streamingllm").name == "streamingllm(W=32, N=2)"  # delta forced to 0
    assert base.replace(delta=0).host() == P.rsqr(32, 2, 0).host()  # no survivors: no cap either
    assert base.replace(recall_pages=2).name == "rsqr(W=32, N=2, delta=4, S=8, fifo, recall=2)"
    assert base.host() == P.rsqr(32, 2, 4, 8).host()  # the base is unchanged
    for fields, fragment in [(dict(window=0), "window must be >= 1"), (dict(mode="lru"), "unknown policy"),
                             (dict(mode="rerotate", recall_pages=2), "cannot recall"),
                             (dict(windw=8), "unknown policy field 'windw'")]:
        with pytest.raises(P.PolicyError, match=fragment):
            base.replace(**fields)
    with pytest.raises(P.PolicyError, match="single policy"):
        P.stack_policies([base, base]).replace(window=8)
