#!/usr/bin/env python3
"""Policy sweep: a grid of eviction policies streamed over the same text in ONE vmapped, jitted run.

    python scripts/sweep.py --grid "mode=rsqr,rerotate,leave_gaps,streamingllm window=64,128 delta=4,8,16" \\
        --tokens 512 --bucket 128 --out runs/sweep
    python scripts/sweep.py --grid "..." --devices 4      # shard the policy axis over 4 devices
                                                          # (on CPU: 4 simulated host devices)

Grid: whitespace-separated key=v1,v2 terms (cartesian product; identical policies kept once). Keys:
mode, window, sinks, delta, max_survivors, block, overflow. Writes to --out: sweep.csv, sweep.json
(rows with the per-bucket curve), sweep.md (table sorted by --sort), sweep_ppl.png, nll.npy [P, T-1].
"""

from __future__ import annotations

import itertools
import os
import sys

from _common import (DEFAULT_TEXT, REPO_ROOT, Parser, UsageError, add_model_args, check_model_args, run_main,
                     status)

DEFAULT_GRID = "mode=rsqr,rerotate,leave_gaps,streamingllm window=128,256 delta=4,8,16"
TASKS = ("ppl",)
SORTS = ("ppl", "name", "grid")
MODE_COLORS = {"full": "black", "window": "tab:gray", "streamingllm": "tab:blue", "leave_gaps": "tab:orange",
               "rerotate": "tab:red", "replay": "tab:purple", "rsqr": "tab:green", "rsqr_precompute": "tab:olive"}


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default=DEFAULT_GRID, help=f"policy grid (default: {DEFAULT_GRID!r})")
    p.add_argument("--task", default="ppl", help="ppl (streaming perplexity; the only task so far)")
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="UTF-8 text file (default: Frankenstein)")
    p.add_argument("--tokens", type=int, default=1024, help="number of tokens to stream (T-1 are scored)")
    p.add_argument("--devices", type=int, default=None,
                   help="devices to shard the policy axis over (default: all available; on CPU with N > 1, "
                        "N simulated host devices)")
    p.add_argument("--chunk", type=int, default=1, help="tokens per step (1 = exact token-by-token eviction)")
    p.add_argument("--segment", type=int, default=256, help="tokens per jitted call (progress granularity)")
    p.add_argument("--bucket", type=int, default=1000, help="tokens per point of the perplexity curve")
    p.add_argument("--sort", default="ppl", help="table order: ppl, name or grid")
    p.add_argument("--out", default=str(REPO_ROOT / "runs" / "sweep"), help="output directory")
    p.add_argument("--no-progress", action="store_true")
    add_model_args(p)
    return p


def check_args(args) -> None:
    check_model_args(args)
    if args.task not in TASKS:
        raise UsageError(f"--task must be one of {', '.join(TASKS)}, got {args.task!r}")
    if args.sort not in SORTS:
        raise UsageError(f"--sort must be one of {', '.join(SORTS)}, got {args.sort!r}")
    if args.tokens < 2:
        raise UsageError(f"--tokens must be >= 2, got {args.tokens}")
    if args.chunk < 1 or args.segment < 1 or args.segment % args.chunk:
        raise UsageError("--chunk must be >= 1 and divide --segment")
    if args.bucket < 1:
        raise UsageError(f"--bucket must be >= 1, got {args.bucket}")
    if args.devices is not None and args.devices < 1:
        raise UsageError(f"--devices must be >= 1, got {args.devices}")
    if not os.path.isfile(args.text):
        raise UsageError(f"text file not found: {args.text}")


