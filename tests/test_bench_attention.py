"""rsqr_lab.studies.kernel_timing in-process: the --quick run's layout and its ratios, and the timed
paths computing what they claim (stream == stream through the contract, ref == xla == the float64 oracle).
Inputs are seeded (config.seed = 0; make_cases below: seed 1)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rsqr_lab.studies import kernel_timing as X
from rsqr_jax.eval.runtime import ConfigError
from rsqr_lab.testing.kernel import oracle_f64, rel_err, rope_inv_freq


@pytest.mark.slow
def test_quick_run_rows_ratios_and_json(tmp_path):
    result = X.run(X.BenchAttentionConfig(quick=True, budget_s=0.01), command="test", log=None)
    Ns, batches, budget = X.BenchAttentionConfig(quick=True, budget_s=0.01).sizes
    assert [(r["batch"], r["N"]) for r in result.rows] == [(b, n) for b in batches for n in Ns] and budget == 0.01
    for r in result.rows:
        assert set(r["ms"]) == set(X.TIME_KEYS) == set(r["cpu_ms"]) and set(X.RATIO_KEYS) <= set(r["ratio"])
        assert r["rounds"] >= 5 and all(v > 0 for v in r["ms"].values())
        np.testing.assert_allclose(r["ratio"]["xla_1/2/plain"], r["ms"]["xla_1/2"] / r["ms"]["plain"])
        np.testing.assert_allclose(r["ratio_cpu"]["stream/xla_1/8"], r["cpu_ms"]["stream"] / r["cpu_ms"]["xla_1/8"])
    path = tmp_path / "bench_attention.json"
    result.write(path)
    doc = json.loads(path.read_text())
    assert set(doc) == {"meta", "rows", "table_md"} and doc["meta"]["command"] == "test"
    assert doc["meta"]["shape"] == {"C": 1, "Hq": 9, "Hkv": 3, "D": 64, "dtype": "float32"}
    assert doc["table_md"].count("| 4 | 2048 |") == 4  # wall, ratios, CPU, CPU ratios
    assert X.load_result(path)["rows"] == doc["rows"]
    before = json.loads(path.read_text())
    before["rows"][0]["ratio_cpu"]["xla_1/2/plain"] = 9.0
    cmp = X.compare_md(before, doc).splitlines()
    r0 = doc["rows"][0]["ratio_cpu"]["xla_1/2/plain"]
    assert len(cmp) == 2 + len(doc["rows"]) and f"9.00 → {r0:.2f}" in cmp[2]  # N < 4k: never bold
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a bench_attention JSON"):
        X.load_result(tmp_path / "bad.json")


def test_timed_paths_compute_the_contract():
    inv = rope_inv_freq(X.D, X.ROPE_BASE)
    cases = X.make_cases(np.random.default_rng(1), 2, 64, X.jitted_paths(inv), inv)
    out = {name: np.asarray(fn(*args), np.float64) for name, (fn, args) in cases.items()}
    assert rel_err(out["stream"], out["stream_c"]) < 1e-5  # cos/sin table == the contract with W = 0
    for f in X.FRACS:
        assert rel_err(out[f"ref_{f}"], out[f"xla_{f}"]) < 1e-5
        assert rel_err(out[f"xla_{f}"], oracle_f64(*cases[f"xla_{f}"][1], inv)) < 1e-4
    assert rel_err(out["stream_c"], oracle_f64(*cases["stream_c"][1], inv)) < 1e-4
    assert rel_err(out["plain"], out["xla_1/8"]) > 1e-2  # a different cache layout: not the same attention


def test_bad_budget():
    with pytest.raises(ConfigError, match="--budget must be > 0"):
        X.run(X.BenchAttentionConfig(budget_s=-1.0), log=None)
