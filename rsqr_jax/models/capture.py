"""Capture the raw (un-rotated) per-layer queries and keys of the Llama decoder over a token sequence.

Experiments that study RoPE numerics need q/k as the model computes them: the decoder returns them from
its layer scan when asked (`capture_qk=True`), so nothing re-implements the forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flax import nnx

from rsqr_jax.models.llama import Llama, layer_keys
from rsqr_jax import policy as P
from rsqr_jax.cache import init_cache
from rsqr_jax.spec import CacheSpec
from rsqr_jax.update import plan_step


def weights_of(model: Llama) -> dict[str, np.ndarray]:
    """The module's weights as a float32 numpy dict in the canonical layout (for float64 oracles)."""
    cfg = model.config
    names = ["embed", "final_norm", *layer_keys(cfg)] + ([] if cfg.tie_word_embeddings else ["lm_head"])
    return {n: np.asarray(model.weight(n), np.float32) for n in names}


def capture_qk(model: Llama, tokens_T, *, kernel: str = "xla"):
    """Full causal forward at positions 0..T-1: raw q [L, T, Hq, D], raw k [L, T, Hkv, D], logits [T, V]
    (numpy float32), from the decoder itself (`Llama.__call__(..., capture_qk=True)`)."""
    cfg = model.config
    tokens_1xT = jnp.asarray(np.asarray(tokens_T), jnp.int32)[None]
    T = tokens_1xT.shape[1]
    pol = P.full()
    spec = CacheSpec.for_policies(pol, dims=cfg, batch=1, dtype=str(model.dtype), max_chunk=T, max_len=T)
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(params, tokens_1xT):
        cache = init_cache(spec)
        logits, _, (q, k) = nnx.merge(graphdef, params)(tokens_1xT, cache, plan_step(cache, pol, T), kernel=kernel,
                                                         capture_qk=True)
        return q[:, 0], k[:, 0], logits[0]

    q, k, logits = run(params, tokens_1xT)
    return np.asarray(q, np.float32), np.asarray(k, np.float32), np.asarray(logits)
