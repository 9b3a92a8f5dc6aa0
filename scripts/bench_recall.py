#!/usr/bin/env python3
"""Decode latency of rsqr + recall against cold-store size, side by side with plain rsqr (ratios).

    python scripts/bench_recall.py --out runs/bench_recall            # cold stores 0, 4k, 16k, 64k tokens
    python scripts/bench_recall.py --cold-sizes 0,4096 --prompt-tokens 32,2048,4608   # empty, half full, wrapped
    python scripts/bench_recall.py --cold-sizes 0,65536 --prompt-tokens 66304 --fill --reselect 1,8   # a full 64k store
    python scripts/bench_recall.py --cold-sizes 0,4096 --prompt-tokens 4864 --fill --no-weights   # the cache machinery alone
"""

from __future__ import annotations

import argparse
import json

from rsqr_jax.cli.args import (DEFAULT_TEXT, Parser, add_model_args, check_model_args, check_share_layer,
                               layer_or_none, load_model_from_args, run_main)


def main(argv: list[str] | None = None) -> int:
    from rsqr_jax.spec import ColdStore
    from rsqr_lab.studies import recall_timing as B

    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default=str(DEFAULT_TEXT))
    p.add_argument("--cold-sizes", default="0,4096,16384,65536", help="cold-store capacities (0 = plain rsqr)")
    p.add_argument("--recall-pages", type=int, default=None, help="default: the model's preset (rsqr_jax/presets)")
    p.add_argument("--page-size", type=int, default=None, help="default: the model's preset")
    p.add_argument("--page-scores", default=None, help="page rules to compare at every cold size, e.g. mean,max "
                   "(default: the default rule)")
    p.add_argument("--reselect", default=None, help="pages chosen afresh every k decode steps, a list to compare, "
                   "e.g. 1,4,8 (ColdStore.reselect; 1 = every step; default: the model's preset)")
    p.add_argument("--share-choice-from", default=None, metavar="LAYERS",
                   help="a list to compare, e.g. none,18: layers after LAYER attend the pages LAYER chose "
                   "(ColdStore.share_from; none = every layer chooses); per-layer sources (LAYERS:SOURCE,...) as "
                   "arms separated by ';', e.g. '14;0-1:none,10-13:9,15-29:14' (default: the model's preset)")
    p.add_argument("--score-dtypes", default=None, help="the max rule's scoring copy, a list to compare, e.g. "
                   "float32,int8 (ColdStore.score_dtype; default: the model's preset)")
    p.add_argument("--prompt-tokens", default="512", help="prompt lengths, one arm each, e.g. 32,2048 (a prompt "
                   "that stays inside the window with every generated token leaves the store empty)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fill", action="store_true", help="feed each store size's prompt once with recall off and "
                   "start every arm from that state (a full store without one recall prefill per arm)")
    p.add_argument("--no-weights", action="store_true", help="time the cache machinery alone: the model's "
                   "projections read no weights (their memory traffic, the noisiest part of a step, is gone; the "
                   "text generated means nothing); compare arms by their difference in ms")
    p.add_argument("--quick", action="store_true", help="cold stores 0 and 256, 8 tokens, 1 round")
    p.add_argument("--out", default=None, metavar="DIR")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="(no progress bars here)")
    add_model_args(p)
    args = p.parse_args(argv)
    check_model_args(args)
    from rsqr_jax.models.loading import load_config
    from rsqr_jax.presets import find_preset, format_choice_sources

    preset = find_preset(load_config(args.model)).resolve().recall  # what a flag leaves out: the model's preset
    args.recall_pages = preset["pages"] if args.recall_pages is None else args.recall_pages
    args.page_size = preset["page_size"] if args.page_size is None else args.page_size
    args.reselect = str(preset["reselect"]) if args.reselect is None else args.reselect
    args.score_dtypes = preset["score_dtype"] if args.score_dtypes is None else args.score_dtypes
    if args.share_choice_from is None:
        share = preset["share_from"]
        args.share_choice_from = ("none" if share is None else str(share) if isinstance(share, int)
                                  else format_choice_sources(share))
    try:
        sizes = tuple(int(x) for x in args.cold_sizes.split(","))
    except ValueError:
        p.error(f"--cold-sizes must be comma-separated integers, got {args.cold_sizes!r}")
    try:
        prompts = tuple(int(x) for x in args.prompt_tokens.split(","))
    except ValueError:
        p.error(f"--prompt-tokens must be comma-separated integers, got {args.prompt_tokens!r}")
    try:
        reselects = tuple(int(x) for x in args.reselect.split(","))
    except ValueError:
        p.error(f"--reselect must be comma-separated integers, got {args.reselect!r}")
    try:
        arms = args.share_choice_from.split(";" if ":" in args.share_choice_from else ",")
        shares = tuple(None if v == -1 else v for v in map(layer_or_none, arms))
        for share in shares:
            ColdStore(share_from=share)  # per-layer sources: each a chooser's
    except (argparse.ArgumentTypeError, ValueError) as e:
        p.error(f"--share-choice-from must be comma-separated layers or none, or per-layer sources separated by ';' "
                f"({e}), got {args.share_choice_from!r}")
    if args.quick:
        sizes, args.new_tokens, args.rounds = (0, 256), 8, 1
    rules = {"page_scores": tuple(args.page_scores.split(","))} if args.page_scores else {}
    cfg = B.BenchRecallConfig(args.text, sizes, recall_pages=args.recall_pages, page_size=args.page_size, **rules,
                              prompt_tokens=prompts, new_tokens=args.new_tokens, rounds=args.rounds,
                              reselects=reselects, share_froms=shares, score_dtypes=tuple(args.score_dtypes.split(",")),
                              fill=args.fill)
    loaded, apply_fn, params = load_model_from_args(args)
    if args.no_weights:
        from rsqr_jax.models.llama import split_apply

        apply_fn, params = split_apply(loaded.model, kernel=args.kernel, matmul=B.weightless_matmul)
    for share in shares:
        check_share_layer(args, loaded.config, share)
    result = B.run(cfg, apply_fn, params, loaded.config, loaded.tokenizer)
    result["config"]["no_weights"] = args.no_weights
    if args.out:
        B.write(result, args.out)
    print(json.dumps(result) if args.json else B.markdown(result), end="")
    return 0


if __name__ == "__main__":
    run_main(main)
