#!/usr/bin/env python3
"""Recall under streaming eviction: plant secret numbers, stream filler through a bounded cache, ask.

    python scripts/exp_recall.py --quick                      # < 2 min: a smoke run of every arm (CI)
    python scripts/exp_recall.py                              # the default study (runs/exp_recall)
    python scripts/exp_recall.py --trials 100 --batch 50 --out runs/exp_recall_100   # docs/recall.md tables 1-3
    python scripts/exp_recall.py ... --resume       # continue a killed run (it keeps every finished arm; exit 3)

The protocol is described in lab/rsqr_lab/studies/recall_probe.py (and written to recall.json under "protocol").
"""

from __future__ import annotations

import json

from rsqr_jax.cli.args import (DEFAULT_TEXT, Parser, add_model_args, add_policy_args, add_recall_args, check_model_args,
                     cold_store_flags, model_label, policy_from_args, run_main)

from rsqr_lab.studies import recall_probe as recall


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run (< 2 min): 4 trials, cycles 2,4, float32, one cache spec")
    p.add_argument("--out", default="runs/exp_recall", help="output directory")
    p.add_argument("--json", action="store_true", help="print recall.json's object on stdout instead of the tables")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--filler", default=str(DEFAULT_TEXT), help="filler text file (default: Frankenstein)")
    p.add_argument("--facts", default=None,
                   help="facts file: lines 'NAME NUMBER' or JSON; default: built-in names, random 7-digit numbers")
    p.add_argument("--n-facts", type=int, default=None, help="facts planted per trial (default 1)")
    p.add_argument("--preamble", default="none",
                   help="none, or chat: the chat template's system turn + user header before the facts (sinks)")
    p.add_argument("--trials", type=int, default=None, help="trials per cell")
    p.add_argument("--cycles", default=None, help="n_cycles checkpoints, e.g. 2,4,8,16,32,64")
    p.add_argument("--dtypes", default=None, help="float32 and/or bfloat16 (comma-separated)")
    p.add_argument("--variants", default=None, help="pinned and/or unprotected")
    p.add_argument("--arms", default=None, help=f"subset of {','.join(recall.ARMS)}")
    p.add_argument("--bf16-arms", default=None, help="arms run in bfloat16 (default: rerotate,streamingllm)")
    p.add_argument("--bf16-cycles", default=None, help="n_cycles checkpoints in bfloat16 (default: up to 16)")
    p.add_argument("--unprotected-cycles", default=None, help="n_cycles for the unprotected variant (default: <= 4)")
    p.add_argument("--unprotected-arms", default=None, help="arms of the unprotected variant (default: all)")
    # the sinks are each variant's, the cap the rsqr_cap arm's (rsqr's is uncapped), the block the streaming chunk
    add_policy_args(p, flags=("window", "delta", "block"), recall=False, window=24, block=8)
    p.add_argument("--cap", type=int, default=16, help="rsqr_cap max_survivors")
    p.add_argument("--cycle-len", type=int, default=16, help="filler tokens per cycle")
    p.add_argument("--gen-tokens", type=int, default=10, help="greedy answer tokens")
    p.add_argument("--batch", type=int, default=40, help="trials per batch (rows of one forward)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--from-json", default=None, help="re-plot and print the table of an existing recall.json")
    p.add_argument("--resume", action="store_true",
                   help="continue OUT/recall.json written by an interrupted run: arms it finished are kept, the "
                        "rest run (the settings must match)")
    add_recall_args(p, default_pages=4, what="the rsqr_recall arm")
    add_model_args(p)
    return p


def config_from_args(args) -> recall.RecallConfig:
    ints = {k: recall.parse_int_list(v, "--" + k.replace("_", "-")) if v else None
            for k, v in (("cycles", args.cycles), ("bf16_cycles", args.bf16_cycles),
                         ("unprotected_cycles", args.unprotected_cycles))}
    choices = {k: recall.parse_choice_list(v, "--" + k.replace("_", "-"), allowed) if v else None
               for k, v, allowed in (("dtypes", args.dtypes, ("float32", "bfloat16")),
                                     ("variants", args.variants, recall.VARIANTS), ("arms", args.arms, recall.ARMS),
                                     ("bf16_arms", args.bf16_arms, recall.ARMS),
                                     ("unprotected_arms", args.unprotected_arms, recall.ARMS))}
    return recall.make_config(
        args.filler, quick=args.quick, trials=args.trials, n_facts=args.n_facts, **ints, **choices,
        facts=args.facts, preamble=args.preamble, cycle_len=args.cycle_len,
        policy=policy_from_args(args, max_survivors=args.cap, recall_pages=0),  # --recall-pages: rsqr_recall's
        recall_pages=args.recall_pages, cold=cold_store_flags(args),
        gen_tokens=args.gen_tokens, batch=args.batch, seed=args.seed,
        model=args.model, dtype=args.dtype, kernel=args.kernel)


def show(result: recall.RecallResult, as_json: bool) -> None:
    print(json.dumps(result.data) if as_json else result.tables())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.from_json:
        result = recall.RecallResult.from_json(args.from_json)
        if not args.no_plot:
            result.plot(f"{args.out}/recall.png")
        show(result, args.json)
        return 0
    check_model_args(args)
    cfg = config_from_args(args)
    previous = recall.preflight(cfg, args.out, resume=args.resume)

    from rsqr_jax.models.llama import load_model, split_apply

    models = {}
    for dtype in cfg.dtypes:
        lm = load_model(args.model, dtype, weight_format=args.weight_format)
        apply_fn, params = split_apply(lm.model, kernel=args.kernel)
        models[dtype] = recall.RecallModel(apply_fn, params, lm.config, lm.tokenizer)
    result = recall.run(cfg, models, args.out, previous=previous, model_path=model_label(args),
                        show_progress=not args.no_progress)
    if not result.complete:
        return 3
    result.write(args.out, with_plot=not args.no_plot)
    show(result, args.json)
    return 0


if __name__ == "__main__":
    run_main(main)
