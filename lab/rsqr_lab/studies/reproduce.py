"""Reproduce the RSQR author's two recall studies on our model, and isolate why they disagree.

The published model (Qwen2.5-0.5B-Instruct) is not available offline: everything runs on
SmolLM2-135M-Instruct (float32). The trials are drawn exactly as the author's notebooks draw them
(numpy `default_rng(seed * 1000 + n_cycles)`, the same calls in the same order), so trial i of a cell has
the author's names, numbers and filler indices; only the token ids differ.

* **P1** (study 1, README table): sinks = 6 random filler words; three facts "{Name}'s secret number is
  {d}." (distinct d in 2..8, names from Alice Bob Carol Dave Eve), one asked; 16 filler tokens per cycle
  drawn i.i.d. from 16 single-token words; the query "{Name}'s secret number is" (not pinned) and a space
  token; correct iff the argmax after the space is the digit. Window 24, block 8, one token per step,
  positions from 1. Arms: the author's replay (A), renumber + re-rotate (B corrected) and leave-gap
  (B uncorrected) with the first eviction skipped as coded, the same two with the skip removed; ours
  (`full`, `rsqr`, `rsqr_cap` through the engine, the facts pinned as sinks like the author's fact
  segment).
* **P2** (study 2, rsqr_precision_results_v1.md): sinks = the chat template's preamble through
  "<|im_start|>user\\n" (SmolLM2's own default system turn); one fact "The secret number is {d}."; a pinned
  suffix ". The secret number is" and the space token. Arms: B corrected / uncorrected with the study-2
  first eviction (evicted, counter moved back without re-rotation: a transient position collision) and the
  study-2 pinned-slice bug, the same with both removed; the author's rank-based RSQR as coded, with only
  its off-by-one fixed, with the off-by-one and the pinned slice fixed; the two-scale RSQR as coded; ours.
* **Factorial**: filler (word salad / Frankenstein) x answer (one digit by argmax / 7 digits by greedy
  text) x prefix (P1 / P2) x feeding (one token / chunks of 8) on our `leave_gaps`, `streamingllm` and
  `full` at 4, 16, 64 cycles (one stream per trial, asked at each checkpoint).

Statistics per cell: accuracy with a Wilson 95% interval, the mean log-probability of the answer token
(digit answers), and against a reference arm of the same trials a continuity-corrected McNemar p and a
paired bootstrap 95% interval of the accuracy difference.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from rsqr_lab.studies import reproduce_arms as A
from rsqr_jax.eval.runtime import ConfigError, progress, status, write_json_atomic
from rsqr_jax.eval.stats import wilson

FILLER_WORDS = ("the cat sat on mat and ran far away into town market river bridge forest path").split()
NAMES = ("Alice", "Bob", "Carol", "Dave", "Eve")
P1_CYCLES = (2, 4, 8, 12, 16)
P2_CYCLES = (2, 4, 6, 12, 16, 32, 48, 64)
FACTORIAL_CYCLES = (4, 16, 64)
WINDOW, BLOCK, CYCLE_LEN, DELTA, CAP = 24, 8, 16, 8, 16
FACTORIAL_MAX_PREFIX = 64  # the longest factorial prefix (sinks + facts): one `full` spec for every cell

# The author's published numbers (accuracy %, n = 150 for P1 and 60 for P2), for the side-by-side tables.
PUBLISHED_P1 = {  # n_cycles: (A full replay, B renumber + re-rotate, B leave gap)
    2: (88.7, 92.0, 92.0), 4: (84.0, 82.7, 90.0), 8: (90.0, 89.3, 95.3), 12: (87.3, 88.7, 96.0), 16: (90.7, 91.3, 95.3)}
PUBLISHED_P2 = {  # n_cycles: (B corrected, B uncorrected, C RSQR) accuracy %, then mean log-prob
    2: (93.3, 93.3, 80.0, -1.149, -1.149, -1.171), 4: (93.3, 61.7, 70.0, -1.012, -1.314, -1.255),
    6: (91.7, 53.3, 73.3, -1.002, -1.394, -1.198), 12: (100.0, 28.3, 78.3, -1.022, -1.752, -1.367),
    16: (96.7, 35.0, 86.7, -0.943, -1.691, -1.588), 32: (93.3, 18.3, 95.0, -1.004, -1.664, -1.064),
    64: (None, None, 0.0, None, None, None)}
PUBLISHED_P2_MCNEMAR = {  # RSQR vs B corrected: n, diff %, McNemar p, bootstrap CI %
    2: (60, -13.3, 0.039, (-25.0, -3.3)), 4: (60, -23.3, 0.001, (-36.7, -11.7)), 6: (60, -18.3, 0.007, (-30.0, -6.7)),
    12: (60, -21.7, 0.001, (-31.7, -11.7)), 16: (60, -10.0, 0.070, (-20.0, -1.7)), 32: (60, 1.7, 1.0, (-5.0, 10.0)),
    48: (37, 0.0, 1.0, (-10.8, 10.8))}

P1_REPLICA_ARMS = ("A_replay", "B_rerotate", "B_leave_gap", "B_rerotate_noskip", "B_leave_gap_noskip")
P2_REPLICA_ARMS = ("B_corrected", "B_uncorrected", "B_corrected_clean", "B_uncorrected_clean", "C_rsqr_rank",
                   "C_rsqr_rank_obo_fixed", "C_rsqr_rank_fixed", "C_rsqr_two_scale")
OURS = ("full", "rsqr", "rsqr_cap")
FACTORIAL_POLICIES = ("leave_gaps", "streamingllm", "full")


# ----------------------------------------------------------------------------------------------------
# Tokenisation and trials.


def check_tokenisation(enc: Callable[[str], list[int]]) -> dict:
    """The author's tokenisation assumptions, checked on this tokenizer (a report, never an assert)."""
    words = {w: enc(" " + w) for w in FILLER_WORDS}
    digits = {d: enc(" " + str(d)) for d in range(2, 9)}
    space = enc(" ")
    names = {n: len(enc(f"{n}'s secret number is")) for n in NAMES}
    return {
        "filler_words_single_token": all(len(v) == 1 for v in words.values()),
        "filler_word_ids": {w: v for w, v in words.items()},
        "space_id": space,
        "space_digit_is_space_then_digit": all(v == space + enc(str(d)) for d, v in digits.items()),
        "digit_ids": {d: enc(str(d)) for d in range(2, 9)},
        "query_base_tokens_by_name": names,
        "fact_tokens": len(enc("The secret number is 5.")),
        "suffix_tokens": len(enc(". The secret number is")),
    }


def _word_ids(enc) -> list[int]:
    ids = [enc(" " + w) for w in FILLER_WORDS]
    if any(len(i) != 1 for i in ids):
        raise ConfigError("a filler word is not a single token with this tokenizer: the author's filler cannot be "
                          "reproduced")
    return [i[0] for i in ids]


