#!/usr/bin/env python3
"""Per-token decode latency against stream position for every policy (real SmolLM2, this CPU).

For each policy the decode step (rsqr_jax.session.Session's ahead-of-time compiled greedy step, one
token, cache donated) is timed end to end - host round trip of the sampled token included - for
--steps consecutive tokens at each probe position (default 1k ... 50k). To reach a probe position
cheaply the stream is *jumped* there: a positions-only scan of `plan_step` (the exact bookkeeping
every real step runs: slots, survivors, overflow, ranks, stored rotations) advances the cache state to
that position without running the model, and the K/V arrays hold random values. A decode step's work
depends only on that bookkeeping and on the static shapes, never on the K/V values, so its latency at
position p is the latency of a real stream at p (what it attends to is not; we measure time only).

Also reported, per policy: key rotations per token counted analytically from the plan outputs of a
positions-only scan (rotations at write, inside attention, and in upkeep: rerotate hops, precompute
refreshes, replay recomputation), the latency bump at eviction/upkeep events vs other steps, and cache
bytes by part. A second pass (--sweep, on by default) measures the event tail against W, delta and
block at one steady-state position; memory of the raw shadow and survivors is tabulated against delta
and W analytically (CacheSpec.bytes_by_part).

    python scripts/exp_latency.py                  # default: 1k..50k, all policies (< 30 min)
    python scripts/exp_latency.py --quick          # up to ~2k, short windows (< 2 min)
    python scripts/exp_latency.py --policies rsqr streamingllm --positions 1000 50000
"""

from __future__ import annotations

import json
import os
import platform
import time

