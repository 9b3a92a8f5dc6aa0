#!/usr/bin/env python3
"""Benchmark: 8 policies vmapped in one run vs the same 8 run one after another.

Both arms stream the same tokens through the same engine (the vmapped arm via rsqr_jax.sweep.sweep_nll,
the sequential arm one policy at a time with the same union CacheSpec, so it compiles once too), each in
its own subprocess (this script with --arm), so its peak RSS is its own; compilation is excluded. Prints
a table and writes DIR/bench_sweep.json (--out DIR). The logic is rsqr_lab.studies.sweep_timing.

    python scripts/bench_sweep.py                  # SmolLM2-135M, 256 tokens of Frankenstein (~minutes)
    python scripts/bench_sweep.py --tokens 512
    python scripts/bench_sweep.py --quick          # tiny random model, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from rsqr_jax.cli.args import DEFAULT_TEXT, Parser, UsageError, run_main

from rsqr_lab.studies import sweep_timing as X


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default=None, help=f"policy grid (default: {X.DEFAULT_GRID!r}, 8 policies)")
    p.add_argument("--tokens", type=int, default=None, help="tokens to stream (default 256; --quick 96)")
    p.add_argument("--text", default=str(DEFAULT_TEXT))
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    p.add_argument("--chunk", type=int, default=1)
    p.add_argument("--segment", type=int, default=None, help="tokens per jitted call (default 128; --quick 32)")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded SmolLM2-135M)")
    p.add_argument("--quick", action="store_true", help="tiny random model, short stream")
    p.add_argument("--out", default="runs", help=f"output directory (writes {X.JSON_NAME})")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--arm", choices=X.ARMS, default=None, help=argparse.SUPPRESS)  # the child process
    return p


def run_child(config: X.BenchSweepConfig, arm: str) -> None:
    """Load the model in this process and run one arm; print its result as one JSON line."""
    from rsqr_lab.studies.policy_sweep import load_tokens, quick_model

    if config.quick:
        apply_fn, params, model_config, name = quick_model(config.dtype)
        tokenizer = None
    else:
        from rsqr_jax.models.llama import load_model, split_apply

        loaded = load_model(config.model, config.dtype)
        (apply_fn, params), model_config = split_apply(loaded.model), loaded.config
        tokenizer, name = loaded.tokenizer, loaded.path
    tokens = load_tokens(None if config.quick else config.text, config.tokens, tokenizer=tokenizer,
                         vocab_size=model_config.vocab_size)
    print(json.dumps(X.run_arm(config, arm, apply_fn, params, model_config, tokens, name)))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model is not None and not os.path.exists(args.model):
        raise UsageError(f"model not found: {args.model}")
    config = X.BenchSweepConfig.make(quick=args.quick, grid=args.grid, tokens=args.tokens, segment=args.segment,
                                     chunk=args.chunk, dtype=args.dtype, text=args.text, model=args.model)
    config.validate()
    if args.arm is not None:
        run_child(config, args.arm)
        return 0
    result = X.run(config, [sys.executable, os.path.abspath(__file__)], show_progress=not args.no_progress)
    path = result.write(args.out)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(result.markdown())
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
