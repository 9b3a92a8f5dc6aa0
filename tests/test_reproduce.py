"""The replicas of the RSQR author's position bookkeeping, against hand-worked examples, and the
explicit-position step against the float64 oracle."""

from __future__ import annotations

import numpy as np
import pytest

from rsqr_lab.studies import reproduce as R
from rsqr_lab.studies import reproduce_arms as A
from tests.cli import assert_one_line_error, run_in_process, run_script


def drive(arm) -> tuple[list[A.Call], dict]:
    """Run an arm with a fake model: call k gets slot k; returns every Call and the result."""
    calls = []
    try:
        call = next(arm)
        while True:
            calls.append(call)
            call = arm.send(A.Reply(len(calls) - 1, 7, -0.5))
    except StopIteration as done:
        return calls, done.value


def small_stream(n_window: int, pinned: bool):
    """S S F W1..Wn [P] Q: 2 sinks, a 1-token fact, n window tokens, a pinned token, the query."""
    s = [(100, False, -1, False), (101, False, -1, False), (102, False, -1, False)]
    s += [(200 + i, False, -1, False) for i in range(n_window)]
    if pinned:
        s.append((300, False, -1, True))
    return s + [(301, True, 7, pinned)]


def test_rank_rsqr_bookkeeping_matches_hand_worked_example():
    """sink 2, fact 1, window 4, block 2, delta 2. Hand-worked from the author's code: the flagged token is
    a survivor at once (rank 0, 1, 2: positions the sinks hold), the window slice after a flag starts one
    entry late (W1's K/V are lost at W2, W3's at W6...), the pinned slice copies the first survivor."""
    calls, res = drive(A.author_rsqr_rank(small_stream(6, True), fact_len=1, sink_size=2, window=4, block=2, delta=2))
    sink_fact = [(0, 1), (1, 2), (2, 3)]
    assert [c.pos for c in calls] == list(range(1, 12))
    assert calls[3].entries == sink_fact                                   # W1
    assert calls[4].entries == sink_fact + [(3, 4)]                        # W2 (flagged)
    assert calls[5].entries == sink_fact + [(4, 0), (4, 5)]                # W3: W1 dropped, W2 twice
    assert calls[6].entries == sink_fact + [(4, 0), (4, 5), (5, 6)]        # W4 (flagged)
    assert calls[7].entries == sink_fact + [(4, 0), (6, 1), (5, 6), (6, 7)]  # W5: W3 dropped
    assert calls[8].entries == sink_fact + [(4, 0), (6, 1), (5, 6), (6, 7), (7, 8)]  # W6 (flagged, evicts 2)
    assert calls[9].entries == sink_fact + [(4, 0), (6, 1), (8, 2), (8, 9)]  # pinned token
    assert calls[10].entries == sink_fact + [(4, 0), (4, 0), (6, 1), (8, 2), (8, 9)]  # query: pinned = survivor 0
    assert calls[10].answer == 7 and res["n_survivors"] == 3 and res["n_window_entries"] == 1

    calls, _ = drive(A.author_rsqr_rank(small_stream(6, True), fact_len=1, sink_size=2, window=4, block=2, delta=2,
                                        fix_off_by_one=True, pinned_slice_bug=False))
    assert calls[10].entries == sink_fact + [(9, 10), (4, 0), (6, 1), (8, 2), (5, 6), (6, 7), (7, 8), (8, 9)]


