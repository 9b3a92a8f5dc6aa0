"""Independent references for the policy tests: a pure-Python model of docs/design.md §3 (which tokens
stay) and a float64 numpy model forward that attends over a given token set on the rank or global
timeline. Nothing here imports rsqr_jax: these are what the library is checked against."""

from __future__ import annotations

import numpy as np


def reference_token_sets(T, *, window, n_sink, delta, max_survivors, block, overflow="fifo", chunk=1,
                         keep_all=False, pinned=()):
    """List of (n_processed, sorted cached global positions) after each step of `chunk` tokens.

    pinned: global positions kept forever beside the sinks (docs/design.md §3c); a pinned token that leaves
    the window is not a survivor, so it never counts against max_survivors."""
    pinned = set(pinned)
    if keep_all:
        return [(n, list(range(n))) for n in range(chunk, T + chunk, chunk) if n <= T] or []
    survivors: list[int] = []
    count, n, out = 0, 0, []
    while n < T:
        c = min(chunk, T - n)
        leaving: list[int] = []
        for g in range(n, n + c):
            count += 1
            if count == window + block:
                oldest = g - count + 1
                leaving.extend(range(oldest, oldest + block))
                count -= block
        n += c
        for g in leaving:
            if g not in pinned and g >= n_sink and delta > 0 and (g - n_sink) % delta == delta - 1:
                survivors.append(g)
        if len(survivors) > max_survivors:
            if overflow == "decimate":
                survivors = survivors[0::2]
            while len(survivors) > max_survivors:
                survivors.pop(0)
        w0 = n - count
        cached = set(range(min(n_sink, n))) | {g for g in pinned if g < n} | set(survivors) | set(range(w0, n))
        out.append((n, sorted(cached)))
    return out


def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def rope_f64(x, pos, inv_freq):
    """float64 R_pos x (half-split layout) for x [..., D] at positions pos broadcastable to x[..., 0]: the
    reference rotation of every oracle here and of the drift experiment."""
    x = np.asarray(x, np.float64)
    ang = np.asarray(pos, np.float64)[..., None] * np.asarray(inv_freq, np.float64)
    c, s = np.cos(ang), np.sin(ang)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def stream_logits_f64(weights, cfg, tokens, token_sets, semantics, positions=None):
    """float64 logits [T, V] of a single sequence streamed token by token.

    token_sets[t] = cached global positions after token t (must contain t), or a list of one such set per
    layer (layers that attend different tokens: the recall tier's per-layer page choice). semantics 'rank': a cached
    token sits at its rank in that set and the query at its own rank; 'global': both at global positions;
    'given': positions[t] maps each cached global position (the query's, t, included) to its logical position.
    Raw K/V of a token are computed once, when it is processed (no consolidation). Vectorized over heads
    and cached keys, so a few hundred tokens of a 135M model take seconds.
    """
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    L, Hq, Hkv, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G = Hq // Hkv
    inv_freq = np.asarray(cfg.inv_freq, np.float64)
    T = len(tokens)
    raw_k_LxTxHkvxD = np.zeros((L, T, Hkv, D))
    raw_v_LxTxHkvxD = np.zeros((L, T, Hkv, D))
    head = w["embed"].T if "lm_head" not in w else w["lm_head"]
    out = []
    for t, tok in enumerate(tokens):
        per_layer = isinstance(token_sets[t], list) and len(token_sets[t]) == L and not np.isscalar(token_sets[t][0])
        sets = token_sets[t] if per_layer else [token_sets[t]] * L
        x = w["embed"][tok]
        for l in range(L):
            cached = np.asarray(sorted(sets[l]))
            assert cached[-1] == t
            if semantics == "given":
                pos_N = np.asarray([positions[t][g] for g in cached], np.float64)
            else:
                pos_N = np.arange(len(cached)) if semantics == "rank" else cached
            h = _rms(x, w["attn_norm"][l], cfg.rms_norm_eps)
            q, k, v = h @ w["wq"][l], h @ w["wk"][l], h @ w["wv"][l]
            if cfg.attention_bias:
                q, k, v = q + w["bq"][l], k + w["bk"][l], v + w["bv"][l]
            raw_k_LxTxHkvxD[l, t], raw_v_LxTxHkvxD[l, t] = k.reshape(Hkv, D), v.reshape(Hkv, D)
            k_NxHkvxD = rope_f64(raw_k_LxTxHkvxD[l, cached], pos_N[:, None], inv_freq)
            q_HkvxGxD = rope_f64(q.reshape(Hkv, G, D), pos_N[-1], inv_freq)
            s = np.einsum("kgd,nkd->kgn", q_HkvxGxD, k_NxHkvxD) / np.sqrt(D)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            att = np.einsum("kgn,nkd->kgd", p, raw_v_LxTxHkvxD[l, cached]).reshape(-1)
            x = x + att @ w["wo"][l]
            h = _rms(x, w["mlp_norm"][l], cfg.rms_norm_eps)
            g_ = h @ w["w_gate"][l]
            x = x + ((g_ / (1 + np.exp(-g_))) * (h @ w["w_up"][l])) @ w["w_down"][l]
        out.append(_rms(x, w["final_norm"], cfg.rms_norm_eps) @ head)
    return np.stack(out)


def reference_cold_sets(T, *, window, n_sink, block, page_size, cold_slots, chunk=1):
    """Recallable global positions after each step (docs/design.md §3b), as a plain-Python model of the cold
    ring: every non-sink token g is written at slot (g - N) mod cold_slots; writing the first slot of a
    page forgets the page's older remnants; a stored token is recallable once it has left the window."""
    ring = [-1] * cold_slots
    out, count, n = [], 0, 0
    while n < T:
        c = min(chunk, T - n)
        for g in range(n, n + c):
            count += 1
            if count == window + block:
                count -= block
            if g >= n_sink:
                slot = (g - n_sink) % cold_slots
                if slot % page_size == 0:
                    ring[slot:slot + page_size] = [-1] * page_size
                ring[slot] = g
        n += c
        w0 = n - count
        out.append((n, sorted(g for g in ring if 0 <= g < w0)))
    return out
