#!/usr/bin/env python3
"""Experiment 1 (issue 6), "Drift": error of keys rotated again and again (`rerotate`) against one
rotation from raw (`rsqr` / `streamingllm`), at three levels.

1. Keys.  A key is written rotated at base position P and then re-rotated in hops of -s (s = evict_n,
   the rank decrease of one eviction event), rounding to the storage dtype after every rotation, exactly
   as rsqr_jax.attention does (pallas_kernels.rope: exact angles, float32 arithmetic, then `.astype`).
   "rotations" h counts every rotate-and-round the stored key went through: h = 1 is the write alone
   (what rsqr and streamingllm do, once), h = 1000 is the write plus 999 re-rotations. The rsqr path
   rotates the raw key once at the final position P - (h-1)s. Both are compared with a float64
   rotation of the same float32 raw key. Keys: random N(0, 1) and raw keys captured from SmolLM2's
   forward pass over a Frankenstein excerpt (all layers, all KV heads). Plus a P x s grid (exact
   angles, and for comparison the naive float32 `pos * inv_freq` angles of HF-style code) and the
   error per frequency pair (the mechanism).
2. Attention.  Captured queries/keys, sinks + a window of W keys, each key at the rotation count it
   has in a rerotate stream (uniform h, or the steady-state profile of block b); KL(p64 || p) and total
   variation of the attention distribution against a float64 rank-timeline reference.
3. Model.  Stream a Frankenstein excerpt token by token through rsqr_jax.update.step with the real
   policies (rerotate, rsqr; sinks + window, block 1 and 8, and one configuration with survivors), in
   three precisions: float32 model + float32 cache, float32 model + bfloat16 cache, bfloat16 model +
   bfloat16 cache; plus the float32-model/bfloat16-cache stream started at global position 1e5.
   Per-step logits are compared (max-abs, KL, top-1, NLL) with a float32 reference on the same token
   set: `streamingllm` (a different code path: raw ring, every key rotated from raw at its rank every
   step) for the delta = 0 configurations, float32 `rsqr` for the survivor one. The float32 references
   are checked against the float64 rank oracle (tests/oracle.py) on a prefix.

    python scripts/exp_drift.py --quick --out /tmp/drift_quick     # CI smoke run (< 3 min)
    nice -n 10 python scripts/exp_drift.py --out runs/exp_drift     # full run (~17 min on 2 busy cores)
    python scripts/exp_drift.py --parts keys --out runs/exp_drift   # redo one part (keys, attention, model)
    python scripts/exp_drift.py --replot --out runs/exp_drift       # redraw plots + markdown from results.json

Writes results.json, drift_*.png and drift_section.md (markdown tables) to --out.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.rope import rope_cos_sin, rotate_half_split  # noqa: E402

DEFAULT_TEXT = REPO_ROOT.parent / "shared" / "data" / "frankenstein.txt"
HP = jax.lax.Precision.HIGHEST
DTYPES = ("float32", "bfloat16")

QUICK = dict(
    n_random=512, capture_tokens=96, capture_stride=6, rotations=[1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000],
    shifts=[1, 8], base_pos=10000,
    grid_P=[0, 10_000, 1_000_000], grid_s=[1, 8, 64], grid_h=[1, 100], grid_keys=256, distance=64,
    att_windows=[32], att_blocks=[1, 8], att_uniform_W=32, att_uniform_h=[1, 10, 100, 1000], att_queries=4,
    model_tokens=64, model_configs=[(32, 1), (32, 8)], surv_config=dict(window=32, delta=4, max_survivors=4, block=1),
    segment=32, oracle_tokens=0, oracle_configs="first", precisions=["f32", "f32+bf16cache"],
)
FULL = dict(
    n_random=2048, capture_tokens=600, capture_stride=8, rotations=[1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000],
    shifts=[1, 8], base_pos=10000,
    grid_P=[0, 1000, 10_000, 100_000, 1_000_000], grid_s=[1, 2, 4, 8, 16, 32, 64], grid_h=[1, 10, 100],
    grid_keys=1024, distance=256,
    att_windows=[64, 256], att_blocks=[1, 8], att_uniform_W=64,
    att_uniform_h=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000],
    att_queries=8,
    model_tokens=512, model_configs=[(64, 1), (64, 8), (256, 1), (256, 8)],
    surv_config=dict(window=64, delta=8, max_survivors=16, block=1),
    segment=32, oracle_tokens=96, oracle_configs="both",
    precisions=["f32", "f32+bf16cache", "bf16", "f32+bf16cache@1e5"],
)
N_SINK = 4
RSQR_GLOBAL_OFFSET = 100_000  # rsqr window keys/queries sit at global positions ~1e5 (a long stream)
RSQR_OFFSETS = (0, 1000, 10_000, RSQR_GLOBAL_OFFSET, 1_000_000)  # attention level: rsqr floor vs global position
LATE_START = 100_000  # model level: a bfloat16-cache stream that starts at this global position
START_PRECISION = "f32+bf16cache@1e5"


def log(msg: str) -> None:
    print(f"[exp_drift {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ rotations


def rotate(x, pos, inv_freq, dtype, *, naive=False):
    """R_pos x in float32 (the library's rotation; naive: float32 `pos * inv_freq` angles), cast to dtype.

    x [..., D]; pos broadcastable to x[..., 0] (int).
    """
    pos = jnp.asarray(pos, jnp.int32)
    if naive:
        ang = pos.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
        cos, sin = jnp.cos(ang), jnp.sin(ang)
    else:
        cos, sin = rope_cos_sin(pos, inv_freq)
    return rotate_half_split(x, cos, sin).astype(dtype)


def rotate64(x, pos, inv_freq):
    """float64 reference rotation (numpy), x [..., D], pos broadcastable to x[..., 0]."""
    x = np.asarray(x, np.float64)
    ang = np.asarray(pos, np.float64)[..., None] * np.asarray(inv_freq, np.float32).astype(np.float64)
    c, s = np.cos(ang), np.sin(ang)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _hop_fn(inv_freq, dtype, naive):
    return _hop_fn_cached(np.asarray(inv_freq, np.float32).tobytes(), str(jnp.dtype(dtype)), bool(naive))


@functools.lru_cache(maxsize=None)
def _hop_fn_cached(inv_bytes, dtype, naive):
    inv = np.frombuffer(inv_bytes, np.float32)

    @jax.jit
    def hop_n(k, shift, n, mask_n):
        """Rotate k by `shift` (broadcast over k[..., 0]) n times, rounding to dtype each time; a key
        rotates in iteration i only while i < mask_n (its own remaining hop count)."""
        def body(i, k):
            moved = rotate(k, shift, inv, dtype, naive=naive)
            return jnp.where((i < mask_n)[..., None], moved, k)

        return jax.lax.fori_loop(0, n, body, k)

    return hop_n


def rerotated_keys(raw, P, s, checkpoints, inv_freq, dtype, *, naive=False):
    """{h: stored key after h rotations}: written at P, then hops of -s, rounded to dtype each time."""
    hop_n = _hop_fn(inv_freq, dtype, naive)
    k = rotate(jnp.asarray(raw), P, np.asarray(inv_freq), dtype, naive=naive)
    out, h = {}, 1
    for target in sorted(checkpoints):
        n = target - h
        if n:
            k = hop_n(k, jnp.asarray(-s, jnp.int32), n, jnp.full(k.shape[:-1], n, jnp.int32))
        h = target
        out[h] = np.asarray(k.astype(jnp.float32), np.float64)
    return out


def key_errors(path, ref):
    """Per-key max-abs and relative L2 error: arrays [N]."""
    e = path - ref
    return np.abs(e).max(-1), np.linalg.norm(e, axis=-1) / np.linalg.norm(ref, axis=-1)


def _stats(x):
    x = np.asarray(x, np.float64).ravel()
    return {"median": float(np.median(x)), "p90": float(np.quantile(x, 0.9)), "mean": float(np.mean(x)),
            "max": float(np.max(x))}


# ------------------------------------------------------------------------------------ model + capture


def load(model_path):
    from models.llama import load_model

    return load_model(model_path, "float32")


def model_weights(model, cfg) -> dict[str, np.ndarray]:
    from models.llama import BIAS_KEYS, LAYER_KEYS

    names = ["embed", "final_norm", *LAYER_KEYS] + (list(BIAS_KEYS) if cfg.attention_bias else []) + \
        ([] if cfg.tie_word_embeddings else ["lm_head"])
    return {n: np.asarray(getattr(model, n)[...], np.float32) for n in names}


def capture_qk(weights, cfg, tokens):
    """Full causal float32 forward at positions 0..T-1; returns raw q [L,T,Hq,D], raw k [L,T,Hkv,D], logits [T,V].

    Written here (not a hook in models/llama.py) so the model is untouched; checked against
    models.llama.forward_logits by the caller.
    """
    from models.llama import rms_norm
    from rsqr_jax.rope import apply_rope

    L, Hq, Hkv, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G = Hq // Hkv
    inv = cfg.inv_freq
    w = {k: jnp.asarray(v) for k, v in weights.items()}
    T = len(tokens)
    pos = jnp.arange(T, dtype=jnp.int32)
    dense = lambda x, m: jnp.dot(x, m, precision=HP)  # noqa: E731

    @jax.jit
    def run(w, toks):
        x = jnp.take(w["embed"], toks, axis=0)
        stacked = {k: w[k] for k in ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")}
        if cfg.attention_bias:
            stacked.update({k: w[k] for k in ("bq", "bk", "bv")})

        def layer(x, p):
            h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
            q, k, v = dense(h, p["wq"]), dense(h, p["wk"]), dense(h, p["wv"])
            if cfg.attention_bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
            q, k, v = q.reshape(T, Hq, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
            qr = apply_rope(q, pos, inv).reshape(T, Hkv, G, D)
            kr = apply_rope(k, pos, inv)
            s = jnp.einsum("tkgd,ukd->kgtu", qr, kr, precision=HP) * D**-0.5
            s = jnp.where(pos[:, None] >= pos[None, :], s, -jnp.inf)
            o = jnp.einsum("kgtu,ukd->tkgd", jax.nn.softmax(s, axis=-1), v, precision=HP).reshape(T, Hq * D)
            x = x + dense(o, p["wo"])
            h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
            x = x + dense(jax.nn.silu(dense(h, p["w_gate"])) * dense(h, p["w_up"]), p["w_down"])
            return x, (q, k)

        x, (q, k) = jax.lax.scan(layer, x, stacked)
        head = w["embed"].T if "lm_head" not in w else w["lm_head"]
        return q, k, dense(rms_norm(x, w["final_norm"], cfg.rms_norm_eps), head)

    q, k, logits = run(w, jnp.asarray(tokens, jnp.int32))
    return np.asarray(q), np.asarray(k), np.asarray(logits)


def read_tokens(tokenizer, path, n):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    ids, chars = [], 4 * n + 1000
    while len(ids) < n and chars < 40 * n + len(text):
        ids = tokenizer.encode(text[:chars])
        chars *= 2
    if len(ids) < n:
        raise SystemExit(f"exp_drift: {path} has only {len(ids)} tokens, need {n}")
    return np.asarray(ids[:n], np.int32)


# ---------------------------------------------------------------------------------------- 1. keys


def exp_keys(keysets, inv, cfg_run):
    """Rotation sweep, P x s grid, and per-pair breakdown for each key set and dtype."""
    out = {"rotations": cfg_run["rotations"], "shifts": cfg_run["shifts"], "base_pos": cfg_run["base_pos"],
           "sweep": {}, "grid": {}, "pairs": {}}
    P0 = cfg_run["base_pos"]
    hs = cfg_run["rotations"]
    for kname, raw in keysets.items():
        for dt in DTYPES:
            for s in cfg_run["shifts"]:
                ks = rerotated_keys(raw, P0, s, hs, inv, dt)
                rows = []
                for h in hs:
                    pos = P0 - (h - 1) * s
                    ref = rotate64(raw, pos, inv)
                    fresh = np.asarray(rotate(jnp.asarray(raw), pos, inv, dt).astype(jnp.float32), np.float64)
                    ma_r, rl_r = key_errors(ks[h], ref)
                    ma_f, rl_f = key_errors(fresh, ref)
                    rows.append({"h": h, "final_pos": pos,
                                 "rerotate": {"max_abs": _stats(ma_r), "rel_l2": _stats(rl_r)},
                                 "rsqr": {"max_abs": _stats(ma_f), "rel_l2": _stats(rl_f)}})
                    if h == 100:
                        e = ks[h] - ref
                        half = e.shape[-1] // 2
                        err_pair = np.sqrt(np.mean(e[:, :half] ** 2 + e[:, half:] ** 2, axis=0))
                        norm_pair = np.sqrt(np.mean(ref[:, :half] ** 2 + ref[:, half:] ** 2, axis=0))
                        ef = fresh - ref
                        err_f = np.sqrt(np.mean(ef[:, :half] ** 2 + ef[:, half:] ** 2, axis=0))
                        out["pairs"][f"{kname}/{dt}/s={s}"] = {
                            "h": h, "rerotate_rel_rms": (err_pair / norm_pair).tolist(),
                            "rsqr_rel_rms": (err_f / norm_pair).tolist(), "key_rms": norm_pair.tolist(),
                            "hop_angle": (s * np.asarray(inv, np.float64)).tolist()}
                out["sweep"][f"{kname}/{dt}/s={s}"] = rows
                log(f"keys {kname} {dt} s={s}: rerotate rel-L2 median " +
                    " ".join(f"h={r['h']}:{r['rerotate']['rel_l2']['median']:.2g}" for r in rows if r["h"] in
                             (1, 10, 100, 1000)) + f" | rsqr {rows[-1]['rsqr']['rel_l2']['median']:.2g}")
    # P x s grid on a subsample of each key set.
    for kname, raw in keysets.items():
        sub = raw[np.linspace(0, len(raw) - 1, min(len(raw), cfg_run["grid_keys"])).astype(int)]
        for dt in DTYPES:
            for naive in (False, True):
                cells = []
                for P in cfg_run["grid_P"]:
                    for s in cfg_run["grid_s"]:
                        ks = rerotated_keys(sub, P, s, cfg_run["grid_h"], inv, dt, naive=naive)
                        for h in cfg_run["grid_h"]:
                            pos = P - (h - 1) * s
                            ref = rotate64(sub, pos, inv)
                            fresh = np.asarray(rotate(jnp.asarray(sub), pos, inv, dt, naive=naive)
                                               .astype(jnp.float32), np.float64)
                            cells.append({"P": P, "s": s, "h": h,
                                          "rerotate_rel_l2": float(np.median(key_errors(ks[h], ref)[1])),
                                          "rsqr_rel_l2": float(np.median(key_errors(fresh, ref)[1])),
                                          "rerotate_max_abs": float(np.median(key_errors(ks[h], ref)[0])),
                                          "rsqr_max_abs": float(np.median(key_errors(fresh, ref)[0]))})
                out["grid"][f"{kname}/{dt}/{'naive' if naive else 'exact'}"] = cells
        log(f"grid {kname} done")
    # A key crossing a window of `distance` positions in hops of s (= block b): fewer, larger hops.
    dist = cfg_run["distance"]
    out["distance"] = dist
    out["traverse"] = {}
    for kname, raw in keysets.items():
        sub = raw[np.linspace(0, len(raw) - 1, min(len(raw), cfg_run["grid_keys"])).astype(int)]
        for dt in DTYPES:
            rows = []
            for s in [x for x in cfg_run["grid_s"] if dist % x == 0]:
                h = dist // s + 1
                k_end = rerotated_keys(sub, P0, s, [h], inv, dt)[h]
                ref = rotate64(sub, P0 - dist, inv)
                fresh = np.asarray(rotate(jnp.asarray(sub), P0 - dist, inv, dt).astype(jnp.float32), np.float64)
                rows.append({"s": s, "h": h, "rerotate_rel_l2": float(np.median(key_errors(k_end, ref)[1])),
                             "rsqr_rel_l2": float(np.median(key_errors(fresh, ref)[1]))})
            out["traverse"][f"{kname}/{dt}"] = rows
    return out


# ----------------------------------------------------------------------------------- 2. attention


def window_start_np(n, W, b):
    n = np.asarray(n)
    count = np.where(n < W + b, n, W + (n - W) % b)
    return n - count


def _softmax64(s):
    s = np.asarray(s, np.float64)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(-1, keepdims=True)


def _kl_tv(p_ref, p):
    kl = np.sum(p_ref * (np.log(np.maximum(p_ref, 1e-300)) - np.log(np.maximum(p, 1e-300))), axis=-1)
    return np.maximum(kl, 0.0), 0.5 * np.abs(p_ref - p).sum(-1)


def _attention_case(q, k, tq, key_g, key_rank, q_rank, rer_write, rer_hops, shift, sink_g, inv, dt,
                    rsqr_offsets=(RSQR_GLOBAL_OFFSET,)):
    """KL/TV of rerotate and rsqr attention against float64 for captured q/k.

    q [L, T, Hq, D], k [L, T, Hkv, D] float32 raw. tq [Q] query positions. key_g [Q, W]: global positions
    of the window keys; key_rank [Q, W] their ranks; q_rank [Q]; rer_write [Q, W] rank each was written at
    by rerotate; rer_hops [Q, W] how many hops of `shift` it made since. sink_g: sink positions (ranks
    0..N-1, never hop).
    """
    L, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    N = len(sink_g)
    Q, W = key_g.shape
    kw = k[:, key_g]  # [L, Q, W, Hkv, D]
    ks = k[:, sink_g]  # [L, N, Hkv, D]
    qq = q[:, tq]  # [L, Q, Hq, D]
    pos_w = np.broadcast_to(key_rank[None, :, :, None], kw.shape[:-1])
    # float64 reference on the rank timeline.
    ref_k = np.concatenate([np.broadcast_to(rotate64(ks, np.arange(N)[None, :, None], inv)[:, None],
                                            (L, Q, N, Hkv, D)),
                            rotate64(kw, pos_w, inv)], axis=2)  # [L, Q, N+W, Hkv, D]
    ref_q = rotate64(qq, q_rank[None, :, None], inv)
    s_ref = np.einsum("lqkgd,lqnkd->lqkgn", ref_q.reshape(L, Q, Hkv, G, D), ref_k) * D**-0.5
    p_ref = _softmax64(s_ref)

    def scores(keys_f32, qrot_f32):
        return np.asarray(jnp.einsum("lqkgd,lqnkd->lqkgn", jnp.asarray(qrot_f32).reshape(L, Q, Hkv, G, D),
                                     jnp.asarray(keys_f32), precision=HP) * D**-0.5, np.float64)

    f32 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32))  # noqa: E731
    out = {}
    # rerotate: sinks written at ranks 0..N-1 (never move); window keys written at rer_write, hopped.
    sink_rot = rotate(jnp.asarray(ks), np.arange(N)[None, :, None], inv, dt)
    hop_n = _hop_fn(inv, dt, False)
    kwr = rotate(jnp.asarray(kw), np.broadcast_to(rer_write[None, :, :, None], kw.shape[:-1]), inv, dt)
    hops = jnp.asarray(np.broadcast_to(rer_hops[None, :, :, None], kw.shape[:-1]), jnp.int32)
    kwr = hop_n(kwr, jnp.asarray(-shift, jnp.int32), int(rer_hops.max()), hops)
    keys = np.concatenate([np.broadcast_to(f32(sink_rot)[:, None], (L, Q, N, Hkv, D)), f32(kwr)], axis=2)
    q_rer = f32(rotate(jnp.asarray(qq), q_rank[None, :, None], inv, jnp.float32))
    out["rerotate"] = _kl_tv(p_ref, _softmax64(scores(keys, q_rer)))
    # rank_once (streamingllm numerics): every key rotated from raw once at its rank, rounded to dt.
    kwo = rotate(jnp.asarray(kw), np.broadcast_to(key_rank[None, :, :, None], kw.shape[:-1]), inv, dt)
    keys = np.concatenate([np.broadcast_to(f32(sink_rot)[:, None], (L, Q, N, Hkv, D)), f32(kwo)], axis=2)
    out["rank_once"] = _kl_tv(p_ref, _softmax64(scores(keys, q_rer)))
    # rsqr: window keys rotated once at global position (+ offset), query at global tq for them; sinks
    # stored raw in dt and rotated in float32 at their rank inside the kernel, query relocated to q_rank.
    sink_raw = jnp.asarray(ks).astype(dt)
    sink_k = f32(rotate(sink_raw, np.arange(N)[None, :, None], inv, jnp.float32))
    q_surv = f32(rotate(jnp.asarray(qq), q_rank[None, :, None], inv, jnp.float32))
    s_sink = scores(np.broadcast_to(sink_k[:, None], (L, Q, N, Hkv, D)), q_surv)
    for off in rsqr_offsets:
        kwg = rotate(jnp.asarray(kw), np.broadcast_to(key_g[None, :, :, None] + off, kw.shape[:-1]), inv, dt)
        q_win = f32(rotate(jnp.asarray(qq), tq[None, :, None] + off, inv, jnp.float32))
        s_rsqr = np.concatenate([s_sink, scores(f32(kwg), q_win)], axis=-1)
        out["rsqr" if off == RSQR_GLOBAL_OFFSET else f"rsqr@{off}"] = _kl_tv(p_ref, _softmax64(s_rsqr))
    return out


def _summ_att(res, L):
    o = {}
    for path, (kl, tv) in res.items():
        o[path] = {"kl": _stats(kl), "tv": _stats(tv), "kl_per_layer": kl.reshape(L, -1).mean(-1).tolist()}
    return o


def exp_attention(q, k, inv, cfg_run):
    L, T = q.shape[:2]
    N = N_SINK
    sink_g = np.arange(N)
    Qn = cfg_run["att_queries"]
    tq = np.arange(T - Qn, T)
    out = {"n_sink": N, "queries": tq.tolist(), "rsqr_global_offset": RSQR_GLOBAL_OFFSET,
           "rsqr_offsets": list(RSQR_OFFSETS), "steady": {}, "uniform": {}}
    # Steady state of a rerotate stream (delta = 0): every window key at its own rotation count.
    for W in cfg_run["att_windows"]:
        for b in cfg_run["att_blocks"]:
            if T - Qn < 2 * W + 2 * b + N:
                raise SystemExit(f"exp_drift: capture_tokens {T} too small for W={W}, b={b}")
            for dt in DTYPES:
                w0 = window_start_np(tq + 1, W, b)  # [Q]
                gs = [np.arange(w, t + 1) for w, t in zip(w0, tq)]
                Wmin = min(len(g) for g in gs)  # drop the oldest extra keys so every query has W keys
                key_g = np.stack([g[len(g) - Wmin:] for g in gs])
                key_rank = N + key_g - w0[:, None]
                q_rank = N + tq - w0
                w0_g = window_start_np(key_g + 1, W, b)
                rer_write = N + key_g - w0_g
                rer_hops = (w0[:, None] - w0_g) // b
                assert np.all(rer_write - rer_hops * b == key_rank)
                res = _attention_case(q, k, tq, key_g, key_rank, q_rank, rer_write, rer_hops, b, sink_g, inv, dt,
                                      rsqr_offsets=RSQR_OFFSETS)
                s = _summ_att(res, L)
                s["max_rotations"] = int(rer_hops.max()) + 1
                s["mean_rotations"] = float(rer_hops.mean()) + 1
                out["steady"][f"W={W}/b={b}/{dt}"] = s
                log(f"attention steady W={W} b={b} {dt}: KL mean rerotate {s['rerotate']['kl']['mean']:.2e} "
                    f"rsqr {s['rsqr']['kl']['mean']:.2e} rank_once {s['rank_once']['kl']['mean']:.2e} "
                    f"(max rotations {s['max_rotations']}); rsqr vs offset " +
                    " ".join(f"{o}:{s['rsqr' if o == RSQR_GLOBAL_OFFSET else f'rsqr@{o}']['kl']['mean']:.1e}"
                             for o in RSQR_OFFSETS))
    # Uniform: every window key at h rotations of shift s (a long-lived key: survivors, huge windows).
    W = cfg_run["att_uniform_W"]
    key_g = tq[:, None] - W + 1 + np.arange(W)[None, :]
    key_rank = N + np.broadcast_to(np.arange(W), key_g.shape)
    q_rank = np.full(len(tq), N + W - 1)
    for dt in DTYPES:
        for s in cfg_run["shifts"]:
            rows = []
            for h in cfg_run["att_uniform_h"]:
                hops = np.full(key_g.shape, h - 1)
                res = _attention_case(q, k, tq, key_g, key_rank, q_rank, key_rank + (h - 1) * s, hops, s, sink_g,
                                      inv, dt)
                sm = _summ_att(res, L)
                rows.append({"h": h, **{p: {"kl": sm[p]["kl"], "tv": sm[p]["tv"]} for p in sm}})
            out["uniform"][f"W={W}/{dt}/s={s}"] = rows
            log(f"attention uniform W={W} {dt} s={s}: KL mean rerotate " +
                " ".join(f"h={r['h']}:{r['rerotate']['kl']['mean']:.1e}" for r in rows))
    return out


# ---------------------------------------------------------------------------------------- 3. model


def _stream_runner(apply_fn):
    from rsqr_jax.update import plan_step
    from rsqr_jax.update import step

    def one(params, carry, policy, toks_K):
        def body(carry, tok):
            cache, rot_ring, rot_surv = carry
            plan = plan_step(cache, policy, 1)
            inc = plan.upkeep.rerotate.astype(jnp.int32)
            rot_ring = rot_ring.at[plan.writes.win_slot_C].set(1, mode="drop") + inc * plan.upkeep.win_hop_W
            rot_surv = rot_surv.at[plan.writes.surv_slot_C].set(1, mode="drop") + inc * plan.upkeep.surv_hop_S
            logits, cache = step(apply_fn, params, tok.reshape(1, 1), cache, policy)
            in_ring, in_surv = plan.kernel.win_pos_W >= 0, plan.kernel.surv_valid_S
            r_max = jnp.maximum(jnp.max(jnp.where(in_ring, rot_ring, 0)),
                                jnp.max(jnp.where(in_surv, rot_surv, 0), initial=0))
            n_in = jnp.sum(in_ring) + jnp.sum(in_surv)
            r_mean = (jnp.sum(jnp.where(in_ring, rot_ring, 0)) + jnp.sum(jnp.where(in_surv, rot_surv, 0))) / n_in
            return (cache, rot_ring, rot_surv), (logits[0, 0], r_max, r_mean)

        return jax.lax.scan(body, carry, toks_K)

    return jax.jit(jax.vmap(one, in_axes=(None, 0, 0, None)), donate_argnums=(1,))


def _log_softmax64(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def exp_model(loaded, weights, tokens, cfg_run, oracle_check=True):
    """Stream `tokens` under every (configuration, policy) in three precisions; compare logits per step."""
    from models.llama import Llama, split_apply
    from rsqr_jax import policy as P
    from rsqr_jax.cache import init_cache
    from rsqr_jax.spec import CacheSpec

    cfg = loaded.config
    T = len(tokens)
    K = cfg_run["segment"]
    if T % K:
        raise SystemExit(f"exp_drift: model_tokens {T} must be a multiple of segment {K}")
    configs = []  # (name, ref policy, {mode: policy})
    for W, b in cfg_run["model_configs"]:
        kw = dict(window=W, n_sink=N_SINK, delta=0, block=b)
        configs.append((f"W={W},b={b}", "streamingllm", {
            "streamingllm": P.make_policy("streamingllm", window=W, n_sink=N_SINK, block=b),
            "rsqr": P.make_policy("rsqr", **kw), "rerotate": P.make_policy("rerotate", **kw)}))
    sc = cfg_run["surv_config"]
    skw = dict(window=sc["window"], n_sink=N_SINK, delta=sc["delta"], max_survivors=sc["max_survivors"],
               block=sc["block"], overflow="fifo")
    configs.append((f"W={sc['window']},b={sc['block']},delta={sc['delta']},S={sc['max_survivors']}", "rsqr", {
        "rsqr": P.make_policy("rsqr", **skw), "rerotate": P.make_policy("rerotate", **skw)}))
    all_pols = [p for _, _, d in configs for p in d.values()]

    f32_apply, f32_params = split_apply(loaded.model, kernel="xla")
    # name: (apply_fn, params, cache dtype, modes, stream start); "f32" first: it holds the references.
    precisions = {
        "f32": (f32_apply, f32_params, "float32", None, 0),
        "f32+bf16cache": (f32_apply, f32_params, "bfloat16", ("rsqr", "rerotate"), 0),
    }
    if "bf16" in cfg_run["precisions"]:
        bf_apply, bf_params = split_apply(Llama(cfg, weights, dtype=jnp.bfloat16), kernel="xla")
        precisions["bf16"] = (bf_apply, bf_params, "bfloat16", ("rsqr", "rerotate"), 0)
    # The same bfloat16-cache stream started at global position 1e5 (init_cache(spec, start)): rank-timeline
    # logits do not depend on the start, so the float32 references at start 0 still apply; rsqr's window keys
    # are rotated at global positions and round differently there.
    if START_PRECISION in cfg_run["precisions"]:
        if "start" in inspect.signature(init_cache).parameters:
            precisions[START_PRECISION] = (f32_apply, f32_params, "bfloat16", ("rsqr", "rerotate"), LATE_START)
        else:
            log("init_cache has no `start`: skipping the late-start stream")
    precisions = {k: v for k, v in precisions.items() if k in cfg_run["precisions"]}
    streams = {}
    for pname, (apply_fn, params, cdt, modes, start) in precisions.items():
        idx = [(ci, m) for ci, (_, _, d) in enumerate(configs) for m in d if modes is None or m in modes]
        pols = P.stack_policies([configs[ci][2][m] for ci, m in idx])
        spec = CacheSpec.for_policies(all_pols, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                      head_dim=cfg.head_dim, dtype=cdt)
        cache = init_cache(spec, start=start) if start else init_cache(spec)
        n = len(idx)
        carry = (jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), cache),
                 jnp.zeros((n, spec.win_capacity), jnp.int32), jnp.zeros((n, spec.surv_capacity), jnp.int32))
        streams[pname] = dict(idx=idx, policies=pols, carry=carry, params=params, run=_stream_runner(apply_fn),
                              spec=spec)
    ref_of = {}  # ci -> index of its reference in the f32 stream
    for j, (ci, m) in enumerate(streams["f32"]["idx"]):
        if m == configs[ci][1]:
            ref_of[ci] = j

    # float64 oracle on a prefix for the first delta = 0 configuration and the survivor configuration.
    T_o = min(cfg_run["oracle_tokens"], T) if oracle_check else 0
    oracle_cis = ([0, len(configs) - 1] if cfg_run["oracle_configs"] == "both" else [0]) if T_o else []
    keep = {}  # (ci, mode) -> [T_o, V] f32 logits of the f32 stream

    series = {pn: {f"{configs[ci][0]}/{m}": {"kl": [], "max_abs": [], "top1": [], "nll": [], "max_rot": [],
                                             "mean_rot": []} for ci, m in st["idx"]}
              for pn, st in streams.items()}
    ref_nll = {configs[ci][0]: [] for ci in ref_of}
    t_start, st_time = time.time(), {}
    for seg in range(T // K):
        toks = jnp.asarray(tokens[seg * K:(seg + 1) * K])
        targets = np.full(K, -1, np.int64)
        nxt = tokens[seg * K + 1:(seg + 1) * K + 1]
        targets[:len(nxt)] = nxt
        ref_lp, ref_logits = None, None
        for pname, st in streams.items():  # "f32" first: it holds the references
            ts = time.time()
            st["carry"], (logits, r_max, r_mean) = st["run"](st["params"], st["carry"], st["policies"], toks)
            logits = np.asarray(logits).astype(np.float64)  # [n, K, V]
            st_time[pname] = st_time.get(pname, 0.0) + time.time() - ts
            if pname == "f32":
                ref_logits = {ci: logits[j] for ci, j in ref_of.items()}
                ref_lp = {ci: _log_softmax64(x) for ci, x in ref_logits.items()}
                for ci in ref_of:
                    ref_nll[configs[ci][0]].append(_nll(ref_lp[ci], targets))
                for j, (ci, m) in enumerate(st["idx"]):
                    if ci in oracle_cis and seg * K < T_o:
                        keep.setdefault((ci, m), []).append(logits[j].astype(np.float32))
            for j, (ci, m) in enumerate(st["idx"]):
                lp = _log_softmax64(logits[j])
                lr = ref_lp[ci]
                ser = series[pname][f"{configs[ci][0]}/{m}"]
                ser["kl"].append(np.maximum(np.sum(np.exp(lr) * (lr - lp), -1), 0.0))
                ser["max_abs"].append(np.abs(logits[j] - ref_logits[ci]).max(-1))
                ser["top1"].append(np.argmax(lp, -1) == np.argmax(lr, -1))
                ser["nll"].append(_nll(lp, targets))
                ser["max_rot"].append(np.asarray(r_max[j]))
                ser["mean_rot"].append(np.asarray(r_mean[j]))
        done = (seg + 1) * K
        log(f"model: {done}/{T} tokens streamed ({time.time() - t_start:.0f}s; per stream " +
            ", ".join(f"{k} {v:.0f}s" for k, v in st_time.items()) + ")")

    out = {"tokens": T, "n_sink": N_SINK, "configs": {}, "precisions": {
        "f32": "float32 model, float32 cache", "f32+bf16cache": "float32 model, bfloat16 KV cache",
        "bf16": "bfloat16 model (weights and activations), bfloat16 KV cache",
        START_PRECISION: f"float32 model, bfloat16 KV cache, stream starting at global position {LATE_START}"},
        "series": {}, "summary": {}}
    for ci, (name, ref_mode, d) in enumerate(configs):
        h = d[ref_mode].host()
        first_evict = h["window"] + h["block"] - 1  # 0-based step of the first eviction event
        out["configs"][name] = {"policy_params": {m: p.host() for m, p in d.items()}, "reference": f"f32 {ref_mode}",
                                "first_eviction_step": first_evict,
                                "ref_nll_mean": float(np.nanmean(np.concatenate(ref_nll[name])))}
    for pname, sers in series.items():
        for key, ser in sers.items():
            cname = key.rsplit("/", 1)[0]
            fe = out["configs"][cname]["first_eviction_step"]
            arr = {k: np.concatenate([np.atleast_1d(x) for x in v]).astype(np.float64) for k, v in ser.items()}
            out["series"][f"{pname}/{key}"] = {k: [float(f"{x:.4g}") for x in arr[k]] for k in
                                              ("kl", "max_abs", "max_rot", "mean_rot")}
            after = slice(fe, T - 1)  # steps with at least one eviction; the last step has no target
            last_q = slice(T - 1 - (T - 1 - fe) // 4, T - 1)
            nll = arr["nll"][after]
            ref = np.concatenate(ref_nll[cname])[after]
            out["summary"][f"{pname}/{key}"] = {
                "kl_mean": float(arr["kl"][after].mean()), "kl_median": float(np.median(arr["kl"][after])),
                "kl_max": float(arr["kl"][after].max()), "kl_mean_last_quarter": float(arr["kl"][last_q].mean()),
                "max_abs_mean": float(arr["max_abs"][after].mean()), "max_abs_max": float(arr["max_abs"][after].max()),
                "top1_agree": float(arr["top1"][after].mean()),
                "nll_mean": float(nll.mean()), "dnll_mean": float((nll - ref).mean()),
                "max_rotations": int(arr["max_rot"].max()), "mean_rotations_end": float(arr["mean_rot"][-1]),
                "kl_before_eviction_max": float(arr["kl"][:fe].max()) if fe > 0 else 0.0,
            }
    # float64 oracle check of the float32 stream (reference and the other paths) on the prefix.
    if T_o:
        from rsqr_jax.testing.oracle import reference_token_sets, stream_logits_f64

        out["oracle"] = {"tokens": T_o}
        w64 = {k: np.asarray(v, np.float64) for k, v in weights.items()}
        if cfg_run["oracle_configs"] == "both":
            # The vectorized oracle against the project's reference implementation, on a few tokens.
            n_x = 6
            sets = [set(range(t + 1)) for t in range(n_x)]
            out["oracle"]["vectorized_vs_tests_oracle_max_abs"] = float(np.abs(
                oracle_logits_f64(w64, cfg, tokens[:n_x], sets) -
                stream_logits_f64(weights, cfg, tokens[:n_x], sets, "rank")).max())
        for ci in oracle_cis:
            name, ref_mode, d = configs[ci]
            h = d[ref_mode].host()
            sets = [set(s) for _, s in reference_token_sets(
                T_o, window=h["window"], n_sink=h["n_sink"], delta=h["delta"], max_survivors=h["max_survivors"],
                block=h["block"], overflow=P.OVERFLOWS[h["overflow"]])]
            t0 = time.time()
            lo = oracle_logits_f64(w64, cfg, tokens[:T_o], sets)
            lr = _log_softmax64(lo)
            for m in d:
                got = np.concatenate(keep[(ci, m)], axis=0)[:T_o].astype(np.float64)
                lp = _log_softmax64(got)
                kl = np.maximum(np.sum(np.exp(lr) * (lr - lp), -1), 0.0)
                out["oracle"][f"{name}/{m}"] = {"max_abs": float(np.abs(got - lo).max()), "kl_max": float(kl.max()),
                                                "kl_mean": float(kl.mean())}
            log(f"oracle {name}: {T_o} tokens in {time.time() - t0:.0f}s: " +
                ", ".join(f"{m} max-abs {out['oracle'][f'{name}/{m}']['max_abs']:.1e}" for m in d))
    return out


def oracle_logits_f64(weights, cfg, tokens, token_sets):
    """float64 logits [T, V] of one sequence streamed token by token on the rank timeline.

    The same semantics as tests/oracle.stream_logits_f64 (token_sets[t] = cached global positions after
    token t; every cached key rotated from raw at its rank, the query at its own rank; raw K/V computed
    once, when the token is processed), vectorized over the cached keys so a few hundred tokens of the
    135M model take seconds instead of minutes. Checked against tests/oracle on a short prefix.
    """
    w = weights if all(v.dtype == np.float64 for v in weights.values()) else \
        {k: np.asarray(v, np.float64) for k, v in weights.items()}
    L, Hq, Hkv, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G = Hq // Hkv
    inv = cfg.inv_freq
    T = len(tokens)
    raw_k = np.zeros((L, T, Hkv, D))
    raw_v = np.zeros((L, T, Hkv, D))
    head = w["embed"].T if "lm_head" not in w else w["lm_head"]

    def rms(x, g):
        return g * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.rms_norm_eps))

    out = np.zeros((T, head.shape[1]))
    for t, tok in enumerate(tokens):
        cached = np.asarray(sorted(token_sets[t]))
        assert cached[-1] == t
        ranks = np.arange(len(cached))
        x = w["embed"][tok]
        for li in range(L):
            h = rms(x, w["attn_norm"][li])
            q, k, v = h @ w["wq"][li], h @ w["wk"][li], h @ w["wv"][li]
            if cfg.attention_bias:
                q, k, v = q + w["bq"][li], k + w["bk"][li], v + w["bv"][li]
            raw_k[li, t], raw_v[li, t] = k.reshape(Hkv, D), v.reshape(Hkv, D)
            K = rotate64(raw_k[li, cached], ranks[:, None], inv)  # [n, Hkv, D]
            qr = rotate64(q.reshape(Hkv, G, D), ranks[-1], inv)
            sc = np.einsum("kgd,nkd->kgn", qr, K) / np.sqrt(D)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            att = np.einsum("kgn,nkd->kgd", p, raw_v[li, cached]).reshape(-1)
            x = x + att @ w["wo"][li]
            h = rms(x, w["mlp_norm"][li])
            g_ = h @ w["w_gate"][li]
            x = x + ((g_ / (1 + np.exp(-g_))) * (h @ w["w_up"][li])) @ w["w_down"][li]
        out[t] = rms(x, w["final_norm"]) @ head
    return out


def _nll(lp, targets):
    t = np.asarray(targets)
    v = np.where(t >= 0, t, 0)
    nll = -np.take_along_axis(lp, v[:, None], axis=-1)[:, 0]
    return np.where(t >= 0, nll, np.nan)


# ---------------------------------------------------------------------------------------- plots, md


def make_plots(res, out_dir: Path, cmd: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}

    def save(fig, name):
        p = out_dir / name
        fig.savefig(p, dpi=90, bbox_inches="tight")
        plt.close(fig)
        files[name] = str(p)

    if "keys" in res:
        keys = res["keys"]
        # 1. error vs rotations
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, s in zip(axes, keys["shifts"]):
            for kname, ls in (("random", "-"), ("captured", "--")):
                for dt, col in (("float32", "tab:blue"), ("bfloat16", "tab:red")):
                    rows = keys["sweep"].get(f"{kname}/{dt}/s={s}")
                    if not rows:
                        continue
                    h = [r["h"] for r in rows]
                    ax.loglog(h, [r["rerotate"]["rel_l2"]["median"] for r in rows], ls, color=col, marker="o", ms=3,
                              label=f"rerotate {dt} {kname}")
                    ax.loglog(h, [r["rsqr"]["rel_l2"]["median"] for r in rows], ls, color=col, alpha=0.4,
                              label=f"rsqr {dt} {kname}")
            ax.set_title(f"key error vs float64, hops of -{s}")
            ax.set_xlabel("rotations h (1 = written once)")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("median relative L2 error")
        axes[1].legend(fontsize=7)
        save(fig, "drift_keys.png")

        # 2. P and s
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        hmax = max(res["config"]["grid_h"])
        s0 = min(res["config"]["grid_s"])
        for kname, ls in (("random", "-"), ("captured", "--")):
            for dt, col in (("float32", "tab:blue"), ("bfloat16", "tab:red")):
                for ang, mk in (("exact", "o"), ("naive", "x")):
                    cells = keys["grid"].get(f"{kname}/{dt}/{ang}")
                    if not cells:
                        continue
                    c = [x for x in cells if x["s"] == s0 and x["h"] == hmax]
                    axes[0].loglog([max(x["P"], 1) for x in c], [x["rerotate_rel_l2"] for x in c], ls, color=col,
                                   marker=mk, ms=4, alpha=1 if ang == "exact" else 0.5,
                                   label=f"rerotate {dt} {kname} {ang}")
                    c1 = [x for x in cells if x["s"] == s0 and x["h"] == 1 and x["rsqr_rel_l2"] > 0]
                    axes[0].loglog([max(x["P"], 1) for x in c1], [x["rsqr_rel_l2"] for x in c1], ":", color=col,
                                   marker=mk, ms=3, alpha=0.5)
                    if ang == "exact":
                        P0 = sorted({x["P"] for x in cells})[len({x["P"] for x in cells}) // 2]
                        c = [x for x in cells if x["P"] == P0 and x["h"] == hmax]
                        axes[1].loglog([x["s"] for x in c], [x["rerotate_rel_l2"] for x in c], ls, color=col, marker=mk,
                                       ms=4, label=f"rerotate {dt} {kname} (P={P0})")
        axes[0].set_title(f"error vs base position P (s={s0}, h={hmax}); dotted: one rotation")
        axes[0].set_xlabel("P (0 plotted at 1)")
        axes[0].set_ylabel("median relative L2 error")
        axes[1].set_title(f"error vs shift s = evict_n (h={hmax})")
        axes[1].set_xlabel("s")
        for kname, ls in (("random", "-"), ("captured", "--")):
            for dt, col in (("float32", "tab:blue"), ("bfloat16", "tab:red")):
                rows = keys.get("traverse", {}).get(f"{kname}/{dt}")
                if rows:
                    axes[2].loglog([r["s"] for r in rows], [r["rerotate_rel_l2"] for r in rows], ls, color=col,
                                   marker="o", ms=4, label=f"rerotate {dt} {kname}")
                    axes[2].loglog([r["s"] for r in rows], [r["rsqr_rel_l2"] for r in rows], ":", color=col,
                                   alpha=0.5)
        axes[2].set_title(f"a key crossing {keys.get('distance')} positions in hops of s (dotted: rsqr)")
        axes[2].set_xlabel("s (= block b); hops = distance / s")
        for ax in axes:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
        save(fig, "drift_grid.png")

        # 3. per pair
        fig, ax = plt.subplots(figsize=(8, 4))
        for key, d in keys["pairs"].items():
            kname, dt, s = key.split("/")
            if dt != "bfloat16":
                continue
            ax.semilogy(d["rerotate_rel_rms"], "-" if kname == "random" else "--", marker=".",
                        label=f"rerotate {kname} {s}")
        d0 = next(iter(v for k, v in keys["pairs"].items() if "bfloat16" in k))
        ax.semilogy(d0["rsqr_rel_rms"], ":", color="k", label="rsqr (one rotation)")
        ax.set_xlabel("frequency pair j (0 = fastest)")
        ax.set_ylabel("relative RMS error of the pair")
        ax.set_title("bfloat16, h=100 rotations: which pairs drift")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, "drift_pairs.png")

    if "attention" in res:
        # 4. attention
        att = res["attention"]
        fig, ax = plt.subplots(figsize=(8, 4))
        for key, rows in att["uniform"].items():
            W, dt, s = key.split("/")
            col = "tab:red" if dt == "bfloat16" else "tab:blue"
            ls = "-" if s == "s=1" else "--"
            h = [r["h"] for r in rows]
            ax.loglog(h, [max(r["rerotate"]["kl"]["mean"], 1e-18) for r in rows], ls, color=col, marker="o", ms=3,
                      label=f"rerotate {dt} {s}")
            ax.loglog(h, [max(r["rsqr"]["kl"]["mean"], 1e-18) for r in rows], ls, color=col, alpha=0.35,
                      label=f"rsqr {dt} {s} (window at ~{att['rsqr_global_offset']:.0e})")
            if s == "s=1":
                ax.loglog(h, [max(r["rank_once"]["kl"]["mean"], 1e-18) for r in rows], ":", color="k", alpha=0.6,
                          label=f"streamingllm (once, at rank) {dt}")
        ax.set_xlabel("rotations h of every window key")
        ax.set_ylabel("mean KL(p64 || p) of attention")
        ax.set_title(f"captured SmolLM2 q/k, {att['n_sink']} sinks + {res['config']['att_uniform_W']} window keys")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, "drift_attention.png")

    # 5. model
    mod = res.get("model")
    if mod:
        names = list(mod["configs"])
        fig, axes = plt.subplots(len(names), 1, figsize=(9, 1.9 * len(names)), sharex=True)
        axes = np.atleast_1d(axes)
        for ax, cname in zip(axes, names):
            for pname, col in (("f32+bf16cache", "tab:orange"), ("bf16", "tab:red"), ("f32", "tab:blue"),
                               (START_PRECISION, "tab:purple")):
                for m, ls in (("rerotate", "-"), ("rsqr", ":")):
                    ser = mod["series"].get(f"{pname}/{cname}/{m}")
                    if ser is None:
                        continue
                    if pname == "f32" and mod["configs"][cname]["reference"].endswith(m):
                        continue
                    kl = np.maximum(np.asarray(ser["kl"]), 1e-13)
                    c = np.concatenate([[0.0], np.cumsum(kl)])
                    lo = np.maximum(np.arange(1, len(kl) + 1) - 32, 0)
                    sm = (c[1:] - c[lo]) / (np.arange(1, len(kl) + 1) - lo)  # trailing 32-step mean
                    ax.semilogy(sm, ls, color=col, lw=1, label=f"{m} {pname}")
            ax.axvline(mod["configs"][cname]["first_eviction_step"], color="k", lw=0.5)
            ax.set_ylabel("KL, 32-step mean", fontsize=8)
            ax.set_ylim(1e-13, 1e-1)
            ax.set_title(cname, fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=6, ncol=3)
        axes[-1].set_xlabel("stream step t (vertical line: first eviction)")
        fig.suptitle("per-step KL(reference || policy) of the next-token distribution", fontsize=10)
        save(fig, "drift_model.png")
    return files


def fmt(x):
    if x == 0:
        return "0"
    if abs(x) >= 0.01 and abs(x) < 1000:
        return f"{x:.3g}"
    return f"{x:.1e}"


def markdown(res, cmd: str) -> str:
    L = [f"<!-- generated by: {cmd} -->", ""]
    if "keys" in res:
        L += ["### Keys: error after h rotations (median relative L2 / median max-abs, vs float64)", ""]
        keys = res["keys"]
        hs = [h for h in keys["rotations"] if h in (1, 2, 10, 100, 1000)]
        L.append("| keys | dtype | s | path | " + " | ".join(f"h={h}" for h in hs) + " |")
        L.append("|---|---|---|---|" + "---|" * len(hs))
        for key, rows in keys["sweep"].items():
            kname, dt, s = key.split("/")
            by = {r["h"]: r for r in rows}
            for path in ("rerotate", "rsqr"):
                L.append(f"| {kname} | {dt} | {s[2:]} | {path} | " + " | ".join(
                    f"{fmt(by[h][path]['rel_l2']['median'])} / {fmt(by[h][path]['max_abs']['median'])}"
                    for h in hs) + " |")
        L += ["", f"### P x s grid (rerotate, median relative L2 at h={max(res['config']['grid_h'])})", ""]
        for key, cells in keys["grid"].items():
            hmax = max(c["h"] for c in cells)
            Ps = sorted({c["P"] for c in cells})
            ss = sorted({c["s"] for c in cells})
            L.append(f"**{key}**  ")
            L.append("| P \\ s | " + " | ".join(str(s) for s in ss) + " |")
            L.append("|---|" + "---|" * len(ss))
            for P_ in Ps:
                row = {c["s"]: c for c in cells if c["P"] == P_ and c["h"] == hmax}
                L.append(f"| {P_} | " + " | ".join(fmt(row[s]["rerotate_rel_l2"]) for s in ss) + " |")
            L.append("")
        if "traverse" in keys:
            tr = keys["traverse"]
            ss = [r["s"] for r in next(iter(tr.values()))]
            L += [f"### A key crossing {keys['distance']} positions in hops of s (median relative L2 at the end)", "",
                  "| keys / dtype | " + " | ".join(f"s={s_} ({keys['distance'] // s_} hops)" for s_ in ss) +
                  " | rsqr (one rotation) |", "|---|" + "---|" * (len(ss) + 1)]
            for key, rows in tr.items():
                L.append(f"| {key} | " + " | ".join(fmt(r["rerotate_rel_l2"]) for r in rows) +
                         f" | {fmt(rows[0]['rsqr_rel_l2'])} |")
            L.append("")
        L += ["### One rotation from raw (rsqr / streamingllm) vs position P (median relative L2, exact angles)", "",
              "| keys / dtype | " + " | ".join(f"P={p_}" for p_ in
                                               sorted({c["P"] for c in next(iter(keys["grid"].values()))}))
              + " |", "|---|" + "---|" * len({c["P"] for c in next(iter(keys["grid"].values()))})]
        for key, cells in keys["grid"].items():
            Ps = sorted({c["P"] for c in cells})
            s0 = min(c["s"] for c in cells)
            row = {c["P"]: c for c in cells if c["s"] == s0 and c["h"] == 1}
            L.append(f"| {key} | " + " | ".join(fmt(row[p_]["rsqr_rel_l2"]) for p_ in Ps) + " |")
        L.append("")
    if "attention" in res:
        att = res["attention"]
        L += ["### Attention (captured q/k): KL(p64 || p), mean / max over layers x heads x queries", "",
              "| case | dtype | max rotations | rerotate KL mean | rerotate KL max | rsqr KL mean | rsqr KL max | "
              "rank-once KL mean | rerotate TV mean | rsqr TV mean |", "|---|---|---|---|---|---|---|---|---|---|"]
        for key, s in att["steady"].items():
            W, b, dt = key.split("/")
            L.append(f"| steady {W}, {b} | {dt} | {s['max_rotations']} | {fmt(s['rerotate']['kl']['mean'])} | "
                     f"{fmt(s['rerotate']['kl']['max'])} | {fmt(s['rsqr']['kl']['mean'])} | "
                     f"{fmt(s['rsqr']['kl']['max'])} | "
                     f"{fmt(s['rank_once']['kl']['mean'])} | {fmt(s['rerotate']['tv']['mean'])} | "
                     f"{fmt(s['rsqr']['tv']['mean'])} |")
        for key, rows in att["uniform"].items():
            W, dt, s_ = key.split("/")
            for r in rows:
                if r["h"] in (1, 10, 100, 1000):
                    L.append(f"| uniform {W}, {s_} | {dt} | {r['h']} | {fmt(r['rerotate']['kl']['mean'])} | "
                             f"{fmt(r['rerotate']['kl']['max'])} | {fmt(r['rsqr']['kl']['mean'])} | "
                             f"{fmt(r['rsqr']['kl']['max'])} | {fmt(r['rank_once']['kl']['mean'])} | "
                             f"{fmt(r['rerotate']['tv']['mean'])} | {fmt(r['rsqr']['tv']['mean'])} |")
        L += ["", "rsqr attention floor vs the global position of the window (KL mean; window keys rotated once at "
              "g + offset, query at t + offset):", "",
              "| case | dtype | " + " | ".join(f"offset {o}" for o in att["rsqr_offsets"]) + " |",
              "|---|---|" + "---|" * len(att["rsqr_offsets"])]
        for key, s in att["steady"].items():
            W, b, dt = key.split("/")
            L.append(f"| {W}, {b} | {dt} | " + " | ".join(
                fmt(s["rsqr" if o == att["rsqr_global_offset"] else f"rsqr@{o}"]["kl"]["mean"])
                for o in att["rsqr_offsets"])
                + " |")
    mod = res.get("model")
    if mod:
        L += ["", f"### Model: per-step logits vs the float32 reference, {mod['tokens']} Frankenstein tokens "
              "(steps after the first eviction)", "",
              "| config | precision | policy | max rotations | KL mean | KL max | KL mean (last quarter) | "
              "max-abs mean | max-abs max | top-1 agree | dNLL mean |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for key, s in mod["summary"].items():
            pname, cname, m = key.split("/")
            ref = mod["configs"][cname]["reference"]
            if pname == "f32" and ref.endswith(m):
                continue
            L.append(f"| {cname} | {pname} | {m} | {s['max_rotations']} | {fmt(s['kl_mean'])} | {fmt(s['kl_max'])} | "
                     f"{fmt(s['kl_mean_last_quarter'])} | {fmt(s['max_abs_mean'])} | {fmt(s['max_abs_max'])} | "
                     f"{s['top1_agree']:.3f} | {s['dnll_mean']:+.4f} |")
        if "oracle" in mod:
            L += ["", f"Float32 stream vs the float64 rank oracle, first {mod['oracle']['tokens']} tokens:", "",
                  "| config / policy | max-abs logits | KL max |", "|---|---|---|"]
            for key, o in mod["oracle"].items():
                if not isinstance(o, dict):
                    continue
                L.append(f"| {key} | {fmt(o['max_abs'])} | {fmt(o['kl_max'])} |")
    return "\n".join(L) + "\n"


# ------------------------------------------------------------------------------------------- main


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small CI run (< 3 min)")
    p.add_argument("--out", default="runs/exp_drift", help="output directory (results.json, PNGs, markdown)")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded SmolLM2)")
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="text to capture keys from and to stream")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-tokens", type=int, default=None, help="override the model-level stream length")
    p.add_argument("--parts", default="keys,attention,model",
                   help="comma-separated subset of keys,attention,model (plots/markdown cover what ran)")
    p.add_argument("--no-oracle", action="store_true", help="skip the float64 oracle check of the references")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--replot", action="store_true",
                   help="only redraw the plots and markdown from OUT/results.json (no computation)")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    cfg_run = dict(QUICK if args.quick else FULL)
    if args.model_tokens:
        cfg_run["model_tokens"] = args.model_tokens
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = "python scripts/exp_drift.py" + (" --quick" if args.quick else "") + f" --out {args.out}"
    if args.replot:
        res = json.loads((out_dir / "results.json").read_text())
        res["plots"] = make_plots(res, out_dir, cmd)
        (out_dir / "drift_section.md").write_text(markdown(res, res.get("command", cmd)))
        (out_dir / "results.json").write_text(json.dumps(res, indent=1))
        return res
    t0 = time.time()
    timings = {}

    loaded = load(args.model)
    cfg = loaded.config
    inv = cfg.inv_freq
    weights = model_weights(loaded.model, cfg)
    T_need = max(cfg_run["capture_tokens"], cfg_run["model_tokens"] + 1)
    tokens = read_tokens(loaded.tokenizer, args.text, T_need)
    timings["load"] = time.time() - t0
    log(f"loaded {loaded.path} and {len(tokens)} tokens in {timings['load']:.0f}s")

    # Capture raw q/k and check the capture forward against the library's model forward.
    t = time.time()
    Tc = cfg_run["capture_tokens"]
    q, k, cap_logits = capture_qk(weights, cfg, tokens[:Tc])
    from models.llama import forward_logits

    n_chk = min(Tc, 64)
    lib_logits = forward_logits(loaded, tokens[None, :n_chk])[0]
    capture_check = float(np.abs(lib_logits - cap_logits[:n_chk]).max())
    log(f"captured q/k of {Tc} tokens x {cfg.num_layers} layers; max |logits - forward_logits| = {capture_check:.1e}")
    timings["capture"] = time.time() - t

    rng = np.random.default_rng(args.seed)
    D = cfg.head_dim
    sub_t = np.arange(0, Tc, cfg_run["capture_stride"])
    captured = k[:, sub_t].reshape(-1, D).astype(np.float32)
    keysets = {"random": rng.normal(size=(cfg_run["n_random"], D)).astype(np.float32), "captured": captured}
    t = time.time()
    res = {"config": {**cfg_run, "quick": args.quick, "model": loaded.path, "head_dim": D,
                      "rope_theta": cfg.rope_theta, "num_layers": cfg.num_layers,
                      "n_keys": {n: len(v) for n, v in keysets.items()}},
           "capture_check_max_abs_logits": capture_check}
    parts = set(args.parts.split(","))
    if parts - {"keys", "attention", "model"}:
        raise SystemExit(f"exp_drift: unknown --parts {args.parts!r}")
    if "keys" in parts:
        res["keys"] = exp_keys(keysets, inv, cfg_run)
        timings["keys"] = time.time() - t
    t = time.time()
    if "attention" in parts:
        res["attention"] = exp_attention(q, k, inv, cfg_run)
        timings["attention"] = time.time() - t
    if "model" in parts:
        t = time.time()
        res["model"] = exp_model(loaded, weights, tokens[:cfg_run["model_tokens"]], cfg_run,
                                 oracle_check=not args.no_oracle)
        timings["model"] = time.time() - t
    timings["total"] = time.time() - t0
    res["timings_s"] = timings
    res["command"] = cmd + (f" --parts {args.parts}" if parts != {"keys", "attention", "model"} else "")
    prev = out_dir / "results.json"
    if parts != {"keys", "attention", "model"} and prev.is_file():
        # A partial run updates its parts in an existing results.json and keeps the others.
        old = json.loads(prev.read_text())
        if old.get("config", {}).get("quick") == args.quick:
            for part in {"keys", "attention", "model"} - parts:
                if part in old:
                    res[part] = old[part]
            res["timings_s"] = {**old.get("timings_s", {}), "rerun": {"parts": sorted(parts), **timings}}
            res["command"] = old.get("command", cmd)
    res["plots"] = {} if args.no_plots else make_plots(res, out_dir, cmd)
    (out_dir / "results.json").write_text(json.dumps(res, indent=1))
    (out_dir / "drift_section.md").write_text(markdown(res, res["command"]))
    log(f"done in {timings['total']:.0f}s -> {out_dir}")
    return res


if __name__ == "__main__":
    main()
