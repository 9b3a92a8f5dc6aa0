"""Streaming perplexity per bucket (rsqr_lab.studies.ppl): in process on the tiny model (seed tests/tiny_stream.SEED)
— JSON shape, per-bucket curves, plot, exact policies agreeing, interruption, rescore, merge; one slow smoke
run of `scripts/exp_ppl.py --quick` on SmolLM2-135M (~50 s on 2 cores, in this process) for the sanity
bounds; the script as its own process on bad input."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from rsqr_jax.policy import make_policy
from rsqr_lab.studies import ppl
from rsqr_jax.eval import perplexity as streams
from rsqr_jax.eval.runtime import ConfigError
from rsqr_lab.studies.ppl import PplConfig
from tests.cli import assert_one_line_error, run_in_process, run_script
from tests.tiny_stream import load, write_text

POLICIES = {"full", "window", "streamingllm", "leave_gaps", "rerotate", "rerotate_b8", "rsqr", "rsqr_precompute",
            "replay"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(config, result, out dir) of one tiny grid: 96 tokens, W=16, every policy; replay over 48 tokens."""
    text = write_text(tmp_path_factory.mktemp("text") / "t.txt")
    config = PplConfig(text, tokens=96, windows=(16,), dtypes=("float32",), cell_tokens=(),
                       policy=make_policy("rsqr", n_sink=2, delta=4, max_survivors=8), full_tokens=96, full_chunk=16, replay_tokens=48, replay_block=4, bucket=32,
                       segment=16, piece_segments=2)
    result = ppl.run(config, load, show_progress=False)
    out = tmp_path_factory.mktemp("tiny_ppl")
    result.write(str(out))
    return config, result, out


@pytest.mark.slow
def test_shape_and_curves(tiny):
    config, result, out = tiny
    res = json.loads((out / "exp_ppl.json").read_text())
    assert list(res) == ["cells", "config", "timings", "total_wall_s", "total_cpu_s", "interrupted"]
    assert res["interrupted"] is None and result.interrupted is None
    assert res["config"]["windows"] == [16] and res["config"]["replay_tokens"] == {"16": 48}
    assert list(res["config"]) == ["text", "tokens", "cell_tokens", "windows", "dtypes", "policies", "sinks", "delta",
                                   "max_survivors", "overflow", "full_tokens", "full_chunk", "replay_tokens",
                                   "replay_block", "bucket", "quick"]  # the layout merge and older results share
    assert (res["config"]["sinks"], res["config"]["max_survivors"], res["config"]["overflow"]) == (2, 8, "fifo")
    (cell,) = res["cells"]
    assert cell["window"] == 16 and cell["tokens"] == 96 and set(cell["runs"]) == POLICIES and cell["n_common"] == 47
    for key, r in cell["runs"].items():
        curve = r["curve"]
        assert math.isfinite(r["ppl"]) and len(curve) == math.ceil(r["n_scored"] / 32) and curve[0]["start"] == 0, key
        assert curve[-1]["end"] == r["n_scored"] and all(math.isfinite(p["ppl"]) for p in curve), key
        assert np.load(out / f"nll_W16_float32_{key}.npy").shape == (r["n_scored"],)
    assert cell["runs"]["streamingllm"]["n_scored"] == 95 and cell["runs"]["replay"]["n_scored"] == 47
    assert cell["runs"]["rerotate_b8"]["name"] == "rerotate(W=16, N=2, delta=4, S=8, fifo, b=8)"
    # Same token set, same function (docs/design.md §4): float32 rsqr_precompute and rerotate agree with rsqr.
    for key in ("rsqr_precompute", "rerotate"):
        r = cell["runs"][key]
        assert r["mean_abs_dnll_vs_oracle"] < 1e-4 and r["mean_abs_dnll_vs_rsqr"] < 1e-4, key
        assert abs(r["excess_nll_after_fill"]) < 1e-4 and len(r["excess_nll_per_bucket"]) == len(r["curve"]), key
    assert not {"mean_abs_dnll_vs_oracle"} & (set(cell["runs"]["rsqr"]) | set(cell["runs"]["full"]))
    assert [t["label"] for t in res["timings"]] == ["full float32", "W=16 float32", "replay W=16 float32"]
    png = out / "exp_ppl.png"
    assert png.is_file() and 0 < png.stat().st_size < 200_000
    md = (out / "exp_ppl.md").read_text()
    assert md == result.markdown() and "| streamingllm |" in md and "Per-32-token perplexity" in md
    assert "| replay | " in md and "(n=48)" in md and "first 48 tok" in md