def p1_stream(enc, rng, n_cycles: int, cycle_len: int = CYCLE_LEN, n_facts: int = 3, sink_size: int = 6):
    """`make_multi_fact_stream_fast` of study 1: (stream of (tid, is_query, answer, pinned), fact_len, digit)."""
    ids = _word_ids(enc)
    space = enc(" ")[0]
    numbers = rng.choice(range(2, 9), size=n_facts, replace=False).tolist()
    names = rng.choice(list(NAMES), size=n_facts, replace=False).tolist()
    q = int(rng.integers(0, n_facts))
    fact_ids = [t for name, num in zip(names, numbers) for t in enc(f"{name}'s secret number is {num}.")]
    stream = [(ids[i], False, -1, False) for i in rng.integers(0, len(ids), size=sink_size)]
    stream += [(t, False, -1, False) for t in fact_ids]
    stream += [(ids[i], False, -1, False) for i in rng.integers(0, len(ids), size=n_cycles * cycle_len)]
    base = enc(f"{names[q]}'s secret number is")
    full = enc(f"{names[q]}'s secret number is {numbers[q]}")
    if full[len(base)] != space:
        raise ConfigError("' ' + digit is not a space token then a digit token with this tokenizer")
    stream += [(t, False, -1, False) for t in base] + [(space, True, full[len(base) + 1], False)]
    return stream, len(fact_ids), numbers[q]


def chat_sinks(tokenizer) -> list[int]:
    from rsqr_lab.studies.recall_setup import chat_preamble

    return chat_preamble(tokenizer)


def p2_stream(enc, sinks: list[int], rng, n_cycles: int, cycle_len: int = CYCLE_LEN):
    """`make_multi_cycle_stream_fast` of study 2 (chat-preamble sinks, one fact, pinned suffix)."""
    ids = _word_ids(enc)
    space = enc(" ")[0]
    magic = int(rng.integers(2, 9))
    fact = enc(f"The secret number is {magic}.")
    answer = enc(str(magic))[0]
    stream = [(t, False, -1, False) for t in sinks] + [(t, False, -1, False) for t in fact]
    stream += [(ids[i], False, -1, False) for i in rng.integers(0, len(ids), size=n_cycles * cycle_len)]
    stream += [(t, False, -1, True) for t in enc(". The secret number is")] + [(space, True, answer, True)]
    return stream, len(fact), magic


def draw_trials(study: str, enc, sinks, n_cycles: int, seeds, trials_per_seed: int) -> list[dict]:
    """The author's draw order: per seed, rng = default_rng(seed * 1000 + n_cycles), trials in sequence."""
    out = []
    for seed in seeds:
        rng = np.random.default_rng(seed * 1000 + n_cycles)
        for i in range(trials_per_seed):
            if study == "p1":
                stream, fact_len, num = p1_stream(enc, rng, n_cycles)
                sink_size = 6
            else:
                stream, fact_len, num = p2_stream(enc, sinks, rng, n_cycles)
                sink_size = len(sinks)
            out.append({"seed": seed, "trial": i, "stream": stream, "fact_len": fact_len, "sink_size": sink_size,
                        "number": num})
    return out


# ----------------------------------------------------------------------------------------------------
# The replica arms.


def replica_arm(name: str, t: dict) -> A.Arm:
    s, f, n = t["stream"], t["fact_len"], t["sink_size"]
    kw = dict(window=WINDOW, block=BLOCK)
    table = {
        "A_replay": lambda: A.author_replay(s, f, n, window=WINDOW, horizon=2 * WINDOW),
        "B_rerotate": lambda: A.author_b(s, f, n, correct=True, first_eviction="skip", **kw),
        "B_leave_gap": lambda: A.author_b(s, f, n, correct=False, first_eviction="skip", **kw),
        "B_rerotate_noskip": lambda: A.author_b(s, f, n, correct=True, first_eviction="normal", **kw),
        "B_leave_gap_noskip": lambda: A.author_b(s, f, n, correct=False, first_eviction="normal", **kw),
        "B_corrected": lambda: A.author_b(s, f, n, correct=True, first_eviction="collide", **kw),
        "B_uncorrected": lambda: A.author_b(s, f, n, correct=False, first_eviction="collide", **kw),
        "B_corrected_clean": lambda: A.author_b(s, f, n, correct=True, first_eviction="normal",
                                                pinned_slice_bug=False, **kw),
        "B_uncorrected_clean": lambda: A.author_b(s, f, n, correct=False, first_eviction="normal",
                                                  pinned_slice_bug=False, **kw),
        "C_rsqr_rank": lambda: A.author_rsqr_rank(s, f, n, delta=DELTA, **kw),
        "C_rsqr_rank_obo_fixed": lambda: A.author_rsqr_rank(s, f, n, delta=DELTA, fix_off_by_one=True, **kw),
        "C_rsqr_rank_fixed": lambda: A.author_rsqr_rank(s, f, n, delta=DELTA, fix_off_by_one=True,
                                                        pinned_slice_bug=False, **kw),
        "C_rsqr_two_scale": lambda: A.author_rsqr_two_scale(s, f, n, delta=DELTA, **kw),
    }
    return table[name]()


def query_layout(name: str, t: dict) -> dict:
    """What the query token of a replica arm attends to (no model: a fake step numbers the slots): how many
    entries, its position, the fact's positions and distance, duplicated K/V, shared positions."""
    arm = replica_arm(name, t)
    calls: list[A.Call] = []
    try:
        call = next(arm)
        while True:
            calls.append(call)
            call = arm.send(A.Reply(len(calls) - 1, -1, float("nan")))
    except StopIteration as done:
        res = done.value
    q = calls[-1]
    fact_slots = set(range(t["sink_size"], t["sink_size"] + t["fact_len"]))
    fact_pos = sorted(p for s, p in q.entries if s in fact_slots) if name != "A_replay" else []
    slots = [s for s, _ in q.entries]
    pos = [p for _, p in q.entries]
    return {"entries": len(q.entries), "q_pos": q.pos, "fact_pos": [fact_pos[0], fact_pos[-1]] if fact_pos else None,
            "q_minus_fact": q.pos - fact_pos[-1] if fact_pos else None, "duplicated_kv": len(slots) - len(set(slots)),
            "shared_positions": len(pos) - len(set(pos)), "model_calls": len(calls),
            **{k: v for k, v in res.items() if k.startswith("n_")}}


