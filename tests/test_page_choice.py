"""rsqr_lab.studies.page_choice: the fact page's rank in a layer's order, the claim the study rests on (a cache
with room to rank every page attends what the K-page cache attends and keeps its choice first), and a whole
run on a tiny random model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rsqr_jax.engine import Decoder
from rsqr_jax.spec import CacheSpec, ColdStore
from rsqr_lab.studies import page_choice as PC
from rsqr_lab.studies.recall_probe import RecallModel, feed_stream
from rsqr_lab.testing import drawn_seed
from rsqr_jax.models.tiny import tiny_config, tiny_model
from rsqr_lab.testing.tokenizer import WordTokenizer
from tests.cli import assert_one_line_errors

CFG = tiny_config(layers=3)


def test_fact_page_ranks():
    page = 4
    cold_pos = np.full(4 * page, -1)
    cold_pos[2 * page:3 * page] = np.arange(10, 10 + page)  # page 2 holds positions 10..13
    cold_pos[0:page] = np.arange(14, 18)
    choice = np.array([[[2, 0, 1, 3], [0, 1, 3, 2]],   # layer 0: rank 0 (row 0), 3 (row 1)
                       [[0, 1, 3, 2], [1, 2, 0, 3]]])  # layer 1: rank 3, 1
    np.testing.assert_array_equal(PC.fact_page_ranks(choice, cold_pos, page, 11), [[0, 3], [3, 1]])
    np.testing.assert_array_equal(PC.fact_page_ranks(choice[:, :, :2], cold_pos, page, 11), [[0, 2], [2, 1]])
    # a position no slot holds (evicted from the store, or never written): the page count, for every layer
    np.testing.assert_array_equal(PC.fact_page_ranks(choice, cold_pos, page, 99), np.full((2, 2), 4))


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(CFG, seed=0)


def test_wide_choice_attends_what_k_pages_attend(tiny):
    """max_recall_pages = every page with the policy's K: the same logits as a cache that holds K (its extra
    slots are masked), and its first K choices are the K-page cache's choice, at a prompt chunk and the decode
    step after it."""
    apply_fn, params = tiny
    seed = drawn_seed("wide choice")
    rng = np.random.default_rng(seed)
    cold = ColdStore(capacity=128, page_size=8, reselect=2)
    pol = PC.PageChoiceConfig("unused").arm()  # the study's arm: W 24, block 8, K = 4
    K, C = int(pol.recall_pages), int(pol.block)
    narrow = CacheSpec.for_policies(pol, dims=CFG, batch=2, max_chunk=C, cold=cold)
    wide = dataclasses.replace(narrow, max_recall_pages=narrow.cold_pages)
    ids = rng.integers(0, CFG.vocab_size, (2, 120))
    outs = []
    for spec in (narrow, wide):
        dec = Decoder(apply_fn, spec)
        cache = feed_stream(dec, params, dec.init_cache(), pol, ids, C)
        q = np.pad(ids[:, :5], ((0, 0), (0, C - 5)))
        lg1, cache = dec.feed(params, q, cache, pol, 5)
        choice1 = np.asarray(cache.cold.choice)[..., :K]
        lg2, cache = dec.feed(params, np.pad(ids[:, 5:6], ((0, 0), (0, C - 1))), cache, pol, 1)
        outs.append((np.asarray(lg1[:, :5]), choice1, np.asarray(lg2[:, 0]), np.asarray(cache.cold.choice)[..., :K]))
    (a1, c1, a2, c2), (b1, d1, b2, d2) = outs
    assert np.asarray(cache.cold.pos).max() > 8 * cold.page_size, f"seed {seed}: the store should hold > 8 pages"
    # The wide cache sums over more (masked) slots, so float32 rounding differs: logits reach |25| and differ
    # by up to 6e-5 over 100 seeds, while attending one page more than K moves them by about 10.
    np.testing.assert_allclose(b1, a1, rtol=1e-5, atol=5e-4, err_msg=f"seed {seed}")
    np.testing.assert_allclose(b2, a2, rtol=1e-5, atol=5e-4, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(d1, c1, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(d2, c2, err_msg=f"seed {seed}")


def test_tiny_run(tiny, tmp_path):
    apply_fn, params = tiny
    words = np.random.default_rng(3).choice(["the", "night", "was", "cold", "and", "I", "walked", "far"], 2000)
    filler = tmp_path / "filler.txt"
    filler.write_text(" ".join(words) + ".\n")
    model = RecallModel(apply_fn, params, CFG, WordTokenizer(CFG.vocab_size))
    cfg = PC.PageChoiceConfig(str(filler), trials=3, cycles=(1, 6), batch=2,
                              cold=ColdStore(capacity=256, page_size=16), seed=5)
    res = PC.run(cfg, model, show_progress=False)
    K = int(cfg.policy.recall_pages)
    small, big = res["cells"]
    assert small["trials"] == big["trials"] == 3
    assert len(res["ranks"]["6"]) == 3 and all(len(r) == CFG.num_layers for r in res["ranks"]["6"])
    # With at most K pages in the store every page is attended: the fact's page is in every layer's top K.
    assert small["pages"] <= K and small["layers_with_fact_in_top_k"] == 1.0, small
    assert big["pages"] > K  # ... and with more, the ranks are the measurement
    ranks = np.asarray(res["ranks"]["6"])
    assert big["layers_with_fact_in_top_k"] == pytest.approx(float((ranks < K).mean()))
    assert ranks.min() >= 0 and ranks.max() < 256 // 16
    assert "| 6 |" in PC.table(res)
    with pytest.raises(PC.ConfigError):
        PC.PageChoiceConfig(str(filler), policy=cfg.policy.replace(recall_pages=0))


def test_cli_errors():
    assert_one_line_errors([("exp_page_choice.py", ["--reselect", "3"], "--reselect does not apply"),
                            ("exp_page_choice.py", ["--recall-pages", "0"], "--recall-pages must be >= 1"),
                            ("exp_page_choice.py", ["--recall-neighbors", "1"], "--recall-neighbors must be 0"),
                            ("exp_page_choice.py", ["--cycles", "2,x"], "--cycles must be a comma-separated list"),
                            ("exp_page_choice.py", ["--filler", "/nonexistent.txt"], "filler file not found")])
