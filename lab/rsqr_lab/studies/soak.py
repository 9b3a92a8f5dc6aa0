"""Soak: stream a long text token by token through bounded caches and check that nothing drifts.

Every policy runs one token per step (by default all in one vmapped `Decoder.feed`, weights shared;
`separate`: one Decoder per policy), the text cycled as the stream, every token scored (NLL of the next
one). Criteria, each PASS/FAIL in the verdict:

* cache_bytes_constant: bytes of the cache pytree and of all live JAX arrays are the same at every
  checkpoint after warm-up;
* rss_growth: resident memory (VmRSS) grows by < rss_tolerance from the end of warm-up to the end (median
  of the last 3 checkpoints over the smallest of the first 3, so one transient spike does not decide it);
* finite_logits: no NaN/inf in any logit of any step (reduced on the device, every logit);
* no_recompile: no XLA compilation (jax.monitoring backend-compile events) and no retrace after the
  first step;
* flat_latency: p50 per-token latency of the last window <= latency_tolerance x the p50 of the first one
  after warm-up (wall clock; the process-CPU ratio and the neighbour-robust floor ratio are reported
  beside it, not judged).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rsqr_jax import engine
from rsqr_jax.engine import Decoder
from rsqr_jax.eval.runtime import (ConfigError, progress, read_text, read_tokens, sigterm_interrupts, status,
                                         write_json_atomic)
from rsqr_jax.policy import Policy, stack_policies
from rsqr_jax.spec import CacheSpec
from rsqr_lab.studies import base_policy

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CRITERIA = ("cache_bytes_constant", "rss_growth", "finite_logits", "no_recompile", "flat_latency")
# The CI model (rsqr_jax.models.tiny.tiny_config keywords): 2 layers, hidden 64, GQA 4/2, SmolLM2's vocabulary.
TINY_MODEL = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=49152, theta=1e5)


@dataclasses.dataclass(frozen=True, eq=False)  # holds a Policy (studies.base_policy)
class SoakConfig:
    """One soak. The KV cache is bfloat16 by default; weights are whatever the caller loaded. policies: modes,
    each the base policy (`policy`) in that mode."""

    text: str
    tokens: int = 100_000
    policies: tuple[str, ...] = ("rsqr", "streamingllm")  # any modes, all of the base policy below
    policy: Policy = base_policy.field(window=512)
    warmup: int = 1000  # tokens before the baselines are taken
    latency_window: int = 1000  # tokens in the first/last latency windows
    check_every: int = 1000  # tokens between memory checkpoints
    rss_tolerance: float = 0.02
    latency_tolerance: float = 1.15
    separate: bool = False
    cache_dtype: str = "bfloat16"
    progress: bool = True

    def check(self) -> None:
        if self.tokens < 2 * self.latency_window + self.warmup:
            raise ConfigError(f"--tokens must be >= warmup + 2 * latency-window "
                              f"({self.warmup + 2 * self.latency_window})")
        if self.check_every < 1 or self.latency_window < 1 or self.warmup < 1:
            raise ConfigError("--check-every, --latency-window and --warmup must be positive")
        read_text(self.text)
        if self.cache_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"--cache-dtype must be float32 or bfloat16, got {self.cache_dtype!r}")
        self.make_policies()

    def make_policies(self):
        return [base_policy.check(self.policy).replace(mode=m) for m in self.policies]


def floor_ratio(lat_ms, start: int, width: int) -> dict:
    """Neighbour-robust flatness: the lowest window p50 among the last tenth of the windows over the lowest among
    the first tenth (a neighbour's burst only ever adds time, so the floor tracks the step's own cost)."""
    p50 = [float(np.median(lat_ms[s:s + width])) for s in range(start, len(lat_ms) - width + 1, width)]
    if not p50:
        return {}
    k = max(1, len(p50) // 10)
    first, last = min(p50[:k]), min(p50[-k:])
    return {"floor_first_ms": first, "floor_last_ms": last, "floor_ratio": last / first, "floor_windows": k}


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def tree_bytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def live_bytes() -> int:
    return int(sum(x.nbytes for x in jax.live_arrays()))


def stream_ids(tokenizer, path: str, n: int) -> np.ndarray:
    """n token ids of the text, cycled when the text is shorter."""
    try:
        return read_tokens(tokenizer, path, n)
    except ConfigError:  # too short (a missing file fails again below): the whole text, cycled
        ids = np.asarray(tokenizer.encode(read_text(path), add_special_tokens=False), np.int32)
        return ids[np.arange(n) % len(ids)]


@dataclasses.dataclass
class SoakResult:
    """The soak JSON (`data`) and its renderings; `complete` is False for an interrupted run."""

    data: dict

    @property
    def complete(self) -> bool:
        return self.data["complete"]

    @property
    def verdict(self) -> str:
        return self.data["verdict"]

    def markdown(self) -> str:
        d, a = self.data, self.data["args"]
        n, T = d["tokens"], d["tokens_requested"]
        lines = [f"soak: {n} tokens{'' if n == T else f' of {T} (interrupted)'} x {len(d['policies'])} policies "
                 f"({', '.join(d['policies'])}), {'tiny model, ' if a.get('tiny') else ''}"
                 f"weights {a.get('dtype', '?')}, "
                 f"cache {a['cache_dtype']}, "
                 f"{d['mode']}, {d['loop_s']:.0f}s ({1e3 * d['loop_s'] / max(n, 1):.1f} ms/step)", ""]
        for name, c in d["criteria"].items():
            detail = {k: v for k, v in c.items() if k != "pass"}
            lines.append(f"- {'PASS' if c['pass'] else 'FAIL'} {name}: {json.dumps(detail)}")
        lines += ["", f"verdict: {d['verdict']}{'' if n == T else ' (partial run)'}"]
        return "\n".join(lines) + "\n"

    def write_json(self, path) -> None:
        write_json_atomic(path, self.data)

    def plot(self, path) -> None:
        plot(self.data, path)


def plot(data: dict, path) -> None:
    """Per-1k-token p50 latency (wall and process CPU), resident memory, and perplexity against tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n1k = len(data["latency_ms"]["per_1k_p50"])
    xs = [1000 * (i + 0.5) for i in range(n1k)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    ax.plot(xs, data["latency_ms"]["per_1k_p50"], ".-", label="wall clock")
    ax.plot(xs, data["latency_ms"]["cpu_per_1k_p50"], ".-", label="process CPU time (all threads)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"decode step p50 per 1k tokens ({len(data['policies'])} policies, {data['mode']})", fontsize=9)
    ax.set_xlabel("tokens streamed")
    ax.set_ylabel("ms / step")
    ax.legend(fontsize=8)
    ax = axes[1]
    ck = data["checkpoints"]
    ax.plot([c["tokens"] for c in ck], [c["rss"] / 2**20 for c in ck], ".-", label="RSS")
    ax.plot([c["tokens"] for c in ck], [c["cache_bytes"] / 2**20 for c in ck], ".-", label="cache pytree")
    ax.set_ylim(bottom=0)
    ax.set_title("memory (MiB)", fontsize=9)
    ax.set_xlabel("tokens streamed")
    ax.legend(fontsize=8)
    ax = axes[2]
    b = data["ppl_buckets"]
    for name in data["policies"]:
        ax.plot([b["bucket"] * (i + 0.5) for i in range(len(b[name]))], b[name], ".-", label=name)
    ax.set_title(f"perplexity per {b['bucket']} tokens", fontsize=9)
    ax.set_xlabel("tokens streamed")
    ax.legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"soak: {data['tokens']} tokens, verdict {data['verdict']}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def run(config: SoakConfig, apply_fn, params, model_config, tokenizer, *, meta: dict | None = None,
        on_checkpoint: Callable[[SoakResult], None] | None = None) -> SoakResult:
    """Stream config.tokens tokens; `on_checkpoint` gets the partial result at every checkpoint past the first
    latency windows (so a killed run keeps one). SIGTERM or Ctrl-C ends the stream early: the result then has
    complete=False, or KeyboardInterrupt is re-raised when too few tokens were streamed for a verdict."""
    config.check()
    policies = config.make_policies()
    t_start = time.perf_counter()
    T, P = config.tokens, len(policies)
    stream = stream_ids(tokenizer, config.text, T + 1)
    kw = dict(dims=model_config, dtype=config.cache_dtype)
    if config.separate:  # one Decoder per policy, policy as data
        specs = [CacheSpec.for_policies(p, **kw) for p in policies]
        runs = [(Decoder(apply_fn, s), p) for s, p in zip(specs, policies)]
        caches = [d.init_cache() for d, _ in runs]
    else:
        specs = [CacheSpec.for_policies(policies, **kw)]
        runs = [(Decoder(apply_fn, specs[0], vmap_policies=True), stack_policies(policies))]
        caches = [runs[0][0].init_cache(P)]
    status(f"{T + 1} stream tokens; policies " + ", ".join(p.name for p in policies)
           + f"; cache {config.cache_dtype}; {'separate' if config.separate else 'vmapped'}")
    n_score_traces = []

    @jax.jit
    def score(logits, target):
        """NLL of the target (batch row 0, last chunk token) per policy, and whether every logit is finite."""
        n_score_traces.append(1)
        logp = jax.nn.log_softmax(logits[..., 0, -1, :].astype(jnp.float32), axis=-1)
        return -jnp.take(logp, target, axis=-1), jnp.all(jnp.isfinite(logits))

    compiles = []

    def listener(name, secs, **kw):
        if name == BACKEND_COMPILE:
            compiles.append(secs)

    traces = lambda: engine.TRACES["feed"] + len(n_score_traces)  # noqa: E731
    traces0 = traces()
    nll = np.zeros((P, T), np.float32)
    lat_ms, cpu_ms = np.zeros(T), np.zeros(T)
    nonfinite_steps: list[int] = []
    checkpoints: list[dict] = []
    first = {}  # compiles and traces after the first step

    def checkpoint(t: int):
        checkpoints.append({"tokens": t, "rss": rss_bytes(), "cache_bytes": sum(tree_bytes(c) for c in caches),
                            "live_bytes": live_bytes(), "compiles": len(compiles), "traces": traces() - traces0,
                            "elapsed_s": time.perf_counter() - t_start})

    def report(n: int) -> SoakResult:
        """Verdict over the first n tokens."""
        after = [c for c in checkpoints if c["tokens"] >= config.warmup] or checkpoints[-1:]
        base = after[0]
        cache_const = all(c["cache_bytes"] == base["cache_bytes"] and c["live_bytes"] == base["live_bytes"]
                          for c in after)
        rss_base = min(c["rss"] for c in after[:3])
        rss_end = float(np.median([c["rss"] for c in after[-3:]]))
        rss_growth = rss_end / rss_base - 1.0
        new_compiles, new_traces = len(compiles) - first["compiles"], traces() - first["traces"]
        Lw, W0 = config.latency_window, config.warmup
        lat, cpu = lat_ms[:n], cpu_ms[:n]
        first_p50, last_p50 = float(np.median(lat[W0:W0 + Lw])), float(np.median(lat[n - Lw:]))
        cpu_first, cpu_last = float(np.median(cpu[W0:W0 + Lw])), float(np.median(cpu[n - Lw:]))
        crit = {
            "cache_bytes_constant": {"pass": cache_const, "cache_bytes": base["cache_bytes"],
                                     "live_bytes": sorted({c["live_bytes"] for c in after}),
                                     "cache_bytes_seen": sorted({c["cache_bytes"] for c in after})},
            "rss_growth": {"pass": rss_growth < config.rss_tolerance, "growth": rss_growth,
                           "max_excursion": max(c["rss"] for c in after) / rss_base - 1.0,
                           "rss_after_warmup": rss_base, "rss_end": rss_end, "tolerance": config.rss_tolerance},
            "finite_logits": {"pass": not nonfinite_steps, "nonfinite_steps": len(nonfinite_steps),
                              "first": nonfinite_steps[:10]},
            "no_recompile": {"pass": new_compiles == 0 and new_traces == 0,
                             "compiles_first_step": first["compiles"], "compiles_after_first_step": new_compiles,
                             "traces_after_first_step": new_traces},
            "flat_latency": {"pass": last_p50 <= config.latency_tolerance * first_p50, "first_p50_ms": first_p50,
                             "last_p50_ms": last_p50, "ratio": last_p50 / first_p50,
                             "tolerance": config.latency_tolerance, "first_window": [W0, W0 + Lw],
                             "last_window": [n - Lw, n], "cpu_first_p50_ms": cpu_first, "cpu_last_p50_ms": cpu_last,
                             "cpu_ratio": cpu_last / cpu_first, **floor_ratio(lat[:n], W0, Lw)},
        }
        bucket = 10_000 if n >= 20_000 else 1000
        ppl = {p.name: [float(math.exp(float(nll[i, s:min(s + bucket, n)].mean()))) for s in range(0, n, bucket)]
               for i, p in enumerate(policies)}
        return SoakResult({
            "args": {**base_policy.config_json(config, ("window", "sinks", "delta", "max_survivors")),
                     **(meta or {})},
            "policies": [p.name for p in policies], "tokens": n, "tokens_requested": T, "complete": n == T,
            "verdict": "PASS" if all(c["pass"] for c in crit.values()) else "FAIL",
            "criteria": crit, "loop_s": time.perf_counter() - t_loop, "ms_per_token_mean": float(lat[W0:].mean()),
            "latency_ms": {"p50": float(np.median(lat[W0:])), "p99": float(np.percentile(lat[W0:], 99)),
                           "per_1k_p50": [float(np.median(lat[s:s + 1000])) for s in range(0, n, 1000)],
                           "cpu_per_1k_p50": [float(np.median(cpu[s:s + 1000])) for s in range(0, n, 1000)]},
            "ppl_buckets": {"bucket": bucket, **ppl}, "checkpoints": list(checkpoints),
            "cache_bytes_by_part": [s.bytes_by_part(p) for s, p in zip(specs * P if len(specs) == 1 else specs,
                                                                      policies)],
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
                        "loadavg_end": os.getloadavg()},
            "mode": "separate" if config.separate else "vmapped",
        })

    need = config.warmup + 2 * config.latency_window
    jax.monitoring.register_event_duration_secs_listener(listener)
    t_loop = time.perf_counter()
    done = 0
    try:
        with sigterm_interrupts() as terminated, progress(T, "soak", enabled=config.progress) as bar:
            for t in range(T):
                terminated()
                tok, tgt = np.asarray([[stream[t]]], np.int32), stream[t + 1]
                c0, t0 = time.process_time(), time.perf_counter()
                vals, ok = [], True
                for i, (dec, pol) in enumerate(runs):
                    logits, caches[i] = dec.feed(params, tok, caches[i], pol)
                    v, o = score(logits, tgt)
                    vals.append(np.atleast_1d(np.asarray(v)))
                    ok &= bool(o)
                lat_ms[t], cpu_ms[t] = 1e3 * (time.perf_counter() - t0), 1e3 * (time.process_time() - c0)
                nll[:, t] = np.concatenate(vals)
                if not ok:
                    nonfinite_steps.append(t)
                if t == 0:
                    first.update(compiles=len(compiles), traces=traces())
                done = t + 1
                bar.update(1)
                if done == config.warmup or (done > config.warmup and done % config.check_every == 0) or done == T:
                    if not checkpoints or checkpoints[-1]["tokens"] != done:
                        checkpoint(done)
                    if done < T:  # progress line + partial result at every checkpoint
                        last = lat_ms[max(0, done - config.check_every):done]
                        status(f"{done}/{T} tokens, {last.mean():.1f} ms/token, RSS {rss_bytes() / 2**20:.0f} MiB")
                        if done >= need and on_checkpoint is not None:
                            on_checkpoint(report(done))
    except KeyboardInterrupt:
        if done < need:
            status(f"interrupted after {done} tokens: too few for a verdict (needs {need}); nothing written")
            raise
        status(f"interrupted after {done} tokens")
        return report(done)  # memory criteria over the regular checkpoints (a step may be half done)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return report(T)
