#!/usr/bin/env python3
"""Chat decode speed: decode.py's token-by-token reply loop against the in-process engine, side by side.

    python scripts/bench_chat.py --rounds 3 --new-tokens 96 --out runs/bench_chat   # docs/chat.md's table
    python scripts/bench_chat.py --quick                                            # one round, 16 tokens

Arms: plain rsqr and rsqr + recall (empty cold store), each through Session.generate (the engine) and
through decode.py's reply loop (one token per call, detokenized and printed with flush); and the plain rsqr
engine greedy (--temperature 0) next to the chat sampler. Ratios CLI / engine, recall / plain and
sampled / greedy are paired per round (rounds interleave every arm, in rotated order).
"""

from __future__ import annotations

import json

from rsqr_jax.cli.args import (Parser, add_model_args, add_policy_args, check_model_args, load_model_from_args,
                               policy_from_args, run_main)


def main(argv: list[str] | None = None) -> int:
    from rsqr_lab.studies import chat_timing as B

    d = B.BenchChatConfig()
    p = Parser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--prompt", default=d.prompt, help="the user turn (through the chat template)")
    p.add_argument("--system", default=None, help="system prompt (default: the template's own)")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens, help="tokens per reply (end-of-turn ignored)")
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--seed", type=int, default=d.seed, help="the sampler's seed (every arm's)")
    add_policy_args(p, flags=("window", "sinks", "delta", "max_survivors"), recall=False)
    p.add_argument("--recall-pages", type=int, default=d.recall_pages, help="pages the recall arms recall")
    p.add_argument("--cold-capacity", type=int, default=d.cold_capacity)
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk)
    p.add_argument("--quick", action="store_true", help="one round of 16 tokens (CI)")
    p.add_argument("--out", default=None, metavar="DIR", help="write DIR/bench_chat.json and .md")
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the tables")
    p.add_argument("--no-progress", action="store_true", help="(no progress bars here)")
    add_model_args(p)
    args = p.parse_args(argv)
    check_model_args(args)
    cfg = B.BenchChatConfig(args.prompt, args.system, new_tokens=args.new_tokens, rounds=args.rounds, seed=args.seed,
                            policy=policy_from_args(args, recall_pages=0),  # --recall-pages: the recall arms'
                            recall_pages=args.recall_pages, cold_capacity=args.cold_capacity,
                            page_size=args.page_size, prefill_chunk=args.prefill_chunk)
    if args.quick:
        cfg = cfg.quick()
    loaded, apply_fn, params = load_model_from_args(args)
    result = B.run(cfg, apply_fn, params, loaded.config, loaded.tokenizer)
    if args.out:
        B.write(result, args.out)
    print(json.dumps(result) if args.json else B.markdown(result), end="")
    return 0


if __name__ == "__main__":
    run_main(main)
