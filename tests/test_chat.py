"""rsqr_jax.cli.chat (the loop behind scripts/decode.py) on the tiny model, and decode.py's dtype flags.

In-process tests use the tiny random model of tests/tiny_session.py (seed 0) and a character tokenizer;
the subprocess tests check the one-line errors of the new flags (before any model is loaded) and, on the
real model (slow), that --cache-dtype reaches the CacheSpec while the weights stay float32.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from rsqr_jax import conversation
from rsqr_jax.cli import chat
from rsqr_jax.eval.runtime import ConfigError
from rsqr_jax.session import Session
from tests.cli import assert_one_line_error, run_scripts
from tests.cli import run_script as run
from tests.tiny_session import CFG, CHUNK, IDENTITY, POLICIES, SPEC, make_session, model


class CharTokenizer:
    """Just enough of a transformers tokenizer for ChatFeed and chat.run: ids are characters mod vocab."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % CFG.vocab_size for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


TOK = CharTokenizer()


def test_chat_feed_feeds_only_the_new_text():
    feed = conversation.ChatFeed(TOK)
    first = feed.user_turn("hi")
    assert first == TOK.encode("<user>hi</><assistant>")
    feed.assistant_reply("yo")
    assert feed.fed_text == "<user>hi</><assistant>yo"
    assert feed.user_turn("x") == TOK.encode("</><user>x</><assistant>")  # closes the reply, adds the turn
    assert [m["role"] for m in feed.messages] == ["user", "assistant", "user"]


def test_run_counts_tokens_and_streams_every_reply(capsys):
    session = make_session("rsqr")
    config = chat.ChatConfig(("hello", "again"), chat=True, max_new_tokens=5)
    result = chat.run(config, session, TOK)
    assert result.n_generated == 10 and len(result.replies) == 2  # the tiny model has no EOS ids here
    # the second turn feeds only what closes the first reply and opens the new turn
    assert result.n_prompt_tokens == len("<user>hello</><assistant>") + len("</><user>again</><assistant>")
    assert result.session_tokens == session.n_tokens > result.n_prompt_tokens
    out = capsys.readouterr().out
    assert ">>> hello" in out and ">>> again" in out and all(r in out for r in result.replies)
    js = result.to_json(policy="rsqr")
    assert js["text"] == "\n\n".join(result.replies) and js["policy"] == "rsqr" and js["n_generated"] == 10


def test_plain_prompt_and_stdin_lines(capsys):
    result = chat.run(chat.ChatConfig(("abc",), chat=False, max_new_tokens=3), make_session("rsqr"), TOK)
    assert result.n_prompt_tokens == 3 and result.to_json()["text"] == result.replies[0]
    lines = chat.run(chat.ChatConfig(None, chat=False, max_new_tokens=2), make_session("rsqr"), TOK,
                     lines=["one\n", "  \n", "two\n"])
    assert len(lines.replies) == 2  # blank lines are skipped
    assert ">>>" not in capsys.readouterr().out


def test_save_after_every_turn_and_resume_continue_the_same_conversation(tmp_path, capsys):
    turns = ("my name is ada", "what is my name")
    whole = chat.run(chat.ChatConfig(turns, chat=True, max_new_tokens=4), make_session("rsqr"), TOK)

    path = str(tmp_path / "s.session")
    first = chat.run(chat.ChatConfig(turns[:1], chat=True, max_new_tokens=4, save=path), make_session("rsqr"), TOK,
                     identity=IDENTITY)
    apply_fn, params = model()
    resumed = Session.load(path, apply_fn, params, IDENTITY)
    assert [m["role"] for m in resumed.extra["messages"]] == ["user", "assistant"]
    second = chat.run(chat.ChatConfig(turns[1:], chat=True, max_new_tokens=4), resumed, TOK)
    assert first.replies + second.replies == whole.replies  # bit-identical continuation
    assert second.session_tokens == whole.session_tokens


