#!/usr/bin/env python3
"""Data for lm-eval's own `lambada_openai` and `wikitext` tasks, from the verbatim licence texts the package
ships (rsqr_jax.data.LICENSES), in those tasks' schemas: lambada rows {"text": a passage whose last word is the
target}, wikitext splits of {"page": a whole document}. utils.py builds it at load time (deterministic,
seed 15); nothing is shipped.

    python tests/data/lm_eval_builtin/make_data.py OUT_DIR   # writes lambada.json and wikitext.json to look at

lambada passages are 250-1400 words (~350-1900 SmolLM2 tokens, so a 128-token window evicts most of
each), cut at a sentence end, the final punctuation removed so the last word is what is predicted."""

from __future__ import annotations

import json
import os
import re

import numpy as np

import rsqr_jax.data

HERE = os.path.dirname(os.path.abspath(__file__))
LICENSES = os.fspath(rsqr_jax.data.LICENSES)
SEED = 15
PASSAGE_SOURCES = ("GPL-3", "GPL-2", "LGPL-2.1", "GFDL-1.3", "MPL-2.0", "Apache-2.0", "MPL-1.1", "LGPL-2")
# whole documents, shortest first (lm-eval's --limit takes the first ones)
DOCUMENTS = {"test": ("BSD", "Artistic", "CC0-1.0", "LGPL-3", "Apache-2.0", "GPL-1"),
             "validation": ("GFDL-1.2",), "train": ("MPL-2.0",)}


def _read(name: str) -> str:
    with open(os.path.join(LICENSES, name), encoding="utf-8") as f:
        return f.read()


def passages(n_per_source: int = 3) -> list[dict]:
    rng = np.random.default_rng(SEED)
    rows = []
    for name in PASSAGE_SOURCES:
        words = _read(name).split()  # single spaces: lambada_openai splits the target off at ' '
        for _ in range(n_per_source):
            n = int(rng.integers(250, 1400))
            if len(words) < n + 20:
                n = len(words) - 20
            start = int(rng.integers(0, len(words) - n))
            # the first sentence end at or after start + n whose word (without its punctuation) is a word
            for end in range(start + n, len(words)):
                w = words[end]
                if re.fullmatch(r"[A-Za-z]{3,}[.;:]", w):
                    rows.append({"text": " ".join(words[start:end] + [w[:-1]]), "source": name})
                    break
    return rows


def documents() -> dict[str, list[dict]]:
    return {split: [{"page": _read(name), "source": name} for name in names] for split, names in DOCUMENTS.items()}


def main() -> None:
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else "."
    with open(os.path.join(out, "lambada.json"), "w") as f:
        json.dump({"test": passages()}, f, indent=0, ensure_ascii=False)
    with open(os.path.join(out, "wikitext.json"), "w") as f:
        json.dump(documents(), f, indent=0, ensure_ascii=False)


if __name__ == "__main__":
    main()
