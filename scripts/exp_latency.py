#!/usr/bin/env python3
"""Per-token decode latency against stream position for every policy (real SmolLM2, this CPU).

The stream is jumped to each probe position by a positions-only bookkeeping loop, then a Session's
one-token step is timed; rotations per token are counted analytically (rsqr_lab.studies.latency).

    python scripts/exp_latency.py                  # default: 1k..50k, all policies (< 30 min)
    python scripts/exp_latency.py --quick          # up to ~2k, short windows (< 2 min)
    python scripts/exp_latency.py --policies rsqr streamingllm --positions 1000 50000

Writes DIR/latency.json, latency.md and latency.png (--out DIR); --json prints the JSON on stdout.
"""

from __future__ import annotations

import json
import os

from rsqr_jax.cli.args import (DEFAULT_TEXT, Parser, add_model_args, add_policy_args, add_recall_args, check_model_args,
                               cold_store_from_args, load_model_from_args, policy_from_args, run_main)

from rsqr_lab.studies import latency as L
from rsqr_jax.eval.runtime import status


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--positions", type=int, nargs="+", default=[1000, 2000, 5000, 10000, 20000, 50000])
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per probe position")
    p.add_argument("--replay-steps", type=int, default=96, help="timed steps per probe for replay (expensive)")
    p.add_argument("--full-max", type=int, default=8192, help="largest probe position for full attention")
    p.add_argument("--policies", nargs="+", default=list(L.POLICIES), help=f"subset of {', '.join(L.POLICIES)}")
    add_policy_args(p, flags=("window", "sinks", "delta", "max_survivors"), recall=False, window=512)
    p.add_argument("--sweep-position", type=int, default=4096)
    p.add_argument("--sweep-steps", type=int, default=96)
    p.add_argument("--no-sweep", action="store_true", help="skip the W/delta/block tail sweep")
    p.add_argument("--quick", action="store_true", help="tiny run: positions 512 and 2048, W=128, 24 steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default=str(DEFAULT_TEXT))
    p.add_argument("--out", default="runs/exp_latency", help="output directory ('' = write nothing)")
    p.add_argument("--png", default=None, help="plot path (default: OUT/latency.png; '' = no plot)")
    p.add_argument("--json", action="store_true", help="print the result JSON on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_recall_args(p, default_pages=4, what="the rsqr_recall arm")
    add_model_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_model_args(args)
    from rsqr_jax.spec import ColdStore

    cold = cold_store_from_args(args) or ColdStore()
    config = L.LatencyConfig(text=args.text, positions=tuple(args.positions), steps=args.steps,
                             replay_steps=args.replay_steps, full_max=args.full_max, policies=tuple(args.policies),
                             policy=policy_from_args(args, recall_pages=0),  # --recall-pages: rsqr_recall's
                             sweep_position=args.sweep_position,
                             sweep_steps=args.sweep_steps, no_sweep=args.no_sweep, seed=args.seed,
                             dtype=args.dtype, progress=not args.no_progress, recall_pages=args.recall_pages,
                             cold=cold)
    config = config.quick() if args.quick else config
    config.check()  # before the model loads
    loaded, apply_fn, params = load_model_from_args(args)
    meta = {k: getattr(args, k) for k in ("quick", "out", "png", "model", "kernel")}
    result = L.run(config, apply_fn, params, loaded.config, loaded.tokenizer, meta=meta)
    if args.json:
        print(json.dumps(result.data))
    else:
        print(result.markdown())
    if args.out:
        result.write_json(os.path.join(args.out, "latency.json"))
        with open(os.path.join(args.out, "latency.md"), "w") as f:
            f.write(result.markdown())
        status(f"wrote {args.out}/latency.json, latency.md ({result.data['total_s']:.0f}s)")
    png = os.path.join(args.out, "latency.png") if args.png is None and args.out else args.png
    if png:
        result.plot(png)
        status(f"wrote {png}")
    return 0


if __name__ == "__main__":
    run_main(main)
