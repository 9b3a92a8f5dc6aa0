"""Determinism: same seed and inputs -> same tokens; jit and no-jit agree; a policy inside a vmapped
sweep agrees with the same policy run alone (chunked, on a shared spec; tests/test_sweep.py covers
every mode token by token through rsqr_jax.sweep)."""

from __future__ import annotations

import chex
import pytest
import jax
import jax.numpy as jnp
import numpy as np

from rsqr_jax import policy as P
from rsqr_jax.cache import init_cache
from rsqr_jax.sampling import Sampling
from rsqr_jax.spec import CacheSpec
from rsqr_jax.engine import stream_nll
from rsqr_jax.engine import step
from tests.tiny_session import CFG, make_session, model


DATA_SEED = 2024  # the inputs' seed: every failure message names it


def _prompt(size=21):
    return np.random.default_rng(DATA_SEED).integers(0, CFG.vocab_size, size=size)


def test_same_seed_same_tokens_other_seed_other_tokens():
    prompt = _prompt()
    kw = dict(sampling=Sampling(temperature=8.0, top_k=50))  # (top_p < 1 keeps the tiny model's argmax alone)

    def tokens(seed, policy="rsqr"):
        s = make_session(policy, seed=seed, **kw)
        s.feed(prompt)
        return s.generate(24)

    a = tokens(11)
    assert tokens(11) == a, f"data seed {DATA_SEED}"
    assert tokens(12) != a, f"data seed {DATA_SEED}"  # the seed matters: the equality above is not vacuous
    assert tokens(11, "replay") == tokens(11, "replay"), f"data seed {DATA_SEED}"


# ---------------------------------------------------------------------------------------------------------
# jit vs no-jit on a short stream of the tiny model's step (chunks of 3 and single tokens, with evictions).

POLICY = P.rsqr(5, 1, 2, 2, block=2)
SPEC = CacheSpec.for_policies(POLICY, num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                              head_dim=CFG.head_dim, max_chunk=3)
SCHEDULE = [3, 3, 1, 2]  # tokens per step (2 = a chunk of 3 with one padded slot); W + b = 7: evicts


def _stream(step_fn, tokens):
    _, params = model()
    cache, out, i = init_cache(SPEC), [], 0
    for n in SCHEDULE:
        c = 1 if n == 1 else 3
        chunk = np.zeros((1, c), np.int32)
        chunk[0, :n] = tokens[i:i + n]
        logits, cache = step_fn(params, jnp.asarray(chunk), cache, POLICY, jnp.int32(n))
        out.append(np.asarray(logits[0, :n], np.float64))
        i += n
    return np.concatenate(out), cache


def _step(params, tokens, cache, policy, n_valid):
    apply_fn, _ = model()
    return step(apply_fn, params, tokens, cache, policy, n_valid)


def test_jit_and_eager_agree():
    # jax.disable_jit: the whole step (its lax.scan over layers, every lax.cond of the policies) runs
    # eagerly as Python, op by op; the jitted step is one XLA program. Float results agree to rounding,
    # integer bookkeeping exactly.
    tokens = _prompt(sum(SCHEDULE))
    ref, ref_cache = _stream(jax.jit(_step), tokens)
    with jax.disable_jit():
        got, cache = _stream(_step, tokens)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, err_msg=f"data seed {DATA_SEED}")
    for name in ("win_pos", "surv_pos", "surv_rank", "t"):
        np.testing.assert_array_equal(np.asarray(getattr(cache, name)), np.asarray(getattr(ref_cache, name)),
                                      err_msg=f"{name}, data seed {DATA_SEED}")
    try:
        chex.assert_trees_all_close(jax.tree.map(np.asarray, cache), jax.tree.map(np.asarray, ref_cache),
                                    rtol=1e-5, atol=1e-5)
    except AssertionError as e:
        raise AssertionError(f"data seed {DATA_SEED}: {e}") from None
    assert int(cache.t) == sum(SCHEDULE) > 5 + 2 - 1  # the window evicted


# ---------------------------------------------------------------------------------------------------------
# A policy inside a vmapped sweep == the same policy alone (same spec, chunked prefill with padding).

SWEEP = [P.rsqr(6, 2, 2, 2, block=2), P.rerotate(6, 2, 2, 2, block=2), P.replay(6, 2, 2, 2, block=2),
         P.leave_gaps(6, 2, 2, 2, block=2), P.streamingllm(6, 2)]


@pytest.mark.xla_optimized  # two programs, the same bits: at the optimizations users run
def test_vmapped_policy_equals_the_policy_alone():
    apply_fn, params = model()
    tokens = np.random.default_rng(DATA_SEED).integers(0, CFG.vocab_size, size=(2, 30))
    spec = CacheSpec.for_policies(SWEEP, num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                                  head_dim=CFG.head_dim, batch=2, max_chunk=2)
    kw = dict(chunk=2, segment=8)  # 29 scored tokens: the last segment is padded, its last chunk half real
    batched, _ = stream_nll(apply_fn, params, tokens, P.stack_policies(SWEEP), spec, vmap_policies=True, **kw)
    assert batched.shape == (len(SWEEP), 2, 29)
    for i, pol in enumerate(SWEEP):
        alone, _ = stream_nll(apply_fn, params, tokens, pol, spec, **kw)
        np.testing.assert_allclose(batched[i], alone, rtol=1e-5, atol=1e-5,
                                   err_msg=f"{pol.name}, data seed {DATA_SEED}")
    # The policies really differ (so agreement is not a property of the tokens alone).
    assert np.abs(batched[0] - batched[3]).max() > 1e-3, f"data seed {DATA_SEED}"  # rsqr vs leave_gaps
