"""The command-line contract: bad input -> one line on stderr and exit code 2; the real model answers."""

from __future__ import annotations

import dataclasses

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
    (["--top-k", "-1"], "--top-k must be an integer >= 0"),
    (["--min-p", "1.5"], "--min-p must be in [0, 1)"),
    (["--repeat-penalty", "0"], "--repeat-penalty must be > 0"),
    (["--repeat-last-n", "-2"], "--repeat-last-n must be an integer >= 0"),
    (["--presence-penalty", "inf"], "--presence-penalty must be a number and finite"),
    (["--raw", "--chat"], "--raw is plain completion"),
    (["--raw", "--system", "be terse"], "--raw is plain completion"),
    (["--stop", ""], "--stop needs a non-empty text"),
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
def test_prompt_answers_paris_through_the_chat_template(smollm2_path, tmp_path):
    """`decode.py --prompt` on the instruct model goes through its chat template by default: greedy, the
    answer names Paris; sampled with the chat defaults, 8 seeds in one --prompts-jsonl run (one process, one
    compilation), at least 5 name it within 64 tokens (measured: 12 of 16 seeds, 6 of these 8; the misses open in
    French, "L'Étoile de la Cité ...", which the model weighs almost as high as "The": 0.144 against 0.156)."""
    rows = tmp_path / "p.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "What is the capital of France?", "seed": s}) + "\n" for s in range(8)))
    # both runs in one process (tests/cli.py run_scripts: one interpreter and one model load)
    proc, sampled = run_scripts([
        ("decode.py", ["--policy", "full", "--prompt", "What is the capital of France?", "--max-new-tokens", "24",
                       "--temperature", "0", "--json"]),
        ("decode.py", ["--prompts-jsonl", str(rows), "--max-new-tokens", "64", "--recall-pages", "0", "--json"])])
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert "Paris" in result["text"] and result["chat"] is True
    for key in ("text", "n_prompt_tokens", "n_generated", "tokens_per_s", "prefill_s", "cache_bytes", "policy", "seed",
                "sampling", "stop"):
        assert key in result
    assert result["policy"] == "full" and result["n_generated"] <= 24 and result["sampling"]["temperature"] == 0
    assert sampled.returncode == 0, sampled.stderr
    texts = [json.loads(line)["text"] for line in sampled.stdout.splitlines()]
    assert len(texts) == 8 and len(set(texts)) > 1  # sampled: the seeds differ
    assert sum("Paris" in t for t in texts) >= 5, texts


