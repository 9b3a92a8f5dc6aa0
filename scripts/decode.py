#!/usr/bin/env python3
"""Stream a generation (or a multi-turn chat) through a bounded KV cache.

    python scripts/decode.py --policy rsqr                  # built-in demo: a chat longer than the cache
    python scripts/decode.py --policy full --chat --prompt "What is the capital of France?" --json
    python scripts/decode.py --chat                         # multi-turn chat, one user turn per stdin line
    python scripts/decode.py --chat --prompt "Hi, I am Ada." --save ada.session
    python scripts/decode.py --resume ada.session --prompt "What is my name?"   # continue that session

--save PATH writes the whole session (cache, counters, policy, sampler state, chat transcript) after
every turn, atomically. --resume PATH continues a saved session: the prompt (or the stdin lines) is fed
after the saved state; policy, cache, sampler and model settings come from the file, and an explicitly
given flag that conflicts with them is an error.

Tokens stream to stdout (to stderr with --json, whose stdout is one JSON object); status to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from _common import (Parser, UsageError, add_model_args, add_policy_args, check_cache_fits, check_model_args,
                     load_model_from_args, policy_from_args, run_main, status)

DEMO_TURNS = [
    "Hi! My name is Ada and I keep bees on a rooftop in Lisbon. Give me three tips for a beginner beekeeper.",
    "Which flowers should I plant nearby so my bees have food all year?",
    "How can I tell whether a hive is healthy?",
    "Write a short poem about bees waking up at sunrise.",
    "What is the capital of France?",
    "Explain in two sentences why bees dance.",
    "Remind me: what is my name, and where do I keep my bees?",
]


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", default=None, help="prompt text")
    p.add_argument("--prompt-file", default=None, help="read the prompt from a file")
    p.add_argument("--chat", action="store_true", help="use the chat template (multi-turn from stdin without a prompt)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print one JSON object with the result and figures")
    p.add_argument("--save", default=None, metavar="PATH", help="save the session to PATH after every turn")
    p.add_argument("--resume", default=None, metavar="PATH", help="continue the session saved in PATH")
    add_policy_args(p, default_policy="rsqr")
    add_model_args(p)
    return p


class ChatFeed:
    """Turns a growing conversation into the exact text still to feed, via the model's chat template."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.messages: list[dict] = []
        self.fed_text = ""

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