@pytest.mark.slow
def test_interruption_keeps_finished_pieces(tiny, monkeypatch):
    """A KeyboardInterrupt (SIGTERM in the script) in the 2nd piece of the W=16 batch: the cell keeps full
    and the batch's first piece (32 scored tokens), equal to the uninterrupted run's."""
    config, done, _ = tiny
    calls, real = [], streams.stream_nll

    def cut(*args, **kw):
        calls.append(1)
        if len(calls) == 5:  # full: 3 pieces of 32 tokens; the batch: piece 1 done, piece 2 interrupted
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(streams, "stream_nll", cut)
    result = ppl.run(config, load, show_progress=False)
    assert result.interrupted == {"during": "W=16 float32", "scored_tokens": 32}
    (cell,) = result.cells
    assert set(cell["nll"]) == POLICIES - {"replay"}
    full_nll = {k: v for k, v in done.cells[0]["nll"].items()}
    np.testing.assert_array_equal(cell["nll"]["full"], full_nll["full"])
    for key in POLICIES - {"replay", "full"}:
        np.testing.assert_allclose(cell["nll"][key], full_nll[key][:32], rtol=1e-6, atol=1e-6, err_msg=key)
    assert result.data["cells"][0]["n_common"] == 32 and result.data["timings"][-1]["tokens"] == 33
    assert "**Interrupted** during `W=16 float32` after 32 scored tokens" in result.markdown()


@pytest.mark.slow
def test_rescore_rebuilds_the_same_tables(tiny, tmp_path):
    """rescore recomputes every number of the summary from the saved per-token NLL, without the model."""
    _, result, out = tiny
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / "exp_ppl.md").unlink()
    (copy / "exp_ppl.png").unlink()
    again = ppl.rescore(str(copy))
    again.write(str(copy))
    for key, r in result.data["cells"][0]["runs"].items():
        r2 = again.data["cells"][0]["runs"][key]
        assert r2["n_scored"] == r["n_scored"] and math.isclose(r2["ppl"], r["ppl"], rel_tol=1e-6), key
        assert [p["ppl"] for p in r2["curve"]] == pytest.approx([p["ppl"] for p in r["curve"]], rel=1e-6)
    assert again.data["config"] == json.loads((out / "exp_ppl.json").read_text())["config"]
    assert (copy / "exp_ppl.md").read_text() == (out / "exp_ppl.md").read_text() and (copy / "exp_ppl.png").is_file()
    with pytest.raises(ConfigError, match="--rescore: .* not found"):
        ppl.rescore(str(tmp_path / "no"))


def relabel(src: Path, window: int, **config) -> dict:
    """src's cell relabelled as another window (files renamed), config entries overridden."""
    data = json.loads((src / "exp_ppl.json").read_text())
    cell = data["cells"][0]
    for k in cell["runs"]:
        (src / f"nll_W{cell['window']}_{cell['dtype']}_{k}.npy").rename(src / f"nll_W{window}_{cell['dtype']}_{k}.npy")
    for t in data["timings"]:
        t["label"] = t["label"].replace(f"W={cell['window']}", f"W={window}")
    cell["window"], data["config"]["windows"] = window, [window]
    data["config"].update(config)
    (src / "exp_ppl.json").write_text(json.dumps(data))
    return data


