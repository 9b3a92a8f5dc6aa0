"""The canonical weight layout every loader produces, and the small helpers the GGUF and HF loaders share.

Canonical: float32, `x @ W` orientation, layers stacked on a leading axis L, q/k rows in the half-split
("rotate_half") RoPE layout of HF transformers, norm weights as HF holds them (Gemma's are the w of (1 + w)). `canonical_shapes(config)` names every tensor.
"""

from __future__ import annotations

import numpy as np

from rsqr_jax.models.config import ModelConfig, ModelLoadError

# Tokens that end a chat turn / a document in the model families we support (llama.cpp ends generation on each of
# them by its text); added to eos_token_ids.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "<|end|>",
                      "<end_of_turn>")


def one_line(exc: BaseException) -> str:
    """`Type: first line of message`, shortened: for wrapping library errors into a ModelLoadError."""
    text = str(exc).strip().splitlines()
    msg = text[0] if text else ""
    if len(msg) > 200:
        msg = msg[:197] + "..."
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def canonical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The exact names and shapes `load_weights` returns for `config`."""
    L, H, I, V = config.num_layers, config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {
        "embed": (V, H),
        "attn_norm": (L, H),
        "wq": (L, H, q),
        "wk": (L, H, kv),
        "wv": (L, H, kv),
        "wo": (L, q, H),
        "mlp_norm": (L, H),
        "w_gate": (L, H, I),
        "w_up": (L, H, I),
        "w_down": (L, I, H),
        "final_norm": (H,),
    }
    if config.attention_bias:
        shapes.update(bq=(L, q), bk=(L, kv), bv=(L, kv))
    if config.qk_norm:
        shapes.update(q_norm=(L, config.head_dim), k_norm=(L, config.head_dim))
    if config.gemma:
        shapes.update(post_attn_norm=(L, H), post_mlp_norm=(L, H))
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (H, V)
    return shapes


def checked(name: str, w: np.ndarray, shapes: dict[str, tuple[int, ...]]) -> np.ndarray:
    """`w` if it has the shape the config implies for `name` (else a one-line ModelLoadError)."""
    if w.shape != shapes[name]:
        raise ModelLoadError(f"weight {name} has shape {w.shape}, config implies {shapes[name]}")
    return w


def empty(shape: tuple[int, ...]) -> np.ndarray:
    """Uninitialized float32 array whose data is 64-byte aligned: `jax.device_put` on CPU then adopts the
    buffer instead of copying it (numpy's own large arrays sit 16 bytes past a page boundary and are
    copied), so a loaded weight exists once in host memory."""
    n = int(np.prod(shape, dtype=np.int64)) * 4
    raw = np.empty(n + 64, np.uint8)
    skip = -raw.ctypes.data % 64
    return raw[skip:skip + n].view(np.float32).reshape(shape)


def stack_layers(config: ModelConfig, name: str, shape: tuple[int, ...], get_layer) -> np.ndarray:
    """[L, ...] float32 from `get_layer(i)` ([out, in] Linear weights are transposed to x @ W).

    One canonical tensor at a time, so a streaming loader holds at most one stacked tensor on the host."""
    out = empty(shape)
    for i in range(config.num_layers):
        w = get_layer(i)
        w = w.T if w.ndim == 2 else w
        if w.shape != shape[1:]:
            raise ModelLoadError(f"weight {name} of layer {i} has shape {w.shape}, config implies {shape[1:]}")
        out[i] = w
    return out


def eos_with_end_of_turn(eos: list[int], vocab: dict[str, int] | None) -> tuple[int, ...]:
    ids = [int(i) for i in eos if i is not None and int(i) >= 0]
    for tok in END_OF_TURN_TOKENS:
        if vocab and tok in vocab:
            ids.append(int(vocab[tok]))
    return tuple(dict.fromkeys(ids))  # unique, order kept
