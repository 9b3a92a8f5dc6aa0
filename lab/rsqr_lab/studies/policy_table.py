"""The policy table: every policy on the first N tokens of a text, token by token, against the
float32 oracle (rsqr float32 with the same parameters: docs/design.md §4, every rank-timeline policy computes
the same function of the same token set, and rsqr rotates every key from raw exactly once).

Runs: full float32 with chunked prefill (exact for full); one vmapped float32 batch (window, streamingllm,
rsqr delta=0, rsqr, rerotate block 1); optionally one bfloat16 batch (rsqr, rerotate) and the HF
transformers torch reference (full attention, same GGUF weights). Checks: rsqr(delta=0) is streamingllm,
dropping the sinks hurts, rerotate bfloat16 drifts further from the oracle than rsqr bfloat16, full
matches HF."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

import numpy as np

from rsqr_jax import policy as P
from rsqr_jax.eval.runtime import ConfigError, Timer, portable_path, read_tokens, status, write_json_atomic
from rsqr_jax.eval.stats import block_bootstrap, check_finite, ppl
from rsqr_jax.eval.perplexity import Model, stream_policies
from rsqr_lab.studies import base_policy
from rsqr_lab.testing.hf_reference import hf_reference_nll

REL_TOL = 1e-3  # rsqr(delta=0) vs streamingllm (and full vs HF), relative perplexity


@dataclasses.dataclass(frozen=True, eq=False)  # holds a Policy (studies.base_policy)
class PoliciesConfig:
    """tokens T streamed; policy: the base every run is derived from (window W, sinks N, survivor stride delta,
    max survivors S, overflow, block; the library's defaults: block 1, fifo). segment: tokens per jitted call;
    full_chunk / hf_chunk: chunk of the full and torch runs."""

    text: str
    tokens: int = 4096
    policy: P.Policy = base_policy.field()
    segment: int = 256
    full_chunk: int = 256
    hf_chunk: int = 512
    hf: bool = True
    bf16: bool = True
    quick: bool = False

    @classmethod
    def make(cls, text: str, *, quick: bool = False, tokens: int | None = None, window: int | None = None,
             policy: P.Policy | None = None, **kw):
        """The config with --quick's defaults (512 tokens, W=64) for what is not given: the base policy's window
        is `window`, else 64 with --quick, else its own (policy None: the library's defaults)."""
        base = base_policy.check(policy) if policy is not None else P.make_policy("rsqr")
        return cls(text, tokens=tokens or (512 if quick else 4096),
                   policy=base.replace(window=window or (64 if quick else int(base.window))), quick=quick, **kw)

    def __post_init__(self):
        W = int(base_policy.check(self.policy).window)
        if self.tokens < 2 * W:
            raise ConfigError(f"--tokens {self.tokens} must be at least twice the window {W} (evictions must happen)")
        if self.segment < 1 or self.full_chunk < 1 or self.hf_chunk < 1:
            raise ConfigError("--segment, --full-chunk and --hf-chunk must be positive")
        if self.segment % self.full_chunk:
            raise ConfigError("--full-chunk must divide --segment")

    def batches(self) -> tuple[dict, dict]:
        """({key: Policy} of the float32 batch, of the bfloat16 batch), each from the base policy."""
        base = self.policy
        f32 = {"window": base.replace(mode="window"), "streamingllm": base.replace(mode="streamingllm"),
               "rsqr_delta0": base.replace(mode="rsqr", delta=0), "rsqr": base.replace(mode="rsqr"),
               "rerotate": base.replace(mode="rerotate")}
        return f32, {"rsqr": f32["rsqr"], "rerotate": f32["rerotate"]}

    def to_json(self, model_path: str) -> dict:
        keys = ("window", "sinks", "delta", "max_survivors", "block", "overflow")
        return {"text": portable_path(self.text), "tokens": self.tokens, **base_policy.settings(self.policy, keys),
                "quick": self.quick, "segment": self.segment, "model": model_path}


@dataclasses.dataclass
class PoliciesResult:
    """runs: {run key "policy/dtype": {"nll" float64 [T-1], "dtype", "policy", "name", "chunk"}};
    data: the exp_policies.json object (config, rows, checks, timings, total_wall_s, total_cpu_s)."""

    runs: dict
    data: dict

    def to_json(self) -> dict:
        return self.data

    def markdown(self) -> str:
        return markdown(self.data)

    def write(self, out_dir: str) -> None:
        """OUT/exp_policies.json, exp_policies.md and nll_<policy>_<dtype>.npy (float32) per run."""
        os.makedirs(out_dir, exist_ok=True)
        for key, r in self.runs.items():
            np.save(os.path.join(out_dir, f"nll_{key.replace('/', '_')}.npy"), r["nll"].astype(np.float32))
        write_json_atomic(os.path.join(out_dir, "exp_policies.json"), self.data)
        with open(os.path.join(out_dir, "exp_policies.md"), "w") as f:
            f.write(self.markdown())
        status(f"wrote {out_dir}/exp_policies.json and exp_policies.md ({self.data['total_wall_s']:.0f}s wall, "
               f"{self.data['total_cpu_s']:.0f}s CPU)")


def run(config: PoliciesConfig, load: Callable[[str], Model], *, show_progress: bool = True) -> PoliciesResult:
    """Stream the batches; load(dtype) gives the model in that storage dtype (called once per dtype)."""
    c = config
    f32_batch, bf16_batch = c.batches()
    runs: dict[str, dict] = {}
    timings = []

    def add(nll: dict, batch: dict, dtype: str, chunk: int):
        for k, v in nll.items():
            runs[f"{k}/{dtype}"] = {"nll": v, "dtype": dtype, "policy": k, "name": batch[k].name, "chunk": chunk}

    kw = dict(segment=c.segment, show_progress=show_progress)
    with Timer() as total:
        lm32 = load("float32")
        ids_T = read_tokens(lm32.tokenizer, c.text, c.tokens)
        nll, tm = stream_policies(lm32, ids_T, {"full": P.full()}, chunk=c.full_chunk, label="full f32", **kw)
        add(nll, {"full": P.full()}, "float32", c.full_chunk)
        timings.append(tm)
        nll, tm = stream_policies(lm32, ids_T, f32_batch, label="float32", **kw)
        add(nll, f32_batch, "float32", 1)
        timings.append(tm)
        if c.bf16:
            nll, tm = stream_policies(load("bfloat16"), ids_T, bf16_batch, label="bfloat16", **kw)
            add(nll, bf16_batch, "bfloat16", 1)
            timings.append(tm)
        if c.hf:
            nll, tm = hf_reference_nll(lm32.path, ids_T, chunk=c.hf_chunk, show_progress=show_progress)
            runs["hf/float32"] = {"nll": nll, "dtype": "float32 (torch)", "policy": "hf_reference",
                                  "name": "HF transformers, full attention", "chunk": c.hf_chunk}
            timings.append(tm)
    for key, r in runs.items():
        check_finite(key, r["nll"])
    data = analyze(runs, c.to_json(lm32.path))
    data.update(timings=timings, total_wall_s=total.wall, total_cpu_s=total.cpu)
    return PoliciesResult(runs, data)


def rescore(out_dir: str) -> PoliciesResult:
    """Rebuild the summary of an earlier run from its saved per-token NLL (no model runs)."""
    path = os.path.join(out_dir, "exp_policies.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--rescore: {path} not found")
    with open(path) as f:
        old = json.load(f)
    runs = {}
    for r in old["rows"]:
        nll = np.load(os.path.join(out_dir, f"nll_{r['key'].replace('/', '_')}.npy")).astype(np.float64)
        runs[r["key"]] = {"nll": nll, "dtype": r["dtype"], "policy": r["policy"], "name": r["name"], "chunk": r["chunk"]}
    data = analyze(runs, old["config"])
    data.update(timings=old["timings"], total_wall_s=old["total_wall_s"], total_cpu_s=old["total_cpu_s"])
    return PoliciesResult(runs, data)


def analyze(runs: dict, config: dict) -> dict:
    """Rows (ppl; against the oracle for the policies of its token set) and the checks."""
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

    def mean_abs(a, b):
        return float(np.mean(np.abs(runs[a]["nll"] - runs[b]["nll"])))

    checks = {}
    s, z = by["streamingllm/float32"]["ppl"], by["rsqr_delta0/float32"]["ppl"]
    checks["rsqr_delta0_matches_streamingllm"] = {"rel_diff": abs(z / s - 1), "tol": REL_TOL,
                                                 "mean_abs_dnll": mean_abs("rsqr_delta0/float32", "streamingllm/float32"),
                                                 "pass": abs(z / s - 1) < REL_TOL}
    w = by["window/float32"]["ppl"]
    checks["window_worse_than_streamingllm"] = {"window_ppl": w, "streamingllm_ppl": s, "ratio": w / s, "pass": w > s}
    if "rsqr/bfloat16" in by:
        r16, q16 = by["rsqr/bfloat16"], by["rerotate/bfloat16"]
        ci = q16["excess_nll_after_fill_ci95"]
        checks["rerotate_bf16_further_from_oracle_than_rsqr_bf16"] = {
            "rsqr_mean_abs_dnll": r16["mean_abs_dnll_vs_oracle"], "rerotate_mean_abs_dnll": q16["mean_abs_dnll_vs_oracle"],
            "rsqr_dppl": r16["dppl_vs_oracle"], "rerotate_dppl": q16["dppl_vs_oracle"],
            "mean_abs_dnll_rerotate_vs_rsqr_bf16": mean_abs("rerotate/bfloat16", "rsqr/bfloat16"),
            "rerotate_excess_nll_after_fill": q16["excess_nll_after_fill"],
            "rerotate_excess_nll_ci95": ci,
            "rerotate_ppl_effect_significant": not (ci[0] <= 0 <= ci[1]),
            "pass": (q16["mean_abs_dnll_vs_oracle"] > r16["mean_abs_dnll_vs_oracle"]
                     and abs(q16["dppl_vs_oracle"]) > abs(r16["dppl_vs_oracle"]))}
    if "hf/float32" in runs:
        f, h = by["full/float32"]["ppl"], by["hf/float32"]["ppl"]
        checks["full_matches_hf"] = {"full_ppl": f, "hf_ppl": h, "rel_diff": abs(f / h - 1),
                                     "mean_abs_dnll": mean_abs("full/float32", "hf/float32"),
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
