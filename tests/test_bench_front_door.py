"""bench_front_door --quick on the embedded model: decode.py's defaults and rsqr_jax.load().chat() give the same
greedy reply (the script exits non-zero otherwise); no timing threshold (the measured run is in docs/chat.md)."""

from __future__ import annotations

import json
import math

import pytest

from tests.cli import run_script as run


@pytest.mark.slow
def test_decode_and_the_front_door_give_the_same_greedy_reply(smollm2_path, tmp_path):
    proc = run("bench_front_door.py", "--quick", "--json", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["same_replies"] and len(result["replies"]["decode.py"]) == 1
    assert result["replies"]["decode.py"][0].strip()  # a real reply, not two empty ones
    assert all(math.isfinite(v) and v > 0 for v in result["median_ms"].values())
    assert json.loads((tmp_path / "front_door.json").read_text()) == result
