"""RoPE angles that stay exact at any int32 position, using only 32-bit arithmetic.

`pos * inv_freq` in float32 loses the high-frequency pairs long before 2^31: at position p the angle
carries an absolute error of about p * 2^-24 rad. Here the angle is reduced modulo one turn *exactly*
in integer arithmetic: each inverse frequency is turned, on the host and once, into a 64-bit
fixed-point fraction of a turn `r = frac(inv_freq / 2pi)` (two uint32 words); on the device
`frac(pos * r)` is formed with wrapping uint32 multiplies (32 bits of the turn are kept), and only
that reduced turn in [-1/2, 1/2) is converted to a float32 angle. The error is < 5e-7 rad for every
position 0 <= pos < 2^31, independent of pos.

This lives in rsqr_jax.kernels (the lowest layer) because the fused kernel rotates queries and raw
survivor keys itself; rsqr_jax.rope builds the model-facing API on top of it.
"""

from __future__ import annotations

import functools
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

# 1 / (2 pi) to 100 significant digits (pi to 110 digits, exact rational arithmetic below).
_PI = Fraction(
    "3.14159265358979323846264338327950288419716939937510582097494459230781640628620899862803482534211706798214808651"
)
_INV_TWO_PI = 1 / (2 * _PI)
_TWO_PI_F32 = np.float32(2 * np.pi)


def turn_words(inv_freq) -> np.ndarray:
    """uint32 [2, F]: (hi, lo) words of frac(inv_freq / 2pi) as a 64-bit binary fraction.

    Computed exactly from the float32 value of each inverse frequency (what the model uses).
    """
    freqs = np.asarray(inv_freq, dtype=np.float32).reshape(-1)
    return _turn_words_cached(freqs.tobytes()).copy()


@functools.lru_cache(maxsize=64)
def _turn_words_cached(freq_bytes: bytes) -> np.ndarray:
    freqs = np.frombuffer(freq_bytes, dtype=np.float32)
    words = np.zeros((2, freqs.size), dtype=np.uint32)
    for i, f in enumerate(freqs):
        turns = Fraction(float(f)) * _INV_TWO_PI
        frac = turns - (turns.numerator // turns.denominator)
        fixed = (frac.numerator << 64) // frac.denominator
        words[0, i] = (fixed >> 32) & 0xFFFFFFFF
        words[1, i] = fixed & 0xFFFFFFFF
    return words


def _mulhi_u32(a: jax.Array, b: jax.Array) -> jax.Array:
    """High 32 bits of the 64-bit product of two uint32 arrays, with 16-bit limbs (no uint64 needed)."""
    mask = jnp.uint32(0xFFFF)
    a1, a0 = a >> 16, a & mask
    b1, b0 = b >> 16, b & mask
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & mask) + (p10 & mask)
    return p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)


def angles_from_words(pos: jax.Array, words_hi: jax.Array, words_lo: jax.Array) -> jax.Array:
    """float32 angles in [-pi, pi) of pos[..., None] * inv_freq, reduced exactly (see module doc).

    pos: int32 [...] (any sign: angle(-p) = -angle(p)); words_*: uint32 [F]. Returns float32 [..., F].
    """
    pos = pos.astype(jnp.int32)
    p = jnp.abs(pos).astype(jnp.uint32)[..., None]
    frac_u32 = p * words_hi + _mulhi_u32(p, words_lo)  # wraps mod 2^32 == reduction mod one turn
    turns = lax_bitcast_i32(frac_u32).astype(jnp.float32) * jnp.float32(2.0**-32)
    return jnp.where(pos[..., None] < 0, -turns, turns) * _TWO_PI_F32


def lax_bitcast_i32(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.int32)


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def rope_angles(pos: jax.Array, inv_freq) -> jax.Array:
    """float32 [..., F] RoPE angles of int32 positions.

    Exact (reduced in integer arithmetic) when `inv_freq` is concrete (a numpy array or an
    un-traced jax array, which is how every caller in this project passes it: it is a model
    constant). A traced `inv_freq` falls back to `pos * inv_freq` in float32, which is accurate
    only for small positions.
    """
    if _is_concrete(inv_freq):
        words = turn_words(np.asarray(inv_freq))
        return angles_from_words(jnp.asarray(pos, jnp.int32), jnp.asarray(words[0]), jnp.asarray(words[1]))
    return jnp.asarray(pos, jnp.int32).astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)


def rope_cos_sin(pos: jax.Array, inv_freq) -> tuple[jax.Array, jax.Array]:
    """(cos, sin), each float32 [..., F], of the RoPE angles at `pos`."""
    ang = rope_angles(pos, inv_freq)
    return jnp.cos(ang), jnp.sin(ang)


def rotate_half_split(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Apply R_p to x[..., D] in the half-split ("rotate_half", HF Llama) layout, in float32.

    cos/sin are [..., D/2] and broadcast against x[..., :D/2]. Position 0 (cos=1, sin=0) is the
    exact identity, which lets pre-rotated keys pass through the same code unchanged.
    """
    half = x.shape[-1] // 2
    x = x.astype(jnp.float32)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rope_table(inv_freq, n: int) -> np.ndarray:
    """float32 [n, D] table of RoPE rotations at positions 0..n-1: cos in [:, :D/2], sin in [:, D/2:].

    Angles p * inv_freq are formed and reduced in float64 on the host (error ~1e-16 rad at the positions
    a cache holds, far below float32 rounding), then rounded once to float32. Built for the rotations
    whose positions are bounded by a static capacity (survivor ranks): a gather from it replaces the
    per-key integer reduction and sin/cos. Cached per (inv_freq, n); the result is read-only.
    """
    freqs = np.asarray(inv_freq, dtype=np.float32).reshape(-1)
    return _rope_table_cached(freqs.tobytes(), int(n))


@functools.lru_cache(maxsize=32)
def _rope_table_cached(freq_bytes: bytes, n: int) -> np.ndarray:
    freqs = np.frombuffer(freq_bytes, dtype=np.float32).astype(np.float64)
    ang = np.arange(n, dtype=np.float64)[:, None] * freqs[None, :]
    table = np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)
    table.setflags(write=False)
    return table


def rotate_keys(k_BxHxNxD: jax.Array, pos_N: jax.Array, inv_freq) -> jax.Array:
    """R_pos k for keys [B, H, N, D] at positions pos_N [N] (float32 result): how the cache rotates what it stores."""
    cos, sin = rope_cos_sin(pos_N, inv_freq)  # [N, D/2]
    return rotate_half_split(k_BxHxNxD, cos, sin)
