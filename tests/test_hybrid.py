"""Gemma 2 and Gemma 3 (text) with hybrid local/global layers (docs/design.md §3d, docs/models.md): parity with
transformers (full attention, and the models' own sliding windows), the per-layer-type cache (local layers keep a
ring of exactly their window, global layers the policy's cache), every policy against the float64 oracle, and
what a policy reaches from the command line and a saved session."""

from __future__ import annotations

import numpy as np
import pytest

from rsqr_jax import policy as P
from tests import family_fixtures as F
from tests import hf_fixtures
from tests.test_families import _text_ids

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

NAMES = ["gemma2", "gemma3", "gemma2_full", "gemma3_full"]


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory):
    """{name: (spec, dir)} of the tiny Gemma models, built and saved once per module."""
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("gemma")
    return {name: (F.FAMILY_SPECS[name], F.save_hf_model(F.FAMILY_SPECS[name], root / name)) for name in NAMES}


@pytest.fixture(scope="module")
def loaded(gemma_dirs):
    from rsqr_jax.models.llama import load_model

    return {name: load_model(str(d)) for name, (_, d) in gemma_dirs.items()}


def _check(ours, ref, what):
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    err = float(np.abs(ours - ref).max())
    assert err < 1e-4, f"{what}: max |dlogit| = {err:.3g} (logit scale {np.abs(ref).max():.3g})"
    assert (ours.argmax(-1) == ref.argmax(-1)).all(), f"{what}: greedy tokens differ"


@pytest.fixture(autouse=True, scope="module")
def _drop_steps():
    """The jitted steps live for this module only (conftest drops the compiled executables after each)."""
    yield
    F.STEPS.clear()


_stream = F.stream_logits


@pytest.mark.parametrize("name", ["gemma2_full", "gemma3_full"])
def test_full_attention_parity(gemma_dirs, name):
    """A window that spans the context: every layer attends to everything (Gemma 3's local layers keep their
    own RoPE base), logits to float32 tolerance over 200 tokens of text, greedy identical."""
    from rsqr_jax.models.llama import forward_logits

    spec, directory = gemma_dirs[name]
    print(f"{name}: seed {spec.seed}")
    ids = _text_ids(directory, spec)
    _check(forward_logits(str(directory), ids.astype(np.int32)), hf_fixtures.hf_logits(directory, ids), name)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_hybrid_parity(gemma_dirs, loaded, name):
    """The models' own sliding window (24) shorter than the 200-token text: one chunk, and streamed (a chunk
    longer than the window, shorter ones, then token by token through the ring) under `full`."""
    from rsqr_jax.models.llama import forward_logits

    spec, directory = gemma_dirs[name]
    print(f"{name}: seed {spec.seed}")
    ids = _text_ids(directory, spec)
    ref = hf_fixtures.hf_logits(directory, ids)[0]
    _check(forward_logits(loaded[name], ids.astype(np.int32))[0], ref, f"{name} one chunk")
    streamed, _, _ = _stream(loaded[name], P.full(), ids[0, :96], [40, 16, 16])
    _check(streamed, ref[:96], f"{name} streamed")


def test_per_layer_type_cache(loaded):
    """Local layers get a ring of their window and no policy buffers; global layers the policy's cache; the
    memory is reported per layer type."""
    from rsqr_jax.cache import init_cache
    from rsqr_jax.spec import CacheSpec

    cfg = loaded["gemma2"].config
    assert cfg.is_local == (True, False, True, False) and cfg.local_window == 24
    pol = P.rsqr(window=64, sinks=4, delta=4, max_survivors=32)
    spec = CacheSpec.for_policies(pol, dims=cfg, max_chunk=8)
    assert (spec.num_layers, spec.local_layers, spec.local_window) == (2, 2, 24)
    cache = init_cache(spec)
    H, D = cfg.num_kv_heads, cfg.head_dim
    assert cache.loc_k.shape == cache.loc_v.shape == (2, 1, H, 24, D) and cache.loc_pos.shape == (24,)
    assert cache.win_k.shape[0] == cache.surv_k.shape[0] == 2  # the policy's buffers for the global layers only
    parts = spec.bytes_by_part(pol)
    assert parts["local_window"] == 2 * 2 * H * 24 * D * 4 + 24 * 4  # two rings' K and V, and the slots' positions
    assert parts["window"] == spec.win_capacity * 2 * 2 * H * D * 4
    assert parts["total"] == sum(v for k, v in parts.items() if k not in ("total", "recalled_slots"))
    plain = CacheSpec.for_policies(pol, num_layers=4, num_kv_heads=H, head_dim=D, max_chunk=8)
    assert "local_window" not in plain.bytes_by_part(pol)  # other models' reports are unchanged


