"""Requests of an evaluation harness on the engine: score a continuation, generate until a stop condition.

This is the small interface between an evaluation harness (models/lm_eval_model.py: lm-evaluation-harness)
and the engine: token ids in, log-probabilities / token ids out; no tokenizer, no model loading (rsqr_jax
stays model-agnostic). `SequentialEngine` runs the requests one at a time on today's `Decoder` (a fresh
batch-1 cache per request, the policy compiled in as constants, one compilation per chunk function for the
whole run). An engine of independent streams can replace it behind the same two methods, `score` and
`generate`, which take the whole list of requests so that it may run them concurrently.

    engine = SequentialEngine(apply_fn, params, policy, num_layers=..., num_kv_heads=..., head_dim=...)
    [(logprob, is_greedy)] = engine.score([(context_ids, continuation_ids)])
    [token_ids] = engine.generate([GenerateRequest(context_ids, max_new_tokens=16, stop=fn)])

A bounded policy streams the whole request however long it is (that is its point); `full` holds at most
`max_length` tokens, and, like transformers-based harness backends, sees only the last max_length of them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rsqr_jax import policy as P
from rsqr_jax.engine import Decoder
from rsqr_jax.policy import Policy
from rsqr_jax.session import Session
from rsqr_jax.spec import CacheSpec, validate


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """Generate after context_ids: at most max_new_tokens, until an end-of-sequence id or until
    stop(generated_ids) is true (checked after each compiled block; the caller trims what follows the stop)."""

    context_ids: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0
    stop: Callable[[list[int]], bool] | None = None


class RequestEngine(Protocol):
    """What a harness model needs from an engine (SequentialEngine today; a many-streams engine later)."""

    max_length: int
    bounded: bool

    def score(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding reproduces it) per request."""

    def generate(self, requests: Sequence[GenerateRequest]) -> list[list[int]]:
        """The generated ids of each request (without a final end-of-sequence id)."""


@jax.jit
def _target_logprobs(logits_1xCxV, targets_1xC):
    """log p of each target token and whether it is the argmax (computed on device: logits stay there)."""
    logp = jax.nn.log_softmax(logits_1xCxV.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, targets_1xC[..., None], axis=-1)[..., 0]
    return picked[0], (jnp.argmax(logp, axis=-1) == targets_1xC)[0]


class SequentialEngine:
    """One request at a time, each in a fresh batch-1 cache of one fixed policy.

    chunk: tokens fed per compiled step (capped by the policy's window). Scoring feeds the chunks before
    the first scored position without the vocabulary projection (`Decoder.advance`). cold_store: the
    recall tier's CacheSpec keywords (cold_capacity, page_size, max_recall_pages, page_score).
    """

    def __init__(self, apply_fn: Callable, params, policy: Policy, *, num_layers: int, num_kv_heads: int,
                 head_dim: int, max_length: int = 2048, chunk: int = 32, dtype: str = "float32",
                 cold_store: dict | None = None, gen_block: int = 16, eos_ids: Sequence[int] = (), seed: int = 0):
        h = policy.host()
        self.bounded = h["mode"] != P.FULL
        if chunk < 1 or max_length < 2:
            raise ValueError(f"chunk must be >= 1 and max_length >= 2, got {chunk} and {max_length}")
        self.chunk = min(int(chunk), h["window"]) if self.bounded else int(chunk)
        self.max_length = int(max_length)
        self.spec = CacheSpec.for_policies(policy, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                           dtype=dtype, max_chunk=self.chunk, max_len=self.max_length,
                                           **(cold_store or {}))
        validate(policy, self.spec, chunk=self.chunk)
        self.apply_fn, self.params, self.policy = apply_fn, params, policy
        self.decoder = Decoder.for_policy(apply_fn, self.spec, policy, gen_block=gen_block)
        self.gen_block, self.eos_ids, self.seed = gen_block, tuple(int(e) for e in eos_ids), seed

    def score(self, requests):
        return [self._score_one(list(ctx), list(cont)) for ctx, cont in requests]

    def _score_one(self, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
        if not ctx or not cont:
            raise ValueError("a scoring request needs a non-empty context and continuation")
        ids = ctx + cont
        if not self.bounded:
            ids = ids[-(self.max_length + 1):]
        inputs = np.asarray(ids[:-1], np.int32)
        targets = np.asarray(ids[1:], np.int32)
        first = len(inputs) - len(cont)  # first input position whose next token is scored
        C, cache = self.chunk, self.decoder.init_cache()
        logp, greedy = [], []
        for s in range(0, len(inputs), C):
            n = min(C, len(inputs) - s)
            x = np.zeros((1, C), np.int32)
            x[0, :n] = inputs[s:s + n]
            if s + n <= first:
                cache = self.decoder.advance(self.params, x, cache, None, n)
                continue
            y = np.zeros((1, C), np.int32)
            y[0, :n] = targets[s:s + n]
            logits, cache = self.decoder.feed(self.params, x, cache, None, n)
            lp, hit = _target_logprobs(logits, jnp.asarray(y))
            lo = max(first - s, 0)
            logp.append(np.asarray(lp)[lo:n])
            greedy.append(np.asarray(hit)[lo:n])
        return float(np.concatenate(logp).astype(np.float64).sum()), bool(np.concatenate(greedy).all())

    def generate(self, requests):
        return [self._generate_one(r) for r in requests]

    def _generate_one(self, req: GenerateRequest) -> list[int]:
        ctx = list(req.context_ids)
        if not ctx:
            raise ValueError("a generation request needs a non-empty context")
        if req.max_new_tokens < 1:
            return []
        if not self.bounded:  # room for the generated tokens in the full cache
            ctx = ctx[-max(self.max_length - req.max_new_tokens, 1):]
        session = Session(self.apply_fn, self.params, self.spec, self.policy, prefill_chunk=self.chunk,
                          temperature=req.temperature, seed=self.seed, eos_ids=self.eos_ids, gen_block=self.gen_block)
        # (its Decoder equals self.decoder: every request shares one compilation of each function)
        session.feed(ctx)
        out: list[int] = []
        while len(out) < req.max_new_tokens:
            out += session.generate(min(self.gen_block, req.max_new_tokens - len(out)))
            if session.pending is None or (req.stop is not None and req.stop(out)):
                break
        return out[:-1] if out and out[-1] in self.eos_ids else out
