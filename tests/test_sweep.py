"""Vectorized policy sweeps (rsqr_jax.sweep) on a tiny random model: vmapped == alone, one compilation,
sharded == unsharded (4 simulated CPU devices in a subprocess, also through rsqr_lab.studies.policy_sweep),
grid parsing; the sweep and bench_sweep experiments in-process; the command lines' bad-input contract."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from rsqr_jax.models.llama import Llama, split_apply
from rsqr_jax import policy as P
from rsqr_jax.spec import CacheSpec
from rsqr_jax.engine import stream_nll
from rsqr_jax.sweep import policy_grid, summarize, sweep_nll
from rsqr_jax.models.tiny import tiny_config, tiny_weights
from tests.cli import assert_one_line_error, run_in_process, run_scripts, xla_env

CFG = tiny_config()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every mode; rsqr/rerotate/leave_gaps/rsqr_precompute/replay 6 each, streamingllm and window collapse
# the delta axis (3 each), full collapses everything (1): 37 policies, not a multiple of 4 devices.
GRID = ("mode=rsqr,rerotate,leave_gaps,streamingllm,rsqr_precompute,replay,window,full "
        "window=6,8,10 sinks=2 delta=2,3 max_survivors=3")
T, SEGMENT = 40, 16  # 39 scored tokens -> 3 segments (the last one padded)
TOKENS = np.random.default_rng(3).integers(0, CFG.vocab_size, size=(2, T)).astype(np.int32)


@functools.lru_cache(maxsize=None)
def _model():
    return split_apply(Llama(CFG, tiny_weights(CFG, 0), dtype=jnp.float32))


@functools.lru_cache(maxsize=None)
def _grid_run():
    """The vmapped sweep of GRID, with the number of apply_fn traces seen after each segment."""
    apply_fn, params = _model()
    traces = []

    def counting_apply(*args):  # a fresh function: its own jitted runner, so traces start at zero
        traces.append(1)
        return apply_fn(*args)

    after = []
    pols, names = policy_grid(GRID)
    nll = sweep_nll(counting_apply, params, TOKENS, pols, config=CFG, segment=SEGMENT,
                    progress=lambda n: after.append(len(traces)))
    return pols, names, nll, after


def test_grid_of_every_mode_compiles_once_and_runs():
    pols, names, nll, after = _grid_run()
    assert len(names) == 37 and len(set(names)) == 37
    assert {P.MODES[m] for m in np.asarray(pols.mode)} == set(P.MODES)
    assert nll.shape == (37, 2, T - 1) and np.isfinite(nll).all()
    # One trace of the segment function (apply_fn is traced a fixed number of times inside it: the
    # normal step and replay's consolidation), then no retrace for the remaining segments.
    assert len(after) == 3 and after[0] > 0 and after == [after[0]] * 3


@pytest.mark.parametrize("mode", P.MODES)
def test_each_policy_of_a_vmapped_sweep_equals_the_policy_run_alone(mode):
    pols, names, nll, _ = _grid_run()
    apply_fn, params = _model()
    idx = [i for i, m in enumerate(np.asarray(pols.mode)) if P.MODES[m] == mode]
    one = P.unstack_policies(pols)[idx[-1]]
    # The sweep's union capacity (one compilation for every mode); rsqr also with its own, smaller capacity.
    spec = CacheSpec.for_policies(one if mode == "rsqr" else pols, num_layers=CFG.num_layers,
                                  num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim, batch=2, max_len=T)
    alone, _ = stream_nll(apply_fn, params, TOKENS, one, spec, segment=SEGMENT)
    np.testing.assert_allclose(nll[idx[-1]], alone, rtol=1e-5, atol=1e-5, err_msg=names[idx[-1]])


_CHILD = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as PS
    from rsqr_jax.models.llama import Llama, split_apply
    from rsqr_jax.sweep import make_mesh, policy_grid, sweep_nll
    from rsqr_jax.models.tiny import tiny_config, tiny_weights
    assert jax.device_count() == 4, jax.devices()
    cfg = tiny_config()
    apply_fn, params = split_apply(Llama(cfg, tiny_weights(cfg, 0), dtype=jnp.float32))
    tokens = np.load({tokens!r})
    pols, names = policy_grid({grid!r})
    out = {{}}
    for p_dev, b_dev in ((4, 1), (2, 2)):
        nll, cache = sweep_nll(apply_fn, params, tokens, pols, config=cfg, segment={segment},
                               mesh=make_mesh(4, batch_devices=b_dev), return_cache=True)
        sh = cache.win_k.sharding  # equivalent, not equal: a size-1 mesh axis may be dropped from the spec
        want = NamedSharding(sh.mesh, PS("policy", None, "batch"))
        assert len(sh.device_set) == 4 and sh.is_equivalent_to(want, cache.win_k.ndim), sh
        assert cache.win_k.shape[0] == -(-len(names) // p_dev) * p_dev and len(cache.win_k.addressable_shards) == 4
        out[f"nll_{{p_dev}}x{{b_dev}}"] = nll
    # The experiment module over the same 4 devices (its own mesh: 4 x 1, the policy axis padded 5 -> 8).
    from rsqr_lab.studies import policy_sweep as SX
    res = SX.run(SX.SweepConfig(**{experiment!r}, devices=4), apply_fn, params, cfg)
    assert res.meta["devices"] == 4
    out["experiment"] = res.nll_PxT
    np.savez({out!r}, **out)
""")


