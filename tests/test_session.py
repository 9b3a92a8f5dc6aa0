"""Resumable sessions: Session.save / Session.load give bit-identical continuations; bad files are refused
with SessionFileError (one line) and never loaded wrongly; saves are atomic. One slow CLI test with the
real model: decode.py --save then --resume equals an uninterrupted run."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from rsqr_jax import session as S
from rsqr_jax.sampling import Sampling
from rsqr_jax.spec import CacheSpec
from rsqr_jax.cache import cache_arrays
from rsqr_jax.session import Session, SessionFileError
from tests.cli import run_in_process as run
from tests.tiny_session import CFG, IDENTITY, POLICIES, SPEC, make_session, model


DATA_SEED = 2024  # the prompts', session seeds' and flipped bytes' seed: every failure message names it


def _prompts(n: int, size: int = 13) -> list[np.ndarray]:
    rng = np.random.default_rng(DATA_SEED)
    return [rng.integers(0, CFG.vocab_size, size=size) for _ in range(n)]


def _state(session: Session) -> dict:
    """Everything that determines the continuation, as host arrays."""
    out = {f"cache.{k}": np.asarray(v) for k, v in cache_arrays(session.cache).items()}
    out["rng"] = np.asarray(session.rng)
    out["recent"] = np.asarray(session.recent)
    out["pending"] = np.asarray(-1 if session.pending is None else session.pending)
    return out


def _assert_same_state(a: Session, b: Session, why: str = f"data seed {DATA_SEED}") -> None:
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys(), why
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, f"{k}, {why}"
        bits = lambda x: x.reshape(-1).view(np.uint8)  # noqa: E731 - bitwise, also for bfloat16
        np.testing.assert_array_equal(bits(sa[k]), bits(sb[k]), err_msg=f"{k}, {why}")


def _roundtrip(session: Session, path) -> Session:
    session.save(path, IDENTITY, extra={"note": "mid-stream", "turn": 1})
    apply_fn, params = model()
    resumed = Session.load(path, apply_fn, params, IDENTITY)
    _assert_same_state(session, resumed)
    assert resumed.extra == {"note": "mid-stream", "turn": 1}
    return resumed


@pytest.mark.parametrize("policy,sampling", [
    # top-p / min-p act before the temperature (llama.cpp's order): on the tiny model's sharp logits any top_p
    # < 1 keeps the argmax alone, so the sampled cases filter with top_k.
    ("rsqr", Sampling()), ("replay", Sampling(temperature=8.0, top_k=50)),
    ("rsqr_precompute", Sampling(temperature=8.0)),
    ("rsqr", Sampling(temperature=8.0, top_k=20, min_p=0.01, repeat_penalty=1.3, frequency_penalty=0.5)),
], ids=["greedy", "top_p", "temperature", "penalties"])
def test_resumed_session_continues_bit_identically(tmp_path, policy, sampling):
    # The tiny random model's logits are sharp (tied embeddings), so sampling needs a high temperature
    # to produce varied tokens; greedy mostly repeats a token, which is why the cache is compared too.
    # The sampler's ring of recent tokens is part of the compared state.
    a, b = _prompts(2)
    temperature = sampling.temperature
    kw = dict(sampling=sampling, seed=int(np.random.default_rng(DATA_SEED).integers(2**31)))
    seeds = f"data seed {DATA_SEED}, session seed {kw['seed']}"

    ref = make_session(policy, **kw)
    ref.feed(a)
    ref_tokens = ref.generate(12)
    ref.feed(b)
    ref_tokens += ref.generate(12)

    s = make_session(policy, **kw)
    s.feed(a)
    s = _roundtrip(s, tmp_path / "s1.session")  # right after a prefill (pending token not yet emitted)
    tokens = s.generate(5)
    s = _roundtrip(s, tmp_path / "s1.session")  # mid-generation, overwriting the first save
    tokens += s.generate(7)
    s.feed(b)
    tokens += s.generate(12)

    assert tokens == ref_tokens, seeds
    _assert_same_state(s, ref, seeds)
    assert s.n_tokens == ref.n_tokens > 2 * 8  # the stream outgrew the window: evictions happened
    if temperature > 0:
        assert len(set(ref_tokens)) > 5, seeds  # really sampled


def test_resume_restores_the_rng_key(tmp_path):
    # Guards the test above against a vacuous pass: a resumed session with a fresh key diverges.
    kw = dict(sampling=Sampling(temperature=8.0, top_k=50), seed=7)
    s = make_session("rsqr", **kw)
    s.feed(_prompts(1)[0])
    s.generate(3)
    path = tmp_path / "x.session"
    s.save(path, IDENTITY)
    want = s.generate(20)
    apply_fn, params = model()
    r = Session.load(path, apply_fn, params, IDENTITY)
    assert r.generate(20) == want, f"data seed {DATA_SEED}"
    r = Session.load(path, apply_fn, params, IDENTITY)
    r.rng = jax.random.PRNGKey(7)
    assert r.generate(20) != want, f"data seed {DATA_SEED}"


def test_warmup_leaves_the_session_as_it_was():
    """warmup compiles by running each function once: an empty session lends its own cache (donated, so it is
    never copied) and gets a new empty one; a session mid-stream runs on a copy. Either way the continuation
    is the one a session without warmup gives, bit for bit."""
    kw = dict(sampling=Sampling(temperature=8.0, top_k=50), seed=3)
    prompt = _prompts(1)[0]
    plain, fresh = make_session("rsqr", **kw), make_session("rsqr", **kw)
    lent = fresh.cache.win_k
    fresh.warmup()
    assert lent.is_deleted() and not fresh.cache.win_k.is_deleted()  # the empty cache was lent, not copied
    assert fresh.n_tokens == 0 and fresh._warm == {"prefill", "decode", "generate"}
    for s in (plain, fresh):
        s.feed(prompt)
        s.generate(4)
    _assert_same_state(plain, fresh)
    mid = make_session("rsqr", **kw)  # mid-stream: the copy path
    mid.feed(prompt)
    mid.generate(4)
    before = _state(mid)
    kept = mid.cache.win_k
    mid.warmup()
    assert not kept.is_deleted() and mid.cache.win_k is kept
    assert all(np.array_equal(v, _state(mid)[k]) for k, v in before.items())
    assert mid.generate(6) == plain.generate(6), f"data seed {DATA_SEED}"


# ---------------------------------------------------------------------------------------------------------
# Bad files.


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(path, bytes, session) of a valid session file mid-stream."""
    s = make_session("replay", sampling=Sampling(temperature=8.0, top_p=0.9), seed=1)
    s.feed(_prompts(1, 30)[0])
    s.generate(3)
    path = tmp_path_factory.mktemp("saved") / "valid.session"
    s.save(path, IDENTITY, extra={"chat": True})
    return path, path.read_bytes(), s


