"""RULER offline through the lm-eval model (rsqr_jax/eval/ruler.py, scripts/eval_ruler.py).

The smoke (--quick: a tiny random Llama over the embedded model's real tokenizer, 2 samples per task at 1024
tokens, 4 tasks x 4 policies) runs through lm-eval's own RULER generators and scoring; a second run answers
everything from the cache (no model call); answers put in one policy's cache are scored by lm-eval's own
process_results on --report-only; bad input gives one-line errors."""

from __future__ import annotations

import json

import pytest

from rsqr_jax.eval.ruler import DEFAULT_TASKS, POLICIES
from rsqr_jax.eval.stats import wilson
from tests.cli import assert_one_line_errors, run_in_process

SEED = 0  # the smoke's seed (--seed default): RULER's generators and lm-eval's seeds
N = 2  # samples per task in the smoke


@pytest.fixture(scope="module")
def quick(tmp_path_factory, smollm2_path):
    pytest.importorskip("lm_eval")
    pytest.importorskip("wonderwords")
    root = tmp_path_factory.mktemp("ruler")
    out, png = root / "r.json", root / "r.png"
    args = ("--quick", "--cache-dir", str(root / "cache"), "--out", str(out), "--seed", str(SEED))
    print(f"seed {SEED}")
    first = run_in_process("eval_ruler.py", *args, "--plot", str(png))
    assert first.returncode == 0, first.stderr[-3000:]
    return root, args, first, json.loads(out.read_text()), png


@pytest.mark.slow
def test_quick_table_scores_every_cell(quick):
    root, _, proc, result, png = quick
    assert set(result["cells"]) == set(DEFAULT_TASKS)
    table = [ln for ln in proc.stdout.splitlines() if ln.startswith("| ")]
    assert len(table) == 1 + len(DEFAULT_TASKS)  # header + a row per task
    for p in POLICIES:
        assert f"`{result['config']['describe'][p]}`" in table[0]
        assert result["model_requests"][p] == N * len(DEFAULT_TASKS)  # every sample answered by the model
    for t in DEFAULT_TASKS:
        assert [ln for ln in table if ln.startswith(f"| {t} |")][0].count(f"n={N}") == len(POLICIES)
        targets = None
        for p in POLICIES:
            c = result["cells"][t][p]
            assert c["n"] == N and all(0.0 <= s <= 1.0 for s in c["scores"])
            assert c["score"] == pytest.approx(sum(c["scores"]) / N)
            assert c["ci"] == pytest.approx(list(wilson(sum(c["scores"]), N)))
            assert all(n <= 1024 for n in c["lengths"])  # RULER sized the prompts with our tokenizer
            assert targets is None or c["targets"] == targets  # every policy saw the same samples
            targets = c["targets"]
    assert png.stat().st_size > 1000
    # How far back each needle sits: inside the prompt, and the needle is where the distance says.
    assert set(result["needle_distance"]) == {t for t in DEFAULT_TASKS if t.startswith("niah")}
    for t, back in result["needle_distance"].items():
        assert len(back) == N and all(0 < d < n for d, n in zip(back, result["cells"][t]["full"]["lengths"])), back
    import nltk

    with pytest.raises(LookupError):  # the tasks ran without nltk's punkt_tab (none here, none downloaded)
        nltk.data.find("tokenizers/punkt_tab")


@pytest.mark.slow
def test_second_run_answers_from_the_cache(quick):
    root, args, first, result, _ = quick
    again = run_in_process("eval_ruler.py", *args)
    assert again.returncode == 0, again.stderr[-3000:]
    second = json.loads((root / "r.json").read_text())
    assert second["model_requests"] == {p: 0 for p in POLICIES}  # no model call
    assert second["cells"] == result["cells"]
    assert [ln for ln in again.stdout.splitlines() if ln.startswith("| ")] == \
        [ln for ln in first.stdout.splitlines() if ln.startswith("| ")]


@pytest.mark.slow
def test_report_scores_right_answers_one(quick):
    """The right answers written into the rsqr cache score 1 under lm-eval's own RULER scoring (and the
    other policies keep theirs): the report reads the cache, and the score is not a constant."""
    from sqlitedict import SqliteDict
    from lm_eval.api.model import hash_args

    from rsqr_jax.cli.eval_ruler import build_parser, spec_from
    from rsqr_jax.eval.ruler import load_tasks

    root, args, _, result, _ = quick
    spec = spec_from(build_parser().parse_args(list(args)))
    tasks = load_tasks(spec, str(root / "cache" / "tokenizer"))
    path = spec.cache_path(str(root / "cache"), "rsqr") + "_rank0.db"
    with SqliteDict(path, autocommit=True) as db:
        for task in tasks.values():
            task.build_all_requests(limit=N, rank=0, world_size=1)
            for inst in task.instances:
                key = hash_args("generate_until", inst.args)
                assert key in db
                db[key] = " " + ", ".join(inst.doc["outputs"]) + "."
    proc = run_in_process("eval_ruler.py", *args, "--report-only")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads((root / "r.json").read_text())
    for t in DEFAULT_TASKS:
        assert rep["cells"][t]["rsqr"]["scores"] == [1.0] * N
        assert rep["cells"][t]["rsqr"]["ci"] == pytest.approx(list(wilson(N, N)))
        for p in POLICIES:
            if p != "rsqr":
                assert rep["cells"][t][p] == result["cells"][t][p]
    assert rep["model_requests"] == {p: 0 for p in POLICIES}


