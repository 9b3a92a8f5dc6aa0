"""Static cache capacities (`CacheSpec`), the capacity each policy needs, and the check that a spec can
run a policy. Host-side only: nothing here is traced."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from rsqr_jax import policy as P
from rsqr_jax.policy import Policy, PolicyError, host_policies
from rsqr_jax.presets import format_choice_sources, parse_choice_sources  # noqa: F401 (re-exported)


# How recall ranks cold pages against a layer's queries (both on keys rotated at their global positions):
# "mean": the query against the page's mean key; "quest": Quest's upper bound sum_d max(q_d lo_d, q_d hi_d)
# over the page's per-channel key minimum and maximum; "max": the page's best token, max over its keys of
# q . k, exact (it keeps every cold key rotated at its global position, a float32 scoring copy, and scores
# the whole store every step: O(store) per step where the summaries are O(store / page_size)).
# "shortlist": the SHORTLIST_PER_PAGE x max_recall_pages pages of best mean key, each rescored by its best
# token from its raw keys rotated on the fly: "max"'s choice whenever its top pages are on the shortlist, with
# the mean rule's storage and O(store / page_size + shortlist x page_size) work per step.
PAGE_SCORES = ("mean", "quest", "max", "shortlist")
# The rules that read each page's sum of keys (its mean key); the store of another rule keeps no sums.
SUM_RULES = ("mean", "shortlist")
# Shortlisted pages per recalled page: at 16 the shortlist held every page "max" would have chosen on the fact probe.
SHORTLIST_PER_PAGE = 16
# The default: "max" finds a fact that stands out in one token of its page, which a page's mean key averages away,
# at a higher per-token cost than "mean" (it scores every key of the store).
DEFAULT_PAGE_SCORE = "max"
# How the "max" rule's scoring copy stores a key: "float32" (exact scores), or "int8" (codes and a float32 scale per
# key and KV head, scored against the query quantized the same way by an int32 dot: the same facts on the probe, a
# quarter of the copy's bytes, and faster where the scoring dominates).
SCORE_DTYPES = ("float32", "int8")
# Where recalled tokens sit on the query's timeline. Recalled keys are raw, so each is
# rotated once from raw whatever the placement. "rank": at their rank among sinks, pins and survivors in the
# raw segment (the survivor-segment query moves past them; distances stay bounded by the cache). "true": at
# their global position, seen from the query at their true distance t - g (attended in the window segment,
# whose query sits at t; distances grow with the stream). "fixed": every recalled token at one distance from
# the query, the policy's window W (InfLLM's choice; in a chunk, row c sees them at W + c).
PLACEMENTS = ("rank", "true", "fixed")
DEFAULT_PLACEMENT = "rank"
# Pinned spans a stream may hold: each is a [start, stop) range of global positions, stream
# state kept in the cache beside the positions (a system prompt, a first turn, the first K tokens, ...).
PIN_SPANS = 8


def _check_choice_sources(sources: tuple) -> None:
    """ColdStore.share_from as a tuple: each layer attends its own choice, an earlier chooser's, or none (-1)."""
    for layer, src in enumerate(sources):
        if isinstance(src, bool) or not isinstance(src, int) or not -1 <= src <= layer:
            raise ValueError(f"share_from: layer {layer} may attend its own choice ({layer}), an earlier layer's or "
                             f"none (-1), got {src!r}")
        if src >= 0 and sources[src] != src:
            raise ValueError(f"share_from: layer {layer} attends layer {src}'s choice, but layer {src} does not "
                             f"choose its own pages")


