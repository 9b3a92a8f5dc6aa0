#!/usr/bin/env python3
"""Soak test: stream a long text token by token through bounded caches and check that nothing drifts.

Policies (default): rsqr (W=512, N=4, delta=8, S_max=64) and streamingllm (N=4, W=512), one token per
step, Frankenstein cycled as the stream, every token scored. The KV cache is bfloat16 (--cache-dtype);
the weights are float32 (--dtype): XLA:CPU runs bfloat16 matmuls ~9x slower than float32, which would
put 100k steps out of reach. Criteria and verdict: rsqr_lab.studies.soak.

    python scripts/exp_soak.py --tokens 100000            # the full soak (79 min on 2 shared cores)
    python scripts/exp_soak.py --tokens 20000 --out runs/soak_20k
    python scripts/exp_soak.py --tiny --tokens 5000       # CI version: tiny random model, the real tokenizer

Writes DIR/soak.json (also at every checkpoint: a killed run keeps its partial verdict), soak.md and
soak.png (--out DIR); --json prints the JSON on stdout. Exit 0 PASS, 1 FAIL, 130 interrupted.
"""

from __future__ import annotations

import json
import os

from rsqr_jax.cli.args import (DEFAULT_TEXT, Parser, UsageError, add_model_args, add_policy_args, check_model_args,
                               load_model_from_args, policy_from_args, run_main)

from rsqr_lab.studies import soak as S
from rsqr_jax.eval.runtime import status


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=100_000, help="stream length (tokens fed, one per step)")
    p.add_argument("--policies", nargs="+", default=["rsqr", "streamingllm"], help="rsqr and/or streamingllm "
                   "(or any mode; all use the W/N/delta/S flags below)")
    add_policy_args(p, flags=("window", "sinks", "delta", "max_survivors"), recall=False, window=512)
    p.add_argument("--warmup", type=int, default=1000, help="tokens before the baselines are taken")
    p.add_argument("--latency-window", type=int, default=1000, help="tokens in the first/last latency windows")
    p.add_argument("--check-every", type=int, default=1000, help="tokens between memory checkpoints")
    p.add_argument("--rss-tolerance", type=float, default=0.02)
    p.add_argument("--latency-tolerance", type=float, default=1.15)
    p.add_argument("--separate", action="store_true", help="one compiled step per policy instead of one vmapped")
    p.add_argument("--cache-dtype", default="bfloat16", help="KV cache dtype (bfloat16 or float32)")
    p.add_argument("--tiny", action="store_true", help="a tiny random 2-layer model with the real tokenizer "
                   "(exercises the soak machinery in seconds)")
    p.add_argument("--quick", action="store_true", help="the CI run: --tiny --tokens 5000")
    p.add_argument("--text", default=str(DEFAULT_TEXT))
    p.add_argument("--out", default="runs/soak", help="output directory ('' = write nothing)")
    p.add_argument("--png", default=None, help="plot path (default: OUT/soak.png; '' = no plot)")
    p.add_argument("--replot", default=None, metavar="JSON", help="no run: redraw the plot (--png) of a soak JSON")
    p.add_argument("--json", action="store_true", help="print the result JSON on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_model_args(p)
    return p


def replot(json_path: str, png: str | None) -> int:
    try:
        with open(json_path) as f:
            data = json.load(f)
        data["latency_ms"]["per_1k_p50"]
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--replot: not a soak result: {json_path} ({type(e).__name__})") from None
    png = png or os.path.splitext(json_path)[0] + ".png"
    S.plot(data, png)
    status(f"wrote {png}")
    return 0


def load(args):
    """(apply_fn, params, model config, tokenizer): the tiny CI model or the real one."""
    if not args.tiny:
        loaded, apply_fn, params = load_model_from_args(args)
        return apply_fn, params, loaded.config, loaded.tokenizer
    from rsqr_jax.models.loading import load_tokenizer
    from rsqr_jax.models.tiny import tiny_config, tiny_model

    cfg = tiny_config(**S.TINY_MODEL)
    return (*tiny_model(cfg, seed=0), cfg, load_tokenizer(None))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.replot:
        return replot(args.replot, args.png)
    check_model_args(args)
    if args.quick:
        args.tiny, args.tokens = True, 5000
    config = S.SoakConfig(text=args.text, tokens=args.tokens, policies=tuple(args.policies),
                          policy=policy_from_args(args), warmup=args.warmup,
                          latency_window=args.latency_window, check_every=args.check_every,
                          rss_tolerance=args.rss_tolerance, latency_tolerance=args.latency_tolerance,
                          separate=args.separate, cache_dtype=args.cache_dtype, progress=not args.no_progress)
    config.check()  # before the model loads
    apply_fn, params, model_config, tokenizer = load(args)
    path = lambda name: os.path.join(args.out, name)  # noqa: E731
    meta = {k: getattr(args, k) for k in ("tiny", "quick", "dtype", "model", "kernel", "out", "png")}
    result = S.run(config, apply_fn, params, model_config, tokenizer, meta=meta,
                   on_checkpoint=(lambda r: r.write_json(path("soak.json"))) if args.out else None)
    print(json.dumps(result.data) if args.json else result.markdown())
    if args.out:
        result.write_json(path("soak.json"))
        with open(path("soak.md"), "w") as f:
            f.write(result.markdown())
    png = path("soak.png") if args.png is None and args.out else args.png
    if png:
        result.plot(png)
    status(f"wrote {args.out or '-'}, {png or 'no plot'}")
    if not result.complete:
        return 130
    return 0 if result.verdict == "PASS" else 1


if __name__ == "__main__":
    run_main(main)
