"""Exact positions at any length: RoPE angles at any int32 position, and streams that start at a huge
global position (init_cache(spec, start=s)) give the same logits as streams that start at 0."""

from __future__ import annotations

import functools
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rsqr_jax.kernels.exact_rope as kernel_rope
from rsqr_jax.models.llama import Llama, split_apply
from rsqr_jax import policy as P
from rsqr_jax.cache import cached_positions, init_cache
from rsqr_jax.policy import window_start
from rsqr_jax.spec import CacheSpec
from rsqr_jax.rope import RopeScaling, inverse_frequencies, rope_angles
from rsqr_jax.engine import step
from rsqr_jax.models.tiny import tiny_config, tiny_weights

I32_MAX = 2**31 - 1
# pi to 60 digits, typed here independently of the library's constant.
PI = Fraction("3.14159265358979323846264338327950288419716939937510582097494")
TWO_PI = 2 * PI

FREQS = {
    "smollm2": inverse_frequencies(64, 1e5),  # the real model: head_dim 64, theta 1e5
    "llama3": inverse_frequencies(128, 5e5, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)),
}


def exact_angles(pos: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """float64 [N, F]: pos * inv_freq (the float32 frequency taken exactly) reduced into [-pi, pi) in rationals."""
    out = np.empty((pos.size, inv_freq.size))
    fr = [Fraction(float(f)) for f in inv_freq]
    for i, p in enumerate(pos.tolist()):
        for j, f in enumerate(fr):
            a = p * f
            a -= TWO_PI * round(a / TWO_PI)
            out[i, j] = float(a)
    return out


def wrapped_err(got, ref) -> np.ndarray:
    d = np.asarray(got, np.float64) - ref
    return np.abs((d + np.pi) % (2 * np.pi) - np.pi)


DATA_SEED = 2024  # the random positions' and tokens' seed: every failure message names it


def _positions() -> np.ndarray:
    """Edge cases and random positions over the whole int32 range, each also negated."""
    rng = np.random.default_rng(DATA_SEED)
    edges = [1, 2, 4095, 2**24 + 1, 2**30, 2**30 + 12345, 2**31 - 2, I32_MAX]
    pos = np.concatenate([edges, rng.integers(2**24, I32_MAX, size=48, endpoint=True),
                          rng.integers(1, 2**16, size=8)]).astype(np.int64)
    return np.concatenate([[0], pos, -pos])  # negative positions: the re-rotation hops


POS = _positions()


@pytest.mark.parametrize("name", sorted(FREQS))
def test_exact_angles_at_every_int32_position(name):
    inv_freq = FREQS[name]
    ref = exact_angles(POS, inv_freq)
    got = np.asarray(rope_angles(jnp.asarray(POS, jnp.int32), inv_freq))
    err = wrapped_err(got, ref)
    assert err.max() < 1e-6, (err.max(), POS[np.argmax(err.max(1))], f"data seed {DATA_SEED}")
    # The same under jit with traced positions (how the model calls it: inv_freq is a numpy constant).
    jitted = np.asarray(jax.jit(lambda p: rope_angles(p, inv_freq))(jnp.asarray(POS, jnp.int32)))
    np.testing.assert_array_equal(jitted, got, err_msg=f"data seed {DATA_SEED}")
    # R_{-p} is exactly the inverse rotation of R_p.
    n = (POS.size - 1) // 2
    np.testing.assert_array_equal(got[1 + n:], -got[1:1 + n], err_msg=f"data seed {DATA_SEED}")


@pytest.mark.parametrize("name", sorted(FREQS))
def test_naive_float32_angles_fail_the_bound(name):
    # What this file guards against: pos * inv_freq formed in float32 errs by ~pos * 2^-24 rad.
    inv_freq = FREQS[name]
    ref = exact_angles(POS, inv_freq)
    naive = np.asarray(jnp.asarray(POS, jnp.int32).astype(jnp.float32)[:, None] * jnp.asarray(inv_freq))
    err = wrapped_err(naive, ref)
    assert err.max() > 1.0, f"data seed {DATA_SEED}"  # not even close at 2^31
    big = np.abs(POS) >= 2**24
    # fails the 1e-6 bound at nearly every position >= 2^24 (a few, like 2^30, are exact in float32)
    assert (err[big].max(axis=1) > 1e-6).mean() > 0.9, f"data seed {DATA_SEED}"


# ---------------------------------------------------------------------------------------------------------
# Translation invariance on the tiny random model.

CFG = tiny_config()
T = 41  # streamed in chunks of 3: the last chunk has 2 real tokens and one padded slot
CHUNK = 3
POLICIES = [
    P.full(), P.window(7, block=2), P.leave_gaps(7, 2, 3, 3, block=2), P.rsqr(7, 2, 3, 3, block=2),
    P.rsqr_precompute(7, 2, 3, 2, block=1, overflow="decimate"), P.streamingllm(7, 2, block=2),
    P.rerotate(7, 2, 3, 3, block=2), P.replay(7, 2, 3, 3, block=2),
]
SPEC = CacheSpec.for_policies(POLICIES, num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                              head_dim=CFG.head_dim, max_chunk=CHUNK, max_len=T)
STACKED = P.stack_policies(POLICIES)
N_CHUNKS = -(-T // CHUNK)


@functools.lru_cache(maxsize=None)
def _model():
    return split_apply(Llama(CFG, tiny_weights(CFG, 0), dtype=jnp.float32))


def _runner():
    """jit(vmap over policies) of a scan of chunk steps; the start position is data (no recompilation)."""
    apply_fn, _ = _model()

    def one(params, policy, cache, tokens_KxBxC, n_valid_K):
        def body(cache, xs):
            tok, nv = xs
            logits, cache = step(apply_fn, params, tok, cache, policy, nv)
            return cache, logits

        return jax.lax.scan(body, cache, (tokens_KxBxC, n_valid_K))

    return jax.jit(jax.vmap(one, in_axes=(None, 0, 0, None, None)))


_RUN = functools.lru_cache(maxsize=None)(_runner)


def stream_from(start: int, tokens: np.ndarray, run=None):
    """Logits [P, T, V] of every policy of POLICIES streaming `tokens` from global position `start`."""
    _, params = _model()
    pad = N_CHUNKS * CHUNK - T
    tok = np.concatenate([tokens, np.zeros(pad, np.int32)]).reshape(N_CHUNKS, 1, CHUNK)
    n_valid = np.minimum(CHUNK, T - CHUNK * np.arange(N_CHUNKS)).astype(np.int32)
    cache = jax.tree.map(lambda x: jnp.broadcast_to(x, (len(POLICIES),) + x.shape), init_cache(SPEC, start=start))
    cache, logits = (run or _RUN())(params, STACKED, cache, jnp.asarray(tok), jnp.asarray(n_valid))
    logits = np.asarray(logits, np.float64)  # [P, K, 1, C, V]
    return logits.reshape(len(POLICIES), N_CHUNKS * CHUNK, -1)[:, :T], cache


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@functools.lru_cache(maxsize=None)
def _tokens():
    return np.random.default_rng(DATA_SEED).integers(0, CFG.vocab_size, size=T).astype(np.int32)


@functools.lru_cache(maxsize=None)
def _from_zero():
    return stream_from(0, _tokens())


@pytest.mark.parametrize("start", [2**30, I32_MAX - T])  # the second one ends exactly at t = 2^31 - 1
def test_every_policy_is_translation_invariant(start):
    tokens = _tokens()
    ref, cache0 = _from_zero()
    got, cache = stream_from(start, tokens)
    assert np.isfinite(got).all()
    for i, pol in enumerate(POLICIES):
        assert rel_err(got[i], ref[i]) < 1e-5, f"{pol.name}, data seed {DATA_SEED}"
        # Same token set, shifted by start (sinks/flags/window are stream-relative).
        one = lambda c: jax.tree.map(lambda x: x[i], c)  # noqa: E731
        assert int(one(cache).t) == start + T
        if P.MODES[int(pol.mode)] != "full":
            np.testing.assert_array_equal(cached_positions(one(cache), pol) - start,
                                          cached_positions(one(cache0), pol),
                                          err_msg=f"{pol.name}, data seed {DATA_SEED}")
    # Evictions really happened (otherwise most policies would trivially agree with full).
    assert all(rel_err(ref[i], ref[0]) > 1e-3 for i in range(1, len(POLICIES))), f"data seed {DATA_SEED}"


def test_translation_invariance_would_catch_naive_float32_angles(monkeypatch):
    # Guard against a vacuous pass: with angles formed as pos * inv_freq in float32, a stream at 2^30
    # differs grossly from the same stream at 0 (for the global-timeline policies).
    def naive(pos, inv_freq):
        return jnp.asarray(pos, jnp.int32).astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)

    monkeypatch.setattr(kernel_rope, "rope_angles", naive)
    run = _runner()  # a fresh jit: traced with the naive angles
    tokens = _tokens()
    ref, _ = stream_from(0, tokens, run)
    got, _ = stream_from(2**30, tokens, run)
    for i in (0, 2, 3):  # full, leave_gaps, rsqr
        assert rel_err(got[i], ref[i]) > 1e-2, f"{POLICIES[i].name}, data seed {DATA_SEED}"


def test_start_is_checked_and_window_arithmetic_cannot_overflow():
    for bad in (-1, I32_MAX, 2**40, 1.5, True):
        with pytest.raises(ValueError, match="start must be"):
            init_cache(SPEC, start=bad)
    # window_start near the top of int32 with the largest window and block a policy allows.
    n = jnp.int32(I32_MAX)
    w, b = jnp.int32(P.UNBOUNDED - 1), jnp.int32(P.UNBOUNDED - 1)
    assert int(window_start(n, w, b, jnp.int32(I32_MAX - 5))) == I32_MAX - 5  # all 5 tokens still in the window
    # 10 tokens, W=4, b=3: the window grew to 6, dropped 3 at the 7th token, grew to 6 again, dropped 3 at the 10th.
    assert int(window_start(n, jnp.int32(4), jnp.int32(3), jnp.int32(I32_MAX - 10))) == I32_MAX - 4
    with pytest.raises(P.PolicyError, match="block must be at most"):
        P.make_policy("rsqr", block=2**31)
