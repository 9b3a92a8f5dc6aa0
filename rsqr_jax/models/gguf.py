"""GGUF files (llama.cpp format, any quantization gguf-py can dequantize), architectures ``llama`` (Mistral GGUFs
are written as ``llama`` too), ``qwen2``, ``qwen3``, ``gemma2`` and ``gemma3``: config, canonical weights
(dequantized one tensor at a time) and the tokenizer.

llama.cpp's ``convert_hf_to_gguf`` permutes the q/k rows of ``llama`` models into the interleaved RoPE layout
(not those of ``qwen2`` / ``qwen3`` / Gemma, whose per-head q/k norms it writes as ``attn_q_norm`` /
``attn_k_norm``); ``iter_weights`` undoes that permutation, so the weights come out in the canonical half-split
layout. For Gemma the converter adds 1 to every RMSNorm weight (llama.cpp's norm is ``x * w``, Gemma's
``x * (1 + w)``); ``iter_weights`` subtracts it again, so the norms come out as HF holds them.
"""

from __future__ import annotations

import functools
import math
import mmap
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from rsqr_jax.models.blocks import BLOCK_TYPES, BlockWeights, decode_blocks
from rsqr_jax.models.config import GEMMA, GLOBAL, LOCAL, ModelConfig, ModelLoadError
from rsqr_jax.models.layout import canonical_shapes, empty, eos_with_end_of_turn, one_line, stack_layers
from rsqr_jax.rope import RopeScaling, inverse_frequencies

MAGIC = b"GGUF"
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the layer weights a BlockWeights can hold
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")


@functools.lru_cache(maxsize=1)
def _fast_reader_class():
    import gguf

    class FastGGUFReader(gguf.GGUFReader):
        """GGUFReader over a plain ndarray view of its memmap: the reader slices the file ~250k times to
        parse the token list, and np.memmap's per-slice subclass overhead triples the parse time. Keeps the
        mmap so the pages of tensors already dequantized can be dropped from this process (`drop_pages`)."""

        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):
            self._mmap = getattr(value, "_mmap", None)
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        def drop_pages(self) -> None:
            """Unmap the resident file pages (they stay in the page cache; a later read faults them back)."""
            if self._mmap is not None and hasattr(mmap, "MADV_DONTNEED"):
                self._mmap.madvise(mmap.MADV_DONTNEED)

    return FastGGUFReader


@functools.lru_cache(maxsize=1)
def _reader(path: str, size: int, mtime_ns: int):  # size/mtime only key the cache
    try:
        reader = _fast_reader_class()(path)
    except Exception as e:  # gguf raises ValueError/IndexError/struct.error on truncated or corrupt files
        raise ModelLoadError(f"corrupt or truncated GGUF file {path}: {one_line(e)}") from None
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes:
            raise ModelLoadError(
                f"truncated GGUF file {path}: tensor {t.name} has {t.data.nbytes} of {t.n_bytes} bytes"
            )
    return reader


def open_reader(p: Path):
    """The parsed file (one parse per process for a file that does not change: config, weights and
    tokenizer all read it)."""
    st = p.stat()
    return _reader(str(p.resolve()), st.st_size, st.st_mtime_ns)


def reader_is_open() -> bool:
    """Whether a parsed file is held (open_reader's cache)."""
    return _reader.cache_info().currsize > 0


def forget_readers() -> None:
    """Drop the cached parse (its memmap and ~250k small arrays of metadata) once nothing needs it."""
    _reader.cache_clear()


def _value(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception as e:
        raise ModelLoadError(f"unreadable GGUF metadata {key!r}: {one_line(e)}") from None


def _float(reader, key: str, default: float | None = None) -> float | None:
    """A float metadata value; a float32 one as the decimal it was written from (the shortest that rounds to it:
    1e-05, not 9.999999747378752e-06), so a GGUF gives the config of the HF directory it was converted from."""
    from gguf import GGUFValueType

    v = _value(reader, key)
    if v is None:
        return default
    return float(str(np.float32(v))) if reader.fields[key].types[0] == GGUFValueType.FLOAT32 else float(v)


def _tokens(reader) -> list[str] | None:
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        return None
    return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]


