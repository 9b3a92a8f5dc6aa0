"""A CPU kernel for decode's projections on a GGUF's blocks (block_matvec.cc), built on first use.

At batch 1 a decode step reads every weight once. XLA:CPU dequantizes a blocked int8 matrix into float32 before
its dot (writing and reading four bytes per weight), and its integer dot is no fast path, so on XLA alone the
GGUF's blocks save memory but little decode time over float32 weights. This kernel reads each code once and keeps
everything else in registers, as llama.cpp does, but in float32 on float32 activations: the same weights'
products summed in another order (not llama.cpp's int8 activations).

The C++ source ships with the package and is compiled on first use, for this machine, into the package's cache
(rsqr_jax.kernels.cpu_ffi), then registered with XLA as an FFI target. Where it cannot be built (no
compiler, not a CPU backend) `available()` says why and the caller stays on XLA's dequantize-then-dot;
RSQR_CPU_KERNEL=0 turns it off.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rsqr_jax.kernels import cpu_ffi

NAME = "block_matvec"  # its key in cpu_ffi.KERNELS
TARGET = "rsqr_block_matvec"
SOURCE = Path(__file__).with_name("block_matvec.cc")
GROUP = 8  # output columns per tile of the codes' layout ([L, K/32, N/8, 32, 8])
ROWS_MAX = 8  # rows x of a call that go through the kernel (decode); more (prefill) stay on XLA's dot


def _compiler() -> str | None:
    return cpu_ffi.compiler()


def _build(cxx: str) -> Path:
    """This kernel's shared library for this source, jaxlib and compiler (cpu_ffi.build)."""
    return cpu_ffi.build(SOURCE, cxx)


STALE_DAYS = cpu_ffi.STALE_DAYS


@functools.lru_cache(maxsize=1)
def _load() -> str | None:
    """None when the kernel is registered, else why not (one line)."""
    return cpu_ffi.load(SOURCE, "BlockMatvec", TARGET)


def available() -> bool:
    """Whether the kernel is built and registered (building it on the first call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    """Why the kernel is not available (None when it is)."""
    return _load()


def usable() -> bool:
    """available(), for a caller about to use the kernel: where it cannot be built, a warning once per process
    (cpu_ffi.warn_off) says why and what falling back costs."""
    reason = _load()
    if reason is not None:
        cpu_ffi.warn_off(NAME, reason)
    return reason is None


def tile_codes(codes: np.ndarray) -> np.ndarray:
    """Codes [..., K/32, 32, N] (blocks along the input axis) in the kernel's layout [..., K/32, N/8, 32, 8]."""
    *lead, nb, blk, n = codes.shape
    if n % GROUP:
        raise ValueError(f"block_matvec needs output columns in multiples of {GROUP}, got {n}")
    return np.ascontiguousarray(np.swapaxes(codes.reshape(*lead, nb, blk, n // GROUP, GROUP), -3, -2))


def untile_codes(codes: jax.Array) -> jax.Array:
    """tile_codes undone, inside a jitted step: [..., K/32, N/8, 32, 8] -> [..., K/32, 32, N]."""
    *lead, nb, g, blk, e = codes.shape
    return jnp.swapaxes(codes, -3, -2).reshape(*lead, nb, blk, g * e)


@jax.custom_batching.custom_vmap
def _call(x, codes, scale, offset, layer):
    has_offset = offset is not None
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (codes.shape[2] * GROUP,), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x, codes, scale, offset if has_offset else scale, layer,
                                         has_offset=has_offset)


@_call.def_vmap
def _call_vmap(axis_size, in_batched, x, codes, scale, offset, layer):
    """Only x batched (a vmap over policies or streams): its batch is more rows of the same call, as long as they
    are a decode step's few (ROWS_MAX); more rows take XLA's dequantize-then-dot (the kernel re-reads the codes for
    every row). Anything else batched: one call per element."""
    x_batched, *rest = in_batched
    if not any(jax.tree.leaves(rest)):
        if x.size // x.shape[-1] <= ROWS_MAX:
            return _call(x, codes, scale, offset, layer), True
        return xla_matvec(x, codes, scale, offset, layer), True
    args = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape) if a is not None else None
            for a, b in zip((x, codes, scale, offset, layer), (x_batched, *rest))]
    return jax.lax.map(lambda a: _call(*a), tuple(args)), True


def dequantize(codes: jax.Array, scale: jax.Array, offset: jax.Array | None) -> jax.Array:
    """A tiled matrix (stack) as float32 [..., K, N], inside a jitted step: codes * scale (+ offset), the float32
    path's values bit for bit (rsqr_jax.models.blocks)."""
    w = untile_codes(codes).astype(jnp.float32) * scale
    if offset is not None:
        w = w + offset
    return w.reshape(w.shape[:-3] + (w.shape[-3] * w.shape[-2], w.shape[-1]))


def tiled_dot(x: jax.Array, codes: jax.Array, scale: jax.Array, offset: jax.Array | None, dtype=jnp.float32) -> jax.Array:
    """x [..., K] @ one tiled matrix (codes [K/32, N/8, 32, 8], scale and offset [K/32, 1, N]) by XLA's dot: float32
    [..., N]. The matrix is dequantized in its tiles (float32 arithmetic, cast to `dtype` last) and contracted there,
    over (block, row in block): the values and the result of `dequantize` then a dot, bit for bit on XLA:CPU, without
    a transpose back to rows (which would make a prompt's projections slower than on the blocks layout)."""
    kb, ng, blk, e = codes.shape
    tile = lambda a: a.reshape(kb, 1, ng, e).swapaxes(1, 2)  # noqa: E731  [K/32, 1, N] -> [K/32, N/8, 1, 8]
    w = codes.astype(jnp.float32) * tile(scale)
    if offset is not None:
        w = w + tile(offset)
    y = jnp.einsum("...bi,bgie->...ge", x.reshape(x.shape[:-1] + (kb, blk)), w.astype(dtype),
                   precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.reshape(x.shape[:-1] + (ng * e,))


def xla_matvec(x, codes, scale, offset, layer) -> jax.Array:
    """What block_matvec computes, by XLA: matrix `layer` of the stack through `tiled_dot` (float32 [..., N])."""
    pick = lambda a: None if a is None else jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)  # noqa: E731
    return tiled_dot(x.astype(jnp.float32), pick(codes), pick(scale), pick(offset))


def block_matvec(x: jax.Array, codes: jax.Array, scale: jax.Array, offset: jax.Array | None,
                 layer: jax.Array) -> jax.Array:
    """x [..., K] @ the dequantized matrix `layer` of a stack: float32 [..., N]. codes int8 [L, K/32, N/8, 32, 8]
    (tile_codes), scale and offset float32 [L, K/32, 1, N] (offset None: Q4_0 / Q8_0), layer an int32 scalar.
    Builds the kernel on the first call; RuntimeError (its reason) where it cannot (check `available()`)."""
    if (reason := _load()) is not None:
        raise RuntimeError(f"block_matvec: {reason}")
    return _call(x.astype(jnp.float32), codes, scale, offset, jnp.asarray(layer, jnp.int32))
