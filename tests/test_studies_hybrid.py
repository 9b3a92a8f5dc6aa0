"""Studies on a hybrid local/global model (a tiny random Gemma 2, tests/family_fixtures.py): their caches come
from the model config, so the local layers get their rings and a study runs as on any other model."""

from __future__ import annotations

import numpy as np
import pytest

from rsqr_jax import policy as P
from tests import family_fixtures as F

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """(loaded model, apply_fn, params, filler text path) of the tiny Gemma 2 (local window 24 on every other
    layer) and a seeded filler text of its tokenizer's characters."""
    pytest.importorskip("torch")
    from rsqr_jax.models.llama import load_model, split_apply

    root = tmp_path_factory.mktemp("gemma2")
    loaded = load_model(str(F.save_hf_model(F.FAMILY_SPECS["gemma2"], root / "model")))
    assert loaded.config.local_layers > 0  # hybrid: the test is about the local layers' rings
    words = np.random.default_rng(5).choice(["ash", "elm", "oak", "yew", "fir"], 200)
    (root / "filler.txt").write_text(" ".join(words) + ".\n")
    return (loaded, *split_apply(loaded.model), str(root / "filler.txt"))


@pytest.mark.slow
def test_fact_probe_and_recall_study_run_on_gemma2(gemma2, tmp_path):
    """The fact probe (Sessions, with the recall tier) and the recall study (--quick-sized: batched streams;
    replay is not defined for hybrid models) run past the local window: the fact has left the local rings and
    the policies' windows, and every arm answers."""
    from rsqr_jax.spec import ColdStore
    from rsqr_lab.studies import fact_probe, recall_probe

    loaded, apply_fn, params, filler = gemma2
    cfg = fact_probe.FactConfig(filler, trials=2, n_filler=60, arms=("rsqr", "rsqr_recall"), policy=P.rsqr(16, 2, 3, 4),
                                recall_pages=2, cold=ColdStore(64, 4), prefill_chunk=8, gen_tokens=3)
    res = fact_probe.run(cfg, apply_fn, params, loaded.config, loaded.tokenizer, show_progress=False)
    assert [r["arm"] for r in res["records"]] == ["rsqr", "rsqr_recall"] * 2
    assert all(r["prompt_tokens"] > 60 > 24 for r in res["records"])  # past the local window and the policy's

    facts = tmp_path / "facts.txt"  # names of one length: every trial's prefix is as long (one batch)
    facts.write_text("Ada 1234567\nBob 7654321\n")
    study = recall_probe.make_config(  # not --quick: its one spec for every arm would hold replay
        filler, trials=2, batch=2, gen_tokens=3, cycles=[4], dtypes=["float32"], facts=str(facts),
        variants=["unprotected"], arms=["streamingllm", "rsqr_cap"], unprotected_arms=["streamingllm", "rsqr_cap"],
        policy=P.make_policy("rsqr", window=32, delta=8, max_survivors=8, block=32))  # the question: 27 tokens
    models = {"float32": recall_probe.RecallModel(apply_fn, params, loaded.config, loaded.tokenizer)}
    out = recall_probe.run(study, models, tmp_path / "recall", show_progress=False)
    assert out.complete and [s["arm"] for s in out.data["summary"]] == ["streamingllm", "rsqr_cap"]
    for layout in out.data["layout"]:  # the digits have left the window (and the local rings): sinks are 4
        assert layout["facts"][0]["digits"]["window"] == 0 and layout["facts"][0]["digits"]["sink"] == 0, layout
