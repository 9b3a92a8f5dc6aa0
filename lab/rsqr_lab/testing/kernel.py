"""Inputs and the float64 oracle of the survivor-attention kernel contract (docs/design.md §6), shared by
tests/test_survivor_attention.py, the GPU check and the attention benchmark (one copy of each).

* `kernel_inputs(seed, ...)`: random but sensible contract inputs for correctness checks (seeded).
* `decode_step_args(q, k, v, S)`: the decode-step layout the benchmarks time (window + S survivors at
  ranks, and the streamingllm layout with every key raw).
* `oracle_f64(...)`: an independent float64 numpy implementation of the contract (numpy only; angles
  pos * inv_freq formed in float64).

Arguments follow the contract's order, `KERNEL_ARGS`; `args_of(inputs)` turns an inputs dict into it.
"""

from __future__ import annotations

import numpy as np

from rsqr_lab.testing.oracle import rope_f64

KERNEL_ARGS = ("q", "win_k", "win_v", "win_pos", "surv_k", "surv_v", "surv_rot_pos", "surv_valid", "q_pos_win",
               "q_pos_surv")
N_SINK = 4  # the first survivor slots (ranks 0..3) hold the sinks, as in the cache


def rope_inv_freq(D: int, base: float = 10000.0) -> np.ndarray:
    """float32 [D/2] RoPE inverse frequencies (Llama: base 1e4; SmolLM2: 1e5)."""
    return (1.0 / base ** (np.arange(0, D, 2, dtype=np.float64) / D)).astype(np.float32)



