"""The immutable KV-cache pytree.

Layout, per layer (stacked on a leading layer axis L so a `lax.scan` over layers can thread it):

* win_k / win_v [L, B, Hkv, W, D]: the window segment, a ring buffer written at `t mod W`, never
  shifted. Keys are stored rotated at their global position (full, window, leave_gaps, rsqr,
  rsqr_precompute), at their rank (rerotate, replay) or raw (streamingllm).
* surv_k / surv_v [L, B, Hkv, S, D]: the survivor segment: sinks and flagged tokens, written when the
  token arrives. While a flagged token is still in the window its entry is the raw *shadow* copy; once
  it leaves the window the same entry *is* the survivor (no copy at eviction time). Keys raw for
  rsqr / rsqr_precompute / streamingllm, rotated for the rotated-storage policies.
* surv_k_rot [L, B, Hkv, S or 0, D]: rsqr_precompute's copy of each survivor rotated at its rank.
* win_tok / surv_tok [B, W or 0] / [B, S or 0]: token ids, only for replay.
* cold: the recall tier's cold store (rsqr_jax.recall.ColdState: every evicted non-sink token's raw K/V in pages,
  the summaries its page rule scores, each layer's kept page choice), None without one.
* loc_k / loc_v [Lloc, B, Hkv, Wl, D], loc_pos [Wl]: the rings of a hybrid model's local (sliding-window)
  layers (CacheSpec.local_layers rings of local_window slots; empty otherwise; rsqr_jax.hybrid). Keys rotated
  once at their global positions, written at `g mod Wl`; the policy never reaches them. The policy's fields
  above then hold the global layers only (L = CacheSpec.num_layers of them).
* pin_lo / pin_hi [PIN_SPANS or 0]: the pinned spans, [pin_lo, pin_hi) in global
  positions (empty: lo = hi); a pinned token takes a survivor entry on arrival, like a sink, and is kept
  forever, never counted against max_survivors. Set with `pin_span`, before the span is fed.

Positions are shared by all layers and all batch rows (every row advances in lockstep), so they are
stored once: win_pos / surv_pos (global position of the token in each slot, -1 = empty),
win_stored_rot / surv_stored_rot (the position each stored key is currently rotated at; 0 for raw
keys), surv_rank (each survivor's rank on the rank timeline, the logical-position map), surv_copy_pos
(where the precomputed copy was rotated).

Stream origin: `t` is the global position of the next token and `start` the global position of the
stream's first token (0 unless the cache was made with `init_cache(spec, start=s)`). Attention uses
global positions (window keys rotated at g, the query at t); the token set is
defined on stream-relative positions r = g - start: sinks are r < N, flagged tokens (r - N) mod delta ==
delta - 1, and the window counts the r tokens seen so far. So a stream started at s keeps exactly the
tokens a stream started at 0 keeps, shifted by s, and every policy's logits are translation-invariant
(global-timeline policies because attention only sees position differences, rank-timeline policies
because ranks do not depend on s). Positions are int32: a stream may run while t <= 2**31 - 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rsqr_jax import recall as R
from rsqr_jax.policy import Policy, host_policies, window_start
from rsqr_jax.spec import PIN_SPANS, CacheSpec, keeps_pins

MAX_POSITION = (1 << 31) - 1
# The K/V stacks (kernels.store), besides the cold store's own (ColdState.k, .v).
KV_FIELDS = ("win_k", "win_v", "surv_k", "surv_v", "surv_k_rot", "loc_k", "loc_v")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """See the module docstring for every field. Shapes follow a CacheSpec; `t` = next global position."""

    win_k: jax.Array
    win_v: jax.Array
    surv_k: jax.Array
    surv_v: jax.Array
    surv_k_rot: jax.Array
    win_tok: jax.Array
    surv_tok: jax.Array
    win_pos: jax.Array
    win_stored_rot: jax.Array
    surv_pos: jax.Array
    surv_rank: jax.Array
    surv_stored_rot: jax.Array
    surv_copy_pos: jax.Array
    cold: R.ColdState | None
    pin_lo: jax.Array
    pin_hi: jax.Array
    loc_k: jax.Array
    loc_v: jax.Array
    loc_pos: jax.Array
    t: jax.Array
    start: jax.Array

    def replace(self, **kw) -> "KVCache":
        return dataclasses.replace(self, **kw)


def init_cache(spec: CacheSpec, start: int = 0) -> KVCache:
    """An empty cache whose stream begins at global position `start` (0 <= start < 2**31 - 1).

    A nonzero start is how a stream continues at a large global position (e.g. to test that nothing
    depends on the absolute position); see the module docstring for what is relative to it.
    """
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or not 0 <= start < MAX_POSITION:
        raise ValueError(f"start must be an integer in [0, {MAX_POSITION}), got {start!r}")
    L, B, H, D = spec.num_layers, spec.batch, spec.num_kv_heads, spec.head_dim
    W, S = spec.win_capacity, spec.surv_capacity
    Sp = S if spec.precompute else 0
    dt = jnp.dtype(spec.dtype)
    neg = lambda n: jnp.full((n,), -1, jnp.int32)  # noqa: E731
    return KVCache(
        win_k=jnp.zeros((L, B, H, W, D), dt), win_v=jnp.zeros((L, B, H, W, D), dt),
        surv_k=jnp.zeros((L, B, H, S, D), dt), surv_v=jnp.zeros((L, B, H, S, D), dt),
        surv_k_rot=jnp.zeros((L, B, H, Sp, D), dt),
        win_tok=jnp.zeros((B, W if spec.token_ids else 0), jnp.int32),
        surv_tok=jnp.zeros((B, S if spec.token_ids else 0), jnp.int32),
        win_pos=neg(W), win_stored_rot=jnp.zeros((W,), jnp.int32),
        surv_pos=neg(S), surv_rank=neg(S), surv_stored_rot=jnp.zeros((S,), jnp.int32), surv_copy_pos=neg(Sp),
        cold=R.init_cold(spec, dt),
        pin_lo=jnp.zeros((PIN_SPANS if spec.pins else 0,), jnp.int32),
        pin_hi=jnp.zeros((PIN_SPANS if spec.pins else 0,), jnp.int32),
        loc_k=jnp.zeros((spec.local_layers, B, H, spec.local_window, D), dt),
        loc_v=jnp.zeros((spec.local_layers, B, H, spec.local_window, D), dt),
        loc_pos=neg(spec.local_window),
        t=jnp.asarray(start, jnp.int32), start=jnp.asarray(start, jnp.int32),
    )


def cache_arrays(cache: KVCache) -> dict[str, jax.Array]:
    """The cache as flat named arrays (a session file's entries): every field, the cold store's arrays by their
    file names (recall.FILE_NAMES); what the cache does not hold (no cold store, or a summary its rule does not
    keep) is not there."""
    out = {f.name: getattr(cache, f.name) for f in dataclasses.fields(KVCache) if f.name != "cold"}
    if cache.cold is not None:
        out.update({R.FILE_NAMES[name]: getattr(cache.cold, name) for name in R.FILE_NAMES
                    if getattr(cache.cold, name) is not None})
    return out


def cache_from_arrays(arrays: dict, spec: CacheSpec) -> KVCache:
    """cache_arrays' inverse for a cache of `spec` (KeyError: an array the spec needs is missing)."""
    fresh = jax.eval_shape(lambda: init_cache(spec))
    kw = {f.name: jnp.asarray(arrays[f.name]) for f in dataclasses.fields(KVCache) if f.name != "cold"}
    cold = None
    if fresh.cold is not None:
        cold = fresh.cold.replace(**{name: (None if getattr(fresh.cold, name) is None
                                            else jnp.asarray(arrays[R.FILE_NAMES[name]])) for name in R.FILE_NAMES})
    return KVCache(cold=cold, **kw)


def _cold_file_fields(slots: int, page_size: int):
    """(file name, axis, length along it, init_cache's fill value) of every cold array cut to `slots` slots."""
    for name, axis in {**R.SLOT_AXES, **R.PAGE_AXES}.items():
        yield (R.FILE_NAMES[name], axis, slots if name in R.SLOT_AXES else slots // page_size,
               -1 if name == "pos" else 0)


def cold_slots_in_use(fields: dict[str, np.ndarray], spec: CacheSpec) -> int:
    """How many leading cold slots (a multiple of the page size) hold anything: the ring fills slots 0, 1, ...
    in order until it wraps, so everything after them is still exactly as init_cache made it (checked bit
    for bit; else every slot counts). A session file stores only these (a fresh 4096-token store is ~300 MB)."""
    nc = spec.cold_slots
    if not nc:
        return 0
    page = spec.cold.page_size
    written = np.flatnonzero(np.asarray(fields["cold_pos"]) >= 0)
    used = 0 if not len(written) else -(-(int(written[-1]) + 1) // page) * page
    for name, axis, first, fill in _cold_file_fields(used, page):
        if name not in fields:
            continue
        tail = np.asarray(fields[name])[(slice(None),) * axis + (slice(first, None),)]
        pristine = (tail == fill).all() if fill else not tail.view(np.uint8).any()  # bits: -0.0 is not 0
        if not pristine:
            return nc
    return used


def cut_cold_store(fields: dict[str, np.ndarray], used: int, page_size: int) -> dict[str, np.ndarray]:
    """`fields` with the cold store cut to its first `used` slots (cold_slots_in_use)."""
    out = dict(fields)
    for name, axis, n, _ in _cold_file_fields(used, page_size):
        if name in fields:
            out[name] = fields[name][(slice(None),) * axis + (slice(0, n),)]
    return out


def grow_cold_store(fields: dict[str, np.ndarray], spec: CacheSpec) -> dict[str, np.ndarray]:
    """Undo cut_cold_store: each cold array padded back to its spec shape with init_cache's values."""
    fresh = cache_arrays(jax.eval_shape(lambda: init_cache(spec)))
    out = dict(fields)
    for name, axis, _, fill in _cold_file_fields(spec.cold_slots, spec.cold.page_size if spec.cold else 1):
        if name not in fields or name not in fresh:  # the caller checks what is missing
            continue
        a, want = fields[name], fresh[name]
        missing = want.shape[axis] - a.shape[axis]
        if missing > 0 and a.shape[:axis] + a.shape[axis + 1:] == want.shape[:axis] + want.shape[axis + 1:]:
            pad_shape = a.shape[:axis] + (missing,) + a.shape[axis + 1:]
            out[name] = np.concatenate([a, np.full(pad_shape, fill, a.dtype)], axis=axis)
    return out


class PinError(ValueError):
    """A pin the cache cannot hold (already fed, out of room, or under a policy that keeps no pins)."""


def pinned_count(cache: KVCache) -> int:
    """Tokens pinned so far (host-side)."""
    lo, hi = np.asarray(cache.pin_lo), np.asarray(cache.pin_hi)
    return int(np.max(np.sum(hi - lo, axis=-1))) if lo.size else 0


def pin_span(cache: KVCache, spec: CacheSpec, start: int, stop: int, policy: Policy | None = None) -> KVCache:
    """The cache with global positions [start, stop) pinned: kept forever, exactly, beside the sinks. Host-side, before the span is fed (a pinned key must be kept raw from its arrival on); a cache with a
    leading policy or stream axis pins every row alike. Raises PinError (one line) for a span already (partly)
    fed, one that would pass spec.pins tokens or PIN_SPANS spans, or a policy that keeps no pins."""
    start, stop = int(start), int(stop)
    if policy is not None and not all(keeps_pins(h) for h in host_policies(policy)):
        raise PinError("pinning needs a policy with sinks (full keeps everything; window keeps only the last W tokens)")
    if stop <= start:
        return cache
    if not spec.pins:
        raise PinError("this cache has no room for pins (CacheSpec.pins = 0)")
    t = int(np.max(np.asarray(cache.t)))
    if start < t:
        raise PinError(f"cannot pin from position {start}: the stream is already at {t} (pin a span before feeding it)")
    used = pinned_count(cache)
    if used + stop - start > spec.pins:
        raise PinError(f"pinning {stop - start} more tokens needs {used + stop - start} pinned slots; the cache has "
                       f"{spec.pins}")
    lo, hi = np.array(cache.pin_lo), np.array(cache.pin_hi)
    free = np.flatnonzero((hi <= lo).reshape(-1, lo.shape[-1]).all(axis=0))
    if not len(free):
        raise PinError(f"at most {PIN_SPANS} pinned spans")
    lo[..., free[0]], hi[..., free[0]] = start, stop
    return cache.replace(pin_lo=jnp.asarray(lo), pin_hi=jnp.asarray(hi))


def init_policy_cache(spec: CacheSpec, n_policies: int, start: int = 0) -> KVCache:
    """An empty cache with a leading policy axis [P] (for a vmapped sweep)."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n_policies,) + x.shape), init_cache(spec, start))


def cached_positions(cache: KVCache, policy: Policy) -> np.ndarray:
    """Sorted global positions the cache holds (for tests and debugging; host-side, single policy)."""
    t = int(cache.t)
    w0 = int(window_start(jnp.asarray(t), policy.window, policy.block, cache.start))
    win = np.asarray(cache.win_pos)
    surv = np.asarray(cache.surv_pos)
    in_window = set(int(g) for g in win if g >= max(w0, 0))
    kept = set(int(g) for g in surv if 0 <= g < w0)
    return np.array(sorted(in_window | kept), dtype=np.int64)
