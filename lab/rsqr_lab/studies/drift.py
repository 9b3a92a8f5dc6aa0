"""Experiment 1, "Drift": error of keys rotated again and again (`rerotate`) against one
rotation from raw (`rsqr` / `streamingllm`), at three levels.

1. Keys.  A key is written rotated at base position P and then re-rotated in hops of -s (s = evict_n,
   the rank decrease of one eviction event), rounding to the storage dtype after every rotation, exactly
   as the cache update does (rsqr_jax.kernels.exact_rope: exact angles, float32 arithmetic, then `.astype`).
   "rotations" h counts every rotate-and-round the stored key went through: h = 1 is the write alone
   (what rsqr and streamingllm do, once), h = 1000 is the write plus 999 re-rotations. The rsqr path
   rotates the raw key once at the final position P - (h-1)s. Both are compared with a float64 rotation
   of the same float32 raw key. Keys: random N(0, 1) and raw keys captured from the model's forward pass
   (all layers, all KV heads). Plus a P x s grid (exact angles, and for comparison the naive float32
   `pos * inv_freq` angles of HF-style code) and the error per frequency pair (the mechanism).
2. Attention.  Captured queries/keys, sinks + a window of W keys, each key at the rotation count it has
   in a rerotate stream (uniform h, or the steady-state profile of block b); KL(p64 || p) and total
   variation of the attention distribution against a float64 rank-timeline reference.
3. Model (drift_model.py).  Stream tokens one by one through the engine under the real policies in
   several precisions and compare per-step logits with a float32 reference on the same token set.

`run(config, ...)` takes the model pieces (rsqr_jax never imports `models`): the model config (head_dim,
inv_freq, ...), the tokens, a `capture_qk(tokens_T) -> (q_LxTxHqxD, k_LxTxHkvxD)` callable for the raw
queries/keys, and for the model level the (apply_fn, params) per dtype and the float32 weights (oracle).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import numpy as np

from rsqr_jax.eval.runtime import ConfigError, Timer, status, write_json_atomic
from rsqr_jax.policy import Policy, make_policy
from rsqr_lab.studies import base_policy
from rsqr_lab.studies.drift_keys import N_SINK, exp_attention, exp_keys
from rsqr_lab.studies.drift_model import START_PRECISION, exp_model

PARTS = ("keys", "attention", "model")


@dataclasses.dataclass(frozen=True, eq=False)  # holds a Policy (studies.base_policy)
class DriftConfig:
    """Sizes of the three levels; the defaults are the full run, `quick()` the CI one. surv_policy: the
    model-level configuration with survivors (rsqr and rerotate of it, compared against float32 rsqr)."""

    n_random: int = 2048
    capture_tokens: int = 600
    capture_stride: int = 8
    rotations: tuple[int, ...] = (1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000)
    shifts: tuple[int, ...] = (1, 8)
    base_pos: int = 10000
    grid_P: tuple[int, ...] = (0, 1000, 10_000, 100_000, 1_000_000)
    grid_s: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    grid_h: tuple[int, ...] = (1, 10, 100)
    grid_keys: int = 1024
    distance: int = 256
    att_windows: tuple[int, ...] = (64, 256)
    att_blocks: tuple[int, ...] = (1, 8)
    att_uniform_W: int = 64
    att_uniform_h: tuple[int, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    att_queries: int = 8
    model_tokens: int = 512
    model_configs: tuple[tuple[int, int], ...] = ((64, 1), (64, 8), (256, 1), (256, 8))  # (window, block)
    surv_policy: Policy = base_policy.field(window=64, n_sink=N_SINK, delta=8, max_survivors=16)
    segment: int = 32
    oracle_tokens: int = 96
    oracle_configs: str = "both"  # "first" or "both" (the first delta = 0 one and the survivor one)
    precisions: tuple[str, ...] = ("f32", "f32+bf16cache", "bf16", START_PRECISION)
    parts: tuple[str, ...] = PARTS
    oracle: bool = True
    seed: int = 0
    quick: bool = False

    @classmethod
    def quick_run(cls, **kw) -> "DriftConfig":
        """The small CI run (< 3 min on 2 cores for SmolLM2-135M)."""
        q = dict(n_random=512, capture_tokens=96, capture_stride=6, grid_P=(0, 10_000, 1_000_000),
                 grid_s=(1, 8, 64), grid_h=(1, 100), grid_keys=256, distance=64, att_windows=(32,),
                 att_uniform_W=32, att_uniform_h=(1, 10, 100, 1000), att_queries=4, model_tokens=64,
                 model_configs=((32, 1), (32, 8)),
                 surv_policy=make_policy("rsqr", window=32, n_sink=N_SINK, delta=4, max_survivors=4), oracle_tokens=0,
                 oracle_configs="first", precisions=("f32", "f32+bf16cache"), quick=True)
        return cls(**{**q, **kw})

    def __post_init__(self):
        base_policy.check(self.surv_policy)
        if set(self.parts) - set(PARTS) or not self.parts:
            raise ConfigError(f"parts must be a non-empty subset of {','.join(PARTS)}, got {','.join(self.parts)}")
        if self.model_tokens % self.segment:
            raise ConfigError(f"model_tokens {self.model_tokens} must be a multiple of segment {self.segment}")
        T, Qn = self.capture_tokens, self.att_queries
        for W in self.att_windows:
            for b in self.att_blocks:
                if T - Qn < 2 * W + 2 * b + N_SINK:
                    raise ConfigError(f"capture_tokens {T} too small for W={W}, b={b}")

    @property
    def tokens_needed(self) -> int:
        return max(self.capture_tokens, self.model_tokens + 1)

    def to_json(self) -> dict:
        """The config as results have it: the survivor configuration as "surv_config" (window, delta,
        max_survivors, block), tuples as lists."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "surv_policy":
                out["surv_config"] = base_policy.settings(v, ("window", "delta", "max_survivors", "block"))
            elif f.name != "parts":
                out[f.name] = [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, tuple) else v
        return out


