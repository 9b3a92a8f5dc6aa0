"""rsqr_jax: exact, cheap bounded KV caches for streaming LLMs (RSQR and every rival policy), in JAX.

The public API: `load()`, the front door (a model and its preset: chats, sessions, one-call
generation); policies as data, the cache spec and pytree, the one decode engine, sessions and the text-level
chat over one, sampling, streaming NLL and vmapped sweeps. Names resolve on
first use (PEP 562), so importing a subpackage (the kernels, the command-line plumbing) does not import
the whole engine.

Layout by kind: this package's modules are the core; `kernels` the fused
attention (lowest layer); `models` the Flax decoders and loaders; `eval` reusable evaluation (streaming
perplexity, statistics, the request harness, the lm-eval model); `cli` the command-line applications and
their plumbing. The experiments and benchmarks (`studies`), the GPU checks (`devtools`) and the test support
(`testing`: float64 oracles, kernel inputs) live in the repository's lab/ folder, a project of their own,
not in this package.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "rsqr_jax.api": ["Model", "load"],
    "rsqr_jax.cache": ["KVCache", "init_cache", "init_policy_cache"],
    "rsqr_jax.conversation": ["Chat", "Pins"],
    "rsqr_jax.engine": ["Decoder", "stream_nll"],
    "rsqr_jax.info": ["info"],
    "rsqr_jax.policy": ["MODES", "Policy", "PolicyError", "full", "leave_gaps", "make_policy", "replay", "rerotate",
                        "rsqr", "rsqr_precompute", "stack_policies", "streamingllm", "unstack_policies", "window"],
    "rsqr_jax.presets": ["Preset", "PresetError", "Settings", "find_preset", "load_preset"],
    "rsqr_jax.sampling": ["Sampling"],
    "rsqr_jax.session": ["Session", "SessionFileError"],
    "rsqr_jax.spec": ["CacheSpec", "ColdStore", "validate"],
    "rsqr_jax.sweep": ["make_mesh", "policy_grid", "summarize", "sweep_nll"],
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'rsqr_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