@pytest.mark.slow
def test_sharded_sweep_over_4_devices_equals_unsharded(tmp_path):
    _, _, nll, _ = _grid_run()
    np.save(tmp_path / "tokens.npy", TOKENS)
    out = tmp_path / "sharded.npz"
    config, result = _experiment_run()
    experiment = {k: v for k, v in dataclasses.asdict(config).items() if k != "devices"}
    code = _CHILD.format(tokens=str(tmp_path / "tokens.npy"), grid=GRID, segment=SEGMENT, out=str(out),
                         experiment=experiment)
    xla = xla_env()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **xla,
           "XLA_FLAGS": f"{xla['XLA_FLAGS']} --xla_force_host_platform_device_count=4".strip()}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = np.load(out)
    # Not bitwise: each device multiplies a different number of policy rows, so CPU matmul blocking differs.
    np.testing.assert_allclose(got["nll_4x1"], nll, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got["nll_2x2"], nll, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got["experiment"], result.nll_PxT, rtol=1e-5, atol=1e-4)


def test_policy_grid_product_dedup_and_names():
    pols, names = policy_grid("mode=rsqr,streamingllm,window,full window=128,256 delta=4,8,16")
    # rsqr: 2 x 3; streamingllm and window ignore delta: 2 each; full: 1.
    assert len(names) == 6 + 2 + 2 + 1 == len(set(names)) == P.policy_size(pols)
    assert names[0] == P.rsqr(128, 4, 4).name == "rsqr(W=128, N=4, delta=4, S=64, fifo)" and names[-1] == "full"
    assert "streamingllm(W=256, N=4)" in names and "window(W=128)" in names
    d_pols, d_names = policy_grid({"mode": ["rsqr", "streamingllm", "window", "full"], "window": [128, 256],
                                   "delta": [4, 8, 16]})
    assert d_names == names and d_pols.host() == pols.host()
    _, names = policy_grid("mode=rsqr sinks=0,4 max_survivors=8 block=1,4 overflow=fifo,decimate delta=2")
    assert len(names) == 8 and len(set(names)) == 8
    # Two different policies with the same Policy.name (window's name omits the block) stay distinguishable.
    _, names = policy_grid("mode=window window=8 block=1,2")
    assert len(set(names)) == 2


@pytest.mark.parametrize("grid, match", [
    ("mode=rsqr windw=8", "unknown grid key"),
    ("mode=rsqr,sink_cache", "unknown policy"),
    ("mode=rsqr window=8,x", "not an integer"),
    ("window=8", "needs mode"),
    ("mode=rsqr window", "expected key=v1,v2"),
    ("mode=rsqr window=", "no values"),
    ("mode=rsqr window=0", "window must be >= 1"),
    ("mode=rsqr overflow=lifo", "overflow"),
    ("mode=rsqr mode=full", "given twice"),
])
def test_policy_grid_errors(grid, match):
    with pytest.raises(P.PolicyError, match=match):
        policy_grid(grid)


def test_summarize_curve():
    nll = np.log(np.array([[[2.0] * 5 + [4.0] * 5]]))  # [P=1, B=1, 10]
    (row,) = summarize(nll, ["a"], tokens_per_bucket=4)
    assert row["bucket_end"] == [4, 8, 10] and row["tokens"] == 10
    np.testing.assert_allclose(row["ppl_curve"], [2.0, 2 ** 1.75, 4.0])
    np.testing.assert_allclose(row["ppl"], np.sqrt(8.0))