def _tensors(reader) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def _int(reader, key: str, default: int | None = None) -> int | None:
    v = _value(reader, key, default)
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
    reproduce the tensor to 1e-4. (float64 here: head_dim/2 numbers, exactness of the fit matters.)
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


# What llama.cpp assumes where a Gemma file says nothing (src/models/gemma2.cpp and gemma3.cpp, llama-hparams.h).
# Its converter never writes the local:global pattern nor the query scale, and Gemma 2's converter writes no RoPE
# base (llama.cpp's default, 10000, is Gemma 2's). By architecture: the local layers' window (Gemma 2: 4096; Gemma 3:
# none, then every layer is global with the global RoPE), the period of the local:global pattern (the last layer of
# every 2 / 6 is global), the local layers' RoPE base (Gemma 2: the global one; Gemma 3: 10000, which older
# converters did not write), the soft-caps (Gemma 2: 50 on the attention scores, 30 on the logits; Gemma 3: no
# attention soft-cap, a logit one only when the file gives it), and the layer count of the 27B model, whose query
# scale is (hidden / heads) ** -0.5 instead of head_dim ** -0.5 (query_pre_attn_scalar in the HF config).
_GEMMA_DEFAULTS = {
    "gemma2": dict(window=4096, period=2, local_theta=None, attn_cap=50.0, final_cap=30.0, layers_27b=46),
    "gemma3": dict(window=None, period=6, local_theta=10000.0, attn_cap=None, final_cap=None, layers_27b=62),
}


def _gemma_layer_types(reader, arch: str, n_layers: int, period: int) -> tuple[str, ...]:
    """LOCAL / GLOBAL per layer from `attention.sliding_window_pattern` as llama.cpp reads it: one flag per layer
    (true: local), or a period n whose last layer is global (0: every layer local); `period` when absent."""
    key = f"{arch}.attention.sliding_window_pattern"
    v = _value(reader, key, period)
    if isinstance(v, (list, tuple)):
        if len(v) != n_layers:
            raise ModelLoadError(f"GGUF metadata {key} has {len(v)} entries for {n_layers} layers")
        flags = [bool(f) for f in v]
    else:
        n = int(v)
        flags = [n == 0 or i % n < n - 1 for i in range(n_layers)]
    return tuple(LOCAL if f else GLOBAL for f in flags)


