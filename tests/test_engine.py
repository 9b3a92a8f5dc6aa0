"""The decode engine (rsqr_jax.engine): one compilation per configuration for a whole stream, the
compiled generation loop equals feeding token by token, jit equals no-jit for the step, policies vmap,
and the nucleus (top-p) branch of the sampler keeps exactly the smallest nucleus."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rsqr_jax import policy as P
from rsqr_jax.engine import TRACES, Decoder, policy_values, stream_nll
from rsqr_jax.sampling import Sampling, sample
from rsqr_jax.cache import init_cache
from rsqr_jax.spec import CacheSpec
from rsqr_jax.models.tiny import tiny_config, tiny_model
from rsqr_jax.engine import step

CFG = tiny_config()
POLICIES = [P.rsqr(6, 2, 2, 3, block=2), P.rerotate(6, 2, 2, 3), P.streamingllm(6, 2), P.replay(6, 2, 2, 3, block=2),
            P.rsqr_precompute(6, 2, 2, 3), P.leave_gaps(6, 2, 2, 3), P.window(6), P.full()]
SPEC = CacheSpec.for_policies(POLICIES, num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                              head_dim=CFG.head_dim, max_chunk=4, max_len=64)


def _seeded(name: str) -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"{name}: seed {seed}")  # a failing draw is reproducible from the log
    return np.random.default_rng(seed)


def test_a_whole_stream_compiles_score_once_per_configuration():
    apply_fn, params = tiny_model(CFG, 3)
    tokens = _seeded("stream").integers(0, CFG.vocab_size, size=(1, 50))
    pols = P.stack_policies(POLICIES[:3])
    before = TRACES["score"]
    # Three policies of the same batch shape, two stream lengths and two pieces each: one trace.
    for batch in (pols, P.stack_policies([POLICIES[2], POLICIES[0], POLICIES[1]])):
        for T in (50, 37):
            stream_nll(apply_fn, params, tokens[:, :T], batch, SPEC, chunk=2, segment=8, vmap_policies=True)
    assert TRACES["score"] - before == 1
    # another chunk size is another configuration: exactly one more
    stream_nll(apply_fn, params, tokens, pols, SPEC, chunk=4, segment=8, vmap_policies=True)
    assert TRACES["score"] - before == 2


@pytest.mark.parametrize("index", range(len(POLICIES)))
def test_vmapped_policy_equals_the_policy_alone(index):
    apply_fn, params = tiny_model(CFG, 4)
    tokens = _seeded("vmap").integers(0, CFG.vocab_size, size=(1, 40))
    nll_PxBxT, _ = stream_nll(apply_fn, params, tokens, P.stack_policies(POLICIES), SPEC, chunk=1, segment=13,
                              vmap_policies=True)
    alone, _ = stream_nll(apply_fn, params, tokens, POLICIES[index], SPEC, chunk=1, segment=13)
    np.testing.assert_allclose(nll_PxBxT[index], alone, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("policy", [POLICIES[0], POLICIES[3], POLICIES[2]], ids=["rsqr", "replay", "streamingllm"])
def test_generate_loop_equals_feeding_token_by_token(policy):
    """Decoder.generate (a compiled while_loop over blocks) = the same greedy stream fed one token at a time."""
    apply_fn, params = tiny_model(CFG, 5)
    dec = Decoder.for_policy(apply_fn, SPEC, policy, gen_block=5)
    prompt = _seeded("generate").integers(0, CFG.vocab_size, size=(1, 4))
    rng = jax.random.PRNGKey(0)
    nxt, cache, rng = dec.feed_and_sample(params, prompt, dec.init_cache(), None, 4, rng, Sampling())
    ref_cache = jax.tree.map(jnp.copy, cache)
    got, pending = [], nxt
    for _ in range(4):  # 4 blocks of 5 = 20 tokens, one host round trip per block
        out = dec.generate(params, pending, cache, None, rng, Sampling(), 5, eos_ids=())
        cache, rng, pending = out.cache, out.state, out.pending_B
        assert int(out.n_steps) == 5 and not bool(out.done_B[0])
        got += [int(t) for t in np.asarray(out.tokens_BxK[0])]
    want, tok, c = [], int(nxt[0]), ref_cache
    for _ in range(20):
        want.append(tok)
        logits, c = dec.feed(params, np.asarray([[tok]]), c, None, 1)
        tok = int(jnp.argmax(logits[0, 0]))
    assert got == want
    assert int(cache.t) == int(c.t) == 24


def test_generate_stops_at_end_of_sequence_without_feeding_it():
    apply_fn, params = tiny_model(CFG, 6)
    dec = Decoder.for_policy(apply_fn, SPEC, POLICIES[0], gen_block=8)
    prompt = _seeded("eos").integers(0, CFG.vocab_size, size=(1, 3))
    rng = jax.random.PRNGKey(1)
    nxt, cache, rng = dec.feed_and_sample(params, prompt, dec.init_cache(), None, 3, rng, Sampling())
    free = dec.generate(params, nxt, jax.tree.map(jnp.copy, cache), None, rng, Sampling(), 8, eos_ids=())
    stream = [int(t) for t in np.asarray(free.tokens_BxK[0])]
    eos = stream[3]  # the 4th greedy token, declared end-of-sequence
    stop = stream.index(eos)
    out = dec.generate(params, nxt, cache, None, rng, Sampling(), 8, eos_ids=(eos,))
    assert bool(out.done_B[0]) and int(out.n_steps) == stop + 1
    assert [int(t) for t in np.asarray(out.tokens_BxK[0, :stop + 1])] == stream[:stop + 1]
    assert (np.asarray(out.tokens_BxK[0, stop + 1:]) == -1).all()
    assert int(out.cache.t) == 3 + stop  # every emitted token but the end-of-sequence one was fed


def test_fixed_policy_decoders_are_equal_and_hash_equal():
    apply_fn, _ = tiny_model(CFG, 7)
    a = Decoder.for_policy(apply_fn, SPEC, P.rsqr(6, 2, 2, 3, block=2))
    b = Decoder(apply_fn, SPEC, fixed_policy=policy_values(POLICIES[0]))
    assert a == b and hash(a) == hash(b)
    assert a != Decoder.for_policy(apply_fn, SPEC, POLICIES[1])


VARIANT_SEED = int(np.random.SeedSequence().entropy % 2**31)  # one draw shared by both variants


class TestStepJitNoJit(chex.TestCase):
    """The per-step update gives the same logits and cache under jit and without it."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_step(self):
        apply_fn, params = tiny_model(CFG, 8)
        print(f"variants: seed {VARIANT_SEED}")
        rng = np.random.default_rng(VARIANT_SEED)
        cache = Decoder(apply_fn, SPEC).init_cache()
        fn = self.variant(lambda p, tok, c, pol, n: step(apply_fn, p, tok, c, pol, n))
        for n in (4, 4, 3, 1):  # W + b = 7 after 8 tokens: evictions and a survivor
            tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(1, 4)), jnp.int32)
            logits, cache = fn(params, tokens, cache, POLICIES[0], jnp.int32(n))
            chex.assert_shape(logits, (1, 4, CFG.vocab_size))
            assert np.isfinite(np.asarray(logits[0, :n])).all()
        assert int(cache.t) == 12
        self.__class__.results = getattr(self.__class__, "results", []) + [np.asarray(logits[0, 0])]
        if len(self.__class__.results) == 2:
            np.testing.assert_allclose(*self.__class__.results, rtol=1e-5, atol=1e-5)


