"""A CPU kernel for the recall tier's page scores on its int8 scoring copy (page_scores.cc), built on first use.

Scoring a layer's store is a pass over its copy (17 int32 words per key at head_dim 64): XLA:CPU reads the layer's
rows into a temporary, converts them to bytes, runs an integer dot with no fast path and reduces the scores per page
in further passes. The kernel reads each key once, dots it with every query in registers and keeps each page's best,
giving rsqr_jax.recall's scores bit for bit (the integer dot is exact; the two float32 products are XLA's, in its
order). Where it cannot be built the recall tier stays on XLA (`available()` says why); RSQR_CPU_KERNEL=0 turns it
off with the other CPU kernels.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from rsqr_jax.kernels import cpu_ffi

NAME = "page_scores"  # its key in cpu_ffi.KERNELS
TARGET = "rsqr_page_scores_int8"
SOURCE = Path(__file__).with_name("page_scores.cc")
QUERIES_MAX = 64  # query vectors per KV head (chunk rows x query heads per KV head) the kernel takes; more stay on XLA


@functools.lru_cache(maxsize=1)
def _load() -> str | None:
    return cpu_ffi.load(SOURCE, "PageScoresInt8", TARGET)


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


def applies(n_queries: int) -> bool:
    """Whether a call with this many query vectors per KV head goes through the kernel (decode's few do; a prefill
    chunk's many stay on XLA's dot)."""
    return n_queries <= QUERIES_MAX and usable()


def page_scores_int8(rows_LxBxHkvxNxW: jax.Array, layer, q_codes_BxCxHkvxGxD: jax.Array, q_scale_BxCxHkvxG: jax.Array,
                     valid_N: jax.Array, real_C: jax.Array, pages_scored, page_size: int) -> jax.Array:
    """[B, N / page_size] float32: each page's best q . k over its valid slots, the real rows and every head, for the
    first pages_scored pages of layer `layer` (-inf beyond them, and for a page with nothing valid). rows: the whole
    stack of the int8 scoring copy (recall.pack_int8_keys), int32 [L, B, Hkv, N, D/4 + 1]; the queries as
    recall.quantize_int8 gives them. RuntimeError (its reason) where the kernel cannot be built."""
    if (reason := _load()) is not None:
        raise RuntimeError(f"page_scores: {reason}")
    B, N = rows_LxBxHkvxNxW.shape[1], rows_LxBxHkvxNxW.shape[3]
    out = jax.ShapeDtypeStruct((B, N // page_size), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
        rows_LxBxHkvxNxW, jnp.asarray(layer, jnp.int32), q_codes_BxCxHkvxGxD.astype(jnp.int8),
        q_scale_BxCxHkvxG.astype(jnp.float32), valid_N.astype(bool), real_C.astype(bool),
        jnp.asarray(pages_scored, jnp.int32))
