"""Requests of an evaluation harness on the engine: score a continuation, generate until a stop condition.

This is the small interface between an evaluation harness (rsqr_jax/eval/lm_eval_model.py: lm-evaluation-harness)
and the engine: token ids in, log-probabilities / token ids out; no tokenizer, no model loading (rsqr_jax
stays model-agnostic). `SequentialEngine` runs the requests one at a time on a `Decoder` (a fresh
batch-1 cache per request, the policy compiled in as constants, one compilation per chunk function for the
whole run). `StreamsEngine` runs them on independent streams behind the same two methods, `score` and
`generate`, which take the whole list of requests so that it may run them concurrently.

    engine = SequentialEngine(apply_fn, params, policy, num_layers=..., num_kv_heads=..., head_dim=...)
    [(logprob, is_greedy)] = engine.score([(context_ids, continuation_ids)])
    [token_ids] = engine.generate([GenerateRequest(context_ids, max_new_tokens=16, stop=fn)])

A bounded policy streams the whole request however long it is (that is its point); `full` holds at most
`max_length` tokens, and, like transformers-based harness backends, sees only the last max_length of them.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rsqr_jax import policy as P
from rsqr_jax.engine import Decoder, policy_values
from rsqr_jax.policy import Policy
from rsqr_jax.sampling import Sampling
from rsqr_jax.session import Session
from rsqr_jax.spec import CacheSpec, validate
from rsqr_jax.streams import Request, StreamScheduler


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """Generate after context_ids: at most max_new_tokens, until an end-of-sequence id or until
    stop(generated_ids) is true (checked after each compiled block; the caller trims what follows the stop).
    sampling: the request's sampler settings (None = greedy)."""

    context_ids: Sequence[int]
    max_new_tokens: int
    sampling: Sampling | None = None
    stop: Callable[[list[int]], bool] | None = None


class RequestEngine(Protocol):
    """What a harness model needs from an engine (SequentialEngine today; a many-streams engine later)."""

    max_length: int
    bounded: bool

    def score(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding reproduces it) per request."""

    def generate(self, requests: Sequence[GenerateRequest]) -> list[list[int]]:
        """The generated ids of each request (without a final end-of-sequence id)."""


def _setup(engine, apply_fn, params, policy: Policy, *, num_layers, num_kv_heads, head_dim, max_length, chunk, dtype,
           cold_store, dims=None) -> None:
    """The settings both engines share: bounded, chunk (capped by a bounded window), max_length, spec."""
    h = policy.host()
    engine.bounded = h["mode"] != P.FULL
    if chunk < 1 or max_length < 2:
        raise ValueError(f"chunk must be >= 1 and max_length >= 2, got {chunk} and {max_length}")
    engine.chunk = min(int(chunk), h["window"]) if engine.bounded else int(chunk)
    engine.max_length = int(max_length)
    engine.spec = CacheSpec.for_policies(policy, dims=dims, num_layers=num_layers, num_kv_heads=num_kv_heads,
                                         head_dim=head_dim, dtype=dtype, max_chunk=engine.chunk,
                                         max_len=engine.max_length, **(cold_store or {}))
    validate(policy, engine.spec, chunk=engine.chunk)
    engine.apply_fn, engine.params, engine.policy = apply_fn, params, policy


def _score_inputs(engine, ctx, cont) -> tuple[np.ndarray, np.ndarray, int]:
    """(input ids, target ids, first scored input position) of a scoring request; `full` keeps the last
    max_length + 1 tokens (as HF-based harness backends do)."""
    ctx, cont = list(ctx), list(cont)
    if not ctx or not cont:
        raise ValueError("a scoring request needs a non-empty context and continuation")
    ids = ctx + cont
    if not engine.bounded:
        ids = ids[-(engine.max_length + 1):]
    inputs = np.asarray(ids[:-1], np.int32)
    return inputs, np.asarray(ids[1:], np.int32), len(inputs) - len(cont)


def _generate_context(engine, req: GenerateRequest) -> list[int]:
    """The context a generation request runs from (`full`: truncated to leave room for the new tokens)."""
    ctx = list(req.context_ids)
    if not ctx:
        raise ValueError("a generation request needs a non-empty context")
    if not engine.bounded:
        ctx = ctx[-max(engine.max_length - req.max_new_tokens, 1):]
    return ctx


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
    recall tier's CacheSpec keywords (cold: a ColdStore, max_recall_pages). dims: the model config, for the
    rings of a hybrid model's local layers (CacheSpec.for_policies; the sizes must agree with it).
    """

    def __init__(self, apply_fn: Callable, params, policy: Policy, *, num_layers: int, num_kv_heads: int,
                 head_dim: int, max_length: int = 2048, chunk: int = 32, dtype: str = "float32",
                 cold_store: dict | None = None, gen_block: int = 16, eos_ids: Sequence[int] = (), seed: int = 0,
                 dims=None):
        _setup(self, apply_fn, params, policy, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
               max_length=max_length, chunk=chunk, dtype=dtype, cold_store=cold_store, dims=dims)
        self.decoder = Decoder.for_policy(apply_fn, self.spec, policy, gen_block=gen_block,
                                          repeat_last_n=Sampling().repeat_last_n)
        self.gen_block, self.eos_ids, self.seed = gen_block, tuple(int(e) for e in eos_ids), seed

    def score(self, requests):
        return [self._score_one(*_score_inputs(self, ctx, cont)) for ctx, cont in requests]

    def _score_one(self, inputs: np.ndarray, targets: np.ndarray, first: int) -> tuple[float, bool]:
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
        ctx = _generate_context(self, req)
        if req.max_new_tokens < 1:
            return []
        session = Session(self.apply_fn, self.params, self.spec, self.policy, prefill_chunk=self.chunk,
                          sampling=req.sampling or Sampling(), seed=self.seed, eos_ids=self.eos_ids,
                          gen_block=self.gen_block)
        # (its Decoder equals self.decoder: every request shares one compilation of each function)
        session.feed(ctx)
        out: list[int] = []
        while len(out) < req.max_new_tokens:
            out += session.generate(min(self.gen_block, req.max_new_tokens - len(out)))
            if session.pending is None or (req.stop is not None and req.stop(out)):
                break
        return out[:-1] if out and out[-1] in self.eos_ids else out


