"""The one-call public API on a tiny random model: `CacheSpec.for_policies(dims=config)`, the front door's
`Model.session`, `Model.chat` (rsqr_jax.conversation.Chat) and `Model.generate` under a preset, and `stream_nll`
over a list of policies. Each is checked against the hand-wired form it replaces (the same spec, the same tokens
under the same seed, the same NLL), and the text-level chat against the decode command's own turn loop
(rsqr_jax.cli.chat.run)."""

from __future__ import annotations

import dataclasses
import functools
import io

import jax.numpy as jnp
import numpy as np
import pytest

import rsqr_jax as rj
from rsqr_jax import conversation
from rsqr_jax.cli import chat as cli_chat
from rsqr_jax.api import Model
from rsqr_jax.models.llama import Llama, LoadedModel
from rsqr_jax.models.tiny import tiny_config, tiny_weights
from rsqr_jax.presets import generic

CFG = tiny_config()
DIMS = dict(num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim)
POLICY = rj.rsqr(16, 2, 3, 4)
SAMPLING = rj.Sampling(temperature=3.0, top_k=50, repeat_penalty=1.3)  # flat: the tiny model is peaked
SEED = 1234
# The same sampler as keywords of the front door (every field, so the preset's own values do not apply).
SAMPLING_KW = SAMPLING.to_json()


class AlphabetTokenizer:
    """A reversible transformers-style tokenizer over a small alphabet (inside the tiny vocabulary)."""

    ALPHABET = " abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:?!\n-<>/"

    def __init__(self, template: bool = True):
        self.chat_template = "<role>content</>" if template else None

    def encode(self, text, add_special_tokens=True):
        return [self.ALPHABET.index(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.ALPHABET[int(i) % len(self.ALPHABET)] for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


TOK = AlphabetTokenizer()


@functools.lru_cache(maxsize=None)
def loaded(eos: tuple[int, ...] = ()) -> LoadedModel:
    """The tiny random model as load_model returns a real one (one per eos set: one apply_fn, one compilation)."""
    cfg = dataclasses.replace(CFG, eos_token_ids=eos)
    return LoadedModel(cfg, Llama(cfg, tiny_weights(cfg, 0), dtype=jnp.float32), "tiny", "float32", _tokenizer=TOK)


def front(lm: LoadedModel) -> Model:
    """The front door's Model over the tiny model, with the generic preset (no preset matches it)."""
    m = Model(lm, generic(), kernel="xla")
    m.__dict__["model_sampling"] = {}  # the tiny model has no files that could carry sampling defaults
    return m


def hand_wired(lm: LoadedModel, policy, chunk: int, **kw) -> rj.Session:
    """The Session wired by hand from its parts."""
    apply_fn, params = lm.split()
    spec = rj.CacheSpec.for_policies(policy, max_chunk=chunk, **DIMS)
    return rj.Session(apply_fn, params, spec, policy, prefill_chunk=chunk, eos_ids=lm.config.eos_token_ids,
                      vocab_size=lm.config.vocab_size, **kw)


def prompt(seed: int, n: int = 23) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, CFG.vocab_size, size=n)]


# ----------------------------------------------------------------------------------------------------
# CacheSpec.for_policies(dims=...)

@pytest.mark.parametrize("policies", [POLICY, [POLICY, rj.streamingllm(8, 2), rj.replay(8, 2, 3, 3, block=2)]])
def test_for_policies_takes_a_model_config_or_a_dict_as_dims(policies):
    by_hand = rj.CacheSpec.for_policies(policies, max_chunk=4, **DIMS)
    assert rj.CacheSpec.for_policies(policies, dims=CFG, max_chunk=4) == by_hand
    assert rj.CacheSpec.for_policies(policies, dims=DIMS, max_chunk=4) == by_hand
    assert rj.CacheSpec.for_policies(policies, dims=CFG, max_chunk=4, num_layers=CFG.num_layers) == by_hand
    other = tiny_config(layers=3, kv_heads=1, head_dim=8)
    got = rj.CacheSpec.for_policies(policies, dims=other, max_chunk=4)
    assert (got.num_layers, got.num_kv_heads, got.head_dim) == (3, 1, 8), got


def test_for_policies_refuses_missing_or_contradicting_dims():
    with pytest.raises(ValueError, match="contradicts dims.head_dim=16"):
        rj.CacheSpec.for_policies(POLICY, dims=CFG, head_dim=8)
    with pytest.raises(ValueError, match="needs num_kv_heads"):
        rj.CacheSpec.for_policies(POLICY, num_layers=2, head_dim=16)
    with pytest.raises(ValueError, match="dims has no num_layers"):
        rj.CacheSpec.for_policies(POLICY, dims={"num_kv_heads": 2, "head_dim": 16})


