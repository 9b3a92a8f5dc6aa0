"""Per-token decode latency against stream position for every policy, with analytic rotation counts.

For each policy a Session's one-token greedy step (cache donated) is timed end to end - host round trip
of the sampled token included - for `steps` consecutive tokens at each probe position. To reach a probe
position cheaply the stream is *jumped* there: a positions-only loop of `plan_step` (the exact
bookkeeping every real step runs: slots, survivors, overflow, ranks, stored rotations) advances the
cache to that position without running the model, and the K/V arrays hold random values. A decode
step's work depends only on that bookkeeping and on the static shapes, never on the K/V values, so its
latency at position p is the latency of a real stream at p (what it attends to is not; only time counts).

Also per policy: keys rotated per token (per layer and KV head) counted from the plan outputs of a
positions-only scan (at write, inside attention, in upkeep: rerotate hops, precompute refreshes, replay
recomputation), the latency bump at upkeep-event steps, and cache bytes by part. The optional sweep
measures the event tail against W, delta and block at one steady-state position; `memory` tabulates
rsqr's shadow and survivor bytes against delta and W analytically (CacheSpec.bytes_by_part).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rsqr_jax.cache import init_cache
from rsqr_jax.eval.runtime import ConfigError, progress, read_text, status, write_json_atomic
from rsqr_jax.policy import Policy, window_start
from rsqr_jax.session import Session
from rsqr_jax.spec import CacheSpec, ColdStore
from rsqr_lab.studies import base_policy
from rsqr_jax.update import commit, plan_step

# name -> (mode, overrides of the base policy)
POLICIES = {
    "full": ("full", {}),
    "window": ("window", {}),
    "streamingllm": ("streamingllm", {}),
    "leave_gaps": ("leave_gaps", {}),
    "rerotate_b1": ("rerotate", {"block": 1}),
    "rerotate_b8": ("rerotate", {"block": 8}),
    "rsqr": ("rsqr", {}),
    "rsqr_precompute": ("rsqr_precompute", {}),
    "replay_b8": ("replay", {"block": 8}),
    "rsqr_recall": ("rsqr", {"recall": True}),  # + the recall tier (LatencyConfig.recall_pages, .cold)
}

# tail sweep: (name, mode, overrides) measured at one steady-state position
SWEEP = [
    ("rerotate_b8_W256", "rerotate", {"block": 8, "window": 256}),
    ("rerotate_b8_W1024", "rerotate", {"block": 8, "window": 1024}),
    ("rerotate_b32", "rerotate", {"block": 32}),
    ("replay_b8_W256", "replay", {"block": 8, "window": 256}),
    ("replay_b32", "replay", {"block": 32}),
    ("rsqr_precompute_d4", "rsqr_precompute", {"delta": 4}),
    ("rsqr_precompute_d16", "rsqr_precompute", {"delta": 16}),
    ("rsqr_W1024", "rsqr", {"window": 1024}),
]


@dataclasses.dataclass(frozen=True, eq=False)  # holds a Policy (studies.base_policy)
class LatencyConfig:
    """One latency run. `text` feeds the (untimed) token that steps into each probe position. policy: the base
    of every measured policy (POLICIES and SWEEP set their mode and overrides on it; rsqr_recall's pages are
    recall_pages, the other policies recall nothing)."""

    text: str
    positions: tuple[int, ...] = (1000, 2000, 5000, 10000, 20000, 50000)
    steps: int = 200  # timed decode steps per probe position
    replay_steps: int = 96  # replay is expensive
    full_max: int = 8192  # largest probe position for full attention
    policies: tuple[str, ...] = tuple(POLICIES)
    policy: Policy = base_policy.field(window=512)
    sweep_position: int = 4096
    sweep_steps: int = 96
    no_sweep: bool = False
    seed: int = 0
    dtype: str = "float32"
    progress: bool = True
    recall_pages: int = 4
    cold: ColdStore = ColdStore()

    def quick(self) -> "LatencyConfig":
        """The small CI run: positions 512 and 2048, W=128, 24 steps, no sweep."""
        return dataclasses.replace(self, positions=(512, 2048), steps=24, replay_steps=8,
                                   policy=self.policy.replace(window=128), full_max=2048, no_sweep=True)

    def check(self) -> None:
        base_policy.check(self.policy)
        bad = [p for p in self.policies if p not in POLICIES]
        if bad:
            raise ConfigError(f"unknown policy name(s) {', '.join(bad)}: choose from {', '.join(POLICIES)}")
        if list(self.positions) != sorted(self.positions) or min(self.positions) < 1:
            raise ConfigError("--positions must be positive and increasing")
        if self.steps < 8 or self.replay_steps < 8:
            raise ConfigError("--steps and --replay-steps must be >= 8")

    def derived(self, mode: str, overrides: dict) -> Policy:
        """The base policy in `mode` with `overrides` ("recall": True = recall_pages)."""
        over = dict(overrides)
        if over.pop("recall", False):
            over["recall_pages"] = self.recall_pages
        return self.policy.replace(mode=mode, **over)


def round_up(n: int, m: int = 64) -> int:
    return -(-n // m) * m


# ---------------------------------------------------------------------------------------------------
# Positions-only machinery (no model): jump the stream, and count rotations per step.


def advance(cache, policy: Policy, n):
    """n single-token plan_steps, bookkeeping only (K/V untouched)."""
    return jax.lax.fori_loop(0, n, lambda _, c: commit(c, plan_step(c, policy, 1)), cache)


def trace(cache, policy: Policy, n_steps: int) -> dict:
    """Per-step counts of the next n_steps single-token steps (from plan_step outputs; cache unchanged)."""
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731

    def body(c, _):
        plan = plan_step(c, policy, 1)
        nxt = vars(plan.next)
        up = plan.upkeep
        out = {
            "n_window": i32(jnp.sum(plan.kernel.win_pos_W >= 0)),
            "n_surv": i32(jnp.sum(plan.kernel.surv_valid_S)),
            "new_surv": i32(jnp.sum(plan.writes.surv_slot_C < c.surv_pos.shape[0])),
            "hops": i32(jnp.where(up.rerotate, jnp.sum(up.win_hop_W) + jnp.sum(up.surv_hop_S), 0)),
            "refresh": i32(jnp.where(up.refresh, jnp.sum(up.refresh_S), 0)),
            "replay": i32(up.replay),
            "release": i32(window_start(nxt["t"], policy.window, policy.block, c.start)
                           != window_start(c.t, policy.window, policy.block, c.start)),
            "dropped": i32(jnp.sum((c.surv_pos >= 0) & (nxt["surv_pos"] < 0))),
            "recallable": i32(0 if plan.recall is None else jnp.sum(plan.recall.token_valid_Nc)),
        }
        return commit(c, plan), out

    return jax.lax.scan(body, cache, None, length=n_steps)[1]


class Bookkeeping(NamedTuple):
    """advance and trace, jitted (make one per run: each `bookkeeping()` compiles afresh)."""

    advance: Callable
    trace: Callable


def bookkeeping() -> Bookkeeping:
    return Bookkeeping(jax.jit(advance, donate_argnums=(0,)), jax.jit(trace, static_argnums=(2,)))


def rotation_counts(mode: str, tr: dict, recall_slots: int = 0) -> dict:
    """Keys rotated per step (per layer and KV head), split by where the work happens. With recall, the
    attention count includes the recalled tokens at their most (recall_slots, or every recallable token)."""
    n_cached = tr["n_window"] + tr["n_surv"] + np.minimum(recall_slots, tr["recallable"])
    write = np.where(mode == "streamingllm", 0, 1) + (tr["new_surv"] if mode in ("leave_gaps", "rerotate", "replay")
                                                      else 0)
    attn = {"streamingllm": n_cached, "rsqr": n_cached - tr["n_window"]}.get(mode, np.zeros_like(n_cached))
    upkeep = tr["hops"] + tr["refresh"] + (tr["replay"] * n_cached if mode == "replay" else 0)
    return {"write": write, "attention": attn, "upkeep": upkeep, "total": write + attn + upkeep,
            "n_cached": n_cached, "event": upkeep > 0}


def randomize_kv(cache, seed: int):
    """Random K/V values (the step's cost does not depend on them)."""
    upd, cold = {}, {}
    keys = jax.random.split(jax.random.PRNGKey(seed), 8)
    draw = lambda k, x: (0.5 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)  # noqa: E731
    for k, name in zip(keys, ("win_k", "win_v", "surv_k", "surv_v", "surv_k_rot", "cold.k", "cold.v", "cold.sums")):
        if name.startswith("cold."):
            x = None if cache.cold is None else getattr(cache.cold, name[5:])
            if x is not None:
                cold[name[5:]] = draw(k, x)
        else:
            upd[name] = draw(k, getattr(cache, name))
    if cold:
        upd["cold"] = cache.cold.replace(**cold)
    return cache.replace(**upd)


# ---------------------------------------------------------------------------------------------------


def stats(ms) -> dict | None:
    ms = np.asarray(ms, float)
    if ms.size == 0:
        return None
    return {"n": int(ms.size), "p50": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90)),
            "p99": float(np.percentile(ms, 99)), "max": float(ms.max()), "mean": float(ms.mean())}


