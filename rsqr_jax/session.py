"""A streaming generation session: cache + policy + sampler state + the two jitted steps (prefill, decode).

Model-agnostic: it takes the model's pure apply function. Each step is compiled once (prefill at a
fixed chunk size with a dynamic number of real tokens, decode at one token) and donates the cache,
so a session of any length runs in place under exactly two compilations.

Sessions can be saved and resumed bit-identically (`Session.save` / `Session.load`). The file is a
numpy .npz archive (never pickled) holding:

* ``header``: UTF-8 JSON: format name and version, the caller's model identity, the CacheSpec, the
  policy values, the sampler settings (temperature, top_p, seed), eos ids, the pending token, the
  caller's ``extra`` dict (e.g. a chat transcript), the name/dtype/shape of every array, and a
  SHA-256 checksum over the header (without the checksum) and every array's name, dtype, shape, bytes;
* one entry per array (every KVCache field, and the rng key), stored as its raw bytes (so bfloat16
  and any other dtype round-trip exactly).

Writes are atomic: a temporary file in the target directory, fsync, then os.replace, so a crash
leaves either the old file or the new one, never a half-written one. Anything that does not read
back as exactly the session it claims to be (truncated, corrupted, another format version, saved for
another model identity, arrays that do not fit its spec, a spec or policy other than the caller
expects) raises SessionFileError with a one-line message: a file is never loaded wrongly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import tempfile
import time
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from rsqr_jax.cache import MAX_POSITION, CacheSpec, KVCache, init_cache, validate
from rsqr_jax.policy import FULL as P_FULL
from rsqr_jax.policy import Policy, PolicyError
from rsqr_jax.stream import decode_and_sample

FORMAT = "rsqr_jax.session"
FORMAT_VERSION = 1


class SessionFileError(ValueError):
    """A session file that cannot be written, or cannot be read back as exactly the session it claims to be."""


@functools.lru_cache(maxsize=32)
def _jitted_step(apply_fn, policy_values: tuple[int, ...]):
    """The jitted step of one concrete policy (field values in Policy order).

    A Session's policy never changes, so its values are compile-time constants here: XLA folds every
    mode test of plan_step / layer_attention and drops the branches this policy never takes (per layer
    and step, the rerotate and streamingllm conds each cost a copy of the layer's keys otherwise).
    """

    def fn(params, tokens_BxC, cache, n_valid, rng, temperature, top_p):
        policy = Policy(*(jnp.asarray(v, jnp.int32) for v in policy_values))
        return decode_and_sample(apply_fn, params, tokens_BxC, cache, policy, n_valid, rng, temperature, top_p)

    return jax.jit(fn, donate_argnums=(2,))


class Session:
    """Feed tokens, generate tokens; the cache stays bounded by the policy however long it runs.

    `pending` is the token sampled after the last fed token (None before the first feed, or right
    after generation emitted an end-of-sequence token, which is never fed). `vocab_size`, when given,
    makes `feed` reject out-of-range token ids (which a gather would otherwise silently clamp).
    `extra` is a JSON-serializable dict the caller may fill; it is saved and restored with the session.
    """

    def __init__(self, apply_fn: Callable, params, spec: CacheSpec, policy: Policy, *, prefill_chunk: int = 64,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, eos_ids: Iterable[int] = (),
                 vocab_size: int | None = None):
        if spec.batch != 1:
            raise ValueError("a Session streams one sequence (spec.batch must be 1)")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, (int, np.integer)) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        self.prefill_chunk = min(int(prefill_chunk), spec.max_chunk)
        validate(policy, spec, chunk=self.prefill_chunk)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if not (temperature >= 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        self.apply_fn, self.params, self.spec, self.policy = apply_fn, params, spec, policy
        self.temperature, self.top_p, self.seed = float(temperature), float(top_p), int(seed)
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self.cache: KVCache = init_cache(spec)
        self.rng = jax.random.PRNGKey(self.seed)
        self.pending: int | None = None
        self.extra: dict = {}
        self._step = _jitted_step(apply_fn, tuple(int(np.asarray(getattr(policy, f.name)))
                                                  for f in dataclasses.fields(Policy)))
        self._compiled: dict[int, Callable] = {}
        self.compile_s = 0.0

    @property
    def n_tokens(self) -> int:
        """Tokens fed so far."""
        return int(self.cache.t) - int(self.cache.start)

    def _args(self, ids: np.ndarray, n_valid: int):
        return (self.params, jnp.asarray(ids[None], jnp.int32), self.cache, jnp.int32(n_valid), self.rng,
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
        ids = np.asarray(list(ids))
        if ids.size == 0:
            raise ValueError("nothing to feed: empty token list")
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token ids must be a flat list of integers, got dtype {ids.dtype} shape {ids.shape}")
        hi = self.vocab_size if self.vocab_size is not None else 2**31
        if ids.min() < 0 or ids.max() >= hi:
            bad = int(ids[(ids < 0) | (ids >= hi)][0])
            raise ValueError(f"token id {bad} is out of range [0, {hi})")
        ids = ids.astype(np.int32)
        full_policy = int(np.asarray(self.policy.mode)) == P_FULL
        if full_policy and self.n_tokens + ids.size > self.spec.ring_capacity:
            raise ValueError(f"full attention cache holds {self.spec.ring_capacity} tokens; "
                             f"{self.n_tokens + ids.size} requested (use a bounded policy)")
        if int(self.cache.t) + ids.size > MAX_POSITION:
            raise ValueError(f"the stream would pass global position {MAX_POSITION} (int32 positions)")
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

    # ------------------------------------------------------------------------------------------------
    # Save / resume.

    def save(self, path: str | os.PathLike, identity: dict, *, extra: dict | None = None) -> None:
        """Write the whole session state to `path` atomically (see the module docstring for the format).

        identity: a JSON-serializable dict naming the model (e.g. models.llama.LoadedModel.identity);
        `load` refuses the file for any other identity. extra: replaces `self.extra` if given.
        Raises SessionFileError (one line) if the file cannot be written; the old file, if any, is intact.
        """
        if extra is not None:
            self.extra = dict(extra)
        arrays = {f"cache.{f.name}": np.asarray(getattr(self.cache, f.name)) for f in dataclasses.fields(KVCache)}
        arrays["rng"] = np.asarray(self.rng)
        header = {
            "format": FORMAT, "version": FORMAT_VERSION,
            "identity": _json_clean(identity, "identity"), "extra": _json_clean(self.extra, "extra"),
            "spec": dataclasses.asdict(self.spec),
            "policy": {f.name: int(np.asarray(getattr(self.policy, f.name))) for f in dataclasses.fields(Policy)},
            "prefill_chunk": self.prefill_chunk, "temperature": self.temperature, "top_p": self.top_p,
            "seed": self.seed, "eos_ids": sorted(self.eos_ids), "vocab_size": self.vocab_size,
            "pending": self.pending, "n_tokens": self.n_tokens,
        }
        write_session_file(path, header, arrays)

    @classmethod
    def load(cls, path: str | os.PathLike, apply_fn: Callable, params, identity: dict, *,
             spec: CacheSpec | None = None, policy: Policy | None = None) -> "Session":
        """Resume a saved session on the model (apply_fn, params) named by `identity`.

        The cache, counters, policy, sampler state (rng key included), pending token and `extra` come
        back exactly, so continuing gives the same tokens as a run that was never interrupted. `spec`
        / `policy`, if given, must equal the saved ones. Raises SessionFileError (one line) otherwise.
        """
        header, arrays = read_session_file(path)
        name = os.fspath(path)
        check_identity(name, header.get("identity"), identity)
        try:
            saved_spec = CacheSpec(**header["spec"])
            fields = [f.name for f in dataclasses.fields(Policy)]
            if sorted(header["policy"]) != sorted(fields):
                raise ValueError(f"policy fields {sorted(header['policy'])}")
            saved_policy = Policy(**{k: jnp.asarray(int(header["policy"][k]), jnp.int32) for k in fields})
            validate(saved_policy, saved_spec, chunk=int(header["prefill_chunk"]))
        except (TypeError, ValueError, KeyError) as e:  # PolicyError is a ValueError
            raise SessionFileError(f"{name} holds an invalid spec or policy: {_one_line(e)}") from None
        if spec is not None and spec != saved_spec:
            raise SessionFileError(f"{name} has cache spec {saved_spec}, expected {spec}")
        if policy is not None and _policy_values(policy) != header["policy"]:
            raise SessionFileError(f"{name} has policy {saved_policy.name}, expected {policy.name}")
        expected = jax.eval_shape(lambda: init_cache(saved_spec))
        cache_names = {f"cache.{f.name}" for f in dataclasses.fields(KVCache)}
        if set(arrays) != cache_names | {"rng"}:
            raise SessionFileError(f"{name} holds arrays {sorted(arrays)}, expected {sorted(cache_names | {'rng'})}")
        for f in dataclasses.fields(KVCache):
            a, e = arrays[f"cache.{f.name}"], getattr(expected, f.name)
            if a.shape != e.shape or a.dtype != e.dtype:
                raise SessionFileError(f"{name}: array {f.name} is {a.dtype}{list(a.shape)} but its spec needs "
                                       f"{e.dtype}{list(e.shape)}")
        try:
            session = cls(apply_fn, params, saved_spec, saved_policy, prefill_chunk=int(header["prefill_chunk"]),
                          temperature=float(header["temperature"]), top_p=float(header["top_p"]),
                          seed=int(header["seed"]), eos_ids=[int(e) for e in header["eos_ids"]],
                          vocab_size=header["vocab_size"])
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
        session.cache = KVCache(**{f.name: jnp.asarray(arrays[f"cache.{f.name}"]) for f in dataclasses.fields(KVCache)})
        session.rng = jnp.asarray(rng)
        session.pending = pending
        session.extra = header["extra"]
        return session

    @staticmethod
    def read_header(path: str | os.PathLike) -> dict:
        """The verified header of a session file (identity, spec, policy, sampler settings, extra, ...)."""
        return read_session_file(path)[0]


# ----------------------------------------------------------------------------------------------------
# The file format (module-level so tests can craft files that are well-formed but wrong).


def _one_line(e: BaseException | str) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def _json_clean(obj, what: str):
    """obj after a JSON round trip (what the file will hold); ValueError if it is not JSON-serializable."""
    try:
        return json.loads(json.dumps(obj, sort_keys=True, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be JSON-serializable: {_one_line(e)}") from None


def check_identity(name, saved: dict, identity: dict) -> None:
    """SessionFileError (one line, naming the differing keys) unless a file's saved identity equals `identity`."""
    want = _json_clean(identity, "identity")
    if not isinstance(saved, dict) or saved != want:
        saved = saved if isinstance(saved, dict) else {}
        diff = [f"{k}: {saved.get(k)!r} != {want.get(k)!r}"
                for k in sorted(set(saved) | set(want)) if saved.get(k) != want.get(k)]
        raise SessionFileError(f"{os.fspath(name)} was saved for another model ({'; '.join(diff)})")


def _policy_values(policy: Policy) -> dict:
    try:
        return {f.name: int(np.asarray(getattr(policy, f.name))) for f in dataclasses.fields(Policy)}
    except TypeError:  # a batched policy is never a Session's
        return {}


def _checksum(header: dict, arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    body = {k: v for k, v in header.items() if k != "checksum"}
    h.update(json.dumps(body, sort_keys=True).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"\0{name}\0{a.dtype.name}\0{list(a.shape)}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def write_session_file(path: str | os.PathLike, header: dict, arrays: dict[str, np.ndarray]) -> None:
    """Atomically write header (completed with array metadata and checksum) + arrays; SessionFileError on failure."""
    path = os.fspath(path)
    header = _json_clean(header, "header")  # exactly what the file will hold (and what load re-checksums)
    header["arrays"] = {k: {"dtype": np.asarray(a).dtype.name, "shape": list(np.shape(a))} for k, a in arrays.items()}
    header["checksum"] = _checksum(header, arrays)
    payload = {"header": np.frombuffer(json.dumps(header, sort_keys=True).encode(), np.uint8)}
    for k, a in arrays.items():
        payload[f"a/{k}"] = np.frombuffer(np.ascontiguousarray(a).tobytes(), np.uint8)
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise SessionFileError(f"cannot write session file {path}: it is a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    except OSError as e:
        raise SessionFileError(f"cannot write session file {path}: {e.strerror or _one_line(e)}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise SessionFileError(f"cannot write session file {path}: {e.strerror or _one_line(e)}") from None
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def read_session_file(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """(header, arrays) of a session file, checked for format, version and checksum; SessionFileError otherwise."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise SessionFileError(f"session file not found: {name}") from None
    except OSError as e:
        raise SessionFileError(f"cannot read session file {name}: {e.strerror or _one_line(e)}") from None
    if not raw.startswith(b"PK\x03\x04"):
        raise SessionFileError(f"{name} is not a session file (not an .npz archive{'; empty' if not raw else ''})")
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            entries = {k: np.asarray(z[k]) for k in z.files}
        header = json.loads(entries.pop("header").tobytes().decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except Exception as e:  # zipfile / numpy / json raise many types on truncated or corrupt input
        raise SessionFileError(f"{name} is not a readable session file (truncated or corrupt: {_one_line(e)})") \
            from None
    if header.get("format") != FORMAT:
        raise SessionFileError(f"{name} is not an {FORMAT} file")
    if header.get("version") != FORMAT_VERSION:
        raise SessionFileError(f"{name} has session format version {header.get('version')!r}; this code reads "
                               f"version {FORMAT_VERSION}")
    try:
        meta = header["arrays"]
        if set(meta) != {k[2:] for k in entries if k.startswith("a/")} or len(meta) != len(entries):
            raise ValueError("array list does not match the archive")
        arrays = {}
        for k, m in meta.items():
            dt = jnp.dtype(m["dtype"])
            shape = tuple(int(s) for s in m["shape"])
            buf = entries[f"a/{k}"]
            if buf.dtype != np.uint8 or buf.size != dt.itemsize * math.prod(shape):
                raise ValueError(f"array {k} has {buf.size} bytes, expected {dt}{list(shape)}")
            arrays[k] = buf.view(dt).reshape(shape)
    except Exception as e:
        raise SessionFileError(f"{name} is corrupt: {_one_line(e)}") from None
    if header.get("checksum") != _checksum(header, arrays):
        raise SessionFileError(f"{name} is corrupt: checksum mismatch")
    _check_header_fields(name, header)
    return header, arrays


_INT, _NUM = (int,), (int, float)
_HEADER_FIELDS = {"identity": (dict,), "extra": (dict,), "spec": (dict,), "policy": (dict,), "prefill_chunk": _INT,
                  "temperature": _NUM, "top_p": _NUM, "seed": _INT, "eos_ids": (list,),
                  "vocab_size": _INT + (type(None),), "pending": _INT + (type(None),), "n_tokens": _INT}


def _check_header_fields(name: str, header: dict) -> None:
    """The header has every field a Session needs, of the right JSON type (so readers can index it safely)."""
    from rsqr_jax.policy import MODES, OVERFLOWS

    for key, types in _HEADER_FIELDS.items():
        v = header.get(key)
        if key not in header or not isinstance(v, types) or isinstance(v, bool):
            raise SessionFileError(f"{name} has a malformed header: field {key!r} = {v!r}")
    pol = header["policy"]
    if (not all(isinstance(pol.get(f.name), int) for f in dataclasses.fields(Policy))
            or not 0 <= pol["mode"] < len(MODES) or not 0 <= pol["overflow"] < len(OVERFLOWS)):
        raise SessionFileError(f"{name} has a malformed header: policy {pol!r}")
