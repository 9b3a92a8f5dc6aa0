"""Speed-related changes that must not change results, and the analytic rotation counts of exp_latency.

* bfloat16 caches on CPU run through the model as uint16 bits (rsqr_jax.update): bit-identical
  to the plain bfloat16 path;
* a Session compiles its step with the policy as constants: same tokens as the data-policy step;
* greedy sampling skips the candidate search (lax.cond): same token as argmax, and temperature > 0 still samples;
* rsqr_lab.studies.latency's positions-only rotation counts match what each policy is defined to do,
  and its run (and bench_decode's, greedy tokens equal to HF's) works end to end on the tiny model.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rsqr_jax.models.llama import Llama, split_apply
from rsqr_jax import policy as P
from rsqr_jax import engine as U
from rsqr_jax.engine import Decoder, stream_nll
from rsqr_jax.cache import init_cache
from rsqr_jax.spec import CacheSpec
from rsqr_jax.sampling import Sampling, sample
from rsqr_lab.studies import decode_timing as B
from rsqr_lab.studies import latency as L
from rsqr_jax.spec import ColdStore
from rsqr_jax.session import Session
from rsqr_jax.models.tiny import tiny_config, tiny_weights
from rsqr_lab.testing.tokenizer import ByteTokenizer
from tests.cli import assert_one_line_errors

CFG = tiny_config()
SEED = 2026  # every draw below; a failure message names it


@functools.lru_cache(maxsize=None)
def _model(seed=0):
    return split_apply(Llama(CFG, tiny_weights(CFG, seed), dtype=jnp.float32))


BITS_POLICIES = [P.rsqr(6, 2, 2, 3, block=2), P.rerotate(6, 2, 2, 3, block=2), P.rsqr_precompute(6, 2, 2, 3),
                 P.streamingllm(6, 2)]


@pytest.mark.xla_optimized  # two programs, the same bits: at the optimizations users run
def test_bfloat16_bits_path_is_bit_identical(monkeypatch):
    """Every write path (new K/V, rerotate hops, precompute refresh, streamingllm) under one vmapped batch."""
    apply_fn, params = _model()
    pols = P.stack_policies(BITS_POLICIES)
    spec = CacheSpec.for_policies(BITS_POLICIES, num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                                  head_dim=CFG.head_dim, dtype="bfloat16", max_chunk=3)
    tokens = np.random.default_rng(SEED).integers(0, CFG.vocab_size, size=(1, 30)).astype(np.int32)
    run = lambda: stream_nll(apply_fn, params, tokens, pols, spec, chunk=3, segment=9,  # noqa: E731
                               vmap_policies=True)
    nll_bits, cache_bits = run()
    assert cache_bits.win_k.dtype == jnp.bfloat16 and jax.default_backend() == "cpu"  # the bits path ran
    monkeypatch.setattr(U, "_bits_on_cpu", lambda cache: False)
    jax.clear_caches()  # the engine's compiled functions were traced with the bits path
    try:
        nll_plain, cache_plain = run()
    finally:
        jax.clear_caches()
    assert np.isfinite(nll_bits).all()
    np.testing.assert_array_equal(nll_bits, nll_plain, err_msg=f"seed {SEED}")
    for a, b in zip(jax.tree.leaves(cache_bits), jax.tree.leaves(cache_plain)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.atleast_1d(np.asarray(a)).view(np.uint8),
                                      np.atleast_1d(np.asarray(b)).view(np.uint8))


SESSION_POLICIES = {"rsqr": P.rsqr(6, 2, 2, 3), "streamingllm": P.streamingllm(6, 2),
                    "rerotate": P.rerotate(6, 2, 2, 3, block=3)}


@pytest.mark.parametrize("name", list(SESSION_POLICIES))
def test_session_constant_policy_step_matches_the_data_policy_step(name):
    policy = SESSION_POLICIES[name]
    apply_fn, params = _model(1)
    spec = CacheSpec.for_policies(list(SESSION_POLICIES.values()), num_layers=CFG.num_layers,
                                  num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim, max_chunk=4)
    prompt = np.random.default_rng(SEED).integers(0, CFG.vocab_size, size=9)
    s = Session(apply_fn, params, spec, policy, prefill_chunk=4)
    s.feed(prompt)
    got = s.generate(20)
    # the same stream through the plain step, policy passed as data (one compilation for all three)
    run = Decoder(apply_fn, spec).feed
    cache, want, nxt = init_cache(spec), [], None
    for start in range(0, prompt.size, 4):
        part = prompt[start:start + 4]
        logits, cache = run(params, jnp.asarray(np.pad(part, (0, 4 - part.size))[None], jnp.int32), cache, policy,
                            jnp.int32(part.size))
        nxt = int(jnp.argmax(logits[0, part.size - 1]))
    for _ in range(20):
        want.append(nxt)
        logits, cache = run(params, jnp.asarray([[nxt]], jnp.int32), cache, policy, jnp.int32(1))
        nxt = int(jnp.argmax(logits[0, 0]))
    assert got == want, f"seed {SEED}"


def test_greedy_sampling_is_argmax_and_temperature_still_samples():
    logits = jnp.asarray(np.random.default_rng(SEED).normal(size=(3, 500)).astype(np.float32))
    key = jax.random.PRNGKey(0)
    no_ring = jnp.zeros((3, 0), jnp.int32)
    greedy = sample(logits, key, Sampling().values(), no_ring)
    np.testing.assert_array_equal(np.asarray(greedy), np.argmax(np.asarray(logits), -1), err_msg=f"seed {SEED}")
    hot = Sampling(temperature=5.0).values()
    draws = {tuple(np.asarray(sample(logits, jax.random.PRNGKey(i), hot, no_ring))) for i in range(8)}
    assert len(draws) > 1  # temperature 5 over 500 tokens: not the argmax every time


def test_exp_latency_rotation_counts():
    jump = L.bookkeeping()
    W, N, d, cap = 8, 2, 3, 3
    pols = {"rsqr": P.rsqr(W, N, d, cap), "streamingllm": P.streamingllm(W, N),
            "rerotate": P.rerotate(W, N, d, cap, block=4), "rsqr_precompute": P.rsqr_precompute(W, N, d, cap),
            "leave_gaps": P.leave_gaps(W, N, d, cap), "replay": P.replay(W, N, d, cap, block=4)}
    spec = CacheSpec.for_policies(list(pols.values()), num_layers=1, num_kv_heads=1, head_dim=4)
    n = 24
    counts = {}
    for mode, pol in pols.items():
        cache = jump.advance(init_cache(spec), pol, 57)
        assert int(cache.t) == 57
        tr = {k: np.asarray(v) for k, v in jump.trace(cache, pol, n).items()}
        counts[mode] = (tr, L.rotation_counts(mode, tr))
    tr, rot = counts["streamingllm"]  # every cached key (sinks + full window) rotated at its rank, every step
    assert (rot["attention"] == N + W).all() and (rot["write"] == 0).all() and (rot["upkeep"] == 0).all()
    tr, rot = counts["rsqr"]  # sinks + capped survivors rotated inside attention, plus the new key
    assert (rot["attention"] == N + cap).all() and (rot["write"] == 1).all() and not rot["event"].any()
    tr, rot = counts["leave_gaps"]  # nothing but the new key (and its survivor copy when flagged)
    assert (rot["attention"] == 0).all() and set(rot["write"]) == {1, 2} and not rot["event"].any()
    tr, rot = counts["rerotate"]  # hops only when the window releases a block or a survivor is dropped
    assert rot["event"].any() and (~rot["event"]).any()
    assert (rot["event"] <= ((tr["release"] > 0) | (tr["dropped"] > 0))).all()
    assert rot["upkeep"].max() <= N + cap + W + 3
    tr, rot = counts["rsqr_precompute"]  # refresh only when ranks change: a drop or a new survivor
    assert (rot["attention"] == 0).all() and (rot["write"] == 1).all()
    drop = tr["dropped"] > 0  # steady state: each new survivor pushes the oldest out, every survivor's rank moves
    assert drop.sum() == n // d and (rot["event"] == drop).all() and (rot["upkeep"][drop] == cap).all()
    tr, rot = counts["replay"]  # every block release recomputes all cached tokens
    assert (tr["replay"] <= tr["release"]).all() and tr["replay"].sum() == n // 4
    assert (rot["upkeep"][tr["replay"] > 0] == rot["n_cached"][tr["replay"] > 0]).all()


def test_bad_input_is_one_line():
    """bench_decode.py and exp_latency.py, every case in one batch (tests/cli.py run_scripts)."""
    assert_one_line_errors([("bench_decode.py", ["--cached", "0"], "must be positive"),
                            ("bench_decode.py", ["--policy", "sinkcache", "--no-hf"], "unknown policy"),
                            ("exp_latency.py", ["--policies", "nope"], "unknown policy name"),
                            ("exp_latency.py", ["--positions", "5000", "1000"], "increasing")])


def test_event_bump_label_says_why_there_is_none():
    """rerotate block 1 rotates at every step (no quiet step to compare with); rsqr never has an upkeep event."""
    el = L
    assert el.bump_label({"event_bump": 1.3125, "event_steps": 3, "steps": 24}).strip() == "1.31x"
    assert "every step" in el.bump_label({"event_steps": 24, "steps": 24})
    assert "no upkeep events" in el.bump_label({"event_steps": 0, "steps": 24})


TEXT = "It was on a dreary night of November that I beheld the accomplishment of my toils. " * 40


@pytest.mark.slow
def test_latency_run_on_the_tiny_model(tmp_path):
    """Probe positions, rotation counts and the JSON layout of a whole (small) latency run."""
    apply_fn, params = _model()
    (tmp_path / "t.txt").write_text(TEXT)
    N, cap = 2, 4
    config = L.LatencyConfig(text=str(tmp_path / "t.txt"), positions=(40, 90), steps=8, replay_steps=8, full_max=40,
                             policies=("full", "rsqr", "replay_b8", "rsqr_recall"), policy=P.rsqr(16, N, 3, cap),
                             no_sweep=True, progress=False, recall_pages=2, cold=ColdStore(32, 4))
    res = L.run(config, apply_fn, params, CFG, ByteTokenizer(CFG.vocab_size))
    pols = res.data["policies"]
    assert list(pols) == ["full", "rsqr", "replay_b8", "rsqr_recall"]
    for r in pols["rsqr_recall"]["probes"]:  # + 2 recalled pages of 4 (>= 22 recallable tokens at 40)
        assert r["rotations_per_token"]["attention"] == N + cap + 8
    assert pols["rsqr_recall"]["cache_bytes"]["cold_store"] > 0 == pols["rsqr"]["cache_bytes"]["cold_store"]
    (full,) = pols["full"]["probes"]  # full_max = 40: the 90 probe is skipped
    assert full["position"] == 40 and full["n_cached_mean"] == 44.5  # 41..48 cached over the 8 steps
    assert full["rotations_per_token"]["total"] == 1 and full["win_capacity"] == 64
    rsqr = pols["rsqr"]["probes"]
    assert [r["position"] for r in rsqr] == [40, 90] and "flat_ratio" in pols["rsqr"]
    for r in rsqr:  # sinks + capped survivors rotated inside attention, plus the new key
        assert r["rotations_per_token"] == {"write": 1, "attention": N + cap, "upkeep": 0, "total": N + cap + 1}
        assert r["event_steps"] == 0 and len(r["raw_ms"]) == 8 and r["latency_ms"]["p50"] > 0
    assert all(r["replay_events"] == 1 for r in pols["replay_b8"]["probes"])  # 8 steps, block 8
    assert pols["rsqr"]["win_capacity"] == 16 and pols["rsqr"]["cache_bytes"]["total"] > 0
    assert len(res.data["memory"]) == 16 and res.data["sweep"] == []
    assert "| rsqr |" in res.markdown()
    res.write_json(tmp_path / "latency.json")
    assert json.loads((tmp_path / "latency.json").read_text())["args"]["positions"] == [40, 90]
    res.plot(tmp_path / "latency.png")
    assert (tmp_path / "latency.png").stat().st_size > 10_000


@pytest.mark.slow
def test_bench_decode_matches_hf_greedy_on_the_tiny_model(tmp_path):
    """Our greedy continuation equals HF's (holding our very weights); a bounded row holds `cached` tokens."""
    pytest.importorskip("torch")
    from types import SimpleNamespace

    model = Llama(CFG, tiny_weights(CFG, 0), dtype=jnp.float32)
    apply_fn, params = split_apply(model)
    hf = B.hf_model_from_ours(SimpleNamespace(config=CFG, model=model))
    (tmp_path / "t.txt").write_text(TEXT)
    tok = ByteTokenizer(CFG.vocab_size)
    config = B.BenchConfig(text=str(tmp_path / "t.txt"), cached=(16, 40), new=12, repeats=1, prefill_chunk=8,
                           threads=1)
    res = B.run(config, apply_fn, params, CFG, tok, hf_model=hf)
    for row, cached in zip(res.data["rows"], (16, 40)):
        assert row["greedy_agreement"] == 1.0 and row["first_divergence"] is None, row
        assert row["win_capacity"] == B.round_up(cached + 12 + 1) and row["ours_tok_s"] > 0 and row["hf_tok_s"] > 0
    assert "| 40 |" in res.markdown()
    # the chat sampler is timed next to greedy, and the sampler alone against the former full sort
    assert all(r["sampled_tok_s"] > 0 for r in res.data["rows"]) and "sampled tok/s" in res.markdown()
    assert set(res.data["sampler_ms"]) >= {"greedy_no_ring", "chat_chain", "full_sort_former"}
    bounded = B.run(dataclasses.replace(config, policy=P.rsqr(), cached=(32,)), apply_fn, params, CFG, tok)
    (row,) = bounded.data["rows"]
    assert row["cached_after_decode_ours"] == 32 and row["prompt_tokens_ours"] == 88 and "hf_tok_s" not in row