# ----------------------------------------------------------------------------------------------------
# Model.session

def test_one_call_session_generates_the_tokens_of_the_hand_wired_session():
    lm = loaded()
    s = front(lm).session(policy=POLICY, seed=SEED, **SAMPLING_KW)
    ref = hand_wired(lm, POLICY, chunk=16, sampling=SAMPLING, seed=SEED)
    assert s.spec == ref.spec and s.prefill_chunk == ref.prefill_chunk == s.spec.max_chunk == 16
    assert s.decoder == ref.decoder  # the same apply_fn and spec: one compilation serves both
    ids = prompt(SEED)
    assert s.feed(ids) == ref.feed(ids)
    got, want = s.generate(40), ref.generate(40)
    assert got == want, f"seed {SEED}: {got} != {want}"
    # the seed reaches the sampler: another one samples another stream
    other = front(lm).session(policy=POLICY, seed=SEED + 1, **SAMPLING_KW)
    other.feed(ids)
    assert other.generate(40) != got, f"seeds {SEED} and {SEED + 1} sampled the same 40 tokens"


def test_one_call_session_takes_the_models_eos_ids_vocabulary_and_the_presets_dtype():
    m = front(loaded(eos=(5, 7)))
    s = m.session(policy=POLICY)
    assert s.eos_ids == {5, 7} and s.vocab_size == CFG.vocab_size and s.spec.dtype == "float32"
    with pytest.raises(ValueError, match="out of range"):
        s.feed([CFG.vocab_size])
    assert m.session(policy=POLICY, cache_dtype="bfloat16").spec.dtype == "bfloat16"


def test_session_follows_the_preset_chunk_capped_by_the_window_and_full_gets_the_models_context():
    m = front(loaded())
    apply_fn, params = m.loaded.split()
    preset_session = m.session()  # the generic preset: rsqr with the recall tier
    assert preset_session.prefill_chunk == 64 and preset_session.policy.host() == rj.rsqr(recall_pages=4).host()
    assert preset_session.spec.cold == rj.ColdStore(4096, 16) and preset_session.spec.max_recall_pages == 4
    small = m.session(policy=rj.streamingllm(8, 2))
    assert small.prefill_chunk == small.spec.max_chunk == 8 and small.spec.cold is None  # another mode: no recall
    assert m.session(policy=POLICY, prefill_chunk=4).spec == rj.CacheSpec.for_policies(POLICY, dims=CFG, max_chunk=4)
    full = m.session(policy="full")  # the model's context
    assert full.spec.win_capacity == CFG.max_position_embeddings
    with pytest.raises(ValueError, match="needs max_len"):
        rj.Session.create(apply_fn, params, rj.full(), dims=CFG)
    assert rj.Session.create(apply_fn, params, rj.full(), dims=CFG, max_len=100).spec.win_capacity == 100
    with pytest.raises(ValueError, match="prefill_chunk must be a positive integer"):
        m.session(policy=POLICY, prefill_chunk=0)
    with pytest.raises(rj.PresetError, match="unknown setting 'chunk'"):
        m.session(policy=POLICY, chunk=4)
    cold = m.session(policy=rj.rsqr(16, 2, 3, 4, recall_pages=2), cold_capacity=64, page_size=8)
    assert (cold.spec.cold, cold.spec.max_recall_pages) == (rj.ColdStore(64, 8), 2)


# ----------------------------------------------------------------------------------------------------
# Model.chat: the decode command's turn loop, as an object

TURNS = ("Hi, I am Ada.", "What is my name?")


def test_chat_send_replies_as_the_decode_commands_chat_does():
    lm = loaded()
    c = front(lm).chat(policy=POLICY, system="Be brief.", max_new_tokens=12, seed=SEED, **SAMPLING_KW)
    shown: list[str] = []
    replies = [c.send(TURNS[0], on_text=shown.append), c.send(TURNS[1])]
    assert "".join(shown) == replies[0]
    ref = hand_wired(lm, POLICY, chunk=16, sampling=SAMPLING, seed=SEED)
    config = cli_chat.ChatConfig(TURNS, chat=True, max_new_tokens=12, system="Be brief.")
    result = cli_chat.run(config, ref, TOK, out=io.StringIO(), status=lambda msg: None)
    assert replies == result.replies, f"seed {SEED}"
    assert c.session.n_tokens == ref.n_tokens and c.stop_reason == result.stops[-1] == "length"
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert c.messages[-1]["content"] == replies[1]


