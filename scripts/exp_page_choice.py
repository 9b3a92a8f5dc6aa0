#!/usr/bin/env python3
"""Where the fact's page ranks in each layer's choice when the question arrives (the unprotected protocol).

    python scripts/exp_page_choice.py --trials 40 --out runs/page_choice     # docs/recall_tier.md §9
"""

from __future__ import annotations

import json
import os

from rsqr_jax.cli.args import (DEFAULT_TEXT, Parser, add_model_args, add_policy_args, add_recall_args,
                               check_model_args, cold_store_flags, load_model_from_args, policy_from_args, run_main)


def main(argv: list[str] | None = None) -> int:
    from rsqr_jax.eval.runtime import write_json_atomic
    from rsqr_lab.studies import page_choice as PC
    from rsqr_lab.studies.recall_probe import RecallModel, parse_int_list

    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--filler", default=str(DEFAULT_TEXT), help="filler text (default: Frankenstein)")
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--cycles", default="2,4,8,16,32,64", help="checkpoints, in cycles of --cycle-len filler tokens")
    p.add_argument("--cycle-len", type=int, default=16)
    p.add_argument("--batch", type=int, default=20, help="trials per forward")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="4 trials, cycles 2,4")
    p.add_argument("--out", default=None, metavar="DIR", help="write DIR/page_choice.json and .md")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--no-progress", action="store_true")
    add_policy_args(p, flags=("window", "delta", "max_survivors", "block"), recall=False, window=24, delta=8,
                    max_survivors=16, block=8)
    add_recall_args(p, default_pages=4)
    p.set_defaults(cold_capacity=1088)
    add_model_args(p)
    args = p.parse_args(argv)
    check_model_args(args)
    if args.reselect not in (None, 1):
        raise PC.ConfigError("--reselect does not apply: the question is a prompt chunk, which chooses its pages afresh")
    cold = cold_store_flags(args)
    cycles = (2, 4) if args.quick else tuple(parse_int_list(args.cycles, "--cycles"))
    policy = policy_from_args(args, mode="rsqr", n_sink=4)
    cfg = PC.PageChoiceConfig(args.filler, trials=4 if args.quick else args.trials, cycles=cycles, policy=policy,
                              cold=cold, cycle_len=args.cycle_len, batch=args.batch, seed=args.seed)
    if not os.path.isfile(cfg.filler):
        raise PC.ConfigError(f"filler file not found: {cfg.filler}")
    loaded, apply_fn, params = load_model_from_args(args)
    model = RecallModel(apply_fn, params, loaded.config, loaded.tokenizer)
    result = PC.run(cfg, model, show_progress=not args.no_progress)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_json_atomic(os.path.join(args.out, "page_choice.json"), result)
        with open(os.path.join(args.out, "page_choice.md"), "w") as f:
            f.write(PC.table(result) + "\n")
    print(json.dumps(result) if args.json else PC.table(result))
    return 0


if __name__ == "__main__":
    run_main(main)
