"""The recall study's results: statistics per cell, recall.json, its markdown tables and the plot
(everything here works from records alone, so `--from-json` re-renders a run without a model)."""

from __future__ import annotations

import json
from pathlib import Path

from rsqr_jax.eval.runtime import ConfigError, portable_path, recorded_file, same_input
from rsqr_jax.eval.stats import mcnemar_p, wilson
from rsqr_lab.studies.recall_setup import ARMS, UNPROTECTED_SINKS, VARIANTS

# The RSQR author's published tables (repository null-Exception1/auto-kv-cache-eviction; model
# Qwen2.5-0.5B-Instruct). Study 1: README.md / METHODOLOGY.md; study 2: rsqr_precision_results_v1.md.
PUBLISHED = {
    "study1": {"model": "Qwen2.5-0.5B-Instruct", "float": "float32", "sinks": 6, "window": 24, "block": 8,
               "cycle_len": 16, "trials": 150, "facts": "3 pinned facts, single digit 2-8, argmax of one token",
               "n_cycles": [4, 8, 12, 16],
               "acc": {"replay": [84.0, 90.0, 87.3, 90.7], "rerotate": [82.7, 89.3, 88.7, 91.3],
                       "leave_gaps": [90.0, 95.3, 96.0, 95.3]}},
    "study2": {"model": "Qwen2.5-0.5B-Instruct", "float": "float32", "window": 24, "block": 8, "delta": 8,
               "cycle_len": 16, "trials": 60, "facts": "one fact (pinned in the harness), argmax of one token",
               "n_cycles": [2, 4, 6, 12, 16, 32],
               "acc": {"streamingllm": [93.3, 93.3, 91.7, 100.0, 96.7, 93.3],
                       "leave_gaps": [93.3, 61.7, 53.3, 28.3, 35.0, 18.3],
                       "rsqr": [80.0, 70.0, 73.3, 78.3, 86.7, 95.0]},
               "note": "rsqr collapsed to 0% at n_cycles=64 (unbounded survivors); excluded from the table"},
}


# ----------------------------------------------------------------------------------------------------
# Statistics.

def _cell_order(kv):
    return kv[0][0], kv[0][1], ARMS.index(kv[0][2]), kv[0][3]


def paired(records: list[dict], ref: str = "streamingllm") -> list[dict]:
    """Every arm vs `ref` on the same trials (all arms of a cell share the trials): discordant counts."""
    by: dict[tuple, dict] = {}
    for r in records:
        by.setdefault((r["variant"], r["dtype"], r["n_cycles"], r["trial"]), {})[r["arm"]] = r["correct"]
    cells: dict[tuple, list[int]] = {}
    for (variant, dtype, c, _), arms in by.items():
        if ref not in arms:
            continue
        for arm, ok in arms.items():
            if arm == ref:
                continue
            d = cells.setdefault((variant, dtype, arm, c), [0, 0, 0])
            d[0] += ok and not arms[ref]
            d[1] += arms[ref] and not ok
            d[2] += 1
    return [{"variant": v, "dtype": dt, "arm": a, "ref": ref, "n_cycles": c, "pairs": n, "arm_only": b,
             "ref_only": k, "mcnemar_p": mcnemar_p(b, k)}
            for (v, dt, a, c), (b, k, n) in sorted(cells.items(), key=_cell_order)]


def summarize(records: list[dict]) -> list[dict]:
    """Accuracy per (variant, dtype, arm, n_cycles) with its Wilson interval."""
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        cells.setdefault((r["variant"], r["dtype"], r["arm"], r["n_cycles"]), []).append(r)
    out = []
    for (variant, dtype, arm, c), rs in sorted(cells.items(), key=_cell_order):
        k, n = sum(r["correct"] for r in rs), len(rs)
        lo, hi = wilson(k, n)
        out.append({"variant": variant, "dtype": dtype, "arm": arm, "n_cycles": c, "trials": n, "correct": k,
                    "acc": k / n, "wilson_lo": lo, "wilson_hi": hi,
                    "mean_leading_digits": sum(r["digits"] for r in rs) / n})
    return out


# ----------------------------------------------------------------------------------------------------
# The result, and resuming from it.

def _same_setting(key: str, old, new) -> bool:
    """A fingerprint entry of the run to continue against this run's; the input files are compared as files (a
    run written from another working directory, or with an older absolute name, continues)."""
    if key in ("filler", "facts") and old is not None and new is not None:
        return same_input(old, recorded_file(new))
    return old == new


def load_resumable(path: Path, fingerprint: dict) -> dict:
    """The recall.json an interrupted run left, if it was run with the same fingerprint."""
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--resume: cannot read {path}: {e}") from None
    if "fingerprint" not in old or "arms_done" not in old:
        raise ConfigError(f"--resume: {path} was written without resume data (an older run); start a fresh --out")
    diff = [k for k in fingerprint if not _same_setting(k, old["fingerprint"].get(k), fingerprint[k])]
    if diff:
        k = diff[0]
        raise ConfigError(f"--resume: {path} was run with {k}={old['fingerprint'].get(k)!r}, this run has "
                          f"{fingerprint[k]!r}" + (f" (and {len(diff) - 1} more setting(s) differ)" if len(diff) > 1
                                                   else ""))
    return old


