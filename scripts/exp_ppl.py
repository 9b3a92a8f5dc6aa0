#!/usr/bin/env python3
"""Issue 6 section 3: streaming perplexity of every policy on Frankenstein, per 1k tokens (table + plot).

    python scripts/exp_ppl.py --quick                       # CI smoke (~1-2 min): 512 tokens, W=64, float32
    python scripts/exp_ppl.py                               # default grid, sized to < 30 min on 2 idle cores
    python scripts/exp_ppl.py --tokens 20000 --full-tokens 20000 --replay-tokens 20000 --bf16-policies same
                                                            # the full issue-6 grid (hours on CPU)

Default grid: float32 W=256 4096 tokens, float32 W=1024 3072, bfloat16 W=256 2048 and W=1024 1536
(--cell-tokens); bfloat16 cells run streamingllm, rerotate (block 1 and 8), rsqr, rsqr_precompute.

For each (W, dtype) cell, the token-by-token policies (window, streamingllm, leave_gaps, rerotate block 1,
rerotate block 8, rsqr, rsqr_precompute) stream the text in ONE vmapped stream_nll call (one compilation,
weights shared); `full` runs once per dtype (it does not depend on W) with chunked prefill (exact for
full; --full-chunk) over at most --full-tokens tokens; `replay` (a full forward over the cache at every
eviction event, so very expensive) runs alone with block --replay-block over at most --replay-tokens.
Policy parameters: N sinks, survivor stride delta, max survivors S (fifo) as given (defaults 4 / 8 / 64).
Writes OUT/exp_ppl.json, OUT/exp_ppl.md and a PNG of the per-1k-token perplexity curves.
"""

from __future__ import annotations

import json
import os
import signal

import numpy as np

from _common import DEFAULT_TEXT, Parser, UsageError, run_main, status
from _stream_exp import Interrupted, Timer, block_bootstrap, check_finite, ppl, ppl_curve, stream_policies

VMAPPED = ("window", "streamingllm", "leave_gaps", "rerotate", "rerotate_b8", "rsqr", "rsqr_precompute")
ALL = ("full",) + VMAPPED + ("replay",)
# bfloat16 is ~3x slower per step than float32 on XLA:CPU: by default its cells run the rank-timeline
# policies whose numerics differ (rotation in the storage dtype) and fewer tokens.
BF16_DEFAULT = ("streamingllm", "rerotate", "rerotate_b8", "rsqr", "rsqr_precompute")
DEFAULT_CELL_TOKENS = "1024/float32=3072,256/bfloat16=2048,1024/bfloat16=1536"


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default=str(DEFAULT_TEXT))
    p.add_argument("--tokens", type=int, default=None, help="tokens streamed per cell (default 4096; --quick 512)")
    p.add_argument("--windows", default=None, help="comma-separated windows W (default 256,1024; --quick 64)")
    p.add_argument("--dtypes", default=None, help="comma-separated: float32, bfloat16 (default both; --quick float32)")
    p.add_argument("--policies", default=",".join(ALL), help=f"float32 cells: comma-separated subset of {','.join(ALL)}")
    p.add_argument("--bf16-policies", default=",".join(BF16_DEFAULT),
                   help="bfloat16 cells: subset as for --policies, or 'same' (= --policies)")
    p.add_argument("--cell-tokens", default=None,
                   help="per-cell override of --tokens, W/dtype=N terms (default: " + DEFAULT_CELL_TOKENS
                        + "; '' for none)")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--delta", type=int, default=8)
    p.add_argument("--max-survivors", type=int, default=64)
    p.add_argument("--full-tokens", type=int, default=None, help="cap for full (default 4096)")
    p.add_argument("--full-chunk", type=int, default=256)
    p.add_argument("--replay-tokens", type=int, default=None, help="cap for replay (default W+512; --quick W+96)")
    p.add_argument("--replay-block", type=int, default=None, help="replay eviction block (default 32; --quick 16)")
    p.add_argument("--bucket", type=int, default=None, help="tokens per point of the curves (default 1000; --quick 128)")
    p.add_argument("--segment", type=int, default=256, help="tokens per jitted call")
    p.add_argument("--piece-segments", type=int, default=8,
                   help="segments per piece: the unit kept when a run is interrupted (SIGTERM/Ctrl-C)")
    p.add_argument("--quick", action="store_true", help="tiny configuration for CI")
    p.add_argument("--out", default=None, help="output directory (default runs/exp_ppl[_quick])")
    p.add_argument("--plot", default=None, help="PNG path (default OUT/exp_ppl.png)")
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


