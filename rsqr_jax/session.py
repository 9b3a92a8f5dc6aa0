"""A streaming generation session: a thin stateful wrapper over a `Decoder` (rsqr_jax.engine).

It holds what one conversation owns (the cache, the sampler state, the pending token, a caller
`extra` dict such as a chat transcript) and calls the Decoder's compiled functions: prefill at a fixed
chunk size with a dynamic number of real tokens, and generation in compiled blocks (`Decoder.generate`,
one host round trip per block). The policy is compiled in as constants, every call donates the cache,
so a session of any length runs in place under one compilation per function.

Sessions can be saved and resumed bit-identically (`Session.save` / `Session.load`) in the file format
of rsqr_jax.session_file; a file that does not fit the caller's model, spec or policy raises
SessionFileError with a one-line message: a file is never loaded wrongly.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from rsqr_jax.cache import (MAX_POSITION, KVCache, cache_arrays, cache_from_arrays, cold_slots_in_use, cut_cold_store,
                            grow_cold_store, init_cache,
                            pin_span, pinned_count)
from rsqr_jax.engine import Decoder, SamplerState, policy_values
from rsqr_jax.host import release_free_heap
from rsqr_jax.kernels import cpu_status
from rsqr_jax.policy import FULL as P_FULL
from rsqr_jax.policy import Policy, host_policies
from rsqr_jax.sampling import DEFAULT_MAX_CANDIDATES, Sampling
from rsqr_jax.session_file import (FORMAT, FORMAT_VERSION, SessionFileError, _json_clean, _one_line,
                                   check_identity, read_session_file, write_session_file)
from rsqr_jax.spec import CacheSpec, ColdStore, validate

# The prefill chunk of `Session.create` (a policy with a smaller window gets its window): long enough that
# a prompt prefills in few calls, short enough that a short one wastes little padding.
DEFAULT_CHUNK = 64

__all__ = ["Session", "SessionFileError", "FORMAT", "FORMAT_VERSION", "check_identity", "read_session_file",
           "write_session_file"]


class Session:
    """Feed tokens, generate tokens; the cache stays bounded by the policy however long it runs.

    `pending` is the token sampled after the last fed token (None before the first feed, or right
    after generation emitted an end-of-sequence token, which is never fed). `vocab_size`, when given,
    makes `feed` reject out-of-range token ids (which a gather would otherwise silently clamp).
    `extra` is a JSON-serializable dict the caller may fill; it is saved and restored with the session.

    `sampling` (rsqr_jax.sampling.Sampling, default greedy) picks the tokens; its repeat_last_n sizes the
    ring of recent token ids (`recent`: prompt and generated tokens, as llama.cpp counts them) and
    max_candidates the sampler's candidate count. `temperature=` / `top_p=`, if given, override those two
    fields of `sampling` (the older keywords).
    """

    def __init__(self, apply_fn: Callable, params, spec: CacheSpec, policy: Policy, *, prefill_chunk: int = 64,
                 sampling: Sampling | None = None, temperature: float | None = None, top_p: float | None = None,
                 seed: int = 0, eos_ids: Iterable[int] = (), vocab_size: int | None = None, gen_block: int = 16,
                 max_candidates: int = DEFAULT_MAX_CANDIDATES):
        if spec.batch != 1:
            raise ValueError("a Session streams one sequence (spec.batch must be 1)")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, (int, np.integer)) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        self.prefill_chunk = min(int(prefill_chunk), spec.max_chunk)
        validate(policy, spec, chunk=self.prefill_chunk)
        sampling = Sampling() if sampling is None else sampling
        if not isinstance(sampling, Sampling):
            raise ValueError(f"sampling must be a rsqr_jax.sampling.Sampling, got {type(sampling).__name__}")
        legacy = {k: v for k, v in (("temperature", temperature), ("top_p", top_p)) if v is not None}
        sampling = dataclasses.replace(sampling, **legacy) if legacy else sampling  # validated again
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        self.apply_fn, self.params, self.spec, self.policy = apply_fn, params, spec, policy
        self.decoder = Decoder(apply_fn, spec, fixed_policy=policy_values(policy), gen_block=gen_block,
                               repeat_last_n=sampling.repeat_last_n, max_candidates=max_candidates)
        if jax.default_backend() == "cpu":  # the CPU kernels are built and registered now, not inside a trace
            cpu_status.build_all()
        self.sampling, self.seed = sampling, int(seed)
        self._values = sampling.values()
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self.cache: KVCache = init_cache(spec)
        self.rng = jax.random.PRNGKey(self.seed)
        self.recent = jnp.full((1, sampling.repeat_last_n), -1, jnp.int32)
        self.pending: int | None = None
        self.extra: dict = {}
        self._warm: set[str] = set()
        self.compile_s = 0.0

    @classmethod
    def create(cls, apply_fn: Callable, params, policy: Policy, *, dims, chunk: int | None = None,
               dtype: str = "float32", max_len: int = 0, cold: ColdStore | None = None, pins: int = 0,
               **kwargs) -> "Session":
        """A session with its cache spec derived from the policy and the model's `dims` (anything with
        num_layers, num_kv_heads, head_dim: a model config), prefilling in chunks of `chunk` tokens (default
        64, at most the policy's window), the one value the spec's max_chunk and the prefill chunk must share.

        dtype: the cache's storage dtype. max_len: the positions a `full` policy's cache holds (required for
        it; the other policies are bounded by themselves). cold: the recall tier's cold store. pins: room for
        that many pinned tokens (`pin_next`, `feed(..., pin=True)`). The other
        keywords (sampling, seed, eos_ids, vocab_size, gen_block, max_candidates) are the constructor's.
        """
        hosts = host_policies(policy)
        if len(hosts) != 1:
            raise ValueError(f"a Session runs one policy, got {len(hosts)}")
        bounded = hosts[0]["mode"] != P_FULL
        if not bounded and max_len < 1:
            raise ValueError("a full-attention session needs max_len (the positions its cache holds)")
        if chunk is None:
            chunk = min(DEFAULT_CHUNK, hosts[0]["window"]) if bounded else DEFAULT_CHUNK
        if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
            raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
        spec = CacheSpec.for_policies(policy, dims=dims, dtype=dtype, max_chunk=int(chunk), max_len=max_len,
                                      cold=cold, pins=pins)
        return cls(apply_fn, params, spec, policy, prefill_chunk=int(chunk), **kwargs)

    @property
    def temperature(self) -> float:
        return float(self.sampling.temperature)

    @property
    def top_p(self) -> float:
        return float(self.sampling.top_p)

    @property
    def state(self) -> SamplerState:
        """The sampler state the next call continues from (rng key, ring of recent token ids)."""
        return SamplerState(self.rng, self.recent)

    @property
    def n_tokens(self) -> int:
        """Tokens fed so far."""
        return int(self.cache.t) - int(self.cache.start)

    def reset(self) -> None:
        """Forget the stream (an empty cache, an empty ring of recent tokens, `extra` cleared); the compiled
        functions and the rng key's position are kept, so a reset session samples on where it left off."""
        self.cache = init_cache(self.spec)
        self.recent = jnp.full_like(self.recent, -1)
        self.pending = None
        self.extra = {}

    def warmup(self) -> None:
        """Compile the prefill and generation functions now (so timings exclude compilation; `compile_s`).

        Runs each once on a throwaway cache, so the session's state is untouched. A session that holds nothing
        yet lends its own (empty) cache and gets a new empty one, so a cache never exists twice: with a large
        cold store, a copy would add its size to the process's peak memory."""
        for name in ("prefill", "decode", "generate"):
            if name in self._warm:
                continue
            t0 = time.perf_counter()
            empty = self.n_tokens == 0 and int(self.cache.start) == 0 and self.pinned == 0
            scratch = self.cache if empty else jax.tree.map(jnp.copy, self.cache)
            self.cache = None if empty else self.cache
            if name == "generate":
                out = self.decoder.generate(self.params, jnp.zeros((1,), jnp.int32), scratch, None, self.state,
                                            self._values, 0, self.eos_ids)
            else:
                c = self.prefill_chunk if name == "prefill" else 1
                out = self.decoder.feed_and_sample(self.params, np.zeros((1, c), np.int32), scratch, None, c,
                                                   self.state, self._values)
            jax.block_until_ready(out)
            del out, scratch  # before the next cache exists
            if self.cache is None:
                self.cache = init_cache(self.spec)
            self._warm.add(name)
            self.compile_s += time.perf_counter() - t0
            release_free_heap()  # the compiler's freed buffers

    def _run(self, ids: np.ndarray, n_valid: int) -> int:
        nxt, self.cache, (self.rng, self.recent) = self.decoder.feed_and_sample(
            self.params, ids[None], self.cache, None, n_valid, self.state, self._values)
        return int(nxt[0])

    def _check_ids(self, ids) -> np.ndarray:
        ids = np.asarray(list(ids))
        if ids.size == 0:
            raise ValueError("nothing to feed: empty token list")
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token ids must be a flat list of integers, got dtype {ids.dtype} shape {ids.shape}")
        hi = self.vocab_size if self.vocab_size is not None else 2**31
        if ids.min() < 0 or ids.max() >= hi:
            bad = int(ids[(ids < 0) | (ids >= hi)][0])
            raise ValueError(f"token id {bad} is out of range [0, {hi})")
        self._check_room(ids.size)
        return ids.astype(np.int32)

    def _check_room(self, n: int) -> None:
        full_policy = int(np.asarray(self.policy.mode)) == P_FULL
        if full_policy and self.n_tokens + n > self.spec.win_capacity:
            raise ValueError(f"full attention cache holds {self.spec.win_capacity} tokens; "
                             f"{self.n_tokens + n} requested (use a bounded policy)")
        if int(self.cache.t) + n > MAX_POSITION:
            raise ValueError(f"the stream would pass global position {MAX_POSITION} (int32 positions)")

    @property
    def pinned(self) -> int:
        """Tokens pinned so far."""
        return pinned_count(self.cache)

    def pin_next(self, n: int) -> None:
        """Pin the next n tokens to be fed: kept forever, exactly, beside the sinks (the
        system prompt, a first turn, llama.cpp's n_keep). Raises PinError (one line) past the session's room
        (`pins=` of `create`) or under a policy that keeps no pins; nothing changes then."""
        t = int(self.cache.t)
        self.cache = pin_span(self.cache, self.spec, t, t + int(n), self.policy)

    def feed(self, ids: Iterable[int], *, pin: bool = False) -> int:
        """Append tokens (prefill in chunks); returns and remembers the sampled next token. pin: pin these
        tokens (`pin_next`), checked before anything is fed."""
        ids = self._check_ids(ids)
        if pin:
            self.pin_next(ids.size)
        P = self.prefill_chunk
        for start in range(0, ids.size, P):
            part = ids[start:start + P]
            if part.size == 1:
                self.pending = self._run(part, 1)
            else:
                self.pending = self._run(np.pad(part, (0, P - part.size)), part.size)
        return self.pending

    def generate(self, max_new_tokens: int, on_token: Callable[[int], None] | None = None) -> list[int]:
        """Emit up to max_new_tokens tokens starting with `pending`; every emitted non-EOS token is fed.

        Runs in compiled blocks of `gen_block` steps; `on_token` sees each token as its block returns."""
        if self.pending is None:
            raise ValueError("feed a prompt before generating")
        out: list[int] = []
        while len(out) < max_new_tokens:
            n = min(max_new_tokens - len(out), self.decoder.gen_block)
            # Every emitted token but an end-of-sequence one is fed: room for n of them.
            self._check_room(n)
            res = self.decoder.generate(self.params, jnp.asarray([self.pending], jnp.int32), self.cache, None,
                                        self.state, self._values, n, self.eos_ids)
            self.cache, (self.rng, self.recent) = res.cache, res.state
            k = int(res.n_steps)
            block = [int(x) for x in np.asarray(res.tokens_BxK[0, :k])]
            for tok in block:
                out.append(tok)
                if on_token is not None:
                    on_token(tok)
            if bool(res.done_B[0]):
                self.pending = None
                break
            self.pending = int(res.pending_B[0])
        return out

    # ------------------------------------------------------------------------------------------------
    # Save / resume.

    def save(self, path: str | os.PathLike, identity: dict, *, extra: dict | None = None) -> None:
        """Write the whole session state to `path` atomically (see the module docstring for the format).

        identity: a JSON-serializable dict naming the model (e.g. rsqr_jax.models.llama.LoadedModel.identity);
        `load` refuses the file for any other identity. extra: replaces `self.extra` if given.
        Raises SessionFileError (one line) if the file cannot be written; the old file, if any, is intact.
        """
        if extra is not None:
            self.extra = dict(extra)
        fields = {k: np.asarray(v) for k, v in cache_arrays(self.cache).items()}
        cold_used = cold_slots_in_use(fields, self.spec)  # the still-empty rest of the cold store is not written
        fields = cut_cold_store(fields, cold_used, self.spec.cold.page_size if self.spec.cold else 1)
        arrays = {f"cache.{k}": v for k, v in fields.items()}
        arrays["rng"] = np.asarray(self.rng)
        arrays["recent"] = np.asarray(self.recent)
        header = {
            "format": FORMAT, "version": FORMAT_VERSION,
            "identity": _json_clean(identity, "identity"), "extra": _json_clean(self.extra, "extra"),
            "spec": self.spec.to_json(),
            "policy": self.policy.host(),
            "prefill_chunk": self.prefill_chunk, "sampling": self.sampling.to_json(),
            "max_candidates": self.decoder.max_candidates,
            "seed": self.seed, "eos_ids": sorted(self.eos_ids), "vocab_size": self.vocab_size,
            "pending": self.pending, "n_tokens": self.n_tokens, "cold_slots_saved": cold_used,
        }
        write_session_file(path, header, arrays)

    @classmethod
    def load(cls, path: str | os.PathLike, apply_fn: Callable, params, identity: dict, *,
             spec: CacheSpec | None = None, policy: Policy | None = None) -> "Session":
        """Resume a saved session on the model (apply_fn, params) named by `identity`.

        The cache, counters, policy, sampler state (rng key included), pending token and `extra` come
        back exactly (the sampling settings and the ring of recent token ids too), so continuing gives the
        same tokens as a run that was never interrupted. A file of another format version is refused. `spec`
        / `policy`, if given, must equal the saved ones. Raises SessionFileError (one line) otherwise.
        """
        header, arrays = read_session_file(path)
        name = os.fspath(path)
        check_identity(name, header.get("identity"), identity)
        try:
            saved_spec = CacheSpec.from_json(header["spec"])
            fields = [f.name for f in dataclasses.fields(Policy)]
            if sorted(header["policy"]) != sorted(fields):
                raise ValueError(f"policy fields {sorted(header['policy'])}")
            saved_policy = Policy(**{k: jnp.asarray(int(header["policy"][k]), jnp.int32) for k in fields})
            validate(saved_policy, saved_spec, chunk=int(header["prefill_chunk"]))
        except (TypeError, ValueError, KeyError) as e:  # PolicyError is a ValueError
            raise SessionFileError(f"{name} holds an invalid spec or policy: {_one_line(e)}") from None
        if spec is not None and spec != saved_spec:
            raise SessionFileError(f"{name} has cache spec {saved_spec}, expected {spec}")
        if policy is not None and policy.host() != header["policy"]:
            raise SessionFileError(f"{name} has policy {saved_policy.name}, expected {policy.name}")
        expected = cache_arrays(jax.eval_shape(lambda: init_cache(saved_spec)))
        cache_names = {f"cache.{k}" for k in expected}
        saved = header.get("cold_slots_saved")
        if saved != saved_spec.cold_slots:  # the store's never-written tail was not saved
            page = saved_spec.cold.page_size if saved_spec.cold else 1
            if not (isinstance(saved, int) and 0 <= saved < saved_spec.cold_slots and saved % page == 0):
                raise SessionFileError(f"{name} holds an invalid cold store length {saved!r}")
            grown = grow_cold_store({k[len("cache."):]: v for k, v in arrays.items() if k in cache_names}, saved_spec)
            arrays.update({f"cache.{k}": v for k, v in grown.items()})
        recent = arrays.pop("recent", None)
        if set(arrays) != cache_names | {"rng"} or recent is None:
            raise SessionFileError(f"{name} holds arrays {sorted(arrays) + (['recent'] if recent is not None else [])}, "
                                   f"expected {sorted(cache_names | {'rng', 'recent'})}")
        for key, e in expected.items():
            a = arrays[f"cache.{key}"]
            if a.shape != e.shape or a.dtype != e.dtype:
                raise SessionFileError(f"{name}: array {key} is {a.dtype}{list(a.shape)} but its spec needs "
                                       f"{e.dtype}{list(e.shape)}")
        try:
            sampling = Sampling.from_json(header["sampling"])
            session = cls(apply_fn, params, saved_spec, saved_policy, prefill_chunk=int(header["prefill_chunk"]),
                          sampling=sampling, seed=int(header["seed"]), eos_ids=[int(e) for e in header["eos_ids"]],
                          vocab_size=header["vocab_size"],
                          max_candidates=header["max_candidates"])
            if recent.shape != session.recent.shape or recent.dtype != session.recent.dtype:
                raise ValueError(f"recent-token ring {recent.dtype}{list(recent.shape)}")
            pending = header["pending"]
            if pending is not None and (not isinstance(pending, int) or isinstance(pending, bool)):
                raise ValueError(f"pending token {pending!r}")
            rng = arrays["rng"]
            if rng.shape != session.rng.shape or rng.dtype != session.rng.dtype:
                raise ValueError(f"rng key {rng.dtype}{list(rng.shape)}")
            t, start = int(arrays["cache.t"]), int(arrays["cache.start"])
            if not 0 <= start <= t or t - start != header["n_tokens"]:
                raise ValueError(f"counters t={t} start={start} n_tokens={header['n_tokens']}")
        except (TypeError, ValueError, KeyError) as e:
            raise SessionFileError(f"{name} holds an invalid session: {_one_line(e)}") from None
        session.cache = cache_from_arrays({k[len("cache."):]: v for k, v in arrays.items() if k in cache_names},
                                          saved_spec)
        session.rng = jnp.asarray(rng)
        session.recent = jnp.asarray(recent)
        session.pending = pending
        session.extra = header["extra"]
        return session

    @staticmethod
    def read_header(path: str | os.PathLike) -> dict:
        """The verified header of a session file (identity, spec, policy, sampler settings, extra, ...)."""
        return read_session_file(path)[0]
