"""Recall under streaming eviction: plant secret numbers, stream filler through a bounded cache, ask.

Protocol (every quantity is also written to recall.json under "protocol"):

* A trial plants `n_facts` facts "The secret number of NAME is DDDDDDD." (7 digits, digit = one token
  with the SmolLM2 tokenizer), then streams `n_cycles * cycle_len` filler tokens (a random slice of the
  filler text), then asks " The secret number of NAME is" for one of the facts and decodes `gen_tokens`
  tokens greedily. Correct iff the fact's digit string appears in the decoded answer.
* Streaming: the prefix and the filler are fed in chunks of `block` tokens (evict-for-space: each chunk
  attends to the cached set after the block it displaces has left); the question is one chunk, the
  answer is decoded one token per step (`Decoder.generate`). One stream per trial serves every n_cycles:
  at each checkpoint the cache is copied (the engine donates it), asked, and the stream continues from
  the un-asked cache.
* Variants: `pinned` = the facts lie inside the sinks (n_sink = length of the fact prefix, so they are
  never evicted; rank-semantics arms see them at ranks 0..N-1, leave_gaps/full at their global
  positions); `unprotected` = n_sink = 4 (the first four tokens "The secret number of"), so the digits
  survive only while in the window or as survivors (every delta-th token, rsqr), or are lost.
* Arms: full; replay, rerotate, leave_gaps, streamingllm (no survivors: delta = 0, the author's arms);
  rsqr (delta survivors, uncapped: max_survivors larger than the stream can fill); rsqr_cap (delta
  survivors, at most the cap, fifo). Every bounded arm is derived from the config's base policy, rsqr_cap's
  (window, block, delta, cap), at the variant's sinks.
* replay is evaluated on a short stream per (trial, checkpoint): the sinks plus the last filler tokens
  (at least window + 2 blocks, block-aligned with the long stream). Replay re-encodes every cached token
  from its id at each eviction, so its state depends only on the kept ids: the short stream reaches the
  same state (tests/test_exp_recall.py checks this against the long stream on a tiny model) at a
  fraction of the cost.

A run writes OUT/recall.json after every finished arm; SIGTERM or Ctrl-C keeps the finished arms (the
result is then incomplete) and `resume=True` continues such a run if its fingerprint matches.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

from rsqr_jax.policy import Policy, make_policy
from rsqr_jax.spec import ColdStore
from rsqr_lab.studies import base_policy
from rsqr_jax.eval.runtime import (ConfigError, check_memory, portable_path, progress, read_text, sigterm_interrupts,
                                   status, write_json_atomic)
from rsqr_lab.studies.recall_report import (PUBLISHED, RecallResult, load_resumable, paired, summarize,
                                                unfinished)
from rsqr_lab.studies.recall_setup import (ARMS, UNPROTECTED_SINKS, VARIANTS, Trials, answer_correct,
                                               chat_preamble, layout_of, leading_digits, make_trials, read_facts,
                                               replay_short_len)

__all__ = ["ARMS", "VARIANTS", "PUBLISHED", "RecallConfig", "RecallModel", "RecallResult", "Trials", "make_config",
           "preflight", "run", "read_facts", "make_trials", "chat_preamble", "tokenize_filler", "replay_short_len",
           "layout_of", "answer_correct", "leading_digits", "parse_int_list", "parse_choice_list", "arm_policy",
           "feed_stream", "ask", "summarize", "paired", "load_resumable", "unfinished"]


class RecallModel(NamedTuple):
    """One loaded model (per dtype): rsqr_jax never imports `models`, the caller loads it."""

    apply_fn: Callable
    params: Any
    config: Any  # num_layers, num_kv_heads, head_dim
    tokenizer: Any  # encode(text, add_special_tokens=False), decode(ids), apply_chat_template


# ----------------------------------------------------------------------------------------------------
# Configuration.

def parse_int_list(text: str, flag: str) -> list[int]:
    try:
        vals = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise ConfigError(f"{flag} must be a comma-separated list of integers, got {text!r}") from None
    if not vals or vals[0] < 1:
        raise ConfigError(f"{flag} needs positive integers, got {text!r}")
    return vals


def parse_choice_list(text: str, flag: str, choices) -> list[str]:
    vals = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in vals if v not in choices]
    if not vals or bad:
        raise ConfigError(f"{flag}: unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(choices)}")
    return list(dict.fromkeys(vals))


@dataclasses.dataclass(frozen=True, eq=False)  # holds a Policy (studies.base_policy)
class RecallConfig:
    """Everything that defines a recall study (lists resolved; `make_config` fills the defaults). policy: the
    rsqr_cap arm (window, eviction block = streaming chunk, survivor stride delta, cap), the base of every
    bounded arm (each variant sets the sinks; rsqr_recall adds recall_pages)."""

    filler: str
    trials: int = 40
    cycles: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    variants: tuple[str, ...] = VARIANTS
    arms: tuple[str, ...] = ARMS
    bf16_arms: tuple[str, ...] = ("rerotate", "streamingllm")
    bf16_cycles: tuple[int, ...] = (2, 4, 8, 16)
    unprotected_cycles: tuple[int, ...] = (2, 4)
    unprotected_arms: tuple[str, ...] = tuple(a for a in ARMS if a != "full")
    n_facts: int = 1
    facts: str | None = None
    preamble: str = "none"
    policy: Policy = base_policy.field(window=24, delta=8, max_survivors=16, block=8)
    cycle_len: int = 16
    recall_pages: int = 4  # rsqr_recall: rsqr_cap + the recall tier (DESIGN section 3b)
    cold: ColdStore = ColdStore()  # rsqr_recall's cold store (validated where it is made)
    gen_tokens: int = 10
    batch: int = 40
    seed: int = 0
    quick: bool = False
    # the model's identity (recorded in the fingerprint; the caller loads the model)
    model: str | None = None
    dtype: str = "float32"
    kernel: str = "auto"

    @property
    def chunk(self) -> int:
        return int(self.policy.block)

    @property
    def n_filler(self) -> int:
        return max(self.cycles + self.bf16_cycles + self.unprotected_cycles) * self.cycle_len

    def validate(self) -> "RecallConfig":
        for name in ("trials", "n_facts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("cycle_len", "gen_tokens", "batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        p = base_policy.check(self.policy).settings()
        if p["block"] > p["window"]:
            raise ConfigError(f"--block {p['block']} must not exceed --window {p['window']}")
        if self.gen_tokens < 2:
            raise ConfigError("--gen-tokens must be >= 2")
        if not 1 <= self.recall_pages <= self.cold.pages:
            raise ConfigError(f"--recall-pages must be in [1, {self.cold.pages}] (the cold store's pages), "
                              f"got {self.recall_pages}")
        if self.preamble not in ("none", "chat"):
            raise ConfigError(f"--preamble must be none or chat, got {self.preamble!r}")
        return self

    def plan(self) -> list[tuple[str, str, list[str], list[int]]]:
        """(variant, dtype, arms, cycles) in run order."""
        out = []
        for variant in self.variants:
            for dtype in self.dtypes:
                if variant == "unprotected" and dtype != "float32":
                    continue
                cycles = list((self.cycles if variant == "pinned" else self.unprotected_cycles)
                              if dtype == "float32" else self.bf16_cycles)
                arms = list(self.arms) if dtype == "float32" else [a for a in self.arms if a in self.bf16_arms]
                if variant == "unprotected":
                    arms = [a for a in arms if a in self.unprotected_arms]
                    if "pinned" in self.variants and "full" in self.arms:
                        arms = [a for a in arms if a != "full"]  # full ignores sinks: identical to the pinned run
                if cycles and arms:
                    out.append((variant, dtype, arms, cycles))
        return out

    def as_json(self) -> dict:
        """The "config" section of recall.json (the resolved study)."""
        keys = ("trials", "cycles", "dtypes", "variants", "arms", "bf16_arms", "n_facts", "unprotected_arms",
                "bf16_cycles", "unprotected_cycles", "quick")
        return {**{k: _jsonable(getattr(self, k)) for k in keys}, "batch": min(self.batch, self.trials)}

    def fingerprint(self) -> dict:
        """What a resumed run must share with the run it continues (the trials and what every cell means);
        arms, variants and dtypes may be added."""
        return {"model": self.model or "embedded", "dtype": self.dtype, "kernel": self.kernel,
                "filler": portable_path(self.filler), "facts": portable_path(self.facts) if self.facts else None,
                "preamble": self.preamble, "seed": self.seed, "trials": self.trials, "n_facts": self.n_facts,
                **base_policy.settings(self.policy, ("window", "block")), "cycle_len": self.cycle_len,
                "delta": int(self.policy.delta), "cap": int(self.policy.max_survivors), "gen_tokens": self.gen_tokens,
                "cycles": list(self.cycles),
                "recall": [self.recall_pages, self.cold.capacity, self.cold.page_size]
                + ([self.cold.page_score, self.cold.neighbors] if (self.cold.page_score, self.cold.neighbors)
                   != ("mean", 0) else []),  # the old 3-item key when the defaults are kept: old runs resume
                "bf16_cycles": list(self.bf16_cycles), "unprotected_cycles": list(self.unprotected_cycles),
                "quick": self.quick}


def _jsonable(v):
    return list(v) if isinstance(v, tuple) else v


def make_config(filler: str, *, quick: bool = False, trials=None, cycles=None, dtypes=None, variants=None, arms=None,
                bf16_arms=None, bf16_cycles=None, unprotected_cycles=None, unprotected_arms=None, n_facts=None,
                **fixed) -> RecallConfig:
    """A validated RecallConfig; None means the default (the --quick defaults when quick)."""
    q = quick
    cycles = list(cycles) if cycles else ([2, 4] if q else [2, 4, 8, 16, 32, 64])
    cfg = RecallConfig(
        filler=filler, quick=q,
        trials=trials if trials is not None else (4 if q else 40), cycles=tuple(cycles),
        dtypes=tuple(dtypes or (["float32"] if q else ["float32", "bfloat16"])),
        variants=tuple(variants or VARIANTS), arms=tuple(arms or ARMS),
        bf16_arms=tuple(bf16_arms or ["rerotate", "streamingllm"]),
        n_facts=n_facts if n_facts is not None else 1,
        unprotected_arms=tuple(unprotected_arms or (["streamingllm", "rsqr", "rsqr_recall"] if q else [a for a in ARMS if a != "full"])),
        bf16_cycles=tuple(bf16_cycles or [c for c in cycles if c <= 16]),
        unprotected_cycles=tuple(unprotected_cycles or [c for c in cycles if c <= 4]), **fixed)
    return cfg.validate()


def arm_policy(arm: str, cfg: RecallConfig, n_sink: int, uncapped: int) -> Policy:
    """The arm's policy at n_sink sinks, from the base (rsqr_cap's); the uncapped rsqr arm's cap is `uncapped`,
    the stream's length (a per-run value, so it is not the base policy's)."""
    if arm == "full":
        return make_policy("full")
    cap = cfg.policy.replace(mode="rsqr", n_sink=n_sink)
    if arm in ("replay", "rerotate", "leave_gaps"):
        return cap.replace(mode=arm, delta=0)
    if arm == "streamingllm":
        return cap.replace(mode="streamingllm")
    if arm == "rsqr":
        return cap.replace(max_survivors=uncapped)
    if arm == "rsqr_cap":
        return cap
    if arm == "rsqr_recall":  # the device cache of rsqr_cap plus the recalled slots
        return cap.replace(recall_pages=cfg.recall_pages)
    raise ValueError(arm)


def tokenize_filler(tokenizer, path: str, need: int) -> np.ndarray:
    """Every token of the filler text (trials take random slices of all of it, so read_tokens' prefix
    would change them)."""
    try:
        text = read_text(path)
    except ConfigError:
        raise ConfigError(f"filler file not found: {path}" if not os.path.isfile(path)
                          else f"filler file {path} is empty") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < need + 1:
        raise ConfigError(f"filler file {path} has {len(ids)} tokens; a trial needs {need}")
    return np.asarray(ids, np.int32)


# ----------------------------------------------------------------------------------------------------
# Resume.

def preflight(cfg: RecallConfig, out_dir, *, resume: bool = False) -> dict | None:
    """Checks that need no model (facts file, filler, the output's resume state); the resumed recall.json
    data (or None for a fresh run). Refuses to overwrite an unfinished run without resume."""
    if cfg.facts:
        read_facts(cfg.facts)
    if not os.path.isfile(cfg.filler):
        raise ConfigError(f"filler file not found: {cfg.filler}")
    path = Path(out_dir) / "recall.json"
    old = load_resumable(path, cfg.fingerprint()) if resume else None
    if old is None and unfinished(path):
        raise ConfigError(f"{Path(out_dir)}/recall.json holds an unfinished run: continue it with --resume, or "
                          "choose another --out")
    return old


# ----------------------------------------------------------------------------------------------------
# Streaming through the engine.

def _pad_rows(x, B):
    if x.shape[0] == B:
        return x
    return np.concatenate([x, np.repeat(x[-1:], B - x.shape[0], axis=0)])


def feed_stream(dec, params, cache, policy, ids_BxT, chunk: int):
    """Stream ids through the cache in chunks of `chunk` (the last one padded: one compilation)."""
    T = ids_BxT.shape[1]
    for s in range(0, T, chunk):
        part = ids_BxT[:, s:s + chunk]
        n = part.shape[1]
        if n < chunk:
            part = np.pad(part, ((0, 0), (0, chunk - n)))
        _, cache = dec.feed(params, part, cache, policy, n)
    return cache


def ask(dec, params, cache, policy, q_BxQ, chunk: int, n_gen: int) -> np.ndarray:
    """The question chunk, then greedy decoding: [B, n_gen] token ids. The cache is copied first (the
    engine donates it; the stream continues from the un-asked cache)."""
    import jax
    import jax.numpy as jnp

    fork = jax.tree.map(jnp.copy, cache)
    Q = q_BxQ.shape[1]
    rng = jax.random.PRNGKey(0)  # unused: greedy
    first_B, fork, rng = dec.feed_and_sample(params, np.pad(q_BxQ, ((0, 0), (0, chunk - Q))), fork, policy, Q, rng)
    out = dec.generate(params, first_B, fork, policy, rng, None, n_gen - 1, ())  # feeds n_gen - 1 tokens
    return np.concatenate([np.asarray(out.tokens_BxK[:, :n_gen - 1]), np.asarray(out.pending_B)[:, None]], axis=1)


class _Study:
    """The records, layouts and token-row count of a run, and the two ways an arm streams its trials."""

    def __init__(self, cfg: RecallConfig, models: dict, trials: Trials, show_progress: bool):
        self.cfg, self.models, self.trials, self.show_progress = cfg, models, trials, show_progress
        self.B = min(cfg.batch, cfg.trials)
        self.records: list[dict] = []
        self.layouts: list[dict] = []
        self.token_rows = 0

    def decoder(self, dtype: str, policies, max_len: int = 0):
        """A Decoder for the union spec of `policies` (equal specs share one compilation); a cold store
        only when one of them recalls."""
        from rsqr_jax.engine import Decoder
        from rsqr_jax.spec import CacheSpec

        m = self.models[dtype]
        spec = CacheSpec.for_policies(policies, dims=m.config, batch=self.B, dtype=dtype, max_chunk=self.cfg.chunk,
                                      max_len=max_len, **self.cold_store(policies))
        check_memory(spec.bytes_by_part()["total"])  # e.g. a cold store per trial row: refuse before allocating
        return Decoder(m.apply_fn, spec, gen_block=self.cfg.gen_tokens)

    def cold_store(self, policies) -> dict:
        if not any(int(np.asarray(p.recall_pages)) for p in policies):
            return {}
        return {"cold": self.cfg.cold}

    def stream_arm(self, dec, dtype, variant, arm, policy, cycles, n_sink):
        """One long stream per trial batch, asked at every checkpoint; records every trial's answer."""
        cfg, trials, B, C, L = self.cfg, self.trials, self.B, self.cfg.chunk, self.cfg.cycle_len
        params = self.models[dtype].params
        T = len(trials.numbers)
        with progress(-(-T // B) * len(cycles), f"{variant}/{dtype}/{arm}", enabled=self.show_progress,
                      unit="ask") as bar:
            for b0 in range(0, T, B):
                rows = list(range(b0, min(T, b0 + B)))
                pre, fil, qs = (_pad_rows(x[rows], B) for x in (trials.prefix, trials.filler, trials.question))
                cache = feed_stream(dec, params, dec.init_cache(), policy, pre, C)
                done = 0
                self.token_rows += B * pre.shape[1]
                for c in cycles:
                    cache = feed_stream(dec, params, cache, policy, fil[:, done:c * L], C)
                    self.token_rows += B * (c * L - done)
                    done = c * L
                    if b0 == 0:
                        self.layouts.append({"variant": variant, "dtype": dtype, "arm": arm, "n_cycles": c,
                                             **layout_of(cache, policy, "full" if arm == "full" else _mode(arm),
                                                         n_sink, trials.digit_pos)})
                    gen = ask(dec, params, cache, policy, qs, C, cfg.gen_tokens)
                    self.token_rows += B * (C + cfg.gen_tokens - 1)
                    self._record(dtype, variant, arm, c, rows, gen)
                    bar.update()

    def replay_arm(self, dec, dtype, variant, policy, cycles, n_sink):
        """Replay on short streams (see the module docstring), rows = (trial, checkpoint) pairs."""
        cfg, trials, B, C, L = self.cfg, self.trials, self.B, self.cfg.chunk, self.cfg.cycle_len
        W = int(cfg.policy.window)
        params = self.models[dtype].params
        T = len(trials.numbers)
        by_len: dict[int, list[tuple[int, int]]] = {}
        for c in cycles:
            by_len.setdefault(replay_short_len(c * L, W, C), []).extend((i, c) for i in range(T))
        with progress(sum(-(-len(p) // B) for p in by_len.values()), f"{variant}/{dtype}/replay",
                      enabled=self.show_progress, unit="ask") as bar:
            for k, pairs in by_len.items():
                for b0 in range(0, len(pairs), B):
                    group = pairs[b0:b0 + B]
                    ids = np.stack([np.concatenate([trials.prefix[i], trials.filler[i, c * L - k:c * L]])
                                    for i, c in group])
                    qs = np.stack([trials.question[i] for i, _ in group])
                    ids, qs = _pad_rows(ids, B), _pad_rows(qs, B)
                    cache = feed_stream(dec, params, dec.init_cache(), policy, ids, C)
                    self.token_rows += B * ids.shape[1]
                    # layout of trial 0's short stream (the kept set is the same for every trial)
                    for c in sorted({c for i, c in group if i == 0}):
                        if k == replay_short_len(c * L, W, C):
                            lay = layout_of(cache, policy, "replay", n_sink, trials.digit_pos)
                            lay["note"] = "short stream: t counts the short stream's tokens"
                            self.layouts.append({"variant": variant, "dtype": dtype, "arm": "replay", "n_cycles": c,
                                                 **lay})
                    gen = ask(dec, params, cache, policy, qs, C, cfg.gen_tokens)
                    self.token_rows += B * (C + cfg.gen_tokens - 1)
                    for j, (i, c) in enumerate(group):
                        self._record(dtype, variant, "replay", c, [i], gen[j:j + 1])
                    bar.update()

    def _record(self, dtype, variant, arm, c, rows, gen):
        tokenizer = self.models[dtype].tokenizer
        for j, i in enumerate(rows):
            text = tokenizer.decode([int(x) for x in gen[j]])
            num = self.trials.numbers[i]
            self.records.append({"variant": variant, "dtype": dtype, "arm": arm, "n_cycles": c, "trial": int(i),
                                 "correct": answer_correct(text, num), "digits": leading_digits(text, num),
                                 "answer": text, "number": num})


def _mode(arm: str) -> str:
    return {"rsqr_cap": "rsqr", "rsqr_recall": "rsqr"}.get(arm, arm)


# ----------------------------------------------------------------------------------------------------
# The run.

def run(cfg: RecallConfig, models: dict[str, RecallModel], out_dir, *, previous: dict | None = None,
        model_path: str | None = None, show_progress: bool = True,
        after_arm: Callable[[str, str, str], None] | None = None) -> RecallResult:
    """Run every (variant, dtype, arm) of the plan not already in `previous` (a resumed recall.json from
    `preflight`), writing OUT/recall.json after each arm. SIGTERM / KeyboardInterrupt keep the finished
    arms: the result is then incomplete (the caller exits 3). `after_arm(variant, dtype, arm)` runs after
    each finished arm is saved."""
    out_dir = Path(out_dir)
    t_start = time.perf_counter()
    tok = models[cfg.dtypes[0]].tokenizer
    n_filler = cfg.n_filler
    filler_ids = tokenize_filler(tok, cfg.filler, n_filler)
    preamble = chat_preamble(tok) if cfg.preamble == "chat" else []
    unprotected_sinks = len(preamble) + UNPROTECTED_SINKS
    facts_pool = read_facts(cfg.facts) if cfg.facts else None
    trials = make_trials(tok, cfg.trials, cfg.n_facts, filler_ids, n_filler, cfg.seed, facts_pool, preamble)
    P_len, Q_len = trials.prefix.shape[1], trials.question.shape[1]
    if Q_len > cfg.chunk:
        raise ConfigError(f"the question has {Q_len} tokens; --block must be >= {Q_len}")
    status(f"exp_recall: {cfg.trials} trials/cell, fact prefix {P_len} tokens, question {Q_len}, filler up to "
           f"{n_filler} tokens of {os.path.basename(cfg.filler)}")
    study = _Study(cfg, models, trials, show_progress)
    total_len = P_len + n_filler + cfg.chunk + cfg.gen_tokens
    uncapped = -(-total_len // max(int(cfg.policy.delta), 1)) + 2
    done_arms: list[list[str]] = []
    prior = {"runtime_s": 0.0, "token_rows": 0}
    if previous is not None:
        study.records, study.layouts, done_arms = previous["records"], previous["layout"], previous["arms_done"]
        prior = {"runtime_s": previous["runtime_s"], "token_rows": previous["token_rows"]}
        status(f"exp_recall: resuming {out_dir}/recall.json: {len(done_arms)} arm(s) done, "
               f"{len(study.records)} records")
    meta = {"model_path": model_path, "P_len": P_len, "Q_len": Q_len, "uncapped": uncapped,
            "unprotected_sinks": unprotected_sinks, "n_preamble": len(preamble), "digit_pos": trials.digit_pos,
            "arm_policies": {a: arm_policy(a, cfg, P_len, uncapped).host() for a in cfg.arms}}

    def save(complete: bool, interrupted: str | None = None) -> RecallResult:
        res = RecallResult.build(cfg, meta, study.records, study.layouts, done_arms,
                                 prior["runtime_s"] + time.perf_counter() - t_start,
                                 prior["token_rows"] + study.token_rows, complete, interrupted)
        write_json_atomic(out_dir / "recall.json", res.data)
        return res

    def run_arm(variant, dtype, arm, pols, bounded, run_len, cycles, n_sink) -> None:
        if arm == "rsqr_recall":  # its own spec (both sink counts): the cold store stays out of the others'
            dec = study.decoder(dtype, [arm_policy(arm, cfg, n, uncapped) for n in (P_len, unprotected_sinks)])
        elif cfg.quick:  # one spec (one compilation) for every other arm of the run
            allp = [arm_policy(a, cfg, n, uncapped) for a in ARMS if a != "rsqr_recall"
                    for n in (P_len, unprotected_sinks)]
            dec = study.decoder(dtype, allp, max_len=total_len)
        elif arm == "full":
            dec = study.decoder(dtype, [pols[arm]], max_len=run_len)
        elif arm == "replay":
            dec = study.decoder(dtype, [pols[arm]])
        else:
            dec = study.decoder(dtype, bounded)
        if arm == "replay":
            study.replay_arm(dec, dtype, variant, pols[arm], cycles, n_sink)
        else:
            study.stream_arm(dec, dtype, variant, arm, pols[arm], cycles, n_sink)

    running, n_rec, n_lay = None, 0, 0
    try:
        with sigterm_interrupts():  # a killed run keeps every arm it finished (see resume)
            for variant, dtype, arms, cycles in cfg.plan():
                n_sink = P_len if variant == "pinned" else unprotected_sinks
                pols = {a: arm_policy(a, cfg, n_sink, uncapped) for a in arms}
                run_len = P_len + max(cycles) * cfg.cycle_len + cfg.chunk + cfg.gen_tokens
                bounded = [pols[a] for a in arms if a not in ("full", "replay")]
                for arm in arms:
                    if [variant, dtype, arm] in done_arms:
                        continue
                    t0 = time.perf_counter()
                    n_rec, n_lay, rows0 = len(study.records), len(study.layouts), study.token_rows
                    running = f"{variant}/{dtype}/{arm}"
                    run_arm(variant, dtype, arm, pols, bounded, run_len, cycles, n_sink)
                    done_arms.append([variant, dtype, arm])
                    running = None
                    save(False)
                    accs = {r["n_cycles"]: r["acc"] for r in summarize(study.records)
                            if (r["variant"], r["dtype"], r["arm"]) == (variant, dtype, arm)}
                    status(f"  {variant:11s} {dtype:8s} {arm:12s} {time.perf_counter() - t0:6.1f}s "
                           f"({study.token_rows - rows0} token-rows)  " +
                           " ".join(f"c{c}:{100 * a:.0f}%" for c, a in sorted(accs.items())))
                    if after_arm is not None:
                        after_arm(variant, dtype, arm)
    except KeyboardInterrupt:
        if running is not None:
            del study.records[n_rec:], study.layouts[n_lay:]  # a half-run arm would be a biased cell
        res = save(False, running)
        status(f"exp_recall: interrupted{' during ' + running if running else ''}; kept the {len(done_arms)} "
               f"finished arm(s) in {out_dir}/recall.json (continue with --resume)")
        return res
    res = save(True)
    status(f"exp_recall: done in {res.data['runtime_s']:.0f}s ({res.data['token_rows']} token-rows); wrote "
           f"{out_dir}/recall.json")
    return res