from _common import (DEFAULT_TEXT, Parser, UsageError, add_model_args, check_model_args, load_model_from_args,
                     run_main, status)

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


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--positions", type=int, nargs="+", default=[1000, 2000, 5000, 10000, 20000, 50000])
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per probe position")
    p.add_argument("--replay-steps", type=int, default=96, help="timed steps per probe for replay (expensive)")
    p.add_argument("--full-max", type=int, default=8192, help="largest probe position for full attention")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), help=f"subset of {', '.join(POLICIES)}")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--delta", type=int, default=8)
    p.add_argument("--max-survivors", type=int, default=64)
    p.add_argument("--sweep-position", type=int, default=4096)
    p.add_argument("--sweep-steps", type=int, default=96)
    p.add_argument("--no-sweep", action="store_true", help="skip the W/delta/block tail sweep")
    p.add_argument("--quick", action="store_true", help="tiny run: positions 512 and 2048, W=128, 40 steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default=str(DEFAULT_TEXT))
    p.add_argument("--out", default="runs/exp_latency.json")
    p.add_argument("--png", default="docs/img/latency.png", help="plot path ('' = no plot)")
    add_model_args(p)
    return p


def round_up(n: int, m: int = 64) -> int:
    return -(-n // m) * m


def make(args, mode: str, overrides: dict):
    from rsqr_jax.policy import make_policy

    kw = dict(window=args.window, n_sink=args.sinks, delta=args.delta, max_survivors=args.max_survivors, block=1)
    kw.update(overrides)
    return make_policy(mode, **kw)


# ---------------------------------------------------------------------------------------------------
# Positions-only machinery (no model): jump the stream, and count rotations per step.

_JIT: dict = {}


def advance_fn():
    """advance(cache, policy, n): n single-token plan_steps, bookkeeping only (K/V untouched)."""
    if "advance" not in _JIT:
        import jax

        from rsqr_jax.update import commit, plan_step

        def advance(cache, policy, n):
            def body(_, c):
                return commit(c, plan_step(c, policy, 1))

            return jax.lax.fori_loop(0, n, body, cache)

        _JIT["advance"] = jax.jit(advance, donate_argnums=(0,))
    return _JIT["advance"]


def trace_fn(n_steps: int):
    """Per-step counts of the next n_steps single-token steps (from plan_step outputs)."""
    key = ("trace", n_steps)
    if key not in _JIT:
        import jax
        import jax.numpy as jnp

        from rsqr_jax.policy import window_start
        from rsqr_jax.update import plan_step

        def trace(cache, policy):
            def body(c, _):
                plan = plan_step(c, policy, 1)
                S = c.surv_pos.shape[0]
                nxt = vars(plan.next)
                i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
                out = {
                    "n_window": i32(jnp.sum(plan.kernel.win_pos_W >= 0)),
                    "n_surv": i32(jnp.sum(plan.kernel.surv_valid_S)),
                    "new_surv": i32(jnp.sum(plan.writes.surv_slot_C < S)),
                    "hops": i32(jnp.where(plan.upkeep.rerotate, jnp.sum(plan.upkeep.win_hop_W) + jnp.sum(plan.upkeep.surv_hop_S), 0)),
                    "refresh": i32(jnp.where(plan.upkeep.refresh, jnp.sum(plan.upkeep.refresh_S), 0)),
                    "replay": i32(plan.upkeep.replay),
                    "release": i32(window_start(nxt["t"], policy.window, policy.block, c.start)
                                   != window_start(c.t, policy.window, policy.block, c.start)),
                    "dropped": i32(jnp.sum((c.surv_pos >= 0) & (nxt["surv_pos"] < 0))),
                }
                return c.replace(**nxt), out

            return jax.lax.scan(body, cache, None, length=n_steps)[1]

        _JIT[key] = jax.jit(trace)
    return _JIT[key]


def rotation_counts(mode: str, tr: dict):
    """Keys rotated per step (per layer and KV head), split by where the work happens."""
    import numpy as np

    n_cached = tr["n_window"] + tr["n_surv"]
    write = np.where(mode == "streamingllm", 0, 1) + (tr["new_surv"] if mode in ("leave_gaps", "rerotate", "replay")
                                                      else 0)
    attn = {"streamingllm": n_cached, "rsqr": tr["n_surv"]}.get(mode, np.zeros_like(n_cached))
    upkeep = tr["hops"] + tr["refresh"] + (tr["replay"] * n_cached if mode == "replay" else 0)
    return {"write": write, "attention": attn, "upkeep": upkeep, "total": write + attn + upkeep,
            "n_cached": n_cached, "event": upkeep > 0}


def randomize_kv(cache, seed: int):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    upd = {}
    for k, name in zip(keys, ("win_k", "win_v", "surv_k", "surv_v", "surv_k_rot")):
        x = getattr(cache, name)
        upd[name] = (0.5 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
    return cache.replace(**upd)


# ---------------------------------------------------------------------------------------------------


def stats(ms):
    import numpy as np

    ms = np.asarray(ms, float)
    if ms.size == 0:
        return None
    return {"n": int(ms.size), "p50": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90)),
            "p99": float(np.percentile(ms, 99)), "max": float(ms.max()), "mean": float(ms.mean())}


class Runner:
    def __init__(self, args, loaded, apply_fn, params, text_ids):
        self.args, self.loaded, self.apply_fn, self.params, self.text_ids = args, loaded, apply_fn, params, text_ids

    def session(self, pol, max_len: int = 0):
        from rsqr_jax.cache import init_cache
        from rsqr_jax.spec import CacheSpec
        from rsqr_jax.session import Session

        cfg = self.loaded.config
        spec = CacheSpec.for_policies(pol, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                      head_dim=cfg.head_dim, dtype=self.args.dtype, max_chunk=1, max_len=max_len)
        s = Session(self.apply_fn, self.params, spec, pol, prefill_chunk=1)
        s.warmup()
        s.cache = randomize_kv(init_cache(spec), self.args.seed)
        return s, spec

    def probe(self, s, mode: str, position: int, n_steps: int):
        """Jump to `position`, count rotations for the next n_steps, then time them."""
        import numpy as np

        t = s.n_tokens
        if position - 1 < t:
            raise ValueError(f"probe positions must increase ({position} <= {t})")
        s.cache = advance_fn()(s.cache, s.policy, position - 1 - t)
        tok = int(self.text_ids[position % len(self.text_ids)])
        nxt = s._run(np.asarray([tok], np.int32), 1)  # untimed: the step into `position`
        tr = {k: np.asarray(v) for k, v in trace_fn(n_steps)(s.cache, s.policy).items()}
        rot = rotation_counts(mode, tr)
        start = s.n_tokens
        ms, cpu = [], []
        for _ in range(n_steps):
            c0, t0 = time.process_time(), time.perf_counter()
            nxt = s._run(np.asarray([nxt], np.int32), 1)
            ms.append(1e3 * (time.perf_counter() - t0))
            cpu.append(1e3 * (time.process_time() - c0))
        ms, cpu = np.asarray(ms), np.asarray(cpu)
        ev, rel = rot["event"], tr["release"] > 0
        row = {"position": start, "steps": n_steps, "latency_ms": stats(ms), "cpu_ms": stats(cpu),
               "n_cached_mean": float(rot["n_cached"].mean()),
               "rotations_per_token": {k: float(np.mean(rot[k])) for k in ("write", "attention", "upkeep", "total")},
               "rotations_max_step": int(rot["total"].max()),
               "event_steps": int(ev.sum()), "release_steps": int(rel.sum()),
               "survivors_dropped": int(tr["dropped"].sum()),
               "replay_events": int(tr["replay"].sum()),
               "latency_event_ms": stats(ms[ev]), "latency_no_event_ms": stats(ms[~ev]),
               "cpu_event_ms": stats(cpu[ev]), "cpu_no_event_ms": stats(cpu[~ev]),
               "latency_release_ms": stats(ms[rel]), "latency_no_release_ms": stats(ms[~rel]),
               "raw_ms": [round(float(x), 3) for x in ms]}
        if ev.any() and (~ev).any():
            row["event_bump"] = float(np.median(ms[ev]) / np.median(ms[~ev]))
            row["event_bump_cpu"] = float(np.median(cpu[ev]) / np.median(cpu[~ev]))
        return row


def bump_label(probe: dict) -> str:
    """Event-step p50 over other-step p50; policies whose every step (or no step) is an event have none."""
    if "event_bump" in probe:
        return f"{probe['event_bump']:6.2f}x"
    if probe["event_steps"] == probe["steps"]:
        return "  none (every step is an upkeep event)"
    return "  none (no upkeep events)"


def _p50(st: dict | None) -> str:
    return "-" if not st else f"{st['p50']:.1f}"


def memory_table(args, cfg):
    """rsqr cache bytes by part against W and delta (analytic: CacheSpec.bytes_by_part)."""
    from rsqr_jax.spec import CacheSpec
    from rsqr_jax.policy import make_policy

    out = []
    for W in (256, 512, 1024, 2048):
        for d in (4, 8, 16, 32):
            pol = make_policy("rsqr", window=W, n_sink=args.sinks, delta=d, max_survivors=args.max_survivors)
            spec = CacheSpec.for_policies(pol, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                          head_dim=cfg.head_dim, dtype=args.dtype)
            b = spec.bytes_by_part(pol)
            out.append({"W": W, "delta": d, "max_survivors": args.max_survivors,
                        "shadow_slots": b["shadow"] // spec.entry_bytes,
                        "survivor_slots": b["survivors"] // spec.entry_bytes,
                        **{f"{k}_bytes": int(v) for k, v in b.items()}})
    return out


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    for name, pr in result["policies"].items():
        xs = [r["position"] for r in pr["probes"]]
        p50 = [r["latency_ms"]["p50"] for r in pr["probes"]]
        cpu = [r["cpu_ms"]["p50"] for r in pr["probes"]]
        line, = ax.plot(xs, p50, "o-", label=name, ms=4)
        ax.plot(xs, cpu, ":", color=line.get_color(), alpha=0.6)
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("stream position (tokens)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title("per-token p50: wall clock (solid), process CPU time (dotted)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    names, ev, no = [], [], []
    for name, pr in result["policies"].items():
        r = pr["probes"][-1]
        if r.get("latency_event_ms") and r.get("latency_no_event_ms"):
            names.append(name)
            ev.append(r["latency_event_ms"]["p50"])
            no.append(r["latency_no_event_ms"]["p50"])
    for s in result.get("sweep", []):
        if s.get("latency_event_ms") and s.get("latency_no_event_ms"):
            names.append(s["name"])
            ev.append(s["latency_event_ms"]["p50"])
            no.append(s["latency_no_event_ms"]["p50"])
    if names:
        import numpy as np

        y = np.arange(len(names))
        ax2.barh(y - 0.2, no, 0.4, label="other steps")
        ax2.barh(y + 0.2, ev, 0.4, label="upkeep-event steps")
        ax2.set_yticks(y, names, fontsize=7)
        ax2.set_xlabel("p50 latency (ms)")
        ax2.set_title("eviction/upkeep tail")
        ax2.legend(fontsize=7)
        ax2.set_xscale("log")
    from matplotlib.ticker import LogLocator, ScalarFormatter

    ax2.xaxis.set_major_formatter(ScalarFormatter())  # plain numbers at 1, 2, 5 x 10^k, nothing overlapping
    ax2.xaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    ax2.xaxis.set_minor_formatter(ScalarFormatter())
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    status(f"wrote {path}")


def main() -> int:
    args = build_parser().parse_args()
    check_model_args(args)
    if args.quick:
        args.positions, args.steps, args.replay_steps, args.window = [512, 2048], 24, 8, 128
        args.full_max, args.no_sweep = 2048, True
    bad = [p for p in args.policies if p not in POLICIES]
    if bad:
        raise UsageError(f"unknown policy name(s) {', '.join(bad)}: choose from {', '.join(POLICIES)}")
    if sorted(args.positions) != args.positions or min(args.positions) < 1:
        raise UsageError("--positions must be positive and increasing")
    if args.steps < 8 or args.replay_steps < 8:
        raise UsageError("--steps and --replay-steps must be >= 8")
    import jax
    import numpy as np

    t_all = time.perf_counter()
    loaded, apply_fn, params = load_model_from_args(args)
    cfg = loaded.config
    with open(args.text, encoding="utf-8") as f:
        text_ids = np.asarray(loaded.tokenizer.encode(f.read()[:200_000], add_special_tokens=False), np.int32)
    status(f"model loaded; backend {jax.default_backend()}; load average {os.getloadavg()}")
    run = Runner(args, loaded, apply_fn, params, text_ids)
    result = {"args": vars(args), "policies": {}, "sweep": [],
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
                          "loadavg_start": os.getloadavg()}}
    # All sessions stay alive and every probe position is measured for every policy before moving on, so
    # the neighbours' load on this shared machine drifts along the position axis, not between policies.
    sessions, entries = {}, {}
    full_positions = [p for p in args.positions if p <= args.full_max]
    if args.full_max < args.positions[-1] and args.full_max not in full_positions:
        full_positions.append(args.full_max)
    for name in args.policies:
        mode, over = POLICIES[name]
        pol = make(args, mode, over)
        entries[name] = {"policy": pol.name, "mode": mode, "probes": []}
        if mode != "full":
            s, spec = run.session(pol)
            sessions[name] = s
            entries[name].update(cache_bytes=spec.bytes_by_part(pol), win_capacity=spec.win_capacity,
                                 surv_capacity=spec.surv_capacity, compile_s=s.compile_s)
    status(f"compiled {len(sessions)} sessions ({time.perf_counter() - t_all:.0f}s)")
    for pos in sorted(set(args.positions) | set(full_positions if "full" in args.policies else [])):
        t0 = time.perf_counter()
        for name in args.policies:
            mode, over = POLICIES[name]
            n_steps = args.replay_steps if mode == "replay" else args.steps
            if mode == "full":  # one cache per probe, sized to it: attention must not pay for empty capacity
                if pos not in full_positions:
                    continue
                pol = make(args, mode, over)
                s, spec = run.session(pol, max_len=round_up(pos + n_steps + 2))
                entries[name]["probes"].append(run.probe(s, mode, pos, n_steps) | {
                    "win_capacity": spec.win_capacity, "cache_bytes": spec.bytes_by_part(pol)})
                del s
            elif pos in args.positions:
                entries[name]["probes"].append(run.probe(sessions[name], mode, pos, n_steps))
        status(f"position {pos}: " + ", ".join(
            f"{n} {e['probes'][-1]['latency_ms']['p50']:.0f}/{e['probes'][-1]['cpu_ms']['p50']:.0f}"
            for n, e in entries.items() if e["probes"] and e["probes"][-1]["position"] == pos)
            + f" ms p50 wall/cpu ({time.perf_counter() - t0:.0f}s)")
    for name, e in entries.items():
        pr = e["probes"]
        if len(pr) >= 2:
            e["flat_ratio"] = pr[-1]["latency_ms"]["p50"] / pr[0]["latency_ms"]["p50"]
            e["flat_ratio_cpu"] = pr[-1]["cpu_ms"]["p50"] / pr[0]["cpu_ms"]["p50"]
        result["policies"][name] = e
    sessions.clear()
    if not args.no_sweep:
        for name, mode, over in SWEEP:
            pol = make(args, mode, over)
            s, spec = run.session(pol)
            n = args.sweep_steps if mode != "replay" else max(args.replay_steps, 8 * over.get("block", 1))
            r = run.probe(s, mode, args.sweep_position, n)
            r.update(name=name, policy=pol.name, cache_bytes=spec.bytes_by_part(pol))
            result["sweep"].append(r)
            status(f"sweep {name}: p50 {r['latency_ms']['p50']:.1f} ms, event bump {bump_label(r).strip()}"
                   f", rotations/token {r['rotations_per_token']['total']:.1f}")
    result["memory"] = memory_table(args, cfg)
    result["machine"]["loadavg_end"] = os.getloadavg()
    result["total_s"] = time.perf_counter() - t_all

    print(f"\nper-token decode latency (ms), {args.dtype}, W={args.window} N={args.sinks} delta={args.delta} "
          f"S={args.max_survivors}; rotations = keys rotated per token per layer and KV head")
    cols = sorted({r["position"] for e in result["policies"].values() for r in e["probes"]})
    pos_hdr = "".join(f" {p:>13}" for p in cols)
    print(f"{'policy':<16}{pos_hdr}  flat  flat(cpu)  rot/tok  event bump")
    for name, e in result["policies"].items():
        by = {r["position"]: r for r in e["probes"]}
        cells = "".join(f" {by[p]['latency_ms']['p50']:6.1f}/{by[p]['latency_ms']['p99']:<6.1f}" if p in by
                        else f" {'-':>13}" for p in cols)
        last = e["probes"][-1]
        print(f"{name:<16}{cells} {e.get('flat_ratio', float('nan')):5.2f} {e.get('flat_ratio_cpu', float('nan')):9.2f}"
              f" {last['rotations_per_token']['total']:8.1f}  "
              + bump_label(last))
    print("\nprocess CPU time per token, p50 (ms) - robust to the neighbours' load")
    print(f"{'policy':<16}" + "".join(f" {p:>7}" for p in cols))
    for name, e in result["policies"].items():
        by = {r["position"]: r for r in e["probes"]}
        print(f"{name:<16}" + "".join(f" {by[p]['cpu_ms']['p50']:7.1f}" if p in by else f" {'-':>7}" for p in cols))
    if result["sweep"]:
        print("\ntail sweep at position", args.sweep_position)
        for r in result["sweep"]:
            print(f"{r['name']:<22} p50 {r['latency_ms']['p50']:6.1f}  p99 {r['latency_ms']['p99']:6.1f}  "
                  f"event p50 {_p50(r['latency_event_ms']):>7}  other p50 {_p50(r['latency_no_event_ms']):>6}  "
                  f"rot/tok {r['rotations_per_token']['total']:.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=float)
    status(f"wrote {args.out} ({result['total_s']:.0f}s)")
    if args.png:
        plot(result, args.png)
    return 0


if __name__ == "__main__":
    run_main(main)
