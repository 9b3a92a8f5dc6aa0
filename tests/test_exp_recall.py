"""rsqr_lab.studies.recall_probe: scoring helpers, facts files, the replay short-stream shortcut, the layout
diagnostics and the Decoder's greedy answers (tiny random model), a whole study in-process with its
interruption and resume, the CLI error contract, and the --quick run with SIGTERM/--resume on SmolLM2 (slow)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rsqr_jax import engine
from rsqr_jax import policy as P
from rsqr_jax.engine import Decoder
from rsqr_lab.studies import recall_probe as er
from rsqr_jax.eval.runtime import ConfigError
from rsqr_jax.eval.stats import wilson
from rsqr_jax.spec import CacheSpec
from rsqr_lab.testing.oracle import reference_token_sets
from rsqr_jax.models.tiny import tiny_config, tiny_model
from rsqr_lab.testing.tokenizer import WordTokenizer
from rsqr_jax.engine import step
from tests.cli import assert_one_line_errors, run_in_process

REPO = Path(__file__).resolve().parent.parent
CFG = tiny_config(layers=4)  # 2 layers barely propagate context into the question's logits
SEED = 0  # the tiny model's weights; every other RNG below is seeded where it is made


def test_wilson_interval_known_values():
    assert wilson(0, 0) == (0.0, 1.0)
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    lo, hi = wilson(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson(40, 40)
    assert hi == 1.0 and lo == pytest.approx(0.9124, abs=1e-4)
    for n in range(1, 101):  # the bounds contain the estimate exactly, also at k = 0 and k = n
        for k in range(n + 1):
            lo, hi = wilson(k, n)
            assert 0 <= lo <= k / n <= hi <= 1, (k, n)
        assert wilson(n, n)[1] == 1.0 and wilson(0, n)[0] == 0.0


def test_answer_scoring():
    assert er.answer_correct(" 1234567.\n", "1234567")
    assert er.answer_correct("\nIt is 1234567", "1234567")
    assert not er.answer_correct(" 123456", "1234567")
    assert not er.answer_correct(" 1,234,567", "1234567")
    assert er.leading_digits(" 1239999", "1234567") == 3
    assert er.leading_digits("x1234567", "1234567") == 0


def test_facts_file_formats(tmp_path):
    lines = tmp_path / "f.txt"
    lines.write_text("# comment\nAlice 1234567\n\nBob 7654321\n")
    assert er.read_facts(str(lines)) == [("Alice", "1234567"), ("Bob", "7654321")]
    js = tmp_path / "f.json"
    js.write_text(json.dumps([{"name": "Carol", "number": "0000001"}, {"name": "Dan", "number": "9999999"}]))
    assert er.read_facts(str(js)) == [("Carol", "0000001"), ("Dan", "9999999")]
    js.write_text(json.dumps({"Eve": "1111111"}))
    assert er.read_facts(str(js)) == [("Eve", "1111111")]
    bad = {"x.txt": ("Alice 12a4567\n", "not a digit string"), "y.txt": ("Alice 123 4\n", "expected 'NAME NUMBER'"),
           "z.txt": ("Alice 1234567\nBob 12\n", "same number of digits"),
           "d.txt": ("Alice 1234567\nAlice 7654321\n", "duplicate names"), "e.txt": ("\n# nothing\n", "has no facts"),
           "j.json": ("[{\"name\": \"A\"}]", "must be an object with name and number"),
           "k.json": ("{bad json", "invalid JSON")}
    for name, (text, fragment) in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            er.read_facts(str(tmp_path / name))
    with pytest.raises(ConfigError, match="cannot read facts file"):
        er.read_facts(str(tmp_path / "missing.txt"))


# ----------------------------------------------------------------------------------------------------
# The streaming pieces on a tiny random model.

W, B, N = 6, 2, 3
POLICIES = {
    "replay": P.make_policy("replay", window=W, n_sink=N, delta=0, block=B),
    "streamingllm": P.make_policy("streamingllm", window=W, n_sink=N, block=B),
    "rsqr": P.make_policy("rsqr", window=W, n_sink=N, delta=3, max_survivors=4, block=B),
    "leave_gaps": P.make_policy("leave_gaps", window=W, n_sink=N, delta=3, max_survivors=100, block=B),
}


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(CFG, SEED)


def _decoder(tiny, names, batch, gen_block=2):
    """A Decoder for the union spec of the named test policies (one compilation for all of them)."""
    spec = CacheSpec.for_policies([POLICIES[p] for p in names], num_layers=CFG.num_layers,
                                  num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim, batch=batch, max_chunk=2)
    return Decoder(tiny[0], spec, gen_block=gen_block)


def test_replay_short_stream_reaches_the_long_stream_state(tiny):
    """Replay's state depends only on the kept ids: the short stream gives the long stream's logits.
    The same shortcut must NOT hold for streamingllm (its window K/V carry the evicted history)."""
    params = tiny[1]
    dec = _decoder(tiny, ("replay", "streamingllm"), 2)
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, CFG.vocab_size, (2, 5)).astype(np.int32)
    filler = rng.integers(0, CFG.vocab_size, (2, 40)).astype(np.int32)
    q = rng.integers(0, CFG.vocab_size, (2, 2)).astype(np.int32)
    for n_filler in (8, 14, 30):
        k = er.replay_short_len(n_filler, W, B)
        assert k <= n_filler and (n_filler - k) % B == 0
        diffs = {}
        for mode in ("replay", "streamingllm"):
            pol = POLICIES[mode]
            out = []
            for ids in (filler[:, :n_filler], filler[:, n_filler - k:n_filler]):
                cache = er.feed_stream(dec, params, dec.init_cache(), pol, np.concatenate([prefix, ids], axis=1), B)
                out.append(np.asarray(dec.feed(params, q, cache, pol, 2)[0]))
            diffs[mode] = float(np.max(np.abs(out[0] - out[1])))
        assert diffs["replay"] < 1e-4, (n_filler, diffs)
        if k < n_filler:  # a real shortcut: streamingllm's long and short streams differ
            assert diffs["streamingllm"] > 1e-2, (n_filler, diffs)


def test_layout_matches_the_token_set_oracle(tiny):
    modes = ("rsqr", "streamingllm", "leave_gaps")
    dec = _decoder(tiny, modes, 1)
    T = 41
    digit_pos = [[1, 2, 4, 5, 6], [10, 11], [36, 37]]
    seen = set()
    ids = np.random.default_rng(1).integers(0, CFG.vocab_size, (1, T)).astype(np.int32)
    for mode in modes:
        pol = POLICIES[mode]
        cache = er.feed_stream(dec, tiny[1], dec.init_cache(), pol, ids, B)
        lay = er.layout_of(cache, pol, mode, N, digit_pos)
        h = pol.host()
        n, kept = reference_token_sets(T, window=W, n_sink=N, delta=h["delta"], max_survivors=h["max_survivors"],
                                       block=B, chunk=B)[-1]
        assert n == T and lay["t"] == T and lay["n_cached"] == len(kept)
        w0 = T - (T if T < W + B else W + (T - W) % B)
        for dp, got in zip(digit_pos, lay["facts"]):
            want = {"sink": sum(g < N for g in dp), "window": sum(g >= w0 for g in dp),
                    "survivor": sum(N <= g < w0 and g in kept for g in dp), "evicted": sum(g not in kept for g in dp)}
            assert got["digits"] == want, (mode, dp, got, want)
            seen |= {k for k, v in want.items() if v}
            first = [g for g in dp if g in kept]
            if first:
                want_d = T - first[0] if mode == "leave_gaps" else len(kept) - kept.index(first[0])
                assert got["distance"] == want_d
            else:
                assert got["distance"] is None
        assert lay["query_position"] == (T if mode == "leave_gaps" else len(kept))
    assert seen == {"sink", "survivor", "window", "evicted"}


@pytest.mark.slow
def test_ask_is_the_greedy_loop_of_steps_and_leaves_the_stream_cache_alone(tiny):
    """ask() (question chunk, then Decoder.generate) = the old runner's argmax loop over `step`, token for
    token; the stream's cache is copied, so asking twice gives the same answer."""
    apply_fn, params = tiny
    n_gen = 5
    dec = _decoder(tiny, ("rsqr", "streamingllm"), 2, gen_block=n_gen)
    rng = np.random.default_rng(2)
    ids = rng.integers(0, CFG.vocab_size, (2, 23)).astype(np.int32)
    q = rng.integers(0, CFG.vocab_size, (2, 1)).astype(np.int32)  # shorter than the chunk: padded
    jstep = jax.jit(lambda c, tok, n, pol: step(apply_fn, params, tok, c, pol, n))
    for mode in ("rsqr", "streamingllm"):
        pol = POLICIES[mode]
        cache = er.feed_stream(dec, params, dec.init_cache(), pol, ids, B)
        got = er.ask(dec, params, cache, pol, q, B, n_gen)
        assert got.shape == (2, n_gen)
        np.testing.assert_array_equal(er.ask(dec, params, cache, pol, q, B, n_gen), got)
        c = jax.tree.map(jnp.copy, cache)
        lg, c = jstep(c, jnp.asarray(np.pad(q, ((0, 0), (0, B - 1)))), jnp.int32(1), pol)
        want = [np.asarray(jnp.argmax(lg[:, 0], -1))]
        for _ in range(n_gen - 1):
            tok = jnp.asarray(want[-1][:, None], jnp.int32)
            lg, c = jstep(c, jnp.pad(tok, ((0, 0), (0, B - 1))), jnp.int32(1), pol)
            want.append(np.asarray(jnp.argmax(lg[:, 0], -1)))
        np.testing.assert_array_equal(got, np.stack(want, 1), err_msg=mode)


