#!/usr/bin/env python3
"""Streaming perplexity of every policy on Frankenstein, per 1k tokens (table + plot).

    python scripts/exp_ppl.py --quick                       # CI smoke (~1-2 min): 512 tokens, W=64, float32
    python scripts/exp_ppl.py                               # default grid, sized to < 30 min on 2 idle cores
    python scripts/exp_ppl.py --tokens 20000 --full-tokens 20000 --replay-tokens 20000 --bf16-policies same
                                                            # the full grid (hours on CPU)

Default grid: float32 W=256 4096 tokens, float32 W=1024 3072, bfloat16 W=256 2048 and W=1024 1536
(--cell-tokens); bfloat16 cells run streamingllm, rerotate (block 1 and 8), rsqr, rsqr_precompute.
Per (W, dtype) cell the token-by-token policies stream in ONE vmapped call; full runs once per dtype with
chunked prefill; replay runs alone (rsqr_lab.studies.ppl). SIGTERM/Ctrl-C keeps the finished pieces
(exit code 3). Writes OUT/exp_ppl.json, OUT/exp_ppl.md, nll_*.npy and a PNG of the per-1k-token curves;
prints the tables (or, with --json, the JSON object).
"""

from __future__ import annotations

import json
import os

from rsqr_jax.cli.args import (DEFAULT_TEXT, Parser, UsageError, add_policy_args, add_recall_args, cold_store_from_args,
                               policy_from_args, run_main)


def build_parser() -> Parser:
    from rsqr_lab.studies.ppl import ALL, BF16_DEFAULT, DEFAULT, DEFAULT_CELL_TOKENS

    cell_default = ",".join(f"{w}/{d}={n}" for (w, d), n in DEFAULT_CELL_TOKENS.items())
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default=str(DEFAULT_TEXT))
    p.add_argument("--tokens", type=int, default=None, help="tokens streamed per cell (default 4096; --quick 512)")
    p.add_argument("--windows", default=None, help="comma-separated windows W (default 256,1024; --quick 64)")
    p.add_argument("--dtypes", default=None, help="comma-separated: float32, bfloat16 (default both; --quick float32)")
    p.add_argument("--policies", default=",".join(DEFAULT),
                   help=f"float32 cells: comma-separated subset of {','.join(ALL)}")
    p.add_argument("--bf16-policies", default=",".join(BF16_DEFAULT),
                   help="bfloat16 cells: subset as for --policies, or 'same' (= --policies)")
    p.add_argument("--cell-tokens", default=None,
                   help=f"per-cell override of --tokens, W/dtype=N terms (default: {cell_default}; '' for none)")
    add_policy_args(p, flags=("sinks", "delta", "max_survivors"), recall=False)  # the windows are --windows
    p.add_argument("--full-tokens", type=int, default=None, help="cap for full (default 4096)")
    p.add_argument("--full-chunk", type=int, default=256)
    p.add_argument("--replay-tokens", type=int, default=None, help="cap for replay (default W+512; --quick W+96)")
    p.add_argument("--replay-block", type=int, default=None, help="replay eviction block (default 32; --quick 16)")
    p.add_argument("--bucket", type=int, default=None, help="tokens per point of the curves (default 1000; --quick 128)")
    p.add_argument("--segment", type=int, default=256, help="tokens per jitted call")
    p.add_argument("--piece-segments", type=int, default=8,
                   help="segments per piece: the unit kept when a run is interrupted (SIGTERM/Ctrl-C)")
    add_recall_args(p, default_pages=4, what="the rsqr_recall arm")
    p.add_argument("--quick", action="store_true", help="tiny configuration for CI")
    p.add_argument("--out", default=None, help="output directory (default runs/exp_ppl[_quick])")
    p.add_argument("--plot", default=None, help="PNG path (default OUT/exp_ppl.png)")
    p.add_argument("--json", action="store_true", help="print the JSON object instead of the tables")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--rescore", default=None, metavar="DIR",
                   help="no model runs: rebuild DIR's tables and plot (--plot) from its exp_ppl.json and nll_*.npy")
    p.add_argument("--merge", default=None, nargs="+", metavar="SRC",
                   help="with --rescore: add the cells of other runs (SRC dirs) to DIR first (their nll_*.npy are "
                        "copied in); a cell DIR already has is an error")
    return p


def _ints(s: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{what}: expected comma-separated integers, got {s!r}") from None
    if not vals or min(vals) < 1:
        raise UsageError(f"{what}: expected positive integers, got {s!r}")
    return vals


def _cell_tokens(s: str | None) -> dict | None:
    if s is None:
        return None
    out = {}
    for term in [t for t in s.split(",") if t]:
        try:
            cell, n = term.split("=")
            w, d = cell.split("/")
            out[(int(w), d)] = int(n)
        except ValueError:
            raise UsageError(f"--cell-tokens: bad term {term!r} (expected W/dtype=N)") from None
    return out


def config_from_args(args):
    from rsqr_lab.studies.ppl import PplConfig

    from rsqr_jax.spec import ColdStore

    pols = tuple(x for x in args.policies.split(",") if x)
    cold = cold_store_from_args(args) or ColdStore()
    bf16 = pols if args.bf16_policies == "same" else tuple(x for x in args.bf16_policies.split(",") if x)
    base = policy_from_args(args, recall_pages=0)  # --recall-pages is the rsqr_recall arm's
    return PplConfig.make(
        args.text, quick=args.quick, tokens=args.tokens, windows=args.windows and _ints(args.windows, "--windows"),
        dtypes=args.dtypes and [d for d in args.dtypes.split(",") if d], policies=pols, bf16_policies=bf16,
        cell_tokens=_cell_tokens(args.cell_tokens), policy=base, full_tokens=args.full_tokens,
        full_chunk=args.full_chunk, replay_tokens=args.replay_tokens, replay_block=args.replay_block, bucket=args.bucket, segment=args.segment,
        piece_segments=args.piece_segments, recall_pages=args.recall_pages, cold=cold)


def load(dtype: str):
    from rsqr_jax.models.llama import load_model, split_apply
    from rsqr_jax.eval.perplexity import Model

    lm = load_model(None, dtype)
    return Model(*split_apply(lm.model), lm.config, lm.tokenizer, dtype, lm.path)


def main(argv: list[str] | None = None) -> int:
    from rsqr_lab.studies import ppl
    from rsqr_jax.eval.runtime import sigterm_interrupts

    args = build_parser().parse_args(argv)
    if args.merge and not args.rescore:
        raise UsageError("--merge needs --rescore DIR (the run the cells are added to)")
    if args.rescore:
        if args.merge:
            ppl.merge(args.rescore, args.merge)
        result, out_dir = ppl.rescore(args.rescore), args.rescore
    else:
        config = config_from_args(args)
        out_dir = args.out or os.path.join("runs", "exp_ppl_quick" if args.quick else "exp_ppl")
        os.makedirs(out_dir, exist_ok=True)
        with sigterm_interrupts():  # a killed run still writes what it finished
            result = ppl.run(config, load, show_progress=not args.no_progress)
    result.write(out_dir, args.plot)
    print(json.dumps(result.to_json()) if args.json else result.markdown())
    return 3 if result.interrupted and not args.rescore else 0


if __name__ == "__main__":
    run_main(main)
