"""rsqr_jax: exact, cheap bounded KV caches for streaming LLMs (RSQR and every rival policy), in JAX.

The public API (see README.md): policies as data, the cache spec and pytree, the one decode engine,
sessions, streaming NLL and vmapped sweeps.
"""

from rsqr_jax.cache import KVCache, init_cache, init_policy_cache
from rsqr_jax.engine import Decoder, stream_nll
from rsqr_jax.policy import (MODES, Policy, PolicyError, full, leave_gaps, make_policy, replay, rerotate, rsqr,
                             rsqr_precompute, stack_policies, streamingllm, unstack_policies, window)
from rsqr_jax.sampling import Sampling
from rsqr_jax.session import Session, SessionFileError
from rsqr_jax.spec import CacheSpec, ColdStore, validate
from rsqr_jax.sweep import make_mesh, policy_grid, summarize, sweep_nll

__all__ = ["CacheSpec", "ColdStore", "Decoder", "KVCache", "MODES", "Policy", "PolicyError", "Sampling", "Session",
           "SessionFileError",
           "full", "init_cache", "init_policy_cache", "leave_gaps", "make_mesh", "make_policy", "policy_grid",
           "replay", "rerotate", "rsqr", "rsqr_precompute", "stack_policies", "stream_nll", "streamingllm",
           "summarize", "sweep_nll", "unstack_policies", "validate", "window"]