# ----------------------------------------------------------------------------------------------------
# A whole study in-process (tiny model, a word-level tokenizer).
@pytest.fixture(scope="module")
def study(tiny, tmp_path_factory):
    """(base config, models) for in-process runs: 3 trials in batches of 2 (a padded batch), every arm."""
    words = np.random.default_rng(3).choice(["the", "night", "was", "cold", "and", "I", "walked", "on", "far"], 3000)
    filler = tmp_path_factory.mktemp("recall") / "filler.txt"
    filler.write_text(" ".join(words) + ".\n")
    models = {"float32": er.RecallModel(tiny[0], tiny[1], CFG, WordTokenizer(CFG.vocab_size))}
    cfg = er.make_config(str(filler), quick=True, trials=3, batch=2, gen_tokens=4, seed=5)
    return cfg, models


@pytest.mark.slow
def test_in_process_quick_study_one_compilation(study, tmp_path):
    cfg, models = study
    before = dict(engine.TRACES)
    res = er.run(cfg, models, tmp_path, show_progress=False)
    traced = {k: v - before.get(k, 0) for k, v in engine.TRACES.items() if v != before.get(k, 0)}
    # --quick: one spec for every arm but rsqr_recall, whose cold store gets a spec (one compilation) of its own
    assert traced == {"feed": 2, "feed_and_sample": 2, "generate": 2}, traced
    d = res.data
    assert res.complete and d == json.loads((tmp_path / "recall.json").read_text())
    plan = cfg.plan()
    assert d["arms_done"] == [[v, dt, a] for v, dt, arms, _ in plan for a in arms]
    assert len(d["records"]) == sum(len(arms) * len(cyc) * cfg.trials for _, _, arms, cyc in plan)
    for s in d["summary"]:
        assert s["trials"] == cfg.trials and 0 <= s["wilson_lo"] <= s["acc"] <= s["wilson_hi"] <= 1
    n_digits = len(d["protocol"]["digit_positions"][0])
    assert n_digits == 7 and d["protocol"]["sinks"]["unprotected"] == 4
    lays = {(ly["variant"], ly["arm"], ly["n_cycles"]): ly for ly in d["layout"]}
    for c in cfg.cycles:
        assert lays[("pinned", "streamingllm", c)]["facts"][0]["digits"]["sink"] == n_digits
        assert lays[("pinned", "full", c)]["facts"][0]["digits"]["window"] == n_digits
    assert lays[("unprotected", "streamingllm", 2)]["facts"][0]["digits"]["evicted"] == n_digits
    for r in d["records"]:
        assert len(r["number"]) == 7 and r["correct"] == er.answer_correct(r["answer"], r["number"])
    again = er.run(cfg, models, tmp_path / "again", show_progress=False).data
    assert again["records"] == d["records"] and again["layout"] == d["layout"]
    res.write(tmp_path / "w")
    assert (tmp_path / "w" / "recall.png").stat().st_size > 0
    text = er.RecallResult.from_json(tmp_path / "w" / "recall.json").tables()
    assert "| streamingllm |" in text and "paired vs streamingllm" in text and "fact distance" in text