@dataclasses.dataclass(frozen=True)
class ReproConfig:
    """What to run. trials_per_seed x len(seeds) trials per cell (the author: 50 x 3 for P1, 20 x 3 for P2)."""

    parts: tuple = ("p1", "p2", "factorial")
    seeds: tuple = (0, 1, 2)
    p1_trials_per_seed: int = 50
    p2_trials_per_seed: int = 20
    p1_cycles: tuple = P1_CYCLES
    p2_cycles: tuple = P2_CYCLES
    p1_arms: tuple = P1_REPLICA_ARMS + OURS
    p2_arms: tuple = P2_REPLICA_ARMS + OURS
    factorial_trials: int = 24
    factorial_cycles: tuple = FACTORIAL_CYCLES
    factorial_policies: tuple = FACTORIAL_POLICIES
    factorial_only: tuple = ()  # restrict the factorial to cells matching these "factor=level" pairs
    batch: int = 48
    gen_tokens: int = 10
    quick: bool = False

    def validate(self) -> "ReproConfig":
        bad = set(self.parts) - {"p1", "p2", "factorial"}
        if bad:
            raise ConfigError(f"unknown part(s) {sorted(bad)}: choose from p1, p2, factorial")
        for name, arms, allowed in (("p1", self.p1_arms, P1_REPLICA_ARMS + OURS),
                                    ("p2", self.p2_arms, P2_REPLICA_ARMS + OURS)):
            if set(arms) - set(allowed):
                raise ConfigError(f"unknown {name} arm(s) {sorted(set(arms) - set(allowed))}: choose from "
                                  f"{', '.join(allowed)}")
        if set(self.factorial_policies) - set(FACTORIAL_POLICIES):
            raise ConfigError(f"factorial policies are {', '.join(FACTORIAL_POLICIES)}")
        for name in ("p1_trials_per_seed", "p2_trials_per_seed", "factorial_trials", "batch", "gen_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 1")
        for name in ("p1_cycles", "p2_cycles", "factorial_cycles"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be positive integers")
        if not self.seeds:
            raise ConfigError("at least one seed")
        for pair in self.factorial_only:
            factor, _, level = pair.partition("=")
            if level not in FACTORS.get(factor, ()):
                raise ConfigError(f"factorial cell filter {pair!r}: expected factor=level with "
                                  + "; ".join(f"{f} in {'/'.join(v)}" for f, v in FACTORS.items()))
        return self


def quick_config(**kw) -> ReproConfig:
    """The CI run: two trials, the smallest cycle counts, a few arms of each kind (replica, replay, engine,
    both factorial answers); the unit tests cover every replica's bookkeeping."""
    base = dict(quick=True, seeds=(0,), p1_trials_per_seed=2, p2_trials_per_seed=2, p1_cycles=(4,), p2_cycles=(2,),
                p1_arms=("A_replay", "B_leave_gap", "full"), p2_arms=("C_rsqr_rank", "C_rsqr_two_scale", "rsqr"),
                factorial_trials=2, factorial_cycles=(2,), factorial_only=("filler=salad", "prefix=p2", "feeding=8"),
                batch=8, gen_tokens=4)
    base.update(kw)
    return ReproConfig(**base).validate()


# ----------------------------------------------------------------------------------------------------
# Statistics.


def mcnemar_cc(b: int, c: int) -> float:
    """Continuity-corrected McNemar p (chi-square, 1 dof) for b vs c discordant pairs, as the author used."""
    if b + c == 0:
        return 1.0
    x = (abs(b - c) - 1) ** 2 / (b + c)
    return float(math.erfc(math.sqrt(x / 2)))


def paired_bootstrap(a, b, n: int = 4000, seed: int = 0) -> list[float]:
    """95% percentile interval of mean(a - b) over trials resampled in pairs."""
    d = np.asarray(a, float) - np.asarray(b, float)
    if len(d) < 2:
        return [float("nan"), float("nan")]
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(n, len(d)))].mean(1)
    return [float(v) for v in np.percentile(means, [2.5, 97.5])]


def cell_stats(records: list[dict]) -> dict:
    k, n = sum(r["correct"] for r in records), len(records)
    lo, hi = wilson(k, n)
    lps = [r["logp"] for r in records if r.get("logp") is not None and not math.isnan(r["logp"])]
    return {"n": n, "correct": k, "acc": k / n if n else float("nan"), "wilson": [lo, hi],
            "mean_logp": float(np.mean(lps)) if lps else None}


def paired_stats(arm: list[dict], ref: list[dict]) -> dict:
    """arm vs ref over the same trials (matched by seed and trial)."""
    key = lambda r: (r["seed"], r["trial"])  # noqa: E731
    rm = {key(r): r["correct"] for r in ref}
    pairs = [(r["correct"], rm[key(r)]) for r in arm if key(r) in rm]
    a = [p[0] for p in pairs]
    b = [p[1] for p in pairs]
    only_arm = sum(x and not y for x, y in pairs)
    only_ref = sum(y and not x for x, y in pairs)
    return {"n": len(pairs), "diff": float(np.mean(a) - np.mean(b)) if pairs else float("nan"),
            "only_arm": only_arm, "only_ref": only_ref, "mcnemar_cc_p": mcnemar_cc(only_arm, only_ref),
            "bootstrap95": paired_bootstrap(a, b)}


def summarize(records: list[dict], refs: dict[str, str]) -> list[dict]:
    """One row per (part, cell, arm, n_cycles) with its statistics and paired tests against refs[part]
    and against `full` of the same part and cell."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["part"], r.get("cell", ""), r["arm"], r["n_cycles"]), []).append(r)
    rows = []
    for (part, cell, arm, c), recs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][3], kv[0][2])):
        row = {"part": part, "cell": cell, "arm": arm, "n_cycles": c, **cell_stats(recs)}
        if "n_survivors" in recs[0]:
            row["n_exercised"] = sum(r["n_survivors"] > 0 for r in recs)
        for label, ref_arm in (("vs_ref", refs.get(part)), ("vs_full", "full")):
            ref = groups.get((part, cell, ref_arm, c))
            if ref_arm and ref and ref_arm != arm:
                row[label] = {"ref": ref_arm, **paired_stats(recs, ref)}
        rows.append(row)
    return rows


REFS = {"p1": "B_rerotate", "p2": "B_corrected", "factorial": "streamingllm"}


def _boot_diff(a, b, n: int = 4000, seed: int = 0) -> list[float]:
    """95% percentile interval of mean(a) - mean(b), independent samples resampled separately."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 2 or len(b) < 2:
        return [float("nan"), float("nan")]
    rng = np.random.default_rng(seed)
    d = a[rng.integers(0, len(a), (n, len(a)))].mean(1) - b[rng.integers(0, len(b), (n, len(b)))].mean(1)
    return [float(v) for v in np.percentile(d, [2.5, 97.5])]


