"""Presets: one source of defaults for every entry point.

A preset is data, a JSON file in this folder: the policy, the recall tier's settings and the sampling and
generation defaults tuned for one model, found by the model's identity (architecture and sizes, `match`).
`generic.json` serves every model without a preset of its own. `rsqr_jax.load()`, the command lines, the
lm-eval model and the benchmarks all turn a preset and the settings a caller gave into one `Settings` through
`Preset.resolve`, so the same call gives the same tokens and the same cost everywhere.

This module imports nothing of the library and no jax (a command line reads its defaults before jax loads):
rsqr_jax.api turns `Settings` into the library's objects (`policy_of`, `cold_store_of`, `sampling_of`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

__all__ = ["Preset", "PresetError", "Settings", "SETTING_NAMES", "find_preset", "format_choice_sources", "generic",
           "load_preset", "parse_choice_sources", "shipped_presets"]

HERE = Path(__file__).resolve().parent
GENERIC = "generic"

POLICY_FIELDS = ("mode", "window", "sinks", "delta", "max_survivors", "block", "overflow")
RECALL_FIELDS = ("pages", "cold_capacity", "page_size", "page_score", "neighbors", "placement", "reselect",
                 "share_from", "score_dtype")
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
                   "frequency_penalty")
GENERATION_FIELDS = ("prefill_chunk", "max_new_tokens", "cache_dtype")

# The keyword of each setting a caller may give (the command lines' flag names, `--recall-pages` ->
# recall_pages), and where it lives in a preset.
_POLICY_KEYS = {"policy": "mode", "window": "window", "sinks": "sinks", "delta": "delta",
                "max_survivors": "max_survivors", "block": "block", "overflow": "overflow"}
_RECALL_KEYS = {"recall_pages": "pages", "cold_capacity": "cold_capacity", "page_size": "page_size",
                "page_score": "page_score", "recall_neighbors": "neighbors", "placement": "placement",
                "reselect": "reselect", "share_from": "share_from", "score_dtype": "score_dtype"}
SETTING_NAMES = (*_POLICY_KEYS, *_RECALL_KEYS, *SAMPLING_FIELDS, *GENERATION_FIELDS)


class PresetError(ValueError):
    """A preset file that cannot be used, or a setting no preset has (one line)."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a session is built with, resolved: the policy's fields (mode and overflow by name), the recall
    tier's (`recall_pages` 0 = off; then the other recall fields are unused), the sampling values and the
    generation defaults. `preset` names where the defaults came from."""

    preset: str
    policy_fields: dict
    recall: dict
    sampling: dict
    prefill_chunk: int
    max_new_tokens: int
    cache_dtype: str

    @property
    def recall_pages(self) -> int:
        return int(self.recall["pages"])

    @property
    def chunk(self) -> int:
        """The prefill chunk a session uses: at most the window (a chunk never evicts what it attends)."""
        if self.policy_fields["mode"] == "full":
            return self.prefill_chunk
        return min(self.prefill_chunk, int(self.policy_fields["window"]))

    @property
    def policy_kwargs(self) -> dict:
        """The rsqr_jax.policy.make_policy arguments of these settings (recall_pages included)."""
        f = self.policy_fields
        return {"mode": f["mode"], "window": f["window"], "n_sink": f["sinks"], "delta": f["delta"],
                "max_survivors": f["max_survivors"], "block": f["block"], "overflow": f["overflow"],
                "recall_pages": self.recall_pages}

    @property
    def cold_store_kwargs(self) -> dict | None:
        """The rsqr_jax.spec.ColdStore arguments of the recall tier (None when recall is off)."""
        if not self.recall_pages:
            return None
        r = self.recall
        return {"capacity": r["cold_capacity"], "page_size": r["page_size"], "page_score": r["page_score"],
                "neighbors": r["neighbors"], "placement": r["placement"], "reselect": r["reselect"],
                "share_from": r["share_from"], "score_dtype": r["score_dtype"]}

    def flat(self) -> dict:
        """The settings by keyword (the names `Preset.resolve` takes), e.g. to print or to record in a result."""
        out = {k: self.policy_fields[v] for k, v in _POLICY_KEYS.items()}
        out.update({k: self.recall[v] for k, v in _RECALL_KEYS.items()})
        out.update(self.sampling)
        out.update(prefill_chunk=self.prefill_chunk, max_new_tokens=self.max_new_tokens, cache_dtype=self.cache_dtype)
        return out


@dataclasses.dataclass(frozen=True)
class Preset:
    """One model's defaults (a JSON file of this folder). `match`: the model config fields that identify the
    model (None: the generic preset). `tuning`: the text and command the recall settings were derived from."""

    name: str
    about: str
    match: dict | None
    policy: dict
    recall: dict
    sampling: dict
    generation: dict
    tuning: dict | None = None
    source: str = ""

    def matches(self, config) -> bool:
        """Whether a model config (anything with the `match` fields as attributes) is this preset's model."""
        if not self.match:
            return False
        return all(getattr(config, k, None) == v for k, v in self.match.items())

    def resolve(self, *, model_sampling: dict | None = None, **given) -> Settings:
        """The settings of a session: each keyword given (not None) over this preset's value.

        `policy` may be a mode name or an rsqr_jax.policy.Policy (its fields, recall_pages included, are taken
        whole). The preset's recall tier applies under the preset's own policy mode; another mode recalls
        nothing unless `recall_pages` is given. `model_sampling`: the sampling values the model's own files carry
        (rsqr_jax.models.loading.load_generation_defaults), between a given value and the preset's."""
        unknown = sorted(set(given) - set(SETTING_NAMES))
        if unknown:
            raise PresetError(f"unknown setting {unknown[0]!r}: choose from {', '.join(SETTING_NAMES)}")
        given = {k: v for k, v in given.items() if v is not None}
        pol = given.pop("policy", None)
        policy_fields = dict(self.policy)
        if pol is not None and not isinstance(pol, str):  # a Policy object: its fields whole
            s = pol.settings()
            s["sinks"] = s.pop("n_sink")
            given.setdefault("recall_pages", s.pop("recall_pages"))
            policy_fields.update(s)
        elif pol is not None:
            policy_fields["mode"] = pol
        for key, field in _POLICY_KEYS.items():
            if key in given:
                policy_fields[field] = given[key]
        recall = dict(self.recall)
        if policy_fields["mode"] != self.policy["mode"]:
            recall["pages"] = 0
        for key, field in _RECALL_KEYS.items():
            if key in given:
                recall[field] = given[key]
        if recall["share_from"] in (-1, "none"):  # every layer chooses its own pages
            recall["share_from"] = None
        elif isinstance(recall["share_from"], str):  # per-layer sources as text: 0-1:none,10-13:9,...
            try:
                recall["share_from"] = parse_choice_sources(recall["share_from"])
            except ValueError as e:
                raise PresetError(f"share_from: {e}") from None
        sampling = {k: given.get(k, (model_sampling or {}).get(k, self.sampling[k])) for k in SAMPLING_FIELDS}
        sampling["top_k"], sampling["repeat_last_n"] = int(sampling["top_k"]), int(sampling["repeat_last_n"])
        gen = {k: given.get(k, self.generation[k]) for k in GENERATION_FIELDS}
        for k in ("prefill_chunk", "max_new_tokens"):
            if isinstance(gen[k], bool) or not isinstance(gen[k], int) or gen[k] < 1:
                raise PresetError(f"{k} must be a positive integer, got {gen[k]!r}")
        return Settings(self.name, policy_fields, recall, sampling, gen["prefill_chunk"], gen["max_new_tokens"],
                        gen["cache_dtype"])