class _TorchAsLlamaCpp:
    """llama-cpp-python's decoding surface (reset / eval(ids) / sample(temp=0.0)) over an HF torch model, so the
    llama.cpp side of bench_decode runs without the package: a second engine whose greedy tokens must equal ours."""

    def __init__(self, hf):
        self.hf, self.ids = hf, []

    def reset(self):
        self.ids = []

    def eval(self, ids):
        self.ids += [int(i) for i in ids]

    def sample(self, temp):
        import torch

        assert temp == 0.0
        with torch.no_grad():
            return int(self.hf(torch.tensor([self.ids])).logits[0, -1].argmax())


def test_bench_decode_llama_cpp_side_on_the_tiny_model(tmp_path):
    """The llama.cpp columns: the other engine decodes the same token ids (its greedy tokens agree with ours),
    its prefill and decode are timed in the same rounds, and the table names both."""
    pytest.importorskip("torch")
    from types import SimpleNamespace

    model = Llama(CFG, tiny_weights(CFG, 0), dtype=jnp.float32)
    apply_fn, params = split_apply(model)
    other = _TorchAsLlamaCpp(B.hf_model_from_ours(SimpleNamespace(config=CFG, model=model)))
    (tmp_path / "t.txt").write_text(TEXT)
    config = B.BenchConfig(text=str(tmp_path / "t.txt"), cached=(24,), new=10, repeats=2, prefill_chunk=8,
                           threads=1, sampled=False)
    res = B.run(config, apply_fn, params, CFG, ByteTokenizer(CFG.vocab_size), llama_cpp=other)
    (row,) = res.data["rows"]
    assert row["greedy_agreement_llama_cpp"] == 1.0, row
    assert len(other.ids) == row["prompt_tokens_ours"] + 10  # the prompt, then one eval per decoded token
    assert len(row["llama_cpp_tok_s_all"]) == 2 and row["llama_cpp_tok_s"] == max(row["llama_cpp_tok_s_all"])
    assert row["vs_llama_cpp"] == pytest.approx(row["ours_tok_s"] / row["llama_cpp_tok_s"])
    assert "| llama.cpp tok/s | ours/llama.cpp |" in res.markdown()


