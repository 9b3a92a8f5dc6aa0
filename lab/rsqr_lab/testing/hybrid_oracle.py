"""A float64 numpy forward of the Gemma 2 / Gemma 3 decoder streamed token by token over given token sets, for
the hybrid local/global tests (docs/design.md §3d). It imports nothing of the library (only the oracles'
float64 rotation): it is what the library is checked against.

Local (sliding-window) layers attend to their last `sliding_window` global positions at global positions; the
other layers to the given token set, on the rank or the global timeline (as `oracle.stream_logits_f64`)."""

from __future__ import annotations

import numpy as np

from rsqr_lab.testing.oracle import rope_f64


def _gemma_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def _cap(x, cap):
    return x if cap is None else np.tanh(x / cap) * cap


def gemma_stream_logits_f64(weights, cfg, tokens, token_sets, semantics="rank"):
    """float64 logits [T, V] of one Gemma sequence streamed token by token.

    weights: the canonical weights (rsqr_jax.models.capture.weights_of); cfg: the ModelConfig (read for its
    sizes, norms eps, scale, soft-caps, layer kinds and RoPE frequencies). token_sets[t]: the global layers'
    cached global positions after token t (must contain t); semantics 'rank' or 'global' as in
    oracle.stream_logits_f64. A local layer (cfg.is_local) sees {t - sliding_window + 1, ..., t} at global
    positions whatever the token set."""
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    L, Hq, Hkv, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G = Hq // Hkv
    eps = cfg.rms_norm_eps
    scale = (cfg.query_pre_attn_scalar or D) ** -0.5
    inv_global = np.asarray(cfg.inv_freq, np.float64)
    inv_local = np.asarray(cfg.local_inv_freq, np.float64)
    T = len(tokens)
    raw_k = np.zeros((L, T, Hkv, D))
    raw_v = np.zeros((L, T, Hkv, D))
    head = w["embed"].T if "lm_head" not in w else w["lm_head"]
    out = []
    for t, tok in enumerate(tokens):
        cached = np.asarray(sorted(token_sets[t]))
        assert cached[-1] == t
        x = w["embed"][tok] * np.sqrt(cfg.hidden_size)
        for l in range(L):
            h = _gemma_norm(x, w["attn_norm"][l], eps)
            q, k, v = (h @ w["wq"][l]).reshape(Hq, D), (h @ w["wk"][l]).reshape(Hkv, D), (h @ w["wv"][l]).reshape(Hkv, D)
            if cfg.qk_norm:
                q, k = _gemma_norm(q, w["q_norm"][l], eps), _gemma_norm(k, w["k_norm"][l], eps)
            raw_k[l, t], raw_v[l, t] = k, v
            inv = inv_local if cfg.local_rope[l] else inv_global
            if cfg.is_local[l]:
                keys = np.arange(max(0, t - cfg.sliding_window + 1), t + 1)
                pos = keys
            else:
                keys = cached
                pos = np.arange(len(cached)) if semantics == "rank" else cached
            k_N = rope_f64(raw_k[l, keys], pos[:, None], inv)
            q_r = rope_f64(q.reshape(Hkv, G, D), pos[-1], inv)
            s = _cap(np.einsum("kgd,nkd->kgn", q_r, k_N) * scale, cfg.attn_logit_softcap)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            att = np.einsum("kgn,nkd->kgd", p, raw_v[l, keys]).reshape(-1)
            x = x + _gemma_norm(att @ w["wo"][l], w["post_attn_norm"][l], eps)
            h = _gemma_norm(x, w["mlp_norm"][l], eps)
            m = (_gelu_tanh(h @ w["w_gate"][l]) * (h @ w["w_up"][l])) @ w["w_down"][l]
            x = x + _gemma_norm(m, w["post_mlp_norm"][l], eps)
        out.append(_cap(_gemma_norm(x, w["final_norm"], eps) @ head, cfg.final_logit_softcap))
    return np.stack(out)
