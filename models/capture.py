"""Capture the raw (un-rotated) per-layer queries and keys of the Llama decoder over a token sequence.

Experiments that study RoPE numerics need q/k as the model computes them. models/llama.py exposes no
hook, so this runs the decoder's own layer recipe on the Llama module's weights with its own pieces
(`rms_norm`, `_dense`, and attention through `rsqr_jax.update.attend_layer` with a full-attention plan,
i.e. the library's causal attention), returning q/k from the layer scan. Only the wiring of the layer is
repeated here (models/llama.py may not change); tests check its logits against `forward_logits`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.llama import BIAS_KEYS, LAYER_KEYS, Llama, _dense, rms_norm
from rsqr_jax import policy as P
from rsqr_jax.cache import init_cache
from rsqr_jax.spec import CacheSpec
from rsqr_jax.update import attend_layer, plan_step


def weights_of(model: Llama) -> dict[str, np.ndarray]:
    """The module's weights as a float32 numpy dict in the canonical layout (for float64 oracles)."""
    cfg = model.config
    names = ["embed", "final_norm", *LAYER_KEYS] + (list(BIAS_KEYS) if cfg.attention_bias else []) + \
        ([] if cfg.tie_word_embeddings else ["lm_head"])
    return {n: np.asarray(getattr(model, n)[...], np.float32) for n in names}


def capture_qk(model: Llama, tokens_T, *, kernel: str = "xla"):
    """Full causal forward at positions 0..T-1: raw q [L, T, Hq, D], raw k [L, T, Hkv, D], logits [T, V]
    (numpy float32), computed as Llama.__call__ computes them."""
    cfg = model.config
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    tokens_1xT = jnp.asarray(np.asarray(tokens_T), jnp.int32)[None]
    T = tokens_1xT.shape[1]
    pol = P.full()
    spec = CacheSpec.for_policies(pol, num_layers=cfg.num_layers, num_kv_heads=Hkv, head_dim=D, batch=1,
                                  dtype=str(model.dtype), max_chunk=T, max_len=T)
    keys = LAYER_KEYS + (BIAS_KEYS if cfg.attention_bias else ())
    stacked = {name: getattr(model, name)[...] for name in keys}
    head = model.embed[...].T if model.lm_head is None else model.lm_head[...]

    @jax.jit
    def run(stacked, embed, final_norm, head, tokens_1xT):
        cache = init_cache(spec)
        plan = plan_step(cache, pol, T)

        def layer(carry, xs):
            x, cache = carry
            p, idx = xs
            h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
            q, k, v = _dense(h, p["wq"]), _dense(h, p["wk"]), _dense(h, p["wv"])
            if cfg.attention_bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
            q, k = q.reshape(1, T, Hq, D), k.reshape(1, T, Hkv, D)
            attn, cache = attend_layer(idx, q, k, v.reshape(1, T, Hkv, D), cache, plan, cfg.inv_freq, kernel=kernel)
            x = x + _dense(attn.reshape(1, T, Hq * D).astype(x.dtype), p["wo"])
            h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
            x = x + _dense(jax.nn.silu(_dense(h, p["w_gate"])) * _dense(h, p["w_up"]), p["w_down"])
            return (x, cache), (q[0], k[0])

        x = jnp.take(embed, tokens_1xT, axis=0)
        (x, _), (q, k) = jax.lax.scan(layer, (x, cache), (stacked, jnp.arange(cfg.num_layers)))
        h = rms_norm(x, final_norm, cfg.rms_norm_eps)
        logits = jnp.dot(h, head, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return q, k, logits[0]

    q, k, logits = run(stacked, model.embed[...], model.final_norm[...], head, tokens_1xT)
    return np.asarray(q, np.float32), np.asarray(k, np.float32), np.asarray(logits)
