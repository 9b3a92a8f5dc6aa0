"""The kernel contract's model constants for the newer families (docs/design.md §6 and §3d): attention-logit
soft-capping (Gemma 2), a non-default scale (Gemma's query_pre_attn_scalar) and a local layer's sliding window,
in every implementation (reference, XLA, Pallas interpreted on CPU) against the float64 oracle."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from rsqr_jax.attention import attend
from rsqr_lab.testing.kernel import args_of, kernel_inputs, oracle_f64, rel_err

KERNELS = ["reference", "xla", "pallas"]


def _inputs(seed, *, C=5, W=40, S=6, q_gain=4.0):
    """Contract inputs with queries scaled by q_gain so scores reach well past the cap below."""
    inp, inv = kernel_inputs(seed, B=2, C=C, Hq=4, Hkv=2, D=32, W=W, S=S, dtype=jnp.float32)
    inp["q"] = inp["q"] * q_gain
    return inp, inv


@pytest.mark.parametrize("kernel", KERNELS)
def test_softcap_and_scale_match_oracle(kernel):
    seed = 101
    print("seed", seed)
    inp, inv = _inputs(seed)
    scale, cap = 24.0 ** -0.5, 5.0
    s = np.einsum("bchd,bkwd->bhcw", np.asarray(inp["q"]), np.asarray(inp["win_k"])[:, [0, 0, 1, 1]][:, :2]) * scale
    assert np.abs(s).max() > 2 * cap  # the cap bites on these inputs
    got = np.asarray(attend(*args_of(inp), inv, kernel, scale=scale, logit_cap=cap))
    want = oracle_f64(*args_of(inp), inv, scale=scale, logit_cap=cap)
    assert rel_err(got, want) < 1e-4
    # and the cap matters: without it the output is far from the capped oracle
    uncapped = np.asarray(attend(*args_of(inp), inv, kernel, scale=scale))
    assert rel_err(uncapped, want) > 1e-2


@pytest.mark.parametrize("kernel", KERNELS)
def test_sliding_window_matches_oracle(kernel):
    """A chunk of C queries over a window segment longer than the sliding window: each query sees only its
    last `sliding` positions (itself included); the survivor segment is untouched by it."""
    seed = 202
    print("seed", seed)
    inp, inv = _inputs(seed, C=7, W=40, S=0, q_gain=1.0)
    sliding = 9
    got = np.asarray(attend(*args_of(inp), inv, kernel, sliding_window=sliding, logit_cap=3.0))
    want = oracle_f64(*args_of(inp), inv, sliding_window=sliding, logit_cap=3.0)
    assert rel_err(got, want) < 1e-4
    full = oracle_f64(*args_of(inp), inv, logit_cap=3.0)
    assert rel_err(full, want) > 1e-2  # the window changes the result


def test_sliding_window_sees_exactly_its_window():
    """One query, values one-hot by position: the output weights are nonzero exactly on the last `sliding`
    positions."""
    inp, inv = _inputs(303, C=1, W=16, S=0, q_gain=0.0)  # zero query: uniform weights over what it sees
    pos = np.asarray(inp["win_pos"])
    W = pos.shape[1]
    v = np.zeros((2, 2, W, 32), np.float32)
    for b in range(2):
        for w in range(W):
            v[b, :, w, w] = 1.0
    inp["win_v"] = jnp.asarray(v)
    t = int(np.asarray(inp["q_pos_win"])[0, 0])
    out = np.asarray(attend(*args_of(inp), inv, "xla", sliding_window=5))[:, 0, 0, :W]
    for b in range(2):
        seen = {int(pos[b, w]) for w in np.flatnonzero(out[b] > 0)}
        assert seen == set(range(t - 4, t + 1)), (b, sorted(seen))
        np.testing.assert_allclose(out[b][out[b] > 0], 0.2, rtol=1e-6)
