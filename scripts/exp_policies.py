#!/usr/bin/env python3
"""Issue 3 "done when" table: the policies on the first N tokens of Frankenstein, token by token.

    python scripts/exp_policies.py                 # 4096 tokens, W=256, N=4, delta=8 (~25-40 min on 2 busy cores)
    python scripts/exp_policies.py --quick         # 512 tokens, W=64 (~2 min; CI adds --no-hf --no-bf16)

Runs (rank/global policies streamed token by token, chunk 1; each dtype's batch in ONE vmapped call):
  * HF transformers reference: torch float32, eager full attention, the same GGUF weights, fed in chunks
    with past_key_values (skip with --no-hf);
  * full, float32, chunk 256 (chunked prefill is exact for full);
  * float32 batch: window (0+W), streamingllm (N+W), rsqr delta=0, rsqr, rerotate block 1;
  * bfloat16 batch: rsqr, rerotate block 1.
The float32 oracle is rsqr float32 with the same parameters (DESIGN section 4: every rank-timeline policy
computes the same function of the same token set; rsqr rotates every key from raw exactly once).
Writes OUT/exp_policies.json (summary, checks, timings) + OUT/exp_policies.md (tables) + OUT/nll_*.npy.
"""

from __future__ import annotations

import json
import os

import numpy as np

from _common import DEFAULT_TEXT, Parser, UsageError, run_main, status
from _stream_exp import Timer, block_bootstrap, check_finite, hf_reference_nll, ppl, stream_policies

REL_TOL = 1e-3  # rsqr(delta=0) vs streamingllm, relative perplexity


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default=str(DEFAULT_TEXT))
    p.add_argument("--tokens", type=int, default=None, help="tokens streamed (default 4096; --quick 512)")
    p.add_argument("--window", type=int, default=None, help="window W (default 256; --quick 64)")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--delta", type=int, default=8)
    p.add_argument("--max-survivors", type=int, default=64)
    p.add_argument("--segment", type=int, default=256, help="tokens per jitted call")
    p.add_argument("--full-chunk", type=int, default=256, help="chunk of the full-attention run")
    p.add_argument("--hf-chunk", type=int, default=512, help="chunk of the torch reference")
    p.add_argument("--no-hf", action="store_true", help="skip the torch reference")
    p.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 batch")
    p.add_argument("--quick", action="store_true", help="tiny configuration for CI")
    p.add_argument("--out", default=None, help="output directory (default runs/exp_policies[_quick])")
    p.add_argument("--rescore", default=None, metavar="DIR",
                   help="no model runs: rebuild the tables of DIR from its exp_policies.json and nll_*.npy")
    return p


def main() -> int:
    args = build_parser().parse_args()
    if args.rescore:
        return rescore(args.rescore)
    T = args.tokens or (512 if args.quick else 4096)
    W = args.window or (64 if args.quick else 256)
    if T < 2 * W:
        raise UsageError(f"--tokens {T} must be at least twice the window {W} (evictions must happen)")
    if args.segment < 1 or args.full_chunk < 1 or args.hf_chunk < 1:
        raise UsageError("--segment, --full-chunk and --hf-chunk must be positive")
    if args.segment % args.full_chunk:
        raise UsageError("--full-chunk must divide --segment")
    out_dir = args.out or os.path.join("runs", "exp_policies_quick" if args.quick else "exp_policies")
    os.makedirs(out_dir, exist_ok=True)

    from eval_stream import read_tokens
    from models.llama import load_model, split_apply
    from rsqr_jax import policy as P

    pol = dict(window=W, n_sink=args.sinks, delta=args.delta, max_survivors=args.max_survivors, block=1)
    f32_batch = {
        "window": P.make_policy("window", window=W),
        "streamingllm": P.make_policy("streamingllm", window=W, n_sink=args.sinks),
        "rsqr_delta0": P.make_policy("rsqr", **{**pol, "delta": 0}),
        "rsqr": P.make_policy("rsqr", **pol),
        "rerotate": P.make_policy("rerotate", **pol),
    }
    bf16_batch = {"rsqr": P.make_policy("rsqr", **pol), "rerotate": P.make_policy("rerotate", **pol)}

    runs: dict[str, dict] = {}  # run key -> {"nll", "dtype", "policy", "name"}
    timings = []
    with Timer() as total:
        lm32 = load_model(None, "float32")
        ids = read_tokens(lm32.tokenizer, args.text, T)
        apply32, params32 = split_apply(lm32.model)

        nll, tm = stream_policies(lm32, apply32, params32, ids, {"full": P.full()}, chunk=args.full_chunk,
                                  segment=args.segment, label="full f32")
        runs["full/float32"] = {"nll": nll["full"], "dtype": "float32", "policy": "full", "name": "full",
                                "chunk": args.full_chunk}
        timings.append(tm)
        nll, tm = stream_policies(lm32, apply32, params32, ids, f32_batch, segment=args.segment, label="float32")
        for k, v in nll.items():
            runs[f"{k}/float32"] = {"nll": v, "dtype": "float32", "policy": k, "name": f32_batch[k].name, "chunk": 1}
        timings.append(tm)

        if not args.no_bf16:
            lm16 = load_model(None, "bfloat16")
            apply16, params16 = split_apply(lm16.model)
            nll, tm = stream_policies(lm16, apply16, params16, ids, bf16_batch, segment=args.segment,
                                      label="bfloat16")
            for k, v in nll.items():
                runs[f"{k}/bfloat16"] = {"nll": v, "dtype": "bfloat16", "policy": k, "name": bf16_batch[k].name,
                                         "chunk": 1}
            timings.append(tm)

        if not args.no_hf:
            nll, tm = hf_reference_nll(lm32.path, ids, chunk=args.hf_chunk)
            runs["hf/float32"] = {"nll": nll, "dtype": "float32 (torch)", "policy": "hf_reference",
                                  "name": "HF transformers, full attention", "chunk": args.hf_chunk}
            timings.append(tm)

    for key, r in runs.items():
        check_finite(key, r["nll"])
        np.save(os.path.join(out_dir, f"nll_{key.replace('/', '_')}.npy"), r["nll"].astype(np.float32))
    config = {"text": os.path.abspath(args.text), "tokens": T, "window": W, "sinks": args.sinks, "delta": args.delta,
              "max_survivors": args.max_survivors, "block": 1, "overflow": "fifo", "quick": args.quick,
              "segment": args.segment, "model": lm32.path}
    write(out_dir, analyze(runs, config), timings, total.wall, total.cpu)
    return 0


