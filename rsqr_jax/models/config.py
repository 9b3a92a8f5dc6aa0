"""Static model configuration of the supported decoder families: Llama (Llama / Llama-3 rope scaling, SmolLM2,
Mistral), Qwen2/2.5 (q/k/v bias), Qwen3 (per-head q/k RMSNorm), Gemma 2 and Gemma 3 (text): what the decoder
computes and what the cache must hold per layer type."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from rsqr_jax.rope import RopeScaling, inverse_frequencies


class ModelLoadError(ValueError):
    """A model file or directory that cannot be used (missing, truncated, unsupported architecture)."""


SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")
GEMMA = ("gemma2", "gemma3")
# HF layer_types values: a local layer attends to its last `sliding_window` tokens, a global one to the policy's set.
LOCAL, GLOBAL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hashable, static: safe to close over in jit. `arch` names the family (SUPPORTED_ARCHITECTURES).

    qk_norm: RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3). Gemma (arch in GEMMA): (1 + w)
    norms, a post-norm after attention and after the MLP, GeGLU, embeddings scaled by sqrt(hidden).
    query_pre_attn_scalar: attention scale query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    attn_logit_softcap / final_logit_softcap: tanh(x / cap) * cap on the attention scores / the logits.
    layer_types: each layer LOCAL (sliding-window) or GLOBAL; None = every layer GLOBAL. sliding_window: the
    LOCAL layers' window (tokens each attends to, itself included), None when it spans the context (then they
    attend like global layers). local_rope_theta / local_rope_scaling: the LOCAL layers' RoPE (Gemma 3); None =
    the global one."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 8192
    qk_norm: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None
    local_rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.arch!r}: supported are {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - {LOCAL, GLOBAL}:
                raise ModelLoadError(f"layer_types must name {self.num_layers} layers, each {LOCAL!r} or {GLOBAL!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window must be positive, got {self.sliding_window}")
        # Every derived constant once, here: a model's trace reads them per layer.
        for name in DERIVED:
            getattr(self, name)

    @functools.cached_property
    def gemma(self) -> bool:
        return self.arch in GEMMA

    @functools.cached_property
    def local_rope(self) -> tuple[bool, ...]:
        """Per layer: typed LOCAL (it uses local_inv_freq)."""
        return tuple(t == LOCAL for t in (self.layer_types or (GLOBAL,) * self.num_layers))

    @functools.cached_property
    def is_local(self) -> tuple[bool, ...]:
        """Per layer: attends to a bounded window (typed LOCAL, with a sliding_window): it keeps a ring of its own
        in the cache, the other layers the policy's cache."""
        return tuple(r and self.sliding_window is not None for r in self.local_rope)

    @functools.cached_property
    def local_layers(self) -> int:
        """How many layers are local: the cache gives them a ring of their own (CacheSpec.local_layers)."""
        return sum(self.is_local)

    @functools.cached_property
    def local_window(self) -> int:
        """The local layers' window (tokens each attends to, itself included); 0 without local layers."""
        return int(self.sliding_window) if self.local_layers else 0

    @functools.cached_property
    def attn_scale(self) -> float | None:
        """The attention scale when it is not head_dim ** -0.5 (None: the kernels' default)."""
        return None if self.query_pre_attn_scalar is None else float(self.query_pre_attn_scalar) ** -0.5

    @functools.cached_property
    def inv_freq(self) -> np.ndarray:
        """float32 [head_dim/2] inverse frequencies of the global layers (numpy: a model constant, so angles
        stay exact)."""
        return inverse_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)

    @functools.cached_property
    def local_inv_freq(self) -> np.ndarray:
        """float32 [head_dim/2] inverse frequencies of the local layers."""
        if self.local_rope_theta is None:
            return self.inv_freq
        return inverse_frequencies(self.head_dim, self.local_rope_theta, self.local_rope_scaling)


DERIVED = ("gemma", "local_rope", "is_local", "local_layers", "local_window", "attn_scale", "inv_freq",
           "local_inv_freq")
