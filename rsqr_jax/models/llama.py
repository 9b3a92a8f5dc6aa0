"""Flax NNX decoder for the supported families (Llama, Llama-3 rope scaling, SmolLM2, Mistral, Qwen2/2.5 biases,
Qwen3 q/k norms, Gemma 2 / Gemma 3; rsqr_jax.models.config).

Layer weights are stacked on a leading axis and the layers run under one `lax.scan`, so compile time
does not grow with depth. Attention is not implemented here: each global layer hands its raw q/k/v to
`rsqr_jax.update.attend_layer`, which owns RoPE, the cache and every eviction policy; each local
(sliding-window) layer of a hybrid model to `rsqr_jax.hybrid.attend_local`, its own ring of the window.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rsqr_jax.models.blocks import BlockWeights, StackedLayer, dense
from rsqr_jax.models.blocks import matmul as blocks_matmul
from rsqr_jax.models.blocks import logits as tied_logits
from rsqr_jax.models.config import ModelConfig
from rsqr_jax import hybrid
from rsqr_jax.cache import KVCache
from rsqr_jax.update import StepPlan, attend_layer

LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
BIAS_KEYS = ("bq", "bk", "bv")
QK_NORM_KEYS = ("q_norm", "k_norm")
POST_NORM_KEYS = ("post_attn_norm", "post_mlp_norm")


def layer_keys(config: ModelConfig) -> tuple[str, ...]:
    """The stacked per-layer weights of `config`'s family."""
    return (LAYER_KEYS + (BIAS_KEYS if config.attention_bias else ()) + (QK_NORM_KEYS if config.qk_norm else ())
            + (POST_NORM_KEYS if config.gemma else ()))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF Llama RMSNorm: statistics in float32, result cast back before the weight."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def gemma_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF Gemma RMSNorm: statistics and the (1 + w) scale in float32, cast back last."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """tanh(x / cap) * cap (Gemma's logit soft-capping); x itself when cap is None."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def dense_matmul(x: jax.Array, w) -> jax.Array:
    """x @ w; a BlockWeights is dequantized here, inside the step, or read by the CPU kernel
    (rsqr_jax.models.blocks.matmul)."""
    return blocks_matmul(x, w)


class Llama(nnx.Module):
    """Decoder-only transformer; weights in the canonical layout of rsqr_jax.models.loading (x @ W), each an
    array or, for the matrices of a GGUF's 4- and 8-bit blocks, a BlockWeights (dequantized in the step)."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], dtype=jnp.float32):
        self.config = config
        self.dtype = jnp.dtype(dtype)

        def cast(name):
            w = weights[name]
            return nnx.Param(jax.tree.map(jnp.asarray, w) if isinstance(w, BlockWeights) else jnp.asarray(w, self.dtype))

        self.embed = cast("embed")
        self.final_norm = cast("final_norm")
        self.lm_head = cast("lm_head") if not config.tie_word_embeddings else None
        for name in layer_keys(config):
            setattr(self, name, cast(name))

    def weight(self, name: str) -> jax.Array:
        """A weight as an array of the model's dtype (a BlockWeights dequantized): for references and oracles."""
        return dense(getattr(self, name).get_value(), self.dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight as held (BlockWeights: codes, scales and offsets)."""
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(self)))

    def __call__(self, tokens_BxC: jax.Array, cache: KVCache, plan: StepPlan, *, kernel: str = "xla",
                 capture_qk: bool = False, attend: Callable = attend_layer, matmul: Callable | None = None):
        """Logits [B, C, V] (float32) of a chunk, and the cache with this chunk's K/V written.

        capture_qk: also return every layer's raw (un-rotated) q [L, B, C, Hq, D] and k [L, B, C, Hkv, D],
        as the layer computed them (for experiments on RoPE numerics; no second forward anywhere).
        attend: the layer's attention, `attend_layer` (signature and cache contract); an experiment may pass
        its own (e.g. the studies in lab/: reproduce_arms.explicit_attend, whose "cache" is its own pytree).
        matmul(x, w): a layer's projection x @ w, w an array or a BlockWeights (None: dequantize, then dot); a
        benchmark of weight formats passes its own (lab/: studies.weights_timing)."""
        cfg = self.config
        _dense = dense_matmul if matmul is None else matmul
        B, C = tokens_BxC.shape
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        inv_freq = cfg.inv_freq
        stacked = {name: getattr(self, name).get_value() for name in layer_keys(cfg)}
        # Tiled matrices (the CPU kernel's) are not sliced by the scan: each layer gets a StackedLayer view
        kernel_stacks = {n: w for n, w in stacked.items() if isinstance(w, BlockWeights) and w.tiled}
        stacked = {n: w for n, w in stacked.items() if n not in kernel_stacks}
        norm = functools.partial(gemma_rms_norm if cfg.gemma else rms_norm, eps=cfg.rms_norm_eps)
        act = functools.partial(jax.nn.gelu, approximate=True) if cfg.gemma else jax.nn.silu
        # Only the families that need them pass these on: the other programs (and an experiment's own `attend`)
        # are the same as ever.
        attn_kw = {k: v for k, v in (("scale", cfg.attn_scale), ("logit_cap", cfg.attn_logit_softcap)) if v is not None}
        embed = self.embed.get_value()
        if isinstance(embed, BlockWeights):
            x_BxCxH = embed.rows(tokens_BxC, self.dtype)
        else:
            x_BxCxH = jnp.take(embed, tokens_BxC, axis=0)
        if cfg.gemma:  # HF: the normalizer is a tensor of the hidden states' dtype
            x_BxCxH = x_BxCxH * jnp.asarray(cfg.hidden_size ** 0.5, x_BxCxH.dtype)
        # Each layer is one of three kinds: the policy's cache with the global RoPE (0) or with the local layers'
        # RoPE (1: Gemma 3's local layers when their window spans the context), or a local ring (2).
        ring = np.asarray(cfg.is_local)
        local_rope = np.asarray(cfg.local_rope) & (not np.array_equal(cfg.local_inv_freq, inv_freq))
        kind = np.where(ring, 2, local_rope.astype(np.int32))
        used = sorted(set(kind.tolist()))
        slots = np.where(ring, np.cumsum(ring) - 1, np.cumsum(~ring) - 1).astype(np.int32)
        if ring.any():
            hybrid.check_cache(cache, cfg)
            local = hybrid.plan_local(cache, plan, C)

        def attention(p, h):
            q, k, v = _dense(h, p["wq"]), _dense(h, p["wk"]), _dense(h, p["wv"])
            if cfg.attention_bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
            q, k, v = q.reshape(B, C, Hq, D), k.reshape(B, C, Hkv, D), v.reshape(B, C, Hkv, D)
            if cfg.qk_norm:
                q, k = norm(q, p["q_norm"]), norm(k, p["k_norm"])
            return q, k, v

        def layer(carry, xs):
            x, cache = carry
            p, kind_l, slot, index = xs  # slot: the layer's index among the layers of its cache (policy or ring)
            p = p | {n: StackedLayer(w, index) for n, w in kernel_stacks.items()}
            h = norm(x, p["attn_norm"])
            q, k, v = attention(p, h)
            branches = {
                0: lambda c: attend(slot, q, k, v, c, plan, inv_freq, kernel=kernel, **attn_kw),
                1: lambda c: attend(slot, q, k, v, c, plan, cfg.local_inv_freq, kernel=kernel, **attn_kw),
                2: lambda c: hybrid.attend_local(slot, q, k, v, c, local, cfg.local_inv_freq, window=cfg.local_window,
                                                 kernel=kernel, **attn_kw),
            }
            if len(used) == 1:
                attn, cache = branches[used[0]](cache)
            else:  # an unbatched index (a model constant): a real switch even under a policy vmap
                index = jnp.searchsorted(jnp.asarray(used), kind_l)
                attn, cache = jax.lax.switch(index, [branches[u] for u in used], cache)
            o = _dense(attn.reshape(B, C, Hq * D).astype(x.dtype), p["wo"])
            x = x + (norm(o, p["post_attn_norm"]) if cfg.gemma else o)
            h = norm(x, p["mlp_norm"])
            m = _dense(act(_dense(h, p["w_gate"])) * _dense(h, p["w_up"]), p["w_down"])
            x = x + (norm(m, p["post_mlp_norm"]) if cfg.gemma else m)
            return (x, cache), ((q, k) if capture_qk else None)

        (x_BxCxH, cache), qk = jax.lax.scan(layer, (x_BxCxH, cache), (stacked, jnp.asarray(kind), jnp.asarray(slots),
                                                                    jnp.arange(cfg.num_layers, dtype=jnp.int32)))
        if ring.any():
            cache = cache.replace(loc_pos=local.next_pos)
        row = getattr(plan, "logits_row", None)  # a custom `attend` may pass no StepPlan (studies.reproduce_arms)
        if row is not None:  # only the row the caller reads (engine.step's last_logits)
            x_BxCxH = jax.lax.dynamic_slice_in_dim(x_BxCxH, row, 1, axis=1)
        h = norm(x_BxCxH, self.final_norm[...])
        if self.lm_head is None:  # tied: contract the embedding's H axis in place (a `.T` made XLA:CPU copy
            # the whole [V, H] matrix transposed at every step)
            logits = tied_logits(h, embed, self.dtype)
        else:
            head = self.lm_head.get_value()
            if isinstance(head, BlockWeights) and head.tiled:  # decode rows through the CPU kernel
                logits = blocks_matmul(h.astype(jnp.float32), head)
            else:
                logits = jnp.dot(h, dense(head, self.dtype), precision=jax.lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32)
        logits = softcap(logits, cfg.final_logit_softcap)
        return (logits, cache, qk) if capture_qk else (logits, cache)


def split_apply(model: Llama, *, kernel: str = "xla", attend: Callable = attend_layer,
                matmul: Callable | None = None) -> tuple[Callable, nnx.State]:
    """(apply_fn, params): a pure function for the streaming loops (`nnx.split` once, `nnx.merge` inside).

    apply_fn(params, tokens_BxC, cache, plan) -> (logits_BxCxV, cache); `attend` and `matmul` as in
    `Llama.__call__`.
    """
    graphdef, params = nnx.split(model)

    def apply_fn(params, tokens_BxC, cache, plan):
        return nnx.merge(graphdef, params)(tokens_BxC, cache, plan, kernel=kernel, attend=attend, matmul=matmul)

    return apply_fn, params


WEIGHT_FORMATS = ("auto", "tiled", "blocks", "dense")


@dataclasses.dataclass
class LoadedModel:
    """A model ready to stream: its config, the NNX module, the tokenizer (lazy) and where it came from.

    Sessions and chats on it come from the front door, rsqr_jax.load() (rsqr_jax.api.Model), which adds the
    model's preset.
    """

    config: ModelConfig
    model: Llama
    path: str
    dtype: str
    weight_format: str = "dense"  # "blocks" / "tiled" when some matrices are held as a GGUF's blocks (load_model)
    _tokenizer: object = None
    _split: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def split(self, kernel: str = "xla") -> tuple[Callable, nnx.State]:
        """`split_apply(self.model, kernel=kernel)`, made once per kernel: a Decoder compiles per apply_fn,
        so every session of this model shares its compiled functions."""
        if kernel not in self._split:
            self._split[kernel] = split_apply(self.model, kernel=kernel)
        return self._split[kernel]

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from rsqr_jax.models.gguf import forget_readers
            from rsqr_jax.models.loading import load_tokenizer

            self._tokenizer = load_tokenizer(self.path)
            forget_readers()  # weights and tokenizer are read: the parsed GGUF (~70 MB of metadata) can go
        return self._tokenizer

    @property
    def identity(self) -> dict:
        """What a saved session must match to be resumed on this model."""
        c = self.config
        return {"path": self.path, "arch": c.arch, "num_layers": c.num_layers, "hidden_size": c.hidden_size,
                "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
                "dtype": self.dtype}


def read_model(path: str, dtype: str = "float32", *, blocks: bool = False, tiled: bool = False) -> LoadedModel:
    """A LoadedModel read from `path` (not cached: `load_model` is what applications call). blocks: keep a GGUF's
    Q4_0 / Q4_1 / Q8_0 matrices as BlockWeights; tiled: the layer matrices and the output matrix (the tied
    embedding) among them in the CPU kernel's layout (BlockWeights.to_tiled).

    Each canonical tensor goes to the device as soon as it is read (on CPU `jax.device_put` adopts the
    loader's 64-byte aligned buffer; elsewhere it copies, and the wait drops the host copy before the next
    tensor is read: copies are asynchronous), so the host never holds the weights twice.
    """
    from rsqr_jax.host import release_free_heap
    from rsqr_jax.kernels.block_matvec import GROUP
    from rsqr_jax.models.loading import iter_weights, load_config

    config = load_config(path)
    weights, held = {}, set()
    for name, w in iter_weights(path, config, blocks=blocks):
        if isinstance(w, BlockWeights):
            tie = name == "embed" and config.tie_word_embeddings  # the embedding is also the output matrix
            out_columns = w.shape[0 if tie else -1]
            if tiled and (name in layer_keys(config) or name == "lm_head" or tie) and out_columns % GROUP == 0:
                w = w.to_tiled()
            held.add("tiled" if w.tiled else "blocks")
            w = jax.tree.map(jax.device_put, w)
        else:
            w = w if w.dtype == jnp.dtype(dtype) else w.astype(jnp.dtype(dtype))
            w = jax.device_put(w)  # CPU: adopts the aligned buffer, no copy
        weights[name] = jax.block_until_ready(w)
        del w
    release_free_heap()  # the decoded and re-laid blocks' buffers
    return LoadedModel(config, Llama(config, weights, dtype=jnp.dtype(dtype)), path, str(jnp.dtype(dtype)),
                       weight_format="tiled" if "tiled" in held else "blocks" if held else "dense")


@functools.lru_cache(maxsize=1)
def _load_cached(path: str, dtype: str, weight_format: str) -> LoadedModel:
    """One loaded model per process (a second path, dtype or weight format replaces it: two copies of the
    weights never stay alive through this cache)."""
    return read_model(path, dtype, blocks=weight_format != "dense", tiled=weight_format == "tiled")


def load_model(path: str | None = None, dtype: str = "float32", *, weight_format: str = "auto") -> LoadedModel:
    """Load a GGUF file or HF directory (default: the embedded SmolLM2-135M-Instruct) with weights in `dtype`.

    weight_format: "dense" holds every weight as a `dtype` array; "blocks" keeps a GGUF's Q4_0 / Q4_1 / Q8_0 matrices
    as their int8 codes and scales, dequantized inside each step (a quarter of the bytes read per token, the
    same logits bit for bit; rsqr_jax.models.blocks); "tiled" holds the layer matrices among them in the tiled
    layout of the CPU kernel (rsqr_jax.kernels.block_matvec), which decode rows go through without a dequantized matrix (the same
    products summed in another order: logits within float32 rounding of the others'; a prompt's rows still take
    XLA's dot); "auto" (the default) is "tiled" on a CPU where the kernel builds, else "blocks" on a CPU (decode
    there is bound by the bytes of weights read) and "dense" elsewhere. A file without such blocks (an HF
    directory, a float GGUF) loads dense under any setting."""
    from rsqr_jax.kernels import block_matvec
    from rsqr_jax.models.loading import default_model_path

    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
    if weight_format == "tiled" and not block_matvec.available():
        raise ValueError(f"weight_format 'tiled': {block_matvec.unavailable_reason()}")
    path = default_model_path() if path is None else str(path)
    auto = weight_format == "auto"
    if auto:
        weight_format = ("dense" if jax.default_backend() != "cpu" else
                         "tiled" if block_matvec.available() else "blocks")
    loaded = _load_cached(path, str(jnp.dtype(dtype)), weight_format)
    if auto and loaded.weight_format == "blocks":
        block_matvec.usable()  # the kernel would hold these blocks: a warning once says why it cannot
    return loaded


def forward_logits(path_or_loaded, token_ids: np.ndarray, *, dtype: str = "float32") -> np.ndarray:
    """float32 logits [B, T, V] of full causal attention at positions 0..T-1 (parity tests, references)."""
    from rsqr_jax import policy as P
    from rsqr_jax.cache import init_cache
    from rsqr_jax.spec import CacheSpec
    from rsqr_jax.update import plan_step

    loaded = path_or_loaded if isinstance(path_or_loaded, LoadedModel) else load_model(path_or_loaded, dtype)
    cfg = loaded.config
    tokens = jnp.asarray(np.asarray(token_ids), jnp.int32)
    B, T = tokens.shape
    pol = P.full()
    spec = CacheSpec.for_policies(pol, dims=cfg, batch=B, dtype=loaded.dtype, max_chunk=T, max_len=T)
    apply_fn, params = split_apply(loaded.model)

    @jax.jit
    def run(params, tokens):
        cache = init_cache(spec)
        return apply_fn(params, tokens, cache, plan_step(cache, pol, T))[0]

    return np.asarray(run(params, tokens))