def unfinished(path: Path) -> bool:
    """Whether path holds an interrupted run (which a fresh run must not overwrite)."""
    try:
        return json.loads(Path(path).read_text()).get("complete") is False
    except (OSError, json.JSONDecodeError, AttributeError):
        return False



class RecallResult:
    """recall.json's content (`data`): protocol, summary (Wilson CIs), paired tests, layouts, every record."""

    def __init__(self, data: dict):
        self.data = data

    @property
    def complete(self) -> bool:
        return bool(self.data.get("complete", True))

    @classmethod
    def build(cls, cfg, meta: dict, records: list[dict], layouts: list[dict], arms_done, elapsed: float,
              token_rows: int, complete: bool, interrupted: str | None) -> "RecallResult":
        """From a RecallConfig, the run's fixed facts (`meta`: model path, token lengths, sinks, policies)
        and what the run has produced so far."""
        P_len, uncapped = meta["P_len"], meta["uncapped"]
        summary = summarize(records)
        if "pinned" in cfg.variants and "unprotected" in cfg.variants and "full" in cfg.arms:
            for s in [s for s in summary if s["variant"] == "pinned" and s["arm"] == "full" and s["dtype"] == "float32"]:
                if s["n_cycles"] in cfg.unprotected_cycles:
                    summary.append({**s, "variant": "unprotected", "shared_with": "pinned"})
        return cls({
            "model": {"path": meta["model_path"],
                      "name": "SmolLM2-135M-Instruct (embedded GGUF)" if cfg.model is None else cfg.model},
            "protocol": {
                "cycle_len": cfg.cycle_len, "cycle_definition": "one cycle = cycle_len filler tokens",
                "window": int(cfg.policy.window), "block": cfg.chunk, "chunk": cfg.chunk,
                "window_semantics": "the window keeps window..window+block-1 most recent tokens (docs/design.md §3)",
                "delta": int(cfg.policy.delta), "rsqr_uncapped_max_survivors": uncapped,
                "rsqr_cap_max_survivors": int(cfg.policy.max_survivors),
                "overflow": "fifo",
                "sinks": {"pinned": P_len, "unprotected": meta["unprotected_sinks"]},
                "preamble": cfg.preamble, "preamble_tokens": meta["n_preamble"],
                "pinned_definition": "n_sink = fact prefix length (preamble + facts): every fact token is a sink, "
                                     "never evicted",
                "unprotected_definition": f"n_sink = preamble + {UNPROTECTED_SINKS} ('The secret number of'): "
                                          "digits survive only in the window or as survivors",
                "n_facts": cfg.n_facts, "fact_prefix_tokens": P_len, "question_tokens": meta["Q_len"],
                "fact_template": "The secret number of NAME is DDDDDDD.",
                "question_template": " The secret number of NAME is", "gen_tokens": cfg.gen_tokens,
                "correct": "the asked number's digit string appears in the greedy answer",
                "digit_positions": meta["digit_pos"],
                "arm_policies": meta["arm_policies"],
                "filler": portable_path(cfg.filler), "facts": portable_path(cfg.facts) if cfg.facts else "built-in",
                "replay_evaluation": "short stream per (trial, checkpoint): sinks + last filler tokens (block-aligned)",
                "seed": cfg.seed,
            },
            "config": cfg.as_json(),
            "complete": complete,
            "interrupted_during": interrupted,
            "arms_done": list(arms_done),
            "fingerprint": cfg.fingerprint(),
            "summary": summary,
            "paired_vs_streamingllm": paired(records),
            "layout": layouts,
            "published": PUBLISHED,
            "runtime_s": elapsed,
            "token_rows": token_rows,
            "records": records,
        })

    @classmethod
    def from_json(cls, path) -> "RecallResult":
        try:
            return cls(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read {path}: {e}") from None

    def tables(self) -> str:
        """The accuracy, paired and layout tables (markdown)."""
        d = self.data
        parts = [table(d["summary"])]
        if d.get("records"):
            parts.append(paired_table(paired(d["records"])))
        parts.append(layout_table(d.get("layout", [])))
        return "\n".join(parts)

    def write(self, out_dir, *, with_plot: bool = True) -> None:
        """OUT/recall.json and (with_plot) OUT/recall.png."""
        from rsqr_jax.eval.runtime import write_json_atomic

        out_dir = Path(out_dir)
        write_json_atomic(out_dir / "recall.json", self.data)
        if with_plot:
            self.plot(out_dir / "recall.png")

    def plot(self, path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        plot(self.data["summary"], Path(path))


def arm_cycle_table(title: str, rows: list[dict], fmt) -> list[str]:
    """One markdown table: an arm per row, an n_cycles per column, fmt(row) in each cell."""
    cyc = sorted({r["n_cycles"] for r in rows})
    lines = [f"\n{title}", "| arm | " + " | ".join(f"c={c}" for c in cyc) + " |", "|---|" + "---|" * len(cyc)]
    for arm in ARMS:
        cells = {r["n_cycles"]: r for r in rows if r["arm"] == arm}
        if cells:
            lines.append(f"| {arm} | " + " | ".join(fmt(cells[c]) if c in cells else "" for c in cyc) + " |")
    return lines


def paired_table(rows: list[dict]) -> str:
    """Discordant pairs vs streamingllm: 'arm-only correct / streamingllm-only correct (exact McNemar p)'."""
    lines = []
    for variant in VARIANTS:
        for dtype in ("float32", "bfloat16"):
            sub = [r for r in rows if r["variant"] == variant and r["dtype"] == dtype]
            if sub:
                lines += arm_cycle_table(
                    f"{variant}, {dtype}: paired vs streamingllm, arm-only / streamingllm-only correct (p)", sub,
                    lambda r: f"{r['arm_only']}/{r['ref_only']} ({r['mcnemar_p']:.2g})")
    return "\n".join(lines)


def layout_table(layouts: list[dict]) -> str:
    """Per arm and n_cycles (float32): 'distance / survivors / digits', digits as counts of
    s(ink) v (survivor) w(indow) e(victed) for the first fact; distance '-' when every digit is gone."""

    def fmt(ly):
        f = ly["facts"][0]
        d = "".join(f"{v}{k[0] if k != 'survivor' else 'v'}" for k, v in f["digits"].items() if v)
        return f"{'-' if f['distance'] is None else f['distance']} / {ly['n_survivors']} / {d}"

    lines = []
    for variant in VARIANTS:
        sub = [ly for ly in layouts if ly["variant"] == variant and ly["dtype"] == "float32"]
        if sub:
            lines += arm_cycle_table(
                f"{variant}, float32: fact distance / survivors cached / digits (s v w e) before the question", sub, fmt)
    return "\n".join(lines)


def table(summary: list[dict]) -> str:
    """Accuracy % [Wilson 95%] per arm and n_cycles, one table per (variant, dtype)."""
    lines = []
    for variant in VARIANTS:
        for dtype in ("float32", "bfloat16"):
            rows = [s for s in summary if s["variant"] == variant and s["dtype"] == dtype]
            if rows:
                n = max(s["trials"] for s in rows)
                lines += arm_cycle_table(
                    f"{variant}, {dtype}, n={n}/cell: accuracy % [Wilson 95%]", rows,
                    lambda r: f"{100 * r['acc']:.0f} [{100 * r['wilson_lo']:.0f}-{100 * r['wilson_hi']:.0f}]")
    return "\n".join(lines)


def plot(summary: list[dict], path: Path) -> None:
    """Accuracy vs n_cycles per (variant, dtype), and the author's published curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(s["variant"], s["dtype"]) for s in summary},
                    key=lambda p: (VARIANTS.index(p[0]), ("float32", "bfloat16").index(p[1])))
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4.2 * (len(panels) + 1), 3.6), squeeze=False)
    colors = dict(zip(ARMS, ["black", "tab:purple", "tab:orange", "tab:red", "tab:blue", "tab:green", "tab:olive",
                            "tab:cyan"]))
    for ax, (variant, dtype) in zip(axes[0], panels):
        for arm in ARMS:
            rows = [s for s in summary if (s["variant"], s["dtype"], s["arm"]) == (variant, dtype, arm)]
            if not rows:
                continue
            x = [r["n_cycles"] * 2 ** (0.035 * (ARMS.index(arm) - 3)) for r in rows]  # jitter: visible overlaps
            y = [100 * r["acc"] for r in rows]
            err = [[max(0.0, 100 * (r["acc"] - r["wilson_lo"])) for r in rows],
                   [max(0.0, 100 * (r["wilson_hi"] - r["acc"])) for r in rows]]
            ax.errorbar(x, y, yerr=err, marker="o", ms=3, capsize=2, lw=1, color=colors[arm], label=arm)
        n = max(s["trials"] for s in summary if (s["variant"], s["dtype"]) == (variant, dtype))
        ax.set_title(f"{variant}, {dtype} (n={n}/cell)", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-3, 103)
        ax.set_xlabel("n_cycles")
        ax.set_ylabel("recall accuracy % (Wilson 95%)")
        ax.grid(alpha=0.3)
    busiest = max(range(len(panels)), key=lambda i: len({s["arm"] for s in summary
                                                          if (s["variant"], s["dtype"]) == panels[i]}))
    axes[0][busiest].legend(fontsize=7, loc="lower left")
    ax = axes[0][-1]
    for study, style in (("study1", "--"), ("study2", ":")):
        d = PUBLISHED[study]
        for arm, ys in d["acc"].items():
            ax.plot(d["n_cycles"], ys, style, marker="s", ms=3, color=colors[arm], label=f"{study} {arm}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-3, 103)
    ax.set_title("published (Qwen2.5-0.5B, author's harness)", fontsize=9)
    ax.set_xlabel("n_cycles")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


