"""One tiny random model and one cache spec shared by the Session tests (test_session, test_determinism),
so every Session of the test run reuses the same two compilations (prefill + decode)."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from rsqr_jax.models.llama import Llama, split_apply
from rsqr_jax import policy as P
from rsqr_jax.spec import CacheSpec
from rsqr_jax.session import Session
from rsqr_jax.models.tiny import tiny_config, tiny_weights

CFG = tiny_config()
IDENTITY = {"model": "tiny-random", "seed": 0, "vocab_size": CFG.vocab_size, "dtype": "float32"}
CHUNK = 4
# Small windows so the streams below evict (and overflow survivors) many times.
POLICIES = {
    "rsqr": P.rsqr(8, 2, 3, 3, block=2),
    "replay": P.replay(8, 2, 3, 3, block=2),
    "rsqr_precompute": P.rsqr_precompute(8, 2, 2, 3, overflow="decimate"),
    "streamingllm": P.streamingllm(8, 2),
}
SPEC = CacheSpec.for_policies(list(POLICIES.values()), num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                              head_dim=CFG.head_dim, max_chunk=CHUNK)


@functools.lru_cache(maxsize=None)
def model():
    """(apply_fn, params) of the tiny random model (one apply_fn object: one jitted step)."""
    return split_apply(Llama(CFG, tiny_weights(CFG, 0), dtype=jnp.float32))


def make_session(policy="rsqr", **kw) -> Session:
    apply_fn, params = model()
    kw.setdefault("prefill_chunk", CHUNK)
    kw.setdefault("vocab_size", CFG.vocab_size)
    return Session(apply_fn, params, SPEC, POLICIES[policy], **kw)