def test_a_full_cache_is_a_one_line_config_error():
    from rsqr_jax import policy as P
    from rsqr_jax.spec import CacheSpec

    apply_fn, params = model()
    spec = CacheSpec.for_policies(P.full(), num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                                  head_dim=CFG.head_dim, max_chunk=4, max_len=8)
    session = Session(apply_fn, params, spec, P.full(), prefill_chunk=4)
    with pytest.raises(ConfigError, match="full attention cache holds"):
        chat.run(chat.ChatConfig(("a long prompt",), chat=False, max_new_tokens=2), session, TOK)


def test_plan_turns():
    assert chat.plan_turns(None, False, resumed=False) == chat.DEMO.turns
    assert chat.plan_turns("hi", False, resumed=False) == ("hi",)
    assert chat.plan_turns(None, True, resumed=False) is None  # the interactive loop
    assert chat.plan_turns(None, False, resumed=True) is None


def test_weights_dtype_auto_is_float32_on_cpu_and_the_cache_dtype_elsewhere():
    from rsqr_jax.api import resolve_weights_dtype

    assert resolve_weights_dtype("auto", "bfloat16", "cpu") == "float32"
    assert resolve_weights_dtype("auto", "bfloat16", "gpu") == "bfloat16"
    assert resolve_weights_dtype("auto", "float32", "gpu") == "float32"
    assert resolve_weights_dtype("bfloat16", "float32", "cpu") == "bfloat16"


@pytest.fixture(scope="module")
def header(tmp_path_factory):
    s = make_session("rsqr")
    s.feed(np.arange(10) % CFG.vocab_size)
    path = tmp_path_factory.mktemp("chat") / "tiny.session"
    s.save(path, IDENTITY, extra={"chat": True, "messages": [], "fed_text": ""})
    return Session.read_header(path)


def test_apply_resume_takes_the_saved_settings(header):
    settings = chat.apply_resume({"window": 256, "weights_dtype": "auto", "model": None}, header, given=set())
    assert settings["window"] == 8 and settings["policy"] == "rsqr" and settings["chat"] is True
    assert settings["weights_dtype"] == "float32" and settings["cache_dtype"] == settings["dtype"] == "float32"
    same = chat.apply_resume({"window": 8, "weights_dtype": "auto", "chat": True}, header,
                             given={"window", "weights_dtype", "chat"})  # repeating the saved values is fine
    assert same["window"] == 8


@pytest.mark.parametrize("dest,value,fragment", [
    ("window", 64, "--window 64 conflicts with the resumed session (window = 8)"),
    ("weights_dtype", "bfloat16", "--weights-dtype bfloat16 conflicts with the resumed session (weights_dtype = float32)"),
    ("cache_dtype", "bfloat16", "--cache-dtype bfloat16 conflicts"),
    ("dtype", "bfloat16", "--dtype bfloat16 conflicts"),
    ("model", "/elsewhere/model.gguf", "--model /elsewhere/model.gguf conflicts"),
])
def test_apply_resume_refuses_conflicting_flags(header, dest, value, fragment):
    with pytest.raises(ConfigError) as e:
        chat.apply_resume({dest: value}, header, given={dest})
    assert fragment in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------------------
# decode.py: the dtype flags and --out (errors found before the model is loaded).


DTYPE_FLAGS = [
    (["--weights-dtype", "float16"], "--weights-dtype must be float32, bfloat16 or auto, got 'float16'"),
    (["--cache-dtype", "int8"], "--cache-dtype must be float32 or bfloat16, got 'int8'"),
    (["--dtype", "bfloat16", "--cache-dtype", "float32"], "--dtype bfloat16 and --cache-dtype float32 disagree"),
]


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """(input dir, {(*args): finished process}) of every decode.py case below, run in one batch
    (tests/cli.py run_scripts)."""
    d = tmp_path_factory.mktemp("chat_cli")
    (d / "file").write_text("x")
    s = make_session("rsqr")
    s.feed([1, 2, 3])
    s.save(d / "t.session", IDENTITY, extra={"chat": False})
    args = [a for a, _ in DTYPE_FLAGS] + [["--out", str(d / "file")], ["--help"]] + [
        ["--resume", str(d / "t.session"), flag, "bfloat16"] for flag in ("--weights-dtype", "--cache-dtype")]
    return d, {tuple(a): proc for a, proc in zip(args, run_scripts([("decode.py", a) for a in args]))}