def test_bad_input_one_line_errors():
    assert_one_line_errors([
        ("eval_ruler.py", ["--tasks", "niah_nope"], "unknown task 'niah_nope'"),
        ("eval_ruler.py", ["--tasks", "niah_single_2"], "needs a hub data set"),
        ("eval_ruler.py", ["--policies", "full,h2o"], "unknown policy 'h2o'"),
        ("eval_ruler.py", ["--limits", "10,5"], "limits must be increasing"),
        ("eval_ruler.py", ["--limits", "a"], "--limits must be comma-separated integers"),
        ("eval_ruler.py", ["--tasks", "ruler_vt", "--seq-len", "512"], "ruler_vt needs seq_len >= 1024"),
        ("eval_ruler.py", ["--window", "4096"], "window must be in"),
        ("eval_ruler.py", ["--answer", "ruler_cwe"], "the tasks to answer must be some of the tasks"),
        ("eval_ruler.py", ["--merge", "/nonexistent/r.json"], "--merge /nonexistent/r.json: not a readable RULER"),
    ])


@pytest.mark.slow
def test_answer_generates_every_task_but_runs_only_the_chosen(quick, monkeypatch):
    """--answer: every task is still generated (so each keeps its samples), only the chosen go to the model."""
    import lm_eval

    from rsqr_jax.cli.eval_ruler import build_parser, spec_from
    from rsqr_jax.eval import lm_eval_model, ruler

    root, args, _, result, _ = quick
    spec = spec_from(build_parser().parse_args([*args, "--answer", "ruler_fwe,ruler_vt"]))
    assert spec.answer == ("ruler_fwe", "ruler_vt")
    asked = []

    class NoModel:
        engine = type("E", (), {"generate": staticmethod(lambda batch: [])})()

    monkeypatch.setattr(lm_eval_model.RsqrLM, "from_model_args", classmethod(lambda cls, *a, **k: NoModel()))
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: asked.append([t.config.task for t in kw["tasks"]]))
    out = ruler.run_ruler(spec, (None,) * 4, str(root / "cache" / "tokenizer"), str(root / "cache"), log=lambda s: None)
    assert asked == [["ruler_vt", "ruler_fwe"]] * len(POLICIES)  # in --tasks order, once per policy
    for t in DEFAULT_TASKS:  # every task reported from the cache (all answered), on the same samples
        for p in POLICIES:
            assert out["cells"][t][p]["n"] == N and out["cells"][t][p]["targets"] == result["cells"][t][p]["targets"]


@pytest.mark.slow
def test_merge_keeps_the_longer_cell_and_refuses_other_samples(quick):
    import copy

    from rsqr_jax.eval.ruler import merge_reports
    from rsqr_jax.eval.runtime import ConfigError

    _, _, _, result, _ = quick
    earlier = copy.deepcopy(result)
    longer = earlier["cells"]["ruler_fwe"]["rsqr"]
    longer.update(n=N + 1, scores=longer["scores"] + [1.0], targets=longer["targets"] + [["w1", "w2", "w3"]])
    shorter = earlier["cells"]["ruler_vt"]["full"]
    shorter.update(n=1, scores=shorter["scores"][:1], targets=shorter["targets"][:1])
    merged = merge_reports(earlier, result)
    assert merged["cells"]["ruler_fwe"]["rsqr"] == longer and merged["merged_from_earlier"] == ["ruler_fwe/rsqr"]
    assert merged["cells"]["ruler_vt"]["full"] == result["cells"]["ruler_vt"]["full"]  # the cache's is longer
    other = copy.deepcopy(earlier)
    other["cells"]["ruler_fwe"]["rsqr"]["targets"][0] = ["not", "these", "words"]
    with pytest.raises(ConfigError, match="ruler_fwe / rsqr: the earlier report's samples are not these"):
        merge_reports(other, result)
    with pytest.raises(ConfigError, match=r"other settings \(seq_len\)"):
        merge_reports({**earlier, "config": {**earlier["config"], "seq_len": 4096}}, result)


