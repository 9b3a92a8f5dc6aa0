"""The command-line contract: bad input -> one line on stderr and exit code 2; the real model answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli import assert_one_line_error, run_scripts
from tests.cli import run_script as run

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script", ["decode.py", "eval_stream.py"])
def test_unknown_policy(script):
    assert_one_line_error(run(script, "--policy", "sinkcache"), "unknown policy 'sinkcache'")


DECODE_FLAGS = [
    (["--max-new-tokens", "0"], "--max-new-tokens must be positive"),
    (["--max-new-tokens", "-3"], "--max-new-tokens must be positive"),
    (["--max-new-tokens", "many"], "invalid int value"),
    (["--window", "0"], "window must be >= 1"),
    (["--delta", "-1"], "delta must be >= 0"),
    (["--overflow", "lifo"], "unknown overflow rule"),
    (["--dtype", "float16"], "--dtype must be float32 or bfloat16"),
    (["--model", "/nonexistent/model.gguf"], "model not found"),
    (["--prompt", "hi", "--prompt-file", "x"], "not both"),
]


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """{(script, *args): finished process} of the error cases below, run in one batch (tests/cli.py
    run_scripts; test_unknown_policy above keeps a real process per script). d: their input files."""
    d = tmp_path_factory.mktemp("cli")
    (d / "empty.txt").write_text("  \n")
    (d / "mamba").mkdir()
    (d / "mamba" / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    cases = [("decode.py", a) for a, _ in DECODE_FLAGS] + [
        ("decode.py", ["--prompt-file", str(d / "empty.txt")]), ("decode.py", ["--prompt-file", str(d / "missing.txt")]),
        ("eval_stream.py", ["--text", str(d / "none.txt")]), ("eval_stream.py", ["--tokens", "1"]),
        ("decode.py", ["--model", str(d / "mamba"), "--prompt", "hi"])]
    return d, {(s, *a): proc for (s, a), proc in zip(cases, run_scripts(cases))}


@pytest.mark.parametrize("args,fragment", DECODE_FLAGS)
def test_decode_bad_flags(cli, args, fragment):
    assert_one_line_error(cli[1]["decode.py", *args], fragment)


def test_decode_empty_prompt_file(cli):
    d, procs = cli
    assert_one_line_error(procs["decode.py", "--prompt-file", str(d / "empty.txt")], "is empty")
    assert_one_line_error(procs["decode.py", "--prompt-file", str(d / "missing.txt")], "cannot read prompt file")


def test_eval_bad_input(cli):
    d, procs = cli
    assert_one_line_error(procs["eval_stream.py", "--text", str(d / "none.txt")], "text file not found")
    assert_one_line_error(procs["eval_stream.py", "--tokens", "1"], "--tokens must be >= 2")


def test_unsupported_architecture(cli):
    d, procs = cli
    assert_one_line_error(procs["decode.py", "--model", str(d / "mamba"), "--prompt", "hi"], "mamba")


def test_truncated_model_file(tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    assert_one_line_error(run("decode.py", "--model", str(cut), "--prompt", "hi"), "cut.gguf")


@pytest.mark.slow
def test_full_policy_answers_paris(smollm2_path):
    proc = run("decode.py", "--policy", "full", "--chat", "--prompt", "What is the capital of France?",
               "--max-new-tokens", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert "Paris" in result["text"]
    for key in ("text", "n_prompt_tokens", "n_generated", "tokens_per_s", "prefill_s", "cache_bytes", "policy"):
        assert key in result
    assert result["policy"] == "full" and result["n_generated"] <= 16


@pytest.mark.slow
def test_demo_remembers_the_name_the_window_forgot(smollm2_path):
    """`decode.py` with no flags (the README's demo): a chat ~2.7x longer than the cache budget, under rsqr with
    the recall tier on by default; its closing question ("what is my name ...?") is answered with the name
    given in the first turn. With the recall tier off (`--recall-pages 0`) the same greedy run loses it."""
    runs = {}
    for extra in ([], ["--recall-pages", "0"]):
        proc = run("decode.py", "--json", *extra)
        assert proc.returncode == 0, proc.stderr
        runs[bool(extra)] = json.loads(proc.stdout)
    recall, plain = runs[False], runs[True]
    assert (recall["policy"], plain["policy"]) == ("rsqr", "rsqr")
    assert recall["policy_name"].endswith("recall=4)") and "recall" not in plain["policy_name"]
    assert recall["cache_bytes"]["cold_store"] > 0 and not plain["cache_bytes"].get("cold_store")
    for r in (recall, plain):
        assert len(r["replies"]) >= 5 and r["session_tokens"] > 2 * (256 + 4 + 64)
    assert "Ada" in recall["replies"][-1] and "Ada" not in plain["replies"][-1]


@pytest.mark.slow
def test_full_perplexity_matches_hf_reference(smollm2_path):
    # The HF transformers reference (float32, full attention): first 512 tokens of Frankenstein -> 38.98.
    proc = run("eval_stream.py", "--policy", "full", "--tokens", "512", "--chunk", "256", "--json", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert abs(result["ppl"] / 38.98 - 1) < 0.005
    assert result["n_tokens"] == 512 and result["cache_bytes"]["total"] > 0