# ---------------------------------------------------------------------------------------------------------
# scripts/exp_sweep.py: bad input -> one line on stderr, exit code 2; the real model end to end (slow).


# The scripts import this checkout's packages, rsqr_jax and lab/'s rsqr_lab (not whichever checkout the editable
# install points at).
SCRIPT_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "lab")]))


def _cli(*args, timeout=600):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "exp_sweep.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env={**SCRIPT_ENV, **xla_env()})


SWEEP_FLAGS = [
    (["--grid", "mode=rsqr,sinkcache"], "unknown policy 'sinkcache'"),
    (["--grid", "mode=rsqr windw=8"], "unknown grid key 'windw'"),
    (["--text", "/nonexistent/text.txt"], "text file not found"),
    (["--tokens", "0"], "--tokens must be >= 2"),
    (["--tokens", "-5"], "--tokens must be >= 2"),
    (["--task", "recall"], "--task must be one of"),
    (["--devices", "0"], "--devices must be >= 1"),
    (["--quick", "--model", "/nonexistent/model.gguf"], "model not found"),
    (["--quick", "--model", os.path.join(ROOT, "README.md")], "not both --quick and --model"),
    (["--quick", "--processes", "4096"], "one local process per core at most"),
    (["--quick", "--processes", "2", "--devices", "3"], "does not split evenly"),
    (["--quick", "--coordinator", "localhost"], "needs --num-processes and --process-id"),
]


@pytest.fixture(scope="module")
def sweep_cli():
    """{args: finished process} of every SWEEP_FLAGS case, run in one batch (tests/cli.py run_scripts: one
    interpreter); the --processes test runs exp_sweep.py as its own process."""
    procs = run_scripts([("exp_sweep.py", a) for a, _ in SWEEP_FLAGS])
    return {tuple(a): proc for (a, _), proc in zip(SWEEP_FLAGS, procs)}


@pytest.mark.parametrize("args, fragment", SWEEP_FLAGS)
def test_sweep_cli_bad_input(sweep_cli, args, fragment):
    assert_one_line_error(sweep_cli[tuple(args)], fragment)