@pytest.mark.slow
def test_start_answers_only_later_samples_and_follows_the_earlier_report(quick, tmp_path):
    """--start N --merge REPORT: the model answers samples N.. only (one request per cell and round here), and
    each merged cell is what a run from sample 0 over the same answers reports; an earlier report that lacks
    the first N samples, or holds other ones, is refused."""
    import copy
    import shutil

    from rsqr_jax.eval.ruler import merge_reports
    from rsqr_jax.eval.runtime import ConfigError

    root, args, _, _, _ = quick
    cache = tmp_path / "cache"
    shutil.copytree(root / "cache", cache)  # the fixture's answers to samples 0..N-1, not shared with other tests
    pols, answer = "rsqr,rsqr+recall", "niah_single_1"
    earlier = tmp_path / "earlier.json"  # the report of those answers (another test may have changed some)
    proc = run_in_process("eval_ruler.py", *args, "--cache-dir", str(cache), "--policies", pols, "--report-only",
                          "--out", str(earlier))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(earlier.read_text())
    common = [*args, "--cache-dir", str(cache), "--policies", pols, "--limits", str(N + 1)]
    out = tmp_path / "grown.json"
    proc = run_in_process("eval_ruler.py", *common, "--answer", answer, "--start", str(N), "--merge", str(earlier),
                          "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    grown = json.loads(out.read_text())
    assert grown["model_requests"] == {"rsqr": 1, "rsqr+recall": 1}  # sample N only, not 0..N-1 again
    again = run_in_process("eval_ruler.py", *common, "--report-only", "--out", str(tmp_path / "from0.json"))
    assert again.returncode == 0, again.stderr[-3000:]
    from0 = json.loads((tmp_path / "from0.json").read_text())
    for p in ("rsqr", "rsqr+recall"):
        cell = grown["cells"][answer][p]
        assert cell["n"] == N + 1 and "first" not in cell
        assert cell == from0["cells"][answer][p]
        assert cell["scores"][:N] == result["cells"][answer][p]["scores"]
        for t in DEFAULT_TASKS:
            if t != answer:  # not answered: the earlier report's cells
                assert grown["cells"][t][p] == result["cells"][t][p]
    assert_one_line_errors([("eval_ruler.py", [*common, "--start", "1"], "--start 1 needs --merge REPORT"),
                            ("eval_ruler.py", [*common, "--start", str(N + 1), "--merge", str(earlier)],
                             f"start must be in [0, the first limit {N + 1})")])
    # The cells as the run reported them before the merge: from sample N, with the samples before it.
    from rsqr_jax.cli.eval_ruler import build_parser, spec_from
    from rsqr_jax.eval import ruler

    spec = spec_from(build_parser().parse_args([*common, "--start", str(N)]))
    tasks = ruler.load_tasks(spec, str(cache / "tokenizer"))
    alone = ruler.report(spec, tasks, str(cache))
    assert alone["cells"][answer]["rsqr"]["first"] == N and alone["cells"][answer]["rsqr"]["n"] == 1
    short = copy.deepcopy(result)
    short["cells"][answer]["rsqr"].update(n=1, scores=[0.0], targets=short["cells"][answer]["rsqr"]["targets"][:1])
    with pytest.raises(ConfigError, match=f"{answer} / rsqr: the earlier report holds 1 samples; samples from {N} on"):
        merge_reports(short, alone)
    other = copy.deepcopy(result)
    other["cells"][answer]["rsqr"]["targets"][0] = ["not", "these"]
    with pytest.raises(ConfigError, match=f"{answer} / rsqr: the earlier report's samples are not these"):
        merge_reports(other, alone)


def test_per_layer_page_choice_reaches_the_model_arguments_and_reports_merge_after_a_json_round_trip():
    """--share-choice-from with one source per layer (decode.py's choice on the embedded model): the recall arm's
    model arguments carry it in the ';'-separated form lm-eval passes through, which reads back to the same
    sources; a report read back from JSON (lists) merges with one in memory (tuples)."""
    from rsqr_jax.presets import load_preset, parse_choice_sources

    DEFAULT_SHARE_FROM = parse_choice_sources(load_preset("SmolLM2-135M-Instruct").recall["share_from"])
    from rsqr_jax.cli.eval_ruler import build_parser, spec_from
    from rsqr_jax.eval.lm_eval_model import check_model_args
    from rsqr_jax.eval.ruler import merge_reports
    from rsqr_jax.eval.runtime import ConfigError
    from rsqr_jax.spec import ColdStore

    spec = spec_from(build_parser().parse_args(["--policies", "rsqr+recall", "--share-choice-from",
                                                "0-1:none,10-13:9,15-29:14", "--reselect", "4"]))
    assert spec.share_from == DEFAULT_SHARE_FROM
    a = spec.model_args("rsqr+recall")
    assert a["share_from"] == "0-1:none;10-13:9;15-29:14" and "page choice per layer 0-1:none" in spec.describe(
        "rsqr+recall")
    assert ColdStore(share_from=check_model_args(a)["share_from"]).choice_sources(30) == DEFAULT_SHARE_FROM
    assert spec_from(build_parser().parse_args(["--share-choice-from", "none"])).share_from is None
    import dataclasses

    report = {"config": dataclasses.asdict(spec), "cells": {}}
    assert merge_reports(json.loads(json.dumps(report)), report)["cells"] == {}
    other = {"config": {**report["config"], "share_from": 14}, "cells": {}}
    with pytest.raises(ConfigError, match=r"other settings \(share_from\)"):
        merge_reports(other, report)