@pytest.mark.parametrize("args,fragment", DTYPE_FLAGS)
def test_decode_bad_dtype_flags(cli, args, fragment):
    assert_one_line_error(cli[1][tuple(args)], fragment)


def test_decode_out_must_be_a_directory(cli):
    d, procs = cli
    assert_one_line_error(procs["--out", str(d / "file")], "--out")


def test_decode_resume_refuses_other_dtypes(cli):
    d, procs = cli
    assert_one_line_error(procs["--resume", str(d / "t.session"), "--weights-dtype", "bfloat16"],
                          "--weights-dtype bfloat16 conflicts")
    assert_one_line_error(procs["--resume", str(d / "t.session"), "--cache-dtype", "bfloat16"],
                          "--cache-dtype bfloat16 conflicts")


def test_decode_help_names_the_dtype_defaults(cli):
    proc = cli[1][("--help",)]
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert "--weights-dtype" in text and "float32 on CPU" in text and "--cache-dtype" in text


@pytest.mark.slow
def test_cache_dtype_reaches_the_cache_spec_while_weights_stay_float32(smollm2_path, smollm2_config, tmp_path):
    from rsqr_jax.policy import make_policy
    from rsqr_jax.presets import parse_choice_sources
    from rsqr_jax.spec import CacheSpec, ColdStore

    proc = run("decode.py", "--prompt", "Hi", "--max-new-tokens", "2", "--cache-dtype", "bfloat16", "--json",
               "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result == json.loads((tmp_path / "decode.json").read_text())
    assert (result["weights_dtype"], result["cache_dtype"], result["dtype"]) == ("float32", "bfloat16", "bfloat16")
    c = smollm2_config
    # decode.py's defaults: rsqr with the recall tier on (4 pages of the default 4096-token cold store, int8 scoring copy)
    pol = make_policy("rsqr", window=256, n_sink=4, delta=8, max_survivors=64, block=1, overflow="fifo",
                      recall_pages=4)
    spec = CacheSpec.for_policies(pol, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                  dtype="bfloat16", max_chunk=64, max_recall_pages=4,
                                  cold=ColdStore(4096, 16, reselect=4, share_from=parse_choice_sources(
                                      "0-1:none,10-13:9,15-29:14"), score_dtype="int8"))
    assert result["cache_bytes"] == spec.bytes_by_part(pol) and result["cache_bytes"]["cold_store"] > 0
    assert result["policy_name"].endswith("recall=4)")
    assert "float32 weights, bfloat16 cache" in proc.stderr
    assert "preset SmolLM2-135M-Instruct" in proc.stderr
    kernels = next(line for line in proc.stderr.splitlines() if line.startswith("CPU kernels"))
    assert "first use" not in kernels, kernels  # after the first decode step every kernel it uses has said so


# ---------------------------------------------------------------------------------------------------------
# Many prompts at once (decode.py --prompts-jsonl on rsqr_jax.streams): each stream equals its prompt alone.

JSONL_PROMPTS = [  # prompt lengths 1 (a 1-token prefill), 5 (chunk 4 + a 1-token remainder), a multiple of 4, ...
    {"prompt": "q", "max_new_tokens": 6}, {"prompt": "hello", "max_new_tokens": 17},
    {"prompt": "a longer prompt!", "max_new_tokens": 3}, {"prompt": "hi", "chat": True, "max_new_tokens": 9},
    {"prompt": "again, a chat turn", "chat": True, "max_new_tokens": 1},
]


def _jsonl(tmp_path, rows, name="p.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) if isinstance(r, dict) else r for r in rows) + "\n")
    return str(path)


def test_prompts_jsonl_equal_each_prompt_alone_under_one_compilation(tmp_path):
    """5 prompts on 2 slots (streams join and leave, idle slots sit through other prompts' prefill): every
    greedy output equals chat.run + Session for that prompt alone (decode.py --prompt's loop), token for
    token, with one end-of-sequence stop; the whole run, a second one and a sampled one (equal to seeded
    Sessions) trace each function once."""
    from rsqr_jax import engine
    from rsqr_jax.streams import StreamScheduler

    lines = chat.read_prompts_jsonl(_jsonl(tmp_path, JSONL_PROMPTS), max_new_tokens=4, chat=False)
    alone = []
    for pl in lines:
        s = make_session("rsqr")
        s.feed(chat.prompt_ids(TOK, pl.prompt, pl.chat))
        alone.append(s.generate(pl.max_new_tokens))
    eos = alone[1][4]  # the second prompt stops on its 5th token (EOS is emitted, never fed)
    stops = ["eos" if eos in a else "length" for a in alone]
    alone = [a[:a.index(eos) + 1] if eos in a else a for a in alone]
    texts = [chat.run(chat.ChatConfig((pl.prompt,), pl.chat, pl.max_new_tokens),
                      make_session("rsqr", eos_ids=[eos]), TOK).replies[0] for pl in lines]

    apply_fn, params = model()
    before = dict(engine.TRACES)
    sched = StreamScheduler(apply_fn, params, SPEC, POLICIES["rsqr"], n_slots=2, prefill_chunk=CHUNK, eos_ids=[eos],
                            vocab_size=CFG.vocab_size)
    seen = []
    result = chat.run_prompts(lines, sched, TOK, emit=seen.append)
    assert [r["token_ids"] for r in result.rows] == alone
    assert [r["text"] for r in result.rows] == texts
    assert [r["stop"] for r in result.rows] == stops and "length" in stops
    assert sorted(r["line"] for r in seen) == [1, 2, 3, 4, 5] and result.n_generated == sum(map(len, alone))
    # a second session on the same scheduler (slots reused): no new compilation
    again = chat.run_prompts(lines[::-1], sched, TOK)
    assert [r["token_ids"] for r in again.rows] == alone
    assert {k: engine.TRACES[k] - before.get(k, 0) for k in ("feed_streams", "generate_streams")} == \
        {"feed_streams": 1, "generate_streams": 1}
    # sampled (temperature 0.9, top-p 0.8, seed 7): each stream equals a Session seeded alike (its own rng key,
    # split only when the stream moves); the sampler settings are arguments, so still no new compilation
    sampled = []
    for pl in lines:
        s = make_session("rsqr", temperature=0.9, top_p=0.8, seed=7)
        s.feed(chat.prompt_ids(TOK, pl.prompt, pl.chat))
        sampled.append(s.generate(pl.max_new_tokens))
    hot = StreamScheduler(apply_fn, params, SPEC, POLICIES["rsqr"], n_slots=2, prefill_chunk=CHUNK, temperature=0.9,
                          top_p=0.8, vocab_size=CFG.vocab_size)
    assert [r["token_ids"] for r in chat.run_prompts(lines, hot, TOK, seed=7).rows] == sampled != alone
    assert {k: engine.TRACES[k] - before.get(k, 0) for k in ("feed_streams", "generate_streams")} == \
        {"feed_streams": 1, "generate_streams": 1}
    # a stream fed nothing (n_valid 0) keeps its cache bit for bit
    cache = jax.tree.map(np.asarray, sched.cache)
    n = sched.n_slots
    _, after, _ = sched.decoder.feed_streams(params, np.ones((n, CHUNK), np.int32), sched.cache, None,
                                             np.zeros(n, np.int32), np.zeros(n, bool), sched.rng_N.copy())
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, after), cache)