@pytest.mark.slow
def test_sweep_cli_real_model_writes_every_output(tmp_path, smollm2_path):
    """In this process (tests/cli.py run_in_process: the model loaded once per run); the --processes test
    below runs exp_sweep.py as its own process."""
    proc = run_in_process("exp_sweep.py", "--grid", "mode=rsqr,streamingllm window=16 delta=4 max_survivors=8",
                          "--tokens", "40", "--segment", "16", "--bucket", "16", "--devices", "1", "--out",
                          str(tmp_path), "--no-progress", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    meta_rows = json.loads((tmp_path / "sweep.json").read_text())
    assert json.loads(proc.stdout) == meta_rows  # --json: one object on stdout, the same as sweep.json
    assert [r["mode"] for r in meta_rows["rows"]] and meta_rows["meta"]["n_policies"] == 2
    assert all(np.isfinite(r["ppl"]) and len(r["ppl_curve"]) == 3 for r in meta_rows["rows"])
    assert (tmp_path / "sweep.csv").read_text().count("\n") == 3
    assert (tmp_path / "sweep.md").read_text().count("| `") == 2
    assert (tmp_path / "sweep_ppl.png").read_bytes()[:4] == b"\x89PNG"
    assert np.load(tmp_path / "nll.npy").shape == (2, 39)


def test_sweep_cli_two_processes_equal_one_process_in_process():
    """--processes 2: two local jax.distributed processes (loopback, one CPU device each) split the grid;
    process 0 prints the gathered result, the same as the experiment run in this one process."""
    grid, n_tok = "mode=rsqr,streamingllm window=6 sinks=2 delta=3 max_survivors=3", 17  # 2 policies, 1 segment
    config = SX.SweepConfig.quick(text=None, grid=grid, tokens=n_tok, segment=16, bucket=16, sort="grid",
                                  progress=False)
    apply_fn, params, cfg, _ = SX.quick_model()
    result = SX.run(config, apply_fn, params, cfg)
    proc = _cli("--quick", "--processes", "2", "--grid", grid, "--tokens", str(n_tok), "--segment", "16",
                "--bucket", "16", "--sort", "grid", "--out", "", "--no-progress", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)  # one JSON object: gloo's notices on stdout are filtered out
    assert got["meta"]["processes"] == 2 and got["meta"]["devices"] == 2
    assert [r["name"] for r in got["rows"]] == [r["name"] for r in result.rows]
    np.testing.assert_allclose([r["nll"] for r in got["rows"]], [r["nll"] for r in result.rows], rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# rsqr_lab.studies.policy_sweep / bench_sweep in-process on the tiny model (tokens: TOKENS, seed 3; weights seed 0).

from rsqr_lab.studies import sweep_timing as BX  # noqa: E402
from rsqr_lab.studies import policy_sweep as SX  # noqa: E402
from rsqr_jax.eval.runtime import ConfigError  # noqa: E402

SMALL_GRID = "mode=rsqr,streamingllm,full window=6,8 sinks=2 delta=3 max_survivors=3"  # 2 + 2 + 1 policies


@functools.lru_cache(maxsize=None)
def _experiment_run():
    """The sweep experiment on random tokens (seed 5) of the tiny model, grid order kept."""
    apply_fn, params = _model()
    config = SX.SweepConfig(grid=SMALL_GRID, text=None, seed=5, tokens=T, segment=SEGMENT, bucket=16, sort="grid",
                            progress=False)
    return config, SX.run(config, apply_fn, params, CFG, model_name="tiny")


def test_sweep_experiment_rows_match_sweep_nll_and_write_every_output(tmp_path):
    config, result = _experiment_run()
    apply_fn, params = _model()
    pols, names = policy_grid(SMALL_GRID)
    tokens = SX.load_tokens(None, T, vocab_size=CFG.vocab_size, seed=5)
    assert tokens.shape == (1, T) and (tokens == np.random.default_rng(5).integers(0, CFG.vocab_size, T)).all()
    nll = sweep_nll(apply_fn, params, tokens, pols, config=CFG, segment=SEGMENT)[:, 0]
    np.testing.assert_array_equal(result.nll_PxT, nll)
    assert [r["name"] for r in result.rows] == names and len(names) == 5
    for r, x in zip(result.rows, nll.astype(np.float64)):
        np.testing.assert_allclose(r["ppl"], np.exp(x.mean()), rtol=1e-12)
        assert r["bucket_end"] == [16, 32, 39] and len(r["ppl_curve"]) == 3
    by_name = {r["name"]: r for r in result.rows}
    assert by_name["full"]["mode"] == "full" and by_name["full"]["cache_kib"] > by_name["rsqr(W=6, N=2, delta=3, "
                                                                                        "S=3, fifo)"]["cache_kib"]
    assert by_name["streamingllm(W=8, N=2)"]["window"] == 8 and by_name["streamingllm(W=8, N=2)"]["n_sink"] == 2
    m = result.meta
    assert m["n_policies"] == 5 and m["n_scored"] == T - 1 and m["devices"] == 1 and m["text"] is None
    assert result.best["ppl"] == min(r["ppl"] for r in result.rows)

    paths = result.write(tmp_path)
    import json

    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert doc == json.loads(json.dumps(result.to_json())) and [r["name"] for r in doc["rows"]] == names
    assert (tmp_path / "sweep.csv").read_text().count("\n") == 6
    assert (tmp_path / "sweep.md").read_text().count("| `") == 5 and "ppl@32" in result.markdown()
    assert (tmp_path / "sweep_ppl.png").read_bytes()[:4] == b"\x89PNG"
    np.testing.assert_array_equal(np.load(paths["npy"]), nll)
    ranked = SX.sorted_rows(result.rows, "ppl")
    assert [r["ppl"] for r in ranked] == sorted(r["ppl"] for r in result.rows)


@pytest.mark.parametrize("kw, match", [
    (dict(tokens=1), "--tokens must be >= 2"),
    (dict(task="recall"), "--task must be one of"),
    (dict(sort="best"), "--sort must be one of"),
    (dict(chunk=3, segment=16), "divide --segment"),
    (dict(bucket=0), "--bucket must be >= 1"),
    (dict(devices=0), "--devices must be >= 1"),
    (dict(dtype="float16"), "--dtype must be"),
    (dict(text="/nonexistent/text.txt"), "text file not found"),
    (dict(devices=64), "only 1 cpu device"),
])
def test_sweep_experiment_bad_config(kw, match):
    apply_fn, params = _model()
    with pytest.raises(ConfigError, match=match):
        SX.run(SX.SweepConfig.quick(**{"text": None, "progress": False, **kw}), apply_fn, params, CFG)


def test_bench_sweep_arms_in_process_agree():
    """Both arms of the bench in this process (no subprocess): same names, same perplexities (float32)."""
    apply_fn, params = _model()
    config = BX.BenchSweepConfig.make(quick=True, grid=SMALL_GRID, tokens=T, segment=SEGMENT)
    config.validate()
    tokens = SX.load_tokens(None, T, vocab_size=CFG.vocab_size, seed=0)
    arms = {arm: BX.run_arm(config, arm, apply_fn, params, CFG, tokens, "tiny") for arm in BX.ARMS}
    result = BX.summarize(config, arms)
    seq, vm = arms["sequential"], arms["vmapped"]
    assert seq["names"] == vm["names"] == policy_grid(SMALL_GRID)[1]
    assert seq["n_scored"] == vm["n_scored"] == T - 1 and seq["cache_bytes_union"] == vm["cache_bytes_union"]
    np.testing.assert_allclose(vm["ppl"], seq["ppl"], rtol=1e-5)
    assert result.summary["max_rel_ppl_diff"] < 1e-5 and result.summary["quick"]
    assert "| sequential |" in result.markdown() and "| vmapped |" in result.markdown()
    with pytest.raises(ConfigError, match="arm must be one of"):
        BX.run_arm(config, "parallel", apply_fn, params, CFG, tokens, "tiny")
    argv = BX.arm_argv(config, "vmapped")
    assert argv[:2] == ["--arm", "vmapped"] and "--quick" in argv and "--text" not in argv


@pytest.mark.parametrize("kw, match", [
    (dict(dtype="float16"), "--dtype must be"),
    (dict(tokens=1), "--tokens must be >= 2"),
    (dict(chunk=3), "--chunk must divide --segment"),
    (dict(quick=False, text="/nonexistent/text.txt"), "text file not found"),
])
def test_bench_sweep_bad_config(kw, match):
    with pytest.raises(ConfigError, match=match):
        BX.BenchSweepConfig.make(**{"quick": True, **kw}).validate()
    with pytest.raises(P.PolicyError, match="unknown grid key"):
        BX.BenchSweepConfig.make(quick=True, grid="mode=rsqr windw=8").validate()


@pytest.mark.slow
def test_bench_sweep_cli_quick_writes_json_in_out_dir(tmp_path):
    """The one subprocess smoke test of scripts/bench_sweep.py: two child processes, tiny model."""
    import json

    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_sweep.py"), "--quick", "--tokens",
                           "40", "--segment", "16", "--out", str(tmp_path), "--json", "--no-progress"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env={**SCRIPT_ENV, **xla_env()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc == json.loads((tmp_path / BX.JSON_NAME).read_text())
    assert set(doc["arms"]) == set(BX.ARMS) and doc["summary"]["max_rel_ppl_diff"] < 1e-5
    assert doc["arms"]["vmapped"]["n_policies"] == 8 and doc["arms"]["vmapped"]["n_scored"] == 39


def test_sweep_experiment_with_recall_grid_entries():
    """recall_pages is a grid axis: the entries with recall get the config's cold store (in the vmapped
    spec and in their own cache size), and a store that keeps every evicted token, fully recalled, scores
    exactly what full attention scores (docs/design.md §3b)."""
    import rsqr_jax as rj
    from rsqr_jax.spec import ColdStore

    apply_fn, params = _model()
    grid = "mode=rsqr window=6 sinks=2 delta=3 max_survivors=3 recall_pages=0,12"
    config = SX.SweepConfig(grid=grid, text=None, seed=7, tokens=T, segment=SEGMENT, bucket=16, sort="grid",
                            progress=False, cold=ColdStore(T, 4))
    result = SX.run(config, apply_fn, params, CFG, model_name="tiny")
    plain, recall = result.rows
    tokens = SX.load_tokens(None, T, vocab_size=CFG.vocab_size, seed=7)
    full = rj.CacheSpec.for_policies(rj.full(), num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                                     head_dim=CFG.head_dim, max_len=T)
    full_nll = rj.stream_nll(apply_fn, params, tokens, rj.full(), full, segment=SEGMENT)[0][0]
    assert recall["recall_pages"] == 12 and plain["recall_pages"] == 0 and "recall=12" in recall["name"]
    np.testing.assert_allclose(result.nll_PxT[1], full_nll, atol=5e-5)
    assert np.abs(result.nll_PxT[0] - full_nll).max() > 1e-3 and recall["cache_kib"] > plain["cache_kib"]
