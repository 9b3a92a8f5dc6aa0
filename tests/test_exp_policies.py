"""The policy table (rsqr_lab.studies.policy_table): in process on the tiny model (seed tests/tiny_stream.SEED)
— every run, the checks, rescore — and on crafted NLL; one slow smoke run of `scripts/exp_policies.py
--quick --tokens 256 --no-hf --no-bf16` on SmolLM2-135M (~30 s on 2 cores, in this process): rsqr with delta=0 is streamingllm
(docs/design.md §4, equivalence 1) and dropping the attention sinks hurts; the script as its own process on bad
input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rsqr_jax.policy import rsqr
from rsqr_lab.studies import policy_table as policies
from rsqr_jax.eval.runtime import ConfigError
from rsqr_lab.studies.policy_table import PoliciesConfig
from tests.cli import assert_one_line_error, run_in_process, run_script
from rsqr_jax.eval.runtime import read_tokens
from rsqr_lab.testing.oracle import reference_token_sets, stream_logits_f64
from rsqr_jax.models.tiny import tiny_weights
from tests.tiny_stream import CFG, SEED, load, write_text

KEYS = {"full/float32", "window/float32", "streamingllm/float32", "rsqr_delta0/float32", "rsqr/float32",
        "rerotate/float32"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    text = write_text(tmp_path_factory.mktemp("text") / "t.txt")
    config = PoliciesConfig(text, tokens=96, policy=rsqr(16, 2, 4, 8), segment=32, full_chunk=32, hf=False)
    return config, policies.run(config, load, show_progress=False)


@pytest.mark.slow
def test_tiny_rows_and_checks(tiny_run):
    config, result = tiny_run
    res = result.to_json()
    assert list(res) == ["config", "rows", "checks", "timings", "total_wall_s", "total_cpu_s"]
    assert res["config"]["tokens"] == 96 and res["config"]["window"] == 16 and res["config"]["model"] == load().path
    assert list(res["config"]) == ["text", "tokens", "window", "sinks", "delta", "max_survivors", "block", "overflow",
                                   "quick", "segment", "model"]  # the layout rescore and older results share
    assert {r["key"] for r in res["rows"]} == KEYS | {"rsqr/bfloat16", "rerotate/bfloat16"}
    by = {r["key"]: r for r in res["rows"]}
    for r in res["rows"]:
        assert r["n_scored"] == 95 and math.isfinite(r["ppl"]), r
        assert math.isclose(r["ppl"], math.exp(result.runs[r["key"]]["nll"].mean()))
    assert by["full/float32"]["chunk"] == 32 and by["rsqr/float32"]["chunk"] == 1
    # The table's reference run, rsqr float32, against the float64 rank oracle over the design's token sets (an
    # independent model forward); rerotate float32 computes the same function of the same token set.
    ids = read_tokens(load().tokenizer, config.text, config.tokens)
    sets = reference_token_sets(len(ids), window=16, n_sink=2, delta=4, max_survivors=8, block=1)
    logits = stream_logits_f64(tiny_weights(CFG, SEED), CFG, ids, [c for _, c in sets], "rank")
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    want = -logp[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(result.runs["rsqr/float32"]["nll"], want, atol=2e-4, rtol=0)
    assert by["rerotate/float32"]["mean_abs_dnll_vs_oracle"] < 1e-4
    assert len(by["rerotate/float32"]["excess_nll_after_fill_ci95"]) == 2
    assert by["rsqr/bfloat16"]["mean_abs_dnll_vs_oracle"] > 0  # bfloat16 storage differs
    checks = res["checks"]
    assert set(checks) == {"rsqr_delta0_matches_streamingllm", "window_worse_than_streamingllm",
                           "rerotate_bf16_further_from_oracle_than_rsqr_bf16"}
    delta0 = checks["rsqr_delta0_matches_streamingllm"]
    assert delta0["pass"] and delta0["rel_diff"] < 1e-5
    assert abs(by["rsqr/float32"]["ppl"] / by["streamingllm/float32"]["ppl"] - 1) > 1e-3  # survivors matter
    assert [t["label"] for t in res["timings"]] == ["full f32", "float32", "bfloat16"]
    md = result.markdown()
    assert "| check |" in md and md.count("\n| streamingllm(W=16, N=2) | float32 |") == 1


@pytest.mark.slow
def test_rescore_rebuilds_the_same_tables(tiny_run, tmp_path):
    _, result = tiny_run
    result.write(str(tmp_path))
    for key in result.runs:
        assert np.load(tmp_path / f"nll_{key.replace('/', '_')}.npy").shape == (95,)
    again = policies.rescore(str(tmp_path)).to_json()
    old = json.loads((tmp_path / "exp_policies.json").read_text())
    assert again["config"] == old["config"] and again["timings"] == old["timings"]
    for r, r2 in zip(old["rows"], again["rows"]):
        assert r2["key"] == r["key"] and math.isclose(r2["ppl"], r["ppl"], rel_tol=1e-6), r["key"]
    assert {k: v["pass"] for k, v in again["checks"].items()} == {k: v["pass"] for k, v in old["checks"].items()}
    with pytest.raises(ConfigError, match="--rescore: .* not found"):
        policies.rescore(str(tmp_path / "none"))


def crafted(**nll) -> dict:
    return {k: {"nll": np.asarray(v, np.float64), "dtype": k.split("/")[1], "policy": k.split("/")[0], "name": k,
                "chunk": 1} for k, v in nll.items()}


def test_checks_on_crafted_nll():
    """The checks' arithmetic on NLLs whose answers are known (T=40, W=8: 39 scored, 32 after the fill)."""
    rng = np.random.default_rng(3)
    base = 2 + 0.1 * rng.normal(size=39)
    runs = crafted(**{"full/float32": base - 0.1, "window/float32": base + 1, "streamingllm/float32": base,
                      "rsqr_delta0/float32": base + 1e-5, "rsqr/float32": base - 0.05, "rerotate/float32": base - 0.05,
                      "rsqr/bfloat16": base - 0.04, "rerotate/bfloat16": base + 0.2})
    res = policies.analyze(runs, {"tokens": 40, "window": 8})
    by, checks = {r["key"]: r for r in res["rows"]}, res["checks"]
    assert by["rerotate/float32"]["max_abs_dnll_vs_oracle"] == 0 and "dppl_vs_oracle" not in by["window/float32"]
    assert math.isclose(by["rerotate/bfloat16"]["excess_nll_after_fill"], 0.25)
    assert math.isclose(by["rerotate/bfloat16"]["rel_dppl_vs_oracle"], math.exp(0.25) - 1)
    assert checks["rsqr_delta0_matches_streamingllm"]["pass"]
    sinks = checks["window_worse_than_streamingllm"]
    assert sinks["pass"] and math.isclose(sinks["ratio"], math.e)
    bf = checks["rerotate_bf16_further_from_oracle_than_rsqr_bf16"]
    assert bf["pass"] and bf["rerotate_ppl_effect_significant"]
    assert math.isclose(bf["mean_abs_dnll_rerotate_vs_rsqr_bf16"], 0.24)
    runs["rsqr_delta0/float32"]["nll"] = base + 0.01  # 1% off: streamingllm is no longer matched
    runs["hf/float32"] = {**runs["full/float32"], "dtype": "float32 (torch)", "policy": "hf_reference"}
    res = policies.analyze(runs, {"tokens": 40, "window": 8})
    assert not res["checks"]["rsqr_delta0_matches_streamingllm"]["pass"]
    assert res["checks"]["full_matches_hf"]["pass"] and res["checks"]["full_matches_hf"]["mean_abs_dnll"] == 0


