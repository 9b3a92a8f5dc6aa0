"""Presets, the one source of defaults (rsqr_jax.presets): the shipped files, which model each serves, how the
settings a caller gives resolve over them, and that the command line and the front door resolve to the same
settings (so the same call gives the same session everywhere)."""

from __future__ import annotations

import json

import pytest

import rsqr_jax as rj
from rsqr_jax import policy as P
from rsqr_jax.api import cold_store_of, policy_of, sampling_of
from rsqr_jax.presets import (SETTING_NAMES, PresetError, find_preset, generic, load_preset, parse_choice_sources,
                              shipped_presets)
from rsqr_jax.models.tiny import tiny_config

SMOL = "SmolLM2-135M-Instruct"


def test_shipped_presets_read_and_the_generic_one_is_last_and_matches_nothing():
    presets = shipped_presets()
    assert [p.name for p in presets][-1] == "generic" and generic().match is None
    assert {p.name for p in presets} >= {"generic", SMOL}
    for p in presets:  # every shipped preset resolves to objects the library accepts
        s = p.resolve()
        policy_of(s), cold_store_of(s), sampling_of(s)
        assert s.preset == p.name
    assert not generic().matches(tiny_config())


def test_the_embedded_models_config_finds_its_preset_and_another_model_the_generic_one(smollm2_config):
    assert find_preset(smollm2_config).name == SMOL
    assert find_preset(tiny_config()).name == "generic"
    import dataclasses

    other = dataclasses.replace(smollm2_config, num_layers=24)  # another size of the same family
    assert find_preset(other).name == "generic"


def test_the_embedded_preset_holds_the_tuned_recall_choice():
    s = load_preset(SMOL).resolve()
    cold = cold_store_of(s)
    assert cold == rj.ColdStore(4096, 16, reselect=4, share_from=parse_choice_sources("0-1:none,10-13:9,15-29:14"),
                                score_dtype="int8")
    assert cold.choice_sources(30) == (-1, -1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 9) + (14,) * 16
    assert policy_of(s).host() == rj.rsqr(window=256, sinks=4, delta=8, max_survivors=64, recall_pages=4).host()


def test_given_settings_win_and_another_policy_recalls_only_when_asked():
    p = load_preset(SMOL)
    s = p.resolve(window=512, temperature=0.0)
    assert s.policy_fields["window"] == 512 and s.sampling["temperature"] == 0.0
    assert s.sampling["top_k"] == p.sampling["top_k"]  # the rest stays the preset's
    assert p.resolve(policy="streamingllm").recall_pages == 0  # the preset's recall is its own policy's
    on = p.resolve(policy="streamingllm", recall_pages=2)
    assert on.recall_pages == 2 and cold_store_of(on).reselect == 4  # ...with the preset's choice when asked
    assert p.resolve(recall_pages=0).cold_store_kwargs is None
    assert p.resolve(share_from="none").recall["share_from"] is None  # every layer chooses
    assert p.resolve(share_from=-1).recall["share_from"] is None
    assert p.resolve(share_from=14).recall["share_from"] == 14
    whole = p.resolve(policy=rj.rerotate(64, 2, 4, 8, block=2))  # a Policy object: taken whole
    assert policy_of(whole).host() == rj.rerotate(64, 2, 4, 8, block=2).host() and whole.recall_pages == 0
    with pytest.raises(PresetError, match="unknown setting 'windw'"):
        p.resolve(windw=3)
    with pytest.raises(PresetError, match="share_from"):
        p.resolve(share_from="0-x:none")


def test_the_models_own_sampling_sits_between_a_given_value_and_the_presets():
    p = generic()
    s = p.resolve(model_sampling={"temperature": 0.8, "top_p": 0.5}, top_p=0.7)
    assert (s.sampling["temperature"], s.sampling["top_p"], s.sampling["min_p"]) == (0.8, 0.7, p.sampling["min_p"])


def test_policy_constructors_default_to_the_generic_presets_policy_with_recall_off():
    g = generic().policy
    assert P.DEFAULTS == {"window": g["window"], "n_sink": g["sinks"], "delta": g["delta"],
                          "max_survivors": g["max_survivors"], "block": g["block"], "overflow": g["overflow"],
                          "recall_pages": 0}
    assert rj.rsqr().host() == P.make_policy("rsqr", **{k: v for k, v in P.DEFAULTS.items()}).host()
    assert rj.rsqr(window=64, sinks=2).host() == rj.rsqr(64, 2).host()


def test_a_users_preset_file_loads_and_a_bad_one_is_one_line(tmp_path):
    d = json.loads((generic().source and open(generic().source).read()))
    d.update(name="mine", match={"arch": "llama", "num_layers": 2})
    d["policy"]["window"] = 32
    f = tmp_path / "mine.json"
    f.write_text(json.dumps(d))
    mine = load_preset(str(f))
    assert mine.name == "mine" and mine.resolve().policy_fields["window"] == 32
    del d["recall"]["reselect"]
    f.write_text(json.dumps(d))
    with pytest.raises(PresetError, match="recall must have exactly") as e:
        load_preset(str(f))
    assert "\n" not in str(e.value)
    f.write_text("{")
    with pytest.raises(PresetError, match="mine.json"):
        load_preset(str(f))
    with pytest.raises(PresetError, match="no preset 'nothing'"):
        load_preset("nothing")


def test_decode_flags_and_the_front_door_resolve_to_the_same_settings(smollm2_config):
    """The command line's flags and the library's keywords are the same names (SETTING_NAMES); resolved through
    the same preset they give the same Settings, defaults and overrides alike."""
    from rsqr_jax.api import Model
    from rsqr_jax.cli.args import SAMPLING_DESTS, apply_preset
    from rsqr_jax.cli.decode import build_parser

    extra = (*SAMPLING_DESTS, "prefill_chunk", "max_new_tokens", "cache_dtype")
    model = Model(None, find_preset(smollm2_config))
    model.__dict__["model_sampling"] = {}  # the embedded GGUF carries no sampling defaults
    for argv, kw in (([], {}),
                     (["--window", "128", "--temperature", "0", "--recall-pages", "2", "--reselect", "1"],
                      dict(window=128, temperature=0.0, recall_pages=2, reselect=1)),
                     (["--policy", "streamingllm", "--share-choice-from", "none"],
                      dict(policy="streamingllm", share_from=-1))):
        args = build_parser().parse_args(argv)
        args.cache_dtype = None
        cli = apply_preset(args, smollm2_config, extra=extra)
        assert cli == model.settings(**kw), argv
    assert set(SETTING_NAMES) >= {"window", "sinks", "recall_pages", "share_from", "temperature", "prefill_chunk"}