def explicit_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of the flags actually given on the command line (not left at their defaults)."""
    saved = {id(a): a.default for a in parser._actions}
    try:
        for a in parser._actions:
            a.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for a in parser._actions:
            a.default = saved[id(a)]


def check_save_path(path: str) -> None:
    """Fail before any work if PATH cannot be written (the write itself is atomic: session.write_session_file)."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"--save {path}: is a directory")
    if not os.path.isdir(directory):
        raise UsageError(f"--save {path}: directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"--save {path}: directory {directory} is not writable")


# decode.py flag -> where its value lives in a session file header
_POLICY_FLAGS = {"window": "window", "sinks": "n_sink", "delta": "delta", "max_survivors": "max_survivors",
                 "block": "block"}


def apply_resume(args, header: dict, given: set[str]) -> None:
    """Take policy, cache, sampler and model settings from a session header; explicit conflicting flags -> error."""
    from rsqr_jax.policy import MODES, OVERFLOWS

    pol = header["policy"]
    saved = {"policy": MODES[pol["mode"]], "overflow": OVERFLOWS[pol["overflow"]],
             **{flag: pol[key] for flag, key in _POLICY_FLAGS.items()},
             "prefill_chunk": header["prefill_chunk"], "temperature": header["temperature"],
             "top_p": header["top_p"], "seed": header["seed"], "dtype": header["identity"].get("dtype"),
             "chat": bool(header["extra"].get("chat", False))}
    for dest, value in saved.items():
        if dest in given and getattr(args, dest) != value and not (dest == "chat" and value):
            flag = "--" + dest.replace("_", "-")
            shown = "" if dest == "chat" else f" {getattr(args, dest)}"
            raise UsageError(f"{flag}{shown} conflicts with the resumed session ({dest} = {value})")
        setattr(args, dest, value)
    path = header["identity"].get("path")
    if args.model is None:
        args.model = path
    elif os.path.abspath(args.model) != path:
        raise UsageError(f"--model {args.model} conflicts with the resumed session (saved with {path})")


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    given = explicit_dests(parser, sys.argv[1:])
    check_model_args(args)
    if args.model is not None:
        args.model = os.path.abspath(args.model)  # the model identity a saved session records
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.seed < 2**32:
        raise UsageError(f"--seed must be in [0, 2**32), got {args.seed}")
    if args.prefill_chunk < 1:
        raise UsageError(f"--prefill-chunk must be positive, got {args.prefill_chunk}")
    if args.save is not None:
        check_save_path(args.save)
    header = None
    if args.resume is not None:
        from rsqr_jax.session import Session, SessionFileError

        try:
            header = Session.read_header(args.resume)
        except SessionFileError as e:
            raise UsageError(str(e)) from None
        apply_resume(args, header, given)
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("give --prompt or --prompt-file, not both")
    prompt = args.prompt
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompt = f.read()
        except UnicodeDecodeError as e:
            raise UsageError(f"prompt file {args.prompt_file} is not UTF-8 (byte {e.start})") from None
        except OSError as e:
            raise UsageError(f"cannot read prompt file {args.prompt_file}: {e.strerror}") from None
        if not prompt.strip():
            raise UsageError(f"prompt file {args.prompt_file} is empty")
    if prompt is not None and not prompt.strip():
        raise UsageError("--prompt is empty")
    policy = policy_from_args(args)
    demo = prompt is None and not args.chat and header is None

    from models.llama import LoadedModel
    from models.loading import default_model_path, load_config
    from rsqr_jax.spec import CacheSpec
    from rsqr_jax.session import Session, SessionFileError, check_identity

    # Checks that need only the model's config (fast), before the tokenizer and weights are loaded.
    model_path = args.model if args.model is not None else default_model_path()
    cfg = load_config(model_path)
    chunk = min(args.prefill_chunk, args.window) if args.policy != "full" else args.prefill_chunk
    if header is not None:
        try:  # the identity the loaded model will have (checked again by Session.load)
            check_identity(args.resume, header["identity"], LoadedModel(cfg, None, model_path, args.dtype).identity)
        except SessionFileError as e:
            raise UsageError(str(e)) from None
    elif args.policy != "full":  # `full` is sized by the prompt: checked once it is tokenized
        check_cache_fits(CacheSpec.for_policies(policy, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                                head_dim=cfg.head_dim, dtype=args.dtype,
                                                max_chunk=chunk).bytes_by_part(policy)["total"])

    t_load = time.perf_counter()
    loaded, apply_fn, params = load_model_from_args(args)
    tok, cfg = loaded.tokenizer, loaded.config
    status(f"model {loaded.path} ({cfg.arch}, {cfg.num_layers} layers, {args.dtype}) loaded in "
           f"{time.perf_counter() - t_load:.1f}s; policy {policy.name}")

    if demo:
        turns = DEMO_TURNS
        chat = True
    elif prompt is not None:
        turns, chat = [prompt], args.chat
    else:
        turns, chat = None, True if header is None else args.chat  # lines from stdin
    # `full` must hold the whole session: size it to what this run can reach, no more (attention pays for it).
    prompt_bound = sum(len(tok.encode(t)) + 64 for t in turns) if turns else 4096
    n_turns = len(turns) if turns else 16
    max_len = prompt_bound + n_turns * (args.max_new_tokens + 8)
    max_len = -(-max_len // 64) * 64
    if header is None:
        spec = CacheSpec.for_policies(policy, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                      head_dim=cfg.head_dim, dtype=args.dtype, max_chunk=chunk, max_len=max_len)
        check_cache_fits(spec.bytes_by_part(policy)["total"])
        session = Session(apply_fn, params, spec, policy, prefill_chunk=chunk, temperature=args.temperature,
                          top_p=args.top_p, seed=args.seed, eos_ids=cfg.eos_token_ids, vocab_size=cfg.vocab_size)
    else:
        try:
            session = Session.load(args.resume, apply_fn, params, loaded.identity, policy=policy)
        except SessionFileError as e:
            raise UsageError(str(e)) from None
        spec = session.spec
        status(f"resumed {args.resume}: {session.n_tokens} tokens so far")
    cache_bytes = spec.bytes_by_part(policy)
    status(f"cache budget {cache_bytes['total'] / 2**20:.1f} MiB " +
           ", ".join(f"{k} {v / 2**20:.2f}" for k, v in cache_bytes.items() if k != "total" and v))
    session.warmup()
    status(f"compiled prefill + decode steps in {session.compile_s:.1f}s")

    out = sys.stderr if args.json else sys.stdout
    feeder = ChatFeed(tok) if chat else None
    if feeder is not None and header is not None:
        feeder.messages = list(session.extra.get("messages", []))
        feeder.fed_text = session.extra.get("fed_text", "")
    replies, n_prompt, n_gen, prefill_s, decode_s = [], 0, 0, 0.0, 0.0

    def run_turn(user_text: str) -> None:
        nonlocal n_prompt, n_gen, prefill_s, decode_s
        ids = feeder.user_turn(user_text) if chat else tok.encode(user_text)
        if chat:
            print(f"\n>>> {user_text}", file=out, flush=True)
        t0 = time.perf_counter()
        try:
            session.feed(ids)
        except ValueError as e:  # e.g. a resumed `full` session whose cache is full
            raise UsageError(str(e)) from None
        prefill_s += time.perf_counter() - t0
        n_prompt += len(ids)
        reply: list[int] = []
        printed = ""

        def on_token(t: int) -> None:
            nonlocal printed
            reply.append(t)
            text = tok.decode(reply, skip_special_tokens=True)
            print(text[len(printed):], end="", file=out, flush=True)
            printed = text

        t0 = time.perf_counter()
        session.generate(args.max_new_tokens, on_token)
        decode_s += time.perf_counter() - t0
        print(file=out, flush=True)
        n_gen += len(reply)
        text = tok.decode(reply, skip_special_tokens=True)
        replies.append(text)
        if chat:
            feeder.assistant_reply(text)
        if args.save is not None:
            extra = ({"chat": True, "messages": feeder.messages, "fed_text": feeder.fed_text} if chat
                     else {"chat": False})
            try:
                session.save(args.save, loaded.identity, extra=extra)
            except SessionFileError as e:
                raise UsageError(str(e)) from None

    if turns is None:
        for line in sys.stdin:
            if line.strip():
                run_turn(line.strip())
    else:
        for turn in turns:
            run_turn(turn)

    tps = n_gen / decode_s if decode_s > 0 else float("nan")
    status(f"session: {session.n_tokens} tokens through a cache of "
           f"{spec.win_capacity} window + {spec.surv_capacity} survivor slots; {n_prompt} prompt tokens, "
           f"{n_gen} generated at {tps:.1f} tok/s; prefill {prefill_s:.2f}s")
    if args.json:
        result = {"text": replies[-1] if len(replies) == 1 else "\n\n".join(replies), "replies": replies,
                  "n_prompt_tokens": n_prompt, "n_generated": n_gen, "tokens_per_s": tps, "prefill_s": prefill_s,
                  "compile_s": session.compile_s, "session_tokens": session.n_tokens, "cache_bytes": cache_bytes,
                  "policy": args.policy, "policy_name": policy.name, "dtype": args.dtype, "model": loaded.path}
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    run_main(main)
