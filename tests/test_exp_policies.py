"""Issue 3 table (`scripts/exp_policies.py --quick --no-hf --no-bf16`, SmolLM2-135M, ~1 min on 2 cores):
rsqr with delta=0 is streamingllm (DESIGN section 4, consequence 1) and dropping the attention sinks hurts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def table(tmp_path_factory, smollm2_path):
    out = tmp_path_factory.mktemp("exp_policies")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "exp_policies.py"), "--quick", "--no-hf",
                           "--no-bf16", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "exp_policies.json").read_text())


def test_shape(table):
    out, res = table
    assert res["config"]["quick"] is True and res["config"]["tokens"] == 512 and res["config"]["window"] == 64
    keys = {r["key"] for r in res["rows"]}
    assert keys == {"full/float32", "window/float32", "streamingllm/float32", "rsqr_delta0/float32", "rsqr/float32",
                    "rerotate/float32"}
    for r in res["rows"]:
        assert r["n_scored"] == 511 and math.isfinite(r["ppl"]) and 1 < r["ppl"] < 1e4, r
        nll = np.load(out / f"nll_{r['key'].replace('/', '_')}.npy")
        assert nll.shape == (511,) and abs(math.exp(nll.astype(np.float64).mean()) / r["ppl"] - 1) < 1e-5
    assert "| check |" in (out / "exp_policies.md").read_text()


def test_rsqr_delta0_is_streamingllm(table):
    _, res = table
    by = {r["key"]: r for r in res["rows"]}
    s, z = by["streamingllm/float32"]["ppl"], by["rsqr_delta0/float32"]["ppl"]
    assert abs(z / s - 1) < 1e-3
    assert res["checks"]["rsqr_delta0_matches_streamingllm"]["pass"]
    # Survivors change the token set, hence the perplexity: the comparison above is not vacuous.
    assert abs(by["rsqr/float32"]["ppl"] / s - 1) > 1e-3


def test_window_worse_than_streamingllm(table):
    _, res = table
    by = {r["key"]: r for r in res["rows"]}
    assert by["window/float32"]["ppl"] > 1.2 * by["streamingllm/float32"]["ppl"]
    assert res["checks"]["window_worse_than_streamingllm"]["pass"]
    # The 512-token full-attention figure of DESIGN section 9 (HF: 38.98).
    assert abs(by["full/float32"]["ppl"] / 38.98 - 1) < 0.005
