"""Our decoder vs transformers (torch, float32, full attention, positions 0..T-1).

Uses `rsqr_jax.models.llama.forward_logits(path_or_loaded, token_ids[B, T]) -> float32 logits [B, T, V]`.
"""

from __future__ import annotations

import numpy as np
import pytest

import hf_fixtures

# Text for the real-model prompt (Frankenstein, ch. 5; public domain), so the 64 tokens are natural language.
PROMPT_TEXT = (
    "It was on a dreary night of November that I beheld the accomplishment of my toils. With an anxiety "
    "that almost amounted to agony, I collected the instruments of life around me, that I might infuse a "
    "spark of being into the lifeless thing that lay at my feet. It was already one in the morning; the "
    "rain pattered dismally against the panes, and my candle was nearly burnt out, when, by the glimmer "
    "of the half-extinguished light, I saw the dull yellow eye of the creature open."
)


def _forward_logits(path_or_loaded, token_ids: np.ndarray) -> np.ndarray:
    from rsqr_jax.models.llama import forward_logits  # the decoder under test

    out = np.asarray(forward_logits(path_or_loaded, token_ids))
    assert out.dtype == np.float32, out.dtype
    return out


@pytest.mark.parametrize("name", ["llama", "llama_llama3", "llama_untied_hd32", "llama_linear", "qwen2", "qwen2_tied"])
def test_tiny_parity_with_transformers(tiny_hf_dirs, name):
    spec, directory = tiny_hf_dirs[name]
    ids = np.random.default_rng(spec.seed).integers(0, spec.vocab_size, size=(2, 40), dtype=np.int64)
    ref = hf_fixtures.hf_logits(directory, ids)
    ours = _forward_logits(str(directory), ids.astype(np.int32))
    assert ours.shape == ref.shape == (2, 40, spec.vocab_size)
    err = float(np.abs(ours - ref).max())
    assert err < 1e-4, f"{name}: max |dlogit| = {err:.3g} (logit scale {np.abs(ref).max():.3g})"


@pytest.fixture(scope="module")
def smollm2_prompt_ids(smollm2_path):
    from rsqr_jax.models.loading import load_tokenizer

    ids = load_tokenizer(smollm2_path)(PROMPT_TEXT, add_special_tokens=False).input_ids
    assert len(ids) >= 64
    return np.asarray(ids[:64], dtype=np.int64)[None]


@pytest.mark.slow
def test_smollm2_parity_with_transformers_gguf(smollm2_path, smollm2_hf_model, smollm2_prompt_ids):
    """Same GGUF file, transformers' own dequantization and q/k handling: 64-token prompt."""
    ref = hf_fixtures.hf_logits(smollm2_hf_model, smollm2_prompt_ids)
    ours = _forward_logits(smollm2_path, smollm2_prompt_ids.astype(np.int32))
    assert ours.shape == ref.shape == (1, 64, 49152)
    err = float(np.abs(ours - ref).max())
    assert err < 1e-3, f"SmolLM2: max |dlogit| = {err:.3g} (logit scale {np.abs(ref).max():.3g})"
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.98
