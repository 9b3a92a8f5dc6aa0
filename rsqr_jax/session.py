"""A streaming generation session: cache + policy + sampler state + the two jitted steps (prefill, decode).

Model-agnostic: it takes the model's pure apply function. Each step is compiled once (prefill at a
fixed chunk size with a dynamic number of real tokens, decode at one token) and donates the cache,
so a session of any length runs in place under exactly two compilations.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from rsqr_jax.cache import CacheSpec, KVCache, init_cache, validate
from rsqr_jax.policy import FULL as P_FULL
from rsqr_jax.policy import Policy
from rsqr_jax.stream import decode_and_sample


@functools.lru_cache(maxsize=8)
def _jitted_step(apply_fn):
    fn = functools.partial(decode_and_sample, apply_fn)
    return jax.jit(fn, donate_argnums=(2,))


class Session:
    """Feed tokens, generate tokens; the cache stays bounded by the policy however long it runs.

    `pending` is the token sampled after the last fed token (None before the first feed, or right
    after generation emitted an end-of-sequence token, which is never fed).
    """

    def __init__(self, apply_fn: Callable, params, spec: CacheSpec, policy: Policy, *, prefill_chunk: int = 64,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, eos_ids: Iterable[int] = ()):
        if spec.batch != 1:
            raise ValueError("a Session streams one sequence (spec.batch must be 1)")
        self.prefill_chunk = min(prefill_chunk, spec.max_chunk)
        validate(policy, spec, chunk=self.prefill_chunk)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.apply_fn, self.params, self.spec, self.policy = apply_fn, params, spec, policy
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.cache: KVCache = init_cache(spec)
        self.rng = jax.random.PRNGKey(seed)
        self.pending: int | None = None
        self._step = _jitted_step(apply_fn)
        self._compiled: dict[int, Callable] = {}
        self.compile_s = 0.0

    @property
    def n_tokens(self) -> int:
        """Tokens fed so far (the stream position of the next token)."""
        return int(self.cache.t)

    def _args(self, ids: np.ndarray, n_valid: int):
        return (self.params, jnp.asarray(ids[None], jnp.int32), self.cache, self.policy, jnp.int32(n_valid), self.rng,
                jnp.float32(self.temperature), jnp.float32(self.top_p))

    def compiled(self, chunk: int) -> Callable:
        """The ahead-of-time compiled step for a chunk size (1 = decode); compile time is kept apart."""
        if chunk not in self._compiled:
            t0 = time.perf_counter()
            self._compiled[chunk] = self._step.lower(*self._args(np.zeros(chunk, np.int32), chunk)).compile()
            self.compile_s += time.perf_counter() - t0
        return self._compiled[chunk]

    def warmup(self) -> None:
        """Compile the prefill and decode steps now (so timings exclude compilation)."""
        self.compiled(self.prefill_chunk)
        self.compiled(1)

    def _run(self, ids: np.ndarray, n_valid: int) -> int:
        fn = self.compiled(ids.size)
        nxt, self.cache, self.rng = fn(*self._args(ids, n_valid))
        return int(nxt[0])

    def feed(self, ids: Iterable[int]) -> int:
        """Append tokens (prefill in chunks); returns and remembers the sampled next token."""
        ids = np.asarray(list(ids), np.int32)
        if ids.size == 0:
            raise ValueError("nothing to feed: empty token list")
        full_policy = int(np.asarray(self.policy.mode)) == P_FULL
        if full_policy and self.n_tokens + ids.size > self.spec.ring_capacity:
            raise ValueError(f"full attention cache holds {self.spec.ring_capacity} tokens; "
                             f"{self.n_tokens + ids.size} requested (use a bounded policy)")
        P = self.prefill_chunk
        for start in range(0, ids.size, P):
            part = ids[start:start + P]
            if part.size == 1:
                self.pending = self._run(part, 1)
            else:
                self.pending = self._run(np.pad(part, (0, P - part.size)), part.size)
        return self.pending

    def generate(self, max_new_tokens: int, on_token: Callable[[int], None] | None = None) -> list[int]:
        """Emit up to max_new_tokens tokens starting with `pending`; every emitted non-EOS token is fed."""
        if self.pending is None:
            raise ValueError("feed a prompt before generating")
        out: list[int] = []
        for _ in range(max_new_tokens):
            tok = self.pending
            out.append(tok)
            if on_token is not None:
                on_token(tok)
            if tok in self.eos_ids:
                self.pending = None
                break
            self.pending = self.feed([tok])
        return out
