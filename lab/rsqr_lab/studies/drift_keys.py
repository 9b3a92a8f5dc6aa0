"""Drift, levels 1 and 2: stored keys after h rotate-and-round hops against one rotation from raw, and
the attention distribution of captured queries/keys over sinks + a window (see drift.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rsqr_jax.kernels.exact_rope import rope_cos_sin, rotate_half_split
from rsqr_jax.eval.runtime import status
from rsqr_jax.policy import window_start
from rsqr_lab.testing.oracle import rope_f64

HP = jax.lax.Precision.HIGHEST
DTYPES = ("float32", "bfloat16")
N_SINK = 4
RSQR_GLOBAL_OFFSET = 100_000  # rsqr window keys/queries sit at global positions ~1e5 (a long stream)
RSQR_OFFSETS = (0, 1000, 10_000, RSQR_GLOBAL_OFFSET, 1_000_000)  # attention level: rsqr floor vs global position


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


@functools.partial(jax.jit, static_argnames=("inv_key", "dtype", "naive"))
def _hop_n(k, shift, n, mask_n, *, inv_key: tuple, dtype: str, naive: bool):
    """Rotate k by `shift` (broadcast over k[..., 0]) n times, rounding to dtype each time; a key rotates
    in iteration i only while i < mask_n (its own remaining hop count). inv_key: inv_freq as a static
    tuple, so the exact angle reduction sees a concrete inverse frequency."""
    inv = np.asarray(inv_key, np.float32)

    def body(i, k):
        moved = rotate(k, shift, inv, dtype, naive=naive)
        return jnp.where((i < mask_n)[..., None], moved, k)

    return jax.lax.fori_loop(0, n, body, k)


def hop_n(k, shift, n, mask_n, inv_freq, dtype, naive=False):
    inv_key = tuple(float(x) for x in np.asarray(inv_freq, np.float32))
    return _hop_n(k, jnp.asarray(shift, jnp.int32), n, mask_n, inv_key=inv_key, dtype=str(jnp.dtype(dtype)),
                  naive=bool(naive))


def rerotated_keys(raw_NxD, P, s, checkpoints, inv_freq, dtype, *, naive=False):
    """{h: stored key after h rotations}: written at P, then hops of -s, rounded to dtype each time."""
    k = rotate(jnp.asarray(raw_NxD), P, np.asarray(inv_freq), dtype, naive=naive)
    out, h = {}, 1
    for target in sorted(checkpoints):
        n = target - h
        if n:
            k = hop_n(k, -s, n, jnp.full(k.shape[:-1], n, jnp.int32), inv_freq, dtype, naive)
        h = target
        out[h] = np.asarray(k.astype(jnp.float32), np.float64)
    return out


def key_errors(path_NxD, ref_NxD):
    """Per-key max-abs and relative L2 error: arrays [N]."""
    e = path_NxD - ref_NxD
    return np.abs(e).max(-1), np.linalg.norm(e, axis=-1) / np.linalg.norm(ref_NxD, axis=-1)


def stats(x) -> dict:
    x = np.asarray(x, np.float64).ravel()
    return {"median": float(np.median(x)), "p90": float(np.quantile(x, 0.9)), "mean": float(np.mean(x)),
            "max": float(np.max(x))}


def _fresh(raw, pos, inv, dt, naive=False):
    """The rsqr path: one rotation from raw at pos, rounded to dt, as float64."""
    return np.asarray(rotate(jnp.asarray(raw), pos, inv, dt, naive=naive).astype(jnp.float32), np.float64)


def _subsample(raw_NxD, n):
    return raw_NxD[np.linspace(0, len(raw_NxD) - 1, min(len(raw_NxD), n)).astype(int)]


# ---------------------------------------------------------------------------------------- 1. keys


def exp_keys(keysets: dict, inv, cfg: "DriftConfig") -> dict:
    """Rotation sweep, P x s grid, and per-pair breakdown for each key set and dtype."""
    P0, hs = cfg.base_pos, list(cfg.rotations)
    out = {"rotations": hs, "shifts": list(cfg.shifts), "base_pos": P0, "sweep": {}, "grid": {}, "pairs": {}}
    for kname, raw in keysets.items():
        for dt in DTYPES:
            for s in cfg.shifts:
                ks = rerotated_keys(raw, P0, s, hs, inv, dt)
                rows = []
                for h in hs:
                    pos = P0 - (h - 1) * s
                    ref = rope_f64(raw, pos, inv)
                    fresh = _fresh(raw, pos, inv, dt)
                    ma_r, rl_r = key_errors(ks[h], ref)
                    ma_f, rl_f = key_errors(fresh, ref)
                    rows.append({"h": h, "final_pos": pos,
                                 "rerotate": {"max_abs": stats(ma_r), "rel_l2": stats(rl_r)},
                                 "rsqr": {"max_abs": stats(ma_f), "rel_l2": stats(rl_f)}})
                    if h == 100:
                        out["pairs"][f"{kname}/{dt}/s={s}"] = _pair_errors(ks[h], fresh, ref, s, inv, h)
                out["sweep"][f"{kname}/{dt}/s={s}"] = rows
                status(f"keys {kname} {dt} s={s}: rerotate rel-L2 median " +
                       " ".join(f"h={r['h']}:{r['rerotate']['rel_l2']['median']:.2g}" for r in rows if r["h"] in
                                (1, 10, 100, 1000)) + f" | rsqr {rows[-1]['rsqr']['rel_l2']['median']:.2g}")
    # P x s grid on a subsample of each key set.
    for kname, raw in keysets.items():
        sub = _subsample(raw, cfg.grid_keys)
        for dt in DTYPES:
            for naive in (False, True):
                cells = []
                for P in cfg.grid_P:
                    for s in cfg.grid_s:
                        ks = rerotated_keys(sub, P, s, cfg.grid_h, inv, dt, naive=naive)
                        for h in cfg.grid_h:
                            pos = P - (h - 1) * s
                            ref = rope_f64(sub, pos, inv)
                            fresh = _fresh(sub, pos, inv, dt, naive)
                            cells.append({"P": P, "s": s, "h": h,
                                          "rerotate_rel_l2": float(np.median(key_errors(ks[h], ref)[1])),
                                          "rsqr_rel_l2": float(np.median(key_errors(fresh, ref)[1])),
                                          "rerotate_max_abs": float(np.median(key_errors(ks[h], ref)[0])),
                                          "rsqr_max_abs": float(np.median(key_errors(fresh, ref)[0]))})
                out["grid"][f"{kname}/{dt}/{'naive' if naive else 'exact'}"] = cells
        status(f"grid {kname} done")
    # A key crossing a window of `distance` positions in hops of s (= block b): fewer, larger hops.
    dist = cfg.distance
    out["distance"] = dist
    out["traverse"] = {}
    for kname, raw in keysets.items():
        sub = _subsample(raw, cfg.grid_keys)
        for dt in DTYPES:
            rows = []
            for s in [x for x in cfg.grid_s if dist % x == 0]:
                h = dist // s + 1
                k_end = rerotated_keys(sub, P0, s, [h], inv, dt)[h]
                ref = rope_f64(sub, P0 - dist, inv)
                fresh = _fresh(sub, P0 - dist, inv, dt)
                rows.append({"s": s, "h": h, "rerotate_rel_l2": float(np.median(key_errors(k_end, ref)[1])),
                             "rsqr_rel_l2": float(np.median(key_errors(fresh, ref)[1]))})
            out["traverse"][f"{kname}/{dt}"] = rows
    return out


def _pair_errors(k_NxD, fresh_NxD, ref_NxD, s, inv, h) -> dict:
    """Relative RMS error of each frequency pair (which pairs drift)."""
    half = ref_NxD.shape[-1] // 2

    def pair_rms(x):
        return np.sqrt(np.mean(x[:, :half] ** 2 + x[:, half:] ** 2, axis=0))

    norm_pair = pair_rms(ref_NxD)
    return {"h": h, "rerotate_rel_rms": (pair_rms(k_NxD - ref_NxD) / norm_pair).tolist(),
            "rsqr_rel_rms": (pair_rms(fresh_NxD - ref_NxD) / norm_pair).tolist(), "key_rms": norm_pair.tolist(),
            "hop_angle": (s * np.asarray(inv, np.float64)).tolist()}


# ----------------------------------------------------------------------------------- 2. attention


def softmax64(s):
    s = np.asarray(s, np.float64)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(-1, keepdims=True)


def kl_tv(p_ref, p):
    """KL(p_ref || p) and total variation over the last axis."""
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
    ref_k = np.concatenate([np.broadcast_to(rope_f64(ks, np.arange(N)[None, :, None], inv)[:, None],
                                            (L, Q, N, Hkv, D)),
                            rope_f64(kw, pos_w, inv)], axis=2)  # [L, Q, N+W, Hkv, D]
    ref_q = rope_f64(qq, q_rank[None, :, None], inv)
    s_ref = np.einsum("lqkgd,lqnkd->lqkgn", ref_q.reshape(L, Q, Hkv, G, D), ref_k) * D**-0.5
    p_ref = softmax64(s_ref)

    def scores(keys_f32, qrot_f32):
        return np.asarray(jnp.einsum("lqkgd,lqnkd->lqkgn", jnp.asarray(qrot_f32).reshape(L, Q, Hkv, G, D),
                                     jnp.asarray(keys_f32), precision=HP) * D**-0.5, np.float64)

    f32 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32))  # noqa: E731
    out = {}
    # rerotate: sinks written at ranks 0..N-1 (never move); window keys written at rer_write, hopped.
    sink_rot = rotate(jnp.asarray(ks), np.arange(N)[None, :, None], inv, dt)
    kwr = rotate(jnp.asarray(kw), np.broadcast_to(rer_write[None, :, :, None], kw.shape[:-1]), inv, dt)
    hops = jnp.asarray(np.broadcast_to(rer_hops[None, :, :, None], kw.shape[:-1]), jnp.int32)
    kwr = hop_n(kwr, -shift, int(rer_hops.max()), hops, inv, dt)
    keys = np.concatenate([np.broadcast_to(f32(sink_rot)[:, None], (L, Q, N, Hkv, D)), f32(kwr)], axis=2)
    q_rer = f32(rotate(jnp.asarray(qq), q_rank[None, :, None], inv, jnp.float32))
    out["rerotate"] = kl_tv(p_ref, softmax64(scores(keys, q_rer)))
    # rank_once (streamingllm numerics): every key rotated from raw once at its rank, rounded to dt.
    kwo = rotate(jnp.asarray(kw), np.broadcast_to(key_rank[None, :, :, None], kw.shape[:-1]), inv, dt)
    keys = np.concatenate([np.broadcast_to(f32(sink_rot)[:, None], (L, Q, N, Hkv, D)), f32(kwo)], axis=2)
    out["rank_once"] = kl_tv(p_ref, softmax64(scores(keys, q_rer)))
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
        out["rsqr" if off == RSQR_GLOBAL_OFFSET else f"rsqr@{off}"] = kl_tv(p_ref, softmax64(s_rsqr))
    return out


def _summ_att(res, L):
    return {path: {"kl": stats(kl), "tv": stats(tv), "kl_per_layer": kl.reshape(L, -1).mean(-1).tolist()}
            for path, (kl, tv) in res.items()}


def exp_attention(q_LxTxHqxD, k_LxTxHkvxD, inv, cfg: "DriftConfig") -> dict:
    q, k = q_LxTxHqxD, k_LxTxHkvxD
    L, T = q.shape[:2]
    N = N_SINK
    sink_g = np.arange(N)
    Qn = cfg.att_queries
    tq = np.arange(T - Qn, T)
    out = {"n_sink": N, "queries": tq.tolist(), "rsqr_global_offset": RSQR_GLOBAL_OFFSET,
           "rsqr_offsets": list(RSQR_OFFSETS), "steady": {}, "uniform": {}}
    # Steady state of a rerotate stream (delta = 0): every window key at its own rotation count.
    for W in cfg.att_windows:
        for b in cfg.att_blocks:
            for dt in DTYPES:
                w0 = np.asarray(window_start(tq + 1, W, b))  # [Q]
                gs = [np.arange(w, t + 1) for w, t in zip(w0, tq)]
                Wmin = min(len(g) for g in gs)  # drop the oldest extra keys so every query has W keys
                key_g = np.stack([g[len(g) - Wmin:] for g in gs])
                key_rank = N + key_g - w0[:, None]
                q_rank = N + tq - w0
                w0_g = np.asarray(window_start(key_g + 1, W, b))
                rer_write = N + key_g - w0_g
                rer_hops = (w0[:, None] - w0_g) // b
                assert np.all(rer_write - rer_hops * b == key_rank)
                res = _attention_case(q, k, tq, key_g, key_rank, q_rank, rer_write, rer_hops, b, sink_g, inv, dt,
                                      rsqr_offsets=RSQR_OFFSETS)
                s = _summ_att(res, L)
                s["max_rotations"] = int(rer_hops.max()) + 1
                s["mean_rotations"] = float(rer_hops.mean()) + 1
                out["steady"][f"W={W}/b={b}/{dt}"] = s
                status(f"attention steady W={W} b={b} {dt}: KL mean rerotate {s['rerotate']['kl']['mean']:.2e} "
                       f"rsqr {s['rsqr']['kl']['mean']:.2e} rank_once {s['rank_once']['kl']['mean']:.2e} "
                       f"(max rotations {s['max_rotations']}); rsqr vs offset " +
                       " ".join(f"{o}:{s['rsqr' if o == RSQR_GLOBAL_OFFSET else f'rsqr@{o}']['kl']['mean']:.1e}"
                                for o in RSQR_OFFSETS))
    # Uniform: every window key at h rotations of shift s (a long-lived key: survivors, huge windows).
    W = cfg.att_uniform_W
    key_g = tq[:, None] - W + 1 + np.arange(W)[None, :]
    key_rank = N + np.broadcast_to(np.arange(W), key_g.shape)
    q_rank = np.full(len(tq), N + W - 1)
    for dt in DTYPES:
        for s in cfg.shifts:
            rows = []
            for h in cfg.att_uniform_h:
                hops = np.full(key_g.shape, h - 1)
                res = _attention_case(q, k, tq, key_g, key_rank, q_rank, key_rank + (h - 1) * s, hops, s, sink_g,
                                      inv, dt)
                sm = _summ_att(res, L)
                rows.append({"h": h, **{p: {"kl": sm[p]["kl"], "tv": sm[p]["tv"]} for p in sm}})
            out["uniform"][f"W={W}/{dt}/s={s}"] = rows
            status(f"attention uniform W={W} {dt} s={s}: KL mean rerotate " +
                   " ".join(f"h={r['h']}:{r['rerotate']['kl']['mean']:.1e}" for r in rows))
    return out