def test_chat_complete_continues_plain_text_as_the_decode_commands_raw_mode_does():
    lm = loaded()
    c = front(lm).chat(policy=POLICY, seed=SEED, **SAMPLING_KW)
    got = [c.complete(t, max_new_tokens=10) for t in TURNS]
    ref = hand_wired(lm, POLICY, chunk=16, sampling=SAMPLING, seed=SEED)
    result = cli_chat.run(cli_chat.ChatConfig(TURNS, chat=False, max_new_tokens=10), ref, TOK, out=io.StringIO(),
                          status=lambda msg: None)
    assert got == result.replies, f"seed {SEED}"
    assert c.n_generated == 10 and c.messages == []


def test_chat_stops_on_a_stop_string_and_on_the_models_eos():
    lm = loaded()
    s = front(lm).session(policy=POLICY, seed=SEED, **SAMPLING_KW)
    s.feed(TOK.encode("abc"))
    ids = s.generate(30)
    text = TOK.decode(ids)
    assert front(lm).chat(policy=POLICY, max_new_tokens=30, seed=SEED, **SAMPLING_KW).complete("abc") == text
    assert front(lm).generate("abc", chat=False, policy=POLICY, max_new_tokens=30, seed=SEED, **SAMPLING_KW) == text
    stop = text[8:10]
    cut = front(lm).chat(policy=POLICY, max_new_tokens=30, stop=(stop,), seed=SEED, **SAMPLING_KW)
    assert cut.complete("abc") == text[:text.index(stop)] and cut.stop_reason == "stop", f"seed {SEED}"
    k = next(i for i in range(5, 30) if ids[i] not in ids[:i])  # the first token new after the fifth
    ended = front(loaded(eos=(ids[k],))).chat(policy=POLICY, max_new_tokens=30, seed=SEED, **SAMPLING_KW)
    assert ended.complete("abc") == TOK.decode(ids[:k]) and ended.stop_reason == "eos", f"seed {SEED}"
    assert ended.n_generated == k + 1 and ended.session.pending is None


def test_chat_refuses_send_without_a_template_and_mixing_send_with_complete():
    lm = loaded()
    c = front(lm).chat(policy=POLICY, max_new_tokens=2)
    c.send("hi")
    with pytest.raises(ValueError, match="reset"):
        c.complete("hi")
    c.reset()
    assert c.session.n_tokens == 0 and c.messages == []
    c.complete("hi")
    bare = conversation.Chat(front(lm).session(policy=POLICY), AlphabetTokenizer(template=False))
    with pytest.raises(ValueError, match="no chat template"):
        bare.send("hi")
    with pytest.raises(ValueError, match="max_new_tokens"):
        conversation.Chat(front(lm).session(policy=POLICY), TOK, max_new_tokens=0)


def test_the_reply_loop_has_one_home():
    for name in ("ChatFeed", "TextStream", "generate_reply", "has_chat_template"):  # no second copy in the app
        assert getattr(cli_chat, name, getattr(conversation, name)) is getattr(conversation, name), name
    assert rj.Chat is conversation.Chat


# ----------------------------------------------------------------------------------------------------
# stream_nll over a list of policies

def test_stream_nll_of_a_list_equals_the_stacked_vmapped_call():
    apply_fn, params = loaded().split()
    pols = [rj.rsqr(8, 2, 3, 3), rj.rerotate(8, 2, 3, 3), rj.streamingllm(8, 2)]
    spec = rj.CacheSpec.for_policies(pols, dims=CFG, max_chunk=4)
    tokens = np.asarray([prompt(SEED, 41)])
    got, _ = rj.stream_nll(apply_fn, params, tokens, pols, spec, chunk=4, segment=16)
    want, _ = rj.stream_nll(apply_fn, params, tokens, rj.stack_policies(pols), spec, chunk=4, segment=16,
                            vmap_policies=True)
    assert got.shape == (3, 1, 40) and np.array_equal(got, want), f"seed {SEED}"
    assert not np.array_equal(got[0], got[2]), "rsqr and streamingllm scored alike: the policies were not used"
    one, _ = rj.stream_nll(apply_fn, params, tokens, pols[0], spec, chunk=4, segment=16)  # the single form
    assert one.shape == (1, 40)
    np.testing.assert_allclose(one, got[0], rtol=1e-5, atol=1e-5, err_msg=f"seed {SEED}")
