"""A CPU kernel for the recall tier's tokens in the attention (recalled_attention.cc), built on first use.

A layer that recalls attends some 64 tokens from the cold store besides its window and survivors. XLA:CPU ran that as
some ten operations per layer (the pages' runs copied out of the store, the rotation table's rows gathered, the keys
rotated, the scores, their mask, max, exponentials and sums, the values' product), together most of what a recall
step adds to plain rsqr's. The kernel reads the pages where they lie and returns the segment's partial softmax
(o, m, l), merged with the window's and the survivors' by survivor_attention_xla: the same attention within float32
rounding (another summation order). Where it cannot be built the XLA path runs (`available()` says why);
RSQR_CPU_KERNEL=0 turns it off with the other CPU kernels.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from rsqr_jax.kernels import cpu_ffi
from rsqr_jax.kernels.store import StoredRuns

NAME = "recalled_attention"  # its key in cpu_ffi.KERNELS
TARGET = "rsqr_recalled_attention"
SOURCE = Path(__file__).with_name("recalled_attention.cc")
QUERIES_MAX = 64  # query vectors per KV head (chunk rows x query heads per KV head) the kernel takes; more stay on XLA


@functools.lru_cache(maxsize=1)
def _load() -> str | None:
    return cpu_ffi.load(SOURCE, "RecalledAttention", TARGET)


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


def applies(runs: StoredRuns, n_queries: int, logit_cap) -> bool:
    """Whether these slots go through the kernel: a decode step's few queries, no logit soft-capping, K/V stored as
    float32 or bfloat16 bits, on a machine where the kernel builds."""
    return (n_queries <= QUERIES_MAX and logit_cap is None and runs.k_stack.dtype in (jnp.float32, jnp.uint16)
            and runs.v_stack.dtype == runs.k_stack.dtype and usable())


def recalled_partial(runs: StoredRuns, qs_BxCxHkvxGxD: jax.Array, table_TxD) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The partial softmax of the (rotated, scaled) queries over the slots: o [B, Hkv, G, C, D], m and l [B, Hkv, G,
    C, 1], float32, as survivor_attention_xla's `partial` gives them for a segment. RuntimeError (its reason) where
    the kernel cannot be built."""
    if (reason := _load()) is not None:
        raise RuntimeError(f"recalled_attention: {reason}")
    B, C, Hkv, G, D = qs_BxCxHkvxGxD.shape
    out = (jax.ShapeDtypeStruct((B, Hkv, G, C, D), jnp.float32), jax.ShapeDtypeStruct((B, Hkv, G, C, 1), jnp.float32),
           jax.ShapeDtypeStruct((B, Hkv, G, C, 1), jnp.float32))
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
        runs.k_stack, runs.v_stack, jnp.asarray(runs.layer, jnp.int32), runs.starts_BxM.astype(jnp.int32),
        qs_BxCxHkvxGxD.astype(jnp.float32), runs.rot_pos_BxR.astype(jnp.int32), runs.valid_BxR.astype(bool),
        jnp.asarray(table_TxD, jnp.float32))
