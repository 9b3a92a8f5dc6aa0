"""Eviction policies as data: a pytree of int32 scalars, so policies vmap.

A `Policy` says which tokens stay (window, sinks, survivor stride, cap, block, overflow rule) and on
which timeline attention sees them (its `mode`). Nothing here has a shape that depends on a
parameter: capacities live in `rsqr_jax.cache.CacheSpec`, checked against the policy by `validate`
before anything is traced.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rsqr_jax.presets import policy_defaults

MODES = ("full", "window", "streamingllm", "leave_gaps", "rerotate", "replay", "rsqr", "rsqr_precompute")
OVERFLOWS = ("fifo", "decimate")
MODE_ID = {name: i for i, name in enumerate(MODES)}
RECALL_MODES = ("rsqr", "streamingllm")  # raw survivor keys: recalled tokens rotate exactly at their rank
OVERFLOW_ID = {name: i for i, name in enumerate(OVERFLOWS)}
FULL, WINDOW, STREAMINGLLM, LEAVE_GAPS, REROTATE, REPLAY, RSQR, RSQR_PRECOMPUTE = range(len(MODES))

# "Keeps everything": a window no stream reaches (int32-safe even after adding a block).
UNBOUNDED = 1 << 30

# The constructors' defaults: the generic preset's policy, recall off (rsqr_jax.presets).
DEFAULTS = _D = policy_defaults()


@dataclasses.dataclass(frozen=True)
class ModeTraits:
    """What a mode does, as the flags the per-step update reads (one row per mode of MODES).

    rank_window: the window segment is on the rank timeline (keys and query at ranks).
    rank_store: stored keys are rotated at their rank and must follow rank changes (rerotate / replay).
    raw_window: window keys are stored raw and rotated from raw at their rank every step (streamingllm).
    surv_global: survivors are stored rotated at their global position and seen from the query's global
        position (leave_gaps).
    surv_in_kernel: survivor keys are raw and rotated at their rank inside the kernel (rsqr, streamingllm).
    precompute: survivors are attended through a copy rotated at their rank, refreshed on rank changes.
    rerotate / replay: the upkeep run when ranks change (re-rotate in place / recompute by a forward pass).
    Fields are Python bools in MODE_TRAITS and traced booleans in the result of `mode_traits`.
    """

    rank_window: bool = False
    rank_store: bool = False
    raw_window: bool = False
    surv_global: bool = False
    surv_in_kernel: bool = False
    precompute: bool = False
    rerotate: bool = False
    replay: bool = False


T = ModeTraits
MODE_TRAITS = {
    "full": T(),
    "window": T(),
    "streamingllm": T(rank_window=True, raw_window=True, surv_in_kernel=True),
    "leave_gaps": T(surv_global=True),
    "rerotate": T(rank_window=True, rank_store=True, rerotate=True),
    "replay": T(rank_window=True, rank_store=True, replay=True),
    "rsqr": T(surv_in_kernel=True),
    "rsqr_precompute": T(precompute=True),
}
del T
_TRAIT_TABLE = np.array([[getattr(MODE_TRAITS[m], f.name) for f in dataclasses.fields(ModeTraits)] for m in MODES])


def mode_traits(mode: jax.Array) -> ModeTraits:
    """The traits of a (traced) mode id: one table lookup per trait, constant-folded for a fixed policy."""
    table = jnp.asarray(_TRAIT_TABLE)
    return ModeTraits(*(table[mode, i] for i in range(table.shape[1])))


class PolicyError(ValueError):
    """An impossible policy (bad parameter, or one the cache capacity cannot hold)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Policy:
    """One eviction policy, every field an int32 array (scalar, or [P] for a batch of policies).

    mode: index into MODES. window W: the window keeps W..W+block-1 most recent tokens.
    n_sink N: tokens 0..N-1 are kept forever. delta: every delta-th token leaving the window is kept
    as a survivor (0: none). max_survivors: cap on non-sink survivors. block: eviction granularity.
    overflow: index into OVERFLOWS (what to drop past the cap). recall_pages K: each layer attends, in
    the raw segment, to the tokens of its top-K cold-store pages as well (0 = off).
    """

    mode: jax.Array
    window: jax.Array
    n_sink: jax.Array
    delta: jax.Array
    max_survivors: jax.Array
    block: jax.Array
    overflow: jax.Array
    recall_pages: jax.Array

    @property
    def name(self) -> str:
        """Human-readable description of a single (unbatched, concrete) policy."""
        v = {f.name: int(np.asarray(getattr(self, f.name))) for f in dataclasses.fields(self)}
        mode = MODES[v["mode"]]
        if mode == "full":
            return "full"
        if mode == "window":
            return f"window(W={v['window']})"
        parts = [f"W={v['window']}", f"N={v['n_sink']}"]
        if v["delta"]:
            parts += [f"delta={v['delta']}", f"S={v['max_survivors']}", OVERFLOWS[v["overflow"]]]
        if v["block"] != 1:
            parts.append(f"b={v['block']}")
        if v["recall_pages"]:
            parts.append(f"recall={v['recall_pages']}")
        return f"{mode}({', '.join(parts)})"

    def host(self) -> dict:
        """Field values as Python ints (single policy) or lists (batched)."""
        return {f.name: np.asarray(getattr(self, f.name)).tolist() for f in dataclasses.fields(self)}

    def settings(self) -> dict:
        """The make_policy arguments of a single policy: mode and overflow by name, the other fields as ints."""
        h = self.host()
        if isinstance(h["mode"], list):
            raise PolicyError("settings() needs a single policy, not a batch (unstack_policies first)")
        return {**h, "mode": MODES[h["mode"]], "overflow": OVERFLOWS[h["overflow"]]}

    def replace(self, **fields) -> "Policy":
        """This policy with `fields` changed (mode and overflow by name), rebuilt and checked by make_policy:
        a derived policy is validated like any other, and full / window / streamingllm force what their name
        implies."""
        kw = self.settings()
        unknown = sorted(set(fields) - set(kw))
        if unknown:
            raise PolicyError(f"unknown policy field {unknown[0]!r}: choose from {', '.join(kw)}")
        kw.update(fields)
        return make_policy(kw.pop("mode"), **kw)