def test_b_arm_first_eviction_modes():
    """sink 1, fact 1, window 2, block 2: the first eviction trigger (4 window tokens) skipped (study 1),
    evicted with the counter moved back unrotated (study 2: W5 is written at W3's position), or normal."""
    s = [(100, False, -1, False), (101, False, -1, False)] + [(200 + i, False, -1, False) for i in range(6)]
    s.append((301, True, 7, False))
    b = lambda **kw: drive(A.author_b(s, 1, 1, window=2, block=2, **kw))[0]  # noqa: E731
    pre = [(0, 1), (1, 2)]
    skip_c = b(correct=True, first_eviction="skip")
    assert (skip_c[-1].pos, skip_c[-1].entries) == (7, pre + [(4, 3), (5, 4), (6, 5), (7, 6)])
    skip_u = b(correct=False, first_eviction="skip")
    assert (skip_u[-1].pos, skip_u[-1].entries) == (9, pre + [(4, 5), (5, 6), (6, 7), (7, 8)])
    collide_u = b(correct=False, first_eviction="collide")
    assert collide_u[6].pos == 5 and (4, 5) in collide_u[6].entries  # W5 at W3's position 5
    assert (collide_u[-1].pos, collide_u[-1].entries) == (7, pre + [(6, 5), (7, 6)])
    normal_u = b(correct=False, first_eviction="normal")
    assert (normal_u[-1].pos, normal_u[-1].entries) == (9, pre + [(6, 7), (7, 8)])
    normal_c = b(correct=True, first_eviction="normal")
    assert (normal_c[-1].pos, normal_c[-1].entries) == (5, pre + [(6, 3), (7, 4)])


def test_replay_and_two_scale_positions():
    """Replay re-encodes sinks + fact + window at 1..n when 48 positions past the fact; the two-scale RSQR
    writes the window at global - evicted (colliding after an eviction) and survivors delta apart."""
    s = [(100, False, -1, False), (101, False, -1, False)] + [(200 + i, False, -1, False) for i in range(50)]
    s.append((301, True, 7, False))
    calls, res = drive(A.author_replay(s, fact_len=1, sink_size=1, window=24, horizon=48))
    assert res["n_consolidations"] == 1
    replayed = calls[49:49 + 26]  # the token at position 49 triggers a replay of 1 + 1 + 24 tokens
    assert [c.pos for c in replayed] == list(range(1, 27)) and [c.token for c in replayed[:2]] == [100, 101]
    assert calls[-1].pos == 26 + 3 + 1 and len(calls[-1].entries) == 26  # 3 more window tokens, then the query

    calls, res = drive(A.author_rsqr_two_scale(small_stream(6, False), fact_len=1, sink_size=2, window=4, block=2,
                                               delta=2))
    assert [c.pos for c in calls[3:9]] == [4, 5, 6, 7, 8, 9]  # no eviction until the 6th window token
    assert calls[-1].pos == 10 - 2  # query at global + 1 - evicted
    # W2 (slot 4) is promoted when its block (W1, W2) leaves at W6; W4 is still pending in the window. The
    # window then starts at W3: 6 - 2 evicted = 4, so the one survivor sits delta = 2 before it, at 2.
    assert [e for e in calls[-1].entries if e[0] == 4] == [(4, 2)]
    assert [e for e in calls[-1].entries if e[0] == 6] == [(6, 7)]  # W4 keeps its write-time position


def test_explicit_step_matches_float64_oracle():
    """The explicit-position step (a tiny random model) against the float64 oracle: full causal attention
    and a sinks + window set at global (gapped) positions, two rows of one batch."""
    from rsqr_jax.models.llama import Llama, split_apply
    from rsqr_lab.testing.oracle import stream_logits_f64
    from rsqr_jax.models.tiny import tiny_config, tiny_weights

    seed = 3
    print("seed", seed)
    cfg = tiny_config()
    w = tiny_weights(cfg, seed)
    import jax.numpy as jnp

    fn, params = split_apply(Llama(cfg, w, dtype=jnp.float32), attend=A.explicit_attend)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, 12).tolist()
    sets = {"full": [set(range(t + 1)) for t in range(12)],
            "gaps": [set(range(min(2, t + 1))) | set(range(max(0, t - 2), t + 1)) for t in range(12)]}
    target = 5

    def arm(sets_t):
        slot_of = {}
        got = []
        for t, tok in enumerate(tokens):
            r = yield A.Call(tok, [(slot_of[g], g) for g in sorted(sets_t[t] - {t})], t, target)
            slot_of[t] = r.slot
            got.append(r.logp)
        return {"logp": got}

    res = A.run_rows(A.make_explicit_step(fn), params, [arm(sets["full"]), arm(sets["gaps"])],
                     num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, slots=16, batch=2)
    for r, name in zip(res, ("full", "gaps")):
        ref = stream_logits_f64(w, cfg, tokens, sets[name], "global")
        ref_lp = ref[:, target] - np.log(np.exp(ref - ref.max(1, keepdims=True)).sum(1)) - ref.max(1)
        np.testing.assert_allclose(r["logp"], ref_lp, atol=2e-4)
    assert not np.allclose(res[0]["logp"], res[1]["logp"])  # the gapped set really differs