def test_cache_without_rings_is_refused(loaded):
    """A cache made from bare sizes (no local rings) is refused in one line, not run as full attention."""
    import jax
    import jax.numpy as jnp

    from rsqr_jax.cache import init_cache
    from rsqr_jax.hybrid import HybridCacheError
    from rsqr_jax.spec import CacheSpec
    from rsqr_jax.engine import step
    from rsqr_jax.models.llama import split_apply

    cfg = loaded["gemma2"].config
    spec = CacheSpec.for_policies(P.full(), num_layers=4, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                  max_len=8, max_chunk=8)
    apply_fn, params = split_apply(loaded["gemma2"].model)
    with pytest.raises(HybridCacheError) as e:  # at trace time: tracing the step is enough
        jax.eval_shape(lambda: step(apply_fn, params, jnp.zeros((1, 8), jnp.int32), init_cache(spec), P.full()))
    assert "\n" not in str(e.value) and "dims=" in str(e.value)
    with pytest.raises(ValueError, match="replay is not defined for hybrid"):
        CacheSpec.for_policies(P.replay(window=16, sinks=2, delta=3, max_survivors=6), dims=cfg, max_chunk=8)


POLICIES = {
    "rsqr": lambda: P.rsqr(window=16, sinks=2, delta=3, max_survivors=6),
    "leave_gaps": lambda: P.leave_gaps(window=16, sinks=2, delta=3, max_survivors=6),
    "streamingllm": lambda: P.streamingllm(window=16, sinks=2),
}


@pytest.mark.parametrize("name,policy", [("gemma2", "rsqr"), ("gemma3", "rsqr"), ("gemma2", "leave_gaps"),
                                         ("gemma3", "streamingllm")])
def test_hybrid_policy_against_oracle(gemma_dirs, loaded, name, policy):
    """Token by token past both windows: global layers hold the policy's token set (the design's reference
    sets), local layers exactly their last 24 positions, and the logits are the float64 oracle's (local
    layers at global positions over their window, global layers on the policy's timeline)."""
    from rsqr_jax.cache import cached_positions
    from rsqr_jax.hybrid import local_positions
    from rsqr_jax.models.capture import weights_of
    from rsqr_lab.testing.hybrid_oracle import gemma_stream_logits_f64
    from rsqr_lab.testing.oracle import reference_token_sets

    spec, directory = gemma_dirs[name]
    T = 72
    ids = _text_ids(directory, spec, T=T)[0]
    pol = POLICIES[policy]()
    h = pol.host()
    print(f"{name} {policy}: seed {spec.seed}")
    ours, cache, _ = _stream(loaded[name], pol, ids, [1])
    sets = [set(s) for _, s in reference_token_sets(T, window=h["window"], n_sink=h["n_sink"], delta=h["delta"],
                                                     max_survivors=h["max_survivors"], block=h["block"],
                                                     overflow="fifo")]
    assert list(cached_positions(cache, pol)) == sorted(sets[-1])
    assert local_positions(cache) == list(range(T - 24, T))
    cfg = loaded[name].config
    semantics = "global" if policy == "leave_gaps" else "rank"
    ref = gemma_stream_logits_f64(weights_of(loaded[name].model), cfg, ids.tolist(), sets, semantics)
    err = float(np.abs(ours - ref).max() / np.abs(ref).max())
    assert err < 1e-4, f"{name} {policy}: relative error {err:.3g} against the float64 oracle"
    # and the oracle tells the policy apart from full attention on these lengths (the test can fail)
    full = gemma_stream_logits_f64(weights_of(loaded[name].model), cfg, ids.tolist(),
                                   [set(range(t + 1)) for t in range(T)], "global")
    assert float(np.abs(full - ref).max() / np.abs(ref).max()) > 1e-3


