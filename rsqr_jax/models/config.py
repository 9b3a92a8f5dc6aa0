"""Static model configuration for the Llama family (Llama / Llama-3 rope scaling, SmolLM2, Qwen2/2.5)."""

from __future__ import annotations

import dataclasses

import numpy as np

from rsqr_jax.rope import RopeScaling, inverse_frequencies


class ModelLoadError(ValueError):
    """A model file or directory that cannot be used (missing, truncated, unsupported architecture)."""


SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hashable, static: safe to close over in jit. `arch` is "llama" or "qwen2" (q/k/v bias)."""

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

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.arch!r}: supported are {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def inv_freq(self) -> np.ndarray:
        """float32 [head_dim/2] inverse frequencies (numpy: a model constant, so angles stay exact)."""
        return inverse_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)
