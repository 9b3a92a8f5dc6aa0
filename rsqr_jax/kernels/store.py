"""K/V stacks as the cache holds them, and reads of slots where they lie.

Every K/V buffer of the cache is a stack [L, B, Hkv, N, D] over layers, threaded through the model's layer scan.
bfloat16 K/V on CPU travel through the scan as their uint16 bits (BITS_DTYPE): XLA:CPU has no bfloat16
dynamic-update-slice or select, so it would convert the whole stack to float32 and back around every write, per
layer and step, and lose the in-place update. uint16 writes stay in place and the stored bits are identical.

Reads of a layer's slots never slice the layer first: a slice of one layer read before or after a write to the
stack makes XLA copy the layer (or the whole stack) per layer and step. Runs of consecutive slots are sliced from the
whole stack (a dynamic slice copies rows), many runs gathered (XLA:CPU gathers element by element).

`StoredRuns` is a segment of attention that still lies in such a stack (the recall tier's pages): the attention
kernels read it in place, or as arrays through `read()`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

BITS_DTYPE = jnp.uint16
# Up to this many runs (batch rows x runs per row), read_layer_runs slices each run; more take one gather.
SLICED_RUNS_MAX = 64


def logical_dtype(buf: jax.Array):
    """The dtype a stack's values have (bfloat16 for a stack of bits)."""
    return jnp.dtype(jnp.bfloat16) if buf.dtype == BITS_DTYPE else buf.dtype


def as_logical(x: jax.Array) -> jax.Array:
    """Values read from a stack, in their logical dtype."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == BITS_DTYPE else x


def read_layer(buf: jax.Array, layer) -> jax.Array:
    """One layer of a K/V stack, in its logical dtype."""
    return as_logical(buf[layer])


def write_kv(buf: jax.Array, idx, update: jax.Array) -> jax.Array:
    """buf.at[idx].set(update, mode="drop") for a K/V stack in its storage dtype (bits or not)."""
    update = update.astype(logical_dtype(buf))
    if buf.dtype == BITS_DTYPE:
        update = jax.lax.bitcast_convert_type(update, BITS_DTYPE)
    return buf.at[idx].set(update, mode="drop")


def gather_layer_slots(buf: jax.Array, layer, slots_BxR) -> jax.Array:
    """buf[layer, b, h, slots_BxR[b]] for an [L, B, Hkv, N, D] stack: [B, Hkv, R, D] as stored, one gather from the
    whole stack."""
    B, H = buf.shape[1], buf.shape[2]
    return buf[layer, jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None], slots_BxR[:, None, :]]


def run_slots(starts_BxM: jax.Array, n: int) -> jax.Array:
    """The slots of runs of n consecutive slots from each start: [B, M * n]."""
    B, M = starts_BxM.shape
    return (starts_BxM[:, :, None] + jnp.arange(n, dtype=starts_BxM.dtype)).reshape(B, M * n)


def read_layer_runs(buf: jax.Array, layer, starts_BxM: jax.Array, n: int) -> jax.Array:
    """buf[layer, b, :, s : s + n] for each start s of starts_BxM[b], joined along the slots: [B, Hkv, M * n, D] as
    stored, the values of gather_layer_slots(buf, layer, run_slots(starts_BxM, n)). Every start must leave n slots.
    Each run is sliced from the whole stack, up to SLICED_RUNS_MAX runs; more are gathered."""
    B, H, D = buf.shape[1], buf.shape[2], buf.shape[4]
    M = starts_BxM.shape[1]
    if B * M > SLICED_RUNS_MAX:
        return gather_layer_slots(buf, layer, run_slots(starts_BxM, n))
    zero = jnp.zeros((), starts_BxM.dtype)
    layer = jnp.asarray(layer, starts_BxM.dtype)
    rows = [jnp.concatenate([jax.lax.dynamic_slice(buf, (layer, jnp.asarray(b, starts_BxM.dtype), zero,
                                                         starts_BxM[b, m], zero), (1, 1, H, n, D))[0]
                             for m in range(M)], axis=2) for b in range(B)]
    return jnp.concatenate(rows, axis=0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RawSegment:
    """More slots of the raw (rotated-in-the-kernel) segment as arrays: k, v [B, Hkv, R, D], the position each key
    is rotated at and which slots are attended, [B, R]."""

    k: jax.Array
    v: jax.Array
    rot_pos_BxR: jax.Array
    valid_BxR: jax.Array

    def arrays(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        return self.k, self.v, self.rot_pos_BxR, self.valid_BxR


@functools.partial(jax.tree_util.register_dataclass, meta_fields=["run"],
                   data_fields=["k_stack", "v_stack", "layer", "starts_BxM", "rot_pos_BxR", "valid_BxR"])
@dataclasses.dataclass(frozen=True)
class StoredRuns:
    """More slots of the raw segment that still lie in the stacks they are kept in: runs of `run` slots from each of
    starts_BxM in layer `layer` of K and V stacks [L, B, Hkv, N, D] as stored, with the position each key is rotated
    at and which slots are attended, [B, M * run]."""

    k_stack: jax.Array
    v_stack: jax.Array
    layer: jax.Array
    starts_BxM: jax.Array
    run: int
    rot_pos_BxR: jax.Array
    valid_BxR: jax.Array

    def read(self) -> tuple[jax.Array, jax.Array]:
        """The slots' K and V [B, Hkv, M * run, D] in their logical dtype."""
        return tuple(as_logical(read_layer_runs(x, self.layer, self.starts_BxM, self.run))
                     for x in (self.k_stack, self.v_stack))

    def arrays(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """(k, v, rot_pos, valid): the slots as arrays."""
        return (*self.read(), self.rot_pos_BxR, self.valid_BxR)