# ------------------------------------------------------------------------------------- run, result


@dataclasses.dataclass
class DriftResult:
    """What `run` measured (the results.json dict); writes its JSON, markdown section and plots."""

    data: dict

    @classmethod
    def load(cls, path) -> "DriftResult":
        return cls(json.loads(Path(path).read_text()))

    def to_json(self) -> dict:
        return self.data

    def markdown(self) -> str:
        from rsqr_lab.studies.drift_report import markdown

        return markdown(self.data, self.data.get("command", ""))

    def merge_previous(self, path) -> "DriftResult":
        """A partial run (some parts only) keeps the other parts of an earlier results.json of the same kind."""
        path, ran = Path(path), set(self.data["config"]["parts_run"])
        if ran == set(PARTS) or not path.is_file():
            return self
        old = json.loads(path.read_text())
        if old.get("config", {}).get("quick") != self.data["config"]["quick"]:
            return self
        for part in set(PARTS) - ran:
            if part in old:
                self.data[part] = old[part]
        self.data["timings_s"] = {**old.get("timings_s", {}), "rerun": {"parts": sorted(ran), **self.data["timings_s"]}}
        self.data["command"] = old.get("command", self.data.get("command"))
        return self

    def write(self, out_dir, *, plots: bool = True) -> dict:
        """results.json, drift_section.md and (plots) drift_*.png in out_dir; returns {name: path}."""
        from rsqr_lab.studies.drift_report import make_plots

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.data["plots"] = make_plots(self.data, out_dir) if plots else {}
        write_json_atomic(out_dir / "results.json", self.data)
        (out_dir / "drift_section.md").write_text(self.markdown())
        return self.data["plots"]


def run(config: DriftConfig, *, model_cfg, tokens, capture_qk: Callable, models: dict | None = None,
        weights: dict | None = None, progress: bool = True, command: str = "", model_name: str = "") -> DriftResult:
    """Run the configured parts.

    model_cfg: the model's config (head_dim, inv_freq, num_layers, num_kv_heads, rope_theta, ...).
    tokens: at least config.tokens_needed ids. capture_qk(tokens_T) -> raw (q [L,T,Hq,D], k [L,T,Hkv,D]).
    models: {"float32": (apply_fn, params), "bfloat16": ...} for the model level (bfloat16 only with the
    "bf16" precision). weights: float32 numpy weights for the float64 oracle. command, model_name: recorded.
    """
    tokens = np.asarray(tokens, np.int32)
    if len(tokens) < config.tokens_needed:
        raise ConfigError(f"{len(tokens)} tokens given, {config.tokens_needed} needed")
    inv, D, timings = model_cfg.inv_freq, model_cfg.head_dim, {}
    with Timer() as t_all:
        with Timer() as t:
            Tc = config.capture_tokens
            q, k = capture_qk(tokens[:Tc])
            q, k = np.asarray(q, np.float32), np.asarray(k, np.float32)
        timings["capture"] = t.wall
        status(f"captured q/k of {Tc} tokens x {model_cfg.num_layers} layers")
        rng = np.random.default_rng(config.seed)
        captured = k[:, np.arange(0, Tc, config.capture_stride)].reshape(-1, D).astype(np.float32)
        keysets = {"random": rng.normal(size=(config.n_random, D)).astype(np.float32), "captured": captured}
        res = {"config": {**config.to_json(), "model": model_name, "head_dim": D, "rope_theta": model_cfg.rope_theta,
                          "num_layers": model_cfg.num_layers, "n_keys": {n: len(v) for n, v in keysets.items()},
                          "parts_run": [p for p in PARTS if p in config.parts]}}
        if "keys" in config.parts:
            with Timer() as t:
                res["keys"] = exp_keys(keysets, inv, config)
            timings["keys"] = t.wall
        if "attention" in config.parts:
            with Timer() as t:
                res["attention"] = exp_attention(q, k, inv, config)
            timings["attention"] = t.wall
        if "model" in config.parts:
            if models is None:
                raise ConfigError("the model part needs `models` ({dtype: (apply_fn, params)})")
            with Timer() as t:
                res["model"] = exp_model(model_cfg, models, weights, tokens[:config.model_tokens], config,
                                         progress=progress)
            timings["model"] = t.wall
    res["timings_s"] = {**timings, "total": t_all.wall}
    res["command"] = command
    return DriftResult(res)
