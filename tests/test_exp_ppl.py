"""Issue 6 section 3 (`scripts/exp_ppl.py --quick`, SmolLM2-135M, ~1.5 min on 2 cores): JSON shape, per-bucket
curves, plot, and sanity bounds (finite perplexities, the attention-sink effect, exact policies agreeing)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

POLICIES = {"full", "window", "streamingllm", "leave_gaps", "rerotate", "rerotate_b8", "rsqr", "rsqr_precompute",
            "replay"}


@pytest.fixture(scope="module")
def ppl_run(tmp_path_factory, smollm2_path):
    out = tmp_path_factory.mktemp("exp_ppl")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "exp_ppl.py"), "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "exp_ppl.json").read_text())


def test_shape_and_curves(ppl_run):
    out, res = ppl_run
    assert set(res) >= {"config", "cells", "timings", "total_wall_s", "total_cpu_s"}
    cfg = res["config"]
    assert cfg["quick"] is True and cfg["windows"] == [64] and cfg["dtypes"] == ["float32"]
    (cell,) = res["cells"]
    assert cell["window"] == 64 and cell["dtype"] == "float32" and cell["tokens"] == 512
    assert set(cell["runs"]) == POLICIES
    bucket = cfg["bucket"]
    for key, r in cell["runs"].items():
        assert math.isfinite(r["ppl"]) and 1 < r["ppl"] < 1e4, key
        curve = r["curve"]
        assert len(curve) == math.ceil(r["n_scored"] / bucket) and curve[0]["start"] == 0, key
        assert curve[-1]["end"] == r["n_scored"], key
        assert all(math.isfinite(p["ppl"]) and p["ppl"] > 1 for p in curve), key
    assert cell["runs"]["streamingllm"]["n_scored"] == 511 and len(cell["runs"]["streamingllm"]["curve"]) == 4
    assert cell["runs"]["replay"]["n_scored"] == cfg["replay_tokens"]["64"] - 1 < 511
    png = out / "exp_ppl.png"
    assert png.is_file() and 0 < png.stat().st_size < 200_000
    md = (out / "exp_ppl.md").read_text()
    assert "| streamingllm |" in md and "Per-128-token perplexity" in md


def test_sanity_bounds(ppl_run):
    _, res = ppl_run
    runs = res["cells"][0]["runs"]
    # Attention sinks: dropping the first tokens costs a lot (StreamingLLM's observation).
    assert runs["streamingllm"]["ppl"] < runs["window"]["ppl"]
    assert all(s["ppl"] < w["ppl"] for s, w in zip(runs["streamingllm"]["curve"], runs["window"]["curve"]))
    # Same token set, same function (DESIGN section 4): float32 rsqr_precompute and rerotate agree with rsqr.
    for key in ("rsqr_precompute", "rerotate"):
        assert runs[key]["mean_abs_dnll_vs_oracle"] < 1e-3, key
        assert abs(runs[key]["rel_dppl_vs_oracle"]) < 1e-3, key
        lo, hi = runs[key]["excess_nll_after_fill_ci95"]
        assert abs(runs[key]["excess_nll_after_fill"]) < 1e-3 and lo <= runs[key]["excess_nll_after_fill"] <= hi, key
        assert len(runs[key]["excess_nll_per_bucket"]) == len(runs[key]["curve"]), key
    # Full attention sees every token: no bounded policy does better on this text (replay scores a shorter prefix).
    assert runs["full"]["ppl"] <= min(r["ppl"] for k, r in runs.items() if k not in ("full", "replay")) * 1.001


def test_rescore_rebuilds_the_same_tables(ppl_run, tmp_path):
    """--rescore recomputes every number of the summary from the saved per-token NLL, without the model."""
    import shutil

    out, res = ppl_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / "exp_ppl.md").unlink()
    (copy / "exp_ppl.png").unlink()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "exp_ppl.py"), "--rescore", str(copy)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads((copy / "exp_ppl.json").read_text())
    for key, r in res["cells"][0]["runs"].items():
        r2 = again["cells"][0]["runs"][key]
        assert r2["n_scored"] == r["n_scored"] and math.isclose(r2["ppl"], r["ppl"], rel_tol=1e-6), key
        assert [p["ppl"] for p in r2["curve"]] == pytest.approx([p["ppl"] for p in r["curve"]], rel=1e-6)
    assert (copy / "exp_ppl.md").read_text() == (out / "exp_ppl.md").read_text()
    assert (copy / "exp_ppl.png").is_file()
    missing = subprocess.run([sys.executable, str(ROOT / "scripts" / "exp_ppl.py"), "--rescore", str(tmp_path / "no")],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "not found" in missing.stderr and "Traceback" not in missing.stderr


def test_merge_adds_a_separately_run_cell(ppl_run, tmp_path):
    """--rescore DIR --merge SRC: one table from two runs (a cell run later); a cell DIR already has is refused."""
    import shutil

    out, res = ppl_run
    dst, src = tmp_path / "dst", tmp_path / "src"
    shutil.copytree(out, dst)
    shutil.copytree(out, src)
    data = json.loads((src / "exp_ppl.json").read_text())  # the same cell relabelled as another window
    cell = data["cells"][0]
    for k in cell["runs"]:
        (src / f"nll_W{cell['window']}_{cell['dtype']}_{k}.npy").rename(src / f"nll_W96_{cell['dtype']}_{k}.npy")
    cell["window"], data["config"]["windows"] = 96, [96]
    (src / "exp_ppl.json").write_text(json.dumps(data))

    def run(*args):
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "exp_ppl.py"), *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)

    proc = run("--rescore", str(dst), "--merge", str(src))
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = json.loads((dst / "exp_ppl.json").read_text())
    assert [c["window"] for c in merged["cells"]] == [64, 96] and merged["config"]["windows"] == [64, 96]
    for key, r in res["cells"][0]["runs"].items():
        assert math.isclose(merged["cells"][1]["runs"][key]["ppl"], r["ppl"], rel_tol=1e-9), key
    assert "W=96 float32" in (dst / "exp_ppl.md").read_text()
    again = run("--rescore", str(dst), "--merge", str(src))
    assert again.returncode == 2 and "already has the cell W=96 float32" in again.stderr, again.stderr
    alone = run("--merge", str(src))
    assert alone.returncode == 2 and "--merge needs --rescore" in alone.stderr and "Traceback" not in alone.stderr