@pytest.mark.slow
def test_decode_rsqr_on_gemma(gemma_dirs):
    """`decode.py --model DIR --policy rsqr` on a saved tiny Gemma 2 and Gemma 3 (one process): the greedy
    reply is transformers' (the prompt is longer than the local window, shorter than the policy's)."""
    import json

    from tests.cli import run_scripts
    from tests.test_families import _hf_greedy_reply

    prompt, n = "the cat sat on the mat and then it ran", 12
    names = ["gemma2", "gemma3"]
    args = ["--policy", "rsqr", "--prompt", prompt, "--max-new-tokens", str(n), "--temperature", "0",
            "--repeat-penalty", "1", "--json", "--no-progress"]
    procs = run_scripts([("decode.py", ["--model", str(gemma_dirs[name][1]), *args]) for name in names])
    for name, proc in zip(names, procs):
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = json.loads(proc.stdout)
        assert out["n_prompt_tokens"] > 24 and out["cache_bytes"]["local_window"] > 0, out
        assert out["text"] == _hf_greedy_reply(gemma_dirs[name][1], prompt, out["n_generated"]), (name, out)


def test_session_save_resume_on_hybrid(loaded, tmp_path):
    """A hybrid session saved mid-stream and resumed continues exactly as the uninterrupted one."""
    from rsqr_jax.models.llama import split_apply
    from rsqr_jax.session import Session

    model = loaded["gemma3"]
    apply_fn, params = split_apply(model.model)
    pol = P.rsqr(window=16, sinks=2, delta=3, max_survivors=6)
    kw = dict(dims=model.config, chunk=8, seed=5, vocab_size=model.config.vocab_size)
    ids = list(np.random.default_rng(7).integers(3, 100, size=40))
    a = Session.create(apply_fn, params, pol, **kw)
    a.feed(ids)
    first = a.generate(6)
    path = tmp_path / "hybrid.session"
    a.save(path, model.identity)
    rest = a.generate(10)
    b = Session.load(path, apply_fn, params, model.identity)
    assert b.generate(10) == rest and len(first) == 6
    np.testing.assert_array_equal(np.asarray(b.cache.loc_pos), np.asarray(a.cache.loc_pos))


def _nll(model, policy, ids_T, chunk):
    """Per-token NLL [T-1] of ids_T[1:], the first T-1 tokens streamed in chunks of `chunk` (as the sweep and
    eval_stream.py feed them: the chunks' boundaries decide when a policy evicts)."""
    x = np.asarray(_stream(model, policy, ids_T[:-1], [chunk] * len(ids_T))[0], np.float64)
    x = x - x.max(-1, keepdims=True)
    lse = np.log(np.exp(x).sum(-1))
    return lse - x[np.arange(len(x)), np.asarray(ids_T)[1:]]