def _request_host_devices(n: int | None) -> None:
    """Before JAX initializes its backends: let the CPU platform expose n devices (XLA_FLAGS is read at
    backend initialization, not at import; no effect on GPU/TPU backends)."""
    if n is None or n <= 1:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def write_outputs(out: str, rows: list[dict], meta: dict, sort: str) -> dict[str, str]:
    import csv
    import json

    os.makedirs(out, exist_ok=True)
    paths = {k: os.path.join(out, f) for k, f in
             (("csv", "sweep.csv"), ("json", "sweep.json"), ("md", "sweep.md"), ("png", "sweep_ppl.png"))}
    cols = ["rank", "name", "mode", "window", "n_sink", "delta", "max_survivors", "block", "overflow", "ppl", "nll",
            "cache_kib"]
    ordered = sorted_rows(rows, sort)
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for i, r in enumerate(ordered, 1):
            w.writerow({**r, "rank": i, "ppl": f"{r['ppl']:.6f}", "nll": f"{r['nll']:.6f}"})
    with open(paths["json"], "w") as f:
        json.dump({"meta": meta, "rows": ordered}, f, indent=1)
    with open(paths["md"], "w") as f:
        f.write(markdown_table(ordered, meta))
    plot(rows, meta, paths["png"])
    return paths


def sorted_rows(rows, sort):
    if sort == "ppl":
        return sorted(rows, key=lambda r: r["ppl"])
    if sort == "name":
        return sorted(rows, key=lambda r: r["name"])
    return list(rows)


def markdown_table(rows, meta) -> str:
    head = (f"Streaming perplexity, {meta['n_scored']} scored tokens of {os.path.basename(meta['text'])}, "
            f"{meta['dtype']}, chunk {meta['chunk']}; {meta['n_policies']} policies in one vmapped run "
            f"on {meta['devices']} device(s).\n\n")
    buckets = rows[0]["bucket_end"] if rows else []
    curve_cols = [f"ppl@{b}" for b in buckets] if len(buckets) > 1 else []
    lines = ["| # | policy | ppl | cache KiB |" + "".join(f" {c} |" for c in curve_cols),
             "|---:|---|---:|---:|" + "---:|" * len(curve_cols)]
    for i, r in enumerate(rows, 1):
        curve = "".join(f" {v:.2f} |" for v in r["ppl_curve"]) if curve_cols else ""
        lines.append(f"| {i} | `{r['name']}` | {r['ppl']:.3f} | {r['cache_kib']:.0f} |{curve}")
    return head + "\n".join(lines) + "\n"