def _gemma_config(reader, arch: str, n_layers: int, ctx: int, hidden: int, n_heads: int, head_dim: int,
                  theta: float, scaling: RopeScaling | None) -> dict:
    """The Gemma fields of ModelConfig as llama.cpp reads the file (_GEMMA_DEFAULTS where it is silent): the config
    the HF directory it was converted from gives (hf.load_config)."""
    d = _GEMMA_DEFAULTS[arch]
    window = _int(reader, f"{arch}.attention.sliding_window", d["window"])
    types = _gemma_layer_types(reader, arch, n_layers, d["period"]) if window else None
    types = types if types and LOCAL in types else None
    local_theta = _float(reader, f"{arch}.rope.freq_base_swa", d["local_theta"])
    if arch == "gemma2" and local_theta == theta:
        local_theta = None  # one RoPE for every layer
    attn_cap = _float(reader, f"{arch}.attn_logit_softcapping", d["attn_cap"]) if arch == "gemma2" else None
    final_cap = _float(reader, f"{arch}.final_logit_softcapping", d["final_cap"])
    return dict(
        query_pre_attn_scalar=float(hidden // n_heads if n_layers == d["layers_27b"] else head_dim),
        attn_logit_softcap=attn_cap,
        final_logit_softcap=final_cap or None,
        # a window that spans the context is no window at all (the layers stay typed: their RoPE)
        sliding_window=window if types and window < ctx else None,
        layer_types=types,
        local_rope_theta=local_theta if types else None,
        # Gemma 2's local layers share the global scaling; Gemma 3's run unscaled
        local_rope_scaling=scaling if types and arch == "gemma2" and local_theta is not None else None,
    )


def load_config(p: Path) -> ModelConfig:
    reader = open_reader(p)
    arch = _value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r} in {p.name}: supported are {', '.join(GGUF_ARCHITECTURES)}"
        )
    tensors = _tensors(reader)

    def req(key: str) -> int:
        v = _int(reader, f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(f"GGUF metadata {arch}.{key} missing in {p.name}")
        return v

    hidden, n_heads = req("embedding_length"), req("attention.head_count")
    n_kv = _int(reader, f"{arch}.attention.head_count_kv", n_heads)
    head_dim = _int(reader, f"{arch}.attention.key_length", hidden // n_heads)
    rot_dim = _int(reader, f"{arch}.rope.dimension_count", head_dim)
    if rot_dim != head_dim:
        raise ModelLoadError(f"partial rotary embeddings (rope dim {rot_dim} < head dim {head_dim}) are not supported")
    theta = _float(reader, f"{arch}.rope.freq_base", 10000.0)
    ctx = _int(reader, f"{arch}.context_length", 8192)

    scaling = None
    kind = _value(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        factor = _float(reader, f"{arch}.rope.scaling.factor", 1.0)
        scaling = RopeScaling("linear", factor, original_max_position_embeddings=ctx)
    elif kind not in ("none", None):
        raise ModelLoadError(f"unsupported GGUF rope scaling {kind!r}: supported are none, linear, llama3")
    if "rope_freqs.weight" in tensors:
        if scaling is not None:
            raise ModelLoadError("GGUF has both rope.scaling.type and a rope_freqs tensor; unsupported")
        scaling = _llama3_from_rope_freqs(_dequantize(tensors["rope_freqs.weight"]), head_dim, theta, ctx)

    tokens = _tokens(reader)
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"GGUF {p.name} has no token_embd.weight tensor")
    # GGUF shapes are reversed ([H, V]); the weights define the model: a padded token list must not change shapes
    vocab = int(tensors["token_embd.weight"].shape[-1])
    vocab_map = {t: i for i, t in enumerate(tokens)} if tokens else None
    eos = [_int(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    n_layers = req("block_count")
    eps = _float(reader, f"{arch}.attention.layer_norm_rms_epsilon")
    if eps is None and arch in GEMMA:  # llama.cpp requires it of Gemma files (and assumes nothing)
        raise ModelLoadError(f"GGUF metadata {arch}.attention.layer_norm_rms_epsilon missing in {p.name}")
    if arch in GEMMA:
        family = _gemma_config(reader, arch, n_layers, ctx, hidden, n_heads, head_dim, theta, scaling)
    else:
        # Mistral's sliding window on every layer, where the file records one shorter than the context (see hf.py;
        # Qwen's is never on in its checkpoints).
        window = _int(reader, "llama.attention.sliding_window") if arch == "llama" else None
        window = window if window and window < ctx else None
        family = dict(sliding_window=window, layer_types=(LOCAL,) * n_layers if window else None)

    return ModelConfig(
        arch=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=req("feed_forward_length"),
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=1e-6 if eps is None else eps,
        rope_theta=theta,
        rope_scaling=scaling,
        # llama.cpp's Gemma 2 always projects with token_embd (its converter writes no output.weight)
        tie_word_embeddings=arch == "gemma2" or "output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=_int(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_with_end_of_turn(eos, vocab_map),
        max_position_embeddings=ctx,
        qk_norm=arch in ("qwen3", "gemma3"),
        **family,
    )


def _dequantize(t, out: np.ndarray | None = None) -> np.ndarray:
    """float32 [out, in] (or [n]) of one GGUF tensor (gguf-py dequantizes in float32). With `out` (of the
    shape the config implies) the rows are dequantized into it a block at a time: no full-size temporary."""
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF ne[] is innermost-first
    if out is not None and shape != out.shape:
        raise ModelLoadError(f"GGUF tensor {t.name} has shape {shape}, config implies {out.shape}")
    blocked = out is not None and len(shape) == 2 and t.data.shape[0] == shape[0]  # one data row per tensor row
    try:
        if not blocked:
            a = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            if out is None:
                return a
            out[...] = a
            return out
        for r in range(0, shape[0], 4096):
            out[r:r + 4096] = dequantize(t.data[r:r + 4096], t.tensor_type).reshape(-1, shape[1])
        return out
    except Exception as e:
        raise ModelLoadError(f"cannot dequantize GGUF tensor {t.name} ({t.tensor_type.name}): {one_line(e)}") from None


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `LlamaModel.permute` on the output rows of a q/k weight [out, in] or bias [out].

    llama.cpp: w.reshape(n, 2, d/2, ...).swapaxes(1, 2) (half-split -> interleaved); inverse:
    w.reshape(n, d/2, 2, ...).swapaxes(1, 2).
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _block_type(tensors: dict, names: list[str]) -> str | None:
    """The block type (rsqr_jax.models.blocks.BLOCK_TYPES) all of these tensors share, else None."""
    kinds = {tensors[n].tensor_type.name if n in tensors else None for n in names}
    kind = kinds.pop() if len(kinds) == 1 else None
    return kind if kind in BLOCK_TYPES else None


def _blocks_of(t, heads: int | None, permuted: bool, transpose: bool) -> tuple:
    """(codes, scale, offset) of one block-quantized tensor [out, in]: q/k rows unpermuted like the float path,
    transposed to the canonical [in, out] when `transpose` (blocks then run along axis -2)."""
    codes, scale, offset = decode_blocks(t.data, t.tensor_type.name)
    parts = [codes, scale] + ([offset] if offset is not None else [])
    if heads is not None and permuted:
        parts = [_unpermute_rows(a, heads) for a in parts]
    if transpose:
        parts = [np.ascontiguousarray(a.T) for a in parts]
    return parts[0], parts[1], parts[2] if offset is not None else None


def iter_weights(p: Path, config: ModelConfig, *, blocks: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, float32 canonical array), one tensor at a time; the file pages read for a tensor are
    dropped from this process once it is dequantized, so only the arrays the caller keeps stay resident.

    blocks: the matrices (q/k/v/o, MLP, embedding, output) stored as Q4_0 / Q4_1 / Q8_0 in every layer come as
    `BlockWeights` (the file's codes and scales, exact) instead of float32 arrays; any other type is dequantized."""
    reader = open_reader(p)
    tensors = _tensors(reader)
    permuted = config.arch == "llama"  # convert_hf_to_gguf permutes q/k only for LlamaModel
    shapes = canonical_shapes(config)

    def get(name: str, heads: int | None = None) -> np.ndarray:
        if name not in tensors:
            raise ModelLoadError(f"GGUF {p.name} lacks tensor {name}")
        w = _dequantize(tensors[name])
        return _unpermute_rows(w, heads) if heads is not None and permuted else w

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
    if config.gemma:  # ffn_norm is the MLP's pre-norm; Gemma adds a post-norm after attention and after the MLP
        per_layer.update(post_attn_norm=("post_attention_norm.weight", None),
                         post_mlp_norm=("post_ffw_norm.weight", None))
    if config.qk_norm:
        per_layer.update(q_norm=("attn_q_norm.weight", None), k_norm=("attn_k_norm.weight", None))
    if config.attention_bias:
        per_layer.update(
            bq=("attn_q.bias", config.num_heads), bk=("attn_k.bias", config.num_kv_heads), bv=("attn_v.bias", None)
        )
    # the converter's +1 on Gemma's norm weights (every canonical name ending in "norm" is a norm weight); v - 1 is
    # exact in float32 for a stored v >= 0.5, so the decoder's 1 + w gives the file's v back
    shift = 1.0 if config.gemma else 0.0
    for name, (suffix, heads) in per_layer.items():
        names = [f"blk.{i}.{suffix}" for i in range(config.num_layers)]
        if blocks and name in MATRICES and _block_type(tensors, names):
            per = [_blocks_of(tensors[n], heads, permuted, transpose=True) for n in names]
            stack = lambda k: None if per[0][k] is None else np.stack([b[k] for b in per])  # noqa: E731
            w = BlockWeights.from_blocks(stack(0), stack(1), stack(2), block_axis=-2)
            if w.shape != shapes[name]:
                raise ModelLoadError(f"GGUF tensor {names[0]} has shape {w.shape[1:]}, config implies {shapes[name][1:]}")
            reader.drop_pages()
            yield name, w
            continue
        w = stack_layers(config, name, shapes[name], lambda i: get(f"blk.{i}.{suffix}", heads))
        if name.endswith("norm"):
            w -= shift
        reader.drop_pages()
        yield name, w
    singles = {"embed": "token_embd.weight", "final_norm": "output_norm.weight"}
    for name, tensor in singles.items():
        if tensor not in tensors:
            raise ModelLoadError(f"GGUF {p.name} lacks tensor {tensor}")
        if blocks and name == "embed" and _block_type(tensors, [tensor]):  # [V, H], blocks along H
            w = BlockWeights.from_blocks(*_blocks_of(tensors[tensor], None, False, transpose=False), block_axis=-1)
            if w.shape != shapes[name]:
                raise ModelLoadError(f"GGUF tensor {tensor} has shape {w.shape}, config implies {shapes[name]}")
            reader.drop_pages()
            yield name, w
            continue
        w = _dequantize(tensors[tensor], out=empty(shapes[name]))
        if name.endswith("norm"):
            w -= shift
        reader.drop_pages()
        yield name, w
    if not config.tie_word_embeddings:
        if blocks and _block_type(tensors, ["output.weight"]):
            w = BlockWeights.from_blocks(*_blocks_of(tensors["output.weight"], None, False, transpose=True), block_axis=-2)
        else:
            w = empty(shapes["lm_head"])
            w[...] = get("output.weight").T
        reader.drop_pages()
        yield "lm_head", w


# --------------------------------------------------------------------------------------------- tokenizer


def _tokenizer_inputs(reader) -> tuple[str, dict, dict]:
    """(architecture, tokenizer_dict, tokenizer_config) as transformers' `get_gguf_tokenizer` builds them,
    from our parse of the file (transformers' own GGUF reader imports torch, ~200 MB we do not need)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import _SPECIAL_TOKENS, GGUF_TOKENIZER_MAPPING

    grouped = {}
    for group, renames in GGUF_TOKENIZER_MAPPING.items():
        grouped[group] = {}
        for key, name in renames.items():
            full = f"tokenizer.{key}"
            if full in reader.fields:
                grouped[group][name] = _tokens(reader) if full == "tokenizer.ggml.tokens" else _value(reader, full)
    tokenizer, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    kind = tokenizer.get("tokenizer_type")
    if kind == "llama":  # as transformers: llama.cpp adds BOS to a sentencepiece vocabulary that says nothing
        tokenizer_config.setdefault("add_bos_token", True)
    elif kind == "gemma4":
        tokenizer_config["add_bos_token"] = False
    for name, key in _SPECIAL_TOKENS.items():
        token_id = _value(reader, f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return _value(reader, "general.architecture"), tokenizer, tokenizer_config


def load_tokenizer(p: Path):
    """The transformers tokenizer `AutoTokenizer.from_pretrained(dir, gguf_file=...)` builds (same backend,
    special tokens and chat template), built from our cached parse without importing torch."""
    reader = open_reader(p)
    try:
        from transformers import TokenizersBackend
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

        architecture, tokenizer_dict, tokenizer_config = _tokenizer_inputs(reader)
        backend, additional = convert_gguf_tokenizer(architecture, tokenizer_dict)
        tok = TokenizersBackend(tokenizer_object=backend, name_or_path=str(p.parent),
                                **tokenizer_config, **additional)
    except ImportError:  # another transformers version: its own (heavier) GGUF path
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)
    if not getattr(tok, "chat_template", None):
        template = _value(reader, "tokenizer.chat_template")
        if template:
            tok.chat_template = template
    return tok
