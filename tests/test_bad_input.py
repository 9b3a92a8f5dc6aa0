"""Bad input, everywhere: one test per row of README.md "## Bad input" not already covered by
tests/test_cli.py (CLI), tests/test_loading.py (model files), tests/test_policies.py (policy/validate),
tests/test_positions.py (init_cache start) and tests/test_session.py (session files).

CLI: one line on stderr, exit code 2, no traceback, nothing on stdout, no file left behind.
Library: typed exceptions (PolicyError, ModelLoadError, SessionFileError, ValueError) with one-line messages.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

from rsqr_jax import policy as P
from rsqr_jax.spec import CacheSpec, validate
from rsqr_jax.policy import PolicyError
from rsqr_jax.sampling import Sampling
from rsqr_jax.session import Session, SessionFileError
from rsqr_jax.engine import stream_nll
from tests.cli import assert_one_line_error, run_scripts
from tests.cli import run_script as run
from tests.tiny_session import CFG, IDENTITY, POLICIES, SPEC, make_session, model


def assert_error_after_loading(proc, script: str, fragment: str) -> None:
    """For errors found after the model is loaded: status lines may precede the one error line."""
    assert_one_line_error(proc, fragment, after_status=True, prog=script)


# ---------------------------------------------------------------------------------------------------------
# Command line: decode.py and eval_stream.py (rows that fail before the model is loaded). Every case of this
# section runs in one batch (tests/cli.py run_scripts: one interpreter, each case as its script's __main__);
# tests/test_cli.py keeps real single-process runs of both scripts.

DECODE_FLAGS = [
    (["--sinks", "-1"], "n_sink must be >= 0"),
    (["--max-survivors", "0"], "max_survivors must be >= 1 when delta > 0"),
    (["--block", "0"], "block must be >= 1"),
    (["--block", "3000000000"], "block must be at most 1073741824"),
    (["--window", "abc"], "invalid int value: 'abc'"),
    (["--kernel", "cuda"], "--kernel must be xla, pallas, auto or reference"),
    (["--temperature", "-0.5"], "--temperature must be >= 0"),
    (["--temperature", "nan"], "--temperature must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--seed", "-1"], "--seed must be in [0, 2**32)"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be positive"),
    (["--prompt", "   "], "--prompt is empty"),
    (["--unknown-flag"], "unrecognized arguments: --unknown-flag"),
]
EVAL_FLAGS = [
    (["--chunk", "0"], "--chunk must be >= 1"),
    (["--chunk", "3", "--segment", "256"], "divide --segment"),
    (["--bucket", "0"], "--bucket must be >= 1"),
    (["--chunk", "64", "--window", "32", "--segment", "256"], "--chunk 64 is larger than --window 32"),
    (["--sinks", "-2"], "n_sink must be >= 0"),
]
RESUME_CONFLICTS = [
    (["--policy", "rsqr_precompute"], "--policy rsqr_precompute conflicts with the resumed session (policy = rsqr)"),
    (["--window", "64"], "--window 64 conflicts with the resumed session (window = 8)"),
    (["--overflow", "decimate"], "--overflow decimate conflicts"),
    (["--temperature", "0.5"], "--temperature 0.5 conflicts"),
    (["--seed", "3"], "--seed 3 conflicts"),
    (["--prefill-chunk", "16"], "--prefill-chunk 16 conflicts"),
    (["--dtype", "bfloat16"], "--dtype bfloat16 conflicts"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The input files of the cases below: bad text/prompt/model files, and session files of the tiny
    model (valid, truncated, not a session, a plain session); `save` is a directory holding only `file`."""
    d = tmp_path_factory.mktemp("bad_input")
    (d / "empty.txt").write_text(" \n\n")
    (d / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (d / "junk.gguf").write_bytes(b"not a model at all" * 8)
    (d / "save").mkdir()
    (d / "save" / "file").write_text("x")
    s = make_session("rsqr")
    s.feed(np.arange(10) % CFG.vocab_size)
    s.save(d / "tiny.session", IDENTITY, extra={"chat": True, "messages": [], "fed_text": ""})
    raw = (d / "tiny.session").read_bytes()
    (d / "cut.session").write_bytes(raw[: len(raw) // 3])
    (d / "text.session").write_text("hello")
    s = make_session("rsqr")
    s.feed([1, 2, 3])
    s.save(d / "plain.session", IDENTITY, extra={"chat": False})
    return d


def _cases(d) -> list[tuple[str, list[str]]]:
    save = d / "save"
    return ([("decode.py", a) for a, _ in DECODE_FLAGS] + [("eval_stream.py", a) for a, _ in EVAL_FLAGS]
            + [("decode.py", ["--resume", str(d / "tiny.session"), *a]) for a, _ in RESUME_CONFLICTS]
            + [("eval_stream.py", ["--text", str(d / "empty.txt")]), ("eval_stream.py", ["--text", str(d / "latin1.txt")]),
               ("eval_stream.py", ["--text", str(d)]), ("decode.py", ["--prompt-file", str(d / "latin1.txt")]),
               ("decode.py", ["--prompt-file", str(d)]),
               ("decode.py", ["--model", str(d), "--prompt", "hi"]), ("eval_stream.py", ["--model", str(d / "junk.gguf")]),
               ("decode.py", ["--resume", str(d / "none.session")]), ("decode.py", ["--resume", str(d / "cut.session")]),
               ("decode.py", ["--resume", str(d / "text.session")]),
               ("decode.py", ["--resume", str(d / "plain.session"), "--chat"])]
            + [("decode.py", ["--prompt", "hi", "--save", str(t)])
               for t in (save / "no_dir" / "s.session", save, save / "file" / "s.session")])


@pytest.fixture(scope="module")
def cli(files):
    """{(script, *args): finished process} of every case above, run in one batch."""
    cases = _cases(files)
    return {(s, *a): proc for (s, a), proc in zip(cases, run_scripts(cases))}


@pytest.mark.parametrize("args,fragment", DECODE_FLAGS)
def test_decode_bad_flags(cli, args, fragment):
    assert_one_line_error(cli["decode.py", *args], fragment)


@pytest.mark.parametrize("args,fragment", EVAL_FLAGS)
def test_eval_bad_flags(cli, args, fragment):
    assert_one_line_error(cli["eval_stream.py", *args], fragment)


def test_bad_text_and_prompt_files(cli, files):
    assert_one_line_error(cli["eval_stream.py", "--text", str(files / "empty.txt")], "is empty")
    assert_one_line_error(cli["eval_stream.py", "--text", str(files / "latin1.txt")], "is not UTF-8")
    assert_one_line_error(cli["eval_stream.py", "--text", str(files)], "text file not found")
    assert_one_line_error(cli["decode.py", "--prompt-file", str(files / "latin1.txt")], "is not UTF-8")
    assert_one_line_error(cli["decode.py", "--prompt-file", str(files)], "cannot read prompt file")


def test_bad_model_paths(cli, files):
    # Missing, truncated and unsupported-architecture models: tests/test_cli.py; the loader itself:
    # tests/test_loading.py. Here: a directory that is not a model, and a file that is not a model.
    assert_one_line_error(cli["decode.py", "--model", str(files), "--prompt", "hi"], "no config.json")
    assert_one_line_error(cli["eval_stream.py", "--model", str(files / "junk.gguf")], "is not a GGUF file")


def test_save_to_an_unusable_path_fails_before_any_work(cli, files):
    save = files / "save"
    for target, fragment in [(save / "no_dir" / "s.session", "does not exist"),
                             (save, "is a directory"),
                             (save / "file" / "s.session", "does not exist")]:
        assert_one_line_error(cli["decode.py", "--prompt", "hi", "--save", str(target)], fragment)
    assert sorted(os.listdir(save)) == ["file"]  # nothing half-written


def test_resume_bad_files(cli, files):
    assert_one_line_error(cli["decode.py", "--resume", str(files / "none.session")], "session file not found")
    assert_one_line_error(cli["decode.py", "--resume", str(files / "cut.session")], "truncated or corrupt")
    assert_one_line_error(cli["decode.py", "--resume", str(files / "text.session")], "is not a session file")


@pytest.mark.parametrize("args,fragment", RESUME_CONFLICTS)
def test_resume_conflicting_flags(cli, files, args, fragment):
    assert_one_line_error(cli["decode.py", "--resume", str(files / "tiny.session"), *args], fragment)


def test_resume_with_a_plain_session_rejects_chat(cli, files):
    assert_one_line_error(cli["decode.py", "--resume", str(files / "plain.session"), "--chat"],
                          "--chat conflicts with the resumed session")


# ---------------------------------------------------------------------------------------------------------
# Command line: rows that need the real model's config (read before its tokenizer and weights); one batch.


@pytest.mark.slow
def test_cache_too_large_and_a_session_of_another_model_are_refused_before_loading(tmp_path, smollm2_path):
    from rsqr_jax.models.llama import LoadedModel
    from rsqr_jax.models.loading import load_config

    real = LoadedModel(load_config(smollm2_path), None, str(smollm2_path), "float32").identity
    s = make_session("rsqr")
    s.feed([1, 2, 3])
    path = tmp_path / "tiny_as_real.session"
    s.save(path, {**real, "num_layers": CFG.num_layers}, extra={"chat": False})  # claims the real model's path
    too_large, other_model = run_scripts([("decode.py", ["--window", "200000000", "--prompt", "hi"]),
                                          ("decode.py", ["--resume", str(path), "--prompt", "hi"])])
    assert_one_line_error(too_large, "the cache needs")
    assert_one_line_error(other_model, "was saved for another model (num_layers: 2 != 30)")


@pytest.mark.slow
def test_text_shorter_than_tokens(tmp_path, smollm2_path):
    # Found once the text is tokenized (after the model is loaded: a status line may precede the error).
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here.")
    proc = run("eval_stream.py", "--text", str(short), "--tokens", "500")
    assert_error_after_loading(proc, "eval_stream.py", "has only")


# ---------------------------------------------------------------------------------------------------------
# Library: constructors and entry points.


@pytest.mark.parametrize("kw,fragment", [
    (dict(window=2.5), "window must be an integer"),
    (dict(delta=True), "delta must be an integer"),
    (dict(n_sink=-1), "n_sink must be >= 0"),
    (dict(block=0), "block must be >= 1"),
    (dict(max_survivors=0), "max_survivors must be >= 1"),
    (dict(window=2**30), "window must be < 1073741824"),
    (dict(max_survivors=2**31), "max_survivors must be at most"),
    (dict(block=-(2**40)), "block must be at most"),
])
def test_make_policy_rejects(kw, fragment):
    with pytest.raises(PolicyError) as e:
        P.make_policy("rsqr", **kw)
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("change,fragment", [
    (dict(num_layers=0), "num_layers must be an integer >= 1"),
    (dict(head_dim=15), "head_dim must be even"),
    (dict(win_capacity=-1), "win_capacity must be an integer >= 1"),
    (dict(surv_capacity=1.5), "surv_capacity must be an integer >= 0"),
    (dict(max_chunk=0), "max_chunk must be an integer >= 1"),
    (dict(dtype="int8"), "cache dtype must be a floating type"),
    (dict(dtype="float12"), "unknown cache dtype"),
])
def test_cache_spec_rejects(change, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        dataclasses.replace(SPEC, **change)


def test_cache_spec_for_policies_rejects_a_bad_dtype():
    with pytest.raises(ValueError, match="unknown cache dtype"):
        CacheSpec.for_policies(POLICIES["rsqr"], num_layers=1, num_kv_heads=1, head_dim=4, dtype="float99")


def test_validate_rejects_a_corrupted_policy_batch():
    bad = dataclasses.replace(P.stack_policies([POLICIES["rsqr"], POLICIES["rsqr"]]),
                              mode=jnp.asarray([P.RSQR, 42], jnp.int32))
    with pytest.raises(PolicyError, match="unknown policy mode id 42"):
        validate(bad, SPEC)


def test_session_constructor_rejects():
    apply_fn, params = model()
    pol = POLICIES["rsqr"]
    cases = [
        (dict(spec=dataclasses.replace(SPEC, batch=2)), "spec.batch must be 1"),
        (dict(prefill_chunk=0), "prefill_chunk must be a positive integer"),
        (dict(sampling=dict(top_p=0.0)), "top_p must be in (0, 1]"),
        (dict(sampling=dict(temperature=-1.0)), "temperature must be finite and >= 0"),
        (dict(sampling=dict(temperature=float("inf"))), "temperature must be finite and >= 0"),
        (dict(sampling=dict(min_p=1.0)), "min_p must be in [0, 1)"),
        (dict(sampling=dict(top_k=-1)), "top_k must be an integer >= 0"),
        (dict(sampling=dict(repeat_penalty=0.0)), "repeat_penalty must be > 0"),
        (dict(sampling=dict(frequency_penalty=float("nan"))), "frequency_penalty must be a finite number"),
        (dict(seed=2**32), "seed must be an integer in [0, 2**32)"),
        (dict(policy=P.rsqr(window=64)), "exceeds the window capacity"),  # PolicyError (a ValueError)
    ]
    for kw, fragment in cases:
        args = dict(spec=SPEC, policy=pol) | kw
        spec, policy = args.pop("spec"), args.pop("policy")
        with pytest.raises(ValueError) as e:
            if "sampling" in args:
                args["sampling"] = Sampling(**args["sampling"])
            Session(apply_fn, params, spec, policy, **args)
        assert fragment in str(e.value) and "\n" not in str(e.value), (kw, str(e.value))


def test_session_feed_and_generate_reject():
    s = make_session("rsqr")
    with pytest.raises(ValueError, match="feed a prompt before generating"):
        s.generate(3)
    for ids, fragment in [([], "empty token list"), ([1, CFG.vocab_size], f"token id {CFG.vocab_size} is out of range"),
                          ([-1], "token id -1 is out of range"), ([1.5, 2.0], "must be a flat list of integers"),
                          ([[1, 2]], "must be a flat list of integers")]:
        with pytest.raises(ValueError, match=fragment):
            s.feed(ids)
    assert s.n_tokens == 0  # nothing was fed by the refused calls


def test_session_full_policy_capacity_and_position_limit():
    apply_fn, params = model()
    full = P.full()
    spec = CacheSpec.for_policies(full, num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                                  head_dim=CFG.head_dim, max_chunk=4, max_len=8)
    s = Session(apply_fn, params, spec, full, prefill_chunk=4)
    with pytest.raises(ValueError, match="full attention cache holds 8 tokens; 9 requested"):
        s.feed(range(9))
    # A stream may not pass int32 positions (checked before anything runs).
    s = make_session("rsqr")
    from rsqr_jax.cache import init_cache

    s.cache = init_cache(SPEC, start=2**31 - 3)
    with pytest.raises(ValueError, match="would pass global position"):
        s.feed(range(5))


def test_session_files_are_typed_errors(tmp_path):
    # (Truncated, corrupted, other identity/spec/version: tests/test_session.py.)
    apply_fn, params = model()
    with pytest.raises(SessionFileError, match="session file not found"):
        Session.load(tmp_path / "nope", apply_fn, params, IDENTITY)
    assert issubclass(SessionFileError, ValueError)


def test_stream_nll_rejects():
    apply_fn, params = model()
    pol = POLICIES["rsqr"]
    tokens = np.zeros((1, 10), np.int32)
    spec2 = dataclasses.replace(SPEC, batch=2)
    with pytest.raises(ValueError, match="tokens have batch 1 but the cache spec has batch 2"):
        stream_nll(apply_fn, params, tokens, pol, spec2)
    with pytest.raises(ValueError, match="segment 10 must be a multiple of chunk 4"):
        stream_nll(apply_fn, params, tokens, pol, SPEC, chunk=4, segment=10)
    full_spec = CacheSpec.for_policies(P.full(), num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                                       head_dim=CFG.head_dim, max_len=8)
    with pytest.raises(ValueError, match="needs window capacity >= 10"):
        stream_nll(apply_fn, params, tokens, P.full(), full_spec)
    with pytest.raises(PolicyError, match="chunk 8 exceeds the cache's max_chunk 4"):
        stream_nll(apply_fn, params, tokens, pol, SPEC, chunk=8, segment=8)
