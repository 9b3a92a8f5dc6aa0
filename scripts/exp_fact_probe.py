#!/usr/bin/env python3
"""A fact planted ~1200 tokens before its question: full vs rsqr vs rsqr + recall, greedy.

    python scripts/exp_fact_probe.py --filler rsqr_jax/data/licenses/GPL-3 --trials 20 --out runs/fact_gpl
"""

from __future__ import annotations

import json

from rsqr_jax.cli.args import (DEFAULT_TEXT, Parser, add_model_args, check_model_args, cold_store_flags, layer_or_none,
                               load_model_from_args, run_main)


def main(argv: list[str] | None = None) -> int:
    from rsqr_lab.studies import fact_probe as F

    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--filler", default=str(DEFAULT_TEXT), help="filler text (default: Frankenstein)")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--filler-tokens", type=int, default=1200)
    p.add_argument("--arms", default=",".join(F.ARMS))
    p.add_argument("--recall-pages", type=int, default=4)
    p.add_argument("--cold-capacity", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--page-score", default=None, help="max (the default), shortlist, mean or quest")
    p.add_argument("--recall-neighbors", type=int, default=0, help="pages on each side recalled with a chosen page")
    p.add_argument("--placement", default=None, help="where recalled tokens sit: rank (the default), true or fixed")
    p.add_argument("--reselect", type=int, default=None, help="choose pages afresh every k decode steps (default 1)")
    p.add_argument("--share-choice-from", type=layer_or_none, default=None, metavar="LAYER",
                   help="layers after LAYER attend the pages LAYER chose (default, or none: every layer chooses)")
    p.add_argument("--score-dtype", default=None, help="the max rule's scoring copy: float32 (the default) or int8")
    p.add_argument("--lead-max", type=int, default=0,
                   help="0..N random filler tokens before the fact (mid-stream, any page alignment)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="2 trials, 300 filler tokens")
    p.add_argument("--out", default=None, metavar="DIR", help="write DIR/fact_probe.json and .md")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--no-progress", action="store_true")
    add_model_args(p)
    args = p.parse_args(argv)
    check_model_args(args)
    cold = cold_store_flags(args)
    cfg = F.FactConfig(args.filler, trials=2 if args.quick else args.trials,
                       n_filler=300 if args.quick else args.filler_tokens, arms=tuple(args.arms.split(",")),
                       recall_pages=args.recall_pages, cold=cold, lead_max=args.lead_max, seed=args.seed)
    F.read_text(cfg.filler)  # fail before loading the model
    loaded, apply_fn, params = load_model_from_args(args)
    result = F.run(cfg, apply_fn, params, loaded.config, loaded.tokenizer, show_progress=not args.no_progress)
    if args.out:
        F.write(result, args.out)
    print(json.dumps(result) if args.json else F.markdown(result), end="")
    return 0


if __name__ == "__main__":
    run_main(main)
