"""The recall tier (DESIGN section 3b) on the tiny random model: the consequences DESIGN asks for and the
cold ring's token-set model.

* recall_pages = 0 equals plain rsqr; a cold store holding every evicted token with recall_pages >= its
  page count equals `full` (rsqr and streamingllm, token by token and in chunks);
* with recall on, rsqr equals the float64 rank oracle over sinks + survivors + recalled + window;
* the cold ring keeps exactly what the pure-Python model says (hypothesis), the page choice matches a
  numpy model of the scoring rule, one compilation per spec, recall settings vmap, bfloat16 ~ float32.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rsqr_jax as rj
from rsqr_jax import policy as P
from rsqr_jax.engine import TRACES
from rsqr_lab.testing.oracle import reference_cold_sets, reference_token_sets, stream_logits_f64
from rsqr_lab.testing import drawn_seed
from rsqr_jax.models.tiny import tiny_config, tiny_model, tiny_weights
from rsqr_jax.sampling import Sampling
from rsqr_jax import recall
from rsqr_jax.recall import Recall, choose_pages, page_scores, with_neighbors
from rsqr_jax.kernels.store import run_slots
from rsqr_jax.update import commit, plan_step
from rsqr_jax.cache import cache_arrays

REPO = Path(__file__).resolve().parent.parent
CFG = tiny_config()
DIMS = dict(num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim)


@functools.lru_cache(maxsize=None)
def _model(seed=0, dtype="float32"):
    return tiny_model(CFG, seed, dtype=dtype)


def nll(policy, tokens, spec, chunk=1, seed=0):
    apply_fn, params = _model(seed, spec.dtype)
    out, _ = rj.stream_nll(apply_fn, params, tokens, policy, spec, chunk=chunk, segment=4 * chunk)
    return out


def spec_for(policies, T, *, chunk=1, cold=0, page=4, dtype="float32", max_pages=None, neighbors=0, score="mean"):
    store = rj.ColdStore(cold, page, score, neighbors) if cold else None
    return rj.CacheSpec.for_policies(policies, max_chunk=chunk, max_len=T, cold=store, max_recall_pages=max_pages,
                                     dtype=dtype, **DIMS)


def test_recall_pages_zero_equals_plain_rsqr():
    tokens = np.random.default_rng(drawn_seed("zero")).integers(0, CFG.vocab_size, size=(1, 70))
    plain = P.rsqr(8, 2, 3, 3)
    base = nll(plain, tokens, spec_for([plain], 70))
    with_store = nll(plain, tokens, spec_for([plain], 70, cold=32, max_pages=4))  # cold store, recall off
    np.testing.assert_allclose(with_store, base, atol=5e-5, rtol=0)
    full = nll(P.full(), tokens, spec_for([P.full()], 70))
    assert np.abs(base - full).max() > 0.1  # evictions changed the answer: the equality is not vacuous


@pytest.mark.parametrize("mode,chunk,neighbors,score", [("rsqr", 1, 0, "mean"), ("rsqr", 4, 1, "mean"),
                                                         ("streamingllm", 1, 0, "mean"), ("streamingllm", 4, 0, "mean"),
                                                         ("rsqr", 4, 0, "max"), ("rsqr", 4, 0, "shortlist")])
def test_recalling_every_evicted_token_equals_full(mode, chunk, neighbors, score):
    """(neighbors = 1: every page also brings both neighbours, so each token is gathered up to three times;
    the equality holds only if each counts once. score = max: the rule with a scoring copy of the keys.)"""
    T = 64
    tokens = np.random.default_rng(drawn_seed("full")).integers(0, CFG.vocab_size, size=(1, T))
    kw = dict(window=8, n_sink=2) | (dict(delta=3, max_survivors=3) if mode == "rsqr" else {})
    pol = P.make_policy(mode, recall_pages=T // 4, **kw)  # every page of a store that holds everything
    got = nll(pol, tokens, spec_for([pol], T, chunk=chunk, cold=T, neighbors=neighbors, score=score), chunk=chunk)
    want = nll(P.full(), tokens, spec_for([P.full()], T, chunk=chunk), chunk=chunk)
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=0)
    plain = P.make_policy(mode, **kw)
    assert np.abs(nll(plain, tokens, spec_for([plain], T, chunk=chunk), chunk=chunk) - want).max() > 0.1


def test_rsqr_with_recall_equals_the_float64_rank_oracle():
    """A small cold ring (old pages overwritten) fully recalled: sinks + survivors + the ring's evicted
    tokens + window, deduplicated, at their ranks, against the float64 oracle token by token."""
    T, W, N, d, S, Pg = 72, 8, 2, 3, 3, 4
    seed = drawn_seed("oracle")
    tokens = np.random.default_rng(seed).integers(0, CFG.vocab_size, size=T)
    n_pages = spec_for([P.rsqr(W, N, d, S)], T, cold=8, page=Pg).cold_slots // Pg
    pol = P.rsqr(W, N, d, S, recall_pages=n_pages)  # every page of a ring that holds >= 8 evicted tokens
    spec = spec_for([pol], T, cold=8, page=Pg)
    assert spec.cold_slots < T // 2  # old pages are overwritten
    apply_fn, params = _model(2)
    dec = rj.Decoder(apply_fn, spec)
    cache, logits = dec.init_cache(), []
    for t in range(T):
        out, cache = dec.feed(params, tokens[None, t:t + 1], cache, pol)
        logits.append(np.asarray(out[0, 0], np.float64))
    sets = reference_token_sets(T, window=W, n_sink=N, delta=d, max_survivors=S, block=1)
    cold = reference_cold_sets(T, window=W, n_sink=N, block=1, page_size=Pg, cold_slots=spec.cold_slots)
    token_sets = [sorted(set(s) | set(c)) for (_, s), (_, c) in zip(sets, cold)]
    assert any(len(ts) > len(s) for ts, (_, s) in zip(token_sets, sets))  # recall added tokens
    want = stream_logits_f64(tiny_weights(CFG, 2), CFG, tokens, token_sets, "rank")
    got = np.stack(logits)
    assert float(np.max(np.abs(got - want)) / np.max(np.abs(want))) < 2e-5


@functools.partial(jax.jit, static_argnums=2)
def _plan_and_commit(cache, policy, chunk, n_valid):
    """One step's bookkeeping, compiled (one program per drawn shape, not one per operation and shape)."""
    plan = plan_step(cache, policy, chunk, n_valid)
    return commit(cache, plan), plan.recall.token_valid_Nc


@settings(max_examples=25, deadline=None)
@given(window=st.integers(2, 9), n_sink=st.integers(0, 3), block=st.integers(1, 3), page=st.integers(1, 4),
       cold_pages=st.integers(1, 4), chunk=st.integers(1, 3))
def test_cold_ring_keeps_what_the_model_says(window, n_sink, block, page, cold_pages, chunk):
    chunk = min(chunk, window)
    pol = P.rsqr(window, n_sink, 2, 2, block=block)
    spec = rj.CacheSpec.for_policies(pol, num_layers=1, num_kv_heads=1, head_dim=2, max_chunk=chunk,
                                     cold=rj.ColdStore(cold_pages * page, page))
    T = 40
    cache = rj.init_cache(spec)
    want = reference_cold_sets(T, window=window, n_sink=n_sink, block=block, page_size=page,
                               cold_slots=spec.cold_slots, chunk=chunk)
    for n, expected in want:
        cache, token_valid_Nc = _plan_and_commit(cache, pol, chunk, min(chunk, n - int(cache.t)))
        got = sorted(int(g) for g in np.asarray(cache.cold.pos)[np.asarray(token_valid_Nc)])
        assert got == expected, (n, got, expected)
        assert len(got) >= min(spec.cold.capacity, max(0, n - n_sink - window - block + 1))  # capacity honoured


