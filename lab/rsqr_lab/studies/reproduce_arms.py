"""The RSQR author's position bookkeeping, replayed on our model.

The author's notebooks keep per-layer K/V lists (sink, fact, pinned, survivors, window), build the list a
token attends to by concatenation, run one token, and slice the returned list (old + new) back into the
regions. Bugs and quirks live in that bookkeeping, so it is replicated literally here, with the model
replaced by an *explicit-position step*: every cached entry is (slot of the raw K/V the token produced, the
position its key is rotated at when attended). A key the author rotated at p and re-rotated by d is the
entry (slot, p + d): the same function up to the float32 rounding of the extra hop (~1e-6, which the author
measured as invisible past the softmax).

Each arm is a generator: it yields a `Call` (token, the entries it attends to, its position, the answer id
when it is scored) and is sent back a `Reply` (the slot where the token's raw K/V were written, the argmax
and the answer's log-probability); it returns its result dict. `run_rows` drives many such generators as
the rows of one batched step.

Sources (read, not copied): null-Exception1/auto-kv-cache-eviction `qwen_multi_fact_eviction.ipynb`
(study 1: `_run_prefix_until_first_eviction`, `_run_from_state`, `run_strategy_a_fact_persistence`) and
`notebook_v3_rank_based_fix (1).ipynb` (study 2: the same with a pinned suffix, `run_strategy_c_rsqr`
rank-based); null-Exception1/rsqr-kv-cache-eviction `notebook_v3_final_final_fix.ipynb` (two-scale RSQR).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Generator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Entry = tuple  # (slot, position): a cached token's raw K/V slot and the position its key is rotated at


class Call(NamedTuple):
    token: int
    entries: list           # [(slot, pos)] the token attends to (itself excluded: always added at `pos`)
    pos: int                # the token's (query's) position; its own key is rotated there too
    answer: int = -1        # score this step's next-token distribution against this id (-1: not scored)


class Reply(NamedTuple):
    slot: int               # where the token's raw K/V were stored
    argmax: int
    logp: float             # log-probability of Call.answer (nan when not scored)


Arm = Generator[Call, Reply, dict]


def _split(stream_item):
    tid, is_query, answer, *rest = stream_item
    return tid, is_query, answer, bool(rest[0]) if rest else False


def _scored(reply: Reply, answer: int) -> dict:
    return {"correct": bool(reply.argmax == answer), "logp": float(reply.logp), "pred": int(reply.argmax)}


# ----------------------------------------------------------------------------------------------------
# Arm B: evict a block of 8 from a window of 24; renumber by re-rotation ("corrected") or leave the gap.


def author_b(stream, fact_len: int, sink_size: int, window: int = 24, block: int = 8, *, correct: bool,
             first_eviction: str = "skip", pinned_slice_bug: bool = True) -> Arm:
    """Strategy B of both studies (`run_strategy_b_pair_fast`), one arm (corrected or not).

    first_eviction: what happens at the first eviction trigger, which the author's prefix phase handles
    apart from the others: "skip" (study 1: the prefix phase returns *before* evicting, so that block is
    never evicted and the window oscillates 32..40 instead of 24..32), "collide" (study 2: the block is
    evicted and the position counter moves back by 8 without re-rotating anything, so the next tokens are
    written at positions still held by window tokens), "normal" (the quirk removed: like every later one).
    pinned_slice_bug: study 2's pinned-suffix slice `new_full[n_sink+n_fact : n_sink+n_fact+len(pinned)]`
    takes the oldest window entry instead of the new token (False: the new token, the intent).
    """
    sink, fact, pinned, win = [], [], [], []
    n_win_tokens = 0  # len(window_tokens): the author tracks it apart from the cache list
    pos, n_fact_seen, n_ev, first_seen = 0, 0, 0, False
    for item in stream:
        tid, is_query, answer, is_pinned = _split(item)
        base = sink + fact + pinned + win
        if is_query:
            r = yield Call(tid, base, pos + 1, answer)
            return {**_scored(r, answer), "n_evictions": n_ev}
        pos += 1
        r = yield Call(tid, base, pos)
        new_full = base + [(r.slot, pos)]
        if len(sink) < sink_size:
            sink = new_full[:len(sink) + 1]
        elif n_fact_seen < fact_len:
            fact = new_full[len(sink):len(sink) + len(fact) + 1]
            n_fact_seen += 1
        elif is_pinned:
            lo = len(sink) + len(fact)
            pinned = new_full[lo:lo + len(pinned) + 1] if pinned_slice_bug else pinned + [(r.slot, pos)]
        else:
            win = new_full[len(sink) + len(fact) + len(pinned):]
            n_win_tokens += 1
            if n_win_tokens % block == 0 and n_win_tokens > window:
                if not first_seen:
                    first_seen = True
                    if first_eviction == "skip":
                        continue
                    if first_eviction == "collide":
                        win, n_win_tokens, pos, n_ev = win[block:], n_win_tokens - block, pos - block, n_ev + 1
                        continue
                win, n_win_tokens = win[block:], n_win_tokens - block
                if correct:  # rerotate_cache(window, -8): the window keys move back by 8, the counter too
                    win = [(s, p - block) for s, p in win]
                    pos -= block
                n_ev += 1
    raise ValueError("stream has no query token")


# ----------------------------------------------------------------------------------------------------
# Arm A: full replay (a FIFO window of 24 and a re-encode of sinks + fact + window at distance >= 48).


def author_replay(stream, fact_len: int, sink_size: int, window: int = 24, horizon: int = 48) -> Arm:
    """Strategy A (`run_strategy_a_fact_persistence`): the window drops one token per step; when the
    position counter is `horizon` past the fact, every kept token is re-encoded from its id at positions
    1..n (pinned tokens are not replayed; the author notes none exist then)."""
    sink, fact, pinned, win = [], [], [], []
    sink_ids, fact_ids, win_ids = [], [], []
    pos, n_fact_seen, n_cons = 0, 0, 0
    for item in stream:
        tid, is_query, answer, is_pinned = _split(item)
        base = sink + fact + pinned + win
        if is_query:
            r = yield Call(tid, base, pos + 1, answer)
            return {**_scored(r, answer), "n_consolidations": n_cons}
        pos += 1
        if len(sink_ids) < sink_size:
            sink_ids.append(tid)
            r = yield Call(tid, base, pos)
            sink = (base + [(r.slot, pos)])[:len(sink_ids)]
        elif n_fact_seen < fact_len:
            fact_ids.append(tid)
            r = yield Call(tid, base, pos)
            fact = (base + [(r.slot, pos)])[len(sink):len(sink) + len(fact) + 1]
            n_fact_seen += 1
        elif is_pinned:
            r = yield Call(tid, base, pos)
            lo = len(sink) + len(fact)
            pinned = (base + [(r.slot, pos)])[lo:lo + len(pinned) + 1]
        else:
            win_ids.append(tid)
            r = yield Call(tid, base, pos)
            win = (base + [(r.slot, pos)])[len(sink) + len(fact) + len(pinned):len(sink) + len(fact) + len(pinned)
                                           + len(win_ids)]
            if len(win_ids) > window:
                win_ids.pop(0)
                win = win[1:]
            if pos - (sink_size + fact_len - 1) >= horizon:
                cache, p = [], 0
                for t in sink_ids + fact_ids + win_ids:
                    p += 1
                    r = yield Call(t, cache, p)
                    cache = cache + [(r.slot, p)]
                ns, nf = len(sink_ids), len(fact_ids)
                sink, fact, win, pos = cache[:ns], cache[ns:ns + nf], cache[ns + nf:], p
                n_cons += 1
    raise ValueError("stream has no query token")


# ----------------------------------------------------------------------------------------------------
# Arm C: the author's RSQR implementations.


def author_rsqr_rank(stream, fact_len: int, sink_size: int, window: int = 24, block: int = 8, delta: int = 8, *,
                     fix_off_by_one: bool = False, pinned_slice_bug: bool = True) -> Arm:
    """`run_strategy_c_rsqr`, rank-based version (study 2's table).

    Every token is written at its true position 1, 2, ... and the window is never renumbered (so the
    window has leave-gap positions); every delta-th window token is a survivor from the moment it is
    written (raw K/V kept forever, while it is still in the window too); before every step all survivors
    are rotated at their rank 0..S-1 among survivors (positions the sinks also hold). The window slice
    after a flagged step starts at `n_sink + n_fact + n_pinned + n_surv` with n_surv already counting the
    new survivor, one past the window's start: the oldest window K/V is dropped at every flag (the
    off-by-one), so the window cache shrinks by one per block and empties on long streams.
    """
    sink, fact, pinned, win = [], [], [], []
    window_g: list[int] = []          # window_tokens: global positions (kept apart from the cache list)
    surv_slot: dict[int, int] = {}    # global position -> raw slot
    pos, n_fact_seen, n_win_total, n_ev = 0, 0, 0, 0

    def survivors():
        return [(surv_slot[g], rank) for rank, g in enumerate(sorted(surv_slot))]

    for item in stream:
        tid, is_query, answer, is_pinned = _split(item)
        base = sink + fact + pinned + survivors() + win
        if is_query:
            r = yield Call(tid, base, pos + 1, answer)
            return {**_scored(r, answer), "n_evictions": n_ev, "n_survivors": len(surv_slot),
                    "n_window_entries": len(win)}
        pos += 1
        r = yield Call(tid, base, pos)
        new_full = base + [(r.slot, pos)]
        if len(sink) < sink_size:
            sink = new_full[:len(sink) + 1]
        elif n_fact_seen < fact_len:
            fact = new_full[len(sink):len(sink) + len(fact) + 1]
            n_fact_seen += 1
        elif is_pinned:
            lo = len(sink) + len(fact)
            pinned = new_full[lo:lo + len(pinned) + 1] if pinned_slice_bug else pinned + [(r.slot, pos)]
        else:
            n_win_total += 1
            n_surv_before = len(surv_slot)
            if n_win_total % delta == 0:
                surv_slot[pos] = r.slot
            window_g.append(pos)
            start = len(sink) + len(fact) + len(pinned) + (n_surv_before if fix_off_by_one else len(surv_slot))
            win = new_full[start:start + len(window_g)]
            if len(window_g) % block == 0 and len(window_g) > window:
                window_g, win = window_g[block:], win[block:]
                n_ev += 1
    raise ValueError("stream has no query token")


def author_rsqr_two_scale(stream, fact_len: int, sink_size: int, window: int = 24, block: int = 8,
                          delta: int = 8, *, pinned_slice_bug: bool = True) -> Arm:
    """`run_strategy_c_rsqr`, two-scale version (rsqr-kv-cache-eviction `notebook_v3_final_final_fix`).

    Sinks, fact and pinned suffix are written at their write-order count 1..n; a window token at
    `global - n_evicted` (fixed at write time, never renumbered: after each eviction the next tokens are
    written at positions the remaining window tokens still hold, so window positions collide); a flagged
    token becomes a survivor when its block is evicted, and all survivors are placed `delta` apart just
    before the window's current start (`window_start - (S - i) * delta`), recomputed at each eviction; the
    query sits at `global + 1 - n_evicted`.
    """
    sink, fact, pinned, win = [], [], [], []
    window_gc: list[int] = []          # window_tokens' global positions
    pending: dict[int, int] = {}       # flagged, still in the window: global -> slot
    surv_slot: dict[int, int] = {}
    surv_pos: dict[int, int] = {}
    g, n_prefix, n_evicted, n_fact_seen, n_win_total, n_ev = 0, 0, 0, 0, 0, 0

    def survivors():
        return [(surv_slot[s], surv_pos[s]) for s in sorted(surv_slot)]

    for item in stream:
        tid, is_query, answer, is_pinned = _split(item)
        base = sink + fact + pinned + survivors() + win
        if is_query:
            r = yield Call(tid, base, g + 1 - n_evicted, answer)
            return {**_scored(r, answer), "n_evictions": n_ev, "n_survivors": len(surv_slot)}
        g += 1
        if len(sink) < sink_size or n_fact_seen < fact_len or is_pinned:
            n_prefix += 1
            r = yield Call(tid, base, n_prefix)
            new_full = base + [(r.slot, n_prefix)]
            if len(sink) < sink_size:
                sink = new_full[:len(sink) + 1]
            elif n_fact_seen < fact_len:
                fact = new_full[len(sink):len(sink) + len(fact) + 1]
                n_fact_seen += 1
            else:
                lo = len(sink) + len(fact)
                pinned = new_full[lo:lo + len(pinned) + 1] if pinned_slice_bug else pinned + [(r.slot, n_prefix)]
            continue
        n_win_total += 1
        cpos = g - n_evicted
        r = yield Call(tid, base, cpos)
        new_full = base + [(r.slot, cpos)]
        if n_win_total % delta == 0:
            pending[g] = r.slot
        window_gc.append(g)
        start = len(sink) + len(fact) + len(pinned) + len(surv_slot)
        win = new_full[start:start + len(window_gc)]
        if len(window_gc) % block == 0 and len(window_gc) > window:
            evicted, window_gc, win = window_gc[:block], window_gc[block:], win[block:]
            for e in evicted:
                if e in pending:
                    surv_slot[e] = pending.pop(e)
            n_evicted += block
            n_ev += 1
            if surv_slot:
                w0 = (window_gc[0] if window_gc else g + 1) - n_evicted
                order = sorted(surv_slot)
                for i, s in enumerate(order):
                    surv_pos[s] = w0 - (len(order) - i) * delta
    raise ValueError("stream has no query token")


# ----------------------------------------------------------------------------------------------------
# The explicit-position step and the driver.


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ExplicitKV:
    """What one layer attends to in an explicit-position step (the model's cache argument).

    keys/vals_LxBxNxHkvxD: raw K and V of the attended entries (gathered from the store), pos_BxN the
    positions their keys are rotated at, valid_BxN the real entries, q_pos_B the new token's position
    (its query and its own key). new_k/new_v_LxBxHkvxD: filled with the new token's raw K/V by each layer.
    """

    keys_LxBxNxHkvxD: jax.Array
    vals_LxBxNxHkvxD: jax.Array
    pos_BxN: jax.Array
    valid_BxN: jax.Array
    q_pos_B: jax.Array
    new_k_LxBxHkvxD: jax.Array
    new_v_LxBxHkvxD: jax.Array


def explicit_attend(layer, q_BxCxHqxD, k_BxCxHkvxD, v_BxCxHkvxD, state: ExplicitKV, plan, inv_freq, *,
                    kernel: str = "xla"):
    """A model layer's attention over explicit (raw K/V, position) entries plus the token itself (C = 1).

    Float32 throughout: keys are rotated from raw at their entry positions (one hop), the query and its own
    key at q_pos, softmax over the valid entries and the token itself."""
    from rsqr_jax.rope import apply_rope

    del plan, kernel
    B, C, Hq, D = q_BxCxHqxD.shape
    Hkv = k_BxCxHkvxD.shape[2]
    G = Hq // Hkv
    inv = jnp.asarray(inv_freq, jnp.float32)
    q_pos = state.q_pos_B[:, None]
    q = apply_rope(q_BxCxHqxD.astype(jnp.float32), q_pos, inv)[:, 0]                        # [B, Hq, D]
    k_self = apply_rope(k_BxCxHkvxD.astype(jnp.float32), q_pos, inv)[:, 0]                  # [B, Hkv, D]
    keys = apply_rope(state.keys_LxBxNxHkvxD[layer], state.pos_BxN, inv)                     # [B, N, Hkv, D]
    keys = jnp.concatenate([keys, k_self[:, None]], axis=1)                                  # [B, N+1, Hkv, D]
    vals = jnp.concatenate([state.vals_LxBxNxHkvxD[layer], v_BxCxHkvxD[:, 0, None].astype(jnp.float32)], axis=1)
    valid = jnp.concatenate([state.valid_BxN, jnp.ones((B, 1), bool)], axis=1)
    qg = q.reshape(B, Hkv, G, D)
    s = jnp.einsum("bhgd,bnhd->bhgn", qg, keys, precision=jax.lax.Precision.HIGHEST) * (D ** -0.5)
    s = jnp.where(valid[:, None, None, :], s, -1e30)
    out = jnp.einsum("bhgn,bnhd->bhgd", jax.nn.softmax(s, axis=-1), vals, precision=jax.lax.Precision.HIGHEST)
    state = dataclasses.replace(
        state, new_k_LxBxHkvxD=state.new_k_LxBxHkvxD.at[layer].set(k_BxCxHkvxD[:, 0].astype(jnp.float32)),
        new_v_LxBxHkvxD=state.new_v_LxBxHkvxD.at[layer].set(v_BxCxHkvxD[:, 0].astype(jnp.float32)))
    return out.reshape(B, 1, Hq, D).astype(q_BxCxHqxD.dtype), state


def make_explicit_step(apply_fn: Callable):
    """The jitted step: (params, store_k, store_v, tokens_B, idx_BxN, pos_BxN, valid_BxN, q_pos_B, slot_B,
    answer_B) -> (store_k, store_v, argmax_B, logp_B). apply_fn(params, tokens_BxC, ExplicitKV, None) must
    run the model with `explicit_attend` as its attention. The store ([L, B, T, Hkv, D], donated) keeps
    every raw K/V a row has produced, by slot."""

    def step(params, store_k, store_v, tokens_B, idx_BxN, pos_BxN, valid_BxN, q_pos_B, slot_B, answer_B):
        L, B, T, Hkv, D = store_k.shape
        take = jax.vmap(lambda s, i: s[:, i], in_axes=(1, 0), out_axes=1)  # per row: [L, T, ...] at [N] slots
        state = ExplicitKV(take(store_k, idx_BxN), take(store_v, idx_BxN), pos_BxN, valid_BxN, q_pos_B,
                           jnp.zeros((L, B, Hkv, D), jnp.float32), jnp.zeros((L, B, Hkv, D), jnp.float32))
        logits, state = apply_fn(params, tokens_B[:, None], state, None)
        logits = logits[:, 0].astype(jnp.float32)
        rows = jnp.arange(B)
        store_k = store_k.at[:, rows, slot_B].set(state.new_k_LxBxHkvxD)
        store_v = store_v.at[:, rows, slot_B].set(state.new_v_LxBxHkvxD)
        logp = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logp, jnp.maximum(answer_B, 0)[:, None], axis=1)[:, 0]
        return store_k, store_v, jnp.argmax(logits, axis=-1).astype(jnp.int32), picked

    return jax.jit(step, donate_argnums=(1, 2))


def _bucket(n: int, buckets=(64, 256)) -> int:
    for b in buckets:
        if n <= b:
            return b
    return -(-n // 512) * 512


def run_rows(step, params, arms: list[Arm], *, num_layers: int, num_kv_heads: int, head_dim: int, slots: int,
             batch: int, on_step: Callable[[int], None] | None = None) -> list[dict]:
    """Drive `arms` (generators) as rows of batched explicit-position steps, `batch` rows at a time; their
    results in order. Rows that finished idle (padding) until the batch's last row is done."""
    results: list[dict | None] = [None] * len(arms)
    for lo in range(0, len(arms), batch):
        group = list(range(lo, min(lo + batch, len(arms))))
        store_k = jnp.zeros((num_layers, batch, slots, num_kv_heads, head_dim), jnp.float32)
        store_v = jnp.zeros_like(store_k)
        calls: dict[int, Call] = {}
        next_slot = [0] * batch
        for i in group:
            calls[i] = next(arms[i])
        while calls:
            n = _bucket(max(len(c.entries) for c in calls.values()))
            idx = np.zeros((batch, n), np.int32)
            pos = np.zeros((batch, n), np.int32)
            valid = np.zeros((batch, n), bool)
            tok = np.zeros(batch, np.int32)
            q_pos = np.zeros(batch, np.int32)
            slot = np.full(batch, slots - 1, np.int32)  # idle rows write a scratch slot
            answer = np.full(batch, -1, np.int32)
            for i, c in calls.items():
                r = i - lo
                if c.entries:
                    e = np.asarray(c.entries, np.int64)
                    idx[r, :len(e)], pos[r, :len(e)], valid[r, :len(e)] = e[:, 0], e[:, 1], True
                tok[r], q_pos[r], answer[r] = c.token, c.pos, c.answer
                if next_slot[r] >= slots - 1:
                    raise ValueError(f"row {i} needs more than {slots - 1} K/V slots")
                slot[r] = next_slot[r]
                next_slot[r] += 1
            store_k, store_v, am, lp = step(params, store_k, store_v, tok, idx, pos, valid, q_pos, slot, answer)
            am, lp = np.asarray(am), np.asarray(lp)
            for i in list(calls):
                r = i - lo
                reply = Reply(int(slot[r]), int(am[r]), float(lp[r]) if answer[r] >= 0 else float("nan"))
                try:
                    calls[i] = arms[i].send(reply)
                except StopIteration as done:
                    results[i] = done.value
                    del calls[i]
            if on_step is not None:
                on_step(len(group))
    return results