@dataclasses.dataclass(frozen=True)
class ColdStore:
    """The recall tier's cold store as one value, `CacheSpec.cold`: capacity (evicted
    tokens kept at least), page_size, page_score (the rule that ranks pages, PAGE_SCORES: it also names the
    summaries the store keeps), neighbors (pages on each side of a chosen page that come back with it) and
    placement (where recalled tokens sit, PLACEMENTS) and reselect (a layer chooses its pages afresh at every
    reselect-th decode step and at every prefill chunk, and attends the pages it chose last in between: the scoring,
    recall's per-step cost linear in the store, runs 1/reselect as often) and share_from (None: every layer
    chooses its own pages; a policy-layer index r: layers 0..r choose their own and every later layer attends
    the pages layer r chose in the same step, so the store is scored in r + 1 layers instead of all: the
    reason is that a few middle layers find the fact's page far more often than the rest; or a tuple, one entry per layer from layer 0: the layer whose choice that layer attends -
    itself (it scores the store), an earlier layer that chooses its own (that layer's choice of the same step) or
    -1 (it recalls nothing: a layer whose own choice is close to arbitrary); layers past the tuple's end choose
    their own, `choice_sources` spells it out) and score_dtype (SCORE_DTYPES: the "max" rule's scoring copy in
    float32 or int8). The
    placement is static, a compilation of its own: "rank" extends the raw segment and the others the window
    segment, so a dynamic choice would carry both in every step. Validated here, once; ValueError on impossible
    values."""

    capacity: int = 4096
    page_size: int = 16
    page_score: str = DEFAULT_PAGE_SCORE
    neighbors: int = 0
    placement: str = DEFAULT_PLACEMENT
    reselect: int = 1
    share_from: int | None = None
    score_dtype: str = "float32"

    def __post_init__(self):
        if self.page_size < 1:
            raise ValueError(f"the page size must be >= 1, got {self.page_size}")
        if self.capacity < self.page_size or self.capacity % self.page_size:
            raise ValueError(f"the cold capacity {self.capacity} must be a positive multiple of the page size "
                             f"{self.page_size}")
        if self.page_score not in PAGE_SCORES:
            raise ValueError(f"unknown page score {self.page_score!r}: choose one of {', '.join(PAGE_SCORES)}")
        if self.neighbors < 0:
            raise ValueError(f"recall neighbors must be >= 0, got {self.neighbors}")
        if isinstance(self.reselect, bool) or not isinstance(self.reselect, int) or self.reselect < 1:
            raise ValueError(f"reselect must be an integer >= 1 (1 = choose pages at every step), got {self.reselect!r}")
        if isinstance(self.share_from, list):  # from a session file's JSON
            object.__setattr__(self, "share_from", tuple(self.share_from))
        if isinstance(self.share_from, tuple):
            _check_choice_sources(self.share_from)
        elif self.share_from is not None and (isinstance(self.share_from, bool) or
                                              not isinstance(self.share_from, int) or self.share_from < 0):
            raise ValueError(f"share_from must be a layer index >= 0, a tuple of one source per layer, or None, got "
                             f"{self.share_from!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.placement!r}: choose one of {', '.join(PLACEMENTS)}")
        if self.score_dtype not in SCORE_DTYPES:
            raise ValueError(f"unknown score dtype {self.score_dtype!r}: choose one of {', '.join(SCORE_DTYPES)}")

    @property
    def pages(self) -> int:
        return self.capacity // self.page_size

    def choice_sources(self, num_layers: int) -> tuple[int, ...] | None:
        """share_from as one source per layer (None when every layer chooses its own): the layer whose page choice
        each layer attends, -1 for none."""
        if self.share_from is None:
            return None
        if isinstance(self.share_from, int):
            return tuple(min(layer, self.share_from) for layer in range(num_layers))
        return self.share_from + tuple(range(len(self.share_from), num_layers))

    @classmethod
    def from_json(cls, d: dict | None) -> "ColdStore | None":
        """The cold store a session file's spec holds (None without one)."""
        return None if d is None else cls(**d)


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Static capacities (array shapes) of a cache; hashable, so it can be a jit static argument.

    win_capacity: slots of the window ring (W..W+b-1 tokens, or the whole stream for `full`).
    surv_capacity: slots of the survivor segment (sinks + capped survivors + the raw shadow copies of
    flagged tokens still in the window). precompute / token_ids: the rsqr_precompute copy and the replay
    token ids are allocated only when a policy of the spec needs them. max_chunk: the largest chunk fed.
    cold / max_recall_pages: the recall tier: a per-layer cold store (a ColdStore: it
    keeps at least the last cold.capacity evicted non-sink tokens, raw K/V in pages of cold.page_size
    consecutive tokens, and the summaries its page rule needs; None: no cold store), from which a policy may
    recall up to max_recall_pages pages per layer and step, each with cold.neighbors pages on each side (a
    fact that straddles a page boundary returns whole; duplicates count once).
    pins: pinned tokens the survivor segment holds besides sinks and survivors (the spans
    themselves are stream state, in the cache: `rsqr_jax.cache.pin_span`); 0 = no pinning.
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
    cold: ColdStore | None = None
    max_recall_pages: int = 0
    pins: int = 0
    local_layers: int = 0
    local_window: int = 0

    def __post_init__(self):
        for name in ("num_layers", "batch", "num_kv_heads", "head_dim", "win_capacity", "surv_capacity", "max_chunk",
                     "max_recall_pages", "pins", "local_layers", "local_window"):
            v = getattr(self, name)
            low = 0 if name in ("surv_capacity", "max_recall_pages", "pins", "local_layers", "local_window") else 1
            if name == "num_layers" and self.local_layers:  # every layer local (Mistral's window): no policy layer
                low = 0
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise ValueError(f"CacheSpec.{name} must be an integer >= {low}, got {v!r}")
        if self.head_dim % 2:
            raise ValueError(f"CacheSpec.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        float_dtype_name(self.dtype)
        if self.cold is not None and not isinstance(self.cold, ColdStore):
            raise ValueError(f"CacheSpec.cold must be a ColdStore or None, got {self.cold!r}")
        if self.max_recall_pages and self.cold is None:
            raise ValueError("max_recall_pages > 0 needs a cold store (CacheSpec.cold)")
        if self.max_recall_pages > self.cold_pages:
            raise ValueError(f"max_recall_pages {self.max_recall_pages} exceeds the cold store's "
                             f"{self.cold_pages} pages")
        if self.cold is not None and isinstance(self.cold.share_from, tuple):
            if len(self.cold.share_from) > self.num_layers:
                raise ValueError(f"share_from names {len(self.cold.share_from)} layers; {self.num_layers} layers "
                                 f"recall")
        elif self.cold is not None and self.cold.share_from is not None and self.cold.share_from >= self.num_layers:
            raise ValueError(f"share_from {self.cold.share_from} is not one of the {self.num_layers} layers that "
                             f"recall")
        if self.cold is not None and self.cold.score_dtype == "int8" and self.head_dim % 4:
            raise ValueError(f"the int8 scoring copy packs four codes to a word: head_dim {self.head_dim} is not a "
                             f"multiple of 4 (use score_dtype float32)")
        if self.cold is not None and self.cold.neighbors and not self.max_recall_pages:
            raise ValueError("recall neighbors > 0 need recall (max_recall_pages > 0)")
        if bool(self.local_layers) != bool(self.local_window):
            raise ValueError(f"local layers need a window and a window needs local layers, got local_layers="
                             f"{self.local_layers}, local_window={self.local_window}")
        if self.local_layers and self.token_ids:
            raise ValueError("replay is not defined for hybrid local/global models (its consolidation pass would "
                             "give the local layers a context they never saw)")

    @property
    def cold_slots(self) -> int:
        """Slots of the cold ring: cold.capacity evicted tokens plus room for the tokens still in the window
        (every non-sink token is written raw on arrival) and for one partly overwritten page."""
        if self.cold is None:
            return 0
        P = self.cold.page_size
        return -(-(self.cold.capacity + self.win_capacity + self.max_chunk) // P) * P + P

    @property
    def cold_pages(self) -> int:
        """Pages of the cold ring (0 without a cold store)."""
        return self.cold_slots // self.cold.page_size if self.cold is not None else 0

    @property
    def page_score(self) -> str | None:
        """The cold store's page rule (None without one)."""
        return None if self.cold is None else self.cold.page_score

    @property
    def keeps_page_sums(self) -> bool:
        """Whether the cold store keeps each page's sum of keys (ColdState.sums: only for the rules that read
        it, SUM_RULES)."""
        return self.page_score in SUM_RULES

    @property
    def scoring_copy_dtype(self) -> str:
        """The scoring copy's number format, ColdStore.score_dtype (float32 without a cold store); how it is
        stored: scoring_copy_row."""
        return "float32" if self.cold is None else self.cold.score_dtype

    @property
    def scoring_copy_row(self) -> tuple[str, int]:
        """(dtype, width) of one key's row of ColdState.scoring: float32 [head_dim], or for the int8 copy int32
        words [head_dim / 4 + 1], its codes four to a word then its float32 scale's bits (recall.pack_int8_keys:
        XLA:CPU scored a layer of the default store about twice as fast from these rows as from 64 codes and a
        scale read apart)."""
        if self.scoring_copy_dtype == "float32":
            return "float32", self.head_dim
        return "int32", self.head_dim // 4 + 1

    @property
    def scoring_copy_bytes(self) -> int:
        """Bytes of the "max" rule's scoring copy per cold slot (all layers and KV heads): float32 keys, or int8
        codes and a float32 scale per key."""
        return self.num_layers * self.batch * self.num_kv_heads * 4 * self.scoring_copy_row[1]

    @property
    def recall_slots(self) -> int:
        """Survivor-segment slots a layer adds per step for recalled tokens (gathered, not stored)."""
        if self.cold is None:
            return 0
        return self.max_recall_pages * (1 + 2 * self.cold.neighbors) * self.cold.page_size

    @property
    def recall_pages_gathered(self) -> int:
        """Pages a layer gathers per step: the chosen ones and their neighbours."""
        return self.max_recall_pages * (1 + 2 * self.cold.neighbors) if self.cold is not None else 0

    @property
    def reselects(self) -> bool:
        """Whether the cache holds each layer's page choice (recall on, and ColdStore.reselect > 1: kept between
        scorings, or ColdStore.share_from: read by the later layers)."""
        return (self.cold is not None and self.max_recall_pages > 0
                and (self.cold.reselect > 1 or self.cold.share_from is not None))

    @property
    def shortlist_pages(self) -> int:
        """Pages the "shortlist" rule rescores per layer and step (0 under the other rules)."""
        if self.page_score != "shortlist" or not self.max_recall_pages:
            return 0
        return min(SHORTLIST_PER_PAGE * self.max_recall_pages, self.cold_pages)

    @classmethod
    def for_policies(cls, policies: Policy | list[Policy], *, dims=None, num_layers: int | None = None,
                     num_kv_heads: int | None = None, head_dim: int | None = None,
                     batch: int = 1, dtype: str = "float32", max_chunk: int = 1, max_len: int = 0,
                     cold: ColdStore | None = None, max_recall_pages: int | None = None,
                     pins: int = 0) -> "CacheSpec":
        """The smallest spec that holds every given policy (a sweep batch gets the union).

        dims: the model's cache dimensions, anything with num_layers, num_kv_heads and head_dim (a model
        config, or a dict of them), so a caller need not copy them by hand; an explicit keyword must agree.
        max_len bounds the stream for `full` (its window must hold everything) and nothing else.
        cold: the recall tier's cold store (None: none); max_recall_pages defaults to the largest recall_pages
        of the policies. pins: room for that many pinned tokens, added to the survivor
        segment of the policies that keep sinks.
        """
        num_layers, num_kv_heads, head_dim = model_dims(dims, num_layers=num_layers, num_kv_heads=num_kv_heads,
                                                        head_dim=head_dim)
        # A hybrid model's local (sliding-window) layers get a ring of their window each, not the policy's cache.
        local_layers, local_window = (int(_dim(dims, "local_layers") or 0), int(_dim(dims, "local_window") or 0))
        num_layers -= local_layers
        hosts = host_policies(policies)
        win, surv, pre, tok = 1, 0, False, False
        for h in hosts:
            w, s = _needed(h, max_chunk, max_len)
            win, surv = max(win, w), max(surv, s + (pins if keeps_pins(h) else 0))
            pre |= h["mode"] == P.RSQR_PRECOMPUTE
            tok |= h["mode"] == P.REPLAY
        if max_recall_pages is None:
            max_recall_pages = max(h["recall_pages"] for h in hosts)
        return cls(num_layers, batch, num_kv_heads, head_dim, win, surv, float_dtype_name(dtype), pre, tok, max_chunk,
                   cold, max_recall_pages, pins, local_layers, local_window)

    def to_json(self) -> dict:
        """The spec as a session file holds it (the cold store nested, or None)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "CacheSpec":
        """The spec a session file holds (its cold store nested, or None)."""
        d = dict(d)
        d["cold"] = ColdStore.from_json(d.get("cold"))
        return cls(**d)

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
        summary_bytes = key_bytes // jnp.dtype(self.dtype).itemsize * 4  # one float32 mean key per page
        out = {
            "window": self.win_capacity * self.entry_bytes,
            "shadow": shadow,
            "survivors": surv_total - shadow - min(self.pins, self.surv_capacity) * self.entry_bytes,
            "pins": min(self.pins, self.surv_capacity) * self.entry_bytes,
            "precompute": self.surv_capacity * key_bytes if self.precompute else 0,
            "token_ids": (self.win_capacity + self.surv_capacity) * self.batch * 4 if self.token_ids else 0,
            "positions": (2 * self.win_capacity + (4 if self.precompute else 3) * self.surv_capacity + 1
                          + (2 * PIN_SPANS if self.pins else 0)) * 4,
            "cold_store": self.cold_slots * (self.entry_bytes + 4)
            + self.cold_pages * summary_bytes * (2 if self.page_score == "quest" else 1 if self.keeps_page_sums else 0)
            + (self.cold_slots * self.scoring_copy_bytes if self.page_score == "max" else 0),
        }
        if self.local_layers:  # the local layers' rings (their K/V and the slots' positions), a part of their own
            out["local_window"] = (2 * self.local_layers * self.batch * self.num_kv_heads * self.head_dim
                                   * jnp.dtype(self.dtype).itemsize + 4) * self.local_window
        out["total"] = sum(out.values())
        # Working memory of the recalled tokens of one layer (gathered per step; not part of the stored cache).
        out["recalled_slots"] = self.recall_slots * self.entry_bytes // self.num_layers if self.num_layers else 0
        return out


DIMS = ("num_layers", "num_kv_heads", "head_dim")


def _dim(dims, name: str):
    """dims' `name` (attribute or mapping key), None when it has none."""
    if dims is None:
        return None
    return dims.get(name) if isinstance(dims, Mapping) else getattr(dims, name, None)


def model_dims(dims=None, **given) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) from `dims` (attributes or mapping keys) and/or the keywords
    (None: not given); ValueError (one line) for a missing one or a keyword that contradicts `dims`."""
    out = []
    for name in DIMS:
        value = given.get(name)
        if dims is not None:
            try:
                own = dims[name] if isinstance(dims, Mapping) else getattr(dims, name)
            except (KeyError, AttributeError):
                raise ValueError(f"dims has no {name} (give a model config with num_layers, num_kv_heads and "
                                 f"head_dim)") from None
            if value is not None and value != own:
                raise ValueError(f"{name}={value!r} contradicts dims.{name}={own!r}")
            value = own
        if value is None:
            raise ValueError(f"the cache needs {name}: pass dims=<model config> or {name}=")
        out.append(value)
    return tuple(out)


def float_dtype_name(dtype) -> str:
    """Canonical name of a floating storage dtype ('float32', 'bfloat16', ...); ValueError otherwise."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"unknown cache dtype {dtype!r}") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"cache dtype must be a floating type, got {dt}")
    return str(dt)


def keeps_pins(h: dict) -> bool:
    """Whether a policy keeps pinned spans: every policy with sinks (`full` keeps everything anyway; `window` is
    the last W tokens by definition)."""
    return h["mode"] not in (P.FULL, P.WINDOW)


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
        surv += spec.pins if keeps_pins(h) else 0
        if h["mode"] != P.FULL and win > spec.win_capacity:
            raise PolicyError(f"{name}: window {h['window']} + block {h['block']} - 1 exceeds the window capacity "
                              f"{spec.win_capacity}")
        if surv > spec.surv_capacity:
            raise PolicyError(f"{name}: {h['n_sink']} sinks + {h['max_survivors']} survivors (+ shadow slots"
                              f"{f' + {spec.pins} pins' if spec.pins else ''}) exceed the survivor capacity "
                              f"{spec.surv_capacity}")
        if h["mode"] == P.RSQR_PRECOMPUTE and not spec.precompute:
            raise PolicyError("rsqr_precompute needs a cache with the precompute copy (CacheSpec.precompute)")
        if h["mode"] == P.REPLAY and not spec.token_ids:
            raise PolicyError("replay needs a cache that stores token ids (CacheSpec.token_ids)")
        if h["recall_pages"] and P.MODES[h["mode"]] not in P.RECALL_MODES:
            raise PolicyError(f"{name} cannot recall evicted tokens (recall_pages needs one of "
                              f"{', '.join(P.RECALL_MODES)})")
        if h["recall_pages"] and spec.cold is not None and spec.cold.placement != "rank" and h["mode"] != P.RSQR:
            raise PolicyError(f"{name}: placement {spec.cold.placement!r} needs rsqr (its window is on the global "
                              f"timeline; {name}'s is on the rank timeline)")
        if h["recall_pages"] > spec.max_recall_pages:
            raise PolicyError(f"{name}: recall_pages {h['recall_pages']} exceeds the cache's max_recall_pages "
                              f"{spec.max_recall_pages}" + ("" if spec.cold is not None else " (no cold store)"))