def test_nucleus_keeps_exactly_the_smallest_set_reaching_top_p():
    rng = _seeded("top_p")
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))  # sorted probabilities
    # One compiled draw of many keys (eager sampling dispatched ~2k small executables: 36k memory maps).
    draws = jax.jit(jax.vmap(sample, in_axes=(None, 0, None, None)))
    keys = jax.random.split(jax.random.PRNGKey(int(rng.integers(2**31))), 300)
    no_ring = jnp.zeros((1, 0), jnp.int32)

    def drawn(lg, top_p):
        v = Sampling(temperature=1.0, top_p=top_p).values()
        return set(np.asarray(draws(jnp.asarray(lg), keys, v, no_ring))[:, 0].tolist())

    assert drawn(logits, 0.7) == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3: the nucleus is the two most likely tokens
    assert drawn(logits, 0.81) == {0, 1, 2}
    perm = rng.permutation(4)  # the nucleus is found by probability, not by index
    assert drawn(logits[:, perm], 0.7) == {int(np.where(perm == 0)[0][0]), int(np.where(perm == 1)[0][0])}


def test_advance_gives_the_cache_feed_gives():
    apply_fn, params = tiny_model(CFG, 9)
    dec = Decoder(apply_fn, SPEC)
    tokens = _seeded("advance").integers(0, CFG.vocab_size, size=(1, 4))
    a, b = dec.init_cache(), dec.init_cache()
    for n in (4, 4, 2):
        a = dec.advance(params, tokens, a, POLICIES[0], n)
        _, b = dec.feed(params, tokens, b, POLICIES[0], n)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert int(a.t) == 10


