"""The immutable KV-cache pytree (DESIGN.md section 5) and the per-step bookkeeping of every policy.

Layout, per layer (stacked on a leading layer axis L so a `lax.scan` over layers can thread it):

* ring_k / ring_v [L, B, Hkv, Wc, D]: the window ring buffer, written at `t mod Wc`, never shifted.
  Keys are stored rotated at their global position (full, window, leave_gaps, rsqr,
  rsqr_precompute), at their rank (rerotate, replay) or raw (streamingllm).
* surv_k / surv_v [L, B, Hkv, S, D]: sinks and flagged tokens, written when the token arrives. While
  a flagged token is still in the window its entry is the raw *shadow* copy; once it leaves the window
  the same entry *is* the survivor (no copy at eviction time). Keys raw for rsqr/rsqr_precompute/
  streamingllm, rotated for the rotated-storage policies.
* surv_k_rot [L, B, Hkv, S or 0, D]: rsqr_precompute's copy of each survivor rotated at its rank.
* ring_tok / surv_tok [B, Wc or 0] / [B, S or 0]: token ids, only for replay.

Positions are shared by all layers and all batch rows (every row advances in lockstep), so they are
stored once: ring_pos/surv_pos (global position, -1 = empty), ring_rot/surv_rot (the position each
stored key is currently rotated at; 0 for raw keys), surv_rank (the logical-position map: each
survivor's rank on the rank timeline), surv_copy_pos (where the precomputed copy was rotated).

Stream origin: `t` is the global position of the next token and `start` the global position of the
stream's first token (0 unless the cache was made with `init_cache(spec, start=s)`). Attention uses
global positions (window keys rotated at g, the query at t); the token set (DESIGN section 3) is
defined on stream-relative positions r = g - start: sinks are r < N, flagged tokens (r - N) mod delta ==
delta - 1, and the window counts the r tokens seen so far. So a stream started at s keeps exactly the
tokens a stream started at 0 keeps, shifted by s, and every policy's logits are translation-invariant
(global-timeline policies because attention only sees position differences, rank-timeline policies
because ranks do not depend on s). Positions are int32: a stream may run while t <= 2**31 - 1 (the
window arithmetic only ever adds small stream-relative counts, so nothing overflows before that).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rsqr_jax import policy as P
from rsqr_jax.policy import Policy, PolicyError


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Static capacities (array shapes) of a cache; hashable, so it can be a jit static argument."""

    num_layers: int
    batch: int
    num_kv_heads: int
    head_dim: int
    ring_capacity: int
    surv_capacity: int
    dtype: str = "float32"
    precompute: bool = False
    token_ids: bool = False
    max_chunk: int = 1

    def __post_init__(self):
        for name in ("num_layers", "batch", "num_kv_heads", "head_dim", "ring_capacity", "surv_capacity", "max_chunk"):
            v = getattr(self, name)
            low = 0 if name == "surv_capacity" else 1
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise ValueError(f"CacheSpec.{name} must be an integer >= {low}, got {v!r}")
        if self.head_dim % 2:
            raise ValueError(f"CacheSpec.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        _float_dtype_name(self.dtype)

    @classmethod
    def for_policies(cls, policies: Policy | list[Policy], *, num_layers: int, num_kv_heads: int, head_dim: int,
                     batch: int = 1, dtype: str = "float32", max_chunk: int = 1, max_len: int = 0) -> "CacheSpec":
        """The smallest spec that holds every given policy (a sweep batch gets the union).

        max_len bounds the stream for `full` (its ring must hold everything) and nothing else.
        """
        hosts = _host_policies(policies)
        ring, surv, pre, tok = 1, 0, False, False
        for h in hosts:
            r, s = _needed(h, max_chunk, max_len)
            ring, surv = max(ring, r), max(surv, s)
            pre |= h["mode"] == P.RSQR_PRECOMPUTE
            tok |= h["mode"] == P.REPLAY
        return cls(num_layers, batch, num_kv_heads, head_dim, ring, surv, _float_dtype_name(dtype), pre, tok, max_chunk)

    @property
    def entry_bytes(self) -> int:
        """Bytes of one token's K and V over all layers and batch rows."""
        return 2 * self.num_layers * self.batch * self.num_kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize

    def bytes_by_part(self, policy: Policy | None = None) -> dict[str, int]:
        """Cache bytes per part. With a policy, the survivor array is split into the shadow part (flagged
        tokens still in the window) and the survivor part (sinks + capped survivors)."""
        surv_total = self.surv_capacity * self.entry_bytes
        shadow = 0
        if policy is not None and self.surv_capacity:
            h = _host_policies(policy)[0]
            shadow = min(self.surv_capacity, _shadow_slots(h, self.max_chunk)) * self.entry_bytes
        key_bytes = self.entry_bytes // 2
        out = {
            "window": self.ring_capacity * self.entry_bytes,
            "shadow": shadow,
            "survivors": surv_total - shadow,
            "precompute": self.surv_capacity * key_bytes if self.precompute else 0,
            "token_ids": (self.ring_capacity + self.surv_capacity) * self.batch * 4 if self.token_ids else 0,
            "positions": (2 * self.ring_capacity + (4 if self.precompute else 3) * self.surv_capacity + 1) * 4,
        }
        out["total"] = sum(out.values())
        return out


def _float_dtype_name(dtype) -> str:
    """Canonical name of a floating storage dtype ('float32', 'bfloat16', ...); ValueError otherwise."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"unknown cache dtype {dtype!r}") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"cache dtype must be a floating type, got {dt}")
    return str(dt)


def _host_policies(policies) -> list[dict]:
    if isinstance(policies, Policy):
        h = policies.host()
        if isinstance(h["mode"], list):
            return [{k: v[i] for k, v in h.items()} for i in range(len(h["mode"]))]
        return [h]
    return [h for p in policies for h in _host_policies(p)]


def _shadow_slots(h: dict, max_chunk: int) -> int:
    if h["delta"] <= 0:
        return 0
    return (h["window"] + h["block"] - 1 + max_chunk) // h["delta"] + 1


def _needed(h: dict, max_chunk: int, max_len: int) -> tuple[int, int]:
    """(ring, survivor) capacity a policy needs."""
    if h["mode"] == P.FULL:
        return max(max_len, max_chunk, 1), 0
    ring = h["window"] + h["block"] - 1
    if h["mode"] == P.WINDOW:
        return ring, 0
    return ring, h["n_sink"] + h["max_survivors"] + _shadow_slots(h, max_chunk)


def validate(policy: Policy, spec: CacheSpec, *, chunk: int = 1) -> None:
    """Raise PolicyError (one line) if the spec cannot run the policy (checked on the host, before tracing)."""
    for h in _host_policies(policy):
        name = P.MODES[h["mode"]] if 0 <= h["mode"] < len(P.MODES) else h["mode"]
        if not 0 <= h["mode"] < len(P.MODES):
            raise PolicyError(f"unknown policy mode id {h['mode']}")
        if not 0 <= h["overflow"] < len(P.OVERFLOWS):
            raise PolicyError(f"unknown overflow rule id {h['overflow']}")
        if chunk > spec.max_chunk:
            raise PolicyError(f"chunk {chunk} exceeds the cache's max_chunk {spec.max_chunk}")
        if h["mode"] != P.FULL and chunk > h["window"]:
            raise PolicyError(f"{name}: chunk {chunk} is larger than the window {h['window']}; use --chunk <= window")
        ring, surv = _needed(h, chunk, 0)
        if h["mode"] != P.FULL and ring > spec.ring_capacity:
            raise PolicyError(f"{name}: window {h['window']} + block {h['block']} - 1 exceeds the ring capacity "
                              f"{spec.ring_capacity}")
        if surv > spec.surv_capacity:
            raise PolicyError(f"{name}: {h['n_sink']} sinks + {h['max_survivors']} survivors (+ shadow slots) exceed "
                              f"the survivor capacity {spec.surv_capacity}")
        if h["mode"] == P.RSQR_PRECOMPUTE and not spec.precompute:
            raise PolicyError("rsqr_precompute needs a cache with the precompute copy (CacheSpec.precompute)")
        if h["mode"] == P.REPLAY and not spec.token_ids:
            raise PolicyError("replay needs a cache that stores token ids (CacheSpec.token_ids)")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """See the module docstring for every field. Shapes follow a CacheSpec; `t` = tokens processed."""

    ring_k: jax.Array
    ring_v: jax.Array
    surv_k: jax.Array
    surv_v: jax.Array
    surv_k_rot: jax.Array
    ring_tok: jax.Array
    surv_tok: jax.Array
    ring_pos: jax.Array
    ring_rot: jax.Array
    surv_pos: jax.Array
    surv_rank: jax.Array
    surv_rot: jax.Array
    surv_copy_pos: jax.Array
    t: jax.Array
    start: jax.Array

    def replace(self, **kw) -> "KVCache":
        return dataclasses.replace(self, **kw)


MAX_POSITION = (1 << 31) - 1


def init_cache(spec: CacheSpec, start: int = 0) -> KVCache:
    """An empty cache whose stream begins at global position `start` (0 <= start < 2**31 - 1).

    A nonzero start is how a stream continues at a large global position (e.g. to test that nothing
    depends on the absolute position); see the module docstring for what is relative to it.
    """
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or not 0 <= start < MAX_POSITION:
        raise ValueError(f"start must be an integer in [0, {MAX_POSITION}), got {start!r}")
    L, B, H, D = spec.num_layers, spec.batch, spec.num_kv_heads, spec.head_dim
    Wc, S = spec.ring_capacity, spec.surv_capacity
    Sp = S if spec.precompute else 0
    dt = jnp.dtype(spec.dtype)
    neg = lambda n: jnp.full((n,), -1, jnp.int32)  # noqa: E731
    return KVCache(
        ring_k=jnp.zeros((L, B, H, Wc, D), dt), ring_v=jnp.zeros((L, B, H, Wc, D), dt),
        surv_k=jnp.zeros((L, B, H, S, D), dt), surv_v=jnp.zeros((L, B, H, S, D), dt),
        surv_k_rot=jnp.zeros((L, B, H, Sp, D), dt),
        ring_tok=jnp.zeros((B, Wc if spec.token_ids else 0), jnp.int32),
        surv_tok=jnp.zeros((B, S if spec.token_ids else 0), jnp.int32),
        ring_pos=neg(Wc), ring_rot=jnp.zeros((Wc,), jnp.int32),
        surv_pos=neg(S), surv_rank=neg(S), surv_rot=jnp.zeros((S,), jnp.int32), surv_copy_pos=neg(Sp),
        t=jnp.asarray(start, jnp.int32), start=jnp.asarray(start, jnp.int32),
    )


def window_start(n: jax.Array, window: jax.Array, block: jax.Array, start: jax.Array | int = 0) -> jax.Array:
    """Global position of the oldest window token once the stream (begun at `start`) reaches n (DESIGN section 3).

    The window grows to W + b - 1 tokens; the token that would make it W + b releases the oldest b.
    Computed on the stream-relative count r = n - start, compared as r - W < b so that nothing
    overflows int32 whatever n, W and b are.
    """
    r = n - start
    count = jnp.where(r - window < block, r, window + (r - window) % block)
    return n - count


def is_flagged(g: jax.Array, n_sink: jax.Array, delta: jax.Array) -> jax.Array:
    """Every delta-th non-sink token: (g - N) mod delta == delta - 1 (never when delta == 0).

    g is the stream-relative position (global position - cache.start)."""
    d = jnp.maximum(delta, 1)
    return (delta > 0) & (g >= n_sink) & ((g - n_sink) % d == d - 1)


def order_index(mask: jax.Array, key: jax.Array) -> jax.Array:
    """0-based rank of each masked entry among the masked entries, ordered by key (O(S log S))."""
    order = jnp.argsort(jnp.where(mask, key, jnp.iinfo(jnp.int32).max), stable=True)
    return jnp.zeros_like(key).at[order].set(jnp.arange(key.shape[0], dtype=key.dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything a layer needs to update its K/V and attend, for one chunk; identical for all layers.

    *_slot: where each chunk token is written (out of range = not written). *_write_pos: the position the
    new key is rotated at when written (0 = stored raw). win_pos/q_pos_win, surv_kernel_pos/q_pos_surv,
    surv_valid: the kernel arguments of DESIGN section 6 (positions in the frame of each segment's query).
    rerotate: re-rotate stored keys by (rot_new - rot_old) where hop_*; refresh: rotate the
    precomputed copy at surv_rank where refresh_mask; rotate_window: streamingllm's per-step rotation
    of the raw ring at ring_rank.
    """

    ring_slot: jax.Array
    ring_write_pos: jax.Array
    surv_slot: jax.Array
    surv_write_pos: jax.Array
    win_pos: jax.Array
    q_pos_win: jax.Array
    surv_kernel_pos: jax.Array
    surv_valid: jax.Array
    q_pos_surv: jax.Array
    use_precompute: jax.Array
    rotate_window: jax.Array
    ring_rank: jax.Array
    rerotate: jax.Array
    ring_hop: jax.Array
    surv_hop: jax.Array
    ring_rot_old: jax.Array
    ring_rot_new: jax.Array
    surv_rot_old: jax.Array
    surv_rot_new: jax.Array
    refresh: jax.Array
    refresh_mask: jax.Array
    surv_rank: jax.Array
    replay_event: jax.Array
    q_rank: jax.Array
    next_state: dict


def plan_step(cache: KVCache, policy: Policy, chunk: int, n_valid: jax.Array | int | None = None) -> StepPlan:
    """Bookkeeping for appending `chunk` tokens (the first n_valid of them real) under `policy`.

    Token set semantics: the chunk attends to the cached set *after* this step's evictions (for one
    token that is exactly DESIGN's set(t); for a chunk it is StreamingLLM's evict-for-space).
    """
    C = chunk
    n_valid = jnp.asarray(C if n_valid is None else n_valid, jnp.int32)
    t0 = cache.t
    g_C = t0 + jnp.arange(C, dtype=jnp.int32)
    real_C = jnp.arange(C) < n_valid
    n = t0 + n_valid
    Wc, S = cache.ring_pos.shape[0], cache.surv_pos.shape[0]
    mode, N = policy.mode, policy.n_sink
    w0 = window_start(n, policy.window, policy.block, cache.start)
    r_C = g_C - cache.start  # stream-relative positions: what sinks and flags are defined on

    ring_slot = jnp.where(real_C, g_C % Wc, Wc)
    ring_pos = cache.ring_pos.at[ring_slot].set(g_C, mode="drop")

    # Sinks and flagged tokens get a survivor entry on arrival (their raw shadow while in the window).
    need_C = real_C & ((r_C < N) | is_flagged(r_C, N, policy.delta))
    free_slots = jnp.nonzero(cache.surv_pos < 0, size=C, fill_value=S)[0] if S else jnp.full((C,), S)
    k_C = jnp.clip(jnp.cumsum(need_C) - 1, 0, C - 1)
    surv_slot = jnp.where(need_C, free_slots[k_C], S)
    surv_pos = cache.surv_pos.at[surv_slot].set(g_C, mode="drop")

    # Overflow: too many non-sink survivors (entries that left the window).
    ev = (surv_pos >= 0) & (surv_pos < w0) & (surv_pos - cache.start >= N)
    k_ev = jnp.sum(ev)
    age = order_index(ev, surv_pos)
    cap = policy.max_survivors
    fifo_drop = ev & (age < k_ev - cap)
    over = k_ev > cap
    k_half = k_ev - k_ev // 2
    dec_drop = ev & over & ((age % 2 == 1) | ((age // 2) < k_half - cap))
    drop = jnp.where(policy.overflow == P.OVERFLOW_ID["fifo"], fifo_drop, dec_drop)
    surv_pos = jnp.where(drop, -1, surv_pos)

    # Rank timeline: survivor segment (sinks + survivors that left the window), then the window.
    live = surv_pos >= 0
    att = live & (surv_pos < w0)
    n_seg = jnp.sum(att).astype(jnp.int32)
    surv_rank = jnp.where(att, order_index(att, surv_pos), n_seg + surv_pos - w0)
    surv_rank = jnp.where(live, surv_rank, -1)
    ring_in = (ring_pos >= 0) & (ring_pos >= w0)
    ring_rank = jnp.where(ring_in, n_seg + ring_pos - w0, -1)
    q_rank = n_seg + g_C - w0

    rank_window = (mode == P.REROTATE) | (mode == P.REPLAY) | (mode == P.STREAMINGLLM)
    rank_store = (mode == P.REROTATE) | (mode == P.REPLAY)
    ring_write_pos = jnp.where(rank_store, q_rank, jnp.where(mode == P.STREAMINGLLM, 0, g_C))
    surv_write_pos = jnp.where(rank_store, q_rank, jnp.where(mode == P.LEAVE_GAPS, g_C, 0))

    # Stored-rotation bookkeeping (rerotate hops, replay events).
    ring_rot_old = cache.ring_rot.at[ring_slot].set(ring_write_pos, mode="drop")
    surv_rot_old = cache.surv_rot.at[surv_slot].set(surv_write_pos, mode="drop")
    ring_hop = ring_in & (ring_rank != ring_rot_old)
    surv_hop = live & (surv_rank != surv_rot_old)
    any_hop = jnp.any(ring_hop) | jnp.any(surv_hop)
    rerotate = (mode == P.REROTATE) & any_hop
    replay_event = (mode == P.REPLAY) & any_hop
    ring_rot_new = jnp.where(rank_store & ring_in, ring_rank, ring_rot_old)
    surv_rot_new = jnp.where(rank_store & live, surv_rank, surv_rot_old)

    # rsqr_precompute: (re)rotate the copy of survivors whose rank is new or changed.
    use_pre = mode == P.RSQR_PRECOMPUTE
    if cache.surv_copy_pos.shape[0]:
        copy_pos = cache.surv_copy_pos.at[surv_slot].set(-1, mode="drop")
        refresh_mask = att & (copy_pos != surv_rank)
        refresh = use_pre & jnp.any(refresh_mask)
        copy_pos = jnp.where(use_pre & refresh_mask, surv_rank, copy_pos)
    else:
        copy_pos, refresh_mask, refresh = cache.surv_copy_pos, jnp.zeros((S,), bool), jnp.asarray(False)

    surv_raw = (mode == P.RSQR) | (mode == P.STREAMINGLLM)
    return StepPlan(
        ring_slot=ring_slot, ring_write_pos=ring_write_pos, surv_slot=surv_slot, surv_write_pos=surv_write_pos,
        win_pos=jnp.where(ring_in, jnp.where(rank_window, ring_rank, ring_pos), -1),
        q_pos_win=jnp.where(rank_window, q_rank, g_C),
        surv_kernel_pos=jnp.where(surv_raw & att, surv_rank, 0),
        surv_valid=att,
        q_pos_surv=jnp.where(mode == P.LEAVE_GAPS, g_C, q_rank),
        use_precompute=use_pre, rotate_window=mode == P.STREAMINGLLM, ring_rank=ring_rank,
        rerotate=rerotate, ring_hop=ring_hop, surv_hop=surv_hop,
        ring_rot_old=ring_rot_old, ring_rot_new=ring_rot_new, surv_rot_old=surv_rot_old, surv_rot_new=surv_rot_new,
        refresh=refresh, refresh_mask=refresh_mask, surv_rank=surv_rank, replay_event=replay_event, q_rank=q_rank,
        next_state=dict(ring_pos=ring_pos, ring_rot=ring_rot_new, surv_pos=surv_pos, surv_rank=surv_rank,
                        surv_rot=surv_rot_new, surv_copy_pos=copy_pos, t=n),
    )


def cached_positions(cache: KVCache, policy: Policy) -> np.ndarray:
    """Sorted global positions the cache holds (for tests and debugging; host-side, single policy)."""
    t = int(cache.t)
    w0 = int(window_start(jnp.asarray(t), policy.window, policy.block, cache.start))
    ring = np.asarray(cache.ring_pos)
    surv = np.asarray(cache.surv_pos)
    in_window = set(int(g) for g in ring if g >= max(w0, 0))
    kept = set(int(g) for g in surv if 0 <= g < w0)
    return np.array(sorted(in_window | kept), dtype=np.int64)