def test_vs_llama_cpp_refuses_without_the_package_or_a_gguf(monkeypatch, tmp_path):
    """Checked before any model loads: one line naming what to install, or that llama.cpp reads only GGUF."""
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)  # import llama_cpp fails as if absent
    with pytest.raises(B.ConfigError, match=r"needs llama-cpp-python: pip install"):
        B.require_llama_cpp("m.gguf")
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", __import__("types").ModuleType("llama_cpp"))
    with pytest.raises(B.ConfigError, match="needs a GGUF model"):
        B.require_llama_cpp(str(tmp_path))
    assert B.require_llama_cpp("m.gguf").__name__ == "llama_cpp"


def test_peak_rss_is_the_childs_own():
    """A child that allocates 256 MiB reports at least that; a bare interpreter reports far less than this
    process holds (a parent's high-water mark must not leak into the child's figure)."""
    import sys

    held = np.ones(96 << 20)  # 768 MiB touched in this process
    big = B.peak_rss([sys.executable, "-c", "import numpy as np; a = np.ones(32 << 20); print(a.sum())"])
    small = B.peak_rss([sys.executable, "-c", "pass"])
    assert big["exit"] == 0 == small["exit"] and held[-1] == 1.0
    assert big["peak_rss_mib"] >= 256 and small["peak_rss_mib"] < 100, (big, small)
    assert B.peak_rss([sys.executable, "-c", "raise SystemExit(3)"])["exit"] == 3