def test_interrupted_study_keeps_finished_arms_and_resumes(study, tmp_path):
    """SIGTERM after the first arm (in-process): the arm is kept, the run reports incomplete; a fresh run
    refuses the unfinished output, a changed setting refuses to resume, --resume finishes it and equals
    an uninterrupted run record for record."""
    cfg, models = study
    cfg = dataclasses.replace(cfg, variants=("pinned",), arms=("streamingllm", "rsqr", "rsqr_cap"))
    want = er.run(cfg, models, tmp_path / "fresh", show_progress=False).data

    def kill(*arm):
        os.kill(os.getpid(), signal.SIGTERM)

    out = tmp_path / "killed"
    handler = signal.getsignal(signal.SIGTERM)
    part = er.run(cfg, models, out, show_progress=False, after_arm=kill)
    assert not part.complete and signal.getsignal(signal.SIGTERM) is handler  # the handler is restored
    saved = json.loads((out / "recall.json").read_text())
    assert saved["complete"] is False and saved["arms_done"] == [["pinned", "float32", "streamingllm"]]
    assert {r["arm"] for r in saved["records"]} == {"streamingllm"}

    with pytest.raises(ConfigError, match="holds an unfinished run"):
        er.preflight(cfg, out)
    with pytest.raises(ConfigError, match="seed=5"):
        er.preflight(dataclasses.replace(cfg, seed=1), out, resume=True)
    previous = er.preflight(cfg, out, resume=True)
    got = er.run(cfg, models, out, previous=previous, show_progress=False).data
    assert got["complete"] is True and got["arms_done"] == want["arms_done"]
    assert got["records"] == want["records"] and got["summary"] == want["summary"]
    assert got["token_rows"] == want["token_rows"]