def _policies(s: str, what: str) -> list[str]:
    pols = [x for x in s.split(",") if x]
    bad = [x for x in pols if x not in ALL]
    if bad or not pols:
        raise UsageError(f"{what}: unknown {','.join(bad) or '(none)'}; choose from {','.join(ALL)}")
    return pols


def parse(args) -> dict:
    q = args.quick
    T = args.tokens or (512 if q else 4096)
    windows = _ints(args.windows or ("64" if q else "256,1024"), "--windows")
    dtypes = [d for d in (args.dtypes or ("float32" if q else "float32,bfloat16")).split(",") if d]
    bad = [d for d in dtypes if d not in ("float32", "bfloat16")]
    if bad or not dtypes:
        raise UsageError(f"--dtypes: choose from float32,bfloat16, got {args.dtypes!r}")
    pols = {"float32": _policies(args.policies, "--policies")}
    pols["bfloat16"] = pols["float32"] if args.bf16_policies == "same" else _policies(args.bf16_policies,
                                                                                    "--bf16-policies")
    cell_tokens = {}
    spec = args.cell_tokens if args.cell_tokens is not None else ("" if q or args.tokens else DEFAULT_CELL_TOKENS)
    for term in [t for t in spec.split(",") if t]:
        try:
            cell, n = term.split("=")
            w, d = cell.split("/")
            cell_tokens[(int(w), d)] = int(n)
        except ValueError:
            raise UsageError(f"--cell-tokens: bad term {term!r} (expected W/dtype=N)") from None
    full_T = min(T, args.full_tokens or 4096)
    replay_b = args.replay_block or (16 if q else 32)
    bucket = args.bucket or (128 if q else 1000)
    for n in [T, full_T, args.replay_tokens or 2] + list(cell_tokens.values()):
        if n < 2:
            raise UsageError("token counts must be >= 2")
    if bucket < 1 or args.segment < 1 or args.full_chunk < 1 or args.segment % args.full_chunk:
        raise UsageError("--bucket and --segment must be positive, and --full-chunk must divide --segment")
    return dict(T=T, windows=windows, dtypes=dtypes, pols=pols, cell_tokens=cell_tokens, full_T=full_T,
                replay_b=replay_b, bucket=bucket)