@pytest.mark.parametrize("rows,fragment", [
    ([{"prompt": "ok"}, '{"prompt": "x",}'], "p.jsonl line 2: not valid JSON"),
    (["", '["a list"]'], "p.jsonl line 2: expected a JSON object, got list"),
    ([{"prompt": "ok"}, {"prompt": "x", "max_tokens": 3}], "line 2: unknown key 'max_tokens'"),
    ([{"prompt": "  "}], "line 1: \"prompt\" must be a non-empty string"),
    ([{"prompt": "a", "max_new_tokens": 0}], "line 1: \"max_new_tokens\" must be a positive integer, got 0"),
    ([{"prompt": "a", "chat": "yes"}], "line 1: \"chat\" must be true or false"),
    (["", "  "], "has no prompts"),
])
def test_prompts_jsonl_malformed_lines_are_named(tmp_path, rows, fragment):
    with pytest.raises(ConfigError) as e:
        chat.read_prompts_jsonl(_jsonl(tmp_path, rows), max_new_tokens=4, chat=False)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_prompt_longer_than_a_full_cache_is_refused_and_the_others_kept():
    """The check is on the host before anything runs: the refused request is an error row, the others
    are queued (run_prompts then runs them; the real-model CLI test runs such a file end to end)."""
    from rsqr_jax import policy as P
    from rsqr_jax.spec import CacheSpec
    from rsqr_jax.streams import Request, StreamScheduler

    apply_fn, params = model()
    spec = CacheSpec.for_policies(P.full(), num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                                  head_dim=CFG.head_dim, max_chunk=4, max_len=16)
    sched = StreamScheduler(apply_fn, params, spec, P.full(), n_slots=2, prefill_chunk=4)
    assert sched.submit(Request((1, 2, 3), 13)) == 0  # 16 positions: fits exactly
    with pytest.raises(ValueError, match="prompt of 4 tokens \\+ 13 new ones exceeds the full attention cache of 16"):
        sched.submit(Request((1, 2, 3, 4), 13))
    assert len(sched.queue) == 1 and sched.submit(Request((5,), 2)) == 1