def rescore(out_dir: str) -> int:
    """Rebuild the summary of an earlier run from its saved per-token NLL (no model runs)."""
    path = os.path.join(out_dir, "exp_policies.json")
    if not os.path.isfile(path):
        raise UsageError(f"--rescore: {path} not found")
    with open(path) as f:
        old = json.load(f)
    runs = {}
    for r in old["rows"]:
        nll = np.load(os.path.join(out_dir, f"nll_{r['key'].replace('/', '_')}.npy")).astype(np.float64)
        runs[r["key"]] = {"nll": nll, "dtype": r["dtype"], "policy": r["policy"], "name": r["name"], "chunk": r["chunk"]}
    write(out_dir, analyze(runs, old["config"]), old["timings"], old["total_wall_s"], old["total_cpu_s"])
    return 0


def write(out_dir: str, result: dict, timings: list, wall: float, cpu: float) -> None:
    result.update(timings=timings, total_wall_s=wall, total_cpu_s=cpu)
    with open(os.path.join(out_dir, "exp_policies.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(os.path.join(out_dir, "exp_policies.md"), "w") as f:
        f.write(md)
    print(md)
    status(f"wrote {out_dir}/exp_policies.json and exp_policies.md ({wall:.0f}s wall, {cpu:.0f}s CPU)")


def analyze(runs: dict, config: dict) -> dict:
    T, W = config["tokens"], config["window"]
    oracle = runs["rsqr/float32"]["nll"]
    rows = []
    for key, r in runs.items():
        row = {"key": key, "policy": r["policy"], "name": r["name"], "dtype": r["dtype"], "chunk": r["chunk"],
               "ppl": ppl(r["nll"]), "n_scored": int(r["nll"].size)}
        if r["policy"] in ("rsqr", "rerotate"):  # same token set as the oracle
            d = r["nll"] - oracle
            post = d[W - 1:]  # predictions made after the first eviction (before it every policy is full)
            row.update(mean_abs_dnll_vs_oracle=float(np.mean(np.abs(d))), max_abs_dnll_vs_oracle=float(np.max(np.abs(d))),
                       dppl_vs_oracle=row["ppl"] - ppl(oracle), rel_dppl_vs_oracle=row["ppl"] / ppl(oracle) - 1,
                       excess_nll_after_fill=float(post.mean()), excess_nll_after_fill_ci95=block_bootstrap(post, W),
                       mean_abs_dnll_per_1k=[float(np.mean(np.abs(d[i:i + 1000]))) for i in range(0, d.size, 1000)])
        if T >= 2048 and r["policy"] in ("full", "hf_reference"):
            row["ppl_first_2048"] = ppl(r["nll"][:2047])
            row["ppl_first_512"] = ppl(r["nll"][:511])
        rows.append(row)
    by = {r["key"]: r for r in rows}

    checks = {}
    s, z = by["streamingllm/float32"]["ppl"], by["rsqr_delta0/float32"]["ppl"]
    checks["rsqr_delta0_matches_streamingllm"] = {"rel_diff": abs(z / s - 1), "tol": REL_TOL,
                                                 "mean_abs_dnll": float(np.mean(np.abs(
                                                     runs["rsqr_delta0/float32"]["nll"] - runs["streamingllm/float32"]["nll"]))),
                                                 "pass": abs(z / s - 1) < REL_TOL}
    w = by["window/float32"]["ppl"]
    checks["window_worse_than_streamingllm"] = {"window_ppl": w, "streamingllm_ppl": s, "ratio": w / s, "pass": w > s}
    if "rsqr/bfloat16" in by:
        r16, q16 = by["rsqr/bfloat16"], by["rerotate/bfloat16"]
        checks["rerotate_bf16_further_from_oracle_than_rsqr_bf16"] = {
            "rsqr_mean_abs_dnll": r16["mean_abs_dnll_vs_oracle"], "rerotate_mean_abs_dnll": q16["mean_abs_dnll_vs_oracle"],
            "rsqr_dppl": r16["dppl_vs_oracle"], "rerotate_dppl": q16["dppl_vs_oracle"],
            "mean_abs_dnll_rerotate_vs_rsqr_bf16": float(np.mean(np.abs(runs["rerotate/bfloat16"]["nll"]
                                                                        - runs["rsqr/bfloat16"]["nll"]))),
            "rerotate_excess_nll_after_fill": q16["excess_nll_after_fill"],
            "rerotate_excess_nll_ci95": q16["excess_nll_after_fill_ci95"],
            "rerotate_ppl_effect_significant": not (q16["excess_nll_after_fill_ci95"][0] <= 0
                                                    <= q16["excess_nll_after_fill_ci95"][1]),
            "pass": (q16["mean_abs_dnll_vs_oracle"] > r16["mean_abs_dnll_vs_oracle"]
                     and abs(q16["dppl_vs_oracle"]) > abs(r16["dppl_vs_oracle"]))}
    if "hf/float32" in runs:
        f, h = by["full/float32"]["ppl"], by["hf/float32"]["ppl"]
        checks["full_matches_hf"] = {"full_ppl": f, "hf_ppl": h, "rel_diff": abs(f / h - 1),
                                     "mean_abs_dnll": float(np.mean(np.abs(runs["full/float32"]["nll"]
                                                                           - runs["hf/float32"]["nll"]))),
                                     "pass": abs(f / h - 1) < REL_TOL}

    return {"config": config, "rows": rows, "checks": checks}


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    if isinstance(x, list):
        return "[" + ", ".join(_fmt(v) for v in x) + "]"
    return str(x)


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [f"{c['tokens']} tokens of {os.path.basename(c['text'])}, W={c['window']}, N={c['sinks']}, "
             f"delta={c['delta']}, S={c['max_survivors']} (fifo), token by token unless noted; "
             f"oracle = rsqr float32.", "",
             "| run | dtype | ppl | Δppl vs oracle | mean \\|ΔNLL\\| vs oracle | max \\|ΔNLL\\| "
             "| excess NLL after fill [95% block CI] |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        name = r["name"] + (f" (chunk {r['chunk']})" if r["chunk"] != 1 else "")
        if "mean_abs_dnll_vs_oracle" in r:
            lo, hi = r["excess_nll_after_fill_ci95"]
            extra = (f"{r['dppl_vs_oracle']:+.4f} ({100 * r['rel_dppl_vs_oracle']:+.3f}%) | "
                     f"{r['mean_abs_dnll_vs_oracle']:.2e} | {r['max_abs_dnll_vs_oracle']:.2e} | "
                     f"{r['excess_nll_after_fill']:+.4f} [{lo:+.4f}, {hi:+.4f}]")
        else:
            extra = "– | – | – | –"
        lines.append(f"| {name} | {r['dtype']} | {r['ppl']:.4f} | {extra} |")
    lines += ["", "| check | figures | pass |", "|---|---|---|"]
    for k, v in result["checks"].items():
        figs = ", ".join(f"{a}={_fmt(b)}" for a, b in v.items() if a != "pass")
        lines.append(f"| {k} | {figs} | {'yes' if v['pass'] else '**no**'} |")
    per_k = [r for r in result["rows"] if "mean_abs_dnll_per_1k" in r and r["key"] != "rsqr/float32"]
    if per_k:
        n = max(len(r["mean_abs_dnll_per_1k"]) for r in per_k)
        lines += ["", "mean \\|ΔNLL\\| vs oracle per 1000 scored tokens:", "",
                  "| run | dtype | " + " | ".join(f"{1000 * i}–{min(1000 * (i + 1), c['tokens'] - 1)}" for i in range(n))
                  + " |", "|---|---|" + "---:|" * n]
        lines += [f"| {r['policy']} | {r['dtype']} | " + " | ".join(f"{v:.4f}" for v in r["mean_abs_dnll_per_1k"]) + " |"
                  for r in per_k]
    firsts = [r for r in result["rows"] if "ppl_first_2048" in r]
    if firsts:
        lines += ["", "| run | ppl first 512 | ppl first 2048 |", "|---|---:|---:|"]
        lines += [f"| {r['name']} | {r['ppl_first_512']:.4f} | {r['ppl_first_2048']:.4f} |" for r in firsts]
    lines += ["", "| run | policies | wall s | CPU s | steady s/token (wall) |", "|---|---|---:|---:|---:|"]
    for t in result["timings"]:
        st = t.get("steady_s_per_token")
        lines.append(f"| {t['label']} | {', '.join(t.get('policies', ['hf']))} | {t['wall_s']:.0f} | {t['cpu_s']:.0f} | "
                     f"{'–' if st is None else f'{st:.3f}'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run_main(main)
