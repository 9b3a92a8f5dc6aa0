"""Streaming perplexity: the NLL of the first N tokens of a text, streamed through the cache.

    python scripts/eval_stream.py --policy full --tokens 2048 --json
    python scripts/eval_stream.py --policy rsqr --tokens 4096 --window 256 --sinks 4 --delta 8 --chunk 1
"""

from __future__ import annotations

import json

from rsqr_jax.cli.args import (DEFAULT_TEXT, Parser, add_model_args, add_policy_args, check_cache_fits, check_model_args,
                     cold_store_from_args, load_model_from_args, model_label, policy_from_args, run_main)


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="UTF-8 text file (default: Frankenstein)")
    p.add_argument("--tokens", type=int, default=2048, help="number of tokens to score")
    p.add_argument("--chunk", type=int, default=1, help="tokens per step (1 = exact token-by-token eviction)")
    p.add_argument("--segment", type=int, default=256, help="tokens per jitted call (progress granularity)")
    p.add_argument("--bucket", type=int, default=1000, help="tokens per point of the perplexity curve")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default=None, metavar="DIR", help="write DIR/eval_stream.json, eval_stream.md, nll.npy")
    p.add_argument("--save-nll", default=None, metavar="PATH", help="write the per-token NLL (float32 .npy)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_policy_args(p, default_policy="rsqr")
    add_model_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from rsqr_jax.eval.perplexity import Model, StreamConfig, check_text, run_stream

    args = build_parser().parse_args(argv)
    check_model_args(args)
    cold = cold_store_from_args(args)  # one-line errors for impossible recall flags, before anything loads
    config = StreamConfig(args.text, policy_from_args(args), args.policy, tokens=args.tokens, chunk=args.chunk,
                          segment=args.segment, bucket=args.bucket, **({"cold": cold} if cold else {}))
    check_text(args.text)  # fail before loading the model
    loaded, apply_fn, params = load_model_from_args(args)
    model = Model(apply_fn, params, loaded.config, loaded.tokenizer, args.dtype, model_label(args))
    result = run_stream(config, model, check_memory=check_cache_fits, show_progress=not args.no_progress)
    if args.save_nll:
        result.save_nll(args.save_nll)
    if args.out:
        result.write(args.out)
    print(json.dumps(result.summary) if args.json else result.text(), end="" if not args.json else "\n")
    return 0


def run() -> None:
    """The console entry point `rsqr-eval-stream`: main() as a process (one-line errors, exit status)."""
    run_main(main)


if __name__ == "__main__":
    run()
