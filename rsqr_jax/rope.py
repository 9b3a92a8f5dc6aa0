"""RoPE for the model side: inverse frequencies from a config (default, linear, llama3) and rotation.

Angles come from rsqr_jax.kernels.exact_rope, which reduces them exactly in integer arithmetic, so window
keys rotated at huge global positions stay exact in endless streams.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from rsqr_jax.kernels.exact_rope import rope_angles, rope_cos_sin, rotate_half_split

__all__ = ["RopeScaling", "inverse_frequencies", "rope_angles", "rope_cos_sin", "rotate_half_split", "apply_rope"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """HF `rope_scaling` of the kinds we support: "linear" (factor) and "llama3"."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, d: dict | None) -> "RopeScaling | None":
        if not d:
            return None
        kind = d.get("rope_type", d.get("type", "default"))
        if kind == "default":
            return None
        if kind not in ("linear", "llama3"):
            raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")
        return cls(
            rope_type=kind,
            factor=float(d.get("factor", 1.0)),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)),
        )


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """float32 [head_dim/2], computed like HF transformers (float32 base powers, then scaling)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    # HF: `base ** exponents` in float32 with torch's (nearly correctly rounded) powf. numpy's float32 power is
    # off by up to ~1 ulp, so take the power in float64 and round once: this matches torch bit for bit on all
    # but a handful of entries (where torch itself is not correctly rounded).
    powers = (np.float64(theta) ** exponents.astype(np.float64)).astype(np.float32)
    inv = (np.float32(1.0) / powers).astype(np.float32)
    if scaling is None:
        return inv
    if scaling.rope_type == "linear":
        return (inv / np.float32(scaling.factor)).astype(np.float32)
    # llama3: keep high frequencies, divide low ones by factor, interpolate in between.
    old_ctx = scaling.original_max_position_embeddings
    low_wavelen = old_ctx / scaling.low_freq_factor
    high_wavelen = old_ctx / scaling.high_freq_factor
    # torch evaluates `2 * math.pi / inv_freq` as `inv_freq.reciprocal() * (2 * math.pi)` (Tensor.__rtruediv__),
    # which rounds differently from a float32 division; mirror it so the three bands are chosen identically.
    wavelen = (np.float32(1.0) / inv) * np.float32(2 * math.pi)
    out = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * out / scaling.factor + smooth * out
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, out).astype(np.float32)


def apply_rope(x: jax.Array, pos: jax.Array, inv_freq) -> jax.Array:
    """Rotate x [..., H, D] at int32 positions pos [...] (broadcast over heads); float32 result."""
    cos, sin = rope_cos_sin(pos, inv_freq)
    return rotate_half_split(x, cos[..., None, :], sin[..., None, :])
