"""rsqr_lab.devtools.compile_report (the H200 compile check, scripts/gpu_compile_check.sh).

The report itself needs the Python 3.12 venv with jax 0.11.2 and pip Triton. CI (.ci/run) runs the check
before the suite and points RSQR_COMPILE_REPORT at its JSON: the last test checks that report instead of
compiling again. Locally it compiles one configuration when the venv exists (RSQR_H200_VENV or
.venv-h200), else it is skipped (a skip, not a pass)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rsqr_lab.devtools import compile_report as cr

ROOT = Path(__file__).resolve().parents[1]

# ptxas -v output of one entry function, as ptxas 12.8 prints it (shape of the text, numbers invented)
PTXAS_LOG = """ptxas info    : 35 bytes gmem
ptxas info    : Compiling entry function 'survivor_attention' for 'sm_90a'
ptxas info    : Function properties for survivor_attention
    272 bytes stack frame, 304 bytes spill stores, 312 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 272 bytes cumulative stack size
ptxas info    : Compile time = 550.008 ms
"""


def test_parse_occupancy_gate_and_bad_input(capsys):
    got = cr.parse_ptxas(PTXAS_LOG)
    assert (got["registers"], got["spill_store_bytes"], got["spill_load_bytes"], got["stack_bytes"]) == (255, 304, 312,
                                                                                                          272)
    assert got["spill_bytes"] == 616
    with pytest.raises(ValueError):
        cr.parse_ptxas("ptxas info    : 35 bytes gmem")
    # CUDA occupancy by hand: 237 regs -> 240 per thread -> 7680 per warp -> 8 warps of 64K -> 2 blocks of 4 warps;
    # 96 regs -> 3072 per warp -> 21 warps -> 5 blocks; 45056 B shared + 1 KiB -> 5 blocks of 228 KiB.
    assert cr.occupancy(237, 4, 0)["programs_per_sm"] == 2
    assert cr.occupancy(96, 4, 24576)["by_registers"] == 5
    assert cr.occupancy(64, 4, 45056)["by_shared"] == 5
    assert cr.occupancy(64, 4, 45056)["programs_per_sm"] == 5
    assert cr.occupancy(32, 8, 0)["programs_per_sm"] == 8  # warps limit: 64 / 8

    ok = {"spill_bytes": 0, "spill_store_bytes": 0, "spill_load_bytes": 0}
    rows = [{"name": "a", **ok}, {"name": "b", **ok, "spill_bytes": 8, "spill_store_bytes": 4, "spill_load_bytes": 4},
            {"name": "c", "error": "RuntimeError: boom\ntraceback"}]
    assert cr.gate(rows, ("a",)) == []
    assert [p.split(":")[0] for p in cr.gate(rows, ("a", "b", "c", "d"))] == ["b", "c", "d"]
    assert set(cr.DEFAULT) <= set(cr.CONFIG_BY_NAME)
    assert {"smollm_decode_bf16", "smollm_decode_f32", "smollm_chunk_bf16", "smollm_chunk_f32",
            "gqa_d128_decode_bf16"} == set(cr.DEFAULT)

    assert cr.main(["--only", "smollm_decode_bf16,nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nope" in err


def _report() -> dict:
    """CI's report (RSQR_COMPILE_REPORT), else one configuration compiled now in the H200 venv."""
    path = os.environ.get("RSQR_COMPILE_REPORT")
    if path:
        assert Path(path).is_file(), f"RSQR_COMPILE_REPORT={path} does not exist: the compile check did not run"
        return json.loads(Path(path).read_text())
    venv = Path(os.environ.get("RSQR_H200_VENV", ROOT / ".venv-h200"))
    if not (venv / "bin" / "python").exists() or not list(venv.glob(".rsqr-h200-*")):
        pytest.skip("no H200 compile venv here (bash scripts/gpu_compile_check.sh builds it; CI runs it)")
    res = subprocess.run([str(venv / "bin" / "python"), "-m", "rsqr_lab.devtools.compile_report",
                          "--only", "window_only_bf16", "--json"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'lab'}", "JAX_PLATFORMS": "cpu"},
                         timeout=300)
    assert res.returncode in (0, 1), res.stderr[-2000:]
    return json.loads(res.stdout)


def test_compile_report_is_consistent():
    """The report's rows are real ptxas numbers for sm_90a under jax 0.11, and its verdict follows its rows."""
    report = _report()
    assert report["meta"]["jax"].startswith("0.11") and report["meta"]["device_kind"] == "NVIDIA H200"
    rows = report["rows"]
    assert rows
    for r in rows:
        assert "error" not in r, r["error"]
        assert r["arch"] == "sm_90a"
        assert 1 <= r["registers"] <= 255 and r["shared_bytes"] > 0 and r["programs"] > 0
        assert r["spill_bytes"] == r["spill_store_bytes"] + r["spill_load_bytes"]
        assert r["occupancy"] == cr.occupancy(r["registers"], r["num_warps"], r["shared_bytes"])
    names = [r["name"] for r in rows]
    assert report["problems"] == cr.gate(rows, tuple(n for n in cr.DEFAULT if n in names))
    # The verdict from the rows themselves: no compiled default configuration spills.
    assert report["pass"] == all(r["spill_bytes"] == 0 for r in rows if r["name"] in cr.DEFAULT)
    if os.environ.get("RSQR_COMPILE_REPORT"):
        assert set(cr.DEFAULT) <= set(names), "CI's compile check must cover every default configuration"
    print(report.get("table_md") or cr.table(rows), file=sys.stderr)