def factorial_effects(records: list[dict]) -> list[dict]:
    """Main effect of each harness factor on each policy's accuracy, and on leave_gaps minus streamingllm
    (the sign the two studies disagree on), per n_cycles: level means over all cells at that level, with
    Wilson intervals and a bootstrap interval of the difference (trials differ between cells: unpaired;
    the leave_gaps - streamingllm difference is paired within a trial)."""
    recs = [r for r in records if r["part"] == "factorial"]
    out = []
    cells = {r["cell"] for r in recs}
    for factor, (l0, l1) in FACTORS.items():
        # a cell counts only when its counterpart (the same levels of the other factors) ran too: in a run
        # of some of the cells, a factor's levels would otherwise pool different mixes of the other factors
        matched = {cl for cl in cells if {cl.replace(f"{factor}={l0}", f"{factor}={l1}"),
                                          cl.replace(f"{factor}={l1}", f"{factor}={l0}")} <= cells}
        for c in sorted({r["n_cycles"] for r in recs}):
            for pol in sorted({r["arm"] for r in recs}) + ["leave_gaps-streamingllm"]:
                vals = {}
                for lev in (l0, l1):
                    sel = [r for r in recs if r["n_cycles"] == c and r["cell"] in matched
                           and f"{factor}={lev}" in r["cell"].split(",")]
                    if pol == "leave_gaps-streamingllm":
                        m = {(r["cell"], r["trial"]): r["correct"] for r in sel if r["arm"] == "streamingllm"}
                        vals[lev] = [int(r["correct"]) - int(m[(r["cell"], r["trial"])]) for r in sel
                                     if r["arm"] == "leave_gaps" and (r["cell"], r["trial"]) in m]
                    else:
                        vals[lev] = [int(r["correct"]) for r in sel if r["arm"] == pol]
                if not vals[l0] or not vals[l1]:
                    continue
                row = {"factor": factor, "n_cycles": c, "policy": pol, "levels": [l0, l1],
                       "n": [len(vals[l0]), len(vals[l1])], "mean": [float(np.mean(vals[l0])), float(np.mean(vals[l1]))],
                       "diff": float(np.mean(vals[l1]) - np.mean(vals[l0])),
                       "bootstrap95": _boot_diff(vals[l1], vals[l0])}
                if pol != "leave_gaps-streamingllm":
                    row["wilson"] = [list(wilson(sum(vals[lv]), len(vals[lv]))) for lv in (l0, l1)]
                else:  # per level: trials only leave_gaps / only streamingllm answered, and McNemar on them
                    row["discordant"] = [[vals[lv].count(1), vals[lv].count(-1)] for lv in (l0, l1)]
                    row["mcnemar_cc_p"] = [mcnemar_cc(*d) for d in row["discordant"]]
                out.append(row)
    return out


# ----------------------------------------------------------------------------------------------------
# Running.


@dataclasses.dataclass
class ReproModel:
    """What the run needs of the model (rsqr_jax never imports `models`: the caller builds these).

    apply_fn/params: the engine's model function; explicit_apply_fn: the same model with
    `reproduce_arms.explicit_attend` as its attention; config: num_layers, num_kv_heads, head_dim;
    tokenizer: encode/decode and the chat template."""

    apply_fn: Callable
    explicit_apply_fn: Callable
    params: Any
    config: Any
    tokenizer: Any


def _enc(tokenizer):
    return lambda s: tokenizer.encode(s, add_special_tokens=False)


def run_replicas(part: str, arms: list[str], trials: list[dict], n_cycles: int, model: ReproModel, step, batch: int,
                 show_progress: bool) -> list[dict]:
    """Every (trial, replica arm) as a row of the explicit-position step; replay rows apart (they make
    more model calls per stream token)."""
    jobs = [(a, t) for a in arms for t in trials]
    rows_out: list[dict] = []
    c = model.config
    for kind in ("replay", "other"):
        sel = [(a, t) for a, t in jobs if (a == "A_replay") == (kind == "replay")]
        if not sel:
            continue
        longest = max(len(t["stream"]) for _, t in sel)
        slots = -(-(longest * (4 if kind == "replay" else 1) + 2) // 256) * 256  # few distinct store shapes
        steps = longest * (3 if kind == "replay" else 1)
        with progress(steps * -(-len(sel) // batch), f"{part}/{n_cycles}/{kind}", enabled=show_progress,
                      unit="step") as bar:
            res = A.run_rows(step, model.params, [replica_arm(a, t) for a, t in sel], num_layers=c.num_layers,
                             num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, slots=slots,
                             batch=min(batch, _round8(len(sel))),
                             on_step=lambda _: bar.update())
        for (a, t), r in zip(sel, res):
            rows_out.append({"part": part, "arm": a, "n_cycles": n_cycles, "seed": t["seed"], "trial": t["trial"],
                             "number": t["number"], **r})
    return rows_out


def _policy(name: str, n_sink: int):
    from rsqr_jax.policy import make_policy

    if name == "full":
        return make_policy("full")
    if name == "rsqr":
        return make_policy("rsqr", window=WINDOW, n_sink=n_sink, delta=DELTA, max_survivors=256, block=BLOCK)
    if name == "rsqr_cap":
        return make_policy("rsqr", window=WINDOW, n_sink=n_sink, delta=DELTA, max_survivors=CAP, block=BLOCK,
                           overflow="fifo")
    if name in ("leave_gaps", "streamingllm"):
        return make_policy(name, window=WINDOW, n_sink=n_sink, block=BLOCK,
                           **({"delta": 0} if name == "leave_gaps" else {}))
    raise ValueError(name)


def _decoder(model: ReproModel, policies: list, batch: int, chunk: int, max_len: int):
    from rsqr_jax.engine import Decoder
    from rsqr_jax.spec import CacheSpec

    spec = CacheSpec.for_policies(policies, dims=model.config, batch=batch, dtype="float32", max_chunk=chunk,
                                  max_len=max_len)
    return Decoder(model.apply_fn, spec, vmap_policies=True)


def _feed(dec, params, cache, pol, ids_BxT, chunk: int, *, last_logits: bool = False):
    """Feed ids in chunks of `chunk` (the last one padded); the logits [P, B, V] of the last token when asked."""
    T = ids_BxT.shape[1]
    logits = None
    for s in range(0, T, chunk):
        part = ids_BxT[:, s:s + chunk]
        n = part.shape[1]
        if n < chunk:
            part = np.pad(part, ((0, 0), (0, chunk - n)))
        if last_logits and s + chunk >= T:
            lg, cache = dec.feed(params, part, cache, pol, n)
            logits = np.asarray(lg[:, :, n - 1])
        else:
            cache = dec.advance(params, part, cache, pol, n)
    return cache, logits


def _round8(n: int) -> int:
    """Batch sizes rounded up to a multiple of 8: little padding, few distinct compilations."""
    return -(-n // 8) * 8


def _log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), -1, keepdims=True))


def _pad(x, B):
    return x if x.shape[0] == B else np.concatenate([x, np.repeat(x[-1:], B - x.shape[0], axis=0)])