@pytest.mark.slow
def test_full_perplexity_matches_hf_reference(smollm2_path):
    # The HF transformers reference (float32, full attention): first 512 tokens of Frankenstein -> 38.98.
    proc = run("eval_stream.py", "--policy", "full", "--tokens", "512", "--chunk", "256", "--json", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert abs(result["ppl"] / 38.98 - 1) < 0.005
    assert result["n_tokens"] == 512 and result["cache_bytes"]["total"] > 0


@pytest.mark.slow
def test_memory_demo_facts_leave_the_device_cache_and_plain_rsqr_loses_them(smollm2_path):
    """The demo's conversation as recorded (tests/data/memory_history.json), then the question: every earlier
    mention of the facts has left the device cache (window, sinks, survivors) when it is asked, and with recall
    all of them are in the cold store. Where the mentions are does not depend on the sampling seed (everything
    before the question is the recorded transcript), so the recall arm runs one seed and a short answer. Plain
    rsqr's answer is sampled under 4 seeds and names at most 1 of the 8 (fact, seed) pairs (measured over 20
    seeds: 0 of 40). What recall gets back is measured, not asserted: 5 of 40 against full attention's 2 of 40
    (docs/chat.md) -- a rate this small cannot be pinned by a CI-sized sample without pinning seeds."""
    from rsqr_jax.models.llama import load_model, split_apply
    from rsqr_lab.studies import memory as M

    loaded = load_model(smollm2_path)
    apply_fn, params = split_apply(loaded.model)
    cfg = M.MemoryConfig(arms=("rsqr",), seeds=4, max_new_tokens=64,
                         history=M.read_history(str(REPO / "tests" / "data" / "memory_history.json")))
    pieces = (apply_fn, params, loaded.config, loaded.tokenizer)
    rows = {"rsqr": M.run_arm("rsqr", cfg, *pieces),
            "rsqr_recall": M.run_arm("rsqr_recall", dataclasses.replace(cfg, seeds=1, max_new_tokens=4), *pieces)}
    for arm, runs in rows.items():
        for r in runs:
            assert len(r["memory"]["fact_positions"]) >= 2 and r["memory"]["in_device_cache"] == 0, (arm, r["memory"])
    assert rows["rsqr"][0]["memory"]["fact_positions"] == rows["rsqr_recall"][0]["memory"]["fact_positions"]
    assert all(r["memory"]["in_cold_store"] == len(r["memory"]["fact_positions"]) for r in rows["rsqr_recall"])
    named_plain = sum(sum(r["answer_names"].values()) for r in rows["rsqr"])
    assert named_plain <= 1, [r["replies"][-1] for r in rows["rsqr"]]


def test_given_flags_are_the_flags_on_the_command_line_and_the_defaults_survive():
    from rsqr_jax.cli.chat import given_flags
    from rsqr_jax.cli.decode import build_parser

    parser = build_parser()
    before = vars(parser.parse_args([]))
    argv = ["--prompt", "hi", "--stop", ".", "--stop", "!", "--window", "256", "--raw"]  # 256 is the default window
    assert given_flags(parser, argv) == {"prompt", "stop", "window", "raw"}
    assert given_flags(parser, []) == set()
    assert vars(parser.parse_args([])) == before  # the markers are gone again
    assert parser.parse_args(argv).stop == [".", "!"]


def test_policy_flags_take_the_library_defaults_and_a_subset_builds_the_same_policy():
    """The policy flags' defaults are rsqr_jax.policy.DEFAULTS (read without importing jax) and --help shows
    them; a command that takes a subset of the flags (or leaves one None) gets the library's value for the
    rest, and policy_from_args sets keywords over the flags."""
    import subprocess
    import sys

    from rsqr_jax import policy as P
    from rsqr_jax.cli.args import Parser, add_policy_args, policy_defaults, policy_from_args

    assert policy_defaults() == P.DEFAULTS
    code = ("import sys; from rsqr_jax.cli.args import Parser, add_policy_args; p = Parser(); add_policy_args(p); "
            "p.parse_args([]); p.format_help(); print('jax' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO / "scripts", capture_output=True, text=True, check=True)
    assert proc.stdout.split() == ["False"]
    full = Parser()
    add_policy_args(full)
    assert P.make_policy("rsqr").host() == policy_from_args(full.parse_args([])).host()
    help_text = " ".join(full.format_help().split())
    for flag, key in (("window", "window"), ("sinks", "n_sink"), ("max-survivors", "max_survivors")):
        assert f"--{flag} {flag.upper().replace('-', '_')} " in help_text and f"(default: {P.DEFAULTS[key]})" in help_text
    some = Parser()
    add_policy_args(some, flags=("sinks", "max_survivors"), recall=False, max_survivors=16)
    args = some.parse_args(["--sinks", "2"])
    assert not hasattr(args, "window") and not hasattr(args, "recall_pages") and args.max_survivors == 16
    pol = policy_from_args(args, window=32, mode="rerotate")
    assert pol.host() == P.rerotate(32, 2, P.DEFAULTS["delta"], 16).host()
    args.max_survivors = None  # a flag left None: the library's value
    assert policy_from_args(args).host() == P.rsqr(sinks=2).host()
    with pytest.raises(TypeError, match="no policy flag 'cap'"):
        add_policy_args(Parser(), cap=3)


def test_recall_choice_defaults_are_the_models_preset_and_none_turns_sharing_off(smollm2_config):
    """decode.py resolves its recall flags from the model's preset: on the embedded model 9 layers choose every 4th
    step from the int8 scoring copy (layers 10-13 attend layer 9's choice, 15-29 layer 14's, 0-1 recall nothing);
    on a model without a preset (the generic one) every layer chooses at every step from the float32 copy;
    `--share-choice-from none` and a resumed session that did not share keep every layer choosing; a session saved
    with one source per layer keeps them."""
    from rsqr_jax.cli.args import SHARE_NONE, UsageError, apply_preset, cold_store_flags
    from rsqr_jax.cli.chat import saved_settings
    from rsqr_jax.cli.decode import build_parser
    from rsqr_jax.spec import CacheSpec, ColdStore
    from rsqr_jax.models.tiny import tiny_config

    def cold(argv, config=smollm2_config):
        args = build_parser().parse_args(argv)
        apply_preset(args, config)
        return cold_store_flags(args)

    sources = cold(["--share-choice-from", "0-1:none,10-13:9,15-29:14"]).share_from
    assert cold([]) == ColdStore(reselect=4, share_from=sources, score_dtype="int8")
    assert cold([]).choice_sources(30) == (-1, -1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 9) + (14,) * 16
    assert cold([], tiny_config()) == ColdStore()
    assert cold(["--preset", "generic"]) == ColdStore()
    assert cold(["--share-choice-from", "none"]) == ColdStore(reselect=4, score_dtype="int8")
    assert cold(["--share-choice-from", "20", "--reselect", "1", "--score-dtype", "float32"]) == ColdStore(share_from=20)
    per_layer = cold(["--share-choice-from", "0-1:none,5:3,7-8:6"])  # the layers between choose their own
    assert per_layer.share_from == (-1, -1, 2, 3, 4, 3, 6, 6, 6)
    with pytest.raises(UsageError, match="unknown score dtype 'int4'"):
        cold(["--score-dtype", "int4"])
    with pytest.raises(UsageError, match="no preset 'nope'"):
        cold(["--preset", "nope"])
    # a session saved unshared, one shared from 14, and one with a source per layer
    for saved, want in ((None, SHARE_NONE), (14, 14), ((-1, 1, 1), (-1, 1, 1))):
        spec = CacheSpec.from_json(json.loads(json.dumps(  # through a session file's JSON
            CacheSpec(30, 1, 3, 64, 8, 4, cold=ColdStore(share_from=saved), max_recall_pages=4).to_json())))
        header = {"policy": {"mode": 7, "overflow": 0, **dict.fromkeys(
                      ("window", "n_sink", "delta", "max_survivors", "block", "recall_pages"), 0)},
                  "spec": spec.to_json(), "prefill_chunk": 8, "seed": 0, "identity": {}, "extra": {},
                  "sampling": {"temperature": 0.0}}
        args = build_parser().parse_args([])
        vars(args).update(saved_settings(header))
        apply_preset(args, smollm2_config)  # the preset does not override what the session fixed
        assert args.share_choice_from == want and cold_store_flags(args).share_from == saved
        assert cold_store_flags(args).score_dtype == "float32"  # as saved, not the new session's default