def test_page_choice_matches_a_numpy_model_of_the_scoring_rule():
    rng = np.random.default_rng(drawn_seed("scores"))
    B, C, Hq, Hkv, D, n_pages, Pg = 2, 3, 4, 2, 8, 6, 4
    q = rng.normal(size=(B, C, Hq, D)).astype(np.float32)
    cold_sum = rng.normal(size=(B, Hkv, n_pages, D)).astype(np.float32)
    cold_pos = np.arange(n_pages * Pg, dtype=np.int32) + 100
    cold_pos[5 * Pg + 2:] = -1  # the newest page is partly written
    valid = cold_pos >= 0
    valid[:Pg] = False  # page 0 is not recallable (e.g. overwritten)
    q_global = np.array([200, 201, 202], np.int32)
    real = np.array([True, True, False])
    inv = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    rc = Recall(jnp.int32(3), jnp.asarray(valid), jnp.zeros((1,), jnp.int32), jnp.asarray(q_global),
                jnp.asarray(real), jnp.asarray(True), 3)
    scores = np.asarray(page_scores(jnp.asarray(q), jnp.asarray(cold_sum), jnp.asarray(cold_pos), rc, jnp.asarray(inv)))
    idx, active = choose_pages(jnp.asarray(scores), jnp.asarray(cold_pos), jnp.int32(2), 3)
    # numpy model: rotate the query at its global position (rotate_half), score against each page's mean key
    ang = q_global[:, None].astype(np.float64) * inv.astype(np.float64)[None]
    c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    q1, q2 = q[..., : D // 2], q[..., D // 2:]
    q_rot = np.concatenate([q1 * c - q2 * s, q2 * c + q1 * s], -1).reshape(B, C, Hkv, Hq // Hkv, D)
    count = (cold_pos >= 0).reshape(n_pages, Pg).sum(1)
    mean = cold_sum / np.maximum(count, 1)[None, None, :, None]
    want = np.einsum("bckgd,bkpd->bckgp", q_rot, mean)[:, real].max(axis=(1, 2, 3))
    want[:, 0] = -np.inf
    np.testing.assert_allclose(scores, want, rtol=1e-5, atol=1e-5)
    for b in range(B):
        order = sorted(range(n_pages), key=lambda p: (-want[b, p], -p))
        assert list(np.asarray(idx[b])) == order[:3]
    assert np.asarray(active).tolist() == [[True, True, False]] * B  # k = 2 of the 3 gathered


def test_max_rule_scores_each_page_by_its_best_recallable_token():
    """page_score "max" against numpy: the page's max over its recallable tokens of q . k (keys as stored in
    the scoring copy, rotated at their global positions), over real rows and all heads; a page whose tokens
    are all unrecallable is -inf, and an unrecallable token does not count even if it would win."""
    rng = np.random.default_rng(drawn_seed("max-rule"))
    B, C, Hq, Hkv, D, n_pages, Pg = 2, 3, 4, 2, 8, 5, 3
    q = rng.normal(size=(B, C, Hq, D)).astype(np.float32)
    k_glob = rng.normal(size=(B, Hkv, n_pages * Pg, D)).astype(np.float32)
    cold_pos = np.arange(n_pages * Pg, dtype=np.int32) + 50
    valid = rng.random(n_pages * Pg) < 0.7
    valid[:Pg] = False  # page 0: nothing recallable
    k_glob[:, :, 4] *= 50.0  # a dominant token ...
    valid[4] = False  # ... that is not recallable
    q_global, real = np.array([90, 91, 92], np.int32), np.array([True, False, True])
    inv = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    rc = Recall(jnp.int32(2), jnp.asarray(valid), jnp.zeros((1,), jnp.int32), jnp.asarray(q_global),
                jnp.asarray(real), jnp.asarray(True), 2)
    zeros = jnp.zeros((B, Hkv, n_pages, D), jnp.float32)
    got = np.asarray(page_scores(jnp.asarray(q), zeros, jnp.asarray(cold_pos), rc, jnp.asarray(inv),
                                 None, None, jnp.asarray(k_glob)))
    ang = q_global[:, None].astype(np.float64) * inv.astype(np.float64)[None]
    c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    q_rot = np.concatenate([q[..., :D // 2] * c - q[..., D // 2:] * s, q[..., D // 2:] * c + q[..., :D // 2] * s], -1)
    tok = np.einsum("bckgd,bknd->bckgn", q_rot.reshape(B, C, Hkv, Hq // Hkv, D), k_glob)[:, real].max(axis=(1, 2, 3))
    want = np.where(valid, tok, -np.inf).reshape(B, n_pages, Pg).max(-1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.all(np.isneginf(got[:, 0])) and np.all(np.isfinite(got[:, 1:]) | ~valid.reshape(n_pages, Pg).any(1)[1:])
    # the scoring copy is its own part of the cold store's memory, which holds the summaries its rule reads and no
    # other: the reported bytes are the cache's cold arrays'
    pol = P.rsqr(8, 2, 3, 3, recall_pages=2)
    for rule in ("mean", "max", "quest", "shortlist"):
        spec = spec_for([pol], 0, cold=64, score=rule)
        cache = rj.init_cache(spec)
        held = sum(x.nbytes for x in (cache.cold.k, cache.cold.v, cache.cold.pos, cache.cold.sums, cache.cold.lo,
                                      cache.cold.hi, cache.cold.scoring) if x is not None)
        assert spec.bytes_by_part()["cold_store"] == held, rule
        # a rule's own summaries only: the others are absent from the cache, not empty arrays
        assert (cache.cold.scoring is not None) == (rule == "max")
        assert (cache.cold.sums is not None) == (rule in ("mean", "shortlist"))
        assert (cache.cold.lo is not None) == (cache.cold.hi is not None) == (rule == "quest")


def _unpack_int8_rows(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [..., D], scale float32 [...]) of the int8 scoring copy's rows (recall.pack_int8_keys), read
    back in numpy: the words' bytes in memory order."""
    words = np.ascontiguousarray(words)
    return words[..., :-1].copy().view(np.int8), words[..., -1].copy().view(np.float32)


def test_int8_scoring_copy_scores_within_its_quantization_bound():
    """ColdStore.score_dtype "int8": page_scores on int8 codes and scales (recall.quantize_int8) against the
    float64 scores of the same keys: each token's q . k is off by at most |q|_1 s_k / 2 + |k^|_1 s_q / 2 (s: a
    vector's scale, k^ its dequantized codes), so each page's maximum is too; codes times scale is the key within
    half a scale; the store's memory counts D + 4 bytes per key."""
    from rsqr_jax.recall import _best_token, pack_int8_keys, quantize_int8

    seed = drawn_seed("int8-copy")
    rng = np.random.default_rng(seed)
    B, C, Hq, Hkv, D, n_pages, Pg = 2, 2, 4, 2, 16, 6, 4
    q = rng.normal(size=(B, C, Hq, D)).astype(np.float32)
    k = (rng.normal(size=(B, Hkv, n_pages * Pg, D)) * rng.uniform(0.1, 10, size=(1, 1, n_pages * Pg, 1))).astype(np.float32)
    k[:, :, 5] = 0.0  # an all-zero key: scale 0
    valid = rng.random(n_pages * Pg) < 0.8
    codes, scale = (np.asarray(x) for x in quantize_int8(jnp.asarray(k)))
    packed = pack_int8_keys(jnp.asarray(k))  # the rows the cache keeps (scored as they lie, scale bytes included)
    assert codes.dtype == np.int8 and codes.shape == k.shape and scale.shape == k.shape[:-1]
    assert np.all(np.abs(codes * scale[..., None] - k) <= scale[..., None] / 2 + 1e-6 * np.abs(k)), seed
    q_global, real = np.array([40, 41], np.int32), np.array([True, True])
    inv = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    rc = Recall(jnp.int32(2), jnp.asarray(valid), jnp.zeros((1,), jnp.int32), jnp.asarray(q_global),
                jnp.asarray(real), jnp.asarray(True), 2)
    zeros = jnp.zeros((B, Hkv, n_pages, D), jnp.float32)
    got = np.asarray(page_scores(jnp.asarray(q), zeros, jnp.asarray(np.arange(n_pages * Pg, dtype=np.int32)), rc,
                                 jnp.asarray(inv), None, None, packed))
    ang = q_global[:, None].astype(np.float64) * inv.astype(np.float64)[None]
    c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    q_rot = np.concatenate([q[..., :D // 2] * c - q[..., D // 2:] * s, q[..., D // 2:] * c + q[..., :D // 2] * s], -1)
    q_rot = q_rot.reshape(B, C, Hkv, Hq // Hkv, D)
    tok = np.einsum("bckgd,bknd->bckgn", q_rot, k.astype(np.float64))
    s_q = np.abs(q_rot).max(-1) / 127
    k_hat = codes.astype(np.float64) * scale[..., None]
    bound = (np.abs(q_rot).sum(-1)[..., None] * scale[:, None, :, None, :] / 2
             + np.abs(k_hat).sum(-1)[:, None, :, None, :] * s_q[..., None] / 2)
    want = np.where(valid, tok.max(axis=(1, 2, 3)), -np.inf).reshape(B, n_pages, Pg).max(-1)
    slack = np.where(valid, bound.max(axis=(1, 2, 3)), 0).reshape(B, n_pages, Pg).max(-1) + 1e-4
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite)
    assert np.all(np.abs(got - want)[finite] <= slack[finite]), (seed, np.abs(got - want), slack)
    assert np.abs(got - want)[finite].max() > 0  # the int8 path ran (float32 scores here match to ~1e-6)
    pol = P.rsqr(8, 2, 3, 3, recall_pages=2)
    f32, i8 = (rj.CacheSpec.for_policies([pol], max_len=0, cold=rj.ColdStore(64, 4, "max", score_dtype=d), **DIMS)
               for d in ("float32", "int8"))
    extra = f32.bytes_by_part()["cold_store"] - i8.bytes_by_part()["cold_store"]
    assert extra == f32.cold_slots * CFG.num_layers * CFG.num_kv_heads * (4 * CFG.head_dim - (CFG.head_dim + 4))
    cache = rj.init_cache(i8)
    assert cache.cold.scoring.dtype == jnp.int32 and cache.cold.scoring.shape[-1] == CFG.head_dim // 4 + 1
    assert rj.init_cache(f32).cold.scoring.shape[-1] == CFG.head_dim
    # the cache keeps each key's codes and scale in one row of words: unpacked, exactly quantize_int8's
    words = packed
    assert words.dtype == jnp.int32 and words.shape == k.shape[:-1] + (D // 4 + 1,)
    back_codes, back_scale = _unpack_int8_rows(np.asarray(words))
    np.testing.assert_array_equal(back_codes, codes)
    np.testing.assert_array_equal(back_scale, scale)
    # scored as they lie (the scale's bytes against zero codes), bit for bit the codes and scales read apart
    q_codes, q_scale = quantize_int8(jnp.asarray(q_rot, jnp.float32))
    apart = jnp.einsum("bckgd,bknd->bckgn", q_codes, jnp.asarray(codes), preferred_element_type=jnp.int32)
    apart = apart.astype(jnp.float32) * q_scale[..., None] * jnp.asarray(scale)[:, None, :, None, :]
    apart = jnp.where(jnp.asarray(valid)[None, None, None, None, :], apart, -jnp.inf)
    want_apart = np.asarray(jnp.max(apart.reshape(apart.shape[:4] + (n_pages, Pg)), axis=(1, 2, 3, 5)))
    got_rows = np.asarray(_best_token(jnp.asarray(q_rot, jnp.float32), words, jnp.asarray(valid)[None].repeat(B, 0),
                                      jnp.asarray(real), Pg))
    np.testing.assert_array_equal(got_rows, want_apart)


@pytest.mark.parametrize("C", [1, 2])  # 1 row: the query turns per page; 2: each key turns (recall.shortlist_scores)
def test_shortlist_rule_rescores_the_best_mean_pages_by_their_best_token(C):
    """page_score "shortlist" against numpy: the M pages of best mean key (ties to the newer page) are scored
    by their best recallable token, q . R_g k from the raw keys, every other page is -inf; with every page on
    the shortlist it is the "max" rule exactly."""
    from rsqr_jax.recall import shortlist_scores

    rng = np.random.default_rng(drawn_seed("shortlist"))
    B, Hq, Hkv, D, n_pages, Pg, M = 2, 4, 2, 8, 7, 3, 3
    assert (C * Hq <= Pg * Hkv) == (C == 1)
    q = rng.normal(size=(B, C, Hq, D)).astype(np.float32)
    k_raw = rng.normal(size=(B, Hkv, n_pages * Pg, D)).astype(np.float32)
    cold_pos = (np.arange(n_pages * Pg) + 40).astype(np.int32)
    cold_pos[-2:] = -1  # the newest page is partly written
    valid = (cold_pos >= 0) & (rng.random(n_pages * Pg) < 0.8)
    valid[Pg:2 * Pg] = False  # page 1: nothing recallable
    q_global, real = np.array([90, 91, 92][:C], np.int32), np.array([True, False, True][:C])
    inv = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)

    def rot(x, pos):  # numpy RoPE (rotate_half) at positions pos [N] of x [..., N, D], float64
        ang = pos[:, None].astype(np.float64) * inv.astype(np.float64)[None]
        c, s = np.cos(ang), np.sin(ang)
        x1, x2 = x[..., :D // 2].astype(np.float64), x[..., D // 2:].astype(np.float64)
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    k_glob = rot(k_raw, cold_pos)
    cold_sum = np.where((cold_pos >= 0)[:, None], k_glob, 0).reshape(B, Hkv, n_pages, Pg, D).sum(3)
    q_rot = np.swapaxes(rot(np.swapaxes(q, 1, 2), q_global), 1, 2).reshape(B, C, Hkv, Hq // Hkv, D)
    rc = lambda m: Recall(jnp.int32(2), jnp.asarray(valid), jnp.zeros((1,), jnp.int32), jnp.asarray(q_global),  # noqa: E731
                          jnp.asarray(real), jnp.asarray(True), 2, shortlist=m)
    args = (jnp.asarray(q), jnp.asarray(cold_sum, jnp.float32), jnp.asarray(cold_pos))
    mean = page_scores(*args, rc(M), jnp.asarray(inv))
    gather_k = lambda starts, n: jnp.asarray(k_raw)[jnp.arange(B)[:, None, None], jnp.arange(Hkv)[None, :, None],  # noqa: E731
                                                    run_slots(starts, n)[:, None, :]]
    got = np.asarray(shortlist_scores(args[0], mean, args[2], rc(M), jnp.asarray(inv), gather_k))
    tok = np.einsum("bckgd,bknd->bckgn", q_rot, k_glob)[:, real].max(axis=(1, 2, 3))  # [B, N]
    best = np.where(valid, tok, -np.inf).reshape(B, n_pages, Pg).max(-1)
    newest = cold_pos.reshape(n_pages, Pg).max(1)
    for b in range(B):
        m = np.asarray(mean)[b]
        listed = sorted((p for p in range(n_pages) if m[p] > -np.inf), key=lambda p: (-m[p], -newest[p]))[:M]
        want = np.full(n_pages, -np.inf)
        want[listed] = best[b, listed]
        np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-5)
        assert np.isneginf(got[b, 1]) and (np.isfinite(got[b]).sum() == M)
    # every page listed: the "max" rule
    every = np.asarray(shortlist_scores(args[0], mean, args[2], rc(n_pages), jnp.asarray(inv), gather_k))
    exact = np.asarray(page_scores(*args, rc(0), jnp.asarray(inv), None, None, jnp.asarray(k_glob, jnp.float32)))
    np.testing.assert_allclose(every, exact, rtol=1e-5, atol=1e-5)
    # the rule keeps the mean rule's storage: no scoring copy
    pol = P.rsqr(8, 2, 3, 3, recall_pages=2)
    mean_spec, short_spec = (spec_for([pol], 0, cold=256, score=r) for r in ("mean", "shortlist"))
    assert short_spec.bytes_by_part() == mean_spec.bytes_by_part() and short_spec.shortlist_pages == 32
    assert spec_for([pol], 0, cold=64, score="shortlist").shortlist_pages == 20  # at most every page


def test_neighbours_are_the_adjacent_pages_in_time_each_once():
    """with_neighbors against a plain-Python model on a wrapped ring: the chosen pages plus the pages holding
    the tokens right before/after them (not the page across the ring's seam, not an empty one), no page twice."""
    rng = np.random.default_rng(drawn_seed("neighbours"))
    n_pages, Pg, B, K = 7, 3, 4, 3
    start = 100 + int(rng.integers(0, 50))  # the ring wrapped: page 4 is the oldest, page 3 the newest
    cold_pos = np.full(n_pages * Pg, -1, np.int32)
    for i, p in enumerate([4, 5, 6, 0, 1, 2, 3]):
        cold_pos[p * Pg:(p + 1) * Pg] = start + i * Pg + np.arange(Pg)
    cold_pos[3 * Pg + 1:4 * Pg] = -1  # the newest page is partly written
    idx = np.stack([rng.choice(n_pages, K, replace=False) for _ in range(B)]).astype(np.int32)
    active = rng.random((B, K)) < 0.7
    pages, act = (np.asarray(x) for x in with_neighbors(jnp.asarray(idx), jnp.asarray(active), jnp.asarray(cold_pos),
                                                         n_pages, 1))
    newest = {p: cold_pos[p * Pg:(p + 1) * Pg].max() for p in range(n_pages)}
    for b in range(B):
        want = set()
        for p in idx[b][active[b]]:
            want |= {q for j in (-1, 0, 1) if abs(newest[(q := (p + j) % n_pages)] - newest[p] - j * Pg) < Pg}
        got = list(pages[b][act[b]])
        assert sorted(got) == sorted(want), (b, got, want)  # each page once
    assert (act.sum(1) > active.sum(1)).any()  # neighbours were added: the check is not vacuous


def test_ties_go_to_the_more_recent_page():
    scores = jnp.zeros((1, 4))
    cold_pos = jnp.asarray([8, 9, 0, 1, 4, 5, 2, 3], jnp.int32)  # page 0 newest, then 2, 3, 1
    idx, _ = choose_pages(scores, cold_pos, jnp.int32(4), 4)
    assert np.asarray(idx[0]).tolist() == [0, 2, 3, 1]


@pytest.mark.parametrize("max_pages", [1, 4, recall.PICK_PAGES_MAX, recall.PICK_PAGES_MAX + 1])
def test_choose_pages_equals_a_stable_sort_on_score_then_recency(max_pages):
    """choose_pages (picks one page at a time up to PICK_PAGES_MAX, one sort above) against numpy's stable sort on
    (-score, -newest): scores drawn from a few values (ties), -inf and NaN pages, -0.0 beside +0.0 (equal), empty pages."""
    seed = drawn_seed("choose_pages")
    rng = np.random.default_rng(seed)
    B, n_pages, Pg = 3, 40, 4
    for trial in range(4):
        scores = rng.choice(np.array([-np.inf, -1.5, -0.0, 0.0, 0.25, 2.0, np.nan], np.float32), size=(B, n_pages))
        cold_pos = rng.permutation(n_pages * Pg).astype(np.int32)
        cold_pos[rng.random(n_pages * Pg) < 0.3] = -1
        cold_pos[:2 * Pg] = -1  # two empty pages: equal newest (-1), ties left to the index
        newest = cold_pos.reshape(n_pages, Pg).max(1)
        k = jnp.int32(max(max_pages - 1, 1))
        idx, active = choose_pages(jnp.asarray(scores), jnp.asarray(cold_pos), k, max_pages)
        for b in range(B):
            # -0.0 and +0.0 are equal scores and NaN comes last, as in jax's sort
            nan = np.isnan(scores[b])
            want = sorted(range(n_pages), key=lambda p: (nan[p], 0.0 if nan[p] else -scores[b, p], -newest[p], p))
            want = want[:max_pages]
            assert np.asarray(idx[b]).tolist() == want, (seed, trial, b)
            want_active = [(j < int(k)) and scores[b, p] > -np.inf for j, p in enumerate(want)]
            assert np.asarray(active[b]).tolist() == want_active, (seed, trial, b)


def test_order_index_counts_and_sorts_alike():
    """order_index's two ways (counting below RANK_BY_COUNT_MAX entries, a stable sort above) against numpy's
    stable argsort, masked entries last by index."""
    seed = drawn_seed("order_index")
    rng = np.random.default_rng(seed)
    for n in (7, P.RANK_BY_COUNT_MAX, P.RANK_BY_COUNT_MAX + 1):
        key = rng.integers(-5, 6, size=n).astype(np.int32)  # many ties
        mask = rng.random(n) < 0.7
        order = np.argsort(np.where(mask, key, np.iinfo(np.int32).max), kind="stable")
        want = np.empty(n, np.int32)
        want[order] = np.arange(n)
        assert np.asarray(P.order_index(jnp.asarray(mask), jnp.asarray(key))).tolist() == want.tolist(), (seed, n)


def test_union_ranks_are_the_order_of_survivors_and_recalled_tokens_together():
    """The raw segment's ranks with recalled tokens (recall._union_ranks: a survivor's own rank moved up by the
    recalled tokens before it) against order_index over the two concatenated, for every valid entry; positions
    drawn from a small range, so survivor/recalled ties (first the survivor) and recalled/recalled ties occur."""
    from rsqr_jax.recall import _union_ranks

    seed = drawn_seed("union-ranks")
    rng = np.random.default_rng(seed)
    B, S, R = 3, 11, 9
    for trial in range(20):
        surv_gpos = rng.integers(0, 25, size=S).astype(np.int32)
        surv_valid = rng.random((B, S)) < 0.7
        rec_gpos = rng.integers(-1, 25, size=(B, R)).astype(np.int32)
        rec_valid = (rng.random((B, R)) < 0.7) & (rec_gpos >= 0)
        surv_rank = jax.vmap(P.order_index, (0, None))(jnp.asarray(surv_valid), jnp.asarray(surv_gpos))
        got_s, got_r = _union_ranks(jnp.asarray(surv_gpos), jnp.asarray(surv_valid), surv_rank, jnp.asarray(rec_gpos),
                                    jnp.asarray(rec_valid))
        valid = np.concatenate([surv_valid, rec_valid], 1)
        want = jax.vmap(P.order_index)(jnp.asarray(valid), jnp.asarray(
            np.concatenate([np.broadcast_to(surv_gpos, (B, S)), rec_gpos], 1)))
        got = np.concatenate([np.asarray(got_s), np.asarray(got_r)], 1)
        assert np.array_equal(got[valid], np.asarray(want)[valid]), (seed, trial)


def test_one_compilation_per_spec_and_recall_settings_vmap():
    T = 48
    tokens = np.random.default_rng(drawn_seed("vmap")).integers(0, CFG.vocab_size, size=(1, T))
    pols = [P.rsqr(8, 2, 3, 3, recall_pages=k) for k in (0, 1, 3)] + [P.streamingllm(8, 2, recall_pages=2)]
    spec = spec_for(pols, T, cold=24)
    apply_fn, params = _model(0)
    before = TRACES["score"]
    batch, _ = rj.stream_nll(apply_fn, params, tokens, rj.stack_policies(pols), spec, segment=8, vmap_policies=True)
    again, _ = rj.stream_nll(apply_fn, params, tokens[:, :40], rj.stack_policies(pols[::-1]), spec, segment=8,
                             vmap_policies=True)
    assert TRACES["score"] - before == 1  # two streams, reordered recall settings: one trace
    for i, pol in enumerate(pols):
        alone, _ = rj.stream_nll(apply_fn, params, tokens, pol, spec, segment=8)
        np.testing.assert_allclose(batch[i], alone, atol=5e-5, rtol=0)
    assert np.abs(batch[1] - batch[0]).max() > 1e-3 and np.abs(batch[2] - batch[1]).max() > 1e-3


@pytest.mark.parametrize("chunk", [1, 4])  # token by token (the query turns per page) and chunks (keys turn)
def test_a_shortlist_of_every_page_recalls_what_the_max_rule_recalls(chunk):
    """End to end on the tiny model (a wrapped ring): "shortlist" with every page on its shortlist
    gives the "max" rule's log-probabilities (its raw keys rotated at their global positions on the fly,
    against the max rule's scoring copy rotated when written)."""
    T = 90
    tokens = np.random.default_rng(drawn_seed("shortlist-e2e")).integers(0, CFG.vocab_size, size=(1, T))
    pol = P.rsqr(8, 2, 3, 3, recall_pages=2)
    spec = {r: spec_for([pol], T, chunk=chunk, cold=64, score=r) for r in ("max", "shortlist", "mean")}
    assert spec["shortlist"].shortlist_pages == spec["shortlist"].cold_slots // 4  # every page
    got = {r: nll(pol, tokens, sp, chunk=chunk) for r, sp in spec.items()}
    np.testing.assert_allclose(got["shortlist"], got["max"], atol=5e-5, rtol=0)
    assert np.abs(got["mean"] - got["max"]).max() > 1e-3  # the rule matters on this stream: not vacuous


def test_bfloat16_cache_with_recall_tracks_float32():
    T = 48
    tokens = np.random.default_rng(drawn_seed("bf16")).integers(0, CFG.vocab_size, size=(1, T))
    pol = P.rsqr(8, 2, 3, 3, recall_pages=T // 4)
    f32 = nll(pol, tokens, spec_for([pol], T, cold=T))
    bf16 = nll(pol, tokens, spec_for([pol], T, cold=T, dtype="bfloat16"))
    full = nll(P.full(), tokens, spec_for([P.full()], T))
    full_bf16 = nll(P.full(), tokens, spec_for([P.full()], T, dtype="bfloat16"))
    np.testing.assert_allclose(f32, full, atol=5e-5, rtol=0)
    # bfloat16 storage costs recall no more than it costs full attention (raw keys, rotated once in float32)
    err, err_full = np.abs(bf16 - f32).mean(), np.abs(full_bf16 - full).mean()
    assert 0 < err < 1.5 * err_full, (err, err_full)


def test_recall_needs_a_raw_survivor_mode_a_cold_store_and_a_cap():
    with pytest.raises(P.PolicyError, match="cannot recall"):
        P.make_policy("rerotate", window=8, n_sink=2, delta=3, max_survivors=3, recall_pages=2)
    with pytest.raises(P.PolicyError, match="recall_pages must be >= 0"):
        P.rsqr(8, 2, 3, 3, recall_pages=-1)
    pol = P.rsqr(8, 2, 3, 3, recall_pages=4)
    with pytest.raises(P.PolicyError, match="exceeds the cache's max_recall_pages 2"):
        rj.validate(pol, spec_for([pol], 32, cold=32, max_pages=2))
    with pytest.raises(P.PolicyError, match="no cold store"):
        rj.validate(pol, spec_for([P.rsqr(8, 2, 3, 3)], 32))
    with pytest.raises(ValueError, match="must be a positive multiple of the page size"):
        spec_for([P.rsqr(8, 2, 3, 3)], 32, cold=30, page=4)
    with pytest.raises(ValueError, match="exceeds the cold store's 6 pages"):
        spec_for([P.rsqr(8, 2, 3, 3)], 32, cold=8, page=4, max_pages=7)


@pytest.mark.slow
def test_fact_probe_runs_every_arm_deterministically(tmp_path):
    """The acceptance experiment's mechanics on the tiny model (its answers are noise; the real model's
    figures are in docs/recall_tier.md)."""
    from rsqr_lab.studies import fact_probe as F
    from rsqr_lab.testing.tokenizer import ByteTokenizer

    text = tmp_path / "filler.txt"
    text.write_text(" ".join(np.random.default_rng(drawn_seed("probe")).choice(["ash", "elm", "oak", "yew"], 300)))
    cfg = F.FactConfig(str(text), trials=2, n_filler=60, policy=rj.rsqr(16, 2, 4, 4), recall_pages=2,
                       cold=rj.ColdStore(64, 4, neighbors=1), lead_max=7, prefill_chunk=8, gen_tokens=4)
    apply_fn, params = _model(0)
    tok = ByteTokenizer(CFG.vocab_size)
    a = F.run(cfg, apply_fn, params, CFG, tok, show_progress=False)
    assert [r["arm"] for r in a["records"]] == list(F.ARMS) * 2
    assert all(r["prompt_tokens"] > 16 + cfg.n_filler // 2 for r in a["records"])
    # The config is written as the committed results have it (their layout, every key in its place).
    committed = json.loads((REPO / "docs/data/recall_tier/fact_place_fixed_s11.json").read_text())["config"]
    assert list(a["config"]) == list(committed)
    assert (a["config"]["window"], a["config"]["n_sink"], a["config"]["max_survivors"]) == (16, 2, 4)
    assert a["summary"][1]["policy"] == "rsqr(W=16, N=2, delta=4, S=4, fifo)"
    for s in a["summary"]:
        assert s["trials"] == 2 and 0 <= s["wilson_lo"] <= s["acc"] <= s["wilson_hi"] <= 1
    assert a == F.run(cfg, apply_fn, params, CFG, tok, show_progress=False)
    F.write(a, tmp_path / "out")
    assert "| rsqr_recall |" in (tmp_path / "out" / "fact_probe.md").read_text()
    with pytest.raises(F.ConfigError, match="unknown arm"):
        F.FactConfig(str(text), arms=("sinkcache",))


@pytest.mark.parametrize("chunk,rule", [(1, "quest"), (3, "quest"), (3, "mean")])
def test_page_summaries_match_the_stored_raw_keys(chunk, rule):
    """cold_lo / cold_hi ("quest") or cold_sum ("mean") of every page = the min / max or sum of its stored raw keys
    rotated at their global positions (restarted pages forget their remnants), after a chunked stream; a store
    keeps only the summaries its rule reads."""
    from rsqr_lab.testing.oracle import rope_f64

    T = 45
    tokens = np.random.default_rng(drawn_seed("summaries")).integers(0, CFG.vocab_size, size=(1, T))
    pol = P.rsqr(8, 2, 3, 3, recall_pages=1)
    spec = rj.CacheSpec.for_policies(pol, max_chunk=chunk, cold=rj.ColdStore(12, 4, rule), **DIMS)
    apply_fn, params = _model(0)
    dec = rj.Decoder(apply_fn, spec)
    cache = dec.init_cache()
    for a in range(0, T - T % chunk, chunk):
        cache = dec.advance(params, tokens[:, a:a + chunk], cache, pol)
    pos = np.asarray(cache.cold.pos)
    n_pages = pos.size // 4
    assert (pos >= 0).sum() >= 12 and T > spec.cold_slots  # the ring wrapped
    rot = rope_f64(np.asarray(cache.cold.k[:, 0]), np.maximum(pos, 0)[None, None, :], np.asarray(CFG.inv_freq))
    for p in range(n_pages):
        sl = slice(4 * p, 4 * p + 4)
        held = pos[sl] >= 0
        if not held.any():
            continue
        r = rot[:, :, sl][:, :, held]  # [L, Hkv, n, D]
        if rule == "mean":
            np.testing.assert_allclose(np.asarray(cache.cold.sums[:, 0, :, p]), r.sum(2), rtol=1e-4, atol=1e-4)
        else:
            np.testing.assert_allclose(np.asarray(cache.cold.lo[:, 0, :, p]), r.min(2), rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(np.asarray(cache.cold.hi[:, 0, :, p]), r.max(2), rtol=1e-4, atol=1e-4)
    summaries = {"sums": cache.cold.sums, "lo": cache.cold.lo, "hi": cache.cold.hi}
    assert {k for k, x in summaries.items() if x is not None} == ({"sums"} if rule == "mean" else {"lo", "hi"})


def test_quest_bound_matches_numpy_and_bounds_every_key():
    rng = np.random.default_rng(drawn_seed("quest"))
    B, C, Hq, Hkv, D, n_pages, Pg = 1, 2, 4, 2, 8, 5, 4
    q = rng.normal(size=(B, C, Hq, D)).astype(np.float32)
    keys = rng.normal(size=(B, Hkv, n_pages, Pg, D)).astype(np.float32)  # already rotated at their positions
    lo, hi, total = keys.min(3), keys.max(3), keys.sum(3)
    cold_pos = np.arange(n_pages * Pg, dtype=np.int32)
    inv = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    qg = np.array([50, 51], np.int32)
    rc = Recall(jnp.int32(2), jnp.ones(n_pages * Pg, bool), jnp.zeros((1,), jnp.int32), jnp.asarray(qg),
                jnp.ones(C, bool), jnp.asarray(True), 2)
    got = np.asarray(page_scores(jnp.asarray(q), jnp.asarray(total), jnp.asarray(cold_pos), rc, jnp.asarray(inv),
                                 jnp.asarray(lo), jnp.asarray(hi)))
    ang = qg[:, None].astype(np.float64) * inv[None]
    c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    qr = np.concatenate([q[..., :4] * c - q[..., 4:] * s, q[..., 4:] * c + q[..., :4] * s], -1).reshape(B, C, Hkv, 2, D)
    bound = np.maximum(qr[:, :, :, :, None] * lo[:, None, :, None], qr[:, :, :, :, None] * hi[:, None, :, None]).sum(-1)
    np.testing.assert_allclose(got, bound.max(axis=(1, 2, 3)), rtol=1e-5, atol=1e-5)
    exact = np.einsum("bckgd,bkpnd->bckgpn", qr, keys).max(axis=(1, 2, 3, 5))  # the best key of each page
    assert (got >= exact - 1e-5).all()  # Quest's score is an upper bound


RECALL_FLAGS = [
    (["--policy", "rerotate", "--recall-pages", "4"], "rerotate cannot recall evicted tokens"),
    (["--recall-pages", "-1"], "must be >= 0"),
    (["--recall-pages", "4", "--cold-capacity", "100"], "must be a positive multiple of the page size 16"),
    (["--recall-pages", "300", "--cold-capacity", "64"], "exceeds the cold store's 4 pages"),
    (["--recall-pages", "4", "--page-score", "maximum"], "unknown page score 'maximum'"),
    (["--recall-pages", "4", "--recall-neighbors", "-1"], "recall neighbors must be >= 0"),
    (["--recall-pages", "4", "--share-choice-from", "3:5"], "layer 3 may attend its own choice"),
    (["--recall-pages", "4", "--share-choice-from", "1:0,2-4:1"], "layer 2 attends layer 1's choice, but layer 1"),
    (["--recall-pages", "4", "--share-choice-from", "0-1:all"], "LAYER[-LAYER]:SOURCE items"),
]
COLD_TOO_LARGE = ("decode.py", ["--recall-pages", "4", "--cold-capacity", str(1 << 30)])


@pytest.fixture(scope="module")
def cli():
    """{(script, *args): finished process} of the recall flags' error cases, run in one batch (tests/cli.py
    run_scripts)."""
    from tests.cli import run_scripts

    cases = [(script, a) for script in ("decode.py", "eval_stream.py") for a, _ in RECALL_FLAGS] + [COLD_TOO_LARGE]
    return {(s, *a): proc for (s, a), proc in zip(cases, run_scripts(cases, timeout=300))}


@pytest.mark.parametrize("args,fragment", RECALL_FLAGS)
@pytest.mark.parametrize("script", ["decode.py", "eval_stream.py"])
def test_recall_flags_bad_input_is_one_line(cli, script, args, fragment):
    from tests.cli import assert_one_line_error

    assert_one_line_error(cli[script, *args], fragment)


@pytest.mark.slow
def test_bench_recall_reports_every_cold_size_against_plain_rsqr(tmp_path):
    from rsqr_lab.studies import recall_timing as B
    from rsqr_lab.testing.tokenizer import ByteTokenizer

    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    cfg = B.BenchRecallConfig(str(text), (0, 32), recall_pages=2, page_size=4, policy=P.rsqr(8, 2, 3, 3),
                              prompt_tokens=40, new_tokens=3, rounds=2, page_scores=("mean", "max"))
    res = B.run(cfg, *_model(0), CFG, ByteTokenizer(CFG.vocab_size))
    rows = res["rows"]
    assert [(r["cold_capacity"], r["page_score"], r["share_from"]) for r in rows] == \
        [(0, None, None), (32, "mean", None), (32, "max", None)]
    assert rows[0]["ratio"] == 1.0
    assert rows[0]["cold_store_MiB"] == 0 < rows[1]["cold_store_MiB"] < rows[2]["cold_store_MiB"]  # + scoring copy
    assert all(len(r["ms_rounds"]) == 2 and r["ms_per_token"] > 0 for r in rows)
    assert rows[1]["device_cache_MiB"] == rows[0]["device_cache_MiB"]  # recall adds no device-cache slots
    B.write(res, tmp_path / "out")
    assert "| 32 | 2 | max | float32 | 1 | every layer chooses |" in (tmp_path / "out" / "bench_recall.md").read_text()
    # Each shared layer and scoring copy is an arm of its own, with its ColdStore (sections 9-10; one round here).
    shared = B.run(dataclasses.replace(cfg, cold_sizes=(32,), page_scores=("max",), share_froms=(0,),
                                       score_dtypes=("int8",), rounds=1), *_model(0), CFG, ByteTokenizer(CFG.vocab_size))
    assert [(r["share_from"], r["reselect"], r["score_dtype"]) for r in shared["rows"]] == [(0, 1, "int8")]
    assert "| 32 | 2 | max | int8 | 1 | layer 0 |" in B.markdown(shared)
    assert rows[1]["cold_store_MiB"] < shared["rows"][0]["cold_store_MiB"] < rows[2]["cold_store_MiB"]
    committed = json.loads((REPO / "docs/data/recall_tier/bench_int8_4k.json").read_text())["config"]
    assert list(res["config"]) == list(committed) and res["config"]["max_survivors"] == 3  # the results' layout
    share = json.loads((REPO / "docs/data/recall_tier/bench_share_4k.json").read_text())["config"]
    assert set(share) == set(committed) - {"score_dtypes"}  # from before the int8 copy: float32 only
    older = json.loads((REPO / "docs/data/recall_tier/bench_full_4k.json").read_text())["config"]
    assert set(older) == set(share) - {"share_froms"}  # from before share_from: every layer chose
    with pytest.raises(B.ConfigError, match="page-scores"):
        B.BenchRecallConfig(str(text), (0, 32), page_size=4, page_scores=("best",))
    with pytest.raises(B.ConfigError, match="multiples of --page-size"):
        B.BenchRecallConfig(str(text), (0, 30), page_size=4)


@pytest.mark.slow
def test_bench_recall_fill_gives_every_arm_a_filled_store_of_its_own_layout(tmp_path, monkeypatch):
    """--fill: an arm starts from a fill whose cache has its shapes in every field (the max rule's scoring
    copy in float32 or int8), so no part of its store is left empty while its cold_pos says full."""
    from rsqr_lab.studies import recall_timing as B
    from rsqr_lab.testing.tokenizer import ByteTokenizer

    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    adopted = []
    real = B._adopt

    def record(session, src):
        from rsqr_jax.cache import cache_arrays

        mine, theirs = cache_arrays(session.cache), cache_arrays(src.cache)
        adopted.append(sorted(k for k in mine.keys() | theirs.keys()
                              if k not in mine or k not in theirs or mine[k].shape != theirs[k].shape))
        real(session, src)

    monkeypatch.setattr(B, "_adopt", record)
    cfg = B.BenchRecallConfig(str(text), (0, 32), recall_pages=2, page_size=4, policy=P.rsqr(8, 2, 3, 3),
                              prompt_tokens=40, new_tokens=2, rounds=1, page_scores=("max",),
                              score_dtypes=("float32", "int8"), fill=True)
    rows = B.run(cfg, *_model(0), CFG, ByteTokenizer(CFG.vocab_size))["rows"]
    assert [(r["page_score"], r["score_dtype"]) for r in rows] == [(None, "float32"), ("max", "float32"), ("max", "int8")]
    assert all(r["recallable"][0] > 0 for r in rows[1:])
    assert adopted[:2] == [[], []]  # the two recalling arms: every field from a fill of their own layout
    assert adopted[2] and all(name.startswith("cold_") for name in adopted[2])  # plain rsqr: no store


@pytest.mark.slow
def test_bench_recall_without_weights_runs_the_same_cache_on_a_projection_that_reads_none(tmp_path):
    """--no-weights: weightless_matmul gives each projection its output width (dense, block or tiled weights) without
    reading them, and a recalling arm runs on it against plain rsqr."""
    import jax.numpy as jnp

    from rsqr_jax.kernels.block_matvec import tile_codes
    from rsqr_jax.models.blocks import BlockWeights, StackedLayer
    from rsqr_jax.models.llama import Llama, split_apply
    from rsqr_lab.studies import recall_timing as B
    from rsqr_jax.models.tiny import tiny_weights
    from rsqr_lab.testing.tokenizer import ByteTokenizer

    x = jnp.arange(12, dtype=jnp.float32).reshape(2, 6)
    blocks = BlockWeights.from_blocks(np.zeros((6, 64), np.int8), np.ones((6, 2), np.float32), None, 1)
    stacked = StackedLayer(BlockWeights(jnp.asarray(tile_codes(np.zeros((2, 2, 32, 16), np.int8))),  # the CPU kernel's
                                        jnp.ones((2, 2, 1, 16)), None, -2, tiled=True), jnp.int32(1))  # layer stack
    for w in (jnp.zeros((6, 10)), jnp.zeros((6, 4)), blocks, stacked):
        out = B.weightless_matmul(x, w)
        assert out.shape == (2, w.shape[-1])
        np.testing.assert_array_equal(np.asarray(out), np.asarray(x)[:, np.arange(w.shape[-1]) % 6] * 0.5 + 0.01)
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    cfg = B.BenchRecallConfig(str(text), (0, 32), recall_pages=2, page_size=4, policy=P.rsqr(8, 2, 3, 3),
                              prompt_tokens=40, new_tokens=3, rounds=1, page_scores=("max",))
    apply_fn, params = split_apply(Llama(CFG, tiny_weights(CFG, 0)), matmul=B.weightless_matmul)
    rows = B.run(cfg, apply_fn, params, CFG, ByteTokenizer(CFG.vocab_size))["rows"]
    assert [r["cold_capacity"] for r in rows] == [0, 32] and all(r["ms_per_token"] > 0 for r in rows)
    assert rows[1]["recallable"][1] > 0  # the store held recallable tokens: the recalling arm recalled


def test_a_cold_store_larger_than_memory_is_refused_before_loading_the_weights(cli):
    from rsqr_jax.eval.runtime import ConfigError, check_memory
    from tests.cli import assert_one_line_error

    assert_one_line_error(cli[COLD_TOO_LARGE[0], *COLD_TOO_LARGE[1]], "GiB of memory is available")
    with pytest.raises(ConfigError, match="--cold-capacity"):
        check_memory(1 << 60)


def test_a_saved_session_resumes_with_its_cold_store(tmp_path):
    """Session.save / load keeps the cold store and its summaries: the continuation is token- and
    bit-identical to an uninterrupted run, and the resumed session still recalls (the store is not empty)."""
    from rsqr_jax.session import Session

    rng = np.random.default_rng(drawn_seed("resume"))
    a, b = rng.integers(0, CFG.vocab_size, size=40), rng.integers(0, CFG.vocab_size, size=9)
    pol = P.rsqr(8, 2, 3, 3, recall_pages=2)
    spec = spec_for([pol], 0, chunk=4, cold=32, neighbors=1)
    apply_fn, params = _model(0)
    ident = {"model": "tiny-random", "seed": 0}

    def session():
        return Session(apply_fn, params, spec, pol, prefill_chunk=4, vocab_size=CFG.vocab_size,
                       sampling=Sampling(temperature=8.0), seed=3)

    ref = session()
    ref.feed(a)
    want = ref.generate(6)
    ref.feed(b)
    want += ref.generate(6)
    s = session()
    s.feed(a)
    got = s.generate(3)
    s.save(tmp_path / "r.session", ident)
    # a file missing an array (here the cold store's positions) is refused, one line
    from rsqr_jax.session_file import SessionFileError, read_session_file, write_session_file

    header, arrays = read_session_file(tmp_path / "r.session")
    assert arrays.pop("cache.cold_pos").size > 0
    header.pop("arrays"), header.pop("checksum")
    write_session_file(tmp_path / "old.session", header, arrays)
    with pytest.raises(SessionFileError, match="old.session holds arrays"):
        Session.load(tmp_path / "old.session", apply_fn, params, ident)
    s = Session.load(tmp_path / "r.session", apply_fn, params, ident)
    assert s.spec == spec and int((np.asarray(s.cache.cold.pos) >= 0).sum()) > 16
    got += s.generate(3)
    s.feed(b)
    got += s.generate(6)
    assert got == want
    got_arrays, want_arrays = cache_arrays(s.cache), cache_arrays(ref.cache)
    for f in ("cold_k", "cold_v", "cold_sum", "cold_pos", "win_k"):
        np.testing.assert_array_equal(np.asarray(got_arrays[f]), np.asarray(want_arrays[f]), err_msg=f)


def test_a_store_is_scored_in_the_fewest_equal_blocks():
    """score_block_pages: the fewest blocks of at most `most` pages, all of one size, at least 2 pages (the default
    4096-token store's 277 pages in one block, not a block of 256 and one moved back over 235 of them)."""
    from rsqr_jax.recall import score_block_pages

    for n_pages, most, want in ((277, 320, 277), (277, 256, 139), (4117, 320, 317), (7, 3, 3), (7, 1, 2), (1, 320, 1),
                                (640, 320, 320), (641, 320, 214)):
        got = score_block_pages(n_pages, most)
        assert got == want, (n_pages, most, got)
        blocks = -(-n_pages // got)
        assert blocks == max(1, -(-n_pages // max(most, 2))) or got == 2  # the fewest blocks
        assert blocks * got - n_pages < blocks  # what the last block rescores is less than one page per block


@pytest.mark.xla_optimized  # two programs: compared at the optimizations users run
@pytest.mark.parametrize("rule", ["mean", "quest", "max"])
def test_scoring_only_the_filled_pages_gives_the_same_scores_and_choice(rule):
    """live_page_scores (blocks of pages over the first live_pages pages, the last block moved back to end at
    the last page) against page_scores over the whole store, for an empty store, a filling prefix and a wrapped
    ring, at block sizes that divide the page count, do not, and exceed it: the same pages scored, each score
    within float32 rounding (XLA compiles a block's dot at another shape than the store's, and may sum it in
    another order: 1 ulp apart on an AVX2 machine), and the same ranking of the pages, which is what recall uses."""
    from rsqr_jax.recall import live_page_scores

    rng = np.random.default_rng(drawn_seed(f"live-{rule}"))
    B, C, Hq, Hkv, D, n_pages, Pg = 2, 2, 4, 2, 8, 7, 3
    Nc = n_pages * Pg
    q = jnp.asarray(rng.normal(size=(B, C, Hq, D)), jnp.float32)
    k_glob = jnp.asarray(rng.normal(size=(B, Hkv, Nc, D)), jnp.float32)
    summ = [jnp.asarray(rng.normal(size=(B, Hkv, n_pages, D)), jnp.float32) for _ in range(3)]
    inv = jnp.asarray(1.0 / 10000 ** (np.arange(0, D, 2) / D), jnp.float32)
    gather = lambda starts, n: k_glob[jnp.arange(B)[:, None, None], jnp.arange(Hkv)[None, :, None],  # noqa: E731
                                      run_slots(starts, n)[:, None, :]]
    for filled in (0, 1, 5, 11, Nc - 2, Nc):  # written slots 0 .. filled - 1 (Nc: the ring wrapped)
        cold_pos = np.where(np.arange(Nc) < filled, np.arange(Nc) + 30, -1).astype(np.int32)
        valid = (cold_pos >= 0) & (rng.random(Nc) < 0.8)
        live = -(-int(np.flatnonzero(valid).max(initial=-1) + 1) // Pg)
        for block in (1, 2, 3, n_pages, 64):  # 1 is taken as 2 (live_page_scores)
            rc = Recall(jnp.int32(2), jnp.asarray(valid), jnp.zeros((1,), jnp.int32), jnp.asarray([60, 61], jnp.int32),
                        jnp.asarray([True, False]), jnp.asarray(True), 2, live_pages=jnp.int32(live), score_block=block)
            args = (q, summ[0], jnp.asarray(cold_pos), rc, inv)
            if rule == "max":
                want, got = page_scores(*args, None, None, k_glob), live_page_scores(*args, None, None, gather)
            elif rule == "quest":
                want, got = page_scores(*args, summ[1], summ[2]), live_page_scores(*args, summ[1], summ[2])
            else:
                want, got = page_scores(*args), live_page_scores(*args)
            got, want = np.asarray(got), np.asarray(want)
            finite = np.isfinite(want)
            np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=f"{filled} {block}")
            scale = np.abs(want[finite]).max(initial=1.0)  # a dot of D terms: its rounding scales with their size
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * scale, err_msg=f"{filled} {block}")
            np.testing.assert_array_equal(np.argsort(-got, axis=-1, kind="stable"),
                                          np.argsort(-want, axis=-1, kind="stable"), err_msg=f"{filled} {block}")
        assert np.isfinite(want).sum() == B * np.any(valid.reshape(n_pages, Pg), 1).sum()


def _logits_token_by_token(apply_fn, params, spec, pol, tokens, chunk):
    dec = rj.Decoder(apply_fn, spec)
    cache, out = dec.init_cache(), []
    for t in range(0, tokens.shape[1], chunk):
        logits, cache = dec.feed(params, tokens[:, t:t + chunk], cache, pol)
        out.append(np.asarray(logits[0]))
    return np.concatenate(out)


@pytest.mark.parametrize("rule,chunk", [("max", 1), ("mean", 1), ("quest", 1), ("shortlist", 1), ("max", 4),
                                        ("shortlist", 4)])
@pytest.mark.xla_optimized  # two programs: compared at the optimizations users run
def test_skipping_an_empty_store_and_scoring_its_fill_gives_the_same_logits(monkeypatch, rule, chunk):
    """The recall tier as it runs (nothing scored, gathered or attended while nothing is recallable; only the
    filled blocks scored while the ring fills) against every page scored at every step (score_block 0): the
    same logits within float32 rounding (other programs; another page chosen would move them by far more),
    step by step, through an empty store, a filling one and a wrapped ring, with several blocks (3 pages, the
    last one moved back) and with the default block (one block here)."""

    T = 96
    tokens = np.random.default_rng(drawn_seed(f"skip-{rule}")).integers(0, CFG.vocab_size, size=(1, T))
    pol = P.rsqr(8, 2, 3, 3, recall_pages=2)
    spec = spec_for([pol], T, chunk=chunk, cold=16, score=rule)
    assert spec.cold_slots // 4 % 3 and spec.cold_slots < T - 2 - 8 - 16  # blocks of 3 do not tile; it wraps
    apply_fn, params = _model(0)
    got = {}
    for block in (0, 3, recall.SCORE_BLOCK_PAGES):
        monkeypatch.setattr(recall, "SCORE_BLOCK_PAGES", block)
        got[block] = _logits_token_by_token(lambda *a: apply_fn(*a), params, spec, pol, tokens, chunk)  # new trace
    atol = 1e-5 * np.abs(got[0]).max()  # float32 rounding at the logits' scale; recall's pages move them > 1e-3
    for block in (3, recall.SCORE_BLOCK_PAGES):
        np.testing.assert_allclose(got[block], got[0], rtol=1e-5, atol=atol, err_msg=f"block {block}")
    plain = P.rsqr(8, 2, 3, 3)
    alone = _logits_token_by_token(apply_fn, params, spec_for([plain], T, chunk=chunk), plain, tokens, chunk)
    np.testing.assert_allclose(got[0][:8], alone[:8], rtol=1e-5, atol=atol)  # nothing left the window yet: plain rsqr
    assert np.abs(got[0] - alone).max() > 1e-3  # recall changed the stream later: the check is not vacuous


@pytest.mark.xla_optimized  # two programs, the same bits: at the optimizations users run
def test_skipping_recall_under_vmap_changes_no_bit(monkeypatch):
    """Under vmap the skip (a lax.cond on "anything recallable") becomes a select that runs both branches: a
    sweep of policies that recall and do not (recall_pages 0 skips at every step) gives what every page scored
    at every step gives (to float32 rounding, under one compilation), and streams of different lengths (one
    still empty while another fills) the same tokens."""
    from rsqr_jax.streams import Request, StreamScheduler

    T = 60
    rng = np.random.default_rng(drawn_seed("skip-vmap"))
    tokens = rng.integers(0, CFG.vocab_size, size=(1, T))
    pols = [P.rsqr(8, 2, 3, 3, recall_pages=k) for k in (0, 2)] + [P.streamingllm(8, 2, recall_pages=2)]
    spec = spec_for(pols, T, cold=24, score="max")
    prompts = [rng.integers(0, CFG.vocab_size, size=n).tolist() for n in (31, 6, 25)]
    one = P.rsqr(8, 2, 3, 3, recall_pages=2)
    stream_spec = spec_for([one], 0, chunk=4, cold=32, score="max")
    apply_fn, params = _model(0)
    sweep, streams = {}, {}
    for block in (0, recall.SCORE_BLOCK_PAGES):
        monkeypatch.setattr(recall, "SCORE_BLOCK_PAGES", block)
        fn = lambda *a: apply_fn(*a)  # noqa: E731  (a new Decoder: traced with this block)
        before = TRACES["score"]
        sweep[block], _ = rj.stream_nll(fn, params, tokens, rj.stack_policies(pols), spec, segment=8,
                                        vmap_policies=True)
        assert TRACES["score"] - before == 1
        sched = StreamScheduler(fn, params, stream_spec, one, n_slots=2, prefill_chunk=4, vocab_size=CFG.vocab_size)
        streams[block] = [f.tokens for f in sched.run([Request(tuple(ids), 6, seed=5) for ids in prompts])]
    # A vmapped sweep is equal to within float32 rounding, not bit for bit (measured: ulp-level differences in a
    # fifth of the NLLs; which batched op rounds differently is not isolated yet).
    np.testing.assert_allclose(sweep[recall.SCORE_BLOCK_PAGES], sweep[0], atol=5e-5, rtol=0)
    assert streams[recall.SCORE_BLOCK_PAGES] == streams[0]
    assert np.abs(sweep[0][1] - sweep[0][0]).max() > 1e-3  # recall changed the sweep: not vacuous


def test_read_layer_runs_equals_the_gather_of_their_slots(monkeypatch):
    """kernels.store.read_layer_runs (recall's reads of pages and score blocks as sliced runs) gives gather_layer_slots'
    values for the same slots bit for bit, sliced (a few runs) or gathered (past SLICED_RUNS_MAX), under jit with
    the layer traced, for every batch row; uint16 bits (a bfloat16 store) included."""
    from rsqr_jax.kernels import store as C

    rng = np.random.default_rng(drawn_seed("runs"))
    L, B, H, N, D, Pg, M = 3, 2, 2, 40, 4, 4, 3
    buf = jnp.asarray(rng.normal(size=(L, B, H, N, D)), jnp.float32)
    bits = jax.lax.bitcast_convert_type(buf.astype(jnp.bfloat16), jnp.uint16)
    starts = jnp.asarray(rng.choice(N // Pg, size=(B, M), replace=True) * Pg, jnp.int32)  # pages, repeats allowed
    for most in (C.SLICED_RUNS_MAX, 0):  # sliced, then every call gathered
        monkeypatch.setattr(C, "SLICED_RUNS_MAX", most)
        for b in (buf, bits):
            runs = jax.jit(lambda b, layer: C.read_layer_runs(b, layer, starts, Pg))
            for layer in range(L):
                want = C.gather_layer_slots(b, jnp.int32(layer), C.run_slots(starts, Pg))
                got = runs(b, jnp.int32(layer))
                assert got.shape == (B, H, M * Pg, D) and got.dtype == b.dtype
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    block = C.read_layer_runs(buf, 1, jnp.full((B, 1), 8, jnp.int32), 24)  # one block of 24 slots from slot 8
    np.testing.assert_array_equal(np.asarray(block), np.asarray(buf[1, :, :, 8:32]))