def _load(path, **kw):
    apply_fn, params = model()
    return Session.load(path, apply_fn, params, kw.pop("identity", IDENTITY), **kw)


def _refused(path, fragment: str = "", **kw) -> str:
    with pytest.raises(SessionFileError) as e:
        _load(path, **kw)
    msg = str(e.value)
    assert "\n" not in msg and msg, msg
    assert fragment in msg, msg
    return msg


def test_truncated_files_are_refused(saved, tmp_path):
    path, raw, _ = saved
    for n in (0, 3, 10, 200, len(raw) // 2, len(raw) - 1):
        cut = tmp_path / f"cut{n}.session"
        cut.write_bytes(raw[:n])
        _refused(cut, "not a session file" if n < 4 else "truncated or corrupt")


def test_flipped_bytes_are_refused_or_harmless(saved, tmp_path):
    # Any single flipped byte is either detected, or (e.g. in zip metadata nobody reads) loads the
    # exact same session: a file is never loaded wrongly.
    path, raw, original = saved
    rng = np.random.default_rng(DATA_SEED)
    offsets = [len(raw) // 2, raw.index(b'"format"')] + list(rng.integers(0, len(raw), size=40))
    refused = 0
    for i, off in enumerate(offsets):
        bad = bytearray(raw)
        bad[off] ^= 1 << int(rng.integers(8))
        p = tmp_path / f"flip{i}.session"
        p.write_bytes(bytes(bad))
        try:
            loaded = _load(p)
        except SessionFileError as e:
            assert "\n" not in str(e), f"offset {off}, data seed {DATA_SEED}"
            refused += 1
            continue
        _assert_same_state(loaded, original, f"offset {off}, data seed {DATA_SEED}")
    # nearly every byte of the file is data or checked metadata
    assert refused >= len(offsets) * 3 // 4, f"data seed {DATA_SEED}"


def test_missing_directory_and_garbage_files_are_refused(tmp_path):
    _refused(tmp_path / "none.session", "not found")
    _refused(tmp_path, "cannot read")
    (tmp_path / "junk").write_bytes(np.random.default_rng(DATA_SEED).bytes(4096))
    _refused(tmp_path / "junk", "not a session file")
    np.savez(tmp_path / "other.npz", header=np.frombuffer(b'{"format": "something else"}', np.uint8))
    _refused(tmp_path / "other.npz", "is not an rsqr_jax.session file")


def test_other_model_identity_is_refused(saved):
    path, _, _ = saved
    _refused(path, "saved for another model", identity={**IDENTITY, "model": "other"})
    _refused(path, "dtype", identity={**IDENTITY, "dtype": "bfloat16"})


def test_other_spec_or_policy_is_refused(saved):
    path, _, _ = saved
    other = dataclasses.replace(SPEC, win_capacity=SPEC.win_capacity + 1)
    _refused(path, "has cache spec", spec=other)
    _refused(path, "has policy", policy=POLICIES["rsqr"])
    assert _load(path, spec=SPEC, policy=POLICIES["replay"]).n_tokens == 33  # the right ones load


def _rewrite(src, dst, edit) -> None:
    """Rewrite a valid file with an edited header and a *valid* checksum: well-formed but wrong."""
    header, arrays = S.read_session_file(src)
    header = {k: v for k, v in header.items() if k not in ("arrays", "checksum")}
    edit(header, arrays)
    S.write_session_file(dst, header, arrays)


def test_well_formed_but_inconsistent_files_are_refused(saved, tmp_path):
    path, _, _ = saved
    p = tmp_path / "w.session"

    _rewrite(path, p, lambda h, a: h.update(version=S.FORMAT_VERSION + 1))
    _refused(p, f"format version {S.FORMAT_VERSION + 1}")

    def grow_ring(h, a):
        h["spec"] = {**h["spec"], "win_capacity": h["spec"]["win_capacity"] + 4}
    _rewrite(path, p, grow_ring)
    _refused(p, "but its spec needs")  # arrays no longer match the (self-consistent) spec

    def bad_policy(h, a):
        h["policy"] = {**h["policy"], "window": 1000}
    _rewrite(path, p, bad_policy)
    _refused(p, "invalid spec or policy")

    def drop_array(h, a):
        del a["rng"]
    _rewrite(path, p, drop_array)
    _refused(p, "holds arrays")

    def bad_counter(h, a):
        h["n_tokens"] = h["n_tokens"] + 1
    _rewrite(path, p, bad_counter)
    _refused(p, "invalid session")

    _rewrite(path, p, lambda h, a: h.pop("identity"))
    _refused(p, "malformed header: field 'identity'")
    _rewrite(path, p, lambda h, a: h.update(seed="7"))
    _refused(p, "malformed header: field 'seed'")
    _rewrite(path, p, lambda h, a: h["policy"].update(mode=99))
    _refused(p, "malformed header: policy")
    with pytest.raises(SessionFileError, match="malformed header"):
        Session.read_header(p)  # what decode.py --resume reads first

    _rewrite(path, p, lambda h, a: h.update(cold_slots_saved=3))  # a cut cold store it cannot have
    _refused(p, "invalid cold store length 3")

    _rewrite(path, p, lambda h, a: None)  # the unedited rewrite loads: the checks above are not vacuous
    _load(p)


# ---------------------------------------------------------------------------------------------------------
# Atomic writes.


def _listing(d):
    return sorted(os.listdir(d))


def test_save_is_atomic(monkeypatch, tmp_path):
    s = make_session("rsqr")
    s.feed(_prompts(1)[0])
    path = tmp_path / "a.session"
    s.save(path, IDENTITY)
    old = path.read_bytes()
    s.generate(4)  # the state moved on: a new save would differ

    def crash(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(S.os, "replace", crash)
    with pytest.raises(SessionFileError, match="No space left on device"):
        s.save(path, IDENTITY)
    assert path.read_bytes() == old and _listing(tmp_path) == ["a.session"]

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(S.np, "savez", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.save(path, IDENTITY)
    assert path.read_bytes() == old and _listing(tmp_path) == ["a.session"]
    monkeypatch.undo()

    s.save(path, IDENTITY)  # and a save that completes replaces it
    assert path.read_bytes() != old and _listing(tmp_path) == ["a.session"]
    _load(path)


def test_unwritable_targets_fail_cleanly(tmp_path):
    s = make_session("rsqr")
    s.feed(_prompts(1)[0])
    with pytest.raises(SessionFileError, match="cannot write"):
        s.save(tmp_path / "no" / "such" / "dir.session", IDENTITY)
    with pytest.raises(SessionFileError, match="is a directory"):
        s.save(tmp_path, IDENTITY)
    with pytest.raises(ValueError, match="JSON-serializable"):
        s.save(tmp_path / "x.session", {"model": object()})
    assert _listing(tmp_path) == []


def test_bfloat16_cache_round_trips_bitwise(tmp_path):
    # bfloat16 caches are stored as raw bytes: nothing is rounded through float32 or a void dtype.
    apply_fn, params = model()
    spec = dataclasses.replace(SPEC, dtype="bfloat16")
    s = Session(apply_fn, params, spec, POLICIES["rsqr"], prefill_chunk=4)
    rng = np.random.default_rng(DATA_SEED)
    s.cache = s.cache.replace(**{name: jax.numpy.asarray(rng.normal(size=getattr(s.cache, name).shape),
                                                         spec.dtype)
                                 for name in ("win_k", "win_v", "surv_k", "surv_v")})
    s.save(tmp_path / "bf16.session", IDENTITY)
    r = Session.load(tmp_path / "bf16.session", apply_fn, params, IDENTITY)
    assert r.cache.win_k.dtype == spec.dtype and isinstance(r.spec, CacheSpec) and r.spec == spec
    _assert_same_state(s, r)


# ---------------------------------------------------------------------------------------------------------
# The command line with the real model.


@pytest.mark.slow
def test_decode_save_then_resume_equals_one_run(tmp_path, smollm2_path):
    turns = ["Hi! My name is Ada and I keep bees in Lisbon.", "What is my name?"]
    flags = ["--chat", "--max-new-tokens", "8", "--window", "32", "--max-survivors", "4", "--prefill-chunk", "16",
             "--temperature", "0.7", "--top-p", "0.9", "--seed", "5", "--json"]
    # The three runs in this process (tests/cli.py run_in_process: one model load; decode.py runs as its own
    # process in tests/test_cli.py and tests/test_chat.py); a save and a resume are separate runs all the same.
    whole = run("decode.py", *flags, stdin="\n".join(turns) + "\n")
    assert whole.returncode == 0, whole.stderr
    path = tmp_path / "chat.session"
    first = run("decode.py", *flags, "--save", str(path), stdin=turns[0] + "\n")
    assert first.returncode == 0, first.stderr
    header = Session.read_header(path)
    assert header["extra"]["chat"] and len(header["extra"]["messages"]) == 2
    # Policy and sampler flags come from the file (repeating them is fine, conflicting ones are not).
    second = run("decode.py", "--resume", str(path), "--max-new-tokens", "8", "--json", stdin=turns[1] + "\n")
    assert second.returncode == 0, second.stderr
    replies = json.loads(whole.stdout)["replies"]
    assert json.loads(first.stdout)["replies"] == replies[:1]
    assert json.loads(second.stdout)["replies"] == replies[1:]
    assert json.loads(second.stdout)["session_tokens"] == json.loads(whole.stdout)["session_tokens"]
