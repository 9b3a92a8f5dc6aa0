"""Weights as a GGUF file stores them: int8 codes in blocks of 32, a scale (and for Q4_1 an offset) per block.

Decode at batch 1 on a CPU reads every weight once per token, so its speed is set by the bytes of weights read.
A Q4_0 / Q4_1 / Q8_0 tensor holds, per block of 32 values along its input axis, 32 small integer codes and
a float16 scale d (and a float16 minimum m for Q4_1): value = d * code (+ m). Kept as int8 codes with float32
scales, a matrix takes a quarter of the bytes of its float32 form, and the decoder dequantizes it inside the
jitted step (`BlockWeights.dense`), where XLA:CPU keeps each layer's dequantized matrix in cache instead of
reading it from memory.

Exact: d * code is exact in float32 (an 11-bit mantissa times an integer of at most 8 bits), so d * code + m
rounds once, as gguf-py's float32 dequantization does: `dense()` is the float32 weight bit for bit, and the
model's logits are those of the float32 path bit for bit (tests/test_blocks.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
# GGUF tensor types held exactly as int8 codes: name -> (bytes per block, has an offset)
BLOCK_TYPES = {"Q4_0": (2 + BLOCK // 2, False), "Q4_1": (4 + BLOCK // 2, True), "Q8_0": (2 + BLOCK, False)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockWeights:
    """One weight (or a layer stack of them) in blocks of 32 along its axis `block_axis` (static: -2 for a
    canonical `x @ W` matrix [..., in, out], blocks along `in`; -1 for the embedding [V, H], blocks along H).

    Held with that axis split in two, (n / 32, 32), the layout XLA:CPU dequantizes fastest inside a step:
    codes: int8 [..., n / 32, 32, ...]; scale: float32 [..., n / 32, 1, ...]; offset: float32 like scale (Q4_1's
    minimum), or None (Q4_0, Q8_0). tiled (static): codes in the CPU kernel's layout [..., in / 32, out / 8, 32, 8],
    scale and offset [..., in / 32, 1, out] (rsqr_jax.kernels.block_matvec), which `matmul` and `logits` send decode
    rows through; an embedding [V, H] tiled is held as its transpose [H, V] (`to_tiled`)."""

    codes: jax.Array
    scale: jax.Array
    offset: jax.Array | None
    block_axis: int = dataclasses.field(default=-2, metadata=dict(static=True))
    tiled: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @classmethod
    def from_blocks(cls, codes: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, block_axis: int):
        """From codes of the weight's shape and scale / offset with one entry per block along block_axis."""
        ax = block_axis % codes.ndim
        split = lambda a, n: a.reshape(a.shape[:ax] + (a.shape[ax] // n, n) + a.shape[ax + 1:])  # noqa: E731
        return cls(split(codes, BLOCK), split(scale, 1), None if offset is None else split(offset, 1), block_axis)

    def to_tiled(self) -> "BlockWeights":
        """This weight with its codes in the CPU kernel's layout (host arrays; the values unchanged): a matrix
        (stack) [..., in, out] as it is; an output matrix [V, H] held row-wise (block_axis -1, the tied embedding)
        as its transpose [H, V], so that h @ w.T is the kernel's x @ W."""
        from rsqr_jax.kernels.block_matvec import tile_codes

        if self.tiled:
            raise ValueError("to_tiled(): already tiled")
        if self.block_axis == -2:
            return BlockWeights(tile_codes(np.asarray(self.codes)), self.scale, self.offset, -2, tiled=True)
        if self.codes.ndim != 3:
            raise ValueError("to_tiled() takes one row-wise output matrix [V, H / 32, 32], not a stack")
        t = lambda a: None if a is None else np.ascontiguousarray(np.asarray(a).transpose(1, 2, 0))  # noqa: E731
        return BlockWeights(tile_codes(t(self.codes)), t(self.scale), t(self.offset), -1, tiled=True)

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape (the block axis whole)."""
        c = self.codes.shape
        if self.tiled:
            in_out = (c[-4] * c[-2], c[-3] * c[-1])
            return c[:-4] + (in_out if self.block_axis == -2 else in_out[::-1])
        ax = self.block_axis % (len(c) - 1)
        return c[:ax] + (c[ax] * c[ax + 1],) + c[ax + 2:]

    def dense(self, dtype=jnp.float32) -> jax.Array:
        """The weight as `dtype` (float32 arithmetic, cast last: the float32 path's values bit for bit)."""
        if self.tiled:
            from rsqr_jax.kernels.block_matvec import dequantize

            w = dequantize(self.codes, self.scale, self.offset)  # [..., in, out]
            return (w.T if self.block_axis == -1 else w).astype(dtype)  # -1: held as its transpose
        w = self.codes.astype(jnp.float32) * self.scale
        if self.offset is not None:
            w = w + self.offset
        return w.reshape(self.shape).astype(dtype)

    def rows(self, index, dtype=jnp.float32) -> jax.Array:
        """Rows `index` of a weight blocked along its last axis (the embedding), dequantized: [*index.shape, H]."""
        if self.block_axis != -1:
            raise ValueError("rows() needs a weight blocked along its last axis (the embedding)")
        if self.tiled:  # row v of [V, H] is column v of the tiled transpose: codes [H/32, V/8, 32, 8]
            idx = jnp.asarray(index)
            pick = lambda a: None if a is None else jnp.moveaxis(a[:, 0, idx], 0, -1)[..., None]  # noqa: E731
            codes = self.codes[:, idx // 8, :, idx % 8]  # [*index, H/32, 32]
            w = codes.astype(jnp.float32) * pick(self.scale)
            if self.offset is not None:
                w = w + pick(self.offset)
            return w.reshape(idx.shape + (-1,)).astype(dtype)
        take = lambda a: None if a is None else jnp.take(a, index, axis=0)  # noqa: E731
        return BlockWeights(take(self.codes), take(self.scale), take(self.offset), -1).dense(dtype)


def _kernel_rows(x: jax.Array) -> bool:
    """Whether x's rows go through the CPU kernel: a decode step's few rows, the kernel built."""
    from rsqr_jax.kernels import block_matvec as BM

    return int(np.prod(x.shape[:-1])) <= BM.ROWS_MAX and BM.available()


def logits(h: jax.Array, w, dtype) -> jax.Array:
    """float32 h @ w.T for an output matrix w [V, H] held row-wise (the tied embedding): h [..., H] -> [..., V].

    A BlockWeights is dequantized a chunk of rows at a time under a loop: XLA:CPU would otherwise write the
    whole [V, H] float32 matrix to memory at every step before reading it back (four times the bytes of its
    codes). Chunks of rows do not change a logit: each is the same H-long dot. Held tiled (BlockWeights.to_tiled),
    a decode step's rows go through the CPU kernel instead."""
    from rsqr_jax.kernels import block_matvec as BM

    dot = lambda a, b: jax.lax.dot_general(a, b, (((a.ndim - 1,), (1,)), ((), ())),  # noqa: E731
                                           precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    if not isinstance(w, BlockWeights):
        return dot(h, w)
    if w.tiled and _kernel_rows(h):  # held as its transpose: h @ w.T is h @ the held [H, V] matrix
        return matmul(h.astype(jnp.float32), dataclasses.replace(w, block_axis=-2))
    V = w.shape[0]
    rows = next((r for r in range(min(V, 4096), 0, -1) if V % r == 0 and r % 8 == 0), V)  # <= 4096, dividing V
    if rows < 256:  # no useful divisor: one piece
        return dot(h, w.dense(dtype))
    if w.tiled:  # chunk i: columns [i * rows, (i + 1) * rows) of the held transpose [H, V], sliced in place (moving
        # the chunks to a leading axis first copied all the codes at every call), through XLA's dot in the tiles
        def part_dot(i):
            cols = lambda a, axis, n: jax.lax.dynamic_slice_in_dim(a, i * n, n, axis=axis)  # noqa: E731
            return BM.tiled_dot(h, cols(w.codes, 1, rows // 8), cols(w.scale, 2, rows),
                                None if w.offset is None else cols(w.offset, 2, rows), dtype)

        out = jax.lax.map(part_dot, jnp.arange(V // rows))
    else:
        chunked = jax.tree.map(lambda a: a.reshape((V // rows, rows) + a.shape[1:]), w)
        out = jax.lax.map(lambda part: dot(h, part.dense(dtype)), chunked)  # [V / rows, ..., rows]
    return jnp.moveaxis(out, 0, -2).reshape(h.shape[:-1] + (V,))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedLayer:
    """Matrix `layer` of a layer stack of tiled BlockWeights, unsliced: the CPU kernel reads the stack in place
    (a slice of the codes would be a copy at every call), and `dense()` slices only when XLA's dot needs it."""

    stack: BlockWeights
    layer: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The matrix's shape (one layer of the stack)."""
        return self.stack.shape[1:]

    def dense(self, dtype=jnp.float32) -> jax.Array:
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, self.layer, keepdims=False),
                            self.stack).dense(dtype)


def dense(w, dtype=None):
    """A weight's array: `w` itself, or a BlockWeights (StackedLayer) dequantized (to `dtype`, default float32)."""
    return w.dense(jnp.float32 if dtype is None else dtype) if isinstance(w, (BlockWeights, StackedLayer)) else w


def matmul(x: jax.Array, w) -> jax.Array:
    """x @ w in x's dtype (float32 accumulation): w an array, a BlockWeights (dequantized inside the step, then
    XLA's dot) or a StackedLayer, whose decode rows (at most block_matvec.ROWS_MAX of them, when the kernel is
    built) go through the CPU kernel (the same products summed in another order) and a prompt's through XLA's dot
    in the tiled layout (block_matvec.tiled_dot: the blocks layout's result bit for bit)."""
    from rsqr_jax.kernels import block_matvec as BM

    one = isinstance(w, BlockWeights) and w.tiled and w.codes.ndim == 4  # one matrix, not a layer stack
    if one or isinstance(w, StackedLayer):
        s, layer = (jax.tree.map(lambda a: a[None], w), 0) if one else (w.stack, w.layer)  # one: a stack of one
        if _kernel_rows(x):
            return BM.block_matvec(x, s.codes, s.scale, s.offset, layer).astype(x.dtype)
        pick = lambda a: None if a is None else jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)  # noqa: E731
        return BM.tiled_dot(x, pick(s.codes), pick(s.scale), pick(s.offset), x.dtype).astype(x.dtype)
    return jnp.dot(x, dense(w, x.dtype), precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32).astype(x.dtype)


def decode_blocks(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(codes int8 [rows, n], scale float32 [rows, n/32], offset or None) of a GGUF tensor's raw bytes
    [rows, bytes per row] of type Q4_0, Q4_1 or Q8_0 (ggml's block layouts: a float16 d, for Q4_1 a float16 m,
    then the codes; a 4-bit block's byte j holds value j in its low nibble and value j + 16 in its high one)."""
    size, has_offset = BLOCK_TYPES[type_name]
    rows = raw.shape[0]
    b = np.ascontiguousarray(raw, np.uint8).reshape(rows, -1, size)
    scale = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    offset = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_offset else None
    q = b[..., 4 if has_offset else 2:]
    if type_name == "Q8_0":
        codes = q.view(np.int8)
    else:
        codes = np.concatenate([q & 0x0F, q >> 4], axis=-1).astype(np.int8)
        if type_name == "Q4_0":
            codes = codes - np.int8(8)
    return codes.reshape(rows, -1), scale, offset
