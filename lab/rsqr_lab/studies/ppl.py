"""Streaming perplexity of every policy, per bucket of tokens, over a grid of (window W,
storage dtype) cells; tables, curves and the excess NLL against the float32 oracle (rsqr float32, same W).

Per cell the token-by-token policies of VMAPPED stream in ONE vmapped evaluation (one compilation, weights
shared); `full` runs once per dtype (it does not depend on W) with chunked prefill (exact for full) over at
most full_tokens tokens; `replay` (a full forward over the cache at every eviction event, very expensive)
runs alone with block replay_block over at most replay_tokens. An interruption keeps the finished pieces
(`streams.stream_policies`) and the result says where it stopped; `merge` joins cells run separately."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Callable

import numpy as np

from rsqr_jax import policy as P
from rsqr_jax.eval.runtime import (ConfigError, Timer, portable_path, read_tokens, recorded_file, same_input, status,
                                   write_json_atomic)
from rsqr_jax.eval.stats import block_bootstrap, check_finite, ppl, ppl_curve
from rsqr_jax.eval.perplexity import Interrupted, Model, stream_policies
from rsqr_jax.spec import ColdStore
from rsqr_lab.studies import base_policy

VMAPPED = ("window", "streamingllm", "leave_gaps", "rerotate", "rerotate_b8", "rsqr", "rsqr_precompute", "rsqr_recall")
ALL = ("full",) + VMAPPED + ("replay",)
# rsqr_recall (rsqr + the recall tier) is asked for by name: its cold store is allocated for every policy of
# its cell (they share one vmapped cache).
DEFAULT = tuple(k for k in ALL if k != "rsqr_recall")
# bfloat16 is ~3x slower per step than float32 on XLA:CPU: by default its cells run the rank-timeline
# policies whose numerics differ (rotation in the storage dtype) and fewer tokens.
BF16_DEFAULT = ("streamingllm", "rerotate", "rerotate_b8", "rsqr", "rsqr_precompute")
DEFAULT_CELL_TOKENS = {(1024, "float32"): 3072, (256, "bfloat16"): 2048, (1024, "bfloat16"): 1536}
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True, eq=False)  # holds a Policy (studies.base_policy)
class PplConfig:
    """tokens T per cell (cell_tokens: ((W, dtype), T) overrides); policies / bf16_policies: the subsets of
    ALL run in float32 / bfloat16 cells; policy: the base every run is derived from (its sinks, delta, max
    survivors, overflow and block; mode and window are each run's); full_tokens (resolved cap, <= tokens),
    replay_tokens (None: W + 512, quick W + 96), bucket: tokens per curve point; segment: tokens per jitted
    call; piece_segments: segments per piece, the unit an interruption keeps; recall_pages / cold: the recall
    tier of the rsqr_recall arm (the other runs recall nothing, so the pages are not the base policy's)."""

    text: str
    tokens: int = 4096
    windows: tuple[int, ...] = (256, 1024)
    dtypes: tuple[str, ...] = DTYPES
    policies: tuple[str, ...] = DEFAULT
    bf16_policies: tuple[str, ...] = BF16_DEFAULT
    cell_tokens: tuple[tuple[tuple[int, str], int], ...] = tuple(DEFAULT_CELL_TOKENS.items())
    policy: P.Policy = base_policy.field()
    full_tokens: int = 4096
    full_chunk: int = 256
    replay_tokens: int | None = None
    replay_block: int = 32
    bucket: int = 1000
    segment: int = 256
    piece_segments: int = 8
    recall_pages: int = 4
    cold: ColdStore = ColdStore()
    quick: bool = False

    @classmethod
    def make(cls, text: str, *, quick: bool = False, tokens=None, windows=None, dtypes=None, cell_tokens=None,
             full_tokens=None, replay_block=None, bucket=None, **kw) -> "PplConfig":
        """The config with the defaults of a plain or --quick run (512 tokens, W=64, float32) for what is
        None; cell_tokens {(W, dtype): T} defaults to DEFAULT_CELL_TOKENS unless quick or tokens is given."""
        T = tokens or (512 if quick else 4096)
        if cell_tokens is None:
            cell_tokens = {} if quick or tokens else DEFAULT_CELL_TOKENS
        return cls(text, tokens=T, windows=tuple(windows or ((64,) if quick else (256, 1024))),
                   dtypes=tuple(dtypes or (("float32",) if quick else DTYPES)), cell_tokens=tuple(cell_tokens.items()),
                   full_tokens=min(T, full_tokens or 4096), replay_block=replay_block or (16 if quick else 32),
                   bucket=bucket or (128 if quick else 1000), quick=quick, **kw)

    def __post_init__(self):
        bad = [d for d in self.dtypes if d not in DTYPES]
        if bad or not self.dtypes:
            raise ConfigError(f"--dtypes: choose from float32,bfloat16, got {','.join(self.dtypes)!r}")
        for what, pols in (("--policies", self.policies), ("--bf16-policies", self.bf16_policies)):
            bad = [x for x in pols if x not in ALL]
            if bad or not pols:
                raise ConfigError(f"{what}: unknown {','.join(bad) or '(none)'}; choose from {','.join(ALL)}")
        if not self.windows or min(self.windows) < 1:
            raise ConfigError(f"--windows: expected positive integers, got {self.windows}")
        for n in [self.tokens, self.full_tokens, self.replay_tokens or 2] + [n for _, n in self.cell_tokens]:
            if n < 2:
                raise ConfigError("token counts must be >= 2")
        if self.bucket < 1 or self.segment < 1 or self.full_chunk < 1 or self.segment % self.full_chunk:
            raise ConfigError("--bucket and --segment must be positive, and --full-chunk must divide --segment")
        base_policy.check(self.policy)

    def pols(self, dtype: str) -> tuple[str, ...]:
        return self.policies if dtype == "float32" else self.bf16_policies

    def cell_T(self, W: int, dtype: str) -> int:
        return dict(self.cell_tokens).get((W, dtype), self.tokens)

    def replay_T(self, W: int, Tc: int) -> int:
        return min(Tc, self.replay_tokens or W + (96 if self.quick else 512))

    def make_policy(self, key: str, W: int) -> P.Policy:
        """Run `key` at window W, from the base policy."""
        if key == "full":
            return P.full()
        if key == "rerotate_b8":
            return self.policy.replace(mode="rerotate", window=W, block=8)
        if key == "replay":
            return self.policy.replace(mode="replay", window=W, block=self.replay_block)
        if key == "rsqr_recall":
            return self.policy.replace(mode="rsqr", window=W, recall_pages=self.recall_pages)
        return self.policy.replace(mode=key, window=W)

    def to_json(self) -> dict:
        return {"text": portable_path(self.text), "tokens": self.tokens,
                "cell_tokens": {f"{w}/{d}": n for (w, d), n in self.cell_tokens}, "windows": list(self.windows),
                "dtypes": list(self.dtypes), "policies": {d: list(self.pols(d)) for d in DTYPES},
                **base_policy.settings(self.policy, ("sinks", "delta", "max_survivors", "overflow")),
                "full_tokens": self.full_tokens, "full_chunk": self.full_chunk,
                "replay_tokens": {str(W): self.replay_T(W, self.tokens) for W in self.windows},
                "replay_block": self.replay_block, "bucket": self.bucket, "quick": self.quick,
                **({"recall_pages": self.recall_pages, "cold": dataclasses.asdict(self.cold)}
                   if "rsqr_recall" in self.policies + self.bf16_policies else {})}


@dataclasses.dataclass
class PplResult:
    """cells: [{"window", "dtype", "tokens", "nll": {policy: float64 [n]}, "names": {policy: name}}];
    data: the exp_ppl.json object (cells, config, timings, total_wall_s, total_cpu_s, interrupted)."""

    cells: list
    data: dict

    @property
    def interrupted(self) -> dict | None:
        return self.data.get("interrupted")

    def to_json(self) -> dict:
        return self.data

    def markdown(self) -> str:
        return markdown(self.data)

    def plot(self, path: str) -> None:
        plot(self.data, path)

    def write(self, out_dir: str, plot_path: str | None = None) -> None:
        """OUT/exp_ppl.json, the plot (default OUT/exp_ppl.png), exp_ppl.md and nll_W<W>_<dtype>_<policy>.npy."""
        plot_path = plot_path or os.path.join(out_dir, "exp_ppl.png")
        os.makedirs(out_dir, exist_ok=True)
        for c in self.cells:
            for k, v in c["nll"].items():
                np.save(os.path.join(out_dir, f"nll_W{c['window']}_{c['dtype']}_{k}.npy"), v.astype(np.float32))
        write_json_atomic(os.path.join(out_dir, "exp_ppl.json"), self.data)
        self.plot(plot_path)
        with open(os.path.join(out_dir, "exp_ppl.md"), "w") as f:
            f.write(self.markdown())
        i, d = self.interrupted, self.data
        status(f"wrote {out_dir}/exp_ppl.json, exp_ppl.md, {plot_path} ({d['total_wall_s']:.0f}s wall, "
               f"{d['total_cpu_s']:.0f}s CPU)" + (f"; INTERRUPTED during {i['during']}: partial results" if i else ""))


def run(config: PplConfig, load: Callable[[str], Model], *, show_progress: bool = True) -> PplResult:
    """Every cell of the grid; load(dtype) gives the model in that storage dtype (called once per dtype).
    An interruption (KeyboardInterrupt inside stream_policies) ends the run with the finished pieces."""
    c = config
    kw = dict(segment=c.segment, piece_segments=c.piece_segments, show_progress=show_progress)
    max_T = max([c.tokens] + [n for _, n in c.cell_tokens])
    cells, timings, interrupted = [], [], None

    def cell(W, dtype, Tc, runs):
        cells.append({"window": W, "dtype": dtype, "tokens": Tc, "nll": runs,
                      "names": {k: c.make_policy(k, W).name for k in runs}})

    with Timer() as total:
        runs, W, dtype, Tc = {}, None, None, 0
        try:
            for dtype in c.dtypes:
                model = load(dtype)
                ids_all = read_tokens(model.tokenizer, c.text, max_T)
                full_run, W, runs = None, None, {}
                if "full" in c.pols(dtype):
                    nll, tm = stream_policies(model, ids_all[:c.full_tokens], {"full": P.full()}, chunk=c.full_chunk,
                                              label=f"full {dtype}", **kw)
                    full_run = nll["full"]
                    timings.append(tm)
                for W in c.windows:
                    Tc = c.cell_T(W, dtype)
                    ids_T = ids_all[:Tc]
                    runs = {} if full_run is None else {"full": full_run}
                    batch = {k: c.make_policy(k, W) for k in VMAPPED if k in c.pols(dtype)}
                    if batch:
                        nll, tm = stream_policies(model, ids_T, batch, label=f"W={W} {dtype}", cold=c.cold, **kw)
                        runs.update(nll)
                        timings.append(tm)
                    if "replay" in c.pols(dtype):
                        replay = {"replay": c.make_policy("replay", W)}
                        nll, tm = stream_policies(model, ids_T[:c.replay_T(W, Tc)], replay,
                                                  label=f"replay W={W} {dtype}", **kw)
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

    data = summarize(cells, c.bucket)
    data.update(config=c.to_json(), timings=timings, total_wall_s=total.wall, total_cpu_s=total.cpu,
                interrupted=interrupted)
    return PplResult(cells, data)


def _read_run(out_dir: str, flag: str) -> dict:
    path = os.path.join(out_dir, "exp_ppl.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{flag}: {path} not found")
    with open(path) as f:
        return json.load(f)


def merge(out_dir: str, sources: list[str]) -> None:
    """Add the cells of separate runs (e.g. one cell run later) to out_dir's exp_ppl.json (and copy their
    nll_*.npy in), so that one rescore rebuilds a single table; the settings that define a cell must match
    and a cell out_dir already has is an error."""
    dst = _read_run(out_dir, "--rescore")
    same = ("text", "sinks", "delta", "max_survivors", "overflow", "bucket")
    for src_dir in sources:
        src = _read_run(src_dir, "--merge")
        diff = [k for k in same if (not same_input(src["config"]["text"], recorded_file(dst["config"]["text"]))
                                    if k == "text" else src["config"].get(k) != dst["config"].get(k))]
        if diff:
            raise ConfigError(f"--merge: {src_dir} was run with {diff[0]}={src['config'].get(diff[0])!r}, "
                              f"{out_dir} with {dst['config'].get(diff[0])!r}")
        have = {(c["window"], c["dtype"]) for c in dst["cells"]}
        for c in src["cells"]:
            if (c["window"], c["dtype"]) in have:
                raise ConfigError(f"--merge: {out_dir} already has the cell W={c['window']} {c['dtype']}")
            for k in c["runs"]:
                name = f"nll_W{c['window']}_{c['dtype']}_{k}.npy"
                shutil.copyfile(os.path.join(src_dir, name), os.path.join(out_dir, name))
            dst["cells"].append(c)
        dst["config"]["windows"] = sorted(set(dst["config"]["windows"]) | set(src["config"]["windows"]))
        dst["config"]["dtypes"] = [d for d in DTYPES if d in dst["config"]["dtypes"] or d in src["config"]["dtypes"]]
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
    order = {d: i for i, d in enumerate(DTYPES)}
    dst["cells"].sort(key=lambda c: (order[c["dtype"]], c["window"]))
    write_json_atomic(os.path.join(out_dir, "exp_ppl.json"), dst)


def rescore(out_dir: str) -> PplResult:
    """Rebuild the summary of an earlier run from its saved per-token NLL (no model runs)."""
    old = _read_run(out_dir, "--rescore")
    cells = []
    for c in old["cells"]:
        nll = {k: np.load(os.path.join(out_dir, f"nll_W{c['window']}_{c['dtype']}_{k}.npy")).astype(np.float64)
               for k in c["runs"]}
        cells.append({"window": c["window"], "dtype": c["dtype"], "tokens": c["tokens"], "nll": nll,
                      "names": {k: r["name"] for k, r in c["runs"].items()}})
    data = summarize(cells, old["config"]["bucket"])
    data.update({k: old.get(k) for k in ("config", "timings", "total_wall_s", "total_cpu_s", "interrupted")})
    return PplResult(cells, data)


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
    """One log-scale panel per cell: the per-bucket perplexity curve of every policy (shared legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

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