def test_resume_needs_a_resumable_run(study, tmp_path):
    cfg, _ = study
    with pytest.raises(ConfigError, match="--resume: cannot read"):
        er.preflight(cfg, tmp_path, resume=True)
    (tmp_path / "recall.json").write_text(json.dumps({"complete": False}))
    with pytest.raises(ConfigError, match="holds an unfinished run"):  # a fresh run must not overwrite it
        er.preflight(cfg, tmp_path)
    with pytest.raises(ConfigError, match="without resume data"):
        er.preflight(cfg, tmp_path, resume=True)


def test_a_run_resumes_from_another_working_directory(tmp_path, monkeypatch):
    """A result names a file of the repository by its repository path, whatever the working directory it was
    run from; resuming from another directory (the file named by another relative path), or from a result
    that holds the older absolute name, finds the same file; another file refuses."""
    from rsqr_jax import data

    repo = REPO
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(repo)
    cfg = er.make_config(os.path.relpath(data.GPL3, repo), quick=True, trials=3)
    fingerprint = cfg.fingerprint()
    assert fingerprint["filler"] == "rsqr_jax/data/licenses/GPL-3"
    monkeypatch.chdir(repo / "scripts")
    here = er.make_config(os.path.relpath(data.GPL3, repo / "scripts"), quick=True, trials=3)
    for name in (fingerprint["filler"], str(data.GPL3)):  # this form, and the absolute one of older results
        (out / "recall.json").write_text(json.dumps({"complete": False, "arms_done": [],
                                                     "fingerprint": {**fingerprint, "filler": name}}))
        assert er.preflight(here, out, resume=True)["fingerprint"]["filler"] == name
    other = er.make_config(os.path.relpath(data.FRANKENSTEIN, repo / "scripts"), quick=True, trials=3)
    with pytest.raises(ConfigError, match="was run with filler='.*GPL-3', this run has 'rsqr_jax/data/frankenstein.txt'"):
        er.preflight(other, out, resume=True)