def plot(rows, meta, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, max(4.5, 0.17 * len(rows) + 1.5)),
                                 gridspec_kw={"width_ratios": [1.2, 1]})
    # Colour = mode, line style = window (largest solid).
    windows = sorted({r["window"] for r in rows if r["mode"] != "full"}, reverse=True)
    styles = dict(zip(windows, itertools.cycle(["-", "--", ":", "-."])))
    by_mode = {r["mode"] for r in rows}
    for r in rows:
        x = np.asarray(r["bucket_end"])
        ax.plot(x, r["ppl_curve"], styles.get(r["window"], "-"), marker="o" if len(x) < 30 else None, ms=3, lw=1.2,
                color=MODE_COLORS.get(r["mode"], "tab:brown"), alpha=0.85, label=r["name"])
    ax.set_xlabel("scored tokens (end of bucket)")
    ax.set_ylabel(f"perplexity per {meta['bucket']}-token bucket")
    ax.set_yscale("log")
    ax.set_title(f"{meta['n_policies']} policies, {meta['n_scored']} tokens, {meta['dtype']}")
    ax.grid(alpha=0.3)
    if len(rows) <= 12:
        ax.legend(fontsize=7)
    ordered = sorted(rows, key=lambda r: r["ppl"])
    y = np.arange(len(ordered))
    bx.barh(y, [r["ppl"] for r in ordered], color=[MODE_COLORS.get(r["mode"], "tab:brown") for r in ordered])
    bx.set_yticks(y, [r["name"] for r in ordered], fontsize=6)
    bx.invert_yaxis()
    lo = min(r["ppl"] for r in ordered)
    hi = max(r["ppl"] for r in ordered)
    bx.set_xlim(lo * 0.9, hi * 1.02)
    bx.set_xlabel("overall perplexity (lower is better)")
    bx.grid(axis="x", alpha=0.3)
    handles = [plt.Line2D([], [], color=c, lw=3, label=m) for m, c in MODE_COLORS.items() if m in by_mode]
    handles += [plt.Line2D([], [], color="gray", ls=ls, label=f"W={w}") for w, ls in list(styles.items())[:4]]
    if len(rows) > 12:
        ax.legend(handles=handles, fontsize=8, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> int:
    args = build_parser().parse_args()
    check_args(args)
    _request_host_devices(args.devices)

    from rsqr_jax.policy import MODES, OVERFLOWS
    from rsqr_jax.sweep import policy_grid

    policies, names = policy_grid(args.grid)  # PolicyError -> one line, exit 2

    import time

    import jax
    import numpy as np

    from eval_stream import read_tokens
    from models.llama import load_model, split_apply
    from rsqr_jax.spec import CacheSpec
    from rsqr_jax.policy import unstack_policies
    from rsqr_jax.sweep import make_mesh, summarize, sweep_nll

    n_avail = len(jax.devices())
    n_dev = n_avail if args.devices is None else args.devices
    if n_dev > n_avail:
        raise UsageError(f"--devices {n_dev}: only {n_avail} {jax.default_backend()} device(s) available")
    loaded = load_model(args.model, args.dtype)
    apply_fn, params = split_apply(loaded.model, kernel=args.kernel)
    cfg = loaded.config
    ids = read_tokens(loaded.tokenizer, args.text, args.tokens)
    n_pol = len(names)
    mesh = make_mesh(n_dev) if n_dev > 1 else None
    status(f"{n_pol} policies x {args.tokens} tokens of {os.path.basename(args.text)}, {args.dtype}, "
           f"chunk {args.chunk}, {n_dev} {jax.default_backend()} device(s)")

    bar, done = None, [0]
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.tokens - 1, unit="tok", desc=f"sweep x{n_pol}", file=sys.stderr, leave=False)

    def progress(n):
        if bar is not None:
            bar.update(n - done[0])
        done[0] = n

    t0 = time.perf_counter()
    nll = sweep_nll(apply_fn, params, np.asarray([ids], np.int32), policies, config=cfg, dtype=args.dtype,
                    chunk=args.chunk, segment=args.segment, mesh=mesh, progress=progress)
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if not np.all(np.isfinite(nll)):
        status("warning: non-finite NLL in some policies")

    rows = summarize(nll, names, tokens_per_bucket=args.bucket)
    for r, pol in zip(rows, unstack_policies(policies)):
        h = pol.host()
        own = CacheSpec.for_policies(pol, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                     head_dim=cfg.head_dim, dtype=args.dtype, max_chunk=args.chunk,
                                     max_len=args.tokens)
        r.update(mode=MODES[h["mode"]], window=h["window"], n_sink=h["n_sink"], delta=h["delta"],
                 max_survivors=h["max_survivors"], block=h["block"], overflow=OVERFLOWS[h["overflow"]],
                 cache_kib=own.bytes_by_part(pol)["total"] / 1024)
    meta = {"task": args.task, "grid": args.grid, "text": os.path.abspath(args.text), "n_tokens": args.tokens,
            "n_scored": int(nll.shape[-1]), "dtype": args.dtype, "chunk": args.chunk, "segment": args.segment,
            "bucket": args.bucket, "n_policies": n_pol, "devices": n_dev, "backend": jax.default_backend(),
            "model": loaded.path, "elapsed_s": elapsed,
            "policy_tokens_per_s": n_pol * nll.shape[-1] / elapsed}
    os.makedirs(args.out, exist_ok=True)
    np.save(os.path.join(args.out, "nll.npy"), nll[:, 0])
    paths = write_outputs(args.out, rows, meta, args.sort)
    best = sorted_rows(rows, "ppl")[0]
    print(f"{n_pol} policies in {elapsed:.1f}s ({meta['policy_tokens_per_s']:.0f} policy-tokens/s); "
          f"best: {best['name']} ppl {best['ppl']:.3f}")
    for k in ("md", "csv", "json", "png"):
        print(f"  {paths[k]}")
    return 0


if __name__ == "__main__":
    run_main(main)
