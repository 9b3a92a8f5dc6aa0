#!/usr/bin/env python3
"""Weight formats for CPU decode side by side: float32, the GGUF's int8 blocks, mixed and int8 dots (one run).

    python scripts/bench_weights.py --out runs/bench_weights            # projections + decode at 128, 2048 cached
    python scripts/bench_weights.py --flags --no-decode                 # projections under each XLA:CPU flag set
    python scripts/bench_weights.py --quick                             # small run (CI)

The formats and what is measured: lab/rsqr_lab/studies/weights_timing.py; results: docs/speed.md §4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rsqr_jax.cli.args import DEFAULT_TEXT, Parser, UsageError, add_model_args, check_model_args, run_main


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default="dense,blocks,tiled,blocks_mixed,blocks_int8", help="comma-separated formats")
    p.add_argument("--cached", type=int, nargs="+", default=[128, 2048], help="cached-token counts for decode")
    p.add_argument("--new", type=int, default=48, help="tokens decoded per measurement")
    p.add_argument("--rounds", type=int, default=3, help="interleaved measurements per format (best reported)")
    p.add_argument("--micro-rounds", type=int, default=5)
    p.add_argument("--flags", action="store_true",
                   help="also time the projections under each XLA:CPU flag set, one child process each")
    p.add_argument("--no-decode", action="store_true", help="projections only")
    p.add_argument("--quick", action="store_true", help="cached 64, 8 new tokens, 1 round")
    p.add_argument("--text", default=str(DEFAULT_TEXT))
    p.add_argument("--out", default=None, metavar="DIR", help="write DIR/bench_weights.json and .md")
    p.add_argument("--json", action="store_true", help="print the result JSON on stdout")
    add_model_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_model_args(args)
    from rsqr_lab.studies import weights_timing as WT

    config = WT.WeightsConfig(args.text, formats=tuple(f for f in args.formats.split(",") if f),
                              cached=(64,) if args.quick else tuple(args.cached), new=8 if args.quick else args.new,
                              rounds=1 if args.quick else args.rounds,
                              micro_rounds=1 if args.quick else args.micro_rounds)
    if "dense" not in config.formats:
        raise UsageError("--formats must include dense (every ratio is to it)")
    import jax

    from rsqr_jax.eval.runtime import read_tokens, status, write_json_atomic
    from rsqr_jax.kernels import block_matvec
    from rsqr_jax.models.loading import default_model_path

    if "tiled" in config.formats and not block_matvec.available():
        raise UsageError(f"--formats tiled: {block_matvec.unavailable_reason()} (leave it out of --formats)")
    path = args.model or default_model_path()
    models = WT.read_models(path, config.formats)
    result = {"config": {"formats": list(config.formats), "cached": list(config.cached), "new": config.new,
                         "rounds": config.rounds, "model": args.model or "embedded"},
              "micro": {}, "decode": [],
              "machine": {"cpus": os.cpu_count(), "jax": jax.__version__}}
    status("projections, default XLA flags ...")
    result["micro"]["default"] = WT.micro(models, config.formats, config.micro_rounds)
    if args.flags:
        for name, flags in WT.FLAG_SETS.items():
            if name == "default":
                continue
            status(f"projections under {flags} (a child process) ...")
            cmd = [sys.executable, os.path.abspath(__file__), "--no-decode", "--json", "--formats", args.formats,
                   "--micro-rounds", str(config.micro_rounds)] + (["--model", args.model] if args.model else [])
            child = subprocess.run(cmd, env={**os.environ, "XLA_FLAGS": flags}, capture_output=True, text=True)
            if child.returncode != 0:
                result["micro"][flags] = {"error": child.stderr.strip().splitlines()[-1:]}
                continue
            result["micro"][flags] = json.loads(child.stdout)["micro"]["default"]
    if not args.no_decode:
        ids = read_tokens(models["dense"].tokenizer, config.text, max(config.cached) + 64).tolist()
        result["decode"] = WT.decode(models, config, ids)
    result["micro"] = {k: v for k, v in result["micro"].items() if "error" not in v} | \
        {k: v for k, v in result["micro"].items() if "error" in v}
    text = WT.markdown({**result, "micro": {k: v for k, v in result["micro"].items() if "error" not in v}})
    if args.out:
        write_json_atomic(os.path.join(args.out, "bench_weights.json"), result)
        with open(os.path.join(args.out, "bench_weights.md"), "w") as f:
            f.write(text)
    print(json.dumps(result) if args.json else text, end="")
    return 0


if __name__ == "__main__":
    run_main(main)
