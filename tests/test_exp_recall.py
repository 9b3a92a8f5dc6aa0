"""scripts/exp_recall.py: scoring helpers, facts files, the replay short-stream shortcut and the layout
diagnostics (tiny random model), the CLI error contract, and the --quick run on SmolLM2 (slow)."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import exp_recall as er  # noqa: E402
from _common import UsageError  # noqa: E402
from models.llama import Llama, split_apply  # noqa: E402
from rsqr_jax import policy as P  # noqa: E402
from rsqr_jax.cache import init_cache
from rsqr_jax.spec import CacheSpec  # noqa: E402
from rsqr_jax.update import step  # noqa: E402
from rsqr_jax.testing.oracle import reference_token_sets  # noqa: E402
from rsqr_jax.testing.tiny import tiny_config, tiny_weights  # noqa: E402

CFG = tiny_config(layers=4)  # 2 layers barely propagate context into the question's logits


def test_wilson_interval_known_values():
    assert er.wilson(0, 0) == (0.0, 1.0)
    lo, hi = er.wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    lo, hi = er.wilson(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = er.wilson(40, 40)
    assert hi == 1.0 and lo == pytest.approx(0.9124, abs=1e-4)
    for n in range(1, 101):  # the bounds contain the estimate exactly, also at k = 0 and k = n
        for k in range(n + 1):
            lo, hi = er.wilson(k, n)
            assert 0 <= lo <= k / n <= hi <= 1, (k, n)
        assert er.wilson(n, n)[1] == 1.0 and er.wilson(0, n)[0] == 0.0


def test_answer_scoring():
    assert er.answer_correct(" 1234567.\n", "1234567")
    assert er.answer_correct("\nIt is 1234567", "1234567")
    assert not er.answer_correct(" 123456", "1234567")
    assert not er.answer_correct(" 1,234,567", "1234567")
    assert er.leading_digits(" 1239999", "1234567") == 3
    assert er.leading_digits("x1234567", "1234567") == 0


def test_facts_file_formats(tmp_path):
    lines = tmp_path / "f.txt"
    lines.write_text("# comment\nAlice 1234567\n\nBob 7654321\n")
    assert er.read_facts(str(lines)) == [("Alice", "1234567"), ("Bob", "7654321")]
    js = tmp_path / "f.json"
    js.write_text(json.dumps([{"name": "Carol", "number": "0000001"}, {"name": "Dan", "number": "9999999"}]))
    assert er.read_facts(str(js)) == [("Carol", "0000001"), ("Dan", "9999999")]
    js.write_text(json.dumps({"Eve": "1111111"}))
    assert er.read_facts(str(js)) == [("Eve", "1111111")]
    bad = {"x.txt": "Alice 12a4567\n", "y.txt": "Alice 123 4\n", "z.txt": "Alice 1234567\nBob 12\n",
           "d.txt": "Alice 1234567\nAlice 7654321\n", "e.txt": "\n# nothing\n", "j.json": "[{\"name\": \"A\"}]",
           "k.json": "{bad json"}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(UsageError):
            er.read_facts(str(tmp_path / name))
    with pytest.raises(UsageError):
        er.read_facts(str(tmp_path / "missing.txt"))


@functools.lru_cache(maxsize=None)
def _tiny_runner(policies: tuple[str, ...], batch: int):
    """One Runner (one compilation) for the union spec of the named test policies, and a jitted step."""
    apply_fn, params = split_apply(Llama(CFG, tiny_weights(CFG, 0), dtype=jnp.float32))
    spec = CacheSpec.for_policies([POLICIES[p] for p in policies], num_layers=CFG.num_layers,
                                  num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim, batch=batch, max_chunk=2)
    return er.Runner(apply_fn, params, spec, n_gen=2), jax.jit(functools.partial(step, apply_fn))


W, B, N = 6, 2, 3
POLICIES = {
    "replay": P.make_policy("replay", window=W, n_sink=N, delta=0, block=B),
    "streamingllm": P.make_policy("streamingllm", window=W, n_sink=N, block=B),
    "rsqr": P.make_policy("rsqr", window=W, n_sink=N, delta=3, max_survivors=4, block=B),
    "leave_gaps": P.make_policy("leave_gaps", window=W, n_sink=N, delta=3, max_survivors=100, block=B),
}


def test_replay_short_stream_reaches_the_long_stream_state():
    """Replay's state depends only on the kept ids: the short stream gives the long stream's logits.
    The same shortcut must NOT hold for streamingllm (its window K/V carry the evicted history)."""
    runner, jstep = _tiny_runner(("replay", "streamingllm"), 2)
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, CFG.vocab_size, (2, 5)).astype(np.int32)
    filler = rng.integers(0, CFG.vocab_size, (2, 40)).astype(np.int32)
    q = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 2)), jnp.int32)
    for n_filler in (8, 14, 30):
        k = er.replay_short_len(n_filler, W, B)
        assert k <= n_filler and (n_filler - k) % B == 0
        diffs = {}
        for mode in ("replay", "streamingllm"):
            pol = POLICIES[mode]
            out = []
            for ids in (filler[:, :n_filler], filler[:, n_filler - k:n_filler]):
                cache = runner.feed(init_cache(runner.spec), pol, np.concatenate([prefix, ids], axis=1), B)
                out.append(np.asarray(jstep(runner.params, q, cache, pol, jnp.int32(2))[0]))
            diffs[mode] = float(np.max(np.abs(out[0] - out[1])))
        assert diffs["replay"] < 1e-4, (n_filler, diffs)
        if k < n_filler:  # a real shortcut: streamingllm's long and short streams differ
            assert diffs["streamingllm"] > 1e-2, (n_filler, diffs)


def test_layout_matches_the_token_set_oracle():
    modes = ("rsqr", "streamingllm", "leave_gaps")
    runner, _ = _tiny_runner(modes, 1)
    T = 41
    digit_pos = [[1, 2, 4, 5, 6], [10, 11], [36, 37]]
    seen = set()
    ids = np.random.default_rng(1).integers(0, CFG.vocab_size, (1, T)).astype(np.int32)
    for mode in modes:
        pol = POLICIES[mode]
        cache = runner.feed(init_cache(runner.spec), pol, ids, B)
        lay = er.layout_of(cache, pol, mode, N, digit_pos)
        h = pol.host()
        n, kept = reference_token_sets(T, window=W, n_sink=N, delta=h["delta"], max_survivors=h["max_survivors"],
                                       block=B, chunk=B)[-1]
        assert n == T and lay["t"] == T and lay["n_cached"] == len(kept)
        w0 = T - (T if T < W + B else W + (T - W) % B)
        for dp, got in zip(digit_pos, lay["facts"]):
            want = {"sink": sum(g < N for g in dp), "window": sum(g >= w0 for g in dp),
                    "survivor": sum(N <= g < w0 and g in kept for g in dp), "evicted": sum(g not in kept for g in dp)}
            assert got["digits"] == want, (mode, dp, got, want)
            seen |= {k for k, v in want.items() if v}
            first = [g for g in dp if g in kept]
            if first:
                want_d = T - first[0] if mode == "leave_gaps" else len(kept) - kept.index(first[0])
                assert got["distance"] == want_d
            else:
                assert got["distance"] is None
        assert lay["query_position"] == (T if mode == "leave_gaps" else len(kept))
    assert seen == {"sink", "survivor", "window", "evicted"}


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, str(REPO / "scripts" / "exp_recall.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


@pytest.mark.parametrize("args,fragment", [
    (["--cycles", "2,x"], "--cycles must be a comma-separated list"),
    (["--cycles", "0"], "--cycles needs positive integers"),
    (["--dtypes", "float16"], "--dtypes: unknown float16"),
    (["--arms", "rsqr,sinkcache"], "--arms: unknown sinkcache"),
    (["--trials", "0"], "--trials must be >= 1"),
    (["--block", "32"], "must not exceed --window"),
    (["--filler", "/nonexistent.txt"], "filler file not found"),
])
def test_cli_bad_input(args, fragment):
    proc = _run(*args)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and fragment in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_bad_facts_file(tmp_path):
    f = tmp_path / "facts.txt"
    f.write_text("Alice 123\nBob 12345\n")
    proc = _run("--facts", str(f))
    assert proc.returncode == 2 and "same number of digits" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_quick_run_json_and_sanity(tmp_path, smollm2_path):
    proc = _run("--quick", "--out", str(tmp_path), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "recall.json").read_text())
    png = tmp_path / "recall.png"
    assert png.is_file() and 0 < png.stat().st_size < 200_000
    proto = data["protocol"]
    for key in ("cycle_len", "window", "block", "delta", "sinks", "chunk", "rsqr_cap_max_survivors"):
        assert key in proto
    assert proto["window"] == 24 and proto["block"] == 8 and proto["delta"] == 8
    cfg = data["config"]
    cells = {(s["variant"], s["dtype"], s["arm"], s["n_cycles"]): s for s in data["summary"]}
    for c in cfg["cycles"]:
        for arm in er.ARMS:
            assert ("pinned", "float32", arm, c) in cells
    for s in data["summary"]:
        assert s["trials"] == cfg["trials"]
        assert 0 <= s["wilson_lo"] <= s["acc"] <= s["wilson_hi"] <= 1
        assert s["correct"] == round(s["acc"] * s["trials"])
    # A 7-digit number is recalled from a short full cache (calibration: 90-100% at ~100 filler tokens).
    assert cells[("pinned", "float32", "full", 2)]["acc"] >= 0.5
    assert cells[("pinned", "float32", "streamingllm", 2)]["acc"] >= 0.5
    # Unprotected: the digits have left the window; no bounded arm can reproduce 7 random digits.
    for c in cfg["unprotected_cycles"]:
        for arm in cfg["unprotected_arms"]:
            assert cells[("unprotected", "float32", arm, c)]["acc"] == 0.0, arm
    lays = {(ly["variant"], ly["arm"], ly["n_cycles"]): ly for ly in data["layout"]}
    n_digits = len(proto["digit_positions"][0])
    for c in cfg["cycles"]:
        assert lays[("pinned", "streamingllm", c)]["facts"][0]["digits"]["sink"] == n_digits
        assert lays[("pinned", "full", c)]["facts"][0]["digits"]["window"] == n_digits
    assert lays[("unprotected", "streamingllm", cfg["unprotected_cycles"][0])]["facts"][0]["digits"]["evicted"] == \
        n_digits
    recs = data["records"]
    assert len(recs) == sum(s["trials"] for s in data["summary"] if "shared_with" not in s)
    pairs = {(p["variant"], p["arm"], p["n_cycles"]): p for p in data["paired_vs_streamingllm"]}
    assert pairs[("pinned", "rsqr", 2)]["pairs"] == cfg["trials"]
    # re-plot from the JSON (no model): the same table, a fresh PNG
    replot = _run("--from-json", str(tmp_path / "recall.json"), "--out", str(tmp_path / "replot"))
    assert replot.returncode == 0 and "| streamingllm |" in replot.stdout, replot.stderr
    assert (tmp_path / "replot" / "recall.png").is_file()


def test_cli_resume_needs_a_resumable_run(tmp_path):
    proc = _run("--resume", "--out", str(tmp_path))
    assert proc.returncode == 2 and "--resume: cannot read" in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "recall.json").write_text(json.dumps({"complete": False}))
    proc = _run("--out", str(tmp_path))  # a fresh run must not overwrite an unfinished one
    assert proc.returncode == 2 and "holds an unfinished run" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_sigterm_keeps_finished_arms_and_resume_matches_a_fresh_run(tmp_path, smollm2_path):
    """A killed run keeps the arms it finished (exit 3); --resume runs only the rest, and the result equals an
    uninterrupted run's, record for record."""
    args = ["--quick", "--variants", "pinned", "--arms", "streamingllm,rsqr,rsqr_cap", "--trials", "3",
            "--cycles", "2,4", "--no-plot"]
    fresh = _run(*args, "--out", str(tmp_path / "fresh"), timeout=900)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    want = json.loads((tmp_path / "fresh" / "recall.json").read_text())
    assert want["complete"] is True and len(want["arms_done"]) == 3

    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "exp_recall.py"), *args, "--out", str(out)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=REPO)
    for line in proc.stderr:  # SIGTERM as soon as the first arm has finished
        if line.startswith("  pinned"):
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.stderr.read()
    assert proc.wait(timeout=300) == 3, rest
    part = json.loads((out / "recall.json").read_text())
    assert part["complete"] is False and part["interrupted_during"] in (None, "pinned/float32/rsqr"), rest
    assert part["arms_done"] == [["pinned", "float32", "streamingllm"]]
    assert {r["arm"] for r in part["records"]} == {"streamingllm"}  # the half-run arm left nothing behind
    assert "--resume" in rest

    bad = _run(*args, "--out", str(out), "--resume", "--seed", "1")
    assert bad.returncode == 2 and "seed=0" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    resumed = _run(*args, "--out", str(out), "--resume", timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "1 arm(s) done" in resumed.stderr
    got = json.loads((out / "recall.json").read_text())
    assert got["complete"] is True and got["arms_done"] == want["arms_done"]
    assert got["records"] == want["records"] and got["summary"] == want["summary"]
