"""Next-token selection inside jit: greedy (temperature 0), temperature, nucleus (top-p)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(logits_BxV: jax.Array, rng: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """int32 [B]. temperature <= 0 means greedy; top_p in (0, 1] keeps the smallest nucleus >= top_p."""
    logits = logits_BxV.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    sorted_desc = jnp.sort(scaled, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep = cum_before < top_p  # always keeps the top token
    threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    drawn = jax.random.categorical(rng, masked, axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)
