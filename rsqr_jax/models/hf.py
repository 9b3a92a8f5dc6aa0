"""Hugging Face model directories (``config.json`` + ``*.safetensors``, single file or sharded with an index) of
the supported families (``ARCHITECTURES``): config and canonical weights, one tensor at a time."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator

import numpy as np

from rsqr_jax.models.config import GEMMA, GLOBAL, LOCAL, ModelConfig, ModelLoadError
from rsqr_jax.models.layout import canonical_shapes, checked, empty, eos_with_end_of_turn, one_line, stack_layers
from rsqr_jax.rope import RopeScaling

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# config.json's model_type -> ModelConfig.arch (the same but for Gemma 3's text model)
_ARCH = {"gemma3_text": "gemma3"}
# The MLP activation each family's config may name (HF's key is hidden_act, or hidden_activation for Gemma).
_ACTIVATIONS = {"silu": ("silu",), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh")}


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {one_line(e)}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def _vocab_from_tokenizer_json(d: Path) -> dict[str, int] | None:
    """Special/added tokens of tokenizer.json (cheap: no tokenizer construction)."""
    f = d / "tokenizer.json"
    if not f.is_file():
        return None
    try:
        data = _read_json(f)
    except ModelLoadError:
        return None
    return {t["content"]: int(t["id"]) for t in data.get("added_tokens", []) if "content" in t and "id" in t}


def _as_list(v) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in (v if isinstance(v, (list, tuple)) else [v])]


def _rope(rope: dict, max_pos: int, where: Path) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of one rope parameter dict (HF's rope_parameters or rope_scaling)."""
    rope = dict(rope)
    theta = float(rope.get("rope_theta", 10000.0))
    rope.setdefault("original_max_position_embeddings", max_pos)  # HF falls back to max_position_embeddings
    try:
        return theta, RopeScaling.from_hf(rope)
    except ValueError as e:
        raise ModelLoadError(f"{e} in {where / 'config.json'}") from None


def _layer_types(cfg: dict, arch: str, n_layers: int, d: Path) -> tuple[str, ...] | None:
    """The per-layer attention types (None: every layer global), from config.json's layer_types or, for configs
    written before it existed, each family's own rule (a Mistral window applies to every layer)."""
    if arch in ("qwen2", "qwen3"):
        if cfg.get("use_sliding_window"):
            raise ModelLoadError(f"use_sliding_window=true in {d} is not supported (full attention only)")
        return None
    types = cfg.get("layer_types")
    if types is None:
        if arch == "gemma2":  # HF Gemma2: even layers slide
            types = [LOCAL if (i + 1) % 2 else GLOBAL for i in range(n_layers)]
        elif arch == "gemma3":
            pattern = int(cfg.get("sliding_window_pattern", 6))
            types = [LOCAL if (i + 1) % pattern else GLOBAL for i in range(n_layers)]
        elif cfg.get("sliding_window"):  # Mistral: one window for every layer
            types = [LOCAL] * n_layers
        else:
            return None
    types = tuple(types)
    if len(types) != n_layers or set(types) - {LOCAL, GLOBAL}:
        raise ModelLoadError(f"layer_types in {d / 'config.json'} must name {n_layers} layers, each {LOCAL!r} "
                             f"or {GLOBAL!r}")
    return types if LOCAL in types else None


def load_config(d: Path) -> ModelConfig:
    cfg = _read_json(d / "config.json")
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    expected = ARCHITECTURES.get(model_type)
    if expected is None or (archs and expected not in archs):
        name = archs[0] if archs else model_type
        raise ModelLoadError(
            f"unsupported architecture {name!r} (model_type {model_type!r}) in {d}: supported are "
            + ", ".join(f"{v} ({k})" for k, v in ARCHITECTURES.items())
        )
    arch = _ARCH.get(model_type, model_type)
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"mlp_bias=true in {d} is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if arch in GEMMA else "silu")
    if act not in _ACTIVATIONS["gelu_tanh" if arch in GEMMA else "silu"]:
        raise ModelLoadError(f"hidden_act={act!r} in {d} is not supported for {arch}")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"use_bidirectional_attention=true in {d} is not supported (causal models only)")
    try:
        hidden, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        n_kv = int(cfg.get("num_key_value_heads") or n_heads)
        head_dim = int(cfg.get("head_dim") or hidden // n_heads)
        n_layers = int(cfg["num_hidden_layers"])
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelLoadError(f"partial_rotary_factor in {d} is not supported")
        max_pos = int(cfg.get("max_position_embeddings", 8192))
        # transformers >= 5 writes `rope_parameters` (with rope_theta inside; per layer type for Gemma 3); older
        # versions `rope_scaling` and `rope_theta`.
        rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        local_theta = local_scaling = None
        if GLOBAL in rope or LOCAL in rope:
            if LOCAL in rope:
                local_theta, local_scaling = _rope(rope[LOCAL], max_pos, d)
            rope = dict(rope.get(GLOBAL) or {})
        if "rope_theta" in cfg and cfg["rope_theta"] is not None:
            rope["rope_theta"] = cfg["rope_theta"]
        theta, scaling = _rope(rope, max_pos, d)
        if arch == "gemma3" and local_theta is None:  # configs from before rope_parameters
            local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
        types = _layer_types(cfg, arch, n_layers, d)
        # a window that spans max_position_embeddings is no window at all (the layers stay typed: their RoPE)
        window = cfg.get("sliding_window") if types else None
        window = int(window) if window and int(window) < max_pos else None
        eos = _as_list(cfg.get("eos_token_id"))
        gen = d / "generation_config.json"
        if gen.is_file():
            eos = _as_list(_read_json(gen).get("eos_token_id")) + eos
        softcap = lambda key: None if cfg.get(key) is None else float(cfg[key])  # noqa: E731
        gemma = arch in GEMMA
        return ModelConfig(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            attention_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
            bos_token_id=None if cfg.get("bos_token_id") is None else int(cfg["bos_token_id"]),
            eos_token_ids=eos_with_end_of_turn(eos, _vocab_from_tokenizer_json(d)),
            max_position_embeddings=max_pos,
            qk_norm=arch in ("qwen3", "gemma3"),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim) if gemma else None,
            attn_logit_softcap=softcap("attn_logit_softcapping") if arch == "gemma2" else None,
            final_logit_softcap=softcap("final_logit_softcapping") if gemma else None,
            sliding_window=window,
            layer_types=types,
            local_rope_theta=local_theta if types else None,
            local_rope_scaling=local_scaling if types else None,
        )
    except ModelLoadError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"invalid config.json in {d}: {one_line(e)}") from None


