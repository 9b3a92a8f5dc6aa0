"""The base policy of a study: its config holds one `Policy` (field `policy`) instead of window / sinks / delta /
max_survivors fields of its own, and derives the policies it varies from it (`Policy.replace`, checked like any
policy). A Policy is a pytree of jax arrays, so such a config is declared `eq=False` (compared by identity, never
hashed or compared by value), builds its default when it is made (`field`), and is written to JSON by
`config_json`, under the names the study's results always had."""

from __future__ import annotations

import copy
import dataclasses
import functools

from rsqr_jax.eval.runtime import ConfigError, portable_path
from rsqr_jax.policy import Policy, make_policy

# A result's name for a setting -> the Policy.settings() key it holds.
_SETTING = {"policy": "mode", "sinks": "n_sink"}
# Config fields that name an input file (written by portable_path).
_FILES = ("text", "filler", "facts")


def field(mode: str = "rsqr", **fields) -> dataclasses.Field:
    """A config's `policy` field: make_policy(mode, **fields) (the library's defaults otherwise), built when a
    config is made, not when its module is imported."""
    return dataclasses.field(default_factory=functools.partial(make_policy, mode, **fields))


def check(policy) -> Policy:
    """A study's base policy: a single Policy (ConfigError otherwise)."""
    if not isinstance(policy, Policy) or policy.mode.ndim:
        raise ConfigError(f"a study's base policy must be a single Policy, got {type(policy).__name__}")
    return policy


def settings(policy: Policy, keys: tuple[str, ...]) -> dict:
    """The policy's settings `keys`, by a study's names for them ("sinks" or "n_sink", "policy" for the mode)."""
    named = policy.settings()
    return {k: named[_SETTING.get(k, k)] for k in keys}


def config_json(cfg, keys: tuple[str, ...]) -> dict:
    """dataclasses.asdict(cfg) as a result writes it: the base policy in its place as its settings `keys`,
    input files by portable_path."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, Policy):
            out.update(settings(value, keys))
        elif f.name in _FILES and value is not None:
            out[f.name] = portable_path(value)
        else:
            out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
    return out