@pytest.mark.parametrize("kw,fragment", [
    (dict(tokens=100, window=64), "must be at least twice the window 64"),
    (dict(segment=0), "must be positive"),
    (dict(full_chunk=100), "--full-chunk must divide --segment"),
])
def test_config_refuses(kw, fragment):
    with pytest.raises(ConfigError, match=fragment):
        PoliciesConfig.make("t.txt", quick=True, **kw)
    assert PoliciesConfig.make("t.txt", quick=True).tokens == 512 and PoliciesConfig.make("t.txt").policy.window == 256
    assert PoliciesConfig.make("t.txt", quick=True).policy.window == 64
    quick = PoliciesConfig.make("t.txt", quick=True, window=32, policy=rsqr(100, 2, 4, 8))
    assert quick.policy.name == "rsqr(W=32, N=2, delta=4, S=8, fifo)"


def test_cli_bad_input_is_one_line(tmp_path):
    """The first case as a real process (exit code 2 from a fresh interpreter), the second in this process."""
    assert_one_line_error(run_script("exp_policies.py", "--quick", "--tokens", "100", "--window", "64"),
                          "must be at least twice the window 64")
    assert_one_line_error(run_in_process("exp_policies.py", "--rescore", str(tmp_path / "none")), "not found")


@pytest.mark.slow
def test_quick_smoke(tmp_path, smollm2_path):
    # 256 of --quick's 512 tokens: the claims below hold from the first eviction on (W=64); the 512-token
    # full-attention figure against the HF reference is tests/test_cli.py's (eval_stream.py, the same scorer).
    proc = run_in_process("exp_policies.py", "--quick", "--tokens", "256", "--no-hf", "--no-bf16", "--no-progress",
                          "--json", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "exp_policies.json").read_text())
    assert json.loads(proc.stdout) == res
    assert res["config"]["quick"] is True and res["config"]["tokens"] == 256 and res["config"]["window"] == 64
    assert {r["key"] for r in res["rows"]} == KEYS
    for r in res["rows"]:
        assert r["n_scored"] == 255 and math.isfinite(r["ppl"]) and 1 < r["ppl"] < 1e4, r
        nll = np.load(tmp_path / f"nll_{r['key'].replace('/', '_')}.npy")
        assert nll.shape == (255,) and abs(math.exp(nll.astype(np.float64).mean()) / r["ppl"] - 1) < 1e-5
    assert "| check |" in (tmp_path / "exp_policies.md").read_text()
    by = {r["key"]: r for r in res["rows"]}
    s, z = by["streamingllm/float32"]["ppl"], by["rsqr_delta0/float32"]["ppl"]
    assert abs(z / s - 1) < 1e-3 and res["checks"]["rsqr_delta0_matches_streamingllm"]["pass"]
    # Survivors change the token set, hence the perplexity: the comparison above is not vacuous.
    assert abs(by["rsqr/float32"]["ppl"] / s - 1) > 1e-3
    assert by["window/float32"]["ppl"] > 1.2 * s and res["checks"]["window_worse_than_streamingllm"]["pass"]
    assert by["full/float32"]["ppl"] < s  # nothing evicted beats any eviction on this text
