#!/usr/bin/env python3
"""The policy table: the policies on the first N tokens of Frankenstein, token by token.

    python scripts/exp_policies.py                 # 4096 tokens, W=256, N=4, delta=8 (~25-40 min on 2 busy cores)
    python scripts/exp_policies.py --quick         # 512 tokens, W=64 (~2 min; CI adds --no-hf --no-bf16)

Runs (rank/global policies streamed token by token, chunk 1; each dtype's batch in ONE vmapped call):
  * HF transformers reference: torch float32, eager full attention, the same GGUF weights, fed in chunks
    with past_key_values (skip with --no-hf);
  * full, float32, chunk 256 (chunked prefill is exact for full);
  * float32 batch: window (0+W), streamingllm (N+W), rsqr delta=0, rsqr, rerotate block 1;
  * bfloat16 batch: rsqr, rerotate block 1.
The float32 oracle is rsqr float32 with the same parameters (rsqr_lab.studies.policy_table).
Writes OUT/exp_policies.json (summary, checks, timings) + OUT/exp_policies.md (tables) + OUT/nll_*.npy;
prints the tables (or, with --json, the JSON object).
"""

from __future__ import annotations

import json
import os

from rsqr_jax.cli.args import DEFAULT_TEXT, Parser, add_policy_args, policy_defaults, policy_from_args, run_main


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default=str(DEFAULT_TEXT))
    p.add_argument("--tokens", type=int, default=None, help="tokens streamed (default 4096; --quick 512)")
    p.add_argument("--window", type=int, default=None,
                   help=f"window W (default {policy_defaults()['window']}; --quick 64)")
    add_policy_args(p, flags=("sinks", "delta", "max_survivors"), recall=False)
    p.add_argument("--segment", type=int, default=256, help="tokens per jitted call")
    p.add_argument("--full-chunk", type=int, default=256, help="chunk of the full-attention run")
    p.add_argument("--hf-chunk", type=int, default=512, help="chunk of the torch reference")
    p.add_argument("--no-hf", action="store_true", help="skip the torch reference")
    p.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 batch")
    p.add_argument("--quick", action="store_true", help="tiny configuration for CI")
    p.add_argument("--out", default=None, help="output directory (default runs/exp_policies[_quick])")
    p.add_argument("--json", action="store_true", help="print the JSON object instead of the tables")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--rescore", default=None, metavar="DIR",
                   help="no model runs: rebuild the tables of DIR from its exp_policies.json and nll_*.npy")
    return p


def load(dtype: str):
    from rsqr_jax.models.llama import load_model, split_apply
    from rsqr_jax.eval.perplexity import Model

    lm = load_model(None, dtype)
    return Model(*split_apply(lm.model), lm.config, lm.tokenizer, dtype, lm.path)


def main(argv: list[str] | None = None) -> int:
    from rsqr_lab.studies import policy_table as policies

    args = build_parser().parse_args(argv)
    if args.rescore:
        result, out_dir = policies.rescore(args.rescore), args.rescore
    else:
        config = policies.PoliciesConfig.make(
            args.text, quick=args.quick, tokens=args.tokens, window=args.window, policy=policy_from_args(args),
            segment=args.segment, full_chunk=args.full_chunk,
            hf_chunk=args.hf_chunk, hf=not args.no_hf, bf16=not args.no_bf16)
        out_dir = args.out or os.path.join("runs", "exp_policies_quick" if args.quick else "exp_policies")
        os.makedirs(out_dir, exist_ok=True)
        result = policies.run(config, load, show_progress=not args.no_progress)
    result.write(out_dir)
    print(json.dumps(result.to_json()) if args.json else result.markdown())
    return 0


if __name__ == "__main__":
    run_main(main)
