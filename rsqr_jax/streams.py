"""Many independent streams in one compiled step: a scheduler of generation requests over a fixed number
of slots of a `vmap_streams` Decoder (rsqr_jax.engine).

Each slot is one stream with its own positions, policy state, rng key, token budget and stop condition
(the cache carries a leading slot axis [N]; the step is vmapped over it). A request joins a free slot
(the slot is reset to an empty cache inside the next compiled call), its prompt is prefilled in chunks
of `prefill_chunk` together with the other prompts still prefilling (each with its own n_valid), then
it generates in compiled blocks of `gen_block` steps alongside the other generating streams, and leaves
its slot when its budget is spent or it emits an end-of-sequence id. Nothing about joins or leaves is a
shape, so a whole session runs under two compilations (the chunk prefill and the generation block; a
prompt's 1-token remainder is fed by the block's first step), whatever the number, lengths and order of
the requests.

A stream sees the computation a lone `Session` with the same settings runs (same chunks, a 1-token
step for a 1-token remainder, the same rng splits; vmapped, so equal up to float reassociation), so greedy outputs equal the
single-prompt ones. Scheduling: prefill-first by default (a round with prompts to prefill runs only the
prefill: generating streams wait for a joining prompt's whole prefill, but every block then serves the
most streams). `interleave=True` runs, in a round where prompts prefill while others generate, one prefill
chunk and then one generation block (two compiled calls, each leaving the other streams untouched): a
joining prompt delays the others by one chunk per block instead of stalling them for its whole prefill, at
the price of blocks that serve fewer streams (fewer tokens/s). The tokens are the same either way.

    sched = StreamScheduler(apply_fn, params, spec, policy, n_slots=16, prefill_chunk=64, eos_ids=eos)
    results = sched.run([Request(ids, max_new_tokens=64) for ids in prompts])   # in request order

Sampling: the scheduler's `sampling` (rsqr_jax.sampling.Sampling, default greedy) applies to every request
without its own; `Request(..., sampling=...)` overrides it for that stream (the values are per-stream data,
so mixing settings costs no compilation). The scheduler's repeat_last_n is the size of every stream's ring
of recent token ids; a request may use a shorter window, not a longer one.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from rsqr_jax.cache import KVCache
from rsqr_jax.engine import Decoder, SamplerState, policy_values
from rsqr_jax.host import release_free_heap
from rsqr_jax.policy import FULL as P_FULL
from rsqr_jax.policy import Policy
from rsqr_jax.sampling import DEFAULT_MAX_CANDIDATES, Sampling, stack_values
from rsqr_jax.spec import CacheSpec, validate


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt (token ids) to continue by up to max_new_tokens tokens; seed: the stream's rng key.
    stop(emitted_ids) -> True ends the request early (checked after each generation block, so the tokens
    of the rest of that block are kept: the caller trims them). sampling: this request's settings (None:
    the scheduler's)."""

    ids: tuple[int, ...]
    max_new_tokens: int
    seed: int = 0
    stop: Callable[[list[int]], bool] | None = None
    sampling: Sampling | None = None


@dataclasses.dataclass
class Finished:
    """A request's result: the emitted tokens (an end-of-sequence token included, as Session emits it),
    why it stopped ("eos", "length" or "stop": the request's stop callback), and the round it finished in."""

    index: int
    tokens: list[int]
    stop: str
    n_prompt_tokens: int
    finished_round: int


@dataclasses.dataclass
class _Slot:
    index: int
    request: Request
    todo: np.ndarray  # prompt tokens not yet fed
    out: list[int] = dataclasses.field(default_factory=list)
    pending: int = -1
    budget: int = 0  # > 0 once generating
    feed_only: bool = False  # pending is the prompt's last token: fed, not emitted


