"""Chat with a model through a bounded KV cache (RSQR by default), or stream one generation.

examples:
  python scripts/decode.py                                   # the memory demo: facts, many turns, then the question
  python scripts/decode.py --prompt "What is the capital of France?"
  python scripts/decode.py --chat                            # interactive chat (/reset, /exit)
  python scripts/decode.py --chat --system "You are terse." --temperature 0.3 --seed 7
  python scripts/decode.py --raw --prompt "Once upon a time" --max-new-tokens 64   # plain completion
  python scripts/decode.py --chat --save ada.session          # saved after every turn ...
  python scripts/decode.py --resume ada.session --prompt "What is my name?"        # ... and continued
  python scripts/decode.py --prompts-jsonl prompts.jsonl --json   # every prompt at once, one stream each

A prompt goes through the model's chat template when it has one (--raw: plain completion). Sampling follows
llama.cpp's chain (repeat penalty, top-k, top-p, min-p, temperature); its defaults are the model's own
generation config where its files carry one, else chat defaults for small models; --temperature 0 is
greedy. The seed is random unless --seed is given; it is printed, so any run can be repeated.

--save PATH writes the whole session (cache, counters, policy, sampler state, transcript) after every turn,
atomically; --resume PATH continues it (its settings come from the file; a conflicting flag is an error).
Tokens stream to stdout as they are generated (to stderr with --json, whose stdout is one JSON object);
status lines go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time

from rsqr_jax.api import FIRST_TURN_ROOM

from rsqr_jax.cli.args import (SAMPLING_DESTS, Parser, UsageError, add_model_args, add_policy_args, apply_preset,
                               check_cache_fits, check_model_args, check_share_layer, cold_store_args, policy_from_args,
                               run_main, status)

DEMO_MAX_NEW_TOKENS = 128




def build_parser() -> Parser:
    from rsqr_jax.cli.chat import CHAT_SAMPLING

    p = Parser(description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[1:]))
    g = p.add_argument_group("conversation")
    g.add_argument("--prompt", default=None, help="one user turn (through the chat template unless --raw)")
    g.add_argument("--prompt-file", default=None, help="read the prompt from a file")
    g.add_argument("--chat", action="store_true", help="interactive chat: one user turn per line of stdin")
    g.add_argument("--system", default=None, help="system prompt of a new chat (default: the template's own)")
    g.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    g.add_argument("--keep", type=int, default=0, metavar="N",
                   help="pin the first N tokens of the stream: kept forever, exactly, beside the sinks (llama.cpp's "
                        "--keep)")
    g.add_argument("--pin-system", action="store_true", help="pin the system prompt (as the chat template renders it)")
    g.add_argument("--pin-first-turn", action="store_true",
                   help="pin the whole first prompt: the system prompt and the first user turn")
    g.add_argument("--pin-room", type=int, default=None, metavar="N",
                   help=f"pinned tokens the cache has room for (default: what --keep and --pin-system need; "
                        f"{FIRST_TURN_ROOM} with --pin-first-turn)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a reply where TEXT appears (repeatable; the text is cut before it)")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"tokens per reply at most (default 256; the demo {DEMO_MAX_NEW_TOKENS})")
    s = p.add_argument_group("sampling (default: the model's generation config, else its preset's; shown: the "
                             "generic preset's)")
    s.add_argument("--temperature", type=float, default=None,
                   help=f"0 = greedy (default {CHAT_SAMPLING['temperature']})")
    s.add_argument("--top-k", type=int, default=None, help=f"keep the k most likely tokens, 0 = off "
                   f"(default {CHAT_SAMPLING['top_k']})")
    s.add_argument("--top-p", type=float, default=None, help=f"nucleus: the smallest set with this probability "
                   f"(default {CHAT_SAMPLING['top_p']})")
    s.add_argument("--min-p", type=float, default=None, help=f"drop tokens below min-p x the top token's "
                   f"probability (default {CHAT_SAMPLING['min_p']})")
    s.add_argument("--repeat-penalty", type=float, default=None, help=f"divide the logits of recent tokens, "
                   f"1 = off (default {CHAT_SAMPLING['repeat_penalty']})")
    s.add_argument("--repeat-last-n", type=int, default=None, help=f"recent tokens the penalties look at "
                   f"(default {CHAT_SAMPLING['repeat_last_n']})")
    s.add_argument("--presence-penalty", type=float, default=None,
                   help=f"subtracted once from every recent token (default {CHAT_SAMPLING['presence_penalty']})")
    s.add_argument("--frequency-penalty", type=float, default=None,
                   help=f"subtracted per occurrence (default {CHAT_SAMPLING['frequency_penalty']})")
    s.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one, printed)")
    o = p.add_argument_group("output and sessions")
    o.add_argument("--json", action="store_true", help="print one JSON object with the result and figures")
    o.add_argument("--out", default=None, metavar="DIR", help="write the JSON result to DIR/decode.json")
    o.add_argument("--no-progress", action="store_true", help="accepted for the common convention (no bars here)")
    o.add_argument("--save", default=None, metavar="PATH", help="save the session to PATH after every turn")
    o.add_argument("--resume", default=None, metavar="PATH", help="continue the session saved in PATH")
    o.add_argument("--prompts-jsonl", default=None, metavar="FILE",
                   help="generate every prompt of FILE (one JSON object per line) concurrently")
    o.add_argument("--streams", type=int, default=16, help="--prompts-jsonl: concurrent streams (cache slots)")
    o.add_argument("--max-len", type=int, default=0,
                   help="--prompts-jsonl with --policy full: positions each stream's cache holds (0: what "
                        "the longest request needs, at most the model's context)")
    p.add_argument("--prefill-chunk", type=int, default=None, help="prompt tokens per prefill step (default: the "
                   "preset's, 64; at most the window)")
    p.add_argument("--preset", default=None, metavar="NAME|FILE",
                   help="the defaults' preset: a shipped one by name or a .json file (default: the model's own, else "
                   "generic; rsqr_jax/presets)")
    add_policy_args(p, default_policy="rsqr", preset=True)
    add_model_args(p)  # its --dtype is the KV cache dtype here (kept for compatibility)
    p.add_argument("--cache-dtype", default=None,
                   help="KV cache dtype, float32 (default) or bfloat16; --dtype is the same setting")
    p.add_argument("--weights-dtype", default="auto",
                   help="float32, bfloat16 or auto: float32 on CPU, where bfloat16 weights decode "
                        "4-5x slower; the cache dtype on GPU/TPU")
    return p


def sampling_flags(args) -> dict:
    return {k: getattr(args, k) for k in SAMPLING_DESTS}


def main(argv: list[str] | None = None) -> int:
    from rsqr_jax import conversation
    from rsqr_jax.cli import chat

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    given = chat.given_flags(parser, argv)
    check_model_args(args)
    args.cache_dtype = args.dtype = chat.cache_dtype(args.dtype, args.cache_dtype, args.weights_dtype,
                                                     dtype_given="dtype" in given)
    if args.model is not None:
        args.model = os.path.abspath(args.model)  # the model identity a saved session records
    if args.raw and (args.chat or args.system is not None):
        raise UsageError("--raw is plain completion: it cannot be combined with --chat or --system")
    chat.check_generation(max_new_tokens=256 if args.max_new_tokens is None else args.max_new_tokens,
                          seed=args.seed, prefill_chunk=args.prefill_chunk, **sampling_flags(args))
    if any(not s for s in args.stop):
        raise UsageError("--stop needs a non-empty text")
    if args.keep < 0 or (args.pin_room is not None and args.pin_room < 0):
        raise UsageError("--keep and --pin-room must be >= 0")
    if args.raw and (args.pin_system or args.pin_first_turn):
        raise UsageError("--pin-system and --pin-first-turn need the chat template: use --keep N with --raw")
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"--out {args.out}: not a directory")
    if args.prompts_jsonl is not None:
        return main_jsonl(args)
    if args.save is not None:
        chat.check_save_path(args.save)
    header = None
    if args.resume is not None:
        from rsqr_jax.session import Session, SessionFileError

        try:
            header = Session.read_header(args.resume)
        except SessionFileError as e:
            raise UsageError(str(e)) from None
        vars(args).update(chat.apply_resume(vars(args), header, given))
    prompt = chat.read_prompt(args.prompt, args.prompt_file)
    turns = chat.plan_turns(prompt, args.chat, resumed=header is not None)
    demo = chat.DEMO if turns is chat.DEMO.turns else None
    if args.max_new_tokens is None and demo:
        args.max_new_tokens = DEMO_MAX_NEW_TOKENS

    import jax

    from rsqr_jax.api import Model, resolve_weights_dtype
    from rsqr_jax.models.llama import LoadedModel, load_model
    from rsqr_jax.models.loading import default_model_path, load_config
    from rsqr_jax.session import Session, SessionFileError, check_identity
    from rsqr_jax.spec import CacheSpec

    # Checks that need only the model's config (fast), before the tokenizer and weights are loaded.
    model_path = args.model if args.model is not None else default_model_path()
    cfg = load_config(model_path)
    settings = apply_preset(args, cfg, model_path, extra=(*SAMPLING_DESTS, "prefill_chunk", "max_new_tokens",
                                                          "cache_dtype"))
    args.dtype = args.cache_dtype
    policy = policy_from_args(args)
    pins = conversation.Pins(args.keep, args.pin_system, args.pin_first_turn)
    if (pins or args.pin_room) and args.policy in ("full", "window"):
        raise UsageError(f"--policy {args.policy} keeps no pinned tokens (full keeps everything, window only the "
                         f"last W): pin under a policy with sinks")
    weights_dtype = resolve_weights_dtype(args.weights_dtype, args.cache_dtype, jax.default_backend())
    check_share_layer(args, cfg)
    chunk = settings.chunk
    sizes = dict(dims=cfg, dtype=args.cache_dtype, max_chunk=chunk, **cold_store_args(args))
    if header is not None:
        try:  # the identity the loaded model will have (checked again by Session.load)
            check_identity(args.resume, header["identity"], LoadedModel(cfg, None, model_path, weights_dtype).identity)
        except SessionFileError as e:
            raise UsageError(str(e)) from None
    elif args.policy != "full":  # `full` is sized by the prompt: checked once it is tokenized
        check_cache_fits(CacheSpec.for_policies(policy, **sizes).bytes_by_part(policy)["total"])

    status(f"loading {os.path.basename(model_path)} ...")
    t_load = time.perf_counter()
    loaded = load_model(args.model, weights_dtype, weight_format=args.weight_format)
    model = Model(loaded, None, args.kernel)
    tok, cfg = loaded.tokenizer, loaded.config
    dtypes = weights_dtype if weights_dtype == args.cache_dtype else f"{weights_dtype} weights, {args.cache_dtype} cache"
    status(f"model {loaded.path} ({cfg.arch}, {cfg.num_layers} layers, {dtypes}) loaded in "
           f"{time.perf_counter() - t_load:.1f}s; preset {settings.preset}; policy {policy.name}")

    if header is None:
        is_chat = not args.raw and conversation.has_chat_template(tok)
        if args.system is not None and not is_chat:
            raise UsageError(f"--system needs a chat template, and {os.path.basename(model_path)} has none")
        system = args.system if args.system is not None else (chat.DEMO.system if demo else None)
        values = settings.sampling
        seed = chat.draw_seed() if args.seed is None else args.seed
        if pins and not is_chat and (pins.system or pins.first_turn):
            raise UsageError(f"--pin-system and --pin-first-turn need a chat template, and "
                             f"{os.path.basename(model_path)} has none")
        try:
            room = args.pin_room if args.pin_room is not None else pins.room(tok, system, FIRST_TURN_ROOM)
        except ValueError as e:
            raise UsageError(f"--pin-system: {e}") from None
        max_len = chat.full_max_len(tok, turns, args.max_new_tokens, system)
        spec = CacheSpec.for_policies(policy, **sizes, pins=room, max_len=max_len)
        check_cache_fits(spec.bytes_by_part(policy)["total"])
        session = model.session(settings=settings, seed=seed, pins=room, max_len=max_len)
        assert session.spec == spec
    else:
        apply_fn, params = loaded.split(args.kernel)
        try:
            session = Session.load(args.resume, apply_fn, params, loaded.identity, policy=policy)
        except SessionFileError as e:
            raise UsageError(str(e)) from None
        spec, is_chat, system = session.spec, bool(header["extra"].get("chat")), None
        pins = conversation.Pins(**header["extra"].get("pins", {}))
        values, seed = session.sampling.to_json(), session.seed
        status(f"resumed {args.resume}: {session.n_tokens} tokens so far")
    status(chat.describe_cache(spec, policy))
    status(chat.describe_sampling(values, seed))
    status("compiling the prefill and decode steps for this cache (once per configuration) ...")
    session.warmup()
    status(f"compiled in {session.compile_s:.1f}s")
    if jax.default_backend() == "cpu":
        from rsqr_jax.kernels.cpu_status import status_line

        status(status_line())
    if turns is None and sys.stdin.isatty():
        status("chat: type a message and press Enter; /reset forgets the conversation, /exit (or Ctrl-D) ends it")

    config = chat.ChatConfig(turns, is_chat, args.max_new_tokens, save=args.save, system=system,
                             stop=tuple(args.stop), demo=demo, pins=pins)
    result = chat.run(config, session, tok, identity=loaded.identity, out=sys.stderr if args.json else sys.stdout,
                      status=status)
    stops = ", ".join(f"{n} {k}" for k, n in sorted({s: result.stops.count(s) for s in result.stops}.items()))
    status(f"session: {session.n_tokens} tokens, {result.n_prompt_tokens} prompt + {result.n_generated} generated "
           f"at {result.tokens_per_s:.1f} tok/s (prefill {result.prefill_s:.2f}s); replies ended by: {stops or 'none'}")
    extra = dict(cache_bytes=spec.bytes_by_part(policy), policy=args.policy, policy_name=policy.name,
                 dtype=args.cache_dtype, model=loaded.path, weights_dtype=weights_dtype, cache_dtype=args.cache_dtype,
                 seed=seed, sampling=values, chat=is_chat, preset=settings.preset)
    if args.out is not None:
        result.write(args.out, **extra)
    if args.json:
        print(json.dumps(result.to_json(**extra)))
    return 0


def main_jsonl(args) -> int:
    """--prompts-jsonl: every request checked before the model loads, then all generated concurrently."""
    from rsqr_jax import conversation
    from rsqr_jax.cli import chat
    from rsqr_jax.eval.runtime import ConfigError

    for flag, given in (("--prompt", args.prompt), ("--prompt-file", args.prompt_file), ("--save", args.save),
                        ("--resume", args.resume)):
        if given is not None:
            raise UsageError(f"--prompts-jsonl runs its own prompts: {flag} cannot be combined with it")
    if args.streams < 1:
        raise UsageError(f"--streams must be positive, got {args.streams}")
    if args.max_len < 0:
        raise UsageError(f"--max-len must be >= 0, got {args.max_len}")
    if args.stop:
        raise UsageError("--stop is for --prompt and chat turns, not --prompts-jsonl")
    from rsqr_jax.models.loading import default_model_path, load_config

    model_path = args.model if args.model is not None else default_model_path()
    settings = apply_preset(args, load_config(model_path), model_path,
                            extra=(*SAMPLING_DESTS, "prefill_chunk", "max_new_tokens", "cache_dtype"))
    lines = chat.read_prompts_jsonl(args.prompts_jsonl, max_new_tokens=args.max_new_tokens, chat=not args.raw)

    import jax

    from rsqr_jax.api import resolve_weights_dtype, sampling_of
    from rsqr_jax.models.llama import load_model
    from rsqr_jax.spec import CacheSpec
    from rsqr_jax.streams import StreamScheduler

    args.dtype = args.cache_dtype
    policy = policy_from_args(args)
    weights_dtype = resolve_weights_dtype(args.weights_dtype, args.cache_dtype, jax.default_backend())
    t_load = time.perf_counter()
    loaded = load_model(args.model, weights_dtype, weight_format=args.weight_format)
    apply_fn, params = loaded.split(args.kernel)
    tok, cfg = loaded.tokenizer, loaded.config
    check_share_layer(args, cfg)
    status(f"model {loaded.path} loaded in {time.perf_counter() - t_load:.1f}s; preset {settings.preset}; policy "
           f"{policy.name}; {len(lines)} prompts")
    if not conversation.has_chat_template(tok):  # plain completion for every line on a model without a template
        import dataclasses

        lines = [dataclasses.replace(pl, chat=False) for pl in lines]
    values = settings.sampling
    seed = chat.draw_seed() if args.seed is None else args.seed
    status(chat.describe_sampling(values, seed))
    chunk = settings.chunk
    max_len = chat.streams_max_len(tok, lines, args.max_len or cfg.max_position_embeddings)
    spec = CacheSpec.for_policies(policy, dims=cfg, dtype=args.cache_dtype, max_chunk=chunk, max_len=max_len,
                                  **cold_store_args(args))
    n_slots = min(args.streams, len(lines))
    check_cache_fits(n_slots * spec.bytes_by_part(policy)["total"])
    sched = StreamScheduler(apply_fn, params, spec, policy, n_slots=n_slots, prefill_chunk=chunk,
                            sampling=sampling_of(settings), eos_ids=cfg.eos_token_ids, vocab_size=cfg.vocab_size)
    sched.warmup()
    status(f"compiled the {n_slots}-stream prefill + generation block in {sched.compile_s:.1f}s")

    def emit(row: dict) -> None:
        if args.json:
            print(json.dumps(row), flush=True)
        elif "error" in row:
            print(f"[line {row['line']}] error: {row['error']}", flush=True)
        else:
            print(f"[line {row['line']}] {row['text']}", flush=True)

    result = chat.run_prompts(lines, sched, tok, emit=emit, seed=seed, sampling=values, system=args.system)
    status(f"{len(lines)} prompts on {n_slots} streams: {result.n_generated} tokens in {result.run_s:.2f}s "
           f"({result.tokens_per_s:.1f} tok/s aggregate, {result.rounds} rounds)")
    if args.out is not None:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in result.rows)
    if result.errors:  # the other prompts ran and printed; the refused ones are named in one line
        bad = result.errors
        raise ConfigError(f"{len(bad)} of {len(lines)} prompts refused: line {bad[0]['line']}: {bad[0]['error']}"
                          + (f" (and lines {', '.join(str(r['line']) for r in bad[1:])})" if len(bad) > 1 else ""))
    return 0


def run() -> None:
    """The console entry point `rsqr-decode`: main() as a process (one-line errors, exit status)."""
    run_main(main)


if __name__ == "__main__":
    run()
