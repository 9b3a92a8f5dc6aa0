"""Test and experiment support, shared by tests/, rsqr_lab.studies and the GPU check (no copies):
float64 references (`oracle`, `hybrid_oracle`), kernel inputs (`kernel`), transformers' torch reference
(`hf_reference`, lazy torch), toy tokenizers (`tokenizer`), a trained tiny model (`train`), and `drawn_seed`.
The tiny random models are installed with the library (rsqr_jax.models.tiny: the RULER command's smoke mode).

Above the library: it may import any of `rsqr_jax`; it wires a real decoder for tests, lazily."""

from __future__ import annotations

import numpy as np


def drawn_seed(name: str) -> int:
    """A fresh random seed, printed with `name`: a test that draws its data anew each run stays reproducible
    from its log (pytest shows the print of a failing test)."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"{name}: seed {seed}")
    return seed