class StreamScheduler:
    """A queue of requests over n_slots streams of one policy; see the module docstring."""

    def __init__(self, apply_fn: Callable, params, spec: CacheSpec, policy: Policy, *, n_slots: int,
                 prefill_chunk: int = 64, sampling: Sampling | None = None, temperature: float | None = None,
                 top_p: float | None = None, eos_ids: Iterable[int] = (), gen_block: int = 16,
                 vocab_size: int | None = None, interleave: bool = False,
                 max_candidates: int = DEFAULT_MAX_CANDIDATES):
        if isinstance(n_slots, bool) or not isinstance(n_slots, (int, np.integer)) or n_slots < 1:
            raise ValueError(f"n_slots must be a positive integer, got {n_slots!r}")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, (int, np.integer)) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        sampling = Sampling() if sampling is None else sampling
        if not isinstance(sampling, Sampling):
            raise ValueError(f"sampling must be a rsqr_jax.sampling.Sampling, got {type(sampling).__name__}")
        legacy = {k: v for k, v in (("temperature", temperature), ("top_p", top_p)) if v is not None}
        sampling = dataclasses.replace(sampling, **legacy) if legacy else sampling  # validated again
        self.prefill_chunk = min(int(prefill_chunk), spec.max_chunk)  # as Session does
        validate(policy, spec, chunk=self.prefill_chunk)
        self.params, self.spec, self.policy = params, spec, policy
        self.n_slots, self.interleave = int(n_slots), bool(interleave)
        self.decoder = Decoder(apply_fn, spec, fixed_policy=policy_values(policy), gen_block=gen_block,
                               vmap_streams=True, repeat_last_n=sampling.repeat_last_n, max_candidates=max_candidates)
        self.sampling = sampling
        self.values_N = stack_values([sampling] * int(n_slots))  # per slot, set when a request joins
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self.cache: KVCache = self.decoder.init_cache(n_streams=self.n_slots)
        self.rng_N = np.zeros((self.n_slots, 2), np.uint32)
        self.recent_N = jnp.full((self.n_slots, sampling.repeat_last_n), -1, jnp.int32)  # reset as a stream joins
        self.slots: list[_Slot | None] = [None] * self.n_slots
        self._fresh = np.zeros(self.n_slots, bool)  # slots to reset in the next compiled call
        self.queue: list[tuple[int, Request]] = []
        self.n_submitted = 0
        self.rounds = 0
        self.n_generated = 0
        self.compile_s = 0.0

    # ------------------------------------------------------------------------------------------------
    def check(self, request: Request) -> None:
        """ValueError (one line) for a request this scheduler cannot run: empty, out-of-vocabulary, or
        longer than a `full` cache (prompt + max_new_tokens must fit its window: every emitted token is fed)."""
        ids = np.asarray(request.ids)
        if ids.size == 0:
            raise ValueError("empty prompt")
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token ids must be a flat list of integers, got dtype {ids.dtype} shape {ids.shape}")
        hi = self.vocab_size if self.vocab_size is not None else 2**31
        if ids.min() < 0 or ids.max() >= hi:
            raise ValueError(f"token id {int(ids[(ids < 0) | (ids >= hi)][0])} is out of range [0, {hi})")
        if isinstance(request.max_new_tokens, bool) or request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be positive, got {request.max_new_tokens}")
        if not 0 <= request.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {request.seed}")
        if request.sampling is not None:
            if not isinstance(request.sampling, Sampling):
                raise ValueError(f"a request's sampling must be a Sampling, got {type(request.sampling).__name__}")
            if request.sampling.repeat_last_n > self.sampling.repeat_last_n:
                raise ValueError(f"a request's repeat_last_n {request.sampling.repeat_last_n} exceeds the "
                                 f"scheduler's ring of {self.sampling.repeat_last_n} tokens")
        need = ids.size + request.max_new_tokens
        if int(np.asarray(self.policy.mode)) == P_FULL and need > self.spec.win_capacity:
            raise ValueError(f"prompt of {ids.size} tokens + {request.max_new_tokens} new ones exceeds the full "
                             f"attention cache of {self.spec.win_capacity} tokens (use a bounded policy)")

    def submit(self, request: Request) -> int:
        """Queue a request (checked first); returns its index (submission order)."""
        self.check(request)
        index = self.n_submitted
        self.queue.append((index, request))
        self.n_submitted += 1
        return index

    def follow_up(self, slot: int, request: Request) -> int:
        """Continue the stream in `slot` with another request: the next turn of a conversation. Unlike a
        submitted request, it keeps the slot's cache, rng key and ring of recent tokens (request.seed is not
        used; request.sampling, if given, replaces the slot's values). The slot must be free: its previous
        request finished. Returns the request's index (as `submit`)."""
        self.check(request)
        if not 0 <= slot < self.n_slots or self.slots[slot] is not None or self._fresh[slot]:
            raise ValueError(f"slot {slot} is not a finished stream that can be continued")
        if int(np.asarray(self.policy.mode)) == P_FULL:
            used = int(np.asarray(self.cache.t)[slot] - np.asarray(self.cache.start)[slot])
            if used + len(request.ids) + request.max_new_tokens > self.spec.win_capacity:
                raise ValueError(f"stream {slot} holds {used} tokens: {len(request.ids)} more + "
                                 f"{request.max_new_tokens} new ones exceed the full attention cache of "
                                 f"{self.spec.win_capacity} tokens")
        index = self.n_submitted
        self.n_submitted += 1
        self.slots[slot] = _Slot(index, request, np.asarray(request.ids, np.int32))
        if request.sampling is not None:
            for k, col in zip(type(self.values_N)._fields, stack_values([request.sampling])):
                getattr(self.values_N, k)[slot] = col[0]
        self._promote()
        return index

    @property
    def idle(self) -> bool:
        return not self.queue and all(s is None for s in self.slots)

    @property
    def n_active(self) -> int:
        return sum(s is not None for s in self.slots)

    # ------------------------------------------------------------------------------------------------
    @property
    def temperature(self) -> float:
        return float(self.sampling.temperature)

    @property
    def top_p(self) -> float:
        return float(self.sampling.top_p)

    def _state(self) -> SamplerState:
        # copies: on CPU a numpy argument may be read in place by the asynchronously running call
        return SamplerState(self.rng_N.copy(), self.recent_N)

    def _values(self):
        return type(self.values_N)(*(x.copy() for x in self.values_N))

    def warmup(self) -> None:
        """Compile the two functions now on a throwaway cache (so timings exclude compilation; compile_s)."""
        t0 = time.perf_counter()
        zeros = np.zeros(self.n_slots, np.int32)
        scratch = jax.tree.map(jnp.copy, self.cache)
        state = SamplerState(self.rng_N.copy(), jnp.copy(self.recent_N))
        jax.block_until_ready(self.decoder.feed_streams(
            self.params, np.zeros((self.n_slots, self.prefill_chunk), np.int32), scratch, None, zeros,
            np.zeros(self.n_slots, bool), state, self._values()))
        scratch = jax.tree.map(jnp.copy, self.cache)
        jax.block_until_ready(self.decoder.generate_streams(self.params, zeros, scratch, None, zeros, state,
                                                            self._values(), self.eos_ids))
        del scratch
        self.compile_s += time.perf_counter() - t0
        release_free_heap()  # the compiler's freed buffers

    def _admit(self) -> None:
        for i in range(self.n_slots):
            if self.slots[i] is None and self.queue:
                index, req = self.queue.pop(0)
                self.slots[i] = _Slot(index, req, np.asarray(req.ids, np.int32))
                self._fresh[i] = True
                self.rng_N[i] = np.asarray(jax.random.PRNGKey(req.seed))
                own = self.sampling if req.sampling is None else req.sampling
                for k, col in zip(type(self.values_N)._fields, stack_values([own])):
                    getattr(self.values_N, k)[i] = col[0]
        self._promote()

    def _promote(self) -> None:
        """A prompt with one token left goes to generation: the next block feeds that token (feed_only)."""
        for s in self.slots:
            if s is not None and s.todo.size == 1:
                s.pending, s.budget, s.feed_only, s.todo = int(s.todo[0]), s.request.max_new_tokens, True, s.todo[1:]

    def _prefill_round(self) -> None:
        """One chunk of every prompt with more than one token left to feed (padded to `prefill_chunk`, its
        n_valid real); exactly Session.feed's split. A prompt's 1-token remainder is fed by the next
        generation block (feed_only), as Session feeds it: by a 1-token step."""
        C = self.prefill_chunk
        rows = [i for i, s in enumerate(self.slots) if s is not None and s.todo.size > 1]
        tokens = np.zeros((self.n_slots, C), np.int32)
        n_valid = np.zeros(self.n_slots, np.int32)
        for i in rows:
            part = self.slots[i].todo[:C]
            tokens[i, :part.size], n_valid[i] = part, part.size
        # copies: on CPU a numpy argument may be read in place by the asynchronously running call
        nxt, self.cache, state = self.decoder.feed_streams(self.params, tokens, self.cache, None, n_valid,
                                                           self._fresh.copy(), self._state(), self._values())
        self._fresh[:] = False
        self.rng_N, self.recent_N = np.array(state.rng), state.recent
        nxt = np.asarray(nxt)
        for i in rows:
            s = self.slots[i]
            s.todo = s.todo[n_valid[i]:]
            if not s.todo.size:  # prefilled: generate from the sampled token
                s.pending, s.budget = int(nxt[i]), s.request.max_new_tokens
        self._promote()

    def _generate_round(self) -> list[Finished]:
        pending = np.array([s.pending if s is not None and s.budget > 0 else 0 for s in self.slots], np.int32)
        budget = np.array([s.budget if s is not None else 0 for s in self.slots], np.int32)
        feed_only = np.array([s is not None and s.feed_only for s in self.slots], bool)
        res = self.decoder.generate_streams(self.params, pending, self.cache, None, budget, self._state(),
                                            self._values(), self.eos_ids, feed_only, self._fresh.copy())
        self._fresh[:] = False
        self.cache, self.rng_N, self.recent_N = res.cache, np.array(res.state_N.rng), res.state_N.recent
        tokens, left, nxt = np.asarray(res.tokens_NxK), np.asarray(res.budget_N), np.asarray(res.pending_N)
        done = []
        for i, s in enumerate(self.slots):
            if s is None or s.budget <= 0:
                continue
            emitted = [int(t) for t in tokens[i] if t >= 0]
            s.out.extend(emitted)
            self.n_generated += len(emitted)
            s.pending, s.budget, s.feed_only = int(nxt[i]), int(left[i]), False
            stopped = s.budget > 0 and s.request.stop is not None and s.request.stop(s.out)
            if s.budget <= 0 or stopped:
                stop = "stop" if stopped else "eos" if s.out and s.out[-1] in self.eos_ids else "length"
                done.append(Finished(s.index, s.out, stop, len(s.request.ids), self.rounds))
                self.slots[i] = None  # the slot is free; its cache is reset when the next stream joins
        return done

    def step(self) -> list[Finished]:
        """One round: admit queued requests into free slots, then one prefill chunk (if any prompt is still
        prefilling) and/or one generation block (both when interleaving and both are waiting; a stream that
        finished its prefill in this round's chunk already generates in its block). Returns the requests
        that finished in it."""
        self._admit()
        self.rounds += 1
        if any(s is not None and s.todo.size > 1 for s in self.slots):
            self._prefill_round()
            if not self.interleave:
                return []
        if any(s is not None and s.budget > 0 for s in self.slots):
            return self._generate_round()
        return []

    def run(self, requests: Iterable[Request] = (), on_finished: Callable[[Finished], None] | None = None
            ) -> list[Finished]:
        """Submit `requests`, run until every queued request is finished; results in submission order."""
        for r in requests:
            self.submit(r)
        out: list[Finished] = []
        while not self.idle:
            for f in self.step():
                out.append(f)
                if on_finished is not None:
                    on_finished(f)
        return sorted(out, key=lambda f: f.index)
