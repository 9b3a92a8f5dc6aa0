"""CPU benchmark of the XLA attention paths (jit, no Pallas): per-step decode attention cost.

  (a) plain   : attention over N pre-rotated keys (the floor);
  (b) rsqr    : S survivors rotated from raw inside attention + N - S pre-rotated window keys, S/N in
                {1/8, 1/2}; twice: "ref" = rsqr_jax.kernels.survivor_attention_reference (the simple
                reference) and "xla" = survivor_attention_xla (the CPU-lean XLA formulation: rotations
                from the cos/sin table over ranks, survivor scores in cache-sized blocks);
  (c) stream  : StreamingLLM - rotate all N raw keys at their ranks, then attend; twice: "stream" with a
                precomputed cos/sin table (the strongest baseline: ranks are always 0..N-1) and
                "stream_c" through the contract (survivor_attention_xla with every key in the raw
                segment, W = 0), the contract's way of running streamingllm (docs/design.md §6).

Shapes follow SmolLM2-135M: C = 1, Hq = 9, Hkv = 3, D = 64, float32. Medians of interleaved rounds after
warm-up, each call blocked on; wall time and process CPU time (all threads) are both recorded, the latter
because a small shared machine is often loaded. Inputs: `rsqr_lab.testing.kernel.decode_step_args`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import statistics
import time

import numpy as np

from rsqr_jax.eval.runtime import ConfigError, read_text, write_json_atomic

HQ, HKV, D = 9, 3, 64
ROPE_BASE = 100000.0  # SmolLM2 rope_theta
FRACS = {"1/8": 1 / 8, "1/2": 1 / 2}  # S / N
RATIO_KEYS = ("ref_1/8/plain", "ref_1/2/plain", "xla_1/8/plain", "xla_1/2/plain",
              "stream/xla_1/8", "stream/xla_1/2", "stream_c/xla_1/8", "stream_c/xla_1/2")
TIME_KEYS = ("plain", "ref_1/8", "ref_1/2", "xla_1/8", "xla_1/2", "stream", "stream_c")
PATHS_DOC = {"plain": "attention over N pre-rotated keys (floor)",
             "ref_S/N": "rsqr_jax.kernels.survivor_attention_reference, S = N*S/N survivors",
             "xla_S/N": "rsqr_jax.kernels.survivor_attention.survivor_attention_xla",
             "stream": "rotate all N raw keys at ranks (cos/sin table) then attend",
             "stream_c": "survivor_attention_xla with all N keys raw (W=0, S=N at ranks)"}


@dataclasses.dataclass(frozen=True)
class BenchAttentionConfig:
    quick: bool = False  # tiny sizes, for a smoke test
    budget_s: float | None = None  # seconds of timed rounds per (N, batch); default 10 (quick 0.5)
    max_n_batch16: int = 32768  # largest N run at batch 16
    seed: int = 0

    @property
    def sizes(self) -> tuple[tuple[int, ...], tuple[int, ...], float]:
        """(cache sizes N, batches, budget seconds)."""
        if self.quick:
            return (1024, 2048), (1, 4), self.budget_s or 0.5
        return (1024, 2048, 4096, 8192, 16384, 32768), (1, 16), self.budget_s or 10.0

    def validate(self) -> None:
        if self.budget_s is not None and self.budget_s <= 0:
            raise ConfigError(f"--budget must be > 0, got {self.budget_s}")


def _softmax_pv(s, v, mask, Hq):
    import jax.numpy as jnp

    from rsqr_jax.kernels.survivor_attention import MASK_VALUE

    B, C = mask.shape[:2]
    mask = mask[:, None, None]
    s = jnp.where(mask, s, MASK_VALUE)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    o = jnp.einsum("bkgcn,bknd->bkgcd", p, v, precision="highest") / jnp.sum(p, -1, keepdims=True)
    return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(B, C, Hq, D)


def _scores(qg, k):
    import jax.numpy as jnp

    return jnp.einsum("bckgd,bknd->bkgcn", qg, k, precision="highest")


def path_plain(q, k, v, kpos, qpos, *, inv):
    """Masked single-segment attention over pre-rotated keys. q [B,1,Hq,D], k/v [B,Hkv,N,D].

    Written like survivor_attention_xla (scale folded into q, output in [B,Hkv,G,C,D] then one
    transpose): on XLA:CPU that layout is ~2x faster than scaling the scores and contracting straight
    into [B,C,Hkv,G,D], so the floor is not handicapped."""
    from rsqr_jax.kernels.exact_rope import rope_cos_sin, rotate_half_split

    B, C, Hq, _ = q.shape
    cos, sin = rope_cos_sin(qpos, inv)
    q_rot = rotate_half_split(q, cos[:, :, None], sin[:, :, None])
    qg = q_rot.reshape(B, C, k.shape[1], Hq // k.shape[1], D) * D**-0.5
    return _softmax_pv(_scores(qg, k), v, (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= qpos[:, :, None]), Hq)


def path_stream(q, k_raw, v, rank, qrank, cos_table, sin_table, *, inv):
    """StreamingLLM (mit-han-lab pos_shift): every cached key rotated from raw at its rank, every step.

    Ranks are 0..N-1, so cos/sin come from a precomputed table (as HF's rotary cos/sin cache) - no
    transcendental work is charged to this path - and the rotation is done in halves, like
    survivor_attention_xla, with no concatenate."""
    from rsqr_jax.kernels.exact_rope import rope_cos_sin, rotate_half_split

    B, C, Hq, _ = q.shape
    F = D // 2
    c, s = cos_table[None, None], sin_table[None, None]  # [1, 1, N, F]
    k1, k2 = k_raw[..., :F], k_raw[..., F:]
    k1r, k2r = k1 * c - k2 * s, k2 * c + k1 * s
    cq, sq = rope_cos_sin(qrank, inv)
    qg = rotate_half_split(q, cq[:, :, None], sq[:, :, None]).reshape(B, C, HKV, Hq // HKV, D) * D**-0.5
    scores = _scores(qg[..., :F], k1r) + _scores(qg[..., F:], k2r)
    return _softmax_pv(scores, v, (rank[:, None, :] >= 0) & (rank[:, None, :] <= qrank[:, :, None]), Hq)


def jitted_paths(inv) -> dict:
    """{path kind: jitted fn}; inv is a concrete constant (exact angles). Built once per run."""
    import jax

    from rsqr_jax.kernels.survivor_attention import survivor_attention_reference, survivor_attention_xla

    return {"plain": jax.jit(functools.partial(path_plain, inv=inv)),
            "stream": jax.jit(functools.partial(path_stream, inv=inv)),
            "ref": jax.jit(lambda *a: survivor_attention_reference(*a, inv)),
            "xla": jax.jit(lambda *a: survivor_attention_xla(*a, inv))}


def cos_sin_table(N, inv):
    ang = np.arange(N, dtype=np.float64)[:, None] * inv.astype(np.float64)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def make_cases(rng, B, N, paths, inv) -> dict:
    """{case name: (jitted fn, args)} for one (batch, N): plain, stream, stream_c, ref_/xla_ per S/N."""
    import jax
    import jax.numpy as jnp

    from rsqr_lab.testing.kernel import decode_step_args

    f = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32))  # noqa: E731
    q, k, v = f(B, 1, HQ, D), f(B, HKV, N, D), f(B, HKV, N, D)
    layout = decode_step_args(q, k, v, 0)
    cos, sin = map(jnp.asarray, cos_sin_table(N, inv))
    cases = {"plain": (paths["plain"], (q, k, v, layout["kpos"], layout["q_pos"])),
             "stream": (paths["stream"], (q, k, v, layout["rank"], layout["q_rank"], cos, sin)),
             "stream_c": (paths["xla"], layout["stream"])}  # streamingllm as this project runs it
    for name, frac in FRACS.items():
        args = decode_step_args(q, k, v, int(N * frac))["rsqr"]
        args = tuple(jax.block_until_ready(jnp.array(a)) for a in args)  # own buffers
        cases[f"ref_{name}"] = (paths["ref"], args)
        cases[f"xla_{name}"] = (paths["xla"], args)
    return cases


def time_cases(cases, budget_s, min_rounds=5, max_rounds=30):
    """Per path: median wall seconds, min wall seconds, median process-CPU seconds per call; rounds.

    Rounds interleave all paths so load drift hits them alike. Process CPU time (all threads) counts
    the work done and is far less sensitive than wall time to other processes sharing the cores."""
    import jax

    for fn, args in cases.values():  # compile + warm-up
        jax.block_until_ready(fn(*args))
        jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for fn, args in cases.values():
        jax.block_until_ready(fn(*args))
    per_round = time.perf_counter() - t0
    rounds = int(min(max_rounds, max(min_rounds, budget_s / max(per_round, 1e-9))))
    wall = {name: [] for name in cases}
    cpu = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (fn, args) in cases.items():
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(fn(*args))
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    med = lambda d: {k: statistics.median(v) for k, v in d.items()}  # noqa: E731
    return med(wall), {k: min(v) for k, v in wall.items()}, med(cpu), rounds


def ratios(t: dict) -> dict:
    out = {}
    for f in FRACS:
        for impl in ("ref", "xla"):
            out[f"{impl}_{f}/plain"] = t[f"{impl}_{f}"] / t["plain"]
            out[f"stream/{impl}_{f}"] = t["stream"] / t[f"{impl}_{f}"]
            out[f"stream_c/{impl}_{f}"] = t["stream_c"] / t[f"{impl}_{f}"]
    return out


TARGETS = {"xla_1/8/plain": ("<=", 1.10, 4096), "xla_1/2/plain": ("<=", 1.10, 4096),
           "stream/xla_1/8": (">=", 1.30, 8192), "stream/xla_1/2": (">=", 1.30, 8192)}  # (op, bound, from N >=)


def load_result(path) -> dict:
    """An earlier JSON document of this benchmark; ConfigError (one line) if it is not one."""
    import json

    try:
        doc = json.loads(read_text(path))
        rows = doc["rows"]
        assert all(set(TARGETS) <= set(r["ratio_cpu"]) for r in rows)
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise ConfigError(f"{path} is not a bench_attention JSON document ({type(e).__name__})") from None
    return doc


def compare_md(before: dict, after: dict, key: str = "ratio_cpu") -> str:
    """Markdown table of the target ratios, before -> after, per (batch, N) present in both JSON documents;
    a ratio inside its target (TARGETS) is bold."""
    old = {(r["batch"], r["N"]): r for r in before["rows"]}
    head = "| batch | N | " + " | ".join(f"{k} before → after" for k in TARGETS) + " |"
    lines = [head, "|---|---|" + "---|" * len(TARGETS)]
    for r in after["rows"]:
        b = old.get((r["batch"], r["N"]))
        if b is None:
            continue
        cells = []
        for k, (op, bound, n_min) in TARGETS.items():
            v = r[key][k]
            ok = v <= bound if op == "<=" else v >= bound
            cells.append(f"{b[key][k]:.2f} → " + (f"**{v:.2f}**" if ok and r["N"] >= n_min else f"{v:.2f}"))
        lines.append(f"| {r['batch']} | {r['N']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tables(rows) -> str:
    t1 = ["| batch | N | plain | rsqr ref S/N=1/8 | rsqr ref 1/2 | rsqr xla 1/8 | rsqr xla 1/2 | stream (table) "
          "| stream (contract) |", "|---|---|---|---|---|---|---|---|---|"]
    head = ("| batch | N | ref/plain 1/8 | ref/plain 1/2 | xla/plain 1/8 | xla/plain 1/2 "
            "| stream/xla 1/8 | stream/xla 1/2 | stream_c/xla 1/8 | stream_c/xla 1/2 |")
    t2 = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    t3, t4 = list(t2), list(t1)
    for r in rows:
        pre = f"| {r['batch']} | {r['N']} | "
        t1.append(pre + " | ".join(f"{r['ms'][k]:.2f}" for k in TIME_KEYS) + " |")
        t2.append(pre + " | ".join(f"{r['ratio'][k]:.2f}" for k in RATIO_KEYS) + " |")
        t4.append(pre + " | ".join(f"{r['cpu_ms'][k]:.2f}" for k in TIME_KEYS) + " |")
        t3.append(pre + " | ".join(f"{r['ratio_cpu'][k]:.2f}" for k in RATIO_KEYS) + " |")
    return ("median wall ms per decode step\n\n" + "\n".join(t1)
            + "\n\nratios of median wall times\n\n" + "\n".join(t2)
            + "\n\nmedian process-CPU ms per decode step (all threads; robust to other load)\n\n" + "\n".join(t4)
            + "\n\nratios of median process-CPU times\n\n" + "\n".join(t3))


@dataclasses.dataclass
class BenchAttentionResult:
    meta: dict
    rows: list[dict]  # one per (batch, N): ms / min_ms / cpu_ms per path, ratio / ratio_min / ratio_cpu

    @property
    def table_md(self) -> str:
        return tables(self.rows)

    def to_json(self) -> dict:
        return {"meta": self.meta, "rows": self.rows, "table_md": self.table_md}

    def write(self, path) -> None:
        write_json_atomic(path, self.to_json())


def run(config: BenchAttentionConfig, *, command: str = "", log=print) -> BenchAttentionResult:
    """Time every path at every (batch, N) of the config; `log` gets one line per row (None: silent)."""
    import jax

    from rsqr_lab.testing.kernel import rope_inv_freq

    config.validate()
    log = log or (lambda *a, **k: None)
    Ns, batches, budget = config.sizes
    inv = rope_inv_freq(D, ROPE_BASE)
    paths = jitted_paths(inv)
    rng = np.random.default_rng(config.seed)
    rows = []
    log(f"jax {jax.__version__} on {jax.default_backend()} ({os.cpu_count()} cpus, load average "
        f"{os.getloadavg()[0]:.1f}); C=1 Hq={HQ} Hkv={HKV} D={D} float32; times are medians in ms", flush=True)
    t_start = time.time()
    for B in batches:
        for N in Ns:
            if B >= 16 and N > config.max_n_batch16:
                continue
            med, best, cpu, rounds = time_cases(make_cases(rng, B, N, paths, inv), budget)
            row = {"batch": B, "N": N, "rounds": rounds, "ms": {k: 1e3 * v for k, v in med.items()},
                   "min_ms": {k: 1e3 * v for k, v in best.items()}, "cpu_ms": {k: 1e3 * v for k, v in cpu.items()},
                   "ratio": ratios(med), "ratio_min": ratios(best), "ratio_cpu": ratios(cpu),
                   "loadavg": os.getloadavg()}
            rows.append(row)
            log(f"  B={B:3d} N={N:6d} rounds={rounds:2d} " + " ".join(f"{k}={v:.2f}" for k, v in row["ms"].items()),
                flush=True)
    meta = {"jax": jax.__version__, "backend": jax.default_backend(), "cpus": os.cpu_count(),
            "machine": platform.machine(), "shape": {"C": 1, "Hq": HQ, "Hkv": HKV, "D": D, "dtype": "float32"},
            "command": command, "budget_s": budget, "max_n_batch16": config.max_n_batch16,
            "wall_s": time.time() - t_start, "loadavg_end": os.getloadavg(), "paths": PATHS_DOC}
    return BenchAttentionResult(meta, rows)
