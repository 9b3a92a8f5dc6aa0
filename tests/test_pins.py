"""Pinned spans (docs/design.md §3c) on the tiny random model: a pinned token is kept forever, exactly, beside the
sinks, never counted against max_survivors; the logits equal the float64 rank oracle over the token-set model with
the pins; the library call, the conversation rules and the command-line flags; one-line errors.

The token-set model itself is checked against the cache bookkeeping with random pins in tests/test_policies.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import rsqr_jax as rj
from rsqr_jax import conversation
from rsqr_jax import policy as P
from rsqr_jax.cache import PinError, cached_positions, init_cache, pin_span
from rsqr_jax.session import Session
from rsqr_lab.testing.oracle import reference_token_sets, stream_logits_f64
from rsqr_lab.testing import drawn_seed
from rsqr_jax.models.tiny import tiny_weights
from tests.cli import assert_one_line_errors
from tests.tiny_session import CFG, model

DIMS = dict(num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim)


@pytest.mark.parametrize("mode", ["rsqr", "streamingllm", "rerotate"])
def test_pinned_stream_equals_the_float64_rank_oracle(mode):
    """Two pinned spans (one overlapping a survivor stride, one past many evictions) under a small cap: token by
    token against the float64 oracle of sinks + pins + survivors + window at their ranks (rerotate in float32:
    its hops stay at float32 rounding here)."""
    T, W, N, d, S = 64, 8, 2, 3, 2
    spans = [(5, 11), (30, 33)]
    seed = drawn_seed(f"pins {mode}")
    tokens = np.random.default_rng(seed).integers(0, CFG.vocab_size, size=T)
    kw = dict(window=W, n_sink=N) | ({} if mode == "streamingllm" else dict(delta=d, max_survivors=S))
    pol = P.make_policy(mode, **kw)
    spec = rj.CacheSpec.for_policies([pol], pins=16, **DIMS)
    apply_fn, params = model()
    dec = rj.Decoder(apply_fn, spec)
    cache = dec.init_cache()
    for a, b in spans:
        cache = pin_span(cache, spec, a, b, pol)
    logits = []
    for t in range(T):
        out, cache = dec.feed(params, tokens[None, t:t + 1], cache, pol)
        logits.append(np.asarray(out[0, 0], np.float64))
    h = pol.host()
    pinned = {g for a, b in spans for g in range(a, b)}
    sets = reference_token_sets(T, window=W, n_sink=N, delta=h["delta"], max_survivors=h["max_survivors"], block=1,
                                pinned=pinned)
    assert pinned <= set(sets[-1][1])  # every pin is still there at the end
    assert list(cached_positions(cache, pol)) == sets[-1][1]
    want = stream_logits_f64(tiny_weights(CFG, 0), CFG, tokens, [s for _, s in sets], "rank")
    assert float(np.max(np.abs(np.stack(logits) - want)) / np.max(np.abs(want))) < 2e-5
    unpinned = reference_token_sets(T, window=W, n_sink=N, delta=h["delta"], max_survivors=h["max_survivors"],
                                    block=1)
    alt = stream_logits_f64(tiny_weights(CFG, 0), CFG, tokens, [s for _, s in unpinned], "rank")
    assert float(np.max(np.abs(np.stack(logits) - alt)) / np.max(np.abs(want))) > 1e-3  # the pins mattered


def test_pins_never_count_against_the_survivor_cap_and_cost_their_own_memory():
    pol = P.rsqr(8, 2, 3, 2)
    spec = rj.CacheSpec.for_policies([pol], pins=12, **DIMS)
    plain = rj.CacheSpec.for_policies([pol], **DIMS)
    assert spec.surv_capacity == plain.surv_capacity + 12
    parts = spec.bytes_by_part(pol)
    assert parts["pins"] == 12 * spec.entry_bytes and parts["survivors"] == plain.bytes_by_part(pol)["survivors"]
    apply_fn, params = model()
    dec = rj.Decoder(apply_fn, spec)
    cache = pin_span(dec.init_cache(), spec, 10, 22, pol)  # 12 pins, 4 of them on the survivor stride
    tokens = np.arange(80)[None] % CFG.vocab_size
    for t in range(80):
        _, cache = dec.feed(params, tokens[:, t:t + 1], cache, pol)
    kept = set(cached_positions(cache, pol))
    assert set(range(10, 22)) <= kept
    survivors = [g for g in kept if g >= 2 and not 10 <= g < 22 and g < 80 - 8]
    assert len(survivors) == 2  # the cap of 2 is all other survivors


def test_pin_errors_are_one_line_and_change_nothing():
    pol = P.rsqr(8, 2, 3, 2)
    spec = rj.CacheSpec.for_policies([pol], pins=12, **DIMS)
    cache = init_cache(spec)
    with pytest.raises(PinError, match="has 12"):
        pin_span(cache, spec, 0, 13, pol)
    with pytest.raises(PinError, match="policy with sinks"):
        pin_span(cache, spec, 0, 4, P.window(8))
    with pytest.raises(PinError, match="no room for pins"):
        plain = rj.CacheSpec.for_policies([pol], **DIMS)
        pin_span(init_cache(plain), plain, 0, 2, pol)
    fed = cache.replace(t=cache.t + 5)
    with pytest.raises(PinError, match="already at 5"):
        pin_span(fed, spec, 3, 6, pol)
    many = cache
    for i in range(8):
        many = pin_span(many, spec, 2 * i, 2 * i + 1, pol)
    with pytest.raises(PinError, match="at most 8 pinned spans"):
        pin_span(many, spec, 40, 41, pol)
    assert np.asarray(cache.pin_hi).sum() == 0  # a refused pin left the cache as it was
    assert pin_span(cache, spec, 4, 4, pol) is cache  # an empty span is nothing to do


def test_a_session_pins_what_it_feeds_and_resumes_with_its_pins(tmp_path):
    """feed(..., pin=True), save, load: the resumed session holds the pins and continues exactly as the
    uninterrupted one; an unpinned session has evicted those tokens."""
    apply_fn, params = model()
    ids = np.random.default_rng(drawn_seed("session pins")).integers(0, CFG.vocab_size, size=40)

    def make(pins):
        return Session.create(apply_fn, params, P.rsqr(8, 2, 3, 2), dims=CFG, chunk=4, pins=pins,
                              vocab_size=CFG.vocab_size)

    a = make(16)
    a.feed(ids[:10], pin=True)
    assert a.pinned == 10
    a.feed(ids[10:30])
    a.save(tmp_path / "s.session", {"model": "tiny"})
    b = Session.load(tmp_path / "s.session", apply_fn, params, {"model": "tiny"})
    assert b.pinned == 10 and b.spec.pins == 16
    assert a.generate(12) == b.generate(12)
    for s in (a, b):
        assert set(range(10)) <= set(cached_positions(s.cache, s.policy))
    c = make(0)
    c.feed(ids[:30])
    assert not set(range(2, 10)) & set(cached_positions(c.cache, c.policy)) - {5, 8}  # only survivors remain
    with pytest.raises(PinError, match="needs 26"):
        a.pin_next(16)


class ChatTokenizer:
    """Characters as ids, and a ChatML-like template with a default system prompt (as SmolLM2's has)."""

    chat_template = "ChatML-like"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % CFG.vocab_size for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        if not messages or messages[0]["role"] != "system":
            messages = [{"role": "system", "content": "Default."}] + list(messages)
        text = "".join(f"<{m['role']}>\n{m['content']}</>\n" for m in messages)
        return text + ("<assistant>\n" if add_generation_prompt else "")


def test_conversation_pins_cover_the_system_prompt_the_first_turn_or_keep_tokens():
    tok = ChatTokenizer()
    assert conversation.system_prompt_text(tok, "Be brief.") == "<system>\nBe brief.</>\n"
    assert conversation.system_prompt_text(tok, None) == "<system>\nDefault.</>\n"  # the template's own
    first = conversation.ChatFeed(tok, [{"role": "system", "content": "Be brief."}]).user_turn("hi")
    sys_len = len("<system>\nBe brief.</>\n")
    assert conversation.Pins(system=True).count(tok, first, "Be brief.") == sys_len
    assert conversation.Pins(first_turn=True).count(tok, first, "Be brief.") == len(first)
    assert conversation.Pins(keep=3, system=True).count(tok, first, "Be brief.") == sys_len
    assert conversation.Pins(keep=100).count(tok, first, None) == 100
    assert conversation.Pins(system=True).room(tok, "Be brief.") == sys_len
    assert conversation.Pins(first_turn=True).room(tok, None, 512) == 512
    assert not conversation.Pins()
    with pytest.raises(ValueError, match="keep"):
        conversation.Pins(keep=-1)


def test_a_chat_pins_its_system_prompt_and_a_refused_pin_loses_nothing():
    tok = ChatTokenizer()
    apply_fn, params = model()
    sys_len = len("<system>\nBe brief.</>\n")
    session = Session.create(apply_fn, params, P.rsqr(8, 2, 3, 2), dims=CFG, chunk=4, pins=sys_len,
                             vocab_size=CFG.vocab_size)
    chat = conversation.Chat(session, tok, system="Be brief.", max_new_tokens=4,
                             pins=conversation.Pins(system=True))
    chat.send("hello there")
    assert session.pinned == sys_len
    assert set(range(sys_len)) <= set(cached_positions(session.cache, session.policy))
    chat.send("and again")  # later turns pin nothing more
    assert session.pinned == sys_len

    small = Session.create(apply_fn, params, P.rsqr(8, 2, 3, 2), dims=CFG, chunk=4, pins=4, vocab_size=CFG.vocab_size)
    refused = conversation.Chat(small, tok, system="Be brief.", pins=dataclasses.replace(conversation.Pins(),
                                                                                         first_turn=True))
    with pytest.raises(PinError, match="has 4"):
        refused.send("a long first message")
    assert small.n_tokens == 0 and [m["role"] for m in refused.messages] == ["system"]


def test_decode_pin_and_placement_flags_bad_input_is_one_line():
    assert_one_line_errors([("decode.py", args + ["--prompt", "hi"], fragment) for args, fragment in [
        (["--policy", "window", "--keep", "4"], "keeps no pinned tokens"),
        (["--policy", "full", "--pin-system"], "keeps no pinned tokens"),
        (["--raw", "--pin-system"], "need the chat template"),
        (["--keep", "-1"], "must be >= 0"),
        (["--placement", "middle", "--recall-pages", "2"], "unknown placement"),
    ]])
