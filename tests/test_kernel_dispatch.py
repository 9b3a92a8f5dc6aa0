"""Every policy streams through the same two-segment contract: the Pallas kernel (interpret mode on
CPU), the CPU-tuned XLA path and the simple reference give the same logits on a tiny model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rsqr_jax.models.llama import Llama, split_apply
from rsqr_jax import policy as P
from rsqr_jax.cache import init_cache
from rsqr_jax.spec import CacheSpec
from rsqr_jax.engine import step
from rsqr_jax.models.tiny import tiny_config, tiny_weights

CFG = tiny_config(layers=1, head_dim=32)  # the kernel needs D a power of two >= 32
POLICIES = [P.rsqr(6, 2, 2, 3), P.streamingllm(6, 2), P.rerotate(6, 2, 2, 3), P.leave_gaps(6, 2, 2, 3),
            P.rsqr_precompute(6, 2, 2, 3), P.full()]


def _stream(kernel: str, tokens: np.ndarray) -> np.ndarray:
    apply_fn, params = split_apply(Llama(CFG, tiny_weights(CFG, 3)), kernel=kernel)
    spec = CacheSpec.for_policies(POLICIES, num_layers=1, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim,
                                  max_chunk=2, max_len=tokens.size)

    @jax.jit
    def run(params, policy):
        def body(cache, tok):
            logits, cache = step(apply_fn, params, tok, cache, policy)
            return cache, logits

        return jax.lax.scan(body, init_cache(spec), jnp.asarray(tokens.reshape(-1, 1, 2)))[1]

    return np.stack([np.asarray(run(params, pol)) for pol in POLICIES])


@pytest.mark.parametrize("kernel", ["pallas", "xla"])
def test_kernel_paths_agree_with_the_reference_for_every_policy(kernel):
    tokens = np.random.default_rng(7).integers(0, CFG.vocab_size, size=24)
    ref = _stream("reference", tokens)
    got = _stream(kernel, tokens)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-4 * np.abs(ref).max())