def test_statistics():
    assert R.mcnemar_cc(0, 0) == 1.0
    assert abs(R.mcnemar_cc(10, 2) - 0.04331) < 1e-4  # chi2 = (|10-2|-1)^2/12 = 4.083, 1 dof: p = 0.0433
    lo, hi = R.paired_bootstrap([1] * 20, [0] * 20)
    assert lo == hi == 1.0


def test_factorial_effects_use_matched_cells_only():
    """In a run of some factorial cells, a factor's effect compares only cells whose counterpart ran: the
    7-digit cells exist only with the study-1 prefix, so the answer effect must not pool study-2 digit cells
    (all correct here) into its digit level; leave_gaps vs streamingllm reports its discordant trials."""
    rng = np.random.default_rng(11)
    print("seed 11")
    cell = "filler=salad,answer={},prefix={},feeding=8".format
    acc = {cell("digit", "p1"): 0.3, cell("7digit", "p1"): 0.5, cell("digit", "p2"): 1.0}
    recs = [{"part": "factorial", "cell": cl, "arm": arm, "n_cycles": 4, "seed": 0, "trial": i,
             "correct": bool(rng.random() < p)} for cl, p in acc.items() for arm in ("leave_gaps", "streamingllm")
            for i in range(40)]
    eff = {(e["factor"], e["policy"]): e for e in R.factorial_effects(recs)}
    digit_p1 = np.mean([r["correct"] for r in recs if r["cell"] == cell("digit", "p1") and r["arm"] == "leave_gaps"])
    assert eff[("answer", "leave_gaps")]["n"] == [40, 40]
    assert eff[("answer", "leave_gaps")]["mean"][0] == digit_p1
    assert eff[("prefix", "leave_gaps")]["n"] == [40, 40] and eff[("prefix", "leave_gaps")]["mean"][1] == 1.0
    assert ("filler", "leave_gaps") not in eff  # no Frankenstein counterpart ran
    d = eff[("answer", "leave_gaps-streamingllm")]
    pairs = [(a["correct"], b["correct"]) for a, b in zip(recs[:40], recs[40:80])]
    assert d["discordant"][0] == [sum(x and not y for x, y in pairs), sum(y and not x for x, y in pairs)]


def test_bad_input_is_one_line():
    r = run_script("exp_reproduce.py", "--parts", "p3", "--quick")
    assert_one_line_error(r, "unknown part")


def fake_enc():
    """A word-level stand-in for the SmolLM2 tokenizer with the same token counts on the author's strings
    (' the' one token, ' 5' = space + digit, the fact 7 tokens, the suffix 5): no tokenizer file to load."""
    import re

    vocab: dict[str, int] = {}
    return lambda s: [vocab.setdefault(p, len(vocab)) for p in re.findall(r" ?[A-Za-z]+|'s| |\d|[.]", s)]


def test_query_layout_shows_the_off_by_one_emptying_the_window():
    """On study 2's stream (16 cycles) the rank-based RSQR's window cache has been emptied by the
    off-by-one; with it fixed the window holds 24 entries; the pinned-slice bug duplicates one entry 5x."""
    enc = fake_enc()
    assert len(enc("The secret number is 5.")) == 7 and len(enc(". The secret number is")) == 5
    t = R.draw_trials("p2", enc, list(range(1000, 1024)), 16, (0,), 1)[0]
    bug, fixed = R.query_layout("C_rsqr_rank", t), R.query_layout("C_rsqr_rank_fixed", t)
    assert bug["n_window_entries"] == 0 and bug["n_survivors"] == 32
    assert fixed["n_window_entries"] == 24
    assert R.query_layout("B_uncorrected", t)["duplicated_kv"] == 5  # 5 suffix tokens -> copies of one entry
    assert R.query_layout("B_uncorrected_clean", t)["duplicated_kv"] == 0


