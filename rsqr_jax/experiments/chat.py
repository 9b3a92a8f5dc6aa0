"""A streaming chat (or plain generation) through a `Session`: feeding each user turn through the chat
template, streaming the reply, saving after every turn, and the rules of resuming a saved session.

Model-agnostic: `run` takes a ready Session and a transformers-style tokenizer (`encode`, `decode`,
`apply_chat_template`); scripts/decode.py loads the model and builds the Session.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path
from typing import Iterable, TextIO

from rsqr_jax.experiments.common import ConfigError, write_json_atomic

DEMO_TURNS = (
    "Hi! My name is Ada and I keep bees on a rooftop in Lisbon. Give me three tips for a beginner beekeeper.",
    "Which flowers should I plant nearby so my bees have food all year?",
    "How can I tell whether a hive is healthy?",
    "Write a short poem about bees waking up at sunrise.",
    "What is the capital of France?",
    "Explain in two sentences why bees dance.",
    "Remind me: what is my name, and where do I keep my bees?",
)

DTYPES = ("float32", "bfloat16")

# decode.py's recall tier under rsqr when --recall-pages is not given: on, because without it the demo's
# closing question is lost with the window (README; docs/recall_tier.md section 5). Other policies keep
# their published behaviour (off).
DEFAULT_RECALL_PAGES = 4


def default_recall_pages(policy: str) -> int:
    """Recall pages decode.py uses for `policy` when --recall-pages is not given."""
    return DEFAULT_RECALL_PAGES if policy == "rsqr" else 0


class ChatFeed:
    """Turns a growing conversation into the exact text still to feed, via the model's chat template."""

    def __init__(self, tokenizer, messages: list[dict] | None = None, fed_text: str = ""):
        self.tok = tokenizer
        self.messages: list[dict] = list(messages or [])
        self.fed_text = fed_text

    def user_turn(self, content: str) -> list[int]:
        self.messages.append({"role": "user", "content": content})
        full = self.tok.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
        if full.startswith(self.fed_text):
            new = full[len(self.fed_text):]
        else:  # the template rewrote earlier text: close the turn and render only the new message
            new = self.tok.apply_chat_template(self.messages[-1:], tokenize=False, add_generation_prompt=True)
        self.fed_text = full
        return self.tok.encode(new, add_special_tokens=False)

    def assistant_reply(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.fed_text += text


# ----------------------------------------------------------------------------------------------------
# Checks and settings (before any model is loaded).


def check_generation(*, max_new_tokens: int, temperature: float, top_p: float, seed: int, prefill_chunk: int) -> None:
    """One-line ConfigError for sampler / chunk settings a Session would refuse later (or silently misuse)."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"--temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {top_p}")
    if not 0 <= seed < 2**32:
        raise ConfigError(f"--seed must be in [0, 2**32), got {seed}")
    if prefill_chunk < 1:
        raise ConfigError(f"--prefill-chunk must be positive, got {prefill_chunk}")


def check_dtype(flag: str, value: str | None, allowed: tuple[str, ...] = DTYPES) -> None:
    if value is not None and value not in allowed:
        raise ConfigError(f"{flag} must be {', '.join(allowed[:-1])} or {allowed[-1]}, got {value!r}")


def cache_dtype(dtype: str, cache_dtype: str | None, weights_dtype: str, *, dtype_given: bool) -> str:
    """The KV cache dtype from --cache-dtype or (compatibility) --dtype; checks --weights-dtype too."""
    check_dtype("--cache-dtype", cache_dtype)
    check_dtype("--weights-dtype", weights_dtype, DTYPES + ("auto",))
    if dtype_given and cache_dtype not in (None, dtype):
        raise ConfigError(f"--dtype {dtype} and --cache-dtype {cache_dtype} disagree (give one)")
    return cache_dtype or dtype


def resolve_weights_dtype(weights_dtype: str, cache_dtype: str, platform: str) -> str:
    """`auto`: float32 on CPU (XLA:CPU runs bfloat16 matmuls 4-5x slower than float32), the cache dtype on
    accelerators (bfloat16 weights halve the memory traffic there)."""
    if weights_dtype != "auto":
        return weights_dtype
    return "float32" if platform == "cpu" else cache_dtype


def check_save_path(path: str) -> None:
    """Fail before any work if PATH cannot be written (the write itself is atomic: session.write_session_file)."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"--save {path}: is a directory")
    if not os.path.isdir(directory):
        raise ConfigError(f"--save {path}: directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"--save {path}: directory {directory} is not writable")


def read_prompt(prompt: str | None, prompt_file: str | None) -> str | None:
    """The prompt text from --prompt or --prompt-file (None: neither), with one-line errors."""
    if prompt is not None and prompt_file is not None:
        raise ConfigError("give --prompt or --prompt-file, not both")
    if prompt_file is not None:
        try:
            with open(prompt_file, encoding="utf-8") as f:
                prompt = f.read()
        except UnicodeDecodeError as e:
            raise ConfigError(f"prompt file {prompt_file} is not UTF-8 (byte {e.start})") from None
        except OSError as e:
            raise ConfigError(f"cannot read prompt file {prompt_file}: {e.strerror}") from None
        if not prompt.strip():
            raise ConfigError(f"prompt file {prompt_file} is empty")
    if prompt is not None and not prompt.strip():
        raise ConfigError("--prompt is empty")
    return prompt


def given_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of the flags actually given on the command line (not left at their defaults): only those
    can conflict with a resumed session."""
    saved = {id(a): a.default for a in parser._actions}
    try:
        for a in parser._actions:
            a.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for a in parser._actions:
            a.default = saved[id(a)]


# command-line dest -> where its value lives in a session file's policy header
_POLICY_FIELDS = {"window": "window", "sinks": "n_sink", "delta": "delta", "max_survivors": "max_survivors",
                  "block": "block", "recall_pages": "recall_pages"}


def saved_settings(header: dict) -> dict:
    """The settings (by command-line dest) a saved session fixes: policy, cache, sampler, model."""
    from rsqr_jax.policy import MODES, OVERFLOWS
    from rsqr_jax.spec import ColdStore

    pol = header["policy"]
    cache_dtype = header["spec"]["dtype"]
    return {"policy": MODES[pol["mode"]], "overflow": OVERFLOWS[pol["overflow"]],
            **{dest: pol[key] for dest, key in _POLICY_FIELDS.items()},
            "prefill_chunk": header["prefill_chunk"], "temperature": header["temperature"],
            "top_p": header["top_p"], "seed": header["seed"], "dtype": cache_dtype, "cache_dtype": cache_dtype,
            "weights_dtype": header["identity"].get("dtype", cache_dtype),
            **({"cold_capacity": cold.capacity, "page_size": cold.page_size, "page_score": cold.page_score,
                "recall_neighbors": cold.neighbors} if (cold := ColdStore.of_spec(header["spec"])) else {}),
            "chat": bool(header["extra"].get("chat", False))}


def apply_resume(settings: dict, header: dict, given: set[str]) -> dict:
    """`settings` with every saved value taken from the session header; an explicitly given setting that
    conflicts with it is a ConfigError (repeating the saved value, `--chat` on a chat session or
    `--weights-dtype auto` is fine). The model path comes from the file unless given (then it must match)."""
    out = dict(settings)
    for dest, value in saved_settings(header).items():
        mine = settings.get(dest)
        harmless = (dest == "chat" and value) or (dest == "weights_dtype" and mine == "auto")
        if dest in given and mine != value and not harmless:
            flag = "--" + dest.replace("_", "-")
            shown = "" if dest == "chat" else f" {mine}"
            raise ConfigError(f"{flag}{shown} conflicts with the resumed session ({dest} = {value})")
        out[dest] = value
    path = header["identity"].get("path")
    if settings.get("model") is None:
        out["model"] = path
    elif os.path.abspath(settings["model"]) != path:
        raise ConfigError(f"--model {settings['model']} conflicts with the resumed session (saved with {path})")
    return out


def plan_turns(prompt: str | None, chat: bool, resumed: bool) -> tuple[tuple[str, ...] | None, bool]:
    """(turns, chat): the demo conversation without a prompt, the prompt, or None = one turn per stdin line."""
    if prompt is None and not chat and not resumed:
        return DEMO_TURNS, True
    if prompt is not None:
        return (prompt,), chat
    return None, True if not resumed else chat


def full_max_len(tokenizer, turns: tuple[str, ...] | None, max_new_tokens: int) -> int:
    """Positions a `full` cache needs for this run (prompts + replies, rounded up to 64): it must hold the
    whole session, and attention pays for every slot, so no more than this run can reach."""
    prompt_bound = sum(len(tokenizer.encode(t)) + 64 for t in turns) if turns else 4096
    n_turns = len(turns) if turns else 16
    max_len = prompt_bound + n_turns * (max_new_tokens + 8)
    return -(-max_len // 64) * 64


# ----------------------------------------------------------------------------------------------------
# The turn loop.


@dataclasses.dataclass(frozen=True)
class ChatConfig:
    """turns None: one turn per non-empty line of `lines` (stdin); save: session file written after every turn."""

    turns: tuple[str, ...] | None
    chat: bool
    max_new_tokens: int
    save: str | None = None


@dataclasses.dataclass
class ChatResult:
    replies: list[str]
    n_prompt_tokens: int
    n_generated: int
    prefill_s: float
    decode_s: float
    compile_s: float
    session_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.n_generated / self.decode_s if self.decode_s > 0 else float("nan")

    def to_json(self, **extra) -> dict:
        """The --json object of scripts/decode.py (`extra`: cache_bytes, policy, dtype, model, ...)."""
        text = self.replies[-1] if len(self.replies) == 1 else "\n\n".join(self.replies)
        return {"text": text, "replies": self.replies, "n_prompt_tokens": self.n_prompt_tokens,
                "n_generated": self.n_generated, "tokens_per_s": self.tokens_per_s, "prefill_s": self.prefill_s,
                "compile_s": self.compile_s, "session_tokens": self.session_tokens, **extra}

    def write(self, out_dir: str | os.PathLike, **extra) -> Path:
        path = Path(out_dir) / "decode.json"
        write_json_atomic(path, self.to_json(**extra))
        return path


def run(config: ChatConfig, session, tokenizer, *, identity: dict | None = None, out: TextIO | None = None,
        lines: Iterable[str] | None = None) -> ChatResult:
    """Feed each turn, stream the reply's text to `out` as it is generated, save after every turn.

    A resumed chat session continues its transcript from `session.extra`. identity: what the saved file
    records (models.llama.LoadedModel.identity); required with config.save."""
    from rsqr_jax.session import SessionFileError

    out = sys.stdout if out is None else out
    tok, chat = tokenizer, config.chat
    feeder = ChatFeed(tok, session.extra.get("messages"), session.extra.get("fed_text", "")) if chat else None
    result = ChatResult([], 0, 0, 0.0, 0.0, session.compile_s, session.n_tokens)

    def run_turn(user_text: str) -> None:
        ids = feeder.user_turn(user_text) if chat else tok.encode(user_text)
        if chat:
            print(f"\n>>> {user_text}", file=out, flush=True)
        t0 = time.perf_counter()
        try:
            session.feed(ids)
        except ValueError as e:  # e.g. a resumed `full` session whose cache is full
            raise ConfigError(str(e)) from None
        result.prefill_s += time.perf_counter() - t0
        result.n_prompt_tokens += len(ids)
        reply: list[int] = []
        printed = ""

        def on_token(t: int) -> None:
            nonlocal printed
            reply.append(t)
            text = tok.decode(reply, skip_special_tokens=True)
            print(text[len(printed):], end="", file=out, flush=True)
            printed = text

        t0 = time.perf_counter()
        session.generate(config.max_new_tokens, on_token)
        result.decode_s += time.perf_counter() - t0
        print(file=out, flush=True)
        result.n_generated += len(reply)
        text = tok.decode(reply, skip_special_tokens=True)
        result.replies.append(text)
        if chat:
            feeder.assistant_reply(text)
        if config.save is not None:
            extra = ({"chat": True, "messages": feeder.messages, "fed_text": feeder.fed_text} if chat
                     else {"chat": False})
            try:
                session.save(config.save, identity, extra=extra)
            except SessionFileError as e:
                raise ConfigError(str(e)) from None

    if config.turns is None:
        for line in (sys.stdin if lines is None else lines):
            if line.strip():
                run_turn(line.strip())
    else:
        for turn in config.turns:
            run_turn(turn)
    result.session_tokens, result.compile_s = session.n_tokens, session.compile_s
    return result


# ----------------------------------------------------------------------------------------------------
# Many prompts at once (decode.py --prompts-jsonl): one stream per prompt on rsqr_jax.streams.

_JSONL_KEYS = {"prompt", "max_new_tokens", "chat"}


@dataclasses.dataclass(frozen=True)
class PromptLine:
    """One request of a --prompts-jsonl file (line: its 1-based line number)."""

    line: int
    prompt: str
    max_new_tokens: int
    chat: bool


def read_prompts_jsonl(path: str, *, max_new_tokens: int, chat: bool) -> list[PromptLine]:
    """Every request of a JSONL file, checked up front (before a model is loaded): one JSON object per
    non-blank line, {"prompt": str, "max_new_tokens": int (default the flag), "chat": bool (default the
    flag)}. A malformed line is a ConfigError naming its line: nothing has run yet, so nothing is lost,
    and a typo is not silently skipped."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"prompts file {path} is not UTF-8 (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"cannot read prompts file {path}: {e.strerror}") from None
    out = []
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{path} line {n}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - _JSONL_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(_JSONL_KEYS))})")
        prompt = obj.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f"{where}: \"prompt\" must be a non-empty string")
        m = obj.get("max_new_tokens", max_new_tokens)
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ConfigError(f"{where}: \"max_new_tokens\" must be a positive integer, got {m!r}")
        c = obj.get("chat", chat)
        if not isinstance(c, bool):
            raise ConfigError(f"{where}: \"chat\" must be true or false, got {c!r}")
        out.append(PromptLine(n, prompt, m, c))
    if not out:
        raise ConfigError(f"prompts file {path} has no prompts")
    return out