@dataclasses.dataclass
class _ScoreSlot:
    index: int  # the request's position in the list given to score
    offset: int = 0  # inputs fed so far
    logp: list = dataclasses.field(default_factory=list)
    greedy: list = dataclasses.field(default_factory=list)


class StreamsEngine:
    """Requests on n_slots independent streams of one fixed policy (a `vmap_streams` Decoder).

    score: every slot feeds its own request chunk by chunk (its own n_valid; the chunks before the first
    scored token without the vocabulary projection, when no slot needs scores in that round); a request
    that ends frees its slot for the next one (longest first), which is reset inside the next compiled
    call. generate: a `StreamScheduler` over the same slots, each request's stop callback checked after
    every block. Joins and leaves are data: one compilation of each function for the whole run. Each
    request sees the chunks SequentialEngine feeds it, so the results are the same (up to float
    reassociation under vmap).
    """

    def __init__(self, apply_fn: Callable, params, policy: Policy, *, n_slots: int, num_layers: int,
                 num_kv_heads: int, head_dim: int, max_length: int = 2048, chunk: int = 32, dtype: str = "float32",
                 cold_store: dict | None = None, gen_block: int = 16, eos_ids: Sequence[int] = (), seed: int = 0,
                 dims=None):
        if isinstance(n_slots, bool) or not isinstance(n_slots, (int, np.integer)) or n_slots < 1:
            raise ValueError(f"n_slots must be a positive integer, got {n_slots!r}")
        _setup(self, apply_fn, params, policy, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
               max_length=max_length, chunk=chunk, dtype=dtype, cold_store=cold_store, dims=dims)
        self.n_slots = int(n_slots)
        self.decoder = Decoder(apply_fn, self.spec, fixed_policy=policy_values(policy), gen_block=gen_block,
                               vmap_streams=True)
        self.gen_block, self.eos_ids, self.seed = gen_block, tuple(int(e) for e in eos_ids), seed

    def score(self, requests):
        prepared = [_score_inputs(self, ctx, cont) for ctx, cont in requests]
        queue = collections.deque(sorted(range(len(prepared)), key=lambda i: -len(prepared[i][0])))
        results: list = [None] * len(prepared)
        N, C = self.n_slots, self.chunk
        cache = self.decoder.init_cache(n_streams=N)
        slots: list[_ScoreSlot | None] = [None] * N
        fresh = np.zeros(N, bool)
        while queue or any(s is not None for s in slots):
            for i in range(N):
                if slots[i] is None and queue:
                    slots[i], fresh[i] = _ScoreSlot(queue.popleft()), True
            tokens, targets = np.zeros((N, C), np.int32), np.zeros((N, C), np.int32)
            n_valid = np.zeros(N, np.int32)
            for i, s in enumerate(slots):
                if s is not None:
                    inputs, tgt, _ = prepared[s.index]
                    n = n_valid[i] = min(C, len(inputs) - s.offset)
                    tokens[i, :n], targets[i, :n] = inputs[s.offset:s.offset + n], tgt[s.offset:s.offset + n]
            scored = [s is not None and s.offset + n_valid[i] > prepared[s.index][2] for i, s in enumerate(slots)]
            if any(scored):
                logp, hit, cache = self.decoder.score_streams(self.params, tokens, targets, cache, None, n_valid,
                                                              fresh.copy())
                logp, hit = np.asarray(logp), np.asarray(hit)
            else:
                cache = self.decoder.advance_streams(self.params, tokens, cache, None, n_valid, fresh.copy())
            fresh[:] = False
            for i, s in enumerate(slots):
                if s is None:
                    continue
                inputs, _, first = prepared[s.index]
                n = int(n_valid[i])
                if scored[i]:
                    lo = max(first - s.offset, 0)
                    s.logp.append(logp[i, lo:n])
                    s.greedy.append(hit[i, lo:n])
                s.offset += n
                if s.offset == len(inputs):
                    results[s.index] = (float(np.concatenate(s.logp).astype(np.float64).sum()),
                                        bool(np.concatenate(s.greedy).all()))
                    slots[i] = None
        return results

    def generate(self, requests):
        results: list = [None] * len(requests)
        # sampler settings are per-stream data; only the ring size (repeat_last_n) is a shape
        by_ring: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            by_ring.setdefault((r.sampling or Sampling()).repeat_last_n, []).append(i)
        for ring, indices in by_ring.items():
            sched = StreamScheduler(self.apply_fn, self.params, self.spec, self.policy, n_slots=self.n_slots,
                                    prefill_chunk=self.chunk, sampling=Sampling(repeat_last_n=ring),
                                    eos_ids=self.eos_ids, gen_block=self.gen_block)
            run = []
            for i in indices:
                r = requests[i]
                ctx = _generate_context(self, r)
                if r.max_new_tokens < 1:
                    results[i] = []
                else:
                    run.append(i)
                    sched.submit(Request(tuple(ctx), r.max_new_tokens, seed=self.seed, stop=r.stop,
                                         sampling=r.sampling))
            for i, f in zip(run, sched.run()):
                results[i] = f.tokens[:-1] if f.stop == "eos" else f.tokens
        return results
