"""Next-token selection inside jit: greedy (temperature 0), temperature, nucleus (top-p)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(logits_BxV: jax.Array, rng: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """int32 [B]. temperature <= 0 means greedy; top_p in (0, 1] keeps the smallest nucleus >= top_p.

    The sampling branch (a full sort of the vocabulary, ~20 ms for 49k logits on a CPU core) runs only
    when temperature > 0: greedy decoding pays for an argmax alone (lax.cond, not a select).
    """
    logits = logits_BxV.astype(jnp.float32)

    def greedy(_):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def drawn(_):
        scaled = logits / jnp.maximum(temperature, 1e-6)
        sorted_desc = jnp.sort(scaled, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        cum_before = jnp.cumsum(probs, axis=-1) - probs
        keep = cum_before < top_p  # always keeps the top token
        threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)
        return jax.random.categorical(rng, masked, axis=-1).astype(jnp.int32)

    return jax.lax.cond(jnp.asarray(temperature) > 0, drawn, greedy, None)
