"""bench_chat on the tiny random model: every arm runs, the table and the JSON have their shape and each row's
figures are positive and finite (no timing thresholds: the real run's numbers are in docs/chat.md)."""

from __future__ import annotations

import json
import math

import pytest

from rsqr_jax.policy import rsqr
from rsqr_lab.studies import chat_timing as B
from rsqr_jax.eval.runtime import ConfigError
from tests.tiny_session import CFG, model


class CharTokenizer:
    """Enough of a transformers tokenizer for the chat template path and incremental detokenization."""

    chat_template = "tiny"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % CFG.vocab_size for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}</>" for m in messages) + "<assistant>"


# A window the prompt ("<user>hi</><assistant>", 22 tokens) and the reply fit, so the store stays empty; prefill
# chunk 1: prefill and decode are one compilation.
TINY = B.BenchChatConfig("hi", new_tokens=6, rounds=2, seed=3, policy=rsqr(32, 2, 2, 4), recall_pages=2,
                         cold_capacity=32, page_size=4, prefill_chunk=1, gen_block=4)


@pytest.fixture(scope="module")
def result():
    apply_fn, params = model()
    return B.run(TINY, apply_fn, params, CFG, CharTokenizer())


@pytest.mark.slow
def test_every_arm_has_positive_finite_figures(result):
    assert [r["arm"] for r in result["rows"]] == [a.name for a in B.ARMS]
    assert B.finite_positive(result)
    for r in result["rows"]:
        assert len(r["tok_per_s_rounds"]) == TINY.rounds and r["new_tokens"] == TINY.new_tokens
        assert r["recallable"] == 0  # the recall arms measure an empty store
    for q in result["ratios"]:
        for v in (q["value"], q["cpu_value"]):
            assert math.isfinite(v) and v > 0
        assert len(q["rounds"]) == len(q["cpu_rounds"]) == TINY.rounds
    assert {q["meets"] for q in result["ratios"] if q["target"] is None} == {None}


@pytest.mark.slow
def test_engine_and_cli_reply_alike_from_one_seed(result):
    # same seed, same prompt: the reply loop and the blocks sample the very same tokens
    assert result["same_text"]["rsqr_cli == rsqr_engine"] and result["same_text"]["recall_cli == recall_engine"]
    assert result["seed"] == 3 and result["prompt_tokens"] == len("<user>hi</><assistant>")


@pytest.mark.slow
def test_table_and_json_shape(result, tmp_path):
    md = B.markdown(result)
    assert "seed 3" in md and md.count("\n| ") == 2 + len(B.ARMS) + len(B.RATIOS)  # two headers and the rows
    B.write(result, tmp_path)
    back = json.loads((tmp_path / "bench_chat.json").read_text())
    assert back["rows"] == result["rows"] and (tmp_path / "bench_chat.md").read_text() == md


def test_a_reply_that_would_fill_the_store_is_refused():
    apply_fn, params = model()
    with pytest.raises(ConfigError, match="must fit the window"):
        B.run(B.BenchChatConfig("hi", new_tokens=40, policy=rsqr(32, 2, 2, 4), recall_pages=2, cold_capacity=32,
                                page_size=4, prefill_chunk=4), apply_fn, params, CFG, CharTokenizer())
