"""The tiny random model as an experiments `Model` (with a byte tokenizer) and a seeded text file, for the
in-process tests of rsqr_lab.studies.{streams, policies, ppl}. One model per dtype for the whole test
run, so equal Decoders share their compilations."""

from __future__ import annotations

import functools

import numpy as np

from rsqr_jax.eval.perplexity import Model
from rsqr_jax.models.tiny import tiny_config, tiny_model

CFG = tiny_config()
SEED = 0  # weights and text


class ByteTokenizer:
    """UTF-8 bytes modulo the tiny vocabulary: deterministic, no files."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b % CFG.vocab_size for b in text.encode()]


@functools.lru_cache(maxsize=None)
def load(dtype: str = "float32") -> Model:
    apply_fn, params = tiny_model(CFG, SEED, dtype=dtype)
    return Model(apply_fn, params, CFG, ByteTokenizer(), dtype, f"tiny-random(seed={SEED})")


def write_text(path, n_words: int = 200, seed: int = SEED):
    """A seeded text of n_words random words (about 5 tokens a word) at path; returns str(path)."""
    rng = np.random.default_rng(seed)
    words = ["the", "creature", "ice", "night", "Victor", "wrote", "of", "a", "letter", "sea", "cold", "light"]
    path.write_text(" ".join(rng.choice(words, size=n_words)) + "\n")
    return str(path)
