"""Vectorized policy sweeps (rsqr_jax.sweep) on a tiny random model: vmapped == alone, one compilation,
sharded == unsharded (4 simulated CPU devices in a subprocess), grid parsing."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from models.llama import Llama, split_apply
from rsqr_jax import policy as P
from rsqr_jax.spec import CacheSpec
from rsqr_jax.engine import stream_nll
from rsqr_jax.sweep import policy_grid, summarize, sweep_nll
from rsqr_jax.testing.tiny import tiny_config, tiny_weights

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
    import sys
    import jax, jax.numpy as jnp, numpy as np
    sys.path.insert(0, {root!r})
    from models.llama import Llama, split_apply
    from rsqr_jax.sweep import make_mesh, policy_grid, sweep_nll
    from rsqr_jax.testing.tiny import tiny_config, tiny_weights
    assert jax.device_count() == 4, jax.devices()
    cfg = tiny_config()
    apply_fn, params = split_apply(Llama(cfg, tiny_weights(cfg, 0), dtype=jnp.float32))
    tokens = np.load({tokens!r})
    pols, names = policy_grid({grid!r})
    out = {{}}
    for p_dev, b_dev in ((4, 1), (2, 2)):
        nll, cache = sweep_nll(apply_fn, params, tokens, pols, config=cfg, segment={segment},
                               mesh=make_mesh(4, batch_devices=b_dev), return_cache=True)
        sh = cache.win_k.sharding
        assert len(sh.device_set) == 4 and tuple(sh.spec)[:3] == ("policy", None, "batch"), sh
        assert cache.win_k.shape[0] == -(-len(names) // p_dev) * p_dev and len(cache.win_k.addressable_shards) == 4
        out[f"nll_{{p_dev}}x{{b_dev}}"] = nll
    np.savez({out!r}, **out)
""")


def test_sharded_sweep_over_4_devices_equals_unsharded(tmp_path):
    _, _, nll, _ = _grid_run()
    np.save(tmp_path / "tokens.npy", TOKENS)
    out = tmp_path / "sharded.npz"
    code = _CHILD.format(root=ROOT, tokens=str(tmp_path / "tokens.npy"), grid=GRID, segment=SEGMENT, out=str(out))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = np.load(out)
    # Not bitwise: each device multiplies a different number of policy rows, so CPU matmul blocking differs.
    np.testing.assert_allclose(got["nll_4x1"], nll, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got["nll_2x2"], nll, rtol=1e-5, atol=1e-4)


def test_policy_grid_product_dedup_and_names():
    pols, names = policy_grid("mode=rsqr,streamingllm,window,full window=128,256 delta=4,8,16")
    # rsqr: 2 x 3; streamingllm and window ignore delta: 2 each; full: 1.
    assert len(names) == 6 + 2 + 2 + 1 == len(set(names)) == P.policy_size(pols)
    assert names[0] == P.rsqr(128, 4, 4, 256).name and names[-1] == "full"
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
# scripts/sweep.py: bad input -> one line on stderr, exit code 2; the real model end to end (slow).


def _cli(*args, timeout=600):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "sweep.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("args, fragment", [
    (["--grid", "mode=rsqr,sinkcache"], "unknown policy 'sinkcache'"),
    (["--grid", "mode=rsqr windw=8"], "unknown grid key 'windw'"),
    (["--text", "/nonexistent/text.txt"], "text file not found"),
    (["--tokens", "0"], "--tokens must be >= 2"),
    (["--tokens", "-5"], "--tokens must be >= 2"),
    (["--task", "recall"], "--task must be one of"),
])
def test_sweep_cli_bad_input(args, fragment):
    proc = _cli(*args)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and fragment in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.slow
def test_sweep_cli_real_model_writes_every_output(tmp_path, smollm2_path):
    proc = _cli("--grid", "mode=rsqr,streamingllm window=16 delta=4 max_survivors=8", "--tokens", "40",
                "--segment", "16", "--bucket", "16", "--devices", "1", "--out", str(tmp_path), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    meta_rows = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["mode"] for r in meta_rows["rows"]] and meta_rows["meta"]["n_policies"] == 2
    assert all(np.isfinite(r["ppl"]) and len(r["ppl_curve"]) == 3 for r in meta_rows["rows"])
    assert (tmp_path / "sweep.csv").read_text().count("\n") == 3
    assert (tmp_path / "sweep.md").read_text().count("| `") == 2
    assert (tmp_path / "sweep_ppl.png").read_bytes()[:4] == b"\x89PNG"
    assert np.load(tmp_path / "nll.npy").shape == (2, 39)
