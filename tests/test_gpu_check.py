"""scripts/gpu_check.sh: the three phases (gate, correctness, timing) as a CPU dry run at tiny sizes
(interpret=True), the stop at once on a non-GPU backend, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.cli import ENV, REPO, assert_one_line_error


def _sh(*args, out, timeout=300):
    env = {**ENV, "OUT": str(out), "PYTHON": sys.executable}
    env.pop("JAX_PLATFORMS", None)
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)


@pytest.mark.slow
def test_cpu_dry_run_of_the_three_phases(tmp_path):
    proc = _sh("--cpu-dry-run", out=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    got = {p: json.loads((tmp_path / f"{p}.json").read_text()) for p in ("gate", "correctness", "timing")}
    assert all(g["done"] and g["dry_run"] for g in got.values())
    gate = got["gate"]
    assert gate["environment"]["backend"] == "cpu" and gate["variant"] == "default" and gate["pass"]
    assert [a["variant"] for a in gate["attempts"]] == ["default"]
    assert 0 < gate["attempts"][0]["err_kernel_f64"] < gate["attempts"][0]["tol"]
    corr = got["correctness"]
    assert corr["pass"] and corr["variant"] == "default"
    assert [c["case"] for c in corr["cases"]] == ["decode_d128_gqa_bf16"]  # the head_dim-128 GQA case
    assert corr["cases"][0]["D"] == 128 and 0 < corr["cases"][0]["err_kernel_f64"] < 2e-2
    tim = got["timing"]
    assert tim["copy_bandwidth"]["GBps"] > 0
    [row] = tim["rows"]
    assert row["errors"] == {}
    assert set(row["us"]) == {"loop_overhead", "kernel", "kernel_at_splits", "decode_attn_at_splits", "xla_plain",
                              "xla_rsqr"}
    for k, net in row["net_us"].items():  # the loop's own cost subtracted
        assert abs(net - max(row["us"][k] - row["us"]["loop_overhead"], 1e-3)) < 1e-9
    assert set(row["bw_frac_of_copy"]) == set(row["net_us"])
    log = (tmp_path / "gpu_check.log").read_text()
    assert all(f"phase {p} exit status 0" in log for p in ("gate", "correctness", "timing"))


def test_stops_at_once_without_a_gpu_and_bad_input(tmp_path):
    t0 = time.time()
    proc = _sh(out=tmp_path)  # JAX_PLATFORMS=cuda on a machine without one
    assert proc.returncode == 3, proc.stdout[-3000:]
    assert time.time() - t0 < 60
    gate = json.loads((tmp_path / "gate.json").read_text())
    assert gate["not_gpu"] and "attempts" not in gate
    assert not (tmp_path / "correctness.json").exists() and not (tmp_path / "timing.json").exists()
    assert "nothing else runs" in proc.stdout

    bad = _sh("--fast", out=tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--fast" in bad.stderr
    proc = subprocess.run([sys.executable, "-m", "rsqr_lab.devtools.gpu_check", "--phase", "warmup", "--out",
                           str(tmp_path)], capture_output=True, text=True, cwd=REPO, env=ENV, timeout=300)
    assert_one_line_error(proc, "warmup")