def prompt_ids(tokenizer, prompt: str, is_chat: bool) -> list[int]:
    """The token ids decode.py --prompt feeds for this prompt (the chat template's first user turn)."""
    return ChatFeed(tokenizer).user_turn(prompt) if is_chat else tokenizer.encode(prompt)


def streams_max_len(tokenizer, lines: list[PromptLine], cap: int) -> int:
    """Positions a `full` cache needs so that every request fits as it does alone (full_max_len of its
    prompt, the longest), at most cap (the model's context or --max-len)."""
    need = max(full_max_len(tokenizer, (pl.prompt,), pl.max_new_tokens) for pl in lines)
    return min(need, cap)


@dataclasses.dataclass
class StreamsResult:
    """The rows of a --prompts-jsonl run (by line number) and its figures."""

    rows: list[dict]
    n_generated: int
    run_s: float  # wall time of the whole run: prefill and generation
    compile_s: float
    n_slots: int
    rounds: int

    @property
    def errors(self) -> list[dict]:
        return [r for r in self.rows if "error" in r]

    @property
    def tokens_per_s(self) -> float:
        return self.n_generated / self.run_s if self.run_s > 0 else float("nan")


def run_prompts(lines: list[PromptLine], scheduler, tokenizer, *, emit=None, seed: int = 0) -> StreamsResult:
    """Generate every request concurrently on `scheduler` (a rsqr_jax.streams.StreamScheduler); `emit(row)`
    sees each row as its stream finishes. Every stream's rng starts from `seed`, as decode.py --seed
    starts a lone prompt's, so sampled outputs equal the single-prompt ones too. A request the scheduler refuses (e.g. longer than a `full`
    cache) becomes an {"line", "error"} row and the others still run: their results are not lost."""
    from rsqr_jax.streams import Request

    rows: dict[int, dict] = {}
    by_index: dict[int, tuple[PromptLine, list[int]]] = {}
    emit = emit or (lambda row: None)
    for pl in lines:
        ids = prompt_ids(tokenizer, pl.prompt, pl.chat)
        try:
            index = scheduler.submit(Request(tuple(ids), pl.max_new_tokens, seed))
        except ValueError as e:
            rows[pl.line] = {"line": pl.line, "error": str(e)}
            emit(rows[pl.line])
            continue
        by_index[index] = (pl, ids)

    def finished(f) -> None:
        pl, ids = by_index[f.index]
        rows[pl.line] = {"line": pl.line, "text": tokenizer.decode(f.tokens, skip_special_tokens=True),
                         "n_prompt_tokens": len(ids), "n_generated": len(f.tokens), "stop": f.stop,
                         "token_ids": f.tokens, "chat": pl.chat}
        emit(rows[pl.line])

    t0 = time.perf_counter()
    scheduler.run(on_finished=finished)
    run_s = time.perf_counter() - t0
    return StreamsResult([rows[k] for k in sorted(rows)], scheduler.n_generated, run_s, scheduler.compile_s,
                         scheduler.n_slots, scheduler.rounds)
