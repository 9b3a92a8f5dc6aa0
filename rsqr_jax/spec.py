"""Static cache capacities (`CacheSpec`), the capacity each policy needs, and the check that a spec can
run a policy. Host-side only: nothing here is traced."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from rsqr_jax import policy as P
from rsqr_jax.policy import Policy, PolicyError


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Static capacities (array shapes) of a cache; hashable, so it can be a jit static argument.

    win_capacity: slots of the window ring (W..W+b-1 tokens, or the whole stream for `full`).
    surv_capacity: slots of the survivor segment (sinks + capped survivors + the raw shadow copies of
    flagged tokens still in the window). precompute / token_ids: the rsqr_precompute copy and the replay
    token ids are allocated only when a policy of the spec needs them. max_chunk: the largest chunk fed.
    """

    num_layers: int
    batch: int
    num_kv_heads: int
    head_dim: int
    win_capacity: int
    surv_capacity: int
    dtype: str = "float32"
    precompute: bool = False
    token_ids: bool = False
    max_chunk: int = 1

    def __post_init__(self):
        for name in ("num_layers", "batch", "num_kv_heads", "head_dim", "win_capacity", "surv_capacity", "max_chunk"):
            v = getattr(self, name)
            low = 0 if name == "surv_capacity" else 1
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise ValueError(f"CacheSpec.{name} must be an integer >= {low}, got {v!r}")
        if self.head_dim % 2:
            raise ValueError(f"CacheSpec.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        float_dtype_name(self.dtype)

    @classmethod
    def for_policies(cls, policies: Policy | list[Policy], *, num_layers: int, num_kv_heads: int, head_dim: int,
                     batch: int = 1, dtype: str = "float32", max_chunk: int = 1, max_len: int = 0) -> "CacheSpec":
        """The smallest spec that holds every given policy (a sweep batch gets the union).

        max_len bounds the stream for `full` (its window must hold everything) and nothing else.
        """
        hosts = host_policies(policies)
        win, surv, pre, tok = 1, 0, False, False
        for h in hosts:
            w, s = _needed(h, max_chunk, max_len)
            win, surv = max(win, w), max(surv, s)
            pre |= h["mode"] == P.RSQR_PRECOMPUTE
            tok |= h["mode"] == P.REPLAY
        return cls(num_layers, batch, num_kv_heads, head_dim, win, surv, float_dtype_name(dtype), pre, tok, max_chunk)

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
            h = host_policies(policy)[0]
            shadow = min(self.surv_capacity, _shadow_slots(h, self.max_chunk)) * self.entry_bytes
        key_bytes = self.entry_bytes // 2
        out = {
            "window": self.win_capacity * self.entry_bytes,
            "shadow": shadow,
            "survivors": surv_total - shadow,
            "precompute": self.surv_capacity * key_bytes if self.precompute else 0,
            "token_ids": (self.win_capacity + self.surv_capacity) * self.batch * 4 if self.token_ids else 0,
            "positions": (2 * self.win_capacity + (4 if self.precompute else 3) * self.surv_capacity + 1) * 4,
        }
        out["total"] = sum(out.values())
        return out


def float_dtype_name(dtype) -> str:
    """Canonical name of a floating storage dtype ('float32', 'bfloat16', ...); ValueError otherwise."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"unknown cache dtype {dtype!r}") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"cache dtype must be a floating type, got {dt}")
    return str(dt)


def host_policies(policies) -> list[dict]:
    """Every policy of a Policy (single or batched) or a list of them, as dicts of Python ints."""
    if isinstance(policies, Policy):
        h = policies.host()
        if isinstance(h["mode"], list):
            return [{k: v[i] for k, v in h.items()} for i in range(len(h["mode"]))]
        return [h]
    return [h for p in policies for h in host_policies(p)]


def _shadow_slots(h: dict, max_chunk: int) -> int:
    if h["delta"] <= 0:
        return 0
    return (h["window"] + h["block"] - 1 + max_chunk) // h["delta"] + 1


def _needed(h: dict, max_chunk: int, max_len: int) -> tuple[int, int]:
    """(window, survivor) capacity a policy needs."""
    if h["mode"] == P.FULL:
        return max(max_len, max_chunk, 1), 0
    win = h["window"] + h["block"] - 1
    if h["mode"] == P.WINDOW:
        return win, 0
    return win, h["n_sink"] + h["max_survivors"] + _shadow_slots(h, max_chunk)


def validate(policy: Policy, spec: CacheSpec, *, chunk: int = 1) -> None:
    """Raise PolicyError (one line) if the spec cannot run the policy (checked on the host, before tracing)."""
    for h in host_policies(policy):
        name = P.MODES[h["mode"]] if 0 <= h["mode"] < len(P.MODES) else h["mode"]
        if not 0 <= h["mode"] < len(P.MODES):
            raise PolicyError(f"unknown policy mode id {h['mode']}")
        if not 0 <= h["overflow"] < len(P.OVERFLOWS):
            raise PolicyError(f"unknown overflow rule id {h['overflow']}")
        if chunk > spec.max_chunk:
            raise PolicyError(f"chunk {chunk} exceeds the cache's max_chunk {spec.max_chunk}")
        if h["mode"] != P.FULL and chunk > h["window"]:
            raise PolicyError(f"{name}: chunk {chunk} is larger than the window {h['window']}; use --chunk <= window")
        win, surv = _needed(h, chunk, 0)
        if h["mode"] != P.FULL and win > spec.win_capacity:
            raise PolicyError(f"{name}: window {h['window']} + block {h['block']} - 1 exceeds the window capacity "
                              f"{spec.win_capacity}")
        if surv > spec.surv_capacity:
            raise PolicyError(f"{name}: {h['n_sink']} sinks + {h['max_survivors']} survivors (+ shadow slots) exceed "
                              f"the survivor capacity {spec.surv_capacity}")
        if h["mode"] == P.RSQR_PRECOMPUTE and not spec.precompute:
            raise PolicyError("rsqr_precompute needs a cache with the precompute copy (CacheSpec.precompute)")
        if h["mode"] == P.REPLAY and not spec.token_ids:
            raise PolicyError("replay needs a cache that stores token ids (CacheSpec.token_ids)")
