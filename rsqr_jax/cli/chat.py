"""A streaming chat (or plain generation) through a `Session`: each user turn through the chat template,
the reply streamed token by token (rsqr_jax.conversation: incremental detokenization, stop strings), saving
after every turn, the interactive loop, the memory demo and the rules of resuming a saved session.

Model-agnostic: `run` takes a ready Session and a transformers-style tokenizer (`encode`, `decode`,
`apply_chat_template`); scripts/decode.py loads the model and builds the Session.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, TextIO

import numpy as np

from rsqr_jax.conversation import ChatFeed, Pins, generate_reply
from rsqr_jax.eval.runtime import ConfigError, write_json_atomic
from rsqr_jax.cli.args import SHARE_NONE
from rsqr_jax.presets import SAMPLING_FIELDS, generic


@dataclasses.dataclass(frozen=True)
class Fact:
    """A fact the demo states once: `mention` (as written in the first turn) and the `answers` that count
    as remembering it (case-insensitive substrings of the reply to the closing question)."""

    label: str
    mention: str
    answers: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class MemoryDemo:
    """The demo conversation: facts stated once in the first turn, unrelated turns long enough that the
    facts leave the window and the survivors, then the question that asks for them."""

    system: str
    turns: tuple[str, ...]
    facts: tuple[Fact, ...]

    @property
    def question(self) -> str:
        return self.turns[-1]

    def positions(self, tokenizer, ids: list[int], first_position: int) -> list[int]:
        """Global positions of the tokens of `ids` (fed from first_position on) that spell a fact."""
        return [first_position + i for i in fact_token_indices(tokenizer, list(ids), [f.mention for f in self.facts])]

    def score(self, answer: str) -> dict[str, bool]:
        """Which facts the answer names (any of each fact's answers as a whole word, case-insensitive)."""
        return {f.label: any(_word(a).search(answer) for a in f.answers) for f in self.facts}


DEMO = MemoryDemo(
    system="You are a helpful AI assistant. Keep your answers short.",
    turns=(
        "Hi! My name is Ada and I keep my bees on a rooftop in Bristol.",
        "What is the capital of France?",
        "Why is the sky blue?",
        "Give me a simple recipe for pancakes.",
        "Write a short poem about the sea.",
        "How does a rainbow form?",
        "What are three habits that help people sleep well?",
        "Tell me a fun fact about octopuses.",
        "What is the difference between a planet and a star?",
        "Suggest a name for a friendly robot and say why.",
        "How do plants make their food?",
        "Remind me: what is my name, and where do I keep my bees?",
    ),
    facts=(Fact("name", "Ada", ("Ada",)), Fact("place", "Bristol", ("Bristol",))),
)

DTYPES = ("float32", "bfloat16")


def token_char_spans(tokenizer, ids: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each token's text in decode(ids) (special tokens kept), by decoding prefixes."""
    ends = [len(tokenizer.decode(ids[:i + 1], skip_special_tokens=False)) for i in range(len(ids))]
    return list(zip([0] + ends[:-1], ends))


def _word(w: str) -> "re.Pattern":
    """`w` as a whole word, case-insensitive ("Ada" does not match "Canada" or "Adam")."""
    return re.compile(rf"(?<!\w){re.escape(w)}(?!\w)", re.IGNORECASE)


def fact_token_indices(tokenizer, ids: list[int], words: Iterable[str]) -> list[int]:
    """Indices into `ids` of the tokens that spell any of `words` as a whole word (every occurrence)."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    spans = token_char_spans(tokenizer, ids)
    out = set()
    for w in words:
        for m in _word(w).finditer(text):
            out.update(i for i, (s, e) in enumerate(spans) if s < m.end() and e > m.start())
    return sorted(out)


# ----------------------------------------------------------------------------------------------------
# Checks and settings (before any model is loaded).

# The sampling values of the generic preset (rsqr_jax/presets/generic.json): chat defaults for small models, used
# where neither a flag nor the model's own generation config sets a value. SmolLM2-class models loop and copy
# earlier replies when greedy: llama.cpp's top-k / top-p / min-p with a low temperature, and the repeat penalty
# over the last 256 tokens (llama.cpp looks at 64) so that a reply does not reopen with the previous one's words.
CHAT_SAMPLING = dict(generic().sampling)


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def check_sampling(values: dict, name: Callable[[str], str] = flag) -> None:
    """One-line ConfigError naming the flag (or `name(field)`) for a sampling value the sampler would refuse."""
    rules = {"temperature": (lambda v: v >= 0, ">= 0"), "top_k": (lambda v: v >= 0 and v == int(v), "an integer >= 0"),
             "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"), "min_p": (lambda v: 0 <= v < 1, "in [0, 1)"),
             "repeat_penalty": (lambda v: v > 0, "> 0"),
             "repeat_last_n": (lambda v: v >= 0 and v == int(v), "an integer >= 0")}
    for k, v in values.items():
        if v is None:
            continue
        ok, what = rules.get(k, (lambda v: True, "a number"))
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
            raise ConfigError(f"{name(k)} must be {what} and finite, got {v!r}")


def resolve_sampling(flags: dict, model_defaults: dict | None = None) -> dict:
    """Each sampling value: the flag if given (not None), else the model's generation default, else the generic
    preset's (rsqr_jax.presets.Preset.resolve)."""
    return generic().resolve(model_sampling=model_defaults, **{k: flags.get(k) for k in SAMPLING_FIELDS}).sampling


def check_generation(*, max_new_tokens: int, seed: int | None, prefill_chunk: int | None, **sampling) -> None:
    """One-line ConfigError for generation settings a Session would refuse later (or silently misuse)."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    check_sampling(sampling)
    if seed is not None and not 0 <= seed < 2**32:
        raise ConfigError(f"--seed must be in [0, 2**32), got {seed}")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ConfigError(f"--prefill-chunk must be positive, got {prefill_chunk}")


def draw_seed() -> int:
    """A fresh random seed (printed, so a run can be repeated with --seed)."""
    import secrets

    return secrets.randbelow(2**32)


def describe_cache(spec, policy) -> str:
    """The cache as the user asked for it (not the internal slot counts), and its memory."""
    from rsqr_jax.policy import host_policies

    h = host_policies(policy)[0]
    parts = spec.bytes_by_part(policy)
    if policy.name.startswith("full"):
        shape = f"full attention, {spec.win_capacity} positions"
    else:
        shape = f"window {h['window']}" + (f" (+{h['block'] - 1} block)" if h["block"] > 1 else "")
        if h["n_sink"]:
            shape += f", {h['n_sink']} sinks"
        if h["delta"]:
            shape += f", {h['max_survivors']} survivors (every {h['delta']}th evicted token)"
        if h["recall_pages"]:
            shape += (f", recall {h['recall_pages']} pages of {spec.cold.page_size} from a "
                      f"{spec.cold.capacity}-token cold store"
                      + (f" ({spec.cold.placement} placement)" if spec.cold.placement != "rank" else ""))
        if spec.pins:
            shape += f", room for {spec.pins} pinned tokens ({parts['pins'] / 2**20:.2f} MiB)"
    mib = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in parts.items() if k != "total" and v >= 2**19)
    return f"cache: {shape}; {parts['total'] / 2**20:.1f} MiB" + (f" ({mib})" if mib else "")


def describe_sampling(values: dict, seed: int) -> str:
    if values["temperature"] == 0:
        text = "greedy"
    else:
        text = (f"temperature {values['temperature']:g}, top-k {values['top_k']}, top-p {values['top_p']:g}, "
                f"min-p {values['min_p']:g}")
    pen = [f"repeat penalty {values['repeat_penalty']:g}" if values["repeat_penalty"] != 1 else "",
           f"presence {values['presence_penalty']:g}" if values["presence_penalty"] else "",
           f"frequency {values['frequency_penalty']:g}" if values["frequency_penalty"] else ""]
    pen = [x for x in pen if x]
    if pen and values["repeat_last_n"]:
        text += f", {' and '.join(pen)} over the last {values['repeat_last_n']} tokens"
    return f"sampling: {text}; seed {seed} (repeat with --seed {seed})"


def check_dtype(flag_name: str, value: str | None, allowed: tuple[str, ...] = DTYPES) -> None:
    if value is not None and value not in allowed:
        raise ConfigError(f"{flag_name} must be {', '.join(allowed[:-1])} or {allowed[-1]}, got {value!r}")


def cache_dtype(dtype: str, cache_dtype: str | None, weights_dtype: str, *, dtype_given: bool) -> str:
    """The KV cache dtype from --cache-dtype or (compatibility) --dtype; checks --weights-dtype too."""
    check_dtype("--cache-dtype", cache_dtype)
    check_dtype("--weights-dtype", weights_dtype, DTYPES + ("auto",))
    if dtype_given and cache_dtype not in (None, dtype):
        raise ConfigError(f"--dtype {dtype} and --cache-dtype {cache_dtype} disagree (give one)")
    return cache_dtype or (dtype if dtype_given else None)  # None: the preset's


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


class _NotGiven(list):
    """The default every flag gets while given_flags parses: a list, so an `append` flag can extend its copy."""


def given_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of the flags actually given on the command line (not left at their defaults): only those
    can conflict with a resumed session. argparse records no provenance, so argv is parsed once more with
    every default set to a marker (public API only: set_defaults / get_default), then the defaults restored."""
    dests = vars(parser.parse_args(argv))
    saved = {d: parser.get_default(d) for d in dests}
    marker = _NotGiven()
    parser.set_defaults(**{d: marker for d in dests})
    try:
        again = vars(parser.parse_args(argv))
    finally:
        parser.set_defaults(**saved)
    return {d for d, v in again.items() if v is not marker}


# command-line dest -> where its value lives in a session file's policy header
_POLICY_FIELDS = {"window": "window", "sinks": "n_sink", "delta": "delta", "max_survivors": "max_survivors",
                  "block": "block", "recall_pages": "recall_pages"}


def saved_sampling(header: dict) -> dict:
    """The sampling values of a session header."""
    return {k: header["sampling"][k] for k in SAMPLING_FIELDS if k in header["sampling"]}


def saved_settings(header: dict) -> dict:
    """The settings (by command-line dest) a saved session fixes: policy, cache, sampler, model."""
    from rsqr_jax.policy import MODES, OVERFLOWS
    from rsqr_jax.spec import CacheSpec

    pol = header["policy"]
    cache_dtype_ = header["spec"]["dtype"]
    return {"policy": MODES[pol["mode"]], "overflow": OVERFLOWS[pol["overflow"]],
            **{dest: pol[key] for dest, key in _POLICY_FIELDS.items()},
            "prefill_chunk": header["prefill_chunk"], **saved_sampling(header), "seed": header["seed"],
            "dtype": cache_dtype_, "cache_dtype": cache_dtype_,
            "weights_dtype": header["identity"].get("dtype", cache_dtype_),
            **({"cold_capacity": cold.capacity, "page_size": cold.page_size, "page_score": cold.page_score,
                "recall_neighbors": cold.neighbors, "placement": cold.placement,
                "reselect": cold.reselect, "share_choice_from": SHARE_NONE if cold.share_from is None else cold.share_from,
                "score_dtype": cold.score_dtype}
               if (cold := CacheSpec.from_json(header["spec"]).cold) else {}),
            **_saved_pins(header),
            "chat": bool(header["extra"].get("chat", False))}


def _saved_pins(header: dict) -> dict:
    """The pin flags a saved session fixes (its spans are in its cache; these pin a stream /reset starts)."""
    pins = Pins(**header["extra"].get("pins", {}))
    return {"keep": pins.keep, "pin_system": pins.system, "pin_first_turn": pins.first_turn,
            "pin_room": int(header["spec"].get("pins", 0))}


def apply_resume(settings: dict, header: dict, given: set[str]) -> dict:
    """`settings` with every saved value taken from the session header; an explicitly given setting that
    conflicts with it is a ConfigError (repeating the saved value, `--chat` on a chat session or
    `--weights-dtype auto` is fine). The model path comes from the file unless given (then it must match)."""
    out = dict(settings)
    for dest, value in saved_settings(header).items():
        mine = settings.get(dest)
        harmless = (dest == "chat" and value) or (dest == "weights_dtype" and mine == "auto")
        if dest in given and mine != value and not harmless:
            shown = "" if dest == "chat" else f" {mine}"
            raise ConfigError(f"{flag(dest)}{shown} conflicts with the resumed session ({dest} = {value})")
        out[dest] = value
    path = header["identity"].get("path")
    if settings.get("model") is None:
        out["model"] = path
    elif os.path.abspath(settings["model"]) != path:
        raise ConfigError(f"--model {settings['model']} conflicts with the resumed session (saved with {path})")
    return out


def plan_turns(prompt: str | None, interactive: bool, resumed: bool) -> tuple[str, ...] | None:
    """The turns to run: the demo conversation without a prompt, the prompt, or None = the interactive loop
    (stdin lines)."""
    if prompt is not None:
        return (prompt,)
    if interactive or resumed:
        return None
    return DEMO.turns


def full_max_len(tokenizer, turns: tuple[str, ...] | None, max_new_tokens: int, system: str | None = None) -> int:
    """Positions a `full` cache needs for this run (prompts + replies, rounded up to 64): it must hold the
    whole session, and attention pays for every slot, so no more than this run can reach."""
    prompt_bound = sum(len(tokenizer.encode(t)) + 64 for t in turns) if turns else 4096
    if system:
        prompt_bound += len(tokenizer.encode(system)) + 64
    n_turns = len(turns) if turns else 16
    max_len = prompt_bound + n_turns * (max_new_tokens + 8)
    return -(-max_len // 64) * 64


# ----------------------------------------------------------------------------------------------------
# The turn loop.

COMMANDS = {"/exit": "end the chat", "/quit": "end the chat", "/reset": "forget the conversation (an empty cache)"}


@dataclasses.dataclass(frozen=True)
class ChatConfig:
    """turns None: the interactive loop (one turn per line of stdin; /exit, /reset). chat: feed turns through
    the chat template (else plain completion). save: session file written after every turn. system: the system
    prompt of a new chat. stop: strings that end a reply (cut before them). demo: the memory demo whose facts
    the run tracks (positions, in the cache or not, named in the answer). pins: what a new stream pins from its
    start (rsqr_jax.conversation.Pins)."""

    turns: tuple[str, ...] | None
    chat: bool
    max_new_tokens: int
    save: str | None = None
    system: str | None = None
    stop: tuple[str, ...] = ()
    demo: MemoryDemo | None = None
    pins: Pins = Pins()


@dataclasses.dataclass
class ChatResult:
    replies: list[str]
    n_prompt_tokens: int
    n_generated: int
    prefill_s: float
    decode_s: float
    compile_s: float
    session_tokens: int
    stops: list[str] = dataclasses.field(default_factory=list)
    memory: dict | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.n_generated / self.decode_s if self.decode_s > 0 else float("nan")

    def to_json(self, **extra) -> dict:
        """The --json object of scripts/decode.py (`extra`: cache_bytes, policy, dtype, model, seed, ...)."""
        text = self.replies[-1] if len(self.replies) == 1 else "\n\n".join(self.replies)
        out = {"text": text, "replies": self.replies, "stop": self.stops[-1] if self.stops else None,
               "stops": self.stops, "n_prompt_tokens": self.n_prompt_tokens, "n_generated": self.n_generated,
               "tokens_per_s": self.tokens_per_s, "prefill_s": self.prefill_s, "compile_s": self.compile_s,
               "session_tokens": self.session_tokens, **extra}
        if self.memory is not None:
            out["memory"] = self.memory
        return out

    def write(self, out_dir: str | os.PathLike, **extra) -> Path:
        path = Path(out_dir) / "decode.json"
        write_json_atomic(path, self.to_json(**extra))
        return path


def stdin_turns(stdin: TextIO, prompt_out: TextIO) -> Iterator[tuple[str, bool]]:
    """(line, typed on a terminal) for each line of stdin; on a terminal with a "> " prompt (and line editing)."""
    if stdin.isatty():
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
        while True:
            try:
                print("> ", end="", file=prompt_out, flush=True)
                line = stdin.readline()
            except KeyboardInterrupt:
                print(file=prompt_out)
                return
            if not line:
                print(file=prompt_out)
                return
            yield line, True
    else:
        for line in stdin:
            yield line, False


def device_positions(cache) -> np.ndarray:
    """Global positions of the tokens the device cache attends to (window, sinks, survivors): not the cold store."""
    pos = np.concatenate([np.asarray(cache.win_pos).ravel(), np.asarray(cache.surv_pos).ravel()])
    return np.unique(pos[pos >= 0])


def cold_positions(cache) -> np.ndarray:
    """Global positions held in the recall tier's cold store."""
    pos = np.asarray(cache.cold.pos).ravel()
    return np.unique(pos[pos >= 0])


def memory_check(cache, fact_positions: list[int], has_cold_store: bool) -> dict:
    """Where the demo's fact tokens are right before the closing question."""
    dev = np.isin(fact_positions, device_positions(cache))
    out = {"fact_positions": [int(p) for p in fact_positions], "in_device_cache": int(dev.sum())}
    if has_cold_store:
        out["in_cold_store"] = int(np.isin(fact_positions, cold_positions(cache)).sum())
    return out


def describe_memory(check: dict) -> str:
    n, dev = len(check["fact_positions"]), check["in_device_cache"]
    pos = check["fact_positions"]
    text = (f"memory check: the facts' {n} tokens (positions {pos[0]}-{pos[-1]}) in the device cache "
            f"(window, sinks, survivors): {'none' if dev == 0 else f'{dev} of {n}'}")
    if "in_cold_store" in check:
        text += f"; in the cold store: {check['in_cold_store']} of {n}"
    return text


def run(config: ChatConfig, session, tokenizer, *, identity: dict | None = None, out: TextIO | None = None,
        lines: Iterable[str] | None = None, status: Callable[[str], None] | None = None) -> ChatResult:
    """Feed each turn, stream the reply's text to `out` token by token, save after every turn.

    config.turns None: the interactive loop over `lines` (default stdin): "/exit" ends it, "/reset" empties the
    cache and the transcript; on a terminal typed lines are not echoed, otherwise each turn is printed as
    ">>> turn" so the transcript reads whole. A resumed chat session continues its transcript from
    `session.extra`. identity: what the saved file records (rsqr_jax.models.llama.LoadedModel.identity); required with
    config.save. status: where status lines go (memory check, empty replies)."""
    from rsqr_jax.session import SessionFileError

    out = sys.stdout if out is None else out
    status = status or (lambda msg: print(msg, file=sys.stderr, flush=True))
    tok, chat = tokenizer, config.chat

    def new_feeder() -> ChatFeed:
        return ChatFeed(tok, [{"role": "system", "content": config.system}] if config.system else [])

    if chat and "messages" in session.extra:
        feeder = ChatFeed(tok, session.extra.get("messages"), session.extra.get("fed_text", ""))
    else:
        feeder = new_feeder() if chat else None
    result = ChatResult([], 0, 0, 0.0, 0.0, session.compile_s, session.n_tokens)
    demo = config.demo
    fact_positions: list[int] = []

    def run_turn(index: int, user_text: str, echo: bool) -> None:
        nonlocal fact_positions
        if echo:
            print(f"\n>>> {user_text}", file=out, flush=True)
        ids = feeder.user_turn(user_text) if chat else tok.encode(user_text)
        asking = demo is not None and user_text == demo.question
        if demo is not None and not asking:  # every mention of a fact before the question, replies included
            fact_positions += demo.positions(tok, ids, int(session.cache.t))
        if asking and fact_positions:
            result.memory = memory_check(session.cache, fact_positions, session.spec.cold_slots > 0)
            status(describe_memory(result.memory))
        t0 = time.perf_counter()
        try:
            config.pins.apply(session, tok, ids, config.system if chat else None)
            session.feed(ids)
        except ValueError as e:  # e.g. a resumed `full` session whose cache is full, or no room for the pins
            raise ConfigError(str(e)) from None
        result.prefill_s += time.perf_counter() - t0
        result.n_prompt_tokens += len(ids)

        def emit(piece: str) -> None:
            if piece:
                print(piece, end="", file=out, flush=True)

        t0 = time.perf_counter()
        first_reply_position = int(session.cache.t)
        text, n, reason, reply_ids = generate_reply(session, tok, config.max_new_tokens, config.stop, emit,
                                                    with_ids=True)
        result.decode_s += time.perf_counter() - t0
        if demo is not None and not asking:
            fact_positions += demo.positions(tok, reply_ids[:int(session.cache.t) - first_reply_position],
                                             first_reply_position)
        print(file=out, flush=True)
        result.n_generated += n
        result.replies.append(text)
        result.stops.append(reason)
        if not text.strip():
            status(f"empty reply (stop: {reason}): the model ended the turn at once"
                   + ("" if chat else "; an instruct model may need its chat template (drop --raw)"))
        if asking and result.memory is not None:
            result.memory["answer_names"] = demo.score(text)
            named = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in result.memory["answer_names"].items())
            status(f"memory check: the answer names {named}")
        if chat:
            feeder.assistant_reply(text)
        if config.save is not None:
            extra = ({"chat": True, "messages": feeder.messages, "fed_text": feeder.fed_text} if chat
                     else {"chat": False}) | ({"pins": dataclasses.asdict(config.pins)} if config.pins else {})
            try:
                session.save(config.save, identity, extra=extra)
            except SessionFileError as e:
                raise ConfigError(str(e)) from None

    if config.turns is None:
        source = ((ln, False) for ln in lines) if lines is not None else stdin_turns(sys.stdin, out)
        index = 0
        for line, typed in source:
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                session.reset()
                feeder = new_feeder() if chat else None
                status("conversation reset: the cache is empty")
                continue
            if text.startswith("/") and text.split()[0] in ("/help", "/?"):
                status("commands: " + "; ".join(f"{c} {what}" for c, what in COMMANDS.items()))
                continue
            run_turn(index, text, echo=chat and not typed)
            index += 1
    else:
        for index, turn in enumerate(config.turns):
            run_turn(index, turn, echo=chat and len(config.turns) > 1)
    result.session_tokens, result.compile_s = session.n_tokens, session.compile_s
    return result


# ----------------------------------------------------------------------------------------------------
# Many prompts at once (decode.py --prompts-jsonl): one stream per prompt on rsqr_jax.streams.

_JSONL_KEYS = {"prompt", "max_new_tokens", "chat", "seed", *SAMPLING_FIELDS}


@dataclasses.dataclass(frozen=True)
class PromptLine:
    """One request of a --prompts-jsonl file (line: its 1-based line number)."""

    line: int
    prompt: str
    max_new_tokens: int
    chat: bool
    seed: int | None = None
    sampling: tuple[tuple[str, float], ...] = ()  # this line's own sampling values (the flags' otherwise)


def read_prompts_jsonl(path: str, *, max_new_tokens: int, chat: bool) -> list[PromptLine]:
    """Every request of a JSONL file, checked up front (before a model is loaded): one JSON object per
    non-blank line, {"prompt": str, "max_new_tokens": int (default the flag), "chat": bool (default the
    flag), "seed": int, and any sampling value ("temperature", "top_k", "top_p", "min_p", "repeat_penalty",
    "presence_penalty", "frequency_penalty"; default the flags)}. A malformed line is a ConfigError naming its line: nothing has run yet, so nothing is lost,
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
        s = obj.get("seed")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**32):
            raise ConfigError(f"{where}: \"seed\" must be an integer in [0, 2**32), got {s!r}")
        own = {k: obj[k] for k in SAMPLING_FIELDS if k in obj}
        if "repeat_last_n" in own:
            raise ConfigError(f"{where}: \"repeat_last_n\" is set for the whole run (--repeat-last-n), not per line")
        try:
            check_sampling(own, name=lambda k: f'"{k}"')
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        out.append(PromptLine(n, prompt, m, c, s, tuple(sorted(own.items()))))
    if not out:
        raise ConfigError(f"prompts file {path} has no prompts")
    return out


def prompt_ids(tokenizer, prompt: str, is_chat: bool, system: str | None = None) -> list[int]:
    """The token ids decode.py --prompt feeds for this prompt (the chat template's first user turn)."""
    if not is_chat:
        return tokenizer.encode(prompt)
    return ChatFeed(tokenizer, [{"role": "system", "content": system}] if system else []).user_turn(prompt)


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


def run_prompts(lines: list[PromptLine], scheduler, tokenizer, *, emit=None, seed: int = 0,
                sampling: dict | None = None, system: str | None = None) -> StreamsResult:
    """Generate every request concurrently on `scheduler` (a rsqr_jax.streams.StreamScheduler); `emit(row)`
    sees each row as its stream finishes. Every stream's rng starts from `seed`, as decode.py --seed
    starts a lone prompt's, so sampled outputs equal the single-prompt ones too; a line's own "seed" and
    sampling values override `seed` and `sampling` (the run's values, by Sampling field) for that line. A request the scheduler refuses (e.g. longer than a `full`
    cache) becomes an {"line", "error"} row and the others still run: their results are not lost."""
    from rsqr_jax.streams import Request

    rows: dict[int, dict] = {}
    by_index: dict[int, tuple[PromptLine, list[int]]] = {}
    emit = emit or (lambda row: None)
    for pl in lines:
        ids = prompt_ids(tokenizer, pl.prompt, pl.chat, system)
        own = None
        if pl.sampling:
            from rsqr_jax.sampling import Sampling

            own = Sampling(**{**(sampling or {}), **dict(pl.sampling)})
        try:
            index = scheduler.submit(Request(tuple(ids), pl.max_new_tokens, seed if pl.seed is None else pl.seed,
                                             sampling=own))
        except ValueError as e:
            rows[pl.line] = {"line": pl.line, "error": str(e)}
            emit(rows[pl.line])
            continue
        by_index[index] = (pl, ids)

    def finished(f) -> None:
        pl, ids = by_index[f.index]
        text_ids = [t for t in f.tokens if t not in scheduler.eos_ids]  # a reply's text never holds its EOS
        rows[pl.line] = {"line": pl.line, "text": tokenizer.decode(text_ids, skip_special_tokens=True),
                         "n_prompt_tokens": len(ids), "n_generated": len(f.tokens), "stop": f.stop,
                         "token_ids": f.tokens, "chat": pl.chat}
        emit(rows[pl.line])

    t0 = time.perf_counter()
    scheduler.run(on_finished=finished)
    run_s = time.perf_counter() - t0
    return StreamsResult([rows[k] for k in sorted(rows)], scheduler.n_generated, run_s, scheduler.compile_s,
                         scheduler.n_slots, scheduler.rounds)
