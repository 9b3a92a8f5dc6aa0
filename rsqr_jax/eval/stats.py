"""The statistics every study reports, written once: the Wilson interval of a rate, exact McNemar for paired
answers, the block bootstrap for dependent per-token NLLs, and perplexity (whole and per bucket)."""

from __future__ import annotations

import math

import numpy as np


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score 95% interval for k successes out of n (0, 1 when n == 0)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))  # exact at k = 0 and k = n


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value for b vs c discordant pairs."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(0, min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def block_bootstrap(x, block: int, n: int = 2000, seed: int = 0) -> list[float]:
    """95% interval of the mean of x by resampling contiguous blocks (neighbouring tokens are dependent)."""
    x = np.asarray(x)
    nb = len(x) // block
    if nb < 2:
        return [float("nan"), float("nan")]
    means = x[:nb * block].reshape(nb, block).mean(1)
    rng = np.random.default_rng(seed)
    boots = means[rng.integers(0, nb, size=(n, nb))].mean(1)
    return [float(v) for v in np.percentile(boots, [2.5, 97.5])]


def ppl(nll) -> float:
    """Perplexity of a sequence of per-token NLLs."""
    return float(math.exp(float(np.mean(nll))))


def ppl_curve(nll, bucket: int) -> list[dict]:
    """Perplexity of each consecutive bucket of scored tokens (the last one may be shorter)."""
    return [{"start": s, "end": min(s + bucket, len(nll)), "ppl": ppl(nll[s:s + bucket])}
            for s in range(0, len(nll), bucket)]


def check_finite(key: str, nll) -> None:
    if not np.all(np.isfinite(nll)):
        raise RuntimeError(f"{key}: non-finite NLL (numerical failure)")