def main() -> int:
    args = build_parser().parse_args()
    if args.merge and not args.rescore:
        raise UsageError("--merge needs --rescore DIR (the run the cells are added to)")
    if args.rescore:
        if args.merge:
            merge(args.rescore, args.merge)
        return rescore(args.rescore, args.plot or os.path.join(args.rescore, "exp_ppl.png"))
    cfg = parse(args)
    T, windows, dtypes, pols, cell_tokens = cfg["T"], cfg["windows"], cfg["dtypes"], cfg["pols"], cfg["cell_tokens"]
    full_T, replay_b, bucket = cfg["full_T"], cfg["replay_b"], cfg["bucket"]

    def replay_T(W, Tc):
        return min(Tc, args.replay_tokens or W + (96 if args.quick else 512))
    out_dir = args.out or os.path.join("runs", "exp_ppl_quick" if args.quick else "exp_ppl")
    os.makedirs(out_dir, exist_ok=True)
    plot_path = args.plot or os.path.join(out_dir, "exp_ppl.png")

    from eval_stream import read_tokens
    from models.llama import load_model, split_apply
    from rsqr_jax import policy as P

    kw = dict(n_sink=args.sinks, delta=args.delta, max_survivors=args.max_survivors)

    def make(key, W):
        if key == "window":
            return P.make_policy("window", window=W)
        if key == "streamingllm":
            return P.make_policy("streamingllm", window=W, n_sink=args.sinks)
        if key == "rerotate_b8":
            return P.make_policy("rerotate", window=W, block=8, **kw)
        if key == "replay":
            return P.make_policy("replay", window=W, block=replay_b, **kw)
        return P.make_policy(key, window=W, **kw)

    max_T = max([T] + list(cell_tokens.values()))
    cells, timings, interrupted = [], [], None

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)  # a killed run still writes what it finished (see Interrupted)

    def cell(W, dtype, Tc, runs):
        cells.append({"window": W, "dtype": dtype, "tokens": Tc, "nll": runs,
                      "names": {k: (P.full() if k == "full" else make(k, W)).name for k in runs}})

    with Timer() as total:
        runs, W, dtype, Tc = {}, None, None, 0
        try:
            for dtype in dtypes:
                lm = load_model(None, dtype)
                apply_fn, params = split_apply(lm.model)
                ids_all = read_tokens(lm.tokenizer, args.text, max_T)
                full_run, W, runs = None, None, {}
                if "full" in pols[dtype]:
                    nll, tm = stream_policies(lm, apply_fn, params, ids_all[:full_T], {"full": P.full()},
                                              chunk=args.full_chunk, segment=args.segment, label=f"full {dtype}", piece_segments=args.piece_segments)
                    full_run = nll["full"]
                    timings.append(tm)
                for W in windows:
                    Tc = cell_tokens.get((W, dtype), T)
                    ids = ids_all[:Tc]
                    runs = {} if full_run is None else {"full": full_run}
                    batch = {k: make(k, W) for k in VMAPPED if k in pols[dtype]}
                    if batch:
                        nll, tm = stream_policies(lm, apply_fn, params, ids, batch, segment=args.segment,
                                                  label=f"W={W} {dtype}", piece_segments=args.piece_segments)
                        runs.update(nll)
                        timings.append(tm)
                    if "replay" in pols[dtype]:
                        nll, tm = stream_policies(lm, apply_fn, params, ids[:replay_T(W, Tc)],
                                                  {"replay": make("replay", W)}, segment=args.segment,
                                                  label=f"replay W={W} {dtype}",
                                                  piece_segments=args.piece_segments)
                        runs.update(nll)
                        timings.append(tm)
                    cell(W, dtype, Tc, runs)
                    runs = {}
        except Interrupted as e:
            timings.append(e.timing)
            interrupted = {"during": e.timing["label"], "scored_tokens": e.timing["tokens"] - 1}
            runs.update({k: v for k, v in e.partial.items() if v.size})
            if W is not None and runs:
                cell(W, dtype, Tc, runs)

    result = summarize(cells, bucket)
    result.update(config={"text": os.path.abspath(args.text), "tokens": T, "cell_tokens": {f"{w}/{d}": n for (w, d), n in
                                                                                           cell_tokens.items()},
                          "windows": windows, "dtypes": dtypes, "policies": pols, "sinks": args.sinks,
                          "delta": args.delta, "max_survivors": args.max_survivors, "overflow": "fifo",
                          "full_tokens": full_T, "full_chunk": args.full_chunk,
                          "replay_tokens": {str(W): replay_T(W, T) for W in windows},
                          "replay_block": replay_b, "bucket": bucket, "quick": args.quick},
                  timings=timings, total_wall_s=total.wall, total_cpu_s=total.cpu, interrupted=interrupted)
    for c in cells:
        for k, v in c["nll"].items():
            np.save(os.path.join(out_dir, f"nll_W{c['window']}_{c['dtype']}_{k}.npy"), v.astype(np.float32))
    write(out_dir, result, plot_path)
    return 3 if interrupted else 0