def test_decode_prompts_jsonl_bad_file_fails_before_the_model_loads(tmp_path):
    assert_one_line_error(run("decode.py", "--prompts-jsonl", _jsonl(tmp_path, [{"prompt": "a"}, "{oops"])),
                          "line 2: not valid JSON")
    assert_one_line_error(run("decode.py", "--prompts-jsonl", _jsonl(tmp_path, [{"prompt": "a"}]), "--prompt", "b"),
                          "--prompt cannot be combined with it")


# ---------------------------------------------------------------------------------------------------------
# Streaming a reply: incremental detokenization, stop strings, stop reasons, the interactive loop, the demo's
# memory check.


def _byte_bpe():
    """A byte-level BPE tokenizer trained here (seeded by its corpus): multi-byte characters split across
    tokens, so partial decodes end in U+FFFD as with real GPT-2-style vocabularies."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["the bees of the rooftop hum in the sun"] * 20, vocab_size=300, min_frequency=2,
                            show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)


def test_text_stream_equals_the_whole_decode_and_never_shows_half_a_character():
    tok = _byte_bpe()
    text = "the bees 🐝 of Lisboa — naïve, ünïcödé, 東京 and the sun"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids)))  # the case the stream must hold back
    stream = conversation.TextStream(tok)
    pieces = [stream.push(t) for t in ids] + [stream.flush()]
    assert "".join(pieces) == tok.decode(ids) == stream.text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(bool(p) for p in pieces) > len(ids) // 2  # it streams, it does not wait for the end


class ScriptedSession:
    """The Session surface generate_reply uses, emitting a fixed token script (the last one repeats)."""

    def __init__(self, script, eos=()):
        self.script, self.eos_ids, self.pending, self.calls = list(script), frozenset(eos), 0, 0

    def generate(self, n):
        assert n == 1
        self.calls += 1
        token = self.script[min(self.calls - 1, len(self.script) - 1)]
        if token in self.eos_ids:
            self.pending = None
        return [token]


class IdTokenizer:
    """ids index a small alphabet (reversible, unlike CharTokenizer, and inside the tiny vocabulary)."""

    ALPHABET = " abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:?!\n-<>/"

    def encode(self, text, add_special_tokens=True):
        return [self.ALPHABET.index(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.ALPHABET[i % len(self.ALPHABET)] for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return CharTokenizer.apply_chat_template(self, messages, tokenize, add_generation_prompt)


def test_generate_reply_stops_on_eos_on_a_stop_string_and_at_the_length():
    tok = IdTokenizer()
    shown = []
    eos = len(tok.ALPHABET)
    text, n, reason = conversation.generate_reply(ScriptedSession(tok.encode("Paris.") + [eos], eos=[eos]), tok, 50,
                                          emit=shown.append)
    assert (text, n, reason) == ("Paris.", 7, "eos") and "".join(shown) == "Paris."
    shown = []
    text, n, reason = conversation.generate_reply(ScriptedSession(tok.encode("one\nUser: two")), tok, 50, stop=("User:",),
                                          emit=shown.append)
    assert (text, reason) == ("one\n", "stop") and "".join(shown) == "one\n" and n == len("one\nUser:")
    assert "U" not in "".join(shown)  # a possible start of the stop string is held back, never printed
    text, n, reason = conversation.generate_reply(ScriptedSession(tok.encode("abc")), tok, 5)
    assert (text, n, reason) == ("abccc", 5, "length")


def test_interactive_loop_resets_and_exits(capsys):
    session = make_session("rsqr")
    lines = ["hello\n", "/reset\n", "again\n", "/exit\n", "never\n"]
    messages = []
    result = chat.run(chat.ChatConfig(None, chat=True, max_new_tokens=3), session, TOK, lines=lines,
                      status=messages.append)
    assert len(result.replies) == 2 and "conversation reset: the cache is empty" in messages
    # after the reset only the second turn is in the cache: its template opens a fresh conversation
    assert session.n_tokens == len(TOK.encode("<user>again</><assistant>")) + 3  # every emitted token is fed
    out = capsys.readouterr().out
    assert ">>> hello" in out and ">>> again" in out and "never" not in out


def test_demo_memory_check_finds_the_fact_tokens_and_where_they_are():
    """The fact's token positions are found in the first turn; before the question, rsqr's device cache
    (window 8, 2 sinks, every 3rd token up to 3 survivors) no longer holds them, `full` holds them all."""
    from rsqr_jax import policy as P
    from rsqr_jax.spec import CacheSpec

    demo = chat.MemoryDemo("", ("xx Ada yy", "a b c d e f g h i j k l m n o p q r s t u", "who?"),
                           (chat.Fact("name", "Ada", ("ada",)),))
    tok = IdTokenizer()
    apply_fn, params = model()
    checks = {}
    for name in ("rsqr", "full"):
        pol = POLICIES["rsqr"] if name == "rsqr" else P.full()
        spec = SPEC if name == "rsqr" else CacheSpec.for_policies(pol, num_layers=CFG.num_layers,
                                                                  num_kv_heads=CFG.num_kv_heads,
                                                                  head_dim=CFG.head_dim, max_chunk=CHUNK, max_len=128)
        session = Session(apply_fn, params, spec, pol, prefill_chunk=CHUNK)
        result = chat.run(chat.ChatConfig(demo.turns, chat=False, max_new_tokens=2, demo=demo), session, tok,
                          status=lambda m: None)
        checks[name] = result.memory
    assert checks["rsqr"]["fact_positions"] == [3, 4, 5] == checks["full"]["fact_positions"]
    assert checks["rsqr"]["in_device_cache"] == 0 and checks["full"]["in_device_cache"] == 3
    assert set(checks["full"]["answer_names"]) == {"name"}
    assert chat.DEMO.score("Your name is ADA and you keep bees in Bristol.") == {"name": True, "place": True}


def test_prompts_jsonl_rows_carry_their_own_sampling_and_seed(tmp_path):
    """A line's own "temperature"/"top_k"/"seed" override the run's values for that line only: each row equals a
    lone Session with those settings; a bad value names its line."""
    from rsqr_jax.sampling import Sampling
    from rsqr_jax.streams import StreamScheduler

    rows = [{"prompt": "hello", "max_new_tokens": 6},
            {"prompt": "hello", "max_new_tokens": 6, "temperature": 8.0, "top_k": 20, "seed": 3},
            {"prompt": "hello", "max_new_tokens": 6, "temperature": 8.0, "top_k": 20, "seed": 4}]
    lines = chat.read_prompts_jsonl(_jsonl(tmp_path, rows), max_new_tokens=4, chat=False)
    run_values = {**chat.CHAT_SAMPLING, "temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "repeat_last_n": 8}
    apply_fn, params = model()
    sched = StreamScheduler(apply_fn, params, SPEC, POLICIES["rsqr"], n_slots=3, prefill_chunk=CHUNK,
                            sampling=Sampling(**run_values), vocab_size=CFG.vocab_size)
    got = [r["token_ids"] for r in chat.run_prompts(lines, sched, TOK, seed=0, sampling=run_values).rows]
    alone = []
    for r in rows:
        own = {k: r[k] for k in ("temperature", "top_k") if k in r}
        s = make_session("rsqr", sampling=Sampling(**{**run_values, **own}), seed=r.get("seed", 0))
        s.feed(TOK.encode(r["prompt"]))
        alone.append(s.generate(r["max_new_tokens"]))
    assert got == alone and got[1] != got[2]  # the two sampled lines differ only by their seed (the tiny model is peaked: a high temperature)
    with pytest.raises(ConfigError, match='line 2: "top_p" must be in \\(0, 1\\]'):
        chat.read_prompts_jsonl(_jsonl(tmp_path, [{"prompt": "a"}, {"prompt": "b", "top_p": 0}], name="bad.jsonl"),
                                max_new_tokens=4, chat=False)


def test_memory_measurement_streams_equal_lone_sessions_and_track_the_facts():
    """exp_memory's runner on the tiny model: each seed's conversation, continued turn after turn on its own
    stream (StreamScheduler.follow_up), gives the replies chat.run gives on a lone Session (greedy); the facts'
    mentions are found (first turn) and, before the question, out of rsqr's device cache; a recorded history
    replays the same conversation with only the answer generated."""
    from rsqr_jax.policy import make_policy
    from rsqr_lab.studies import memory as M
    from rsqr_jax.sampling import Sampling
    from rsqr_jax.spec import CacheSpec

    tok = IdTokenizer()
    demo = chat.MemoryDemo("be brief", ("I am Ada.", "a b c d e f g h i j k", "l m n o p q r s", "who am I?"),
                           (chat.Fact("name", "Ada", ("Ada",)),))
    cfg = M.MemoryConfig(arms=("rsqr",), seeds=2, max_new_tokens=3, policy=make_policy("rsqr", window=8, n_sink=2,
                         delta=3, max_survivors=3), prefill_chunk=CHUNK,
                         sampling=(("temperature", 0.0), ("repeat_last_n", 8)))
    apply_fn, params = model()
    rows = M.run_arm("rsqr", cfg, apply_fn, params, CFG, tok, demo=demo)
    pol = M.policy_of("rsqr", cfg)
    spec = CacheSpec.for_policies(pol, num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                                  head_dim=CFG.head_dim, max_chunk=CHUNK)
    alone = Session(apply_fn, params, spec, pol, prefill_chunk=CHUNK, sampling=Sampling(**cfg.sampling_values))
    lone = chat.run(chat.ChatConfig(demo.turns, chat=True, max_new_tokens=3, system=demo.system), alone, tok,
                    status=lambda m: None)
    assert [r["replies"] for r in rows] == [lone.replies] * 2  # greedy: both seeds alike
    assert rows[0]["memory"]["fact_positions"] and rows[0]["memory"]["in_device_cache"] == 0
    assert rows[0]["session_tokens"] == alone.n_tokens
    replay = M.run_arm("rsqr", dataclasses.replace(cfg, history=tuple(lone.replies[:-1])), apply_fn, params, CFG,
                       tok, demo=demo)
    assert replay[0]["memory"]["fact_positions"] == rows[0]["memory"]["fact_positions"]
    assert len(replay[0]["replies"]) == 1 and "answer_names" in replay[0]
    committed = json.loads((Path(__file__).resolve().parent.parent / "docs/data/memory_history.json").read_text())
    assert list(cfg.to_json()) == list(committed["config"]) and cfg.to_json()["window"] == 8  # the results' layout
    table = M.summarize({"rsqr": rows}, demo)
    assert table[0]["n"] == 2 and table[0]["facts_out_of_device_cache"] == 2