@pytest.mark.slow
def test_merge_adds_a_separately_run_cell(tiny, tmp_path):
    """merge(DIR, [SRC]) then rescore(DIR): one table from two runs; a cell DIR already has is refused, and
    so is a run with other cell-defining settings."""
    _, result, out = tiny
    dst, src, other = tmp_path / "dst", tmp_path / "src", tmp_path / "other"
    for d in (dst, src, other):
        shutil.copytree(out, d)
    text = Path(json.loads((out / "exp_ppl.json").read_text())["config"]["text"])
    (tmp_path / "link.txt").symlink_to(text)  # SRC names the same text by another path: still one text
    relabel(src, 24, text=str(tmp_path / "link.txt"))
    relabel(other, 32, sinks=3)
    wall = result.data["total_wall_s"]
    full_wall = next(t["wall_s"] for t in result.data["timings"] if t["label"] == "full float32")
    # DIR's interrupted attempt at the cell SRC ran is replaced by SRC's timing.
    data = json.loads((dst / "exp_ppl.json").read_text())
    data["timings"].append({"label": "W=24 float32", "policies": ["rsqr"], "tokens": 10, "wall_s": 5.0, "cpu_s": 1.0})
    data["total_wall_s"] += 5.0
    data["interrupted"] = {"during": "W=24 float32", "scored_tokens": 9}
    (dst / "exp_ppl.json").write_text(json.dumps(data))

    ppl.merge(str(dst), [str(src)])
    merged = ppl.rescore(str(dst))
    merged.write(str(dst))
    m = json.loads((dst / "exp_ppl.json").read_text())
    assert [c["window"] for c in m["cells"]] == [16, 24] and m["config"]["windows"] == [16, 24]
    assert m["config"]["merged_from"] == [os.path.abspath(src)] and m["interrupted"] is None
    # SRC's labels replace DIR's: "full float32" too (both ran it), so DIR's full timing goes.
    assert [t["label"] for t in m["timings"]] == ["W=16 float32", "replay W=16 float32", "full float32",
                                                 "W=24 float32", "replay W=24 float32"]
    assert math.isclose(m["total_wall_s"], 2 * wall - full_wall)
    for key, r in result.data["cells"][0]["runs"].items():
        assert math.isclose(m["cells"][1]["runs"][key]["ppl"], r["ppl"], rel_tol=1e-6), key
    assert "W=24 float32" in (dst / "exp_ppl.md").read_text()
    with pytest.raises(ConfigError, match="already has the cell W=24 float32"):
        ppl.merge(str(dst), [str(src)])
    with pytest.raises(ConfigError, match="was run with sinks=3"):
        ppl.merge(str(dst), [str(other)])
    with pytest.raises(ConfigError, match="--merge: .* not found"):
        ppl.merge(str(dst), [str(tmp_path / "none")])


def test_config_defaults_and_refusals():
    quick, plain = PplConfig.make("t.txt", quick=True), PplConfig.make("t.txt")
    assert (quick.tokens, quick.windows, quick.dtypes, quick.cell_tokens, quick.bucket, quick.replay_block) == \
        (512, (64,), ("float32",), (), 128, 16)
    assert quick.replay_T(64, 512) == 160 and plain.replay_T(256, 4096) == 768
    assert plain.cell_T(1024, "bfloat16") == 1536 and plain.cell_T(256, "float32") == 4096
    assert PplConfig.make("t.txt", tokens=2000).cell_tokens == ()  # --tokens alone: no per-cell overrides
    assert PplConfig.make("t.txt", tokens=100).full_tokens == 100
    for kw, fragment in [(dict(dtypes=["float16"]), "--dtypes: choose from"),
                         (dict(policies=("rsqr", "sinkcache")), "--policies: unknown sinkcache"),
                         (dict(bf16_policies=()), r"--bf16-policies: unknown \(none\)"),
                         (dict(tokens=1), "token counts must be >= 2"),
                         (dict(cell_tokens={(64, "float32"): 1}), "token counts must be >= 2"),
                         (dict(full_chunk=100), "--full-chunk must divide --segment")]:
        with pytest.raises(ConfigError, match=fragment):
            PplConfig.make("t.txt", quick=True, **kw)
    with pytest.raises(dataclasses.FrozenInstanceError):
        quick.tokens = 3