def test_sweep_and_eval_stream_on_hybrid(gemma_dirs, loaded):
    """A vmapped policy sweep over a hybrid model gives each policy's own streamed NLL, and eval_stream.py
    reports the same NLL for rsqr."""
    import json

    from rsqr_jax.models.llama import split_apply
    from rsqr_jax.sweep import sweep_nll
    from tests.cli import run_in_process

    name = "gemma3"
    spec, directory = gemma_dirs[name]
    T, chunk = 64, 4
    ids = _text_ids(directory, spec, T=T)[0]
    pols = [POLICIES[p]() for p in ("rsqr", "leave_gaps", "streamingllm")]
    apply_fn, params = split_apply(loaded[name].model)
    swept = np.asarray(sweep_nll(apply_fn, params, ids[None].astype(np.int32), pols, config=loaded[name].config,
                                 chunk=chunk))
    own = [_nll(loaded[name], pol, ids, chunk) for pol in pols]
    for p, ref in enumerate(own):
        np.testing.assert_allclose(swept[p, 0], ref, rtol=2e-4, atol=2e-4)
    assert np.abs(own[0] - own[1]).max() > 1e-3  # the policies differ on this stream

    text = directory / "text.txt"
    from tests.test_families import WORDS

    text.write_text(" ".join(np.random.default_rng(spec.seed).choice(WORDS, size=T)) + ".")
    proc = run_in_process("eval_stream.py", "--model", str(directory), "--text", str(text), "--tokens", str(T),
                          "--chunk", str(chunk), "--policy", "rsqr", "--window", "16", "--sinks", "2", "--delta", "3",
                          "--max-survivors", "6", "--json", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["cache_bytes"]["local_window"] > 0
    np.testing.assert_allclose(out["nll"], float(own[0].mean()), rtol=1e-4)


def test_lm_eval_engine_on_hybrid(loaded):
    """The lm-eval model's engine on a hybrid model: its scores are -sum of the streamed NLL (rsqr, whose
    16-token window and the 24-token local window the 50-token requests overflow), and the lm-eval model
    builds its cache with the local rings."""
    from rsqr_jax.engine import stream_nll
    from rsqr_jax.eval.harness import SequentialEngine
    from rsqr_jax.models.llama import split_apply
    from rsqr_jax.spec import CacheSpec

    model = loaded["gemma2"]
    cfg = model.config
    apply_fn, params = split_apply(model.model)
    policy = POLICIES["rsqr"]()
    rng = np.random.default_rng(11)
    print("seed 11")
    reqs = [(rng.integers(3, 100, 40).tolist(), rng.integers(3, 100, 10).tolist())]
    sizes = dict(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    engine = SequentialEngine(apply_fn, params, policy, max_length=96, chunk=8, dims=cfg, **sizes)
    assert (engine.spec.num_layers, engine.spec.local_layers) == (2, 2)
    spec = CacheSpec.for_policies(policy, dims=cfg, max_chunk=8, max_len=96)
    for (ctx, cont), (lp, _) in zip(reqs, engine.score(reqs)):
        nll, _ = stream_nll(apply_fn, params, np.asarray([ctx + cont]), policy, spec, chunk=8, segment=8)
        np.testing.assert_allclose(lp, -nll[0, -len(cont):].sum(), rtol=1e-5)
    pytest.importorskip("lm_eval")
    from rsqr_jax.eval.lm_eval_model import RsqrLM

    lm = RsqrLM.from_model_args("policy=rsqr,window=16,sinks=2,delta=3,max_survivors=6,recall_pages=0,max_length=96,max_gen_toks=8",
                                pieces=(apply_fn, params, cfg, model.tokenizer))
    assert lm.engine.spec.local_layers == 2 and lm.engine.spec.local_window == 24


def test_rsqr_without_survivors_is_streamingllm_on_hybrid(gemma_dirs, loaded):
    """docs/design.md §4, consequence 1, layer by layer on a hybrid model: rsqr with delta = 0 equals
    streamingllm (same token set on the global layers, the same rings on the local ones)."""
    spec, directory = gemma_dirs["gemma2"]
    ids = _text_ids(directory, spec, T=64)[0]
    a, ca, _ = _stream(loaded["gemma2"], P.rsqr(window=16, sinks=2, delta=0, max_survivors=1), ids, [4] * 16)
    b, cb, _ = _stream(loaded["gemma2"], P.streamingllm(window=16, sinks=2), ids, [4] * 16)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(ca.loc_pos), np.asarray(cb.loc_pos))
