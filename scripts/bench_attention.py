"""CPU benchmark of the XLA attention paths (jit, no Pallas): per-step decode attention cost.

  (a) plain   : attention over N pre-rotated keys (the floor);
  (b) rsqr    : S survivors rotated from raw inside attention + N - S pre-rotated window keys, S/N in
                {1/8, 1/2}; twice: "ref" = pallas_kernels.survivor_attention_reference (the simple
                reference) and "xla" = survivor_attention_xla (the CPU-lean XLA formulation);
  (c) stream  : StreamingLLM - rotate all N raw keys at their ranks, then attend; twice: "stream" with a
                precomputed cos/sin table (the strongest baseline: ranks are always 0..N-1) and
                "stream_c" through the contract (survivor_attention_xla with every key in the raw
                segment, W = 0), which is how DESIGN.md section 6 runs streamingllm.

Shapes follow SmolLM2-135M: C = 1, Hq = 9, Hkv = 3, D = 64, float32. Medians of interleaved rounds
after warm-up, each call blocked on; wall time and process CPU time (all threads) are both recorded,
the latter because this 2-core machine is often shared. Prints tables and writes JSON.

    python scripts/bench_attention.py                 # default run (~minutes on 2 cores)
    python scripts/bench_attention.py --quick         # tiny sanity run
    python scripts/bench_attention.py --out runs/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.rope import rope_cos_sin, rotate_half_split  # noqa: E402
from pallas_kernels.survivor_attention import (  # noqa: E402
    MASK_VALUE,
    survivor_attention_reference,
    survivor_attention_xla,
)

HQ, HKV, D = 9, 3, 64
FRAC_NAME = {1 / 8: "1/8", 1 / 2: "1/2"}
HP = jax.lax.Precision.HIGHEST


def inv_freq(d=D, base=100000.0):  # SmolLM2 rope_theta = 100000
    return (1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)).astype(np.float32)


INV = inv_freq()


def plain_attention(q_rot, k, v, kpos, qpos):
    """Masked single-segment attention over pre-rotated keys. q_rot [B,1,Hq,D], k/v [B,Hkv,N,D].

    Written like survivor_attention_xla (scale folded into q, output in [B,Hkv,G,C,D] then one
    transpose): on XLA:CPU that layout is ~2x faster than scaling the scores and contracting straight
    into [B,C,Hkv,G,D], so the floor is not handicapped."""
    B, C, Hq, _ = q_rot.shape
    G = Hq // k.shape[1]
    qg = q_rot.reshape(B, C, k.shape[1], G, D) * D**-0.5
    s = plain_scores(qg, k)
    return _softmax_pv(s, v, ((kpos[:, None, :] >= 0) & (kpos[:, None, :] <= qpos[:, :, None])), Hq)


def plain_scores(qg, k):
    return jnp.einsum("bckgd,bknd->bkgcn", qg, k, precision=HP)


def _softmax_pv(s, v, mask, Hq):
    B, C = mask.shape[:2]
    mask = mask[:, None, None]
    s = jnp.where(mask, s, MASK_VALUE)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    o = jnp.einsum("bkgcn,bknd->bkgcd", p, v, precision=HP) / jnp.sum(p, -1, keepdims=True)
    return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(B, C, Hq, D)


@jax.jit
def path_plain(q, k, v, kpos, qpos):
    cos, sin = rope_cos_sin(qpos, INV)
    q_rot = rotate_half_split(q, cos[:, :, None], sin[:, :, None])
    return plain_attention(q_rot, k, v, kpos, qpos)


@jax.jit
def path_stream(q, k_raw, v, rank, qrank, cos_table, sin_table):
    """StreamingLLM (mit-han-lab pos_shift): every cached key rotated from raw at its rank, every step.

    Ranks are 0..N-1, so cos/sin come from a precomputed table (as HF's rotary cos/sin cache) - no
    transcendental work is charged to this path - and the rotation is done in halves, like
    survivor_attention_xla, with no concatenate."""
    B, C, Hq, _ = q.shape
    F = D // 2
    c, s = cos_table[None, None], sin_table[None, None]  # [1, 1, N, F]
    k1, k2 = k_raw[..., :F], k_raw[..., F:]
    k1r, k2r = k1 * c - k2 * s, k2 * c + k1 * s
    cq, sq = rope_cos_sin(qrank, INV)
    qg = rotate_half_split(q, cq[:, :, None], sq[:, :, None]).reshape(B, C, HKV, Hq // HKV, D) * D**-0.5
    scores = plain_scores(qg[..., :F], k1r) + plain_scores(qg[..., F:], k2r)
    return _softmax_pv(scores, v, ((rank[:, None, :] >= 0) & (rank[:, None, :] <= qrank[:, :, None])), Hq)


@jax.jit
def path_rsqr(q, win_k, win_v, win_pos, sk, sv, spos, svalid, qpw, qps):
    return survivor_attention_reference(q, win_k, win_v, win_pos, sk, sv, spos, svalid, qpw, qps, INV)


@jax.jit
def path_rsqr_xla(q, win_k, win_v, win_pos, sk, sv, spos, svalid, qpw, qps):
    return survivor_attention_xla(q, win_k, win_v, win_pos, sk, sv, spos, svalid, qpw, qps, INV)


def cos_sin_table(N):
    ang = np.arange(N, dtype=np.float64)[:, None] * INV.astype(np.float64)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def make_case(rng, B, N, fracs):
    t = 10**6
    f = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32))  # noqa: E731
    q = f(B, 1, HQ, D)
    k, v = f(B, HKV, N, D), f(B, HKV, N, D)
    kpos = jnp.asarray(np.tile(np.arange(t - N, t, dtype=np.int32), (B, 1)))
    qpos = jnp.full((B, 1), t, jnp.int32)
    rank = jnp.asarray(np.tile(np.arange(N, dtype=np.int32), (B, 1)))
    cases = {
        "plain": (path_plain, (q, k, v, kpos, qpos)),
        "stream": (path_stream, (q, k, v, rank, jnp.full((B, 1), N, jnp.int32), *map(jnp.asarray, cos_sin_table(N)))),
        # StreamingLLM as this project runs it: every key in the raw segment of the same contract
        "stream_c": (path_rsqr_xla, (q, k[:, :, :0], v[:, :, :0], kpos[:, :0], k, v, rank, jnp.ones((B, N), bool),
                                     qpos, jnp.full((B, 1), N, jnp.int32))),
    }
    for frac in fracs:
        S = int(N * frac)
        W = N - S
        wpos = jnp.asarray(np.tile(np.arange(t - W, t, dtype=np.int32), (B, 1)))
        spos = jnp.asarray(np.tile(np.arange(S, dtype=np.int32), (B, 1)))
        args = (q, k[:, :, :W], v[:, :, :W], wpos, k[:, :, W:], v[:, :, W:], spos, jnp.ones((B, S), bool),
                qpos, jnp.full((B, 1), N, jnp.int32))
        args = tuple(jax.block_until_ready(jnp.array(a)) for a in args)  # own buffers
        cases[f"ref_{FRAC_NAME[frac]}"] = (path_rsqr, args)
        cases[f"xla_{FRAC_NAME[frac]}"] = (path_rsqr_xla, args)
    return cases


def time_cases(cases, budget_s, min_rounds=5, max_rounds=30):
    """Per path: median wall seconds, min wall seconds, median process-CPU seconds per call.

    Rounds interleave all paths so load drift hits them alike. Process CPU time (all threads) counts
    the work done and is far less sensitive than wall time to other processes sharing the cores."""
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


RATIO_KEYS = ("ref_1/8/plain", "ref_1/2/plain", "xla_1/8/plain", "xla_1/2/plain",
              "stream/xla_1/8", "stream/xla_1/2", "stream_c/xla_1/8", "stream_c/xla_1/2")
TIME_KEYS = ("plain", "ref_1/8", "ref_1/2", "xla_1/8", "xla_1/2", "stream", "stream_c")


def ratios(t):
    out = {}
    for f in FRAC_NAME.values():
        for impl in ("ref", "xla"):
            out[f"{impl}_{f}/plain"] = t[f"{impl}_{f}"] / t["plain"]
            out[f"stream/{impl}_{f}"] = t["stream"] / t[f"{impl}_{f}"]
            out[f"stream_c/{impl}_{f}"] = t["stream_c"] / t[f"{impl}_{f}"]
    return out


def tables(rows):
    t1 = ["| batch | N | plain | rsqr ref S/N=1/8 | rsqr ref 1/2 | rsqr xla 1/8 | rsqr xla 1/2 | stream (table) "
          "| stream (contract) |", "|---|---|---|---|---|---|---|---|---|"]
    head = ("| batch | N | ref/plain 1/8 | ref/plain 1/2 | xla/plain 1/8 | xla/plain 1/2 "
            "| stream/xla 1/8 | stream/xla 1/2 | stream_c/xla 1/8 | stream_c/xla 1/2 |")
    t2 = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    t3 = list(t2)
    t4 = list(t1)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    ap.add_argument("--out", default="runs/bench_attention.json")
    ap.add_argument("--budget", type=float, default=None, help="seconds of timed rounds per (N, batch)")
    ap.add_argument("--max-n-batch16", type=int, default=32768, help="largest N run at batch 16")
    args = ap.parse_args()

    fracs = (1 / 8, 1 / 2)
    if args.quick:
        Ns, batches, budget = (1024, 2048), (1, 4), args.budget or 0.5
    else:
        Ns, batches, budget = (1024, 2048, 4096, 8192, 16384, 32768), (1, 16), args.budget or 10.0
    rng = np.random.default_rng(0)
    rows = []
    print(f"jax {jax.__version__} on {jax.default_backend()} ({os.cpu_count()} cpus, load average "
          f"{os.getloadavg()[0]:.1f}); C=1 Hq={HQ} Hkv={HKV} D={D} float32; times are medians in ms", flush=True)
    t_start = time.time()
    for B in batches:
        for N in Ns:
            if B >= 16 and N > args.max_n_batch16:
                continue
            cases = make_case(rng, B, N, fracs)
            med, best, cpu, rounds = time_cases(cases, budget)
            row = {"batch": B, "N": N, "rounds": rounds, "ms": {k: 1e3 * v for k, v in med.items()},
                   "min_ms": {k: 1e3 * v for k, v in best.items()}, "cpu_ms": {k: 1e3 * v for k, v in cpu.items()},
                   "ratio": ratios(med), "ratio_min": ratios(best), "ratio_cpu": ratios(cpu),
                   "loadavg": os.getloadavg()}
            rows.append(row)
            print(f"  B={B:3d} N={N:6d} rounds={rounds:2d} "
                  + " ".join(f"{k}={v:.2f}" for k, v in row["ms"].items()), flush=True)
            del cases

    table = tables(rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    meta = {"jax": jax.__version__, "backend": jax.default_backend(), "cpus": os.cpu_count(),
            "machine": platform.machine(), "shape": {"C": 1, "Hq": HQ, "Hkv": HKV, "D": D, "dtype": "float32"},
            "command": " ".join(sys.argv), "budget_s": budget, "max_n_batch16": args.max_n_batch16,
            "wall_s": time.time() - t_start, "loadavg_end": os.getloadavg(),
            "paths": {"plain": "attention over N pre-rotated keys (floor)",
                      "ref_S/N": "pallas_kernels.survivor_attention_reference, S = N*S/N survivors",
                      "xla_S/N": "pallas_kernels.survivor_attention.survivor_attention_xla",
                      "stream": "rotate all N raw keys at ranks (cos/sin table) then attend",
                      "stream_c": "survivor_attention_xla with all N keys raw (W=0, S=N at ranks)"}}
    with open(args.out, "w") as fh:
        json.dump({"meta": meta, "rows": rows, "table_md": table}, fh, indent=1)
    print()
    print(table)
    print(f"\nwrote {args.out} in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