def test_recall_arm_rides_in_the_vmapped_cell(tmp_path):
    """rsqr_recall (named, not in the default grid) shares the cell's vmapped stream; with a cold store that
    keeps every evicted token and every page recalled it equals full (docs/design.md §3b), unlike plain rsqr."""
    from rsqr_jax.spec import ColdStore

    text = write_text(tmp_path / "t.txt")
    config = PplConfig(text, tokens=64, windows=(16,), dtypes=("float32",), cell_tokens=(),
                       policy=make_policy("rsqr", n_sink=2, delta=4, max_survivors=4), full_tokens=64, full_chunk=16, bucket=32, segment=16,
                       policies=("full", "rsqr", "rsqr_recall"), recall_pages=16, cold=ColdStore(64, 4))
    assert "rsqr_recall" not in PplConfig("t.txt").policies
    result = ppl.run(config, load, show_progress=False)
    (cell,) = result.cells
    assert [t["label"] for t in result.data["timings"]] == ["full float32", "W=16 float32"]
    np.testing.assert_allclose(cell["nll"]["rsqr_recall"], cell["nll"]["full"], atol=5e-5, rtol=0)
    assert np.abs(cell["nll"]["rsqr"] - cell["nll"]["full"]).max() > 0.05
    assert result.data["config"]["cold"]["capacity"] == 64


def test_cli_errors_are_one_line(tmp_path):
    """The first case as a real process (exit code 2 from a fresh interpreter); the others in this process
    (tests/cli.py run_in_process), as is the slow --quick run below."""
    assert_one_line_error(run_script("exp_ppl.py", "--rescore", str(tmp_path / "no")), "not found")
    for args, fragment in [(["--merge", str(tmp_path)], "--merge needs --rescore"),
                           (["--windows", "64,x"], "--windows: expected comma-separated integers"),
                           (["--cell-tokens", "64=3"], "--cell-tokens: bad term")]:
        assert_one_line_error(run_in_process("exp_ppl.py", *args), fragment)


# The real-model smoke runs the policies its sanity bounds name (one vmapped cell of five and full); the
# others (leave_gaps, rerotate_b8, replay) are the tiny grid's, with the same code path per cell.
SMOKE_POLICIES = ("full", "window", "streamingllm", "rsqr", "rsqr_precompute", "rerotate")


@pytest.mark.slow
def test_quick_smoke(tmp_path, smollm2_path):
    proc = run_in_process("exp_ppl.py", "--quick", "--policies", ",".join(SMOKE_POLICIES), "--no-progress", "--json",
                          "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "exp_ppl.json").read_text())
    assert json.loads(proc.stdout) == res
    cfg = res["config"]
    assert cfg["quick"] is True and cfg["windows"] == [64] and cfg["dtypes"] == ["float32"]
    (cell,) = res["cells"]
    assert cell["window"] == 64 and cell["dtype"] == "float32" and cell["tokens"] == 512
    assert set(cell["runs"]) == set(SMOKE_POLICIES)
    runs = cell["runs"]
    for key, r in runs.items():
        assert math.isfinite(r["ppl"]) and 1 < r["ppl"] < 1e4, key
        assert len(r["curve"]) == math.ceil(r["n_scored"] / cfg["bucket"]) and r["curve"][-1]["end"] == r["n_scored"]
    assert runs["streamingllm"]["n_scored"] == 511
    assert (tmp_path / "exp_ppl.png").is_file() and "Per-128-token perplexity" in (tmp_path / "exp_ppl.md").read_text()
    # Attention sinks: dropping the first tokens costs a lot (StreamingLLM's observation).
    assert runs["streamingllm"]["ppl"] < runs["window"]["ppl"]
    assert all(s["ppl"] < w["ppl"] for s, w in zip(runs["streamingllm"]["curve"], runs["window"]["curve"]))
    # Same token set, same function (docs/design.md §4): float32 rsqr_precompute and rerotate agree with rsqr.
    for key in ("rsqr_precompute", "rerotate"):
        assert runs[key]["mean_abs_dnll_vs_oracle"] < 1e-3 and abs(runs[key]["rel_dppl_vs_oracle"]) < 1e-3, key
        lo, hi = runs[key]["excess_nll_after_fill_ci95"]
        assert abs(runs[key]["excess_nll_after_fill"]) < 1e-3 and lo <= runs[key]["excess_nll_after_fill"] <= hi, key
    # Full attention sees every token: no bounded policy does better on this text.
    assert runs["full"]["ppl"] <= min(r["ppl"] for k, r in runs.items() if k != "full") * 1.001
    # The 512-token full-attention figure of the HF transformers reference (38.98).
    assert abs(runs["full"]["ppl"] / 38.98 - 1) < 0.005