@pytest.mark.parametrize("policy", [P.rsqr(6, 2, 2, 3, block=2), P.replay(6, 2, 2, 3, block=2)], ids=["rsqr", "replay"])
def test_last_logits_are_the_last_real_rows_and_the_model_computes_only_that_row(policy):
    """step(last_logits=True), what sampling calls: [B, 1, V], the full step's row n_valid - 1 (within float32
    rounding: one row's final dot may sum in another order than the chunk's), the same cache bit for bit; the
    model honours StepPlan.logits_row (its logits have one row), and a model that does not gets its row taken by
    step, bit for bit. replay: its rebuild branch too (the policy replays on a block boundary; the rebuild's own
    forward over the whole cache keeps every row, the chunk's rows are taken from it)."""
    apply_fn, params = tiny_model(CFG, 5)
    rng = _seeded("last logits")
    spec = CacheSpec.for_policies(policy, num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                                  head_dim=CFG.head_dim, max_chunk=4, max_len=64)
    shapes = []

    def all_rows(params, tokens, cache, plan):  # a model that ignores logits_row
        out = apply_fn(params, tokens, cache, dataclasses.replace(plan, logits_row=None))
        shapes.append(out[0].shape)
        return out

    def seen(params, tokens, cache, plan):
        out = apply_fn(params, tokens, cache, plan)
        shapes.append(out[0].shape)
        return out

    cache = init_cache(spec)
    for n_valid in (4, 3, 4, 1, 2, 4, 4, 3):  # past the window: evictions, survivors, replays
        tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(1, 4)), jnp.int32)
        want, cache_want = step(apply_fn, params, tokens, cache, policy, n_valid)
        shapes.clear()
        got, cache_got = step(seen, params, tokens, cache, policy, n_valid, last_logits=True)
        one_row = (1, 1, CFG.vocab_size)
        assert got.shape == one_row and one_row in shapes, shapes
        assert int(policy.mode) == P.REPLAY or set(shapes) == {one_row}, shapes
        np.testing.assert_allclose(np.asarray(got[:, 0]), np.asarray(want[:, n_valid - 1]), rtol=1e-5, atol=1e-5)
        chex.assert_trees_all_equal(cache_got, cache_want)
        ignored, _ = step(all_rows, params, tokens, cache, policy, n_valid, last_logits=True)
        np.testing.assert_array_equal(np.asarray(ignored[:, 0]), np.asarray(want[:, n_valid - 1]))
        cache = cache_want
