#!/usr/bin/env python3
"""Aggregate tokens/s of 1, 4, 16 concurrent streams (rsqr_jax.streams), side by side in one run.

    python scripts/bench_streams.py                              # rsqr, 128-token prompts, 64 new tokens each
    python scripts/bench_streams.py --streams 1 4 16 32 --policy streamingllm
    python scripts/bench_streams.py --quick                      # tiny sanity run (1 and 4 streams)
    python scripts/bench_streams.py --join 512 --streams 2 4 8   # a 512-token prompt joins generating streams:
                                                                 # prefill-first vs interleaved, longest stall

Prints a table (the ratio of each row to 1 stream); writes DIR/bench_streams.json and bench_streams.md
(--out DIR, '' = nothing); --json prints the JSON on stdout. The loop: lab/rsqr_lab/studies/streams_timing.py.
"""

from __future__ import annotations

import json

from rsqr_jax.cli.args import (DEFAULT_TEXT, Parser, add_model_args, add_policy_args, check_model_args, load_model_from_args,
                     policy_from_args, run_main, status)


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16], help="concurrent stream counts")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per stream")
    p.add_argument("--new", type=int, default=64, help="greedy tokens generated per stream")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per row (the best is reported)")
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--gen-block", type=int, default=16, help="generation steps per compiled block")
    p.add_argument("--join", type=int, default=0, metavar="TOKENS",
                   help="the join-stall mode: a prompt of TOKENS tokens joins the other streams while they generate")
    p.add_argument("--quick", action="store_true", help="tiny run: 1 and 4 streams, 16-token prompts, 8 new tokens")
    p.add_argument("--text", default=str(DEFAULT_TEXT))
    p.add_argument("--out", default="runs/bench_streams", help="output directory ('' = write nothing)")
    p.add_argument("--json", action="store_true", help="print the result JSON on stdout")
    p.add_argument("--no-progress", action="store_true", help="accepted for the common convention (no bars here)")
    add_policy_args(p, default_policy="rsqr")
    add_model_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_model_args(args)
    from rsqr_lab.studies import streams_timing as B

    config = B.BenchStreamsConfig(text=args.text, streams=tuple(args.streams), prompt_len=args.prompt_len,
                                  new=args.new, repeats=args.repeats, prefill_chunk=args.prefill_chunk,
                                  policy=policy_from_args(args, recall_pages=0),  # no cold store here
                                  dtype=args.dtype, gen_block=args.gen_block, join_len=args.join)
    config = config.quick() if args.quick else config
    config.check()  # before the model loads
    loaded, apply_fn, params = load_model_from_args(args)
    status(f"model {loaded.path} loaded; policy {args.policy}, {args.dtype}")
    meta = {k: getattr(args, k) for k in ("quick", "out", "model", "kernel")}
    result = B.run(config, apply_fn, params, loaded.config, loaded.tokenizer, meta=meta)
    print(json.dumps(result.data) if args.json else result.markdown())
    if args.out:
        result.write(args.out)
    return 0


if __name__ == "__main__":
    run_main(main)