def make_policy(
    mode: str,
    *,
    window: int = _D["window"],
    n_sink: int = _D["n_sink"],
    delta: int = _D["delta"],
    max_survivors: int = _D["max_survivors"],
    block: int = _D["block"],
    overflow: str = _D["overflow"],
    recall_pages: int = _D["recall_pages"],
) -> Policy:
    """Build and check one policy (defaults: DEFAULTS). full/window/streamingllm force the parameters their name
    implies.

    full: keeps everything (no eviction). window: last W tokens, no sinks, no survivors.
    streamingllm: sinks + window (delta = 0). The others use every parameter as given.
    recall_pages > 0 (the recall tier) is defined for the raw-survivor modes only: rsqr, streamingllm.
    """
    if mode not in MODE_ID:
        raise PolicyError(f"unknown policy {mode!r}: choose one of {', '.join(MODES)}")
    if overflow not in OVERFLOW_ID:
        raise PolicyError(f"unknown overflow rule {overflow!r}: choose fifo or decimate")
    for name, value in (("window", window), ("n_sink", n_sink), ("delta", delta),
                        ("max_survivors", max_survivors), ("block", block), ("recall_pages", recall_pages)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise PolicyError(f"{name} must be an integer, got {value!r}")
        if not -UNBOUNDED <= value <= UNBOUNDED:  # int32-safe: window + block and friends cannot overflow
            raise PolicyError(f"{name} must be at most {UNBOUNDED} in magnitude, got {value}")
    if mode == "full":
        window, n_sink, delta, max_survivors, block = UNBOUNDED, 0, 0, 0, 1
    elif mode == "window":
        n_sink, delta, max_survivors = 0, 0, 0
    elif mode == "streamingllm":
        delta, max_survivors = 0, 0
    if delta == 0:
        max_survivors = 0
    if window < 1:
        raise PolicyError(f"window must be >= 1, got {window}")
    if n_sink < 0:
        raise PolicyError(f"n_sink must be >= 0, got {n_sink}")
    if delta < 0:
        raise PolicyError(f"delta must be >= 0 (0 = no survivors), got {delta}")
    if max_survivors < 0 or (delta > 0 and max_survivors < 1):
        raise PolicyError(f"max_survivors must be >= 1 when delta > 0, got {max_survivors}")
    if block < 1:
        raise PolicyError(f"block must be >= 1, got {block}")
    if mode != "full" and window >= UNBOUNDED:
        raise PolicyError(f"window must be < {UNBOUNDED}")
    if recall_pages < 0:
        raise PolicyError(f"recall_pages must be >= 0 (0 = no recall), got {recall_pages}")
    if recall_pages and mode not in RECALL_MODES:
        raise PolicyError(f"{mode} cannot recall evicted tokens (recall_pages > 0 needs one of "
                          f"{', '.join(RECALL_MODES)}: their survivor keys are raw)")
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return Policy(i32(MODE_ID[mode]), i32(window), i32(n_sink), i32(delta), i32(max_survivors), i32(block),
                  i32(OVERFLOW_ID[overflow]), i32(recall_pages))


def full() -> Policy:
    return make_policy("full")


def window(window: int = _D["window"], *, block: int = _D["block"]) -> Policy:
    return make_policy("window", window=window, block=block)


def streamingllm(window: int = _D["window"], sinks: int = _D["n_sink"], *, block: int = _D["block"],
                 recall_pages: int = 0) -> Policy:
    return make_policy("streamingllm", window=window, n_sink=sinks, block=block, recall_pages=recall_pages)


def leave_gaps(window=_D["window"], sinks=_D["n_sink"], delta=_D["delta"], max_survivors=_D["max_survivors"],
               block=_D["block"], overflow=_D["overflow"]) -> Policy:
    return make_policy("leave_gaps", window=window, n_sink=sinks, delta=delta, max_survivors=max_survivors,
                       block=block, overflow=overflow)


def rerotate(window=_D["window"], sinks=_D["n_sink"], delta=_D["delta"], max_survivors=_D["max_survivors"],
             block=_D["block"], overflow=_D["overflow"]) -> Policy:
    return make_policy("rerotate", window=window, n_sink=sinks, delta=delta, max_survivors=max_survivors,
                       block=block, overflow=overflow)


def replay(window=_D["window"], sinks=_D["n_sink"], delta=_D["delta"], max_survivors=_D["max_survivors"],
           block=_D["block"], overflow=_D["overflow"]) -> Policy:
    return make_policy("replay", window=window, n_sink=sinks, delta=delta, max_survivors=max_survivors,
                       block=block, overflow=overflow)


def rsqr(window=_D["window"], sinks=_D["n_sink"], delta=_D["delta"], max_survivors=_D["max_survivors"],
         block=_D["block"], overflow=_D["overflow"], recall_pages=0) -> Policy:
    """RSQR: window keys rotated once, every delta-th evicted token a raw survivor (at most max_survivors), the
    first `sinks` tokens kept; recall_pages > 0 recalls evicted pages (the session needs a cold store).
    Every argument may be given by keyword: rsqr(window=256, sinks=4, delta=8, max_survivors=64)."""
    return make_policy("rsqr", window=window, n_sink=sinks, delta=delta, max_survivors=max_survivors,
                       block=block, overflow=overflow, recall_pages=recall_pages)


def rsqr_precompute(window=_D["window"], sinks=_D["n_sink"], delta=_D["delta"], max_survivors=_D["max_survivors"],
                    block=_D["block"], overflow=_D["overflow"]) -> Policy:
    return make_policy("rsqr_precompute", window=window, n_sink=sinks, delta=delta,
                       max_survivors=max_survivors, block=block, overflow=overflow)


def stack_policies(policies: list[Policy]) -> Policy:
    """A batch of policies with a leading policy axis [P] (modes may be mixed)."""
    if not policies:
        raise PolicyError("empty list of policies")
    return jax.tree.map(lambda *xs: jnp.stack(xs), *policies)


def unstack_policies(batch: Policy) -> list[Policy]:
    n = int(np.asarray(batch.mode).shape[0])
    return [jax.tree.map(lambda x, i=i: x[i], batch) for i in range(n)]


def host_policies(policies) -> list[dict]:
    """Every policy of a Policy (single or batched) or a list of them, as dicts of Python ints."""
    if isinstance(policies, Policy):
        h = policies.host()
        if isinstance(h["mode"], list):
            return [{k: v[i] for k, v in h.items()} for i in range(len(h["mode"]))]
        return [h]
    return [h for p in policies for h in host_policies(p)]


def policy_size(policy: Policy) -> int | None:
    """Number of policies in a batch, or None for a single policy."""
    shape = np.shape(policy.mode)
    return None if shape == () else int(shape[0])


def window_start(n: jax.Array, window: jax.Array, block: jax.Array, start: jax.Array | int = 0) -> jax.Array:
    """Global position of the oldest window token once the stream (begun at `start`) reaches n.

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


# Up to this many entries, order_index counts the entries before each one ([S, S] comparisons) instead of sorting:
# the same ranks, in less time than XLA:CPU's sort at the sizes a step ranks (survivors plus recalled tokens).
RANK_BY_COUNT_MAX = 256


def order_index(mask: jax.Array, key: jax.Array) -> jax.Array:
    """0-based rank of each masked entry among the masked entries, ordered by key, ties by index (the masked-off
    entries rank after them, by index): the inverse of a stable argsort."""
    k = jnp.where(mask, key, jnp.iinfo(jnp.int32).max)
    n = key.shape[0]
    if n <= RANK_BY_COUNT_MAX:
        i = jnp.arange(n)
        before = (k[None, :] < k[:, None]) | ((k[None, :] == k[:, None]) & (i[None, :] < i[:, None]))
        return jnp.sum(before, axis=1, dtype=key.dtype)
    order = jnp.argsort(k, stable=True)
    return jnp.zeros_like(key).at[order].set(jnp.arange(n, dtype=key.dtype))
