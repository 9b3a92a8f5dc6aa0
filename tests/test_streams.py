"""rsqr_jax.eval.perplexity on the tiny model: a vmapped policy batch equals separate stream_nll runs,
pieces carry the cache exactly, an interruption keeps the finished pieces, run_stream's summary, and the
torch reference's chunked NLL (seeds: tests/tiny_stream.SEED; token ids below from default_rng(1))."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from rsqr_jax import engine
from rsqr_jax import policy as P
from rsqr_jax.engine import stream_nll
from rsqr_jax.eval import perplexity as streams
from rsqr_jax.eval.runtime import ConfigError
from rsqr_jax.eval.perplexity import Interrupted, StreamConfig, cache_spec, check_text, run_stream, stream_policies
from tests.tiny_stream import CFG, load, write_text

IDS_T = np.random.default_rng(1).integers(0, CFG.vocab_size, size=80).astype(np.int32)
POLICIES = {"rsqr": P.rsqr(16, 2, 4, 8), "streamingllm": P.streamingllm(16, 2)}
KW = dict(segment=16, show_progress=False)


@pytest.fixture(scope="module")
def batch_run():
    before = engine.TRACES["score"]
    nll, tm = stream_policies(load(), IDS_T, POLICIES, piece_segments=2, label="batch", **KW)
    return nll, tm, engine.TRACES["score"] - before


def test_batch_equals_separate_runs(batch_run):
    nll, tm, traces = batch_run
    model = load()
    for key, policy in POLICIES.items():
        spec = cache_spec(model, policy, chunk=1, max_len=len(IDS_T))
        ref, _ = stream_nll(model.apply_fn, model.params, IDS_T[None], policy, spec, segment=16)  # one piece
        assert nll[key].dtype == np.float64 and nll[key].shape == (79,)
        np.testing.assert_allclose(nll[key], ref[0], rtol=1e-5, atol=1e-5, err_msg=key)
    assert not np.allclose(nll["rsqr"], nll["streamingllm"])  # survivors change the token set: not vacuous
    assert traces <= 1  # three pieces, one compilation (the cache spec and the Decoder stay the same)
    assert tm["policies"] == list(POLICIES) and tm["tokens"] == 80 and tm["dtype"] == "float32"
    assert tm["first_segment_s"] > 0 and tm["steady_s_per_token"] > 0  # 5 segments


def test_interruption_keeps_finished_pieces(batch_run, monkeypatch):
    nll, _, _ = batch_run
    calls = []

    def interrupted_third_piece(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return stream_nll(*args, **kw)

    monkeypatch.setattr(streams, "stream_nll", interrupted_third_piece)
    with pytest.raises(Interrupted) as e:
        stream_policies(load(), IDS_T, POLICIES, piece_segments=1, label="cut", **KW)
    assert isinstance(e.value, KeyboardInterrupt)  # a caller that keeps nothing stops as on Ctrl-C
    assert e.value.timing["label"] == "cut" and e.value.timing["tokens"] == 33
    for key in POLICIES:
        np.testing.assert_allclose(e.value.partial[key], nll[key][:32], rtol=1e-5, atol=1e-5, err_msg=key)


def test_interruption_before_any_piece(monkeypatch):
    def at_once(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(streams, "stream_nll", at_once)
    with pytest.raises(Interrupted) as e:
        stream_policies(load(), IDS_T, {"full": P.full()}, chunk=16, label="none", **KW)
    assert e.value.partial["full"].size == 0 and e.value.timing["tokens"] == 1


def test_run_stream_summary(tmp_path, batch_run):
    text = write_text(tmp_path / "t.txt")
    config = StreamConfig(text, POLICIES["rsqr"], "rsqr", tokens=80, chunk=1, segment=16, bucket=30)
    seen = []
    result = run_stream(config, load(), check_memory=seen.append, show_progress=False)
    s = result.summary
    assert seen == [s["cache_bytes"]["total"]] and seen[0] > 0
    assert s["n_tokens"] == 80 and s["n_scored"] == 79 == result.nll.size and s["policy"] == "rsqr"
    assert s["policy_name"] == POLICIES["rsqr"].name and s["model"] == load().path
    assert math.isclose(s["ppl"], math.exp(result.nll.mean())) and math.isclose(s["nll"], result.nll.mean())
    assert [(c["start"], c["end"]) for c in s["curve"]] == [(0, 30), (30, 60), (60, 79)]
    ids = np.asarray(load().tokenizer.encode(open(text).read())[:80])
    ref, _ = stream_policies(load(), ids, {"rsqr": POLICIES["rsqr"]}, **KW)
    np.testing.assert_allclose(result.nll, ref["rsqr"], rtol=1e-6)
    assert "ppl" in result.text() and result.text().count("\n") == 4
    result.write(str(tmp_path / "out"))
    assert np.array_equal(np.load(tmp_path / "out" / "nll.npy"), result.nll.astype(np.float32))
    assert (tmp_path / "out" / "eval_stream.json").is_file() and (tmp_path / "out" / "eval_stream.md").is_file()

    def refuse(n_bytes):
        raise ConfigError(f"the cache needs {n_bytes} bytes")

    with pytest.raises(ConfigError, match="the cache needs"):
        run_stream(config, load(), check_memory=refuse, show_progress=False)


@pytest.mark.parametrize("kw,fragment", [
    (dict(tokens=1), "--tokens must be >= 2"),
    (dict(chunk=0), "--chunk must be >= 1"),
    (dict(chunk=3), "divide --segment"),
    (dict(bucket=0), "--bucket must be >= 1"),
    (dict(chunk=32, segment=64), "--chunk 32 is larger than --window 16"),
])
def test_stream_config_refuses(kw, fragment):
    with pytest.raises(ConfigError, match=fragment):
        StreamConfig("t.txt", POLICIES["rsqr"], "rsqr", **{"segment": 16, **kw})
    StreamConfig("t.txt", P.full(), "full", chunk=32, segment=64)  # full has no window to exceed


def test_check_text(tmp_path):
    latin1, empty = tmp_path / "latin1.txt", tmp_path / "empty.txt"
    latin1.write_bytes("caf\xe9".encode("latin-1"))
    empty.write_text(" \n")
    for path, fragment in [(latin1, "is not UTF-8 (byte 3)"), (empty, "is empty"), (tmp_path, "text file not found")]:
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            check_text(str(path))


def test_hf_stream_nll_chunks_equal_one_forward():
    torch = pytest.importorskip("torch")
    from rsqr_lab.testing.hf_reference import hf_stream_nll
    from tests import hf_fixtures

    spec = hf_fixtures.TINY_SPECS["llama"]
    model = hf_fixtures.build_hf_model(spec)
    ids = np.random.default_rng(2).integers(0, spec.vocab_size, size=40)
    logp = torch.log_softmax(torch.as_tensor(hf_fixtures.hf_logits(model, ids[None])), -1)[0].numpy()
    ref = -logp[np.arange(39), ids[1:]]
    done = []
    nll = hf_stream_nll(model, ids, chunk=7, progress=done.append)
    assert done == [7, 14, 21, 28, 35, 39]
    np.testing.assert_allclose(nll, ref, rtol=1e-4, atol=1e-4)
