"""Choosing recall pages every k steps (`ColdStore.reselect`): between scorings a layer attends the pages it chose
last, their tokens gathered and checked afresh. On the tiny random model: reselect = 1 is the plain recall tier
bit for bit, and reselect = k equals the float64 rank oracle of that definition; a prompt chunk always chooses.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import rsqr_jax as rj
from rsqr_jax.cache import cache_arrays
from rsqr_jax import policy as P
from rsqr_lab.testing.oracle import reference_cold_sets, reference_token_sets, stream_logits_f64
from rsqr_lab.testing import drawn_seed
from rsqr_jax.models.tiny import tiny_config, tiny_model, tiny_weights

CFG = tiny_config()
DIMS = dict(num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim)


@functools.lru_cache(maxsize=None)
def _model(seed=0):
    return tiny_model(CFG, seed)


def _spec(pol, *, cold, page, reselect, chunk=1):
    return rj.CacheSpec.for_policies([pol], max_chunk=chunk, cold=rj.ColdStore(cold, page, "mean", reselect=reselect),
                                     **DIMS)


def _stream(pol, spec, tokens, chunk=1, seed=2):
    apply_fn, params = _model(seed)
    dec = rj.Decoder(apply_fn, spec)
    cache, logits, choices = dec.init_cache(), [], []
    for t in range(0, len(tokens), chunk):
        out, cache = dec.feed(params, tokens[None, t:t + chunk], cache, pol)
        logits.append(np.asarray(out[0], np.float64))
        choices.append(np.asarray(cache.cold.choice))
    return np.concatenate(logits), choices


@pytest.mark.parametrize("k", [3, 5])
def test_reselect_k_equals_the_float64_oracle_of_its_definition(k):
    """Every page recalled at a scoring step (step % k == 0); in between, the recallable tokens of the pages that
    were live then, and nothing of a page that filled later."""
    T, W, N, d, S, Pg = 60, 8, 2, 3, 3, 4
    seed = drawn_seed(f"reselect {k}")
    tokens = np.random.default_rng(seed).integers(0, CFG.vocab_size, size=T)
    probe = _spec(P.rsqr(W, N, d, S, recall_pages=1), cold=8, page=Pg, reselect=k)
    pol = P.rsqr(W, N, d, S, recall_pages=probe.cold_pages)  # every page: one token set for all layers
    spec = _spec(pol, cold=8, page=Pg, reselect=k)
    got, choices = _stream(pol, spec, tokens)
    sets = reference_token_sets(T, window=W, n_sink=N, delta=d, max_survivors=S, block=1)
    cold = reference_cold_sets(T, window=W, n_sink=N, block=1, page_size=Pg, cold_slots=spec.cold_slots)
    page_of = lambda g: ((g - N) % spec.cold_slots) // Pg  # noqa: E731
    token_sets, live, grew = [], set(), False
    for step, ((_, base), (_, recallable)) in enumerate(zip(sets, cold)):
        if step % k == 0:
            live = {page_of(g) for g in recallable}
        kept = {g for g in recallable if page_of(g) in live}
        grew |= len(kept) < len(recallable)
        token_sets.append(sorted(set(base) | kept))
    assert grew  # some step attends less than everything recallable: the kept choice matters
    want = stream_logits_f64(tiny_weights(CFG, 2), CFG, tokens, token_sets, "rank")
    assert float(np.max(np.abs(got - want)) / np.max(np.abs(want))) < 2e-5
    stale = [np.array_equal(choices[s], choices[s - 1]) for s in range(1, T) if s % k]
    assert all(stale)  # the choice changes only at scoring steps


def test_reselect_one_is_the_plain_recall_tier_and_a_prompt_always_chooses():
    tokens = np.random.default_rng(drawn_seed("reselect 1")).integers(0, CFG.vocab_size, size=48)
    pol = P.rsqr(8, 2, 3, 3, recall_pages=2)
    base, _ = _stream(pol, _spec(pol, cold=16, page=4, reselect=1), tokens)
    one = rj.CacheSpec.for_policies([pol], cold=rj.ColdStore(16, 4, "mean"), **DIMS)  # the field left at its default
    np.testing.assert_array_equal(_stream(pol, one, tokens)[0], base)
    # chunks of 4 are prompts: every step chooses, whatever k
    chunked, _ = _stream(pol, _spec(pol, cold=16, page=4, reselect=1, chunk=4), tokens, chunk=4)
    never, _ = _stream(pol, _spec(pol, cold=16, page=4, reselect=10**6, chunk=4), tokens, chunk=4)
    np.testing.assert_allclose(never, chunked, atol=1e-5, rtol=0)
    assert np.abs(_stream(pol, _spec(pol, cold=16, page=4, reselect=10**6), tokens)[0] - base).max() > 1e-3


def test_the_first_decode_step_after_a_prompt_chooses_then_keeps():
    """A prompt restarts the count: the decode step right after it scores the store (as reselect = 1 does), the
    next ones keep that choice."""
    tokens = np.random.default_rng(drawn_seed("after a prompt")).integers(0, CFG.vocab_size, size=30)
    pol = P.rsqr(8, 2, 3, 3, recall_pages=2)
    apply_fn, params = _model(2)
    out = {}
    for k in (1, 10**6):
        dec = rj.Decoder(apply_fn, _spec(pol, cold=16, page=4, reselect=k, chunk=4))
        cache = dec.init_cache()
        for t in range(0, 24, 4):
            _, cache = dec.feed(params, tokens[None, t:t + 4], cache, pol)
        rows, choices = [], []
        for t in range(24, 30):
            logits, cache = dec.feed(params, tokens[None, t:t + 1], cache, pol)
            rows.append(np.asarray(logits[0, -1], np.float64))
            choices.append(np.asarray(cache.cold.choice))
        out[k] = rows, choices
    np.testing.assert_allclose(out[10**6][0][0], out[1][0][0], atol=1e-5, rtol=0)  # the first step chose afresh
    kept = out[10**6][1]
    assert all(np.array_equal(kept[0], c) for c in kept[1:])  # then kept it
    assert max(np.abs(a - b).max() for a, b in zip(out[10**6][0], out[1][0])) > 1e-4  # and keeping it matters


def test_reselect_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="reselect must be an integer >= 1"):
        rj.ColdStore(16, 4, reselect=0)


def test_a_saved_session_keeps_its_page_choice(tmp_path):
    """The kept choice and the step count are session state: save + load mid-stream (between scorings) continues
    bit-identically."""
    from rsqr_jax.models.llama import Llama, split_apply
    from rsqr_jax.session import Session

    import jax.numpy as jnp

    seed = drawn_seed("resume")
    prompt, more = np.split(np.random.default_rng(seed).integers(0, CFG.vocab_size, size=40), [28])
    pol = P.rsqr(8, 2, 3, 3, recall_pages=2)
    spec = _spec(pol, cold=16, page=4, reselect=3, chunk=4)
    apply_fn, params = split_apply(Llama(CFG, tiny_weights(CFG, 0), dtype=jnp.float32))
    identity = {"model": "tiny-random", "seed": 0}
    make = lambda: Session(apply_fn, params, spec, pol, prefill_chunk=4, vocab_size=CFG.vocab_size)  # noqa: E731

    ref = make()
    ref.feed(prompt)
    want = ref.generate(4)
    ref.feed(more)
    want += ref.generate(6)

    s = make()
    s.feed(prompt)
    got = s.generate(4)
    s.save(tmp_path / "r.session", identity)
    s = Session.load(tmp_path / "r.session", apply_fn, params, identity)
    assert int(s.cache.cold.step[0]) % 3 != 0  # resumed between two scorings: the kept choice is what it reads
    s.feed(more)
    got += s.generate(6)
    assert got == want, f"seed {seed}"
    got_arrays, want_arrays = cache_arrays(s.cache), cache_arrays(ref.cache)
    for name in ("cold_choice", "cold_choice_on", "cold_step", "win_k", "cold_k"):
        np.testing.assert_array_equal(np.asarray(got_arrays[name]), np.asarray(want_arrays[name]),
                                      err_msg=f"{name}, seed {seed}")


# --- ColdStore.share_from: the layers after one layer attend the pages it chose ---

CFG3 = tiny_config(layers=3)
DIMS3 = dict(num_layers=CFG3.num_layers, num_kv_heads=CFG3.num_kv_heads, head_dim=CFG3.head_dim)


def _shared_stream(pol, share, tokens, *, rule="max", cold=16, page=4, chunk=1, seed=2, reselect=1):
    """Logits [T, V] (float64) and, after every step, the page choice and its mask [L, B, M] of each layer."""
    apply_fn, params = tiny_model(CFG3, seed)
    spec = rj.CacheSpec.for_policies([pol], max_chunk=chunk, cold=rj.ColdStore(cold, page, rule, share_from=share,
                                                                                reselect=reselect), **DIMS3)
    dec = rj.Decoder(apply_fn, spec)
    cache, logits, choices = dec.init_cache(), [], []
    for t in range(0, len(tokens), chunk):
        out, cache = dec.feed(params, tokens[None, t:t + chunk], cache, pol)
        logits.append(np.asarray(out[0], np.float64))
        choices.append((np.asarray(cache.cold.choice), np.asarray(cache.cold.choice_on)))
    return np.concatenate(logits), choices, spec


@pytest.mark.parametrize("reselect", [1, 3])
def test_shared_choice_equals_the_float64_oracle_of_its_definition(reselect):
    """share_from = 1 of 3 layers: layers 0 and 1 choose as they would unshared (their inputs do not depend on
    later layers, so their choices are the unshared run's, bit for bit), layer 2 holds layer 1's choice at every
    step, and the logits are the float64 oracle's with each layer attending the recallable tokens of the pages it
    holds (the pages its own scores did not pick, for layer 2). With reselect 3 (decode.py pairs the two), two
    steps in three attend the choices kept from the last scoring step, layer 2 layer 1's."""
    T, W, N, d, S, Pg = 56, 8, 2, 3, 3, 4
    seed = drawn_seed(f"shared choice {reselect}")
    tokens = np.random.default_rng(seed).integers(0, CFG3.vocab_size, size=T)
    pol = P.rsqr(W, N, d, S, recall_pages=1)
    got, choices, spec = _shared_stream(pol, 1, tokens, reselect=reselect)
    # every layer chooses (and keeps its choice)
    _, own, _ = _shared_stream(pol, CFG3.num_layers - 1, tokens, reselect=reselect)
    for (c, on), (c_own, on_own) in zip(choices, own):
        np.testing.assert_array_equal(c[:2], c_own[:2], err_msg=f"seed {seed}")
        np.testing.assert_array_equal(on[:2], on_own[:2], err_msg=f"seed {seed}")
        np.testing.assert_array_equal(c[2], c[1], err_msg=f"seed {seed}")
    assert any(not np.array_equal(c_own[2], c_own[1]) for c_own, _ in own), f"seed {seed}: layer 2 chose alike"
    sets = reference_token_sets(T, window=W, n_sink=N, delta=d, max_survivors=S, block=1)
    cold = reference_cold_sets(T, window=W, n_sink=N, block=1, page_size=Pg, cold_slots=spec.cold_slots)
    page_of = lambda g: ((g - N) % spec.cold_slots) // Pg  # noqa: E731
    token_sets = []
    for (_, base), (_, recallable), (c, on) in zip(sets, cold, choices):
        pages = [{int(p) for p, a in zip(c[layer, 0], on[layer, 0]) if a} for layer in range(CFG3.num_layers)]
        token_sets.append([sorted(set(base) | {g for g in recallable if page_of(g) in pages[layer]})
                           for layer in range(CFG3.num_layers)])
    want = stream_logits_f64(tiny_weights(CFG3, 2), CFG3, tokens, token_sets, "rank")
    assert float(np.max(np.abs(got - want)) / np.max(np.abs(want))) < 2e-5, f"seed {seed}"


def test_sharing_from_the_last_layer_is_the_plain_tier_and_a_bad_layer_is_refused():
    tokens = np.random.default_rng(drawn_seed("share last")).integers(0, CFG3.vocab_size, size=48)
    pol = P.rsqr(8, 2, 3, 3, recall_pages=2)
    plain, _, _ = _shared_stream(pol, None, tokens, chunk=4)
    last, _, _ = _shared_stream(pol, CFG3.num_layers - 1, tokens, chunk=4)
    np.testing.assert_array_equal(last, plain)
    first, _, _ = _shared_stream(pol, 0, tokens, chunk=4)
    assert np.abs(first - plain).max() > 1e-3  # sharing layer 0's choice changes what layers 1 and 2 attend
    with pytest.raises(ValueError, match="share_from 3 is not one of the 3 layers that recall"):
        rj.CacheSpec.for_policies([pol], cold=rj.ColdStore(16, 4, share_from=3), **DIMS3)
    with pytest.raises(ValueError, match="share_from must be a layer index >= 0, a tuple of one source per layer"):
        rj.ColdStore(16, 4, share_from=-1)


# --- ColdStore.share_from as one source per layer: choose, share an earlier layer's choice, or recall nothing ---


@pytest.mark.parametrize("reselect", [1, 3])
def test_per_layer_sources_equal_the_float64_oracle_of_their_definition(reselect):
    """share_from = (-1, 1, 1) on 3 layers: layer 0 attends no recalled token, layer 1 chooses, layer 2 holds layer
    1's choice at every step; the logits are the float64 oracle's with each layer attending exactly that."""
    T, W, N, d, S, Pg = 56, 8, 2, 3, 3, 4
    seed = drawn_seed(f"per-layer sources {reselect}")
    tokens = np.random.default_rng(seed).integers(0, CFG3.vocab_size, size=T)
    pol = P.rsqr(W, N, d, S, recall_pages=1)
    got, choices, spec = _shared_stream(pol, (-1, 1, 1), tokens, reselect=reselect)
    assert any(on[1].any() for _, on in choices), f"seed {seed}: nothing recalled"
    for c, on in choices:
        np.testing.assert_array_equal(c[2], c[1], err_msg=f"seed {seed}")
        np.testing.assert_array_equal(on[2], on[1], err_msg=f"seed {seed}")
    sets = reference_token_sets(T, window=W, n_sink=N, delta=d, max_survivors=S, block=1)
    cold = reference_cold_sets(T, window=W, n_sink=N, block=1, page_size=Pg, cold_slots=spec.cold_slots)
    page_of = lambda g: ((g - N) % spec.cold_slots) // Pg  # noqa: E731
    token_sets = []
    for (_, base), (_, recallable), (c, on) in zip(sets, cold, choices):
        pages = [set()] + [{int(p) for p, a in zip(c[layer, 0], on[layer, 0]) if a} for layer in (1, 2)]
        token_sets.append([sorted(set(base) | {g for g in recallable if page_of(g) in pages[layer]})
                           for layer in range(CFG3.num_layers)])
    want = stream_logits_f64(tiny_weights(CFG3, 2), CFG3, tokens, token_sets, "rank")
    assert float(np.max(np.abs(got - want)) / np.max(np.abs(want))) < 2e-5, f"seed {seed}"
    # the oracle tells the layers apart: with layer 0 recalling too, the logits move
    recall0, _, _ = _shared_stream(pol, (0, 1, 1), tokens, reselect=reselect)
    assert np.abs(recall0 - got).max() > 1e-3, f"seed {seed}"


def test_per_layer_sources_spell_the_shared_layer_and_bad_sources_are_refused():
    """A tuple that says what share_from = r says is that run bit for bit (the sources are all the plan reads);
    layers past the tuple's end choose their own; a layer may not attend a later layer's choice, nor the choice
    of a layer that does not choose."""
    tokens = np.random.default_rng(drawn_seed("sources spell share")).integers(0, CFG3.vocab_size, size=48)
    pol = P.rsqr(8, 2, 3, 3, recall_pages=2)
    shared, _, _ = _shared_stream(pol, 1, tokens, chunk=4, reselect=3)
    spelled, _, _ = _shared_stream(pol, (0, 1, 1), tokens, chunk=4, reselect=3)
    np.testing.assert_array_equal(spelled, shared)
    assert rj.ColdStore(16, 4, share_from=1).choice_sources(3) == (0, 1, 1)
    assert rj.ColdStore(16, 4, share_from=(-1,)).choice_sources(3) == (-1, 1, 2)
    assert rj.ColdStore(16, 4, share_from=[0, 0]).share_from == (0, 0)  # a session file's JSON list
    for bad, msg in [((1,), r"layer 0 may attend its own choice \(0\), an earlier layer's or none"),
                     ((0, 2, 2), "layer 1 may attend"), ((-1, 0), "layer 0 does not choose its own pages"),
                     ((0, True), "layer 1 may attend"), ((-2,), "layer 0 may attend")]:
        with pytest.raises(ValueError, match=msg):
            rj.ColdStore(16, 4, share_from=bad)
    with pytest.raises(ValueError, match="share_from names 4 layers; 3 layers recall"):
        rj.CacheSpec.for_policies([pol], cold=rj.ColdStore(16, 4, share_from=(0, 1, 2, 3)), **DIMS3)