def parse_choice_sources(text: str, sep: str = ",") -> tuple[int, ...]:
    """'0-1:none,10-13:9,15-29:14' -> ColdStore.share_from as a tuple: each named layer (or range) attends the
    source's page choice (none: recalls nothing); an unnamed layer chooses its own. ValueError on bad syntax."""
    sources: dict[int, int] = {}
    for item in text.split(sep):
        layers, _, source = item.strip().partition(":")
        first, _, last = layers.partition("-")
        try:
            lo, hi = int(first), int(last or first)
            src = -1 if source.strip().lower() == "none" else int(source)
        except ValueError:
            raise ValueError(f"LAYER[-LAYER]:SOURCE items (SOURCE a layer or none), got {item!r}") from None
        if lo < 0 or hi < lo or src < -1:
            raise ValueError(f"layers from >= 0 to a later one and a source >= 0 or none, got {item!r}")
        sources.update(dict.fromkeys(range(lo, hi + 1), src))
    return tuple(sources.get(layer, layer) for layer in range(max(sources) + 1))


def format_choice_sources(sources: tuple[int, ...], sep: str = ",") -> str:
    """The text `parse_choice_sources` reads back to the same sources (runs of layers with one source; the layers
    that choose their own are left out, so a trailing run of them is implied)."""
    items, layer = [], 0
    while layer < len(sources):
        src = sources[layer]
        if src == layer:
            layer += 1
            continue
        end = layer
        while end + 1 < len(sources) and sources[end + 1] == src:
            end += 1
        name = "none" if src < 0 else str(src)
        items.append(f"{layer}-{end}:{name}" if end > layer else f"{layer}:{name}")
        layer = end + 1
    return sep.join(items) or "0:0"


