#!/usr/bin/env python3
"""Reproduce the RSQR author's two recall studies and the factorial that separates them.

    python scripts/exp_reproduce.py --quick                  # CI smoke run (< 1 min): a tiny random model
    python scripts/exp_reproduce.py --parts p1 --p1-trials 16 --out runs/repro_p1     # docs/reproduction.md
    python scripts/exp_reproduce.py                          # the author's trial counts (hours on 2 cores)
    python scripts/exp_reproduce.py --parts p2 --p2-arms C_rsqr_two_scale --resume --out runs/repro_p2  # add an arm

The published model (Qwen2.5-0.5B-Instruct) is not available offline: the runs use SmolLM2-135M-Instruct.
The protocol is described in lab/rsqr_lab/studies/reproduce.py; results go to OUT/reproduce.json and
OUT/reproduce.md.
"""

from __future__ import annotations

import json

from rsqr_jax.cli.args import DEFAULT_TEXT, Parser, UsageError, add_model_args, check_model_args, run_main

from rsqr_lab.studies import reproduce as R


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="CI smoke run: a tiny random model with the real tokenizer, 2 trials, every arm once")
    p.add_argument("--out", default="runs/exp_reproduce", help="output directory")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--parts", default="p1,p2,factorial", help="any of p1, p2, factorial (comma-separated)")
    p.add_argument("--seeds", default="0,1,2", help="the author's seeds (rng = default_rng(seed * 1000 + n_cycles))")
    p.add_argument("--p1-trials", type=int, default=50, help="P1 trials per seed (the author: 50)")
    p.add_argument("--p2-trials", type=int, default=20, help="P2 trials per seed (the author: 20)")
    p.add_argument("--p1-cycles", default=",".join(map(str, R.P1_CYCLES)))
    p.add_argument("--p2-cycles", default=",".join(map(str, R.P2_CYCLES)))
    p.add_argument("--p1-arms", default=None, help=f"default: all of {','.join(R.P1_REPLICA_ARMS + R.OURS)}")
    p.add_argument("--p2-arms", default=None, help=f"default: all of {','.join(R.P2_REPLICA_ARMS + R.OURS)}")
    p.add_argument("--factorial-trials", type=int, default=24, help="trials per factorial cell")
    p.add_argument("--factorial-cycles", default=",".join(map(str, R.FACTORIAL_CYCLES)))
    p.add_argument("--factorial-policies", default=None, help=f"default: {','.join(R.FACTORIAL_POLICIES)}")
    p.add_argument("--factorial-only", default=None,
                   help="run only the factorial cells with these levels, e.g. answer=digit,feeding=8")
    p.add_argument("--resume", action="store_true",
                   help="reuse the finished cells of OUT/reproduce.json (same seeds and trial counts), run the rest")
    p.add_argument("--filler", default=str(DEFAULT_TEXT), help="the factorial's book filler (default: Frankenstein)")
    p.add_argument("--batch", type=int, default=48, help="rows of one batched step")
    p.add_argument("--from-json", default=None, help="print the tables of existing reproduce.json files (comma-separated: merged; no model)")
    add_model_args(p)
    return p


def _ints(text: str, flag: str) -> tuple:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not vals:
        raise UsageError(f"{flag} is empty")
    return vals


def _names(text: str) -> tuple:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def config_from_args(args) -> R.ReproConfig:
    chosen = {k: _names(v) for k, v in (("p1_arms", args.p1_arms), ("p2_arms", args.p2_arms),
                                          ("factorial_policies", args.factorial_policies),
                                          ("factorial_only", args.factorial_only)) if v}
    if args.quick:
        return R.quick_config(parts=_names(args.parts), **chosen)
    return R.ReproConfig(parts=_names(args.parts), seeds=_ints(args.seeds, "--seeds"), p1_trials_per_seed=args.p1_trials,
                         p2_trials_per_seed=args.p2_trials, p1_cycles=_ints(args.p1_cycles, "--p1-cycles"),
                         p2_cycles=_ints(args.p2_cycles, "--p2-cycles"), factorial_trials=args.factorial_trials,
                         factorial_cycles=_ints(args.factorial_cycles, "--factorial-cycles"), batch=args.batch,
                         **chosen).validate()


def load(args) -> R.ReproModel:
    from rsqr_jax.models.llama import load_model, split_apply
    from rsqr_jax.models.loading import load_tokenizer
    from rsqr_lab.studies.reproduce_arms import explicit_attend

    if args.quick:  # a tiny random model over the real tokenizer's vocabulary: exercises every path in seconds
        import dataclasses

        import jax.numpy as jnp

        from rsqr_jax.models.llama import Llama
        from rsqr_jax.models.tiny import tiny_config, tiny_weights

        tok = load_tokenizer(args.model)
        cfg = dataclasses.replace(tiny_config(), vocab_size=len(tok))
        model = Llama(cfg, tiny_weights(cfg, 0), dtype=jnp.float32)
    else:
        loaded = load_model(args.model, args.dtype, weight_format=args.weight_format)
        model, cfg, tok = loaded.model, loaded.config, loaded.tokenizer
    apply_fn, params = split_apply(model, kernel=args.kernel)
    explicit_fn, _ = split_apply(model, attend=explicit_attend)
    return R.ReproModel(apply_fn, explicit_fn, params, cfg, tok)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.from_json:
        print(R.markdown(R.merge_results(_names(args.from_json))))
        return 0
    check_model_args(args)
    if args.dtype != "float32":
        raise UsageError("the reproduction runs in float32 (the author's dtype)")
    cfg = config_from_args(args)
    model = load(args)
    result = R.run(cfg, model, args.out, filler_path=args.filler, show_progress=not args.no_progress,
                   resume=args.resume)
    if args.json:
        print(json.dumps({"summary": result.summary, "tokenisation": result.tokenisation, "timings": result.timings}))
    else:
        print(R.markdown(result))
    return 0


if __name__ == "__main__":
    run_main(main)
