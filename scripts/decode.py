#!/usr/bin/env python3
"""Stream a generation (or a multi-turn chat) through a bounded KV cache.

    python scripts/decode.py --policy rsqr                  # built-in demo: a chat longer than the cache
    python scripts/decode.py --policy full --chat --prompt "What is the capital of France?" --json
    python scripts/decode.py --chat                         # multi-turn chat, one user turn per stdin line
    python scripts/decode.py --chat --prompt "Hi, I am Ada." --save ada.session
    python scripts/decode.py --resume ada.session --prompt "What is my name?"   # continue that session
    python scripts/decode.py --prompts-jsonl prompts.jsonl --json   # every prompt at once, one stream each

--save PATH writes the whole session (cache, counters, policy, sampler state, chat transcript) after
every turn, atomically. --resume PATH continues a saved session: the prompt (or the stdin lines) is fed
after the saved state; policy, cache, sampler and model settings come from the file, and an explicitly
given flag that conflicts with them is an error.

--prompts-jsonl FILE generates every request of FILE ({"prompt": ..., "max_new_tokens": ..., "chat": ...}
per line) concurrently on --streams slots (rsqr_jax.streams) and prints one line per prompt as it
finishes (one JSON object with --json); greedy outputs equal those of --prompt for each prompt alone.

Tokens stream to stdout (to stderr with --json, whose stdout is one JSON object); status to stderr.
The loop lives in rsqr_jax/experiments/chat.py.
"""

from __future__ import annotations

import json
import os
import sys
import time

from _common import (Parser, UsageError, add_model_args, add_policy_args, check_cache_fits, check_model_args,
                     cold_store_args, policy_from_args, resolve_recall_default, run_main, status)


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
    p.add_argument("--out", default=None, metavar="DIR", help="write the JSON result to DIR/decode.json")
    p.add_argument("--no-progress", action="store_true", help="accepted for the common convention (no bars here)")
    p.add_argument("--save", default=None, metavar="PATH", help="save the session to PATH after every turn")
    p.add_argument("--resume", default=None, metavar="PATH", help="continue the session saved in PATH")
    p.add_argument("--prompts-jsonl", default=None, metavar="FILE",
                   help="generate every prompt of FILE (one JSON object per line) concurrently")
    p.add_argument("--streams", type=int, default=16, help="--prompts-jsonl: concurrent streams (cache slots)")
    p.add_argument("--max-len", type=int, default=0,
                   help="--prompts-jsonl with --policy full: positions each stream's cache holds (default: what "
                        "the longest request needs, at most the model's context)")
    add_policy_args(p, default_policy="rsqr", recall_by_default=True)
    add_model_args(p)  # its --dtype is the KV cache dtype here (kept for compatibility)
    p.add_argument("--cache-dtype", default=None,
                   help="KV cache dtype, float32 (default) or bfloat16; --dtype is the same setting")
    p.add_argument("--weights-dtype", default="auto",
                   help="float32, bfloat16 or auto (default): float32 on CPU, where bfloat16 weights decode "
                        "4-5x slower; the cache dtype on GPU/TPU")
    return p