def test_resume_keeps_only_finished_cells(tmp_path):
    """A resumed run reuses a cell only when every trial of it is on disk with the same seeds and trial
    counts; a cell cut short by a kill, or run with other counts, is dropped and rerun."""
    rng = np.random.default_rng(5)
    print("seed 5")
    rec = lambda part, arm, c, s, i, **kw: {"part": part, "arm": arm, "n_cycles": c, "seed": s, "trial": i,  # noqa: E731
                                            "correct": bool(rng.integers(2)), "logp": float(-rng.random()), **kw}
    records = [rec("p2", "B_corrected", 4, s, i) for s in (0, 1) for i in range(3)]  # complete
    records += [rec("p2", "full", 4, s, i) for s in (0, 1) for i in range(3) if (s, i) != (1, 2)]  # one trial missing
    records += [rec("p1", "A_replay", 2, s, i) for s in (0, 1) for i in range(2)]  # other trial count
    records += [rec("factorial", "leave_gaps", 4, 0, i, cell="filler=salad") for i in range(4)]  # complete
    tok = {"filler_words_single_token": True, "space_digit_is_space_then_digit": True, "query_base_tokens_by_name": {}}
    R.ReproResult({}, tok, records, [], {"p2/4/replicas": 1.0}, False).write(tmp_path)
    cfg = R.ReproConfig(seeds=(0, 1), p1_trials_per_seed=3, p2_trials_per_seed=3, factorial_trials=4)
    kept, timings = R.finished_records(tmp_path / "reproduce.json", cfg)
    assert {(r["part"], r["arm"]) for r in kept} == {("p2", "B_corrected"), ("factorial", "leave_gaps")}
    assert len(kept) == 10 and timings == {"p2/4/replicas": 1.0}
    assert R.finished_records(tmp_path / "missing.json", cfg) == ([], {})
    R.ReproResult({}, tok, kept[:6] + [rec("p2", "B_corrected", 8, 0, 0)], [], {}, True).write(tmp_path / "b")
    merged = R.merge_results([tmp_path / "reproduce.json", tmp_path / "b" / "reproduce.json"])
    assert len(merged.records) == len(records) + 1  # the first run's cells kept, the second's new cell added
    assert {(r["arm"], r["n_cycles"], r["n"]) for r in merged.summary if r["part"] == "p2"} == {
        ("B_corrected", 4, 6), ("full", 4, 5), ("B_corrected", 8, 1)}
    with pytest.raises(R.ConfigError, match="factor=level"):
        R.ReproConfig(factorial_only=("prefix=p3",)).validate()


@pytest.mark.slow
def test_quick_cli_runs_every_part(tmp_path):
    """`exp_reproduce.py --quick` (CI): a tiny random model over the SmolLM2 tokenizer through every part;
    the JSON has a summary row per arm and the tokenisation report says the author's assumptions hold. In this
    process (tests/cli.py run_in_process); test_bad_input_is_one_line runs the script as its own process."""
    import json

    r = run_in_process("exp_reproduce.py", "--quick", "--no-progress", "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    arms = {(row["part"], row["arm"]) for row in out["summary"]}
    assert {("p1", "A_replay"), ("p1", "B_leave_gap"), ("p1", "full"), ("p2", "C_rsqr_rank"),
            ("p2", "C_rsqr_two_scale"), ("p2", "rsqr"), ("factorial", "leave_gaps"),
            ("factorial", "streamingllm"), ("factorial", "full")} <= arms
    assert out["tokenisation"]["filler_words_single_token"] and out["tokenisation"]["space_digit_is_space_then_digit"]
    assert (tmp_path / "reproduce.json").is_file() and (tmp_path / "reproduce.md").is_file()
