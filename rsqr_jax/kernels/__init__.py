"""Fused attention kernels for RSQR and their pure-jnp references (lowest layer: imports nothing of ours but
rsqr_jax.host, which imports nothing)."""

from rsqr_jax.kernels.exact_rope import rope_angles, rope_cos_sin, rope_table, rotate_half_split, turn_words
from rsqr_jax.kernels.survivor_attention import (
    MASK_VALUE,
    survivor_attention,
    survivor_attention_reference,
    survivor_attention_xla,
)

__all__ = [
    "rope_angles",
    "rope_cos_sin",
    "rope_table",
    "rotate_half_split",
    "turn_words",
    "MASK_VALUE",
    "survivor_attention",
    "survivor_attention_reference",
    "survivor_attention_xla",
]