def main() -> int:
    from rsqr_jax.experiments import chat

    parser = build_parser()
    args = parser.parse_args()
    given = chat.given_flags(parser, sys.argv[1:])
    check_model_args(args)
    args.cache_dtype = args.dtype = chat.cache_dtype(args.dtype, args.cache_dtype, args.weights_dtype,
                                                     dtype_given="dtype" in given)
    if args.model is not None:
        args.model = os.path.abspath(args.model)  # the model identity a saved session records
    chat.check_generation(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          seed=args.seed, prefill_chunk=args.prefill_chunk)
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
    resolve_recall_default(args)
    prompt = chat.read_prompt(args.prompt, args.prompt_file)
    policy = policy_from_args(args)

    import jax

    from models.llama import LoadedModel, load_model, split_apply
    from models.loading import default_model_path, load_config
    from rsqr_jax.session import Session, SessionFileError, check_identity
    from rsqr_jax.spec import CacheSpec

    weights_dtype = chat.resolve_weights_dtype(args.weights_dtype, args.cache_dtype, jax.default_backend())
    # Checks that need only the model's config (fast), before the tokenizer and weights are loaded.
    model_path = args.model if args.model is not None else default_model_path()
    cfg = load_config(model_path)
    chunk = min(args.prefill_chunk, args.window) if args.policy != "full" else args.prefill_chunk
    sizes = dict(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                 dtype=args.cache_dtype, max_chunk=chunk, **cold_store_args(args))
    if header is not None:
        try:  # the identity the loaded model will have (checked again by Session.load)
            check_identity(args.resume, header["identity"], LoadedModel(cfg, None, model_path, weights_dtype).identity)
        except SessionFileError as e:
            raise UsageError(str(e)) from None
    elif args.policy != "full":  # `full` is sized by the prompt: checked once it is tokenized
        check_cache_fits(CacheSpec.for_policies(policy, **sizes).bytes_by_part(policy)["total"])

    t_load = time.perf_counter()
    loaded = load_model(args.model, weights_dtype)
    apply_fn, params = split_apply(loaded.model, kernel=args.kernel)
    tok, cfg = loaded.tokenizer, loaded.config
    dtypes = weights_dtype if weights_dtype == args.cache_dtype else f"{weights_dtype} weights, {args.cache_dtype} cache"
    status(f"model {loaded.path} ({cfg.arch}, {cfg.num_layers} layers, {dtypes}) loaded in "
           f"{time.perf_counter() - t_load:.1f}s; policy {policy.name}")

    turns, is_chat = chat.plan_turns(prompt, args.chat, resumed=header is not None)
    if header is None:
        spec = CacheSpec.for_policies(policy, **sizes, max_len=chat.full_max_len(tok, turns, args.max_new_tokens))
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

    config = chat.ChatConfig(turns, is_chat, args.max_new_tokens, save=args.save)
    result = chat.run(config, session, tok, identity=loaded.identity, out=sys.stderr if args.json else sys.stdout)
    status(f"session: {session.n_tokens} tokens through a cache of "
           f"{spec.win_capacity} window + {spec.surv_capacity} survivor slots; {result.n_prompt_tokens} prompt "
           f"tokens, {result.n_generated} generated at {result.tokens_per_s:.1f} tok/s; "
           f"prefill {result.prefill_s:.2f}s")
    extra = dict(cache_bytes=cache_bytes, policy=args.policy, policy_name=policy.name, dtype=args.cache_dtype,
                 model=loaded.path, weights_dtype=weights_dtype, cache_dtype=args.cache_dtype)
    if args.out is not None:
        result.write(args.out, **extra)
    if args.json:
        print(json.dumps(result.to_json(**extra)))
    return 0


def main_jsonl(args) -> int:
    """--prompts-jsonl: every request checked before the model loads, then all generated concurrently."""
    from rsqr_jax.experiments import chat
    from rsqr_jax.experiments.common import ConfigError

    for flag, given in (("--prompt", args.prompt), ("--prompt-file", args.prompt_file), ("--save", args.save),
                        ("--resume", args.resume)):
        if given is not None:
            raise UsageError(f"--prompts-jsonl runs its own prompts: {flag} cannot be combined with it")
    if args.streams < 1:
        raise UsageError(f"--streams must be positive, got {args.streams}")
    if args.max_len < 0:
        raise UsageError(f"--max-len must be >= 0, got {args.max_len}")
    lines = chat.read_prompts_jsonl(args.prompts_jsonl, max_new_tokens=args.max_new_tokens, chat=args.chat)
    resolve_recall_default(args)
    policy = policy_from_args(args)

    import jax

    from models.llama import load_model, split_apply
    from rsqr_jax.spec import CacheSpec
    from rsqr_jax.streams import StreamScheduler

    weights_dtype = chat.resolve_weights_dtype(args.weights_dtype, args.cache_dtype, jax.default_backend())
    t_load = time.perf_counter()
    loaded = load_model(args.model, weights_dtype)
    apply_fn, params = split_apply(loaded.model, kernel=args.kernel)
    tok, cfg = loaded.tokenizer, loaded.config
    status(f"model {loaded.path} loaded in {time.perf_counter() - t_load:.1f}s; policy {policy.name}; "
           f"{len(lines)} prompts")
    chunk = min(args.prefill_chunk, args.window) if args.policy != "full" else args.prefill_chunk
    max_len = chat.streams_max_len(tok, lines, args.max_len or cfg.max_position_embeddings)
    spec = CacheSpec.for_policies(policy, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                  head_dim=cfg.head_dim, dtype=args.cache_dtype, max_chunk=chunk, max_len=max_len,
                                  **cold_store_args(args))
    n_slots = min(args.streams, len(lines))
    check_cache_fits(n_slots * spec.bytes_by_part(policy)["total"])
    sched = StreamScheduler(apply_fn, params, spec, policy, n_slots=n_slots, prefill_chunk=chunk,
                            temperature=args.temperature, top_p=args.top_p, eos_ids=cfg.eos_token_ids,
                            vocab_size=cfg.vocab_size)
    sched.warmup()
    status(f"compiled the {n_slots}-stream prefill + generation block in {sched.compile_s:.1f}s")

    def emit(row: dict) -> None:
        if args.json:
            print(json.dumps(row), flush=True)
        elif "error" in row:
            print(f"[line {row['line']}] error: {row['error']}", flush=True)
        else:
            print(f"[line {row['line']}] {row['text']}", flush=True)

    result = chat.run_prompts(lines, sched, tok, emit=emit, seed=args.seed)
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


if __name__ == "__main__":
    run_main(main)
