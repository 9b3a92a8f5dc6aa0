"""Tiny random Llama/Qwen2 configs and weights (no files, no torch): the smoke mode of the RULER command
(`rsqr_jax.cli.eval_ruler --quick`) and the fast policy tests."""

from __future__ import annotations

import numpy as np

from rsqr_jax.models.config import ModelConfig


def tiny_config(arch="llama", *, layers=2, hidden=32, heads=4, kv_heads=2, head_dim=16, vocab=97, theta=1e4):
    return ModelConfig(arch, vocab, hidden, 2 * hidden, layers, heads, kv_heads, head_dim, 1e-5, theta,
                       attention_bias=arch == "qwen2")


def tiny_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    L, H, I, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    n = lambda *s, fan: rng.normal(size=s) / np.sqrt(fan)  # noqa: E731
    w = dict(embed=rng.normal(size=(V, H)), attn_norm=1 + 0.1 * rng.normal(size=(L, H)), wq=2 * n(L, H, qd, fan=H),
             wk=2 * n(L, H, kd, fan=H), wv=n(L, H, kd, fan=H), wo=n(L, qd, H, fan=qd),
             mlp_norm=1 + 0.1 * rng.normal(size=(L, H)), w_gate=n(L, H, I, fan=H), w_up=n(L, H, I, fan=H),
             w_down=n(L, I, H, fan=I), final_norm=1 + 0.1 * rng.normal(size=(H,)))
    if cfg.attention_bias:
        w.update(bq=0.1 * rng.normal(size=(L, qd)), bk=0.1 * rng.normal(size=(L, kd)), bv=0.1 * rng.normal(size=(L, kd)))
    if not cfg.tie_word_embeddings:
        w["lm_head"] = n(H, V, fan=H)
    return {k: np.asarray(v, np.float32) for k, v in w.items()}


def tiny_model(cfg: ModelConfig | None = None, seed: int = 0, *, dtype: str = "float32", kernel: str = "xla"):
    """(apply_fn, params) of a tiny random Llama (the decoder of `models`, imported here lazily)."""
    import jax.numpy as jnp

    from rsqr_jax.models.llama import Llama, split_apply

    cfg = tiny_config() if cfg is None else cfg
    return split_apply(Llama(cfg, tiny_weights(cfg, seed), dtype=jnp.dtype(dtype)), kernel=kernel)
