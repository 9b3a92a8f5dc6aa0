"""The sampler (rsqr_jax.sampling): its filter chain against a float64 numpy reference, draws that follow
the distribution, greedy = top_k 1, penalties on exactly the ring's tokens, no vocabulary sort, one
compilation for any sampling values, seeded sessions and schedulers reproducible, old files still load."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rsqr_jax import engine
from rsqr_jax.sampling import Sampling, SamplingError, penalize, probabilities, push_recent, sample
from rsqr_jax.session import Session, SessionFileError
from rsqr_jax.session_file import read_session_file, write_session_file
from rsqr_jax.streams import Request, StreamScheduler
from tests.tiny_session import CFG, IDENTITY, POLICIES, SPEC, make_session, model

V, C = 300, 32  # vocabulary, max_candidates of these tests


def reference(logits_V, s: Sampling, recent_R, max_candidates=C) -> dict[int, float]:
    """{token: probability} of the module's chain (penalties -> top_k -> top_p -> min_p -> temperature),
    float64, written from its definition over the whole vocabulary."""
    x = np.asarray(logits_V, np.float64).copy()
    window = [t for t in list(recent_R)[len(recent_R) - s.repeat_last_n:] if t >= 0] if s.repeat_last_n else []
    for t in set(window):
        n = window.count(t)
        x[t] = x[t] / s.repeat_penalty if x[t] > 0 else x[t] * s.repeat_penalty
        x[t] -= s.presence_penalty + s.frequency_penalty * n
    if s.temperature == 0:
        return {int(np.argmax(x)): 1.0}
    order = np.argsort(-x, kind="stable")
    k = min(s.top_k or max_candidates, max_candidates)
    cand = order[:k]
    norm = np.log(np.exp(x[cand] - x.max()).sum()) if s.top_k else np.log(np.exp(x - x.max()).sum())
    p = np.exp(x[cand] - x.max() - norm)
    before = np.cumsum(p) - p
    keep = before < s.top_p if s.top_p < 1 else np.ones(k, bool)
    keep &= p >= s.min_p * p[0]
    cand = cand[keep]
    q = np.exp((x[cand] - x[cand].max()) / s.temperature)
    return dict(zip(cand.tolist(), (q / q.sum()).tolist()))


def _jax_probs(logits_V, s: Sampling, recent_R) -> dict[int, float]:
    ids, p = jax.jit(probabilities, static_argnums=3)(jnp.asarray(logits_V[None], jnp.float32), s.values(),
                                                      jnp.asarray(np.asarray(recent_R)[None], jnp.int32), C)
    return {int(i): float(q) for i, q in zip(np.asarray(ids[0]), np.asarray(p[0])) if q > 0}


SETTINGS = [
    Sampling(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1),  # an Ollama-like chat
    Sampling(temperature=1.0),
    Sampling(temperature=1.5, top_p=0.5),
    Sampling(temperature=0.5, top_k=5),
    Sampling(temperature=1.0, min_p=0.2, presence_penalty=0.5, frequency_penalty=0.3),
    Sampling(temperature=2.0, top_k=100, top_p=0.9, repeat_penalty=1.5, repeat_last_n=6),
    Sampling(repeat_penalty=1.3, frequency_penalty=1.0),  # greedy after penalties
]


def _case(i):
    rng = np.random.default_rng(1000 + i)
    logits = rng.normal(scale=3.0, size=V)
    recent = rng.integers(-1, 20, size=16)  # a ring over the 20 first ids, partly empty
    recent[:3] = -1
    logits[:20] += 4.0  # the ring's tokens are among the likely ones, so the penalties change the outcome
    return logits, recent


@pytest.mark.parametrize("i", range(len(SETTINGS)))
def test_probabilities_equal_the_float64_reference(i):
    s = SETTINGS[i]
    logits, recent = _case(i)
    ring = np.concatenate([np.full(max(0, 64 - recent.size), -1), recent])  # the ring of a 64-token window
    want, got = reference(logits, s, ring), _jax_probs(logits, s, ring)
    assert set(got) == set(want), (sorted(got), sorted(want))
    np.testing.assert_allclose([got[t] for t in want], list(want.values()), rtol=2e-5, atol=1e-7)
    assert 1 <= len(want) <= C and (len(want) > 1 or s.temperature == 0 or s.top_k == 1)


def test_draws_follow_the_distribution():
    s = SETTINGS[0]
    logits, recent = _case(0)
    ring = jnp.asarray(np.concatenate([np.full(48, -1), recent])[None], jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(3), 4000)
    draw = jax.jit(jax.vmap(sample, in_axes=(None, 0, None, None, None)), static_argnums=4)
    lg = jnp.asarray(logits[None], jnp.float32)

    def chi2(settings):
        got = np.asarray(draw(lg, keys, settings.values(), ring, C))[:, 0]
        want = reference(logits, s, np.asarray(ring[0]))
        assert set(got.tolist()) <= set(want)  # nothing outside the support
        obs = np.array([(got == t).sum() for t in want], np.float64)
        exp = np.array(list(want.values())) * len(got)
        return float(((obs - exp) ** 2 / exp).sum()), len(want)

    stat, n = chi2(s)
    assert n >= 3 and stat < n + 6 * np.sqrt(2 * n), (stat, n)  # mean n-1, sd sqrt(2(n-1)): a loose bound
    wrong, _ = chi2(Sampling(**{**s.to_json(), "temperature": 2.0}))  # temperature ignored would look like this
    assert wrong > 10 * (n + 6 * np.sqrt(2 * n)), wrong


def test_top_k_1_is_greedy_and_greedy_is_argmax_after_penalties():
    rng = np.random.default_rng(7)
    logits = jnp.asarray(rng.normal(size=(4, V)), jnp.float32)
    ring = rng.integers(0, V, size=(4, 8))
    ring[:, 0] = np.argmax(np.asarray(logits), -1)  # the penalty moves every row's argmax away
    ring = jnp.asarray(ring, jnp.int32)
    pen = Sampling(repeat_penalty=2.0, frequency_penalty=1.0)
    want = np.argmax(np.asarray(penalize(logits, ring, pen.values())), -1)
    for s in (pen, Sampling(**{**pen.to_json(), "temperature": 3.0, "top_k": 1})):
        for seed in range(3):
            np.testing.assert_array_equal(np.asarray(sample(logits, jax.random.PRNGKey(seed), s.values(), ring, C)),
                                          want)
    plain = np.argmax(np.asarray(logits), -1)
    assert (want != plain).all()
    np.testing.assert_array_equal(np.asarray(sample(logits, jax.random.PRNGKey(0), Sampling().values(), ring, C)),
                                  plain)  # all penalties off: the plain argmax


def test_penalties_change_exactly_the_ring_tokens():
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(2, V)).astype(np.float32)
    ring = np.array([[5, 7, 7, -1, 9, 5, 5, 12], [-1, -1, -1, -1, -1, -1, -1, 3]], np.int32)
    for s in (Sampling(repeat_penalty=1.5), Sampling(presence_penalty=0.4), Sampling(frequency_penalty=0.25),
              Sampling(repeat_penalty=0.8, presence_penalty=-0.3, frequency_penalty=0.1)):
        out = np.asarray(penalize(jnp.asarray(logits), jnp.asarray(ring), s.values()))
        for b in range(2):
            changed = set(np.nonzero(out[b] != logits[b])[0].tolist())
            assert changed == {int(t) for t in ring[b] if t >= 0}, (s, b, changed)
            for t in changed:
                n = int((ring[b] == t).sum())
                x = logits[b, t]
                want = (x / s.repeat_penalty if x > 0 else x * s.repeat_penalty) - s.presence_penalty \
                    - s.frequency_penalty * n
                np.testing.assert_allclose(out[b, t], want, rtol=1e-6)
    # a window shorter than the ring counts only its newest tokens
    out = np.asarray(penalize(jnp.asarray(logits), jnp.asarray(ring), Sampling(repeat_penalty=1.5,
                                                                                repeat_last_n=3).values()))
    assert set(np.nonzero(out[0] != logits[0])[0].tolist()) == {5, 12}
    off = np.asarray(penalize(jnp.asarray(logits), jnp.asarray(ring), Sampling().values()))
    np.testing.assert_array_equal(off, logits)


def test_the_ring_holds_the_last_tokens_fed():
    ring = jnp.full((1, 4), -1, jnp.int32)
    ring = push_recent(ring, jnp.asarray([[1, 2, 3, 0]]), 3)  # 3 real tokens of a padded chunk
    assert np.asarray(ring).tolist() == [[-1, 1, 2, 3]]
    ring = push_recent(ring, jnp.asarray([[4, 5, 6, 7, 8, 9]]), 5)
    assert np.asarray(ring).tolist() == [[5, 6, 7, 8]]
    assert np.asarray(push_recent(ring, jnp.asarray([[1]]), 0)).tolist() == [[5, 6, 7, 8]]
    s = make_session("rsqr", sampling=Sampling(repeat_last_n=64))
    prompt = np.arange(70) % CFG.vocab_size
    s.feed(prompt)  # the prompt counts, as in llama.cpp
    assert np.asarray(s.recent)[0].tolist() == prompt[-64:].tolist()
    out = s.generate(5)
    assert np.asarray(s.recent)[0].tolist() == (prompt.tolist() + out)[-64:]  # every emitted token was fed


def test_no_sort_over_the_vocabulary():
    s = SETTINGS[0].values()
    fn = jax.jit(sample, static_argnums=4)
    args = (jnp.zeros((1, 49152), jnp.float32), jax.random.PRNGKey(0), s, jnp.full((1, 64), -1, jnp.int32), 64)
    jaxpr = str(jax.make_jaxpr(sample, static_argnums=4)(*args))
    assert re.search(r"\btop_k\[", jaxpr) and not re.search(r"\bsort\[", jaxpr)  # primitives, not words
    hlo = fn.lower(*args).compile().as_text()
    sorts = [line for line in hlo.splitlines() if " sort(" in line and "49152" in line]
    assert not sorts, sorts[:2]


def test_validation_messages():
    for kw, fragment in [(dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
                         (dict(temperature=-0.1), "temperature must be finite and >= 0"),
                         (dict(top_k=2.5), "top_k must be an integer >= 0"),
                         (dict(top_k=True), "top_k must be an integer >= 0"),
                         (dict(min_p=-0.1), "min_p must be in [0, 1)"),
                         (dict(repeat_penalty=-1.0), "repeat_penalty must be > 0"),
                         (dict(presence_penalty=float("inf")), "presence_penalty must be a finite number"),
                         (dict(repeat_last_n=-1), "repeat_last_n must be an integer >= 0")]:
        with pytest.raises(SamplingError) as e:
            Sampling(**kw)
        assert fragment in str(e.value) and "\n" not in str(e.value)
    s = SETTINGS[0]
    assert Sampling.from_json(json.loads(json.dumps(s.to_json()))) == s
    with pytest.raises(SamplingError, match="unknown sampling settings"):
        Sampling.from_json({"temprature": 1.0})


def test_one_compilation_for_any_sampling_values_and_seeded_runs():
    prompt = np.random.default_rng(5).integers(0, CFG.vocab_size, size=13)

    def tokens(sampling, seed):
        s = make_session("rsqr", sampling=sampling, seed=seed)
        s.feed(prompt)
        return s.generate(20)

    tokens(Sampling(), 0)  # compiled once for the tiny session's Decoder
    before = dict(engine.TRACES)
    # (the tiny model's distributions are so sharp that any top_p < 1 or min_p > 0 leaves its argmax alone)
    hot = Sampling(temperature=8.0, top_k=30, repeat_penalty=1.2, presence_penalty=0.2)
    a = tokens(hot, 1)
    assert a == tokens(hot, 1) and a != tokens(hot, 2)  # reproducible from its seed, and the seed matters
    assert len(set(a)) > 5  # really sampled
    tokens(Sampling(temperature=0.3, top_p=0.9, min_p=0.05, frequency_penalty=0.5, repeat_last_n=64), 3)
    assert {k: engine.TRACES[k] - before.get(k, 0) for k in ("feed_and_sample", "generate")} == \
        {"feed_and_sample": 0, "generate": 0}


def test_scheduler_per_request_sampling_equals_lone_sessions():
    apply_fn, params = model()
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, CFG.vocab_size, size=n) for n in (9, 14, 6)]
    settings = [None, Sampling(temperature=8.0, top_k=20, repeat_penalty=1.4), Sampling(temperature=4.0, top_p=0.8)]
    base = Sampling(frequency_penalty=0.7)  # the scheduler's default: greedy with a penalty
    alone = []
    for ids, s in zip(prompts, settings):
        sess = make_session("rsqr", sampling=s or base, seed=4)
        sess.feed(ids)
        alone.append(sess.generate(7))
    sched = StreamScheduler(apply_fn, params, SPEC, POLICIES["rsqr"], n_slots=2, prefill_chunk=4, sampling=base,
                            vocab_size=CFG.vocab_size)
    got = sched.run([Request(tuple(int(t) for t in ids), 7, seed=4, sampling=s) for ids, s in zip(prompts, settings)])
    assert [f.tokens for f in got] == alone
    with pytest.raises(ValueError, match="exceeds the scheduler's ring"):
        sched.check(Request((1, 2), 3, sampling=Sampling(repeat_last_n=65)))


def test_sampled_penalised_session_resumes_identically_and_a_file_without_its_sampler_is_refused(tmp_path):
    hot = Sampling(temperature=6.0, top_k=25, repeat_penalty=1.5, presence_penalty=0.3)
    prompt = np.random.default_rng(13).integers(0, CFG.vocab_size, size=11)
    ref = make_session("rsqr", sampling=hot, seed=21)
    ref.feed(prompt)
    want = ref.generate(16)
    s = make_session("rsqr", sampling=hot, seed=21)
    s.feed(prompt)
    got = s.generate(6)
    s.save(tmp_path / "a.session", IDENTITY)
    apply_fn, params = model()
    r = Session.load(tmp_path / "a.session", apply_fn, params, IDENTITY)
    assert r.sampling == hot and np.array_equal(np.asarray(r.recent), np.asarray(s.recent))
    assert got + r.generate(10) == want
    # a file without the sampler's settings or its ring (as an older format wrote) is refused, one line
    header, arrays = read_session_file(tmp_path / "a.session")
    for k in ("sampling", "max_candidates", "arrays", "checksum"):
        header.pop(k)
    arrays.pop("recent")
    write_session_file(tmp_path / "old.session", header, arrays)
    with pytest.raises(SessionFileError, match="old.session has a malformed header: field 'sampling'") as e:
        Session.load(tmp_path / "old.session", apply_fn, params, IDENTITY)
    assert "\n" not in str(e.value)


def test_legacy_temperature_top_p_keywords():
    s = make_session("rsqr", sampling=Sampling(top_k=7), temperature=0.5, top_p=0.9)
    assert s.sampling == Sampling(temperature=0.5, top_p=0.9, top_k=7)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        make_session("rsqr", top_p=0.0)