def oracle_f64(q, win_k, win_v, win_pos, surv_k, surv_v, surv_rot_pos, surv_valid, q_pos_win, q_pos_surv,
               inv_freq, scale=None, logit_cap=None, sliding_window=None) -> np.ndarray:
    """float64 [B, C, Hq, D] of the contract: one softmax over the visible window slots and valid survivors;
    a row that sees nothing is exactly zero. logit_cap: scores tanh(s / cap) * cap; sliding_window: a query
    at p sees window positions in (p - sliding_window, p]."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    q, win_k, win_v, surv_k, surv_v = map(f, (q, win_k, win_v, surv_k, surv_v))
    win_pos, surv_rot_pos, surv_valid, q_pos_win, q_pos_surv = map(np.asarray, (win_pos, surv_rot_pos, surv_valid, q_pos_win,
                                                                            q_pos_surv))
    B, C, Hq, D = q.shape
    Hkv = win_k.shape[1]
    scale = D**-0.5 if scale is None else scale
    q_BxCxHkvxGxD = q.reshape(B, C, Hkv, Hq // Hkv, D)
    qw = rope_f64(q_BxCxHkvxGxD, q_pos_win[:, :, None, None], inv_freq)
    qs = rope_f64(q_BxCxHkvxGxD, q_pos_surv[:, :, None, None], inv_freq)
    ks = rope_f64(surv_k, surv_rot_pos[:, None, :], inv_freq)
    s_win = np.einsum("bckgd,bkwd->bckgw", qw, win_k) * scale
    s_surv = np.einsum("bckgd,bksd->bckgs", qs, ks) * scale
    if logit_cap is not None:
        s_win, s_surv = np.tanh(s_win / logit_cap) * logit_cap, np.tanh(s_surv / logit_cap) * logit_cap
    vis_win = (win_pos[:, None, :] >= 0) & (win_pos[:, None, :] <= q_pos_win[:, :, None])
    if sliding_window is not None:
        vis_win &= win_pos[:, None, :] > q_pos_win[:, :, None] - sliding_window
    vis_win = vis_win[:, :, None, None]
    vis = np.concatenate([np.broadcast_to(vis_win, s_win.shape),
                          np.broadcast_to(surv_valid[:, None, None, None, :], s_surv.shape)], -1)
    s = np.concatenate([s_win, s_surv], -1)
    m = np.max(np.where(vis, s, -np.inf), -1, keepdims=True)
    e = np.where(vis, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    o = np.einsum("bckgn,bknd->bckgd", e, np.concatenate([win_v, surv_v], 2))
    den = e.sum(-1)[..., None]
    return (o / np.where(den > 0, den, 1.0)).reshape(B, C, Hq, D)


def kernel_inputs(seed: int, *, B, C, Hq, Hkv, D, W, S, dtype, t0=None, empty_window=0, all_window_empty=False,
                  surv_invalid_frac=0.2, rope_base=10000.0):
    """(inputs dict keyed by KERNEL_ARGS, inv_freq) of one random contract call, from np.random.default_rng(seed).

    Window = ring buffer of the contiguous global positions ending at the chunk's last query (at t0 + C - 1,
    t0 drawn in [1e5, 1e6) unless given), permuted, `empty_window` slots per row emptied (-1); the chunk's
    own tokens sit in the window (causal masking inside the chunk). Window keys are rotated in float64 at
    their positions. Survivors (the first N_SINK of them the sinks) sit at ranks 0..S-1, as in the cache
    (ranks stay below the capacity W + S, the kernels' rotation table), a fraction `surv_invalid_frac`
    invalid; the query's survivor-segment position is S + (t - w0).
    """
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    inv = rope_inv_freq(D, rope_base)
    t0 = int(rng.integers(10**5, 10**6)) if t0 is None else t0
    last = t0 + C - 1
    w0 = last - W + 1
    win_pos = np.stack([rng.permutation(np.arange(w0, last + 1)) for _ in range(B)]).astype(np.int32).reshape(B, W)
    for b in range(B):
        win_pos[b, rng.choice(W, size=min(empty_window, W), replace=False)] = -1
    if all_window_empty:
        win_pos[:] = -1
    surv_rot_pos = np.tile(np.arange(S, dtype=np.int32), (B, 1))
    surv_valid = rng.random((B, S)) >= surv_invalid_frac
    win_k = rope_f64(rng.standard_normal((B, Hkv, W, D)), np.maximum(win_pos, 0)[:, None, :], inv)
    q_pos_win = np.tile(np.arange(t0, t0 + C, dtype=np.int32), (B, 1))
    q_pos_surv = (S + q_pos_win - w0).astype(np.int32)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return dict(
        q=cast(rng.standard_normal((B, C, Hq, D))),
        win_k=cast(win_k),
        win_v=cast(rng.standard_normal((B, Hkv, W, D))),
        win_pos=jnp.asarray(win_pos),
        surv_k=cast(rng.standard_normal((B, Hkv, S, D))),
        surv_v=cast(rng.standard_normal((B, Hkv, S, D))),
        surv_rot_pos=jnp.asarray(surv_rot_pos),
        surv_valid=jnp.asarray(surv_valid),
        q_pos_win=jnp.asarray(q_pos_win),
        q_pos_surv=jnp.asarray(q_pos_surv),
    ), inv


def args_of(inputs: dict) -> tuple:
    """The contract's positional arguments (before inv_freq) from an inputs dict."""
    return tuple(inputs[k] for k in KERNEL_ARGS)


def decode_step_args(q_Bx1xHqxD, k_BxHkvxNxD, v_BxHkvxNxD, S: int, *, t: int = 10**6) -> dict:
    """The decode step the benchmarks time: a cache of N keys, the query at global position t.

    "rsqr": S survivors (the first S keys, raw, at ranks 0..S-1) + a window of the other N - S keys at
    global positions t-(N-S)..t-1; "stream": streamingllm through the contract (W = 0, every key raw at
    its rank, the query at rank N); also the positions "kpos" (global, t-N..t-1), "rank" (0..N-1),
    "q_pos" (t) and "q_rank" (N), each [B, N] or [B, 1] int32.
    """
    import jax.numpy as jnp

    B, N = k_BxHkvxNxD.shape[0], k_BxHkvxNxD.shape[2]
    kpos = jnp.broadcast_to(jnp.arange(t - N, t, dtype=jnp.int32), (B, N))
    rank = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))
    q_pos, q_rank = jnp.full((B, 1), t, jnp.int32), jnp.full((B, 1), N, jnp.int32)
    k, v = k_BxHkvxNxD, v_BxHkvxNxD
    rsqr = (q_Bx1xHqxD, k[:, :, S:], v[:, :, S:], kpos[:, S:], k[:, :, :S], v[:, :, :S], rank[:, :S],
            jnp.ones((B, S), bool), q_pos, q_rank)
    stream = (q_Bx1xHqxD, k[:, :, :0], v[:, :, :0], kpos[:, :0], k, v, rank, jnp.ones((B, N), bool), q_pos, q_rank)
    return {"rsqr": rsqr, "stream": stream, "kpos": kpos, "rank": rank, "q_pos": q_pos, "q_rank": q_rank}


def rel_err(x, ref) -> float:
    """max |x - ref| / max |ref| in float64."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-30))