def _read(path: Path) -> Preset:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        preset = Preset(**d, source=str(path))
    except (OSError, ValueError, TypeError) as e:
        raise PresetError(f"preset {path.name}: {str(e).splitlines()[0]}") from None
    for part, fields in (("policy", POLICY_FIELDS), ("recall", RECALL_FIELDS), ("sampling", SAMPLING_FIELDS),
                         ("generation", GENERATION_FIELDS)):
        got = getattr(preset, part)
        if not isinstance(got, dict) or set(got) != set(fields):
            have = sorted(got) if isinstance(got, dict) else got
            raise PresetError(f"preset {path.name}: {part} must have exactly {', '.join(fields)}, got {have}")
    return preset


@functools.cache
def shipped_presets() -> tuple[Preset, ...]:
    """The presets shipped in this folder, the generic one last."""
    presets = sorted((_read(p) for p in HERE.glob("*.json")), key=lambda p: (p.match is None, p.name))
    return tuple(presets)


def generic() -> Preset:
    return next(p for p in shipped_presets() if p.name == GENERIC)


def load_preset(name_or_path: str | Path) -> Preset:
    """A shipped preset by name (case-insensitive), or a preset file of the user's."""
    for p in shipped_presets():
        if str(name_or_path).lower() in (p.name.lower(), Path(p.source).stem):
            return p
    path = Path(name_or_path)
    if path.suffix == ".json" and path.is_file():
        return _read(path)
    names = ", ".join(p.name for p in shipped_presets())
    raise PresetError(f"no preset {str(name_or_path)!r}: choose from {names} or give a preset's .json file")


def find_preset(config) -> Preset:
    """The preset of a model config: the shipped one that matches it, else the generic preset."""
    return next((p for p in shipped_presets() if p.matches(config)), generic())


def policy_defaults() -> dict:
    """The policy constructors' defaults (rsqr_jax.policy.make_policy), by Policy field: the generic preset's
    policy with recall off (a bare Policy has no cold store to recall from)."""
    p = generic().policy
    return {"window": p["window"], "n_sink": p["sinks"], "delta": p["delta"], "max_survivors": p["max_survivors"],
            "block": p["block"], "overflow": p["overflow"], "recall_pages": 0}