def bump_label(probe: dict) -> str:
    """Event-step p50 over other-step p50; policies whose every step (or no step) is an event have none."""
    if "event_bump" in probe:
        return f"{probe['event_bump']:6.2f}x"
    if probe["event_steps"] == probe["steps"]:
        return "  none (every step is an upkeep event)"
    return "  none (no upkeep events)"


def memory_table(cfg: LatencyConfig, model_config) -> list[dict]:
    """rsqr cache bytes by part against W and delta (analytic: CacheSpec.bytes_by_part)."""
    out = []
    for W in (256, 512, 1024, 2048):
        for d in (4, 8, 16, 32):
            pol = cfg.derived("rsqr", {"window": W, "delta": d})
            spec = _spec(pol, model_config, cfg.dtype)
            b = spec.bytes_by_part(pol)
            out.append({"W": W, "delta": d, "max_survivors": int(pol.max_survivors),
                        "shadow_slots": b["shadow"] // spec.entry_bytes,
                        "survivor_slots": b["survivors"] // spec.entry_bytes,
                        **{f"{k}_bytes": int(v) for k, v in b.items()}})
    return out


def _spec(pol: Policy, model_config, dtype: str, max_len: int = 0, cold: ColdStore = ColdStore()) -> CacheSpec:
    recalls = int(np.asarray(pol.recall_pages)) > 0
    return CacheSpec.for_policies(pol, dims=model_config, dtype=dtype, max_chunk=1, max_len=max_len,
                                  cold=cold if recalls else None)


# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LatencyResult:
    """The run's JSON (`data`: args, policies, sweep, memory, machine, total_s) and its renderings."""

    data: dict

    def markdown(self) -> str:
        d, a = self.data, self.data["args"]
        cols = sorted({r["position"] for e in d["policies"].values() for r in e["probes"]})
        lines = [f"Per-token decode latency (ms, p50/p99), {a['dtype']}, W={a['window']} N={a['sinks']} "
                 f"delta={a['delta']} S={a['max_survivors']}; rotations = keys rotated per token per layer and "
                 "KV head.", "",
                 "| policy | " + " | ".join(str(p) for p in cols) + " | flat | flat (cpu) | rot/tok | event bump |",
                 "|---" * (len(cols) + 5) + "|"]
        for name, e in d["policies"].items():
            by = {r["position"]: r for r in e["probes"]}
            cells = [f"{by[p]['latency_ms']['p50']:.1f}/{by[p]['latency_ms']['p99']:.1f}" if p in by else "-"
                     for p in cols]
            last = e["probes"][-1]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {e.get('flat_ratio', float('nan')):.2f} | "
                         f"{e.get('flat_ratio_cpu', float('nan')):.2f} | "
                         f"{last['rotations_per_token']['total']:.1f} | {bump_label(last).strip()} |")
        lines += ["", "Process CPU time per token, p50 (ms) - robust to the neighbours' load.", "",
                  "| policy | " + " | ".join(str(p) for p in cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for name, e in d["policies"].items():
            by = {r["position"]: r for r in e["probes"]}
            lines.append(f"| {name} | " + " | ".join(f"{by[p]['cpu_ms']['p50']:.1f}" if p in by else "-"
                                                      for p in cols) + " |")
        if d["sweep"]:
            lines += ["", f"Tail sweep at position {a['sweep_position']}.", "",
                      "| config | p50 | p99 | event p50 | other p50 | rot/tok |", "|---|---|---|---|---|---|"]
            p50 = lambda st: "-" if not st else f"{st['p50']:.1f}"  # noqa: E731
            for r in d["sweep"]:
                lines.append(f"| {r['name']} | {r['latency_ms']['p50']:.1f} | {r['latency_ms']['p99']:.1f} | "
                             f"{p50(r['latency_event_ms'])} | {p50(r['latency_no_event_ms'])} | "
                             f"{r['rotations_per_token']['total']:.1f} |")
        return "\n".join(lines) + "\n"

    def write_json(self, path) -> None:
        write_json_atomic(path, self.data)

    def plot(self, path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import LogLocator, ScalarFormatter

        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [3, 2]})
        for name, pr in self.data["policies"].items():
            xs = [r["position"] for r in pr["probes"]]
            line, = ax.plot(xs, [r["latency_ms"]["p50"] for r in pr["probes"]], "o-", label=name, ms=4)
            ax.plot(xs, [r["cpu_ms"]["p50"] for r in pr["probes"]], ":", color=line.get_color(), alpha=0.6)
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("stream position (tokens)")
        ax.set_ylabel("decode step (ms)")
        ax.set_title("per-token p50: wall clock (solid), process CPU time (dotted)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        tails = [(name, pr["probes"][-1]) for name, pr in self.data["policies"].items()]
        tails += [(s["name"], s) for s in self.data.get("sweep", [])]
        tails = [(n, r) for n, r in tails if r.get("latency_event_ms") and r.get("latency_no_event_ms")]
        if tails:
            y = np.arange(len(tails))
            ax2.barh(y - 0.2, [r["latency_no_event_ms"]["p50"] for _, r in tails], 0.4, label="other steps")
            ax2.barh(y + 0.2, [r["latency_event_ms"]["p50"] for _, r in tails], 0.4, label="upkeep-event steps")
            ax2.set_yticks(y, [n for n, _ in tails], fontsize=7)
            ax2.set_xlabel("p50 latency (ms)")
            ax2.set_title("eviction/upkeep tail")
            ax2.legend(fontsize=7)
            ax2.set_xscale("log")
        ax2.xaxis.set_major_formatter(ScalarFormatter())  # plain numbers at 1, 2, 5 x 10^k, nothing overlapping
        ax2.xaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        ax2.xaxis.set_minor_formatter(ScalarFormatter())
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=80)
        plt.close(fig)


def run(config: LatencyConfig, apply_fn, params, model_config, tokenizer, *, meta: dict | None = None
        ) -> LatencyResult:
    """Measure every policy of `config` on the model (apply_fn, params); `meta` is added to the JSON args."""
    config.check()
    t_all = time.perf_counter()
    text_ids = np.asarray(tokenizer.encode(read_text(config.text)[:200_000], add_special_tokens=False), np.int32)
    jump = bookkeeping()  # compiled once per run

    def session(pol: Policy, max_len: int = 0):
        spec = _spec(pol, model_config, config.dtype, max_len, config.cold)
        s = Session(apply_fn, params, spec, pol, prefill_chunk=1)
        t0 = time.perf_counter()
        s.feed([0])  # compiles the one-token step (Session.warmup would also compile the unused generate)
        compile_s = time.perf_counter() - t0
        s.cache = randomize_kv(init_cache(spec), config.seed)
        return s, spec, compile_s

    def probe(s: Session, mode: str, position: int, n_steps: int) -> dict:
        """Jump to `position`, count rotations for the next n_steps, then time them."""
        t = s.n_tokens
        if position - 1 < t:
            raise ConfigError(f"probe positions must increase ({position} <= {t})")
        s.cache = jump.advance(s.cache, s.policy, position - 1 - t)
        nxt = s.feed([int(text_ids[position % len(text_ids)])])  # untimed: the step into `position`
        tr = {k: np.asarray(v) for k, v in jump.trace(s.cache, s.policy, n_steps).items()}
        rot = rotation_counts(mode, tr, s.spec.recall_slots)
        start = s.n_tokens
        ms, cpu = np.zeros(n_steps), np.zeros(n_steps)
        for i in range(n_steps):
            c0, t0 = time.process_time(), time.perf_counter()
            nxt = s.feed([nxt])
            ms[i], cpu[i] = 1e3 * (time.perf_counter() - t0), 1e3 * (time.process_time() - c0)
        ev, rel = rot["event"], tr["release"] > 0
        row = {"position": start, "steps": n_steps, "latency_ms": stats(ms), "cpu_ms": stats(cpu),
               "n_cached_mean": float(rot["n_cached"].mean()),
               "rotations_per_token": {k: float(np.mean(rot[k])) for k in ("write", "attention", "upkeep", "total")},
               "rotations_max_step": int(rot["total"].max()),
               "event_steps": int(ev.sum()), "release_steps": int(rel.sum()),
               "survivors_dropped": int(tr["dropped"].sum()), "replay_events": int(tr["replay"].sum()),
               "latency_event_ms": stats(ms[ev]), "latency_no_event_ms": stats(ms[~ev]),
               "cpu_event_ms": stats(cpu[ev]), "cpu_no_event_ms": stats(cpu[~ev]),
               "latency_release_ms": stats(ms[rel]), "latency_no_release_ms": stats(ms[~rel]),
               "raw_ms": [round(float(x), 3) for x in ms]}
        if ev.any() and (~ev).any():
            row["event_bump"] = float(np.median(ms[ev]) / np.median(ms[~ev]))
            row["event_bump_cpu"] = float(np.median(cpu[ev]) / np.median(cpu[~ev]))
        return row

    status(f"backend {jax.default_backend()}; load average {os.getloadavg()}")
    args = base_policy.config_json(config, ("window", "sinks", "delta", "max_survivors"))
    data = {"args": {**args, **(meta or {})}, "policies": {}, "sweep": [],
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
                        "loadavg_start": os.getloadavg()}}
    # All sessions stay alive and every probe position is measured for every policy before moving on, so
    # the neighbours' load on this shared machine drifts along the position axis, not between policies.
    sessions, entries = {}, {}
    positions = list(config.positions)
    full_positions = [p for p in positions if p <= config.full_max]
    if config.full_max < positions[-1] and config.full_max not in full_positions:
        full_positions.append(config.full_max)
    for name in config.policies:
        mode, over = POLICIES[name]
        pol = config.derived(mode, over)
        entries[name] = {"policy": pol.name, "mode": mode, "probes": []}
        if mode != "full":
            s, spec, compile_s = session(pol)
            sessions[name] = s
            entries[name].update(cache_bytes=spec.bytes_by_part(pol), win_capacity=spec.win_capacity,
                                 surv_capacity=spec.surv_capacity, compile_s=compile_s)
    status(f"compiled {len(sessions)} sessions ({time.perf_counter() - t_all:.0f}s)")
    all_positions = sorted(set(positions) | set(full_positions if "full" in config.policies else []))
    n_probes = sum(POLICIES[n][0] != "full" for n in config.policies) * len(positions) + (
        len(full_positions) if "full" in config.policies else 0)
    with progress(n_probes, "latency probes", enabled=config.progress, unit="probe") as bar:
        for pos in all_positions:
            t0 = time.perf_counter()
            for name in config.policies:
                mode, over = POLICIES[name]
                n_steps = config.replay_steps if mode == "replay" else config.steps
                if mode == "full":  # one cache per probe, sized to it: attention must not pay for empty capacity
                    if pos not in full_positions:
                        continue
                    pol = config.derived(mode, over)
                    s, spec, _ = session(pol, max_len=round_up(pos + n_steps + 2))
                    entries[name]["probes"].append(probe(s, mode, pos, n_steps) | {
                        "win_capacity": spec.win_capacity, "cache_bytes": spec.bytes_by_part(pol)})
                    del s
                elif pos in positions:
                    entries[name]["probes"].append(probe(sessions[name], mode, pos, n_steps))
                else:
                    continue
                bar.update(1)
            status(f"position {pos}: " + ", ".join(
                f"{n} {e['probes'][-1]['latency_ms']['p50']:.0f}/{e['probes'][-1]['cpu_ms']['p50']:.0f}"
                for n, e in entries.items() if e["probes"] and e["probes"][-1]["position"] == pos)
                + f" ms p50 wall/cpu ({time.perf_counter() - t0:.0f}s)")
    for name, e in entries.items():
        pr = e["probes"]
        if len(pr) >= 2:
            e["flat_ratio"] = pr[-1]["latency_ms"]["p50"] / pr[0]["latency_ms"]["p50"]
            e["flat_ratio_cpu"] = pr[-1]["cpu_ms"]["p50"] / pr[0]["cpu_ms"]["p50"]
        data["policies"][name] = e
    sessions.clear()
    if not config.no_sweep:
        for name, mode, over in SWEEP:
            pol = config.derived(mode, over)
            s, spec, _ = session(pol)
            n = config.sweep_steps if mode != "replay" else max(config.replay_steps, 8 * over.get("block", 1))
            r = probe(s, mode, config.sweep_position, n)
            r.update(name=name, policy=pol.name, cache_bytes=spec.bytes_by_part(pol))
            data["sweep"].append(r)
            status(f"sweep {name}: p50 {r['latency_ms']['p50']:.1f} ms, event bump {bump_label(r).strip()}"
                   f", rotations/token {r['rotations_per_token']['total']:.1f}")
    data["memory"] = memory_table(config, model_config)
    data["machine"]["loadavg_end"] = os.getloadavg()
    data["total_s"] = time.perf_counter() - t_all
    return LatencyResult(data)