_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


class SafetensorsFile:
    """Minimal safetensors reader (memory-mapped) that also handles BF16, which safetensors' numpy API cannot."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if n <= 0 or 8 + n > size:
                    raise ValueError(f"header length {n} exceeds file size {size}")
                header = json.loads(f.read(n))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"corrupt safetensors file {path}: {one_line(e)}") from None
        header.pop("__metadata__", None)
        self.header, self.data_start, self.size = header, 8 + n, size

    def keys(self):
        return self.header.keys()

    def get(self, name: str) -> np.ndarray:
        """float32 array of one tensor (a view of the file for F32; the mapping closes with the array)."""
        info = self.header[name]
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelLoadError(f"unsupported safetensors dtype {info['dtype']} for {name} in {self.path}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if self.data_start + end > self.size or end - begin != math.prod(shape) * np.dtype(dtype).itemsize:
            raise ModelLoadError(f"truncated safetensors file {self.path}: tensor {name} out of bounds")
        raw = np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_start + begin, shape=shape or (1,))
        if info["dtype"] == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)
        return np.asarray(raw, dtype=np.float32).reshape(shape)


def _tensor_index(d: Path) -> dict[str, SafetensorsFile]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map") or {}
        files = {f: SafetensorsFile(d / f) for f in sorted(set(weight_map.values())) if (d / f).is_file()}
        missing = sorted(set(weight_map.values()) - files.keys())
        if missing:
            raise ModelLoadError(f"{d}: shard {missing[0]} listed in model.safetensors.index.json is missing")
        return {name: files[f] for name, f in weight_map.items()}
    single = d / "model.safetensors"
    if single.is_file():
        st = SafetensorsFile(single)
        return {name: st for name in st.keys()}
    raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {d}")


def iter_weights(d: Path, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 canonical array), one tensor at a time."""
    index = _tensor_index(d)
    shapes = canonical_shapes(config)

    def get(name: str) -> np.ndarray:
        if name not in index:
            raise ModelLoadError(f"{d} lacks weight {name}")
        return index[name].get(name)

    per_layer = {
        "attn_norm": "input_layernorm.weight",
        "wq": "self_attn.q_proj.weight",
        "wk": "self_attn.k_proj.weight",
        "wv": "self_attn.v_proj.weight",
        "wo": "self_attn.o_proj.weight",
        "mlp_norm": "post_attention_layernorm.weight",
        "w_gate": "mlp.gate_proj.weight",
        "w_up": "mlp.up_proj.weight",
        "w_down": "mlp.down_proj.weight",
    }
    if config.gemma:  # Gemma's post_attention_layernorm is the attention's post-norm; the MLP has a pre- and a post-norm
        per_layer.update(mlp_norm="pre_feedforward_layernorm.weight", post_attn_norm="post_attention_layernorm.weight",
                         post_mlp_norm="post_feedforward_layernorm.weight")
    if config.qk_norm:
        per_layer.update(q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight")
    if config.attention_bias:
        per_layer.update(bq="self_attn.q_proj.bias", bk="self_attn.k_proj.bias", bv="self_attn.v_proj.bias")
    for name, suffix in per_layer.items():
        yield name, stack_layers(config, name, shapes[name], lambda i: get(f"model.layers.{i}.{suffix}"))
    for name, key in (("embed", "model.embed_tokens.weight"), ("final_norm", "model.norm.weight")):
        yield name, _copy_into(name, get(key), shapes)
    if not config.tie_word_embeddings:
        yield "lm_head", _copy_into("lm_head", get("lm_head.weight").T, shapes)


def _copy_into(name: str, w: np.ndarray, shapes: dict) -> np.ndarray:
    """`w` (possibly a view of the file) copied into an aligned array of the canonical shape."""
    out = empty(checked(name, w, shapes).shape)
    out[...] = w
    return out