@pytest.mark.parametrize("opts,fragment", [
    ({"cycles": "2,x"}, "--cycles must be a comma-separated list"),
    ({"cycles": "0"}, "--cycles needs positive integers"),
    ({"dtypes": "float16"}, "--dtypes: unknown float16"),
    ({"arms": "rsqr,sinkcache"}, "--arms: unknown sinkcache"),
    ({"trials": 0}, "--trials must be >= 1"),
    ({"policy": P.make_policy("rsqr", window=24, block=32)}, "--block 32 must not exceed --window 24"),
    ({"gen_tokens": 1}, "--gen-tokens must be >= 2"),
    ({"preamble": "x"}, "--preamble must be none or chat"),
    ({"filler": "/nonexistent.txt"}, "filler file not found"),
])
def test_bad_config(study, opts, fragment):
    cfg, _ = study
    lists = {"cycles": er.parse_int_list, "dtypes": lambda t, f: er.parse_choice_list(t, f, ("float32", "bfloat16")),
             "arms": lambda t, f: er.parse_choice_list(t, f, er.ARMS)}
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        kw = {k: lists[k](v, "--" + k) if k in lists else v for k, v in opts.items()}
        er.preflight(er.make_config(kw.pop("filler", cfg.filler), **kw), "/nonexistent-out")


def test_bad_filler_and_question_length(study, tmp_path):
    cfg, models = study
    tok = models["float32"].tokenizer
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ConfigError, match="is empty"):
        er.tokenize_filler(tok, str(empty), 10)
    with pytest.raises(ConfigError, match="a trial needs 100000"):
        er.tokenize_filler(tok, cfg.filler, 100000)
    with pytest.raises(ConfigError, match="--block must be >= 6"):
        er.run(dataclasses.replace(cfg, policy=cfg.policy.replace(block=4, window=8)), models, tmp_path,
               show_progress=False)


# ----------------------------------------------------------------------------------------------------
# The command line.

def _run(*args):
    """exp_recall.py in this process (tests/cli.py run_in_process: the model loaded and the arms compiled once
    for the fresh, the killed and the resumed run below)."""
    return run_in_process("exp_recall.py", *args)


def test_cli_bad_input_is_one_line(tmp_path):
    """One line on stderr, exit 2: a library ConfigError and a bad facts file (no model is loaded)."""
    f = tmp_path / "facts.txt"
    f.write_text("Alice 123\nBob 12345\n")
    assert_one_line_errors([("exp_recall.py", ["--cycles", "2,x"], "--cycles must be a comma-separated list"),
                            ("exp_recall.py", ["--facts", str(f)], "same number of digits"),
                            ("exp_recall.py", ["--cold-capacity", "24", "--page-size", "16"], "recall flags: "),
                            ("exp_recall.py", ["--recall-pages", "0"], "--recall-pages must be in"),
                            ("exp_recall.py", ["--delta", "-1"], "delta must be >= 0")])  # one batch