def run_ours(part: str, names: list[str], trials: list[dict], n_cycles: int, model: ReproModel, batch: int,
             show_progress: bool) -> list[dict]:
    """Our policies through the engine, one token per step like the author; the author's sink and fact
    segments are our sinks (never evicted). Trials are grouped by stream length (one cache per group)."""
    from rsqr_jax.policy import stack_policies

    out: list[dict] = []
    by_shape: dict[tuple, list[dict]] = {}
    for t in trials:
        by_shape.setdefault((len(t["stream"]), t["sink_size"] + t["fact_len"]), []).append(t)
    with progress(sum(-(-len(v) // batch) for v in by_shape.values()), f"{part}/{n_cycles}/ours",
                  enabled=show_progress, unit="batch") as bar:
        max_T = max(T for T, _ in by_shape)
        for (T, n_sink), group in by_shape.items():
            pols = [_policy(n, n_sink) for n in names]
            B = min(batch, _round8(len(group)))
            dec = _decoder(model, pols, B, 1, max_T)  # one spec per batch size for every group
            pol = stack_policies(pols)
            for lo in range(0, len(group), B):
                rows = group[lo:lo + B]
                ids = _pad(np.asarray([[x[0] for x in t["stream"]] for t in rows], np.int32), B)
                ans = np.asarray([t["stream"][-1][2] for t in rows])
                _, logits = _feed(dec, model.params, dec.init_cache(len(pols)), pol, ids, 1, last_logits=True)
                logp = _log_softmax(logits)
                for p, name in enumerate(names):
                    for j, t in enumerate(rows):
                        out.append({"part": part, "arm": name, "n_cycles": n_cycles, "seed": t["seed"],
                                    "trial": t["trial"], "number": t["number"],
                                    "correct": bool(int(np.argmax(logits[p, j])) == ans[j]),
                                    "logp": float(logp[p, j, ans[j]]), "pred": int(np.argmax(logits[p, j]))})
                bar.update()
    return out


# ----------------------------------------------------------------------------------------------------
# The factorial (our clean policies, the two harnesses' differences as factors).

FACTORS = {"filler": ("salad", "frankenstein"), "answer": ("digit", "7digit"), "prefix": ("p1", "p2"),
           "feeding": ("1", "8")}


def factorial_cells() -> list[dict]:
    import itertools

    return [dict(zip(FACTORS, v)) for v in itertools.product(*FACTORS.values())]


def _cell_name(cell: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cell.items())


def factorial_trials(enc, sinks, cell: dict, n: int, n_filler: int, book_ids: np.ndarray, seed: int) -> dict:
    """Token arrays of one factorial cell's trials (equal lengths across trials: names of one token)."""
    rng = np.random.default_rng(seed)
    words = _word_ids(enc)
    names = [x for x in NAMES + ("Tom", "Sam", "Anna", "Ben", "Mark") if len(enc(f"{x}'s")) == 2]
    space = enc(" ")[0]
    prefixes, fills, questions, numbers, answers = [], [], [], [], []
    for _ in range(n):
        if cell["prefix"] == "p1":
            chosen_names = rng.choice(names, size=3, replace=False).tolist()
            nums = ([str(d) for d in rng.choice(range(2, 9), size=3, replace=False)] if cell["answer"] == "digit"
                    else ["".join(map(str, [rng.integers(1, 10)] + list(rng.integers(0, 10, 6)))) for _ in range(3)])
            q = int(rng.integers(0, 3))
            sink = ([words[i] for i in rng.integers(0, 16, 6)] if cell["filler"] == "salad"
                    else list(book_ids[(o := int(rng.integers(0, len(book_ids) - 6))):o + 6]))
            pre = sink + [t for nm, num in zip(chosen_names, nums) for t in enc(f"{nm}'s secret number is {num}.")]
            ques = enc(f"{chosen_names[q]}'s secret number is")
            number = nums[q]
        else:
            number = (str(int(rng.integers(2, 9))) if cell["answer"] == "digit"
                      else "".join(map(str, [rng.integers(1, 10)] + list(rng.integers(0, 10, 6)))))
            pre = list(sinks) + enc(f"The secret number is {number}.")
            ques = enc(". The secret number is")
        if cell["filler"] == "salad":
            fill = [words[i] for i in rng.integers(0, 16, n_filler)]
        else:
            o = int(rng.integers(0, len(book_ids) - n_filler))
            fill = list(book_ids[o:o + n_filler])
        if cell["answer"] == "digit":
            ques = ques + [space]
        prefixes.append(pre)
        fills.append(fill)
        questions.append(ques)
        numbers.append(number)
        answers.append(enc(number)[0] if cell["answer"] == "digit" else -1)
    for what, seqs in (("prefix", prefixes), ("question", questions)):
        if len({len(s) for s in seqs}) != 1:
            raise ConfigError(f"factorial {what} lengths differ across trials")
    return {"prefix": np.asarray(prefixes, np.int32), "filler": np.asarray(fills, np.int32),
            "question": np.asarray(questions, np.int32), "numbers": numbers, "answers": np.asarray(answers)}


def run_factorial_cell(cell: dict, tr: dict, cycles, policies, model: ReproModel, batch: int, gen_tokens: int,
                       show_progress: bool) -> list[dict]:
    """One cell: one stream per trial (each policy a vmapped row), asked at every checkpoint."""
    import jax
    import jax.numpy as jnp

    from rsqr_lab.studies.recall_setup import answer_correct
    from rsqr_jax.policy import stack_policies

    chunk = int(cell["feeding"])
    n_sink = tr["prefix"].shape[1]
    T = FACTORIAL_MAX_PREFIX + tr["filler"].shape[1] + tr["question"].shape[1] + gen_tokens + chunk
    if n_sink > FACTORIAL_MAX_PREFIX:
        raise ConfigError(f"factorial prefix of {n_sink} tokens exceeds {FACTORIAL_MAX_PREFIX}")
    out = []
    groups = [("full",)] if "full" in policies else []
    bounded = tuple(p for p in policies if p != "full")
    if bounded:
        groups.insert(0, bounded)
    n = len(tr["numbers"])
    B = min(batch, n)
    for names in groups:
        pols = [_policy(p, n_sink) for p in names]
        dec = _decoder(model, pols, B, chunk, T if "full" in names else 0)
        pol = stack_policies(pols)
        for lo in range(0, n, B):
            rows = list(range(lo, min(n, lo + B)))
            pre, fil, qs = (_pad(tr[k][rows], B) for k in ("prefix", "filler", "question"))
            cache, _ = _feed(dec, model.params, dec.init_cache(len(pols)), pol, pre, chunk)
            done = 0
            for c in cycles:
                cache, _ = _feed(dec, model.params, cache, pol, fil[:, done:c * CYCLE_LEN], chunk)
                done = c * CYCLE_LEN
                fork = jax.tree.map(jnp.copy, cache)
                if cell["answer"] == "digit":
                    fork, logits = _feed(dec, model.params, fork, pol, qs, chunk, last_logits=True)
                    logp = _log_softmax(logits)
                    for p, name in enumerate(names):
                        for j, i in enumerate(rows):
                            a = int(tr["answers"][i])
                            out.append({"part": "factorial", "cell": _cell_name(cell), "arm": name, "n_cycles": c,
                                        "seed": 0, "trial": i, "correct": bool(int(np.argmax(logits[p, j])) == a),
                                        "logp": float(logp[p, j, a])})
                else:
                    gen = _generate(dec, model.params, fork, pol, qs, chunk, gen_tokens)
                    for p, name in enumerate(names):
                        for j, i in enumerate(rows):
                            text = model.tokenizer.decode([int(x) for x in gen[p, j]])
                            out.append({"part": "factorial", "cell": _cell_name(cell), "arm": name, "n_cycles": c,
                                        "seed": 0, "trial": i, "correct": answer_correct(text, tr["numbers"][i]),
                                        "logp": None, "answer": text})
                del fork
    return out


def _generate(dec, params, cache, pol, q_BxQ, chunk: int, n_gen: int) -> np.ndarray:
    """The question (in chunks of `chunk`), then greedy decoding one token per call: [P, B, n_gen] ids
    (the engine's sampler runs one policy; this loop runs the vmapped policies together)."""
    cache, logits = _feed(dec, params, cache, pol, q_BxQ, chunk, last_logits=True)
    out = []
    for k in range(n_gen):
        nxt = np.argmax(logits, -1).astype(np.int32)  # [P, B]
        out.append(nxt)
        if k + 1 < n_gen:
            cache, logits = _feed_per_policy(dec, params, cache, pol, nxt, chunk)
    return np.stack(out, -1)


def _feed_per_policy(dec, params, cache, pol, tok_PxB, chunk: int):
    """Feed one token per (policy, row): the vmapped feed takes one token array for every policy, so the
    policies' different greedy tokens go in one call each (P is 2 at most here)."""
    import jax
    import jax.numpy as jnp

    P = tok_PxB.shape[0]
    if P == 1 or (tok_PxB == tok_PxB[:1]).all():
        return _feed(dec, params, cache, pol, np.asarray(tok_PxB[0])[:, None], chunk, last_logits=True)
    logits = []
    new_cache = None
    for p in range(P):
        c, lg = _feed(dec, params, jax.tree.map(jnp.copy, cache), pol, np.asarray(tok_PxB[p])[:, None], chunk,
                      last_logits=True)
        logits.append(lg[p])
        new_cache = c if new_cache is None else jax.tree.map(
            lambda a, b, p=p: a.at[p].set(b[p]), new_cache, c)
    return new_cache, np.stack(logits)


# ----------------------------------------------------------------------------------------------------
# The run and its result.


@dataclasses.dataclass
class ReproResult:
    config: dict
    tokenisation: dict
    records: list
    summary: list
    timings: dict
    complete: bool
    layouts: list = dataclasses.field(default_factory=list)

    def as_json(self) -> dict:
        return dataclasses.asdict(self)

    def write(self, out_dir) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / "reproduce.json", self.as_json())
        (out / "reproduce.md").write_text(markdown(self), encoding="utf-8")
        return out / "reproduce.json"


def load_result(path) -> ReproResult:
    """A written reproduce.json (ConfigError, one line, when missing or unreadable)."""
    import json

    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
        return ReproResult(d["config"], d["tokenisation"], d["records"], summarize(d["records"], REFS),
                           d.get("timings", {}), d.get("complete", False), d.get("layouts", []))
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None


def merge_results(paths) -> ReproResult:
    """Several runs' reproduce.json as one result (records and layouts concatenated; a cell present in two
    runs keeps the first run's records): the tables of runs made with different trial or cycle counts."""
    results = [load_result(p) for p in paths]
    seen: set = set()
    records, layouts = [], []
    for res in results:
        groups = {(r["part"], r.get("cell", ""), r["arm"], r["n_cycles"]) for r in res.records}
        records += [r for r in res.records if (r["part"], r.get("cell", ""), r["arm"], r["n_cycles"]) not in seen]
        layouts += [x for x in res.layouts if (x["part"], "", x["arm"], x["n_cycles"]) not in seen]
        seen |= groups
    return ReproResult([r.config for r in results], results[0].tokenisation, records, summarize(records, REFS),
                       {k: v for r in results for k, v in r.timings.items()}, all(r.complete for r in results), layouts)


def finished_records(path, cfg: ReproConfig) -> tuple[list[dict], dict]:
    """The records (and timings) of an earlier run in `path` whose cells are complete for `cfg` (every
    trial of the cell present, with the same seeds and trial counts): a resumed run skips those cells and
    reruns the rest. Records of an unfinished cell are dropped."""
    if not Path(path).exists():
        return [], {}
    old = load_result(path)
    expected = {"p1": {(s, i) for s in cfg.seeds for i in range(cfg.p1_trials_per_seed)},
                "p2": {(s, i) for s in cfg.seeds for i in range(cfg.p2_trials_per_seed)},
                "factorial": {(0, i) for i in range(cfg.factorial_trials)}}
    groups: dict[tuple, list[dict]] = {}
    for r in old.records:
        groups.setdefault((r["part"], r.get("cell", ""), r["arm"], r["n_cycles"]), []).append(r)
    kept = [r for (part, *_), recs in groups.items()
            if {(r["seed"], r["trial"]) for r in recs} == expected[part] and len(recs) == len(expected[part])
            for r in recs]
    return kept, dict(old.timings)


def _done(records: list[dict], part: str, arm: str, n_cycles: int, cell: str = "") -> bool:
    return any(r["part"] == part and r["arm"] == arm and r["n_cycles"] == n_cycles and r.get("cell", "") == cell
               for r in records)


def run(cfg: ReproConfig, model: ReproModel, out_dir, *, filler_path: str | None = None,
        show_progress: bool = True, resume: bool = False) -> ReproResult:
    """Run the configured parts; writes OUT/reproduce.json (and .md) after every finished arm group and
    factorial cell, so a run killed midway keeps what it finished; `resume` reuses the finished cells of
    OUT/reproduce.json and runs only the missing ones."""
    cfg = cfg.validate()
    enc = _enc(model.tokenizer)
    tok = check_tokenisation(enc)
    sinks = chat_sinks(model.tokenizer)
    tok["p2_sink_tokens"] = len(sinks)
    step = A.make_explicit_step(model.explicit_apply_fn)
    records, timings = finished_records(Path(out_dir) / "reproduce.json", cfg) if resume else ([], {})
    if records:
        status(f"resuming: {len(records)} finished records from {out_dir}")
    result = ReproResult(dataclasses.asdict(cfg), tok, records, [], timings, False)

    def save(complete=False):
        result.summary = summarize(records, REFS)
        result.complete = complete
        result.write(out_dir)

    for part in ("p1", "p2"):
        if part not in cfg.parts:
            continue
        arms = cfg.p1_arms if part == "p1" else cfg.p2_arms
        cycles = cfg.p1_cycles if part == "p1" else cfg.p2_cycles
        per_seed = cfg.p1_trials_per_seed if part == "p1" else cfg.p2_trials_per_seed
        for c in cycles:
            trials = draw_trials(part, enc, sinks, c, cfg.seeds, per_seed)
            for a in arms:  # trial 0's query layout per replica arm (cheap: no model)
                if a not in OURS:
                    result.layouts.append({"part": part, "arm": a, "n_cycles": c, **query_layout(a, trials[0])})
            todo = [a for a in arms if not _done(records, part, a, c)]
            for kind, names in (("replicas", [a for a in todo if a not in OURS]), ("ours", [a for a in todo if a in OURS])):
                if not names:
                    continue
                t0 = time.perf_counter()
                if kind == "replicas":
                    records += run_replicas(part, names, trials, c, model, step, cfg.batch, show_progress)
                else:
                    records += run_ours(part, names, trials, c, model, cfg.batch, show_progress)
                timings[f"{part}/{c}/{kind}"] = time.perf_counter() - t0
                status(f"{part} n_cycles={c} {kind} ({len(names)} arms x {len(trials)} trials): "
                       f"{timings[f'{part}/{c}/{kind}']:.0f} s")
                save()
    if "factorial" in cfg.parts:
        from rsqr_lab.studies.recall_probe import tokenize_filler

        n_filler = max(cfg.factorial_cycles) * CYCLE_LEN
        book = tokenize_filler(model.tokenizer, filler_path, n_filler + 16) if filler_path else None
        for cell in factorial_cells():
            name = _cell_name(cell)
            if not all(pair in name.split(",") for pair in cfg.factorial_only):
                continue
            if all(_done(records, "factorial", p, c, name) for p in cfg.factorial_policies for c in cfg.factorial_cycles):
                continue
            if cell["filler"] == "frankenstein" and book is None:
                raise ConfigError("the factorial's Frankenstein cells need a filler file")
            records[:] = [r for r in records if r.get("cell", "") != name]  # a cell runs whole (one stream per trial)
            t0 = time.perf_counter()
            tr = factorial_trials(enc, sinks, cell, cfg.factorial_trials, n_filler, book, seed=1234)
            records += run_factorial_cell(cell, tr, cfg.factorial_cycles, cfg.factorial_policies, model, cfg.batch,
                                          cfg.gen_tokens, show_progress)
            timings[f"factorial/{name}"] = time.perf_counter() - t0
            status(f"factorial {name}: {time.perf_counter() - t0:.0f} s")
            save()
    save(complete=True)
    return result


# ----------------------------------------------------------------------------------------------------
# Report.


def _pct(x):
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def _row_text(r: dict) -> str:
    lo, hi = r["wilson"]
    s = f"{_pct(r['acc'])} [{_pct(lo)}, {_pct(hi)}]"
    if r.get("mean_logp") is not None:
        s += f", {r['mean_logp']:.3f}"
    return s


def _cell(rows: dict, arm: str, c: int, logp: bool = False) -> str:
    r = rows.get((arm, c))
    if r is None:
        return "—"
    lo, hi = r["wilson"]
    s = f"{_pct(r['acc'])} [{_pct(lo)}, {_pct(hi)}]"
    return s + (f" ({r['mean_logp']:.2f})" if logp and r.get("mean_logp") is not None else "")


def side_by_side(res: ReproResult) -> str:
    """The author's published tables next to ours, cell by cell (accuracy %, Wilson 95%, n)."""
    out = []
    p1 = {(r["arm"], r["n_cycles"]): r for r in res.summary if r["part"] == "p1"}
    if p1:
        ours = [a for a in ("A_replay", "B_rerotate", "B_leave_gap", "B_rerotate_noskip", "B_leave_gap_noskip",
                            "full", "rsqr", "rsqr_cap") if any(k[0] == a for k in p1)]
        out += ["### Study 1: author (Qwen2.5-0.5B, n = 150) vs ours (SmolLM2-135M)", "",
                "| n_cycles | author A replay | author B re-rotate | author B leave-gap | n | "
                + " | ".join(f"ours {a}" for a in ours) + " |", "|---:|---:|---:|---:|---:|" + "---|" * len(ours)]
        for c in sorted({k[1] for k in p1}):
            pub = PUBLISHED_P1.get(c, (None,) * 3)
            n = max(r["n"] for k, r in p1.items() if k[1] == c)
            out.append(f"| {c} | " + " | ".join("—" if v is None else f"{v:.1f}" for v in pub) + f" | {n} | "
                       + " | ".join(_cell(p1, a, c) for a in ours) + " |")
        out.append("")
    p2 = {(r["arm"], r["n_cycles"]): r for r in res.summary if r["part"] == "p2"}
    if p2:
        ours = [a for a in ("B_corrected", "B_uncorrected", "C_rsqr_rank", "B_corrected_clean", "B_uncorrected_clean",
                            "C_rsqr_rank_obo_fixed", "C_rsqr_rank_fixed", "C_rsqr_two_scale", "full", "rsqr", "rsqr_cap")
                if any(k[0] == a for k in p2)]
        out += ["### Study 2: author (Qwen2.5-0.5B, n = 60) vs ours (SmolLM2-135M); accuracy % [Wilson] (mean log-prob)",
                "", "| n_cycles | author B corrected | author B uncorrected | author C RSQR | n | "
                + " | ".join(f"ours {a}" for a in ours) + " |", "|---:|---|---|---|---:|" + "---|" * len(ours)]
        for c in sorted({k[1] for k in p2}):
            pub = PUBLISHED_P2.get(c)
            cells = (["—"] * 3 if pub is None else
                     [("—" if pub[i] is None else f"{pub[i]:.1f}") + ("" if pub[i + 3] is None else f" ({pub[i + 3]:.2f})")
                      for i in range(3)])
            n = max(r["n"] for k, r in p2.items() if k[1] == c)
            out.append(f"| {c} | " + " | ".join(cells) + f" | {n} | " + " | ".join(_cell(p2, a, c, True) for a in ours)
                       + " |")
        out += ["", "### Study 2's paired test, RSQR vs B corrected: author vs ours", "",
                "| n_cycles | author n | author diff | author McNemar p | author bootstrap 95% | ours arm | n | diff | "
                "McNemar(cc) p | paired bootstrap 95% |", "|---:|---:|---:|---:|---|---|---:|---:|---:|---|"]
        for c in sorted({k[1] for k in p2}):
            pub = PUBLISHED_P2_MCNEMAR.get(c)
            a = (f"{pub[0]} | {pub[1]:+.1f} | {pub[2]:.3f} | [{pub[3][0]:+.1f}, {pub[3][1]:+.1f}]" if pub
                 else "— | — | — | —")
            for arm in ("C_rsqr_rank", "C_rsqr_rank_fixed", "rsqr"):
                r = p2.get((arm, c))
                v = r.get("vs_ref") if r else None
                if v:
                    out.append(f"| {c} | {a} | {arm} | {v['n']} | {100 * v['diff']:+.1f} | {v['mcnemar_cc_p']:.3f} | "
                               f"[{100 * v['bootstrap95'][0]:+.1f}, {100 * v['bootstrap95'][1]:+.1f}] |")
        out.append("")
    return "\n".join(out)


def counts_table(res: ReproResult, part: str) -> str:
    """Correct / n per arm and cycle count (one compact row per n_cycles; the Wilson intervals are in the
    side-by-side and per-part tables)."""
    if part == "factorial":
        rows = {(r["cell"], r["arm"], r["n_cycles"]): r for r in res.summary if r["part"] == part}
        cols = sorted({(k[2], FACTORIAL_POLICIES.index(k[1])) for k in rows})
        cols = [(c, FACTORIAL_POLICIES[i]) for c, i in cols]
        if not cols:
            return ""
        out = ["| cell | " + " | ".join(f"{a} @{c}" for c, a in cols) + " |", "|---|" + "---:|" * len(cols)]
        for cell in sorted({k[0] for k in rows}):
            out.append(f"| {cell} | " + " | ".join(
                f"{rows[(cell, a, c)]['correct']}/{rows[(cell, a, c)]['n']}" if (cell, a, c) in rows else "—"
                for c, a in cols) + " |")
        return "\n".join(out)
    rows = {(r["arm"], r["n_cycles"]): r for r in res.summary if r["part"] == part and not r["cell"]}
    order = (P1_REPLICA_ARMS if part == "p1" else P2_REPLICA_ARMS) + OURS
    arms = [a for a in order if any(k[0] == a for k in rows)]
    if not arms:
        return ""
    out = [f"| n_cycles | {' | '.join(arms)} |", "|---:|" + "---:|" * len(arms)]
    for c in sorted({k[1] for k in rows}):
        out.append(f"| {c} | " + " | ".join(f"{rows[(a, c)]['correct']}/{rows[(a, c)]['n']}" if (a, c) in rows else "—"
                                              for a in arms) + " |")
    return "\n".join(out)


def markdown(res: ReproResult) -> str:
    """Tables: per part, accuracy % [Wilson], mean log-prob; paired tests vs the reference arm and full."""
    lines = ["# Reproduction of the RSQR author's recall studies (SmolLM2-135M-Instruct, float32)", ""]
    if not res.complete:
        lines += ["**Incomplete run** (the cells below are the finished ones).", ""]
    t = res.tokenisation
    lines += ["Tokenisation: filler words single tokens: " + str(t["filler_words_single_token"])
              + "; ' '+digit = space then digit: " + str(t["space_digit_is_space_then_digit"])
              + f"; query base tokens by name: {t['query_base_tokens_by_name']}; P2 sinks: {t.get('p2_sink_tokens')}", ""]
    for part in ("p1", "p2", "factorial"):
        table = counts_table(res, part)
        if table:
            lines += [f"## {part}: correct / n per arm", "", table, ""]
    sbs = side_by_side(res)
    if sbs:
        lines += ["## The author's tables next to ours", "", sbs, ""]
    if res.layouts:
        lines += ["## What the query attends to (trial 0 of each cell; `reproduce.query_layout`)", "",
                  "| part | arm | n_cycles | entries | query pos | fact pos | query - fact | duplicated K/V | "
                  "shared positions | counters |", "|---|---|---:|---:|---:|---|---:|---:|---:|---|"]
        for r in res.layouts:
            extra = ", ".join(f"{k}={v}" for k, v in r.items() if k.startswith("n_") and k != "n_cycles")
            lines.append(f"| {r['part']} | {r['arm']} | {r['n_cycles']} | {r['entries']} | {r['q_pos']} | "
                         f"{r['fact_pos']} | {r['q_minus_fact']} | {r['duplicated_kv']} | {r['shared_positions']} | "
                         f"{extra} |")
        lines.append("")
    effects = factorial_effects(res.records)
    if effects:
        lines += ["## Factorial main effects (accuracy %, level 0 -> level 1; diff with bootstrap 95%)", "",
                  "| factor | n_cycles | policy | level 0 | level 1 | n | diff [95%] | per level: only leave_gaps : only "
                  "streamingllm (McNemar cc p) |", "|---|---:|---|---|---|---|---|---|"]
        for e in effects:
            lines.append(f"| {e['factor']} | {e['n_cycles']} | {e['policy']} | {e['levels'][0]}: {_pct(e['mean'][0])} | "
                         f"{e['levels'][1]}: {_pct(e['mean'][1])} | {e['n'][0]}/{e['n'][1]} | {100 * e['diff']:+.1f} "
                         f"[{100 * e['bootstrap95'][0]:+.1f}, {100 * e['bootstrap95'][1]:+.1f}] | "
                         + (", ".join(f"{d[0]}:{d[1]} (p={p:.3f})" for d, p in zip(e["discordant"], e["mcnemar_cc_p"]))
                            if "discordant" in e else "") + " |")
        lines.append("")
    for part in ("p1", "p2", "factorial"):
        rows = [r for r in res.summary if r["part"] == part]
        if not rows:
            continue
        lines += [f"## {part}", "", "| cell | arm | n_cycles | n | acc % [Wilson 95%], mean logp | vs ref: diff, McNemar(cc) p, "
                  "bootstrap 95% | vs full: diff, p |", "|---|---|---:|---:|---|---|---|"]
        for r in rows:
            vr = r.get("vs_ref")
            vf = r.get("vs_full")
            ref = (f"{vr['ref']}: {100 * vr['diff']:+.1f}, p={vr['mcnemar_cc_p']:.3f}, "
                   f"[{100 * vr['bootstrap95'][0]:+.1f}, {100 * vr['bootstrap95'][1]:+.1f}]") if vr else ""
            full = f"{100 * vf['diff']:+.1f}, p={vf['mcnemar_cc_p']:.3f}" if vf else ""
            lines.append(f"| {r['cell']} | {r['arm']} | {r['n_cycles']} | {r['n']} | {_row_text(r)} | {ref} | {full} |")
        lines.append("")
    return "\n".join(lines) + "\n"
