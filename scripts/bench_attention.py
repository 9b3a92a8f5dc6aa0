#!/usr/bin/env python3
"""CPU benchmark of the XLA attention paths (jit, no Pallas): per-step decode attention cost.

plain (the floor), rsqr with S/N = 1/8 and 1/2 (the jnp reference and the lean XLA path), streamingllm
(cos/sin table, and through the contract). Prints tables and writes JSON ({"meta", "rows", "table_md"};
one row per (batch, N) with ms / cpu_ms / ratio / ratio_cpu per path). The logic and the path
descriptions are rsqr_lab.studies.kernel_timing.

    python scripts/bench_attention.py                 # default run (~minutes on 2 cores)
    python scripts/bench_attention.py --quick         # tiny sanity run
    python scripts/bench_attention.py --out runs/x.json
    python scripts/bench_attention.py --before runs/bench_attention_before.json   # + target ratios before -> after
"""

from __future__ import annotations

import json
import sys
import time

from rsqr_jax.cli.args import Parser, run_main

from rsqr_lab.studies import kernel_timing as X


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--out", default="runs/bench_attention.json", help="JSON file to write")
    p.add_argument("--budget", type=float, default=None, help="seconds of timed rounds per (N, batch)")
    p.add_argument("--max-n-batch16", type=int, default=32768, help="largest N run at batch 16")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    p.add_argument("--before", default=None,
                   help="an earlier JSON of this script: print the target ratios before -> after")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    before = X.load_result(args.before) if args.before else None
    config = X.BenchAttentionConfig(quick=args.quick, budget_s=args.budget, max_n_batch16=args.max_n_batch16)
    t0 = time.time()
    result = X.run(config, command=" ".join(sys.argv), log=None if args.json else print)
    result.write(args.out)
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    print()
    print(result.table_md)
    if before is not None:
        print(f"\ntarget ratios (process CPU) before ({args.before}) -> after\n")
        print(X.compare_md(before, result.to_json()))
    print(f"\nwrote {args.out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    run_main(main)
