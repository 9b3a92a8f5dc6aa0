"""Where recalled tokens sit (docs/design.md §3b, `ColdStore.placement`): each placement against a float64 oracle
of its definition on the tiny random model, and the consequences that pin the definitions down.

* rank: recalled tokens at their rank among sinks and survivors (the existing default);
* true: each recalled token at its true distance t - g from the query;
* fixed: every recalled token at the policy's window W from the query.

Sinks, survivors and the window keep plain rsqr's positions under every placement, so recall_pages = 0 is plain
rsqr; with neither sinks nor survivors and a store that holds every evicted token, `true` is `full`.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import rsqr_jax as rj
from rsqr_jax import policy as P
from rsqr_jax.policy import PolicyError
from rsqr_jax.spec import validate
from rsqr_lab.testing.oracle import reference_cold_sets, reference_token_sets, stream_logits_f64
from rsqr_lab.testing import drawn_seed
from rsqr_jax.models.tiny import tiny_config, tiny_model, tiny_weights

CFG = tiny_config()
DIMS = dict(num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim)


@functools.lru_cache(maxsize=None)
def _model(seed=0):
    return tiny_model(CFG, seed)


def _spec(pol, T, *, cold, page, placement, chunk=1):
    store = rj.ColdStore(cold, page, "mean", placement=placement) if cold else None
    return rj.CacheSpec.for_policies([pol], max_chunk=chunk, max_len=T, cold=store, **DIMS)


def _nll(pol, tokens, spec, chunk=1, seed=0):
    apply_fn, params = _model(seed)
    out, _ = rj.stream_nll(apply_fn, params, tokens, pol, spec, chunk=chunk, segment=4 * chunk)
    return out


def _oracle_positions(T, W, N, d, S, Pg, cold_slots, placement):
    """Per token t: the cached set (sinks + survivors + window + every recallable token, each once) and each
    one's logical position under `placement`, from the pure-Python token-set and cold-ring models."""
    sets = reference_token_sets(T, window=W, n_sink=N, delta=d, max_survivors=S, block=1)
    cold = reference_cold_sets(T, window=W, n_sink=N, block=1, page_size=Pg, cold_slots=cold_slots)
    token_sets, positions = [], []
    for (n, base), (_, recallable) in zip(sets, cold):
        t = n - 1
        pos = {g: r for r, g in enumerate(base)}  # plain rsqr: ranks; the query t is the last of them
        q = pos[t]
        for g in sorted(set(recallable) - set(base)):
            pos[g] = {"rank": None, "true": q - (t - g), "fixed": q - W}[placement]
        if placement == "rank":
            pos = {g: r for r, g in enumerate(sorted(pos))}
        token_sets.append(sorted(pos))
        positions.append(pos)
    return token_sets, positions


@pytest.mark.parametrize("placement", ["rank", "true", "fixed"])
def test_each_placement_equals_its_float64_oracle(placement):
    """A small cold ring (old pages overwritten) fully recalled, token by token, against the float64 oracle of the
    placement's definition; the placements differ from each other, so each equality has teeth."""
    T, W, N, d, S, Pg = 60, 8, 2, 3, 3, 4
    seed = drawn_seed(f"placement {placement}")
    tokens = np.random.default_rng(seed).integers(0, CFG.vocab_size, size=T)
    n_pages = _spec(P.rsqr(W, N, d, S), T, cold=8, page=Pg, placement=placement).cold_pages
    pol = P.rsqr(W, N, d, S, recall_pages=n_pages)  # every page of a ring that holds >= 8 evicted tokens
    spec = _spec(pol, T, cold=8, page=Pg, placement=placement)
    apply_fn, params = _model(2)
    dec = rj.Decoder(apply_fn, spec)
    cache, logits = dec.init_cache(), []
    for t in range(T):
        out, cache = dec.feed(params, tokens[None, t:t + 1], cache, pol)
        logits.append(np.asarray(out[0, 0], np.float64))
    got = np.stack(logits)
    weights = tiny_weights(CFG, 2)
    sets, pos = _oracle_positions(T, W, N, d, S, Pg, spec.cold_slots, placement)
    want = stream_logits_f64(weights, CFG, tokens, sets, "given", pos)
    assert float(np.max(np.abs(got - want)) / np.max(np.abs(want))) < 2e-5
    for other in {"rank", "true", "fixed"} - {placement}:  # the definitions are not interchangeable here
        o_sets, o_pos = _oracle_positions(T, W, N, d, S, Pg, spec.cold_slots, other)
        alt = stream_logits_f64(weights, CFG, tokens, o_sets, "given", o_pos)
        assert float(np.max(np.abs(got - alt)) / np.max(np.abs(want))) > 1e-3, other


@pytest.mark.parametrize("placement", ["true", "fixed"])
def test_recall_pages_zero_is_plain_rsqr_under_every_placement(placement):
    tokens = np.random.default_rng(drawn_seed("zero")).integers(0, CFG.vocab_size, size=(1, 50))
    plain = P.rsqr(8, 2, 3, 3)
    base = _nll(plain, tokens, _spec(plain, 50, cold=0, page=4, placement=placement))
    store = rj.CacheSpec.for_policies([plain], max_len=50, cold=rj.ColdStore(16, 4, "mean", placement=placement),
                                      max_recall_pages=4, **DIMS)  # recall compiled in, recall_pages = 0
    np.testing.assert_allclose(_nll(plain, tokens, store), base, atol=5e-5, rtol=0)


@pytest.mark.parametrize("chunk", [1, 4])
def test_true_placement_with_everything_recalled_and_no_survivors_is_full(chunk):
    """With neither sinks nor survivors (the raw segment, on the rank timeline, is empty) every recalled token sits
    at its true distance: a store that holds every evicted token, fully recalled, is `full` (token by token and in
    chunks). Under `rank` the same holds with sinks and survivors too (tests/test_recall.py)."""
    T = 64
    tokens = np.random.default_rng(drawn_seed("true=full")).integers(0, CFG.vocab_size, size=(1, T))
    pol = P.rsqr(8, 0, 0, 0, recall_pages=T // 4)
    got = _nll(pol, tokens, _spec(pol, T, cold=T, page=4, placement="true", chunk=chunk), chunk=chunk)
    want = _nll(P.full(), tokens, rj.CacheSpec.for_policies([P.full()], max_chunk=chunk, max_len=T, **DIMS),
                chunk=chunk)
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=0)
    fixed = _nll(pol, tokens, _spec(pol, T, cold=T, page=4, placement="fixed", chunk=chunk), chunk=chunk)
    assert np.abs(fixed - want).max() > 0.1  # the same tokens at other distances: not full


def test_true_and_fixed_placements_need_rsqr():
    pol = P.streamingllm(8, 2, recall_pages=2)
    for placement in ("true", "fixed"):
        spec = _spec(pol, 32, cold=16, page=4, placement=placement)
        with pytest.raises(PolicyError, match="needs rsqr"):
            validate(pol, spec)
    validate(pol, _spec(pol, 32, cold=16, page=4, placement="rank"))
    with pytest.raises(ValueError, match="unknown placement"):
        rj.ColdStore(16, 4, placement="middle")
