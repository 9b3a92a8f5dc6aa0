"""Next-token selection inside jit, as chat users know it from llama.cpp / Ollama: greedy, temperature,
top-k, top-p, min-p, and repetition control over a ring of recent token ids.

The filter chain, in llama.cpp's order (its default sampler chain, which Ollama inherits):

    penalties -> top_k -> top_p -> min_p -> temperature -> draw

* penalties (over the last `repeat_last_n` tokens fed to the model, prompt included): a logit of a token
  present in the window is divided by `repeat_penalty` if > 0 and multiplied by it otherwise (llama.cpp),
  then `presence_penalty * [count > 0] + frequency_penalty * count` is subtracted (OpenAI). They apply to
  greedy decoding too: greedy is the argmax of the penalised logits.
* top_k, top_p and min_p act on the penalised logits at temperature 1; temperature only reshapes the
  distribution of the tokens that are left (so top_p 0.95 keeps the same set at any temperature).
* No sort of the vocabulary: the candidates are the `max_candidates` best tokens (`jax.lax.top_k`, a
  static count; top_k = min(top_k, max_candidates); top_k = 0 keeps all of them). top-p sums the
  candidates' true probabilities (normalised over the top_k tokens when top_k > 0, as llama.cpp does, or
  over the whole vocabulary when top_k = 0), so the nucleus is exact unless it would need more than
  max_candidates tokens: it is then cut to those. The draw renormalises over at most max_candidates tokens.
  With top_k 0, max_candidates therefore acts as a top_k (default 256; see DEFAULT_MAX_CANDIDATES).

`Sampling` holds the settings (validated: a one-line SamplingError); `Sampling.values()` is the pytree of
dynamic values the compiled functions take, so changing them never recompiles. `repeat_last_n` is also the
shape of the ring (a static capacity owned by the engine's Decoder); the values carry it as well, so a
stream may use a shorter window than its ring.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# The chat defaults (top_k 40 in llama.cpp and Ollama, 50 in HF generate) are exact at any cap >= 50. With
# top_k 0, a top_p 0.9-0.95 nucleus on a small model's text often exceeds 64 tokens and sometimes 256: capped
# at 256, the kept mass falls a few hundredths short of top_p at those positions. The candidate search at
# 256 stays under a millisecond on a 49k-logit row on one CPU core, a small fraction of a full sort.
DEFAULT_MAX_CANDIDATES = 256


class SamplingError(ValueError):
    """Sampling settings outside their domain (one line naming the field)."""


class SamplingValues(NamedTuple):
    """The dynamic sampling values (scalars, or a leading [N] axis for N streams)."""

    temperature: jax.Array  # float32
    top_k: jax.Array  # int32
    top_p: jax.Array  # float32
    min_p: jax.Array  # float32
    repeat_penalty: jax.Array  # float32
    presence_penalty: jax.Array  # float32
    frequency_penalty: jax.Array  # float32
    repeat_last_n: jax.Array  # int32: window length inside the ring (<= the ring's size)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampling settings. Defaults: greedy, every filter and penalty off, a 64-token window (llama.cpp)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off (all max_candidates candidates)
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repeat_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64  # static: the ring of recent token ids (0 = no ring)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """SamplingError (one line, naming the field) unless every setting is in its domain."""
        t = self.temperature
        if not (_is_num(t) and math.isfinite(t) and t >= 0):
            raise SamplingError(f"temperature must be finite and >= 0, got {t!r}")
        for name in ("top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not math.isfinite(v):
                raise SamplingError(f"{name} must be a finite number, got {v!r}")
        for name in ("top_k", "repeat_last_n"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise SamplingError(f"{name} must be an integer >= 0, got {v!r}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise SamplingError(f"min_p must be in [0, 1), got {self.min_p}")
        if not self.repeat_penalty > 0:
            raise SamplingError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (over a non-empty window)."""
        return self.repeat_last_n > 0 and (self.repeat_penalty != 1 or self.presence_penalty != 0
                                           or self.frequency_penalty != 0)

    def values(self) -> SamplingValues:
        """The dynamic values (device scalars) the compiled functions take."""
        f, i = jnp.float32, jnp.int32
        return SamplingValues(f(self.temperature), i(self.top_k), f(self.top_p), f(self.min_p),
                              f(self.repeat_penalty), f(self.presence_penalty), f(self.frequency_penalty),
                              i(self.repeat_last_n))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Sampling":
        """The inverse of to_json; SamplingError for anything else (unknown or badly typed fields)."""
        if not isinstance(d, dict):
            raise SamplingError(f"sampling settings must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise SamplingError(f"unknown sampling settings {unknown}")
        return cls(**d)


def stack_values(settings: Sequence[Sampling]) -> SamplingValues:
    """Per-stream values: numpy arrays with a leading [N] axis (one row per setting)."""
    fields = SamplingValues._fields
    f32 = {"temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"}
    return SamplingValues(*(np.array([getattr(s, k) for s in settings], np.float32 if k in f32 else np.int32)
                            for k in fields))


def push_recent(recent_BxR: jax.Array, tokens_BxC: jax.Array, n_valid) -> jax.Array:
    """The ring (oldest first, -1 = empty) after feeding the first n_valid tokens of the chunk."""
    R = recent_BxR.shape[-1]
    if R == 0:
        return recent_BxR
    both = jnp.concatenate([recent_BxR, tokens_BxC.astype(jnp.int32)], axis=-1)
    return jax.lax.dynamic_slice_in_dim(both, jnp.asarray(n_valid, jnp.int32), R, axis=-1)


def penalize(logits_BxV: jax.Array, recent_BxR: jax.Array, v: SamplingValues) -> jax.Array:
    """float32 [B, V] logits after the repeat / presence / frequency penalties over the recent window.

    The counts are a scatter-add of the ring into a [B, V] zero array (O(V), small next to the vocabulary
    projection); with no ring, or with every penalty off (a lax.cond), the logits pass through."""
    logits = logits_BxV.astype(jnp.float32)
    B, V = logits.shape
    R = recent_BxR.shape[-1]
    if R == 0:
        return logits

    def apply(logits):
        age = R - 1 - jnp.arange(R)  # the ring is oldest first
        live = (recent_BxR >= 0) & (age < v.repeat_last_n)
        ids = jnp.where(live, recent_BxR, V)  # V: dropped by the scatter
        rows = jnp.broadcast_to(jnp.arange(B)[:, None], ids.shape)
        counts = jnp.zeros((B, V), jnp.float32).at[rows, ids].add(1.0, mode="drop")
        present = counts > 0
        rep = jnp.where(logits > 0, logits / v.repeat_penalty, logits * v.repeat_penalty)
        out = jnp.where(present, rep, logits)
        return out - v.presence_penalty * present - v.frequency_penalty * counts

    on = (v.repeat_last_n > 0) & ((v.repeat_penalty != 1) | (v.presence_penalty != 0) | (v.frequency_penalty != 0))
    return jax.lax.cond(on, apply, lambda x: x, logits)


def filtered(logits_BxV: jax.Array, v: SamplingValues, max_candidates: int):
    """(candidate ids [B, C] int32, their tempered logits [B, C] with -inf for filtered-out ones) for
    temperature > 0; the input logits are already penalised. C = min(max_candidates, V)."""
    V = logits_BxV.shape[-1]
    C = min(int(max_candidates), V)
    cand_BxC, ids_BxC = jax.lax.top_k(logits_BxV, C)  # descending
    rank = jnp.arange(C)
    k = jnp.where(v.top_k > 0, jnp.minimum(v.top_k, C), C)
    keep = rank < k
    # top-p over true probabilities: normalised over the top_k tokens, or over the whole vocabulary
    lse = jnp.where(v.top_k > 0, jax.nn.logsumexp(jnp.where(keep, cand_BxC, -jnp.inf), axis=-1),
                    jax.nn.logsumexp(logits_BxV, axis=-1))
    p = jnp.where(keep, jnp.exp(cand_BxC - lse[:, None]), 0.0)
    before = jnp.cumsum(p, axis=-1) - p
    keep &= (v.top_p >= 1) | (before < v.top_p)  # the top token always stays
    # p >= min_p * p_max; log(0) = -inf keeps all. (The max, not cand[:, :1]: XLA:CPU turns a one-column slice
    # of top_k into a full sort of the vocabulary.)
    top_B1 = jnp.max(cand_BxC, axis=-1, keepdims=True)
    keep &= cand_BxC >= top_B1 + jnp.log(v.min_p)
    scaled = jnp.where(keep, cand_BxC / jnp.maximum(v.temperature, 1e-6), -jnp.inf)
    return ids_BxC.astype(jnp.int32), scaled


def probabilities(logits_BxV: jax.Array, v: SamplingValues, recent_BxR: jax.Array,
                  max_candidates: int = DEFAULT_MAX_CANDIDATES):
    """The distribution `sample` draws from: (candidate ids [B, C], probabilities [B, C] float32, zero for
    filtered-out candidates); greedy puts all mass on the argmax of the penalised logits."""
    logits = penalize(logits_BxV, recent_BxR, v)
    ids, scaled = filtered(logits, v, max_candidates)
    probs = jax.nn.softmax(scaled, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    onehot = (jnp.arange(ids.shape[-1]) == 0).astype(jnp.float32)
    ids = jnp.where(v.temperature > 0, ids, ids.at[:, 0].set(greedy))
    return ids, jnp.where(v.temperature > 0, probs, onehot)


def sample(logits_BxV: jax.Array, rng: jax.Array, v: SamplingValues, recent_BxR: jax.Array,
           max_candidates: int = DEFAULT_MAX_CANDIDATES) -> jax.Array:
    """int32 [B]: the next token of each row under the filter chain of the module docstring.

    Greedy (temperature 0) is the argmax of the penalised logits alone (lax.cond: no top_k, no draw)."""
    logits = penalize(logits_BxV, recent_BxR, v)

    def drawn(logits):
        ids, scaled = filtered(logits, v, max_candidates)
        pick = jax.random.categorical(rng, scaled, axis=-1)
        return jnp.take_along_axis(ids, pick[:, None], axis=-1)[:, 0]

    def greedy(logits):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    return jax.lax.cond(v.temperature > 0, drawn, greedy, logits)