def write(out_dir: str, result: dict, plot_path: str) -> None:
    with open(os.path.join(out_dir, "exp_ppl.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, plot_path)
    md = markdown(result)
    with open(os.path.join(out_dir, "exp_ppl.md"), "w") as f:
        f.write(md)
    print(md)
    i = result.get("interrupted")
    status(f"wrote {out_dir}/exp_ppl.json, exp_ppl.md, {plot_path} ({result['total_wall_s']:.0f}s wall, "
           f"{result['total_cpu_s']:.0f}s CPU)" + (f"; INTERRUPTED during {i['during']}: partial results" if i else ""))


def _read_run(out_dir: str, flag: str) -> dict:
    path = os.path.join(out_dir, "exp_ppl.json")
    if not os.path.isfile(path):
        raise UsageError(f"{flag}: {path} not found")
    with open(path) as f:
        return json.load(f)


def merge(out_dir: str, sources: list[str]) -> None:
    """Add the cells of separate runs (e.g. one cell run later) to out_dir's exp_ppl.json, so that one
    --rescore rebuilds a single table; the settings that define a cell must match."""
    import shutil

    dst = _read_run(out_dir, "--rescore")
    same = ("text", "sinks", "delta", "max_survivors", "overflow", "bucket")
    for src_dir in sources:
        src = _read_run(src_dir, "--merge")
        diff = [k for k in same if src["config"].get(k) != dst["config"].get(k)]
        if diff:
            raise UsageError(f"--merge: {src_dir} was run with {diff[0]}={src['config'].get(diff[0])!r}, "
                             f"{out_dir} with {dst['config'].get(diff[0])!r}")
        have = {(c["window"], c["dtype"]) for c in dst["cells"]}
        for c in src["cells"]:
            if (c["window"], c["dtype"]) in have:
                raise UsageError(f"--merge: {out_dir} already has the cell W={c['window']} {c['dtype']}")
            for k in c["runs"]:
                name = f"nll_W{c['window']}_{c['dtype']}_{k}.npy"
                shutil.copyfile(os.path.join(src_dir, name), os.path.join(out_dir, name))
            dst["cells"].append(c)
        dst["config"]["windows"] = sorted(set(dst["config"]["windows"]) | set(src["config"]["windows"]))
        dst["config"]["dtypes"] = [d for d in ("float32", "bfloat16")
                                   if d in dst["config"]["dtypes"] or d in src["config"]["dtypes"]]
        dst["config"].setdefault("merged_from", []).append(os.path.abspath(src_dir))
        redone = {t["label"] for t in src["timings"]}  # DIR's interrupted attempts at the cells SRC ran
        for t in [t for t in dst["timings"] if t["label"] in redone]:
            dst["timings"].remove(t)
            dst["total_wall_s"] -= t["wall_s"]
            dst["total_cpu_s"] -= t["cpu_s"]
        dst["timings"] += src["timings"]
        dst["total_wall_s"] += src["total_wall_s"]
        dst["total_cpu_s"] += src["total_cpu_s"]
        labels = {f"W={c['window']} {c['dtype']}" for c in dst["cells"]}
        runs_i = [r.get("interrupted") for r in (dst, src)]
        dst["interrupted"] = next((i for i in runs_i if i and i["during"] not in labels), None)
    order = {d: i for i, d in enumerate(("float32", "bfloat16"))}
    dst["cells"].sort(key=lambda c: (order[c["dtype"]], c["window"]))
    with open(os.path.join(out_dir, "exp_ppl.json"), "w") as f:
        json.dump(dst, f, indent=1)


def rescore(out_dir: str, plot_path: str) -> int:
    """Rebuild the summary, tables and plot of an earlier run from its saved per-token NLL (no model runs)."""
    old = _read_run(out_dir, "--rescore")
    cells = []
    for c in old["cells"]:
        nll = {k: np.load(os.path.join(out_dir, f"nll_W{c['window']}_{c['dtype']}_{k}.npy")).astype(np.float64)
               for k in c["runs"]}
        cells.append({"window": c["window"], "dtype": c["dtype"], "tokens": c["tokens"], "nll": nll,
                      "names": {k: r["name"] for k, r in c["runs"].items()}})
    result = summarize(cells, old["config"]["bucket"])
    result.update({k: old.get(k) for k in ("config", "timings", "total_wall_s", "total_cpu_s", "interrupted")})
    write(out_dir, result, plot_path)
    return 0


def summarize(cells: list[dict], bucket: int) -> dict:
    """Per cell and policy: ppl over its scored tokens, ppl over the prefix every run of the cell scored
    (comparable), the per-bucket curve, and mean |dNLL| against rsqr of the same cell and against rsqr
    float32 of the same window (the oracle: same token set, one rotation from raw): mean |dNLL|, relative dppl,
    and the excess NLL after the first eviction with a 95% block-bootstrap interval, overall and per bucket.
    rerotate_b8 is compared too; its window holds W..W+7 tokens, so its token set differs slightly."""
    oracle = {c["window"]: c["nll"]["rsqr"] for c in cells if c["dtype"] == "float32" and "rsqr" in c["nll"]}
    out = []
    for c in cells:
        n_common = min(v.size for v in c["nll"].values())
        runs = {}
        for k, v in c["nll"].items():
            check_finite(f"W={c['window']} {c['dtype']} {k}", v)
            r = {"name": c["names"][k], "n_scored": int(v.size), "ppl": ppl(v), "ppl_common": ppl(v[:n_common]),
                 "curve": ppl_curve(v, bucket)}
            same_set = k in ("rerotate", "rsqr", "rsqr_precompute")
            if same_set and "rsqr" in c["nll"] and k != "rsqr":
                r["mean_abs_dnll_vs_rsqr"] = float(np.mean(np.abs(v - c["nll"]["rsqr"])))
            o = oracle.get(c["window"])
            if (same_set or k == "rerotate_b8") and o is not None and not (k == "rsqr" and c["dtype"] == "float32"):
                n = min(o.size, v.size)
                d = v[:n] - o[:n]
                post = d[c["window"] - 1:]  # predictions after the first eviction (before it, all are full attention)
                r["mean_abs_dnll_vs_oracle"] = float(np.mean(np.abs(d)))
                r["rel_dppl_vs_oracle"] = ppl(v[:n]) / ppl(o[:n]) - 1
                r["excess_nll_after_fill"] = float(post.mean())
                r["excess_nll_after_fill_ci95"] = block_bootstrap(post, c["window"])
                r["excess_nll_per_bucket"] = [float(d[i:i + bucket].mean()) for i in range(0, n, bucket)]
            runs[k] = r
        out.append({"window": c["window"], "dtype": c["dtype"], "tokens": c["tokens"], "n_common": n_common,
                    "runs": runs})
    return {"cells": out}


def markdown(result: dict) -> str:
    cfg = result["config"]
    cells = result["cells"]
    keys = [k for k in ALL if any(k in c["runs"] for c in cells)]
    head = [f"W={c['window']} {c['dtype']} ({c['tokens']} tok)" for c in cells]
    lines = [f"Perplexity over each run's scored tokens (n in brackets when shorter than the cell). N={cfg['sinks']}, "
             f"delta={cfg['delta']}, S={cfg['max_survivors']} fifo; full chunk {cfg['full_chunk']}; replay block "
             f"{cfg['replay_block']}.", "",
             "| policy | " + " | ".join(head) + " |", "|---|" + "---:|" * len(cells)]
    for k in keys:
        vals = []
        for c in cells:
            r = c["runs"].get(k)
            if r is None:
                vals.append("–")
            else:
                short = f" (n={r['n_scored'] + 1})" if r["n_scored"] + 1 < c["tokens"] else ""
                vals.append(f"{r['ppl']:.3f}{short}")
        lines.append(f"| {k} | " + " | ".join(vals) + " |")
    if any(c["n_common"] + 1 < c["tokens"] for c in cells):
        lines += ["", "Perplexity over the prefix every run of the cell scored (comparable with the shorter runs):", "",
                  "| policy | " + " | ".join(f"W={c['window']} {c['dtype']} (first {c['n_common'] + 1} tok)"
                                             for c in cells) + " |", "|---|" + "---:|" * len(cells)]
        for k in keys:
            lines.append(f"| {k} | " + " | ".join(f"{c['runs'][k]['ppl_common']:.3f}" if k in c["runs"] else "–"
                                                   for c in cells) + " |")
    lines += ["", "Against rsqr float32 of the same window (the oracle: same token set; rerotate_b8's differs slightly): "
              "mean |ΔNLL| per token / relative Δppl / excess NLL per token after the first eviction "
              "[95% interval, resampling W-token blocks].",
              "", "| policy | " + " | ".join(head) + " |", "|---|" + "---:|" * len(cells)]
    for k in ("rsqr", "rsqr_precompute", "rerotate", "rerotate_b8"):
        vals = []
        for c in cells:
            r = c["runs"].get(k, {})
            if "mean_abs_dnll_vs_oracle" in r:
                lo, hi = r["excess_nll_after_fill_ci95"]
                vals.append(f"{r['mean_abs_dnll_vs_oracle']:.2e} / {100 * r['rel_dppl_vs_oracle']:+.2f}% / "
                            f"{r['excess_nll_after_fill']:+.4f} [{lo:+.4f}, {hi:+.4f}]")
            else:
                vals.append("oracle" if k == "rsqr" and c["dtype"] == "float32" and k in c["runs"] else "–")
        if any(v != "–" for v in vals):
            lines.append(f"| {k} | " + " | ".join(vals) + " |")
    for c in cells:
        n_b = max(len(r["curve"]) for r in c["runs"].values())
        edges = next(r["curve"] for r in c["runs"].values() if len(r["curve"]) == n_b)
        lines += ["", f"Per-{cfg['bucket']}-token perplexity, W={c['window']} {c['dtype']}:", "",
                  "| policy | " + " | ".join(f"{e['start']}–{e['end']}" for e in edges) + " |",
                  "|---|" + "---:|" * n_b]
        for k, r in c["runs"].items():
            vals = [f"{p['ppl']:.2f}" for p in r["curve"]] + ["–"] * (n_b - len(r["curve"]))
            lines.append(f"| {k} | " + " | ".join(vals) + " |")
        for k, r in c["runs"].items():
            if "excess_nll_per_bucket" in r:
                ex = r["excess_nll_per_bucket"]
                lines.append(f"| {k}: excess NLL vs oracle | " + " | ".join(f"{x:+.3f}" for x in ex)
                             + " | –" * (n_b - len(ex)) + " |")
    lines += ["", "| run | policies | tokens | wall s | CPU s | steady s/token (wall) |", "|---|---|---:|---:|---:|---:|"]
    for t in result["timings"]:
        st = t.get("steady_s_per_token")
        lines.append(f"| {t['label']} | {', '.join(t['policies'])} | {t['tokens']} | {t['wall_s']:.0f} | "
                     f"{t['cpu_s']:.0f} | {'–' if st is None else f'{st:.3f}'} |")
    lines.append(f"\nTotal: {result['total_wall_s']:.0f} s wall, {result['total_cpu_s']:.0f} s CPU.")
    if result.get("interrupted"):
        i = result["interrupted"]
        lines.append(f"\n**Interrupted** during `{i['during']}` after {i['scored_tokens']} scored tokens: partial results.")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    cells = result["cells"]
    if not cells:
        return
    fig, axes = plt.subplots(1, len(cells), figsize=(4.2 * len(cells) + 1.6, 3.6), squeeze=False, sharey=True)
    style = {"full": ("k", "-"), "window": ("tab:red", "-"), "streamingllm": ("tab:blue", "-"),
             "leave_gaps": ("tab:olive", "--"), "rerotate": ("tab:orange", "-"), "rerotate_b8": ("tab:orange", ":"),
             "rsqr": ("tab:green", "-"), "rsqr_precompute": ("tab:green", "--"), "replay": ("tab:purple", "-")}
    for ax, c in zip(axes[0], cells):
        for k, r in c["runs"].items():
            x = [(p["start"] + p["end"]) / 2000 for p in r["curve"]]
            col, ls = style.get(k, ("gray", "-"))
            ax.plot(x, [p["ppl"] for p in r["curve"]], color=col, ls=ls, marker=".", ms=3, lw=1, label=k)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_title(f"W={c['window']}, {c['dtype']}", fontsize=9)
        ax.set_xlabel("token position (k)")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel(f"perplexity per {result['config']['bucket']} tokens")
    legend = {}  # every policy of every panel, once (panels can hold different policy sets)
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(lab, h)
    axes[0][-1].legend(legend.values(), legend.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                       borderaxespad=0)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    run_main(main)