SMOKE_ARMS = ("full", "streamingllm", "rsqr", "rsqr_recall")


@pytest.mark.slow
def test_quick_run_sigterm_and_resume(tmp_path, smollm2_path, monkeypatch):
    """The --quick run on SmolLM2, killed by SIGTERM after its first arm: it keeps that arm (exit 3) and
    --resume finishes the others; the finished study's recall.json and plot are sane. (That a resumed study
    equals an uninterrupted one record for record: test_interrupted_study_keeps_finished_arms_and_resumes.)"""
    # The arms the claims below are about; every arm runs on the tiny model (test_in_process_quick_study_...).
    # The killed run is this process (tests/cli.py run_in_process: the model loaded and the arms compiled once
    # for both runs): a real SIGTERM to this process as soon as the first arm has finished.
    out = tmp_path / "run"
    args = ["--quick", "--arms", ",".join(SMOKE_ARMS), "--no-progress", "--out", str(out)]
    run_study = er.run

    def stopped_after_the_first_arm(*a, **kw):
        return run_study(*a, after_arm=lambda *arm: os.kill(os.getpid(), signal.SIGTERM), **kw)

    with monkeypatch.context() as m:
        m.setattr(er, "run", stopped_after_the_first_arm)
        proc = _run(*args)
    assert proc.returncode == 3, proc.stderr[-3000:]
    part = json.loads((out / "recall.json").read_text())
    assert part["complete"] is False and part["arms_done"] == [["pinned", "float32", "full"]], proc.stderr
    assert {r["arm"] for r in part["records"]} == {"full"}  # the half-run arm left nothing behind
    assert "--resume" in proc.stderr
    proc = _run(*args, "--resume")
    assert proc.returncode == 0 and "1 arm(s) done" in proc.stderr, proc.stderr[-3000:]
    data = json.loads((out / "recall.json").read_text())
    assert data["complete"] is True
    assert [r for r in data["records"] if r["arm"] == "full" and r["variant"] == "pinned"] == part["records"]
    png = out / "recall.png"
    assert png.is_file() and 0 < png.stat().st_size < 200_000
    proto, cfg = data["protocol"], data["config"]
    assert proto["window"] == 24 and proto["block"] == 8 and proto["delta"] == 8
    cells = {(s["variant"], s["dtype"], s["arm"], s["n_cycles"]): s for s in data["summary"]}
    for c in cfg["cycles"]:
        for arm in SMOKE_ARMS:
            assert ("pinned", "float32", arm, c) in cells
    for s in data["summary"]:
        assert s["trials"] == cfg["trials"] and s["correct"] == round(s["acc"] * s["trials"])
    # A 7-digit number is recalled from a short full cache (calibration: 90-100% at ~100 filler tokens).
    assert cells[("pinned", "float32", "full", 2)]["acc"] >= 0.5
    assert cells[("pinned", "float32", "streamingllm", 2)]["acc"] >= 0.5
    # Unprotected: the digits have left the window; no bounded arm can reproduce 7 random digits - except
    # the recall tier, which brings them back from the cold store (100% in the quick run when measured).
    for c in cfg["unprotected_cycles"]:
        for arm in cfg["unprotected_arms"]:
            acc = cells[("unprotected", "float32", arm, c)]["acc"]
            assert (acc >= 0.5) if arm == "rsqr_recall" else (acc == 0.0), (arm, acc)
    assert "rsqr_recall" in cfg["unprotected_arms"]
    assert len(data["records"]) == sum(s["trials"] for s in data["summary"] if "shared_with" not in s)
    assert "| streamingllm |" in proc.stdout
