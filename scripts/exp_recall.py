#!/usr/bin/env python3
"""Recall under streaming eviction: plant secret numbers, stream filler through a bounded cache, ask.

    python scripts/exp_recall.py --quick                      # < 2 min: a smoke run of every arm (CI)
    python scripts/exp_recall.py                              # the default study (runs/exp_recall)
    python scripts/exp_recall.py --trials 100 --batch 50 --out runs/exp_recall_100   # docs/recall.md tables 1-3
    python scripts/exp_recall.py ... --resume       # continue a killed run (it keeps every finished arm)

Protocol (every quantity is also written to the output JSON under "protocol"):

* A trial plants `n_facts` facts "The secret number of NAME is DDDDDDD." (7 digits, digit = one token
  with the SmolLM2 tokenizer), then streams `n_cycles * cycle_len` filler tokens (a random slice of
  --filler), then asks " The secret number of NAME is" for one of the facts and decodes `gen_tokens`
  tokens greedily. Correct iff the fact's digit string appears in the decoded answer.
* Streaming: the prefix and the filler are fed in chunks of `block` tokens (evict-for-space: each
  chunk attends to the cached set after the block it displaces has left); the question is one chunk,
  the answer is decoded one token per step. One stream per trial serves every n_cycles: at each
  checkpoint the (immutable) cache is forked, asked, and the stream continues from the un-asked cache.
* Variants: `pinned` = the facts lie inside the sinks (n_sink = length of the fact prefix, so they are
  never evicted; rank-semantics arms see them at ranks 0..N-1, leave_gaps/full at their global
  positions); `unprotected` = n_sink = 4 (the first four tokens "The secret number of"), so the digits
  survive only while in the window or as survivors (every delta-th token, rsqr), or are lost.
* Arms: full; replay, rerotate, leave_gaps, streamingllm (no survivors: delta = 0, the author's arms);
  rsqr (delta survivors, uncapped: max_survivors larger than the stream can fill); rsqr_cap (delta
  survivors, at most `cap`, fifo).
* replay is evaluated on a short stream per (trial, checkpoint): the sinks plus the last filler
  tokens (at least window + 2 blocks, block-aligned with the long stream). Replay re-encodes every
  cached token from its id at each eviction, so its state at the checkpoint depends only on the kept
  ids: the short stream reaches the same state (tests/test_exp_recall.py checks this against the
  long stream on a tiny model) at a fraction of the cost.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import signal
import time
from pathlib import Path

from _common import (DEFAULT_TEXT, REPO_ROOT, Parser, UsageError, add_model_args, check_model_args, run_main,
                     status, write_json_atomic)

ARMS = ("full", "replay", "rerotate", "leave_gaps", "streamingllm", "rsqr", "rsqr_cap")
VARIANTS = ("pinned", "unprotected")
GLOBAL_MODES = ("full", "window", "leave_gaps")  # attention sees global positions; the others see ranks
DEFAULT_NAMES = ("Alice Bob Carol David Emma Frank Grace Henry Jack Kate Mary Nina Oscar Paul Rose Sam Tom Victor "
                 "Wendy Anna Ben Clara Daniel Eva George Hannah Ivan Julia Kevin Laura Mark Peter Rachel Simon "
                 "Walter").split()
UNPROTECTED_SINKS = 4

# The RSQR author's published tables (repository null-Exception1/auto-kv-cache-eviction; model
# Qwen2.5-0.5B-Instruct). Study 1: README.md / METHODOLOGY.md; study 2: rsqr_precision_results_v1.md.
PUBLISHED = {
    "study1": {"model": "Qwen2.5-0.5B-Instruct", "float": "float32", "sinks": 6, "window": 24, "block": 8,
               "cycle_len": 16, "trials": 150, "facts": "3 pinned facts, single digit 2-8, argmax of one token",
               "n_cycles": [4, 8, 12, 16],
               "acc": {"replay": [84.0, 90.0, 87.3, 90.7], "rerotate": [82.7, 89.3, 88.7, 91.3],
                       "leave_gaps": [90.0, 95.3, 96.0, 95.3]}},
    "study2": {"model": "Qwen2.5-0.5B-Instruct", "float": "float32", "window": 24, "block": 8, "delta": 8,
               "cycle_len": 16, "trials": 60, "facts": "one fact (pinned in the harness), argmax of one token",
               "n_cycles": [2, 4, 6, 12, 16, 32],
               "acc": {"streamingllm": [93.3, 93.3, 91.7, 100.0, 96.7, 93.3],
                       "leave_gaps": [93.3, 61.7, 53.3, 28.3, 35.0, 18.3],
                       "rsqr": [80.0, 70.0, 73.3, 78.3, 86.7, 95.0]},
               "note": "rsqr collapsed to 0% at n_cycles=64 (unbounded survivors); excluded from the table"},
}


# ----------------------------------------------------------------------------------------------------
# Small pure helpers (unit-tested without a model)

def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score 95% interval for k successes out of n (0, 1 when n == 0)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))  # exact at k = 0 and k = n


def parse_int_list(text: str, flag: str) -> list[int]:
    try:
        vals = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise UsageError(f"{flag} must be a comma-separated list of integers, got {text!r}") from None
    if not vals or vals[0] < 1:
        raise UsageError(f"{flag} needs positive integers, got {text!r}")
    return vals


def parse_choice_list(text: str, flag: str, choices) -> list[str]:
    vals = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in vals if v not in choices]
    if not vals or bad:
        raise UsageError(f"{flag}: unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(choices)}")
    return list(dict.fromkeys(vals))


def read_facts(path: str) -> list[tuple[str, str]]:
    """A facts file: JSON ([{"name": .., "number": ..}, ...] or {"NAME": "NUMBER", ...}) or text lines
    "NAME NUMBER" (blank lines and lines starting with # ignored). Numbers are digit strings, all of one
    length; names are distinct single words."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read facts file {path}: {e.strerror or e}") from None
    pairs: list[tuple[str, str]] = []
    stripped = text.strip()
    if stripped.startswith(("[", "{")):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise UsageError(f"facts file {path}: invalid JSON ({e.msg}, line {e.lineno})") from None
        if isinstance(data, dict):
            pairs = [(str(k), str(v)) for k, v in data.items()]
        else:
            for i, item in enumerate(data):
                if not isinstance(item, dict) or "name" not in item or "number" not in item:
                    raise UsageError(f"facts file {path}: item {i} must be an object with name and number")
                pairs.append((str(item["name"]), str(item["number"])))
    else:
        for ln, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise UsageError(f"facts file {path}, line {ln}: expected 'NAME NUMBER', got {line!r}")
            pairs.append((parts[0], parts[1]))
    if not pairs:
        raise UsageError(f"facts file {path} has no facts")
    for name, number in pairs:
        if not re.fullmatch(r"\d+", number):
            raise UsageError(f"facts file {path}: number {number!r} of {name!r} is not a digit string")
        if not re.fullmatch(r"\S+", name):
            raise UsageError(f"facts file {path}: name {name!r} must be one word")
    if len({len(n) for _, n in pairs}) != 1:
        raise UsageError(f"facts file {path}: all numbers must have the same number of digits")
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise UsageError(f"facts file {path}: duplicate names")
    return pairs


def answer_correct(text: str, number: str) -> bool:
    return number in text


def leading_digits(text: str, number: str) -> int:
    """How many leading digits of `number` the answer reproduces (after leading whitespace)."""
    s = text.lstrip()
    k = 0
    while k < len(number) and k < len(s) and s[k] == number[k]:
        k += 1
    return k


# ----------------------------------------------------------------------------------------------------
# Trials: token layout (identical lengths across trials, so trials batch and share cache positions)

@dataclasses.dataclass
class Trials:
    prefix: "np.ndarray"        # [T, P] fact prefix token ids
    filler: "np.ndarray"        # [T, F] filler token ids
    question: "np.ndarray"      # [T, Q]
    numbers: list               # [T] digit string asked for
    names: list                 # [T] name asked for
    queried: "np.ndarray"       # [T] index of the asked fact
    digit_pos: list             # [n_facts] list of global positions of each fact's digit tokens
    filler_offset: "np.ndarray"  # [T] token offset of the filler slice


def tokenize_filler(tokenizer, path: str, need: int) -> "np.ndarray":
    import numpy as np

    if not os.path.isfile(path):
        raise UsageError(f"filler file not found: {path}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise UsageError(f"filler file {path} is empty")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < need + 1:
        raise UsageError(f"filler file {path} has {len(ids)} tokens; a trial needs {need}")
    return np.asarray(ids, np.int32)


def chat_preamble(tokenizer) -> list[int]:
    """The chat template rendered up to the user's content (system turn + '<|im_start|>user\\n'): the
    author's study-2 sinks were this preamble of their model."""
    marker = "@@USERCONTENT@@"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    if marker not in text:
        raise UsageError("the tokenizer's chat template does not render the user's content")
    return tokenizer.encode(text[:text.index(marker)], add_special_tokens=False)


def make_trials(tokenizer, n_trials: int, n_facts: int, filler_ids, n_filler: int, seed: int,
                facts_pool: list[tuple[str, str]] | None, preamble: list[int] = ()) -> Trials:
    import numpy as np

    rng = np.random.default_rng(seed)
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    if facts_pool is None:
        names = [n for n in DEFAULT_NAMES if len(enc(" " + n)) == 1]
        if len(names) < n_facts:
            raise UsageError(f"only {len(names)} single-token default names; --n-facts {n_facts} is too many")
    elif len(facts_pool) < n_facts:
        raise UsageError(f"the facts file has {len(facts_pool)} facts; --n-facts {n_facts} needs at least that many")
    prefixes, questions, numbers, asked_names, queried, digit_pos_all, offsets = [], [], [], [], [], [], []
    for _ in range(n_trials):
        if facts_pool is None:
            chosen = [(names[i], "".join(str(d) for d in [rng.integers(1, 10)] + list(rng.integers(0, 10, 6))))
                      for i in rng.choice(len(names), n_facts, replace=False)]
        else:
            chosen = [facts_pool[i] for i in rng.choice(len(facts_pool), n_facts, replace=False)]
        ids, dpos = list(preamble), []
        for k, (name, number) in enumerate(chosen):
            head = ("The" if k == 0 else " The") + f" secret number of {name} is"
            ids += enc(head) + enc(" ")
            d = enc(number)
            dpos.append(list(range(len(ids), len(ids) + len(d))))
            ids += d + enc(".")
        q = int(rng.integers(n_facts))
        prefixes.append(ids)
        digit_pos_all.append(dpos)
        questions.append(enc(f" The secret number of {chosen[q][0]} is"))
        numbers.append(chosen[q][1])
        asked_names.append(chosen[q][0])
        queried.append(q)
        offsets.append(int(rng.integers(0, len(filler_ids) - n_filler)))
    for what, seqs in (("fact prefix", prefixes), ("question", questions)):
        if len({len(s) for s in seqs}) != 1:
            raise UsageError(f"{what} token lengths differ across trials ({sorted({len(s) for s in seqs})}): use "
                             f"names that tokenize to the same number of tokens and numbers of one length")
    if len({tuple(map(tuple, d)) for d in digit_pos_all}) != 1:
        raise UsageError("digit positions differ across trials: use names and numbers of equal token length")
    filler = np.stack([filler_ids[o:o + n_filler] for o in offsets]).astype(np.int32)
    return Trials(np.asarray(prefixes, np.int32), filler, np.asarray(questions, np.int32), numbers, asked_names,
                  np.asarray(queried), digit_pos_all[0], np.asarray(offsets))


# ----------------------------------------------------------------------------------------------------
# Arms and the jitted steps

@dataclasses.dataclass(frozen=True)
class Protocol:
    window: int
    block: int
    cycle_len: int
    delta: int
    cap: int
    gen_tokens: int
    n_facts: int

    @property
    def chunk(self) -> int:
        return self.block


def arm_policy(arm: str, proto: Protocol, n_sink: int, uncapped: int):
    from rsqr_jax.policy import make_policy

    W, b = proto.window, proto.block
    if arm == "full":
        return make_policy("full")
    if arm in ("replay", "rerotate", "leave_gaps"):
        return make_policy(arm, window=W, n_sink=n_sink, delta=0, block=b)
    if arm == "streamingllm":
        return make_policy("streamingllm", window=W, n_sink=n_sink, block=b)
    if arm == "rsqr":
        return make_policy("rsqr", window=W, n_sink=n_sink, delta=proto.delta, max_survivors=uncapped, block=b)
    if arm == "rsqr_cap":
        return make_policy("rsqr", window=W, n_sink=n_sink, delta=proto.delta, max_survivors=proto.cap, block=b,
                           overflow="fifo")
    raise ValueError(arm)


def _adv(apply_fn, params, cache, policy, tokens_BxC, n_valid):
    from rsqr_jax.update import step

    _, cache = step(apply_fn, params, tokens_BxC, cache, policy, n_valid)
    return cache


def _ask(apply_fn, n_gen, params, cache, policy, question_BxC, n_q):
    """Question chunk, then greedy decoding: [B, n_gen] token ids (the cache is forked, not donated)."""
    import jax
    import jax.numpy as jnp

    from rsqr_jax.update import step

    logits, cache = step(apply_fn, params, question_BxC, cache, policy, n_q)
    first = jnp.argmax(jnp.take(logits, n_q - 1, axis=1), axis=-1).astype(jnp.int32)

    def body(carry, _):
        tok, c = carry
        lg, c = step(apply_fn, params, tok[:, None], c, policy, 1)
        nxt = jnp.argmax(lg[:, 0], axis=-1).astype(jnp.int32)
        return (nxt, c), nxt

    _, rest = jax.lax.scan(body, (first, cache), None, length=n_gen - 1)
    return jnp.concatenate([first[:, None], rest.T], axis=1)


class Runner:
    """Jitted advance/ask for one CacheSpec (one compilation each, whatever the policy)."""

    def __init__(self, apply_fn, params, spec, n_gen: int):
        import jax

        self.params, self.spec = params, spec
        self.adv = jax.jit(functools.partial(_adv, apply_fn), donate_argnums=(1,))
        self.ask = jax.jit(functools.partial(_ask, apply_fn, n_gen))

    def feed(self, cache, policy, ids_BxT, chunk: int):
        import jax.numpy as jnp
        import numpy as np

        B, T = ids_BxT.shape
        for s in range(0, T, chunk):
            part = ids_BxT[:, s:s + chunk]
            n = part.shape[1]
            if n < chunk:
                part = np.pad(part, ((0, 0), (0, chunk - n)))
            cache = self.adv(self.params, cache, policy, jnp.asarray(part, jnp.int32), jnp.int32(n))
        return cache

    def question(self, cache, policy, q_BxQ, chunk: int):
        import jax.numpy as jnp
        import numpy as np

        Q = q_BxQ.shape[1]
        padded = np.pad(q_BxQ, ((0, 0), (0, chunk - Q)))
        return np.asarray(self.ask(self.params, cache, policy, jnp.asarray(padded, jnp.int32), jnp.int32(Q)))


def layout_of(cache, policy, mode: str, n_sink: int, digit_pos: list[list[int]]) -> dict:
    """Where each fact's digit tokens are before the question (sink / survivor / window / evicted), and
    the distance, on the arm's attention timeline, from the next position to the fact's first digit."""
    import numpy as np

    from rsqr_jax.cache import cached_positions
    from rsqr_jax.policy import window_start

    t = int(cache.t)
    kept = cached_positions(cache, policy)
    w0 = int(window_start(np.int32(t), policy.window, policy.block)) if mode != "full" else 0
    rank = {int(g): i for i, g in enumerate(kept)}
    sinks = n_sink if mode != "full" else 0
    facts = []
    for dp in digit_pos:
        where = {"sink": 0, "survivor": 0, "window": 0, "evicted": 0}
        for g in dp:
            if g not in rank:
                where["evicted"] += 1
            elif g < sinks:
                where["sink"] += 1
            elif g >= w0:
                where["window"] += 1
            else:
                where["survivor"] += 1
        kept_digits = [g for g in dp if g in rank]
        if kept_digits:  # to the first digit still cached
            g0 = kept_digits[0]
            dist = (t - g0) if mode in GLOBAL_MODES else (len(kept) - rank[g0])
        else:
            dist = None
        facts.append({"digits": where, "distance": dist})
    n_surv = int(sum(1 for g in kept if sinks <= g < w0))
    return {"t": t, "n_cached": int(len(kept)), "n_sinks": int(min(sinks, len(kept))), "n_survivors": n_surv,
            "n_window": int(sum(1 for g in kept if g >= max(w0, sinks))),
            "query_position": t if mode in GLOBAL_MODES else int(len(kept)), "facts": facts}


def replay_short_len(n_filler: int, window: int, block: int) -> int:
    """Filler tokens a replay short stream needs to reach the long stream's state after n_filler
    tokens: all of them when few, else window + 2 blocks (plus n_filler mod block, keeping alignment)."""
    lo = window + 2 * block
    if n_filler <= lo:
        return n_filler
    return n_filler - block * ((n_filler - lo) // block)


# ----------------------------------------------------------------------------------------------------
# The experiment

def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run (< 2 min): 4 trials, cycles 2,4, float32, one cache spec")
    p.add_argument("--out", default=str(REPO_ROOT / "runs" / "exp_recall"), help="output directory")
    p.add_argument("--filler", default=str(DEFAULT_TEXT), help="filler text file (default: Frankenstein)")
    p.add_argument("--facts", default=None,
                   help="facts file: lines 'NAME NUMBER' or JSON; default: built-in names, random 7-digit numbers")
    p.add_argument("--n-facts", type=int, default=None, help="facts planted per trial (default 1)")
    p.add_argument("--preamble", default="none",
                   help="none, or chat: the chat template's system turn + user header before the facts (sinks)")
    p.add_argument("--trials", type=int, default=None, help="trials per cell")
    p.add_argument("--cycles", default=None, help="n_cycles checkpoints, e.g. 2,4,8,16,32,64")
    p.add_argument("--dtypes", default=None, help="float32 and/or bfloat16 (comma-separated)")
    p.add_argument("--variants", default=None, help="pinned and/or unprotected")
    p.add_argument("--arms", default=None, help=f"subset of {','.join(ARMS)}")
    p.add_argument("--bf16-arms", default=None, help="arms run in bfloat16 (default: rerotate,streamingllm)")
    p.add_argument("--bf16-cycles", default=None, help="n_cycles checkpoints in bfloat16 (default: up to 16)")
    p.add_argument("--unprotected-cycles", default=None, help="n_cycles for the unprotected variant (default: <= 4)")
    p.add_argument("--unprotected-arms", default=None, help="arms of the unprotected variant (default: all)")
    p.add_argument("--window", type=int, default=24)
    p.add_argument("--block", type=int, default=8, help="eviction block = streaming chunk")
    p.add_argument("--cycle-len", type=int, default=16, help="filler tokens per cycle")
    p.add_argument("--delta", type=int, default=8, help="rsqr survivor stride")
    p.add_argument("--cap", type=int, default=16, help="rsqr_cap max_survivors")
    p.add_argument("--gen-tokens", type=int, default=10, help="greedy answer tokens")
    p.add_argument("--batch", type=int, default=40, help="trials per batch (rows of one forward)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--from-json", default=None, help="re-plot and print the table of an existing recall.json")
    p.add_argument("--resume", action="store_true",
                   help="continue OUT/recall.json written by an interrupted run: arms it finished are kept, the "
                        "rest run (the settings must match)")
    add_model_args(p)
    return p


def resolve_config(args) -> dict:
    q = args.quick
    cfg = {
        "trials": args.trials if args.trials is not None else (4 if q else 40),
        "cycles": parse_int_list(args.cycles, "--cycles") if args.cycles else ([2, 4] if q else [2, 4, 8, 16, 32, 64]),
        "dtypes": parse_choice_list(args.dtypes, "--dtypes", ("float32", "bfloat16")) if args.dtypes
        else (["float32"] if q else ["float32", "bfloat16"]),
        "variants": parse_choice_list(args.variants, "--variants", VARIANTS) if args.variants else list(VARIANTS),
        "arms": parse_choice_list(args.arms, "--arms", ARMS) if args.arms else list(ARMS),
        "bf16_arms": parse_choice_list(args.bf16_arms, "--bf16-arms", ARMS) if args.bf16_arms
        else ["rerotate", "streamingllm"],
        "n_facts": args.n_facts if args.n_facts is not None else 1,
    }
    cfg["unprotected_arms"] = (parse_choice_list(args.unprotected_arms, "--unprotected-arms", ARMS)
                               if args.unprotected_arms else
                               (["streamingllm", "rsqr"] if q else [a for a in ARMS if a != "full"]))
    cfg["bf16_cycles"] = (parse_int_list(args.bf16_cycles, "--bf16-cycles") if args.bf16_cycles
                          else [c for c in cfg["cycles"] if c <= 16])
    cfg["unprotected_cycles"] = (parse_int_list(args.unprotected_cycles, "--unprotected-cycles")
                                 if args.unprotected_cycles else [c for c in cfg["cycles"] if c <= 4])
    for name in ("trials", "n_facts"):
        if cfg[name] < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {cfg[name]}")
    for name in ("window", "block", "cycle_len", "gen_tokens", "batch", "cap"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.delta < 0:
        raise UsageError(f"--delta must be >= 0, got {args.delta}")
    if args.block > args.window:
        raise UsageError(f"--block {args.block} must not exceed --window {args.window}")
    if args.gen_tokens < 2:
        raise UsageError("--gen-tokens must be >= 2")
    return cfg


class Experiment:
    def __init__(self, args, cfg, loaded_by_dtype, proto: Protocol):
        self.args, self.cfg, self.proto = args, cfg, proto
        self.loaded = loaded_by_dtype
        self.runners: dict = {}
        self.records: list[dict] = []
        self.layouts: list[dict] = []
        self.token_rows = 0

    def runner(self, dtype: str, key: str, policies, max_len: int = 0):
        from rsqr_jax.spec import CacheSpec

        if (dtype, key) not in self.runners:
            lm, apply_fn, params = self.loaded[dtype]
            c = lm.config
            spec = CacheSpec.for_policies(policies, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                                          head_dim=c.head_dim, batch=self.args.batch, dtype=dtype,
                                          max_chunk=self.proto.chunk, max_len=max_len)
            self.runners[(dtype, key)] = Runner(apply_fn, params, spec, self.proto.gen_tokens)
        return self.runners[(dtype, key)]

    @staticmethod
    def _pad_rows(x, B):
        import numpy as np

        if x.shape[0] == B:
            return x
        return np.concatenate([x, np.repeat(x[-1:], B - x.shape[0], axis=0)])

    def run_stream_arm(self, dtype, variant, arm, policy, runner, trials, cycles, n_sink):
        """One long stream per trial batch, forked at every checkpoint; records every trial's answer."""
        from rsqr_jax.cache import init_cache

        lm = self.loaded[dtype][0]
        B, C, L = self.args.batch, self.proto.chunk, self.proto.cycle_len
        T = len(trials.numbers)
        for b0 in range(0, T, B):
            rows = list(range(b0, min(T, b0 + B)))
            pre = self._pad_rows(trials.prefix[rows], B)
            fil = self._pad_rows(trials.filler[rows], B)
            qs = self._pad_rows(trials.question[rows], B)
            cache = runner.feed(init_cache(runner.spec), policy, pre, C)
            done = 0
            self.token_rows += B * pre.shape[1]
            for c in cycles:
                cache = runner.feed(cache, policy, fil[:, done:c * L], C)
                self.token_rows += B * (c * L - done)
                done = c * L
                if b0 == 0:
                    self.layouts.append({"variant": variant, "dtype": dtype, "arm": arm, "n_cycles": c,
                                         **layout_of(cache, policy, "full" if arm == "full" else _mode(arm),
                                                     n_sink, trials.digit_pos)})
                gen = runner.question(cache, policy, qs, C)
                self.token_rows += B * (C + self.proto.gen_tokens - 1)
                self._record(dtype, variant, arm, c, rows, gen, trials, lm.tokenizer)

    def run_replay(self, dtype, variant, policy, runner, trials, cycles, n_sink):
        """Replay on short streams (see the module docstring), rows = (trial, checkpoint) pairs."""
        import numpy as np

        from rsqr_jax.cache import init_cache

        lm = self.loaded[dtype][0]
        B, C, L, W = self.args.batch, self.proto.chunk, self.proto.cycle_len, self.proto.window
        T = len(trials.numbers)
        by_len: dict[int, list[tuple[int, int]]] = {}
        for c in cycles:
            k = replay_short_len(c * L, W, self.proto.block)
            by_len.setdefault(k, []).extend((i, c) for i in range(T))
        for k, pairs in by_len.items():
            for b0 in range(0, len(pairs), B):
                group = pairs[b0:b0 + B]
                ids = np.stack([np.concatenate([trials.prefix[i], trials.filler[i, c * L - k:c * L]])
                                for i, c in group])
                qs = np.stack([trials.question[i] for i, _ in group])
                ids, qs = self._pad_rows(ids, B), self._pad_rows(qs, B)
                cache = runner.feed(init_cache(runner.spec), policy, ids, C)
                self.token_rows += B * ids.shape[1]
                firsts = {c: j for j, (i, c) in enumerate(group) if i == 0}
                if firsts:  # layout of trial 0's short stream (the kept set is the same for every trial)
                    for c in sorted(firsts):
                        if k == replay_short_len(c * L, W, self.proto.block):
                            lay = layout_of(cache, policy, "replay", n_sink, trials.digit_pos)
                            lay["note"] = "short stream: t counts the short stream's tokens"
                            self.layouts.append({"variant": variant, "dtype": dtype, "arm": "replay", "n_cycles": c,
                                                 **lay})
                gen = runner.question(cache, policy, qs, C)
                self.token_rows += B * (C + self.proto.gen_tokens - 1)
                for j, (i, c) in enumerate(group):
                    self._record(dtype, variant, "replay", c, [i], gen[j:j + 1], trials, lm.tokenizer)

    def _record(self, dtype, variant, arm, c, rows, gen, trials, tokenizer):
        for j, i in enumerate(rows):
            text = tokenizer.decode([int(x) for x in gen[j]])
            num = trials.numbers[i]
            self.records.append({"variant": variant, "dtype": dtype, "arm": arm, "n_cycles": c, "trial": int(i),
                                 "correct": answer_correct(text, num), "digits": leading_digits(text, num),
                                 "answer": text, "number": num})


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value for b vs c discordant pairs."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(0, min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired(records: list[dict], ref: str = "streamingllm") -> list[dict]:
    """Every arm vs `ref` on the same trials (all arms of a cell share the trials): discordant counts."""
    by = {}
    for r in records:
        by.setdefault((r["variant"], r["dtype"], r["n_cycles"], r["trial"]), {})[r["arm"]] = r["correct"]
    cells: dict[tuple, list[int]] = {}
    for (variant, dtype, c, _), arms in by.items():
        if ref not in arms:
            continue
        for arm, ok in arms.items():
            if arm == ref:
                continue
            d = cells.setdefault((variant, dtype, arm, c), [0, 0, 0])
            d[0] += ok and not arms[ref]
            d[1] += arms[ref] and not ok
            d[2] += 1
    return [{"variant": v, "dtype": dt, "arm": a, "ref": ref, "n_cycles": c, "pairs": n, "arm_only": b,
             "ref_only": k, "mcnemar_p": mcnemar_p(b, k)}
            for (v, dt, a, c), (b, k, n) in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                                   ARMS.index(kv[0][2]), kv[0][3]))]


def _mode(arm: str) -> str:
    return {"rsqr_cap": "rsqr"}.get(arm, arm)


def summarize(records: list[dict]) -> list[dict]:
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        cells.setdefault((r["variant"], r["dtype"], r["arm"], r["n_cycles"]), []).append(r)
    out = []
    for (variant, dtype, arm, c), rs in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                               ARMS.index(kv[0][2]), kv[0][3])):
        k, n = sum(r["correct"] for r in rs), len(rs)
        lo, hi = wilson(k, n)
        out.append({"variant": variant, "dtype": dtype, "arm": arm, "n_cycles": c, "trials": n, "correct": k,
                    "acc": k / n, "wilson_lo": lo, "wilson_hi": hi,
                    "mean_leading_digits": sum(r["digits"] for r in rs) / n})
    return out


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(s["variant"], s["dtype"]) for s in summary},
                    key=lambda p: (VARIANTS.index(p[0]), ("float32", "bfloat16").index(p[1])))
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4.2 * (len(panels) + 1), 3.6), squeeze=False)
    colors = dict(zip(ARMS, ["black", "tab:purple", "tab:orange", "tab:red", "tab:blue", "tab:green", "tab:olive"]))
    for ax, (variant, dtype) in zip(axes[0], panels):
        for arm in ARMS:
            rows = [s for s in summary if (s["variant"], s["dtype"], s["arm"]) == (variant, dtype, arm)]
            if not rows:
                continue
            x = [r["n_cycles"] * 2 ** (0.035 * (ARMS.index(arm) - 3)) for r in rows]  # jitter: visible overlaps
            y = [100 * r["acc"] for r in rows]
            err = [[max(0.0, 100 * (r["acc"] - r["wilson_lo"])) for r in rows],
                   [max(0.0, 100 * (r["wilson_hi"] - r["acc"])) for r in rows]]
            ax.errorbar(x, y, yerr=err, marker="o", ms=3, capsize=2, lw=1, color=colors[arm], label=arm)
        n = max(s["trials"] for s in summary if (s["variant"], s["dtype"]) == (variant, dtype))
        ax.set_title(f"{variant}, {dtype} (n={n}/cell)", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-3, 103)
        ax.set_xlabel("n_cycles")
        ax.set_ylabel("recall accuracy % (Wilson 95%)")
        ax.grid(alpha=0.3)
    busiest = max(range(len(panels)), key=lambda i: len({s["arm"] for s in summary
                                                          if (s["variant"], s["dtype"]) == panels[i]}))
    axes[0][busiest].legend(fontsize=7, loc="lower left")
    ax = axes[0][-1]
    for study, style in (("study1", "--"), ("study2", ":")):
        d = PUBLISHED[study]
        for arm, ys in d["acc"].items():
            ax.plot(d["n_cycles"], ys, style, marker="s", ms=3, color=colors[arm], label=f"{study} {arm}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-3, 103)
    ax.set_title("published (Qwen2.5-0.5B, author's harness)", fontsize=9)
    ax.set_xlabel("n_cycles")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> int:
    args = build_parser().parse_args()
    if args.from_json:
        try:
            data = json.loads(Path(args.from_json).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"cannot read {args.from_json}: {e}") from None
        outdir = Path(args.out)
        outdir.mkdir(parents=True, exist_ok=True)
        if not args.no_plot:
            plot(data["summary"], outdir / "recall.png")
        print(table(data["summary"]))
        if data.get("records"):
            print(paired_table(paired(data["records"])))
        print(layout_table(data.get("layout", [])))
        return 0
    check_model_args(args)
    cfg = resolve_config(args)
    if args.preamble not in ("none", "chat"):
        raise UsageError(f"--preamble must be none or chat, got {args.preamble!r}")
    facts_pool = read_facts(args.facts) if args.facts else None
    if not os.path.isfile(args.filler):
        raise UsageError(f"filler file not found: {args.filler}")
    proto = Protocol(args.window, args.block, args.cycle_len, args.delta, args.cap, args.gen_tokens, cfg["n_facts"])
    outdir = Path(args.out)
    fingerprint = run_fingerprint(args, cfg)
    old = load_resumable(outdir / "recall.json", fingerprint) if args.resume else None
    if old is None and unfinished(outdir / "recall.json"):
        raise UsageError(f"{outdir}/recall.json holds an unfinished run: continue it with --resume, or choose "
                         "another --out")
    t_start = time.perf_counter()

    from models.llama import load_model, split_apply

    dtypes_needed = [d for d in cfg["dtypes"]]
    loaded = {}
    for d in dtypes_needed:
        lm = load_model(args.model, d)
        apply_fn, params = split_apply(lm.model, kernel=args.kernel)
        loaded[d] = (lm, apply_fn, params)
    tok = loaded[dtypes_needed[0]][0].tokenizer
    max_cycles = max(cfg["cycles"] + cfg["bf16_cycles"] + cfg["unprotected_cycles"])
    n_filler = max_cycles * proto.cycle_len
    filler_ids = tokenize_filler(tok, args.filler, n_filler)
    preamble = chat_preamble(tok) if args.preamble == "chat" else []
    unprotected_sinks = len(preamble) + UNPROTECTED_SINKS
    trials = make_trials(tok, cfg["trials"], cfg["n_facts"], filler_ids, n_filler, args.seed, facts_pool, preamble)
    P_len, Q_len = trials.prefix.shape[1], trials.question.shape[1]
    if Q_len > proto.chunk:
        raise UsageError(f"the question has {Q_len} tokens; --block must be >= {Q_len}")
    status(f"exp_recall: {cfg['trials']} trials/cell, fact prefix {P_len} tokens, question {Q_len}, filler up to "
           f"{n_filler} tokens of {os.path.basename(args.filler)}")

    args.batch = min(args.batch, cfg["trials"])
    exp = Experiment(args, cfg, loaded, proto)
    plan = []
    for variant in cfg["variants"]:
        for dtype in cfg["dtypes"]:
            if variant == "unprotected" and dtype != "float32":
                continue
            cycles = (cfg["cycles"] if variant == "pinned" else cfg["unprotected_cycles"]) if dtype == "float32" \
                else cfg["bf16_cycles"]
            arms = cfg["arms"] if dtype == "float32" else [a for a in cfg["arms"] if a in cfg["bf16_arms"]]
            if variant == "unprotected":
                arms = [a for a in arms if a in cfg["unprotected_arms"]]
                if "pinned" in cfg["variants"] and "full" in cfg["arms"]:
                    arms = [a for a in arms if a != "full"]  # full ignores sinks: identical to the pinned run
            if cycles and arms:
                plan.append((variant, dtype, arms, cycles))
    total_len = P_len + n_filler + proto.chunk + proto.gen_tokens
    uncapped = -(-total_len // max(proto.delta, 1)) + 2
    done_arms: list[list[str]] = []
    prior = {"runtime_s": 0.0, "token_rows": 0}
    if old is not None:
        exp.records, exp.layouts, done_arms = old["records"], old["layout"], old["arms_done"]
        prior = {"runtime_s": old["runtime_s"], "token_rows": old["token_rows"]}
        status(f"exp_recall: resuming {outdir}/recall.json: {len(done_arms)} arm(s) done, {len(exp.records)} records")

    def save(complete: bool, interrupted: str | None = None) -> dict:
        out = build_output(args, cfg, proto, trials, loaded[dtypes_needed[0]][0], P_len, Q_len, uncapped,
                           unprotected_sinks, len(preamble), exp, fingerprint, done_arms,
                           prior["runtime_s"] + time.perf_counter() - t_start, prior["token_rows"], complete,
                           interrupted)
        write_json_atomic(outdir / "recall.json", out)
        return out

    def run_arm(variant, dtype, arm, pols, bounded, run_len, cycles, n_sink) -> None:
        """Pick the arm's compiled runner (one per cache spec) and stream every trial through it."""
        if args.quick:  # one spec (one compilation) for every arm of the run
            allp = [arm_policy(a, proto, n, uncapped) for a in ARMS for n in (P_len, unprotected_sinks)]
            runner = exp.runner(dtype, "all", allp, max_len=total_len)
        elif arm == "full":
            runner = exp.runner(dtype, f"full{run_len}", [pols[arm]], max_len=run_len)
        elif arm == "replay":
            runner = exp.runner(dtype, f"replay{variant}", [pols[arm]])
        else:
            runner = exp.runner(dtype, "bounded" + variant, bounded)
        if arm == "replay":
            exp.run_replay(dtype, variant, pols[arm], runner, trials, cycles, n_sink)
        else:
            exp.run_stream_arm(dtype, variant, arm, pols[arm], runner, trials, cycles, n_sink)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)  # a killed run keeps every arm it finished (see --resume)
    running, n_rec, n_lay = None, 0, 0
    try:
        for variant, dtype, arms, cycles in plan:
            n_sink = P_len if variant == "pinned" else unprotected_sinks
            pols = {a: arm_policy(a, proto, n_sink, uncapped) for a in arms}
            run_len = P_len + max(cycles) * proto.cycle_len + proto.chunk + proto.gen_tokens
            bounded = [pols[a] for a in arms if a not in ("full", "replay")]
            for arm in arms:
                if [variant, dtype, arm] in done_arms:
                    continue
                t0 = time.perf_counter()
                n_rec, n_lay, rows0 = len(exp.records), len(exp.layouts), exp.token_rows
                running = f"{variant}/{dtype}/{arm}"
                run_arm(variant, dtype, arm, pols, bounded, run_len, cycles, n_sink)
                done_arms.append([variant, dtype, arm])
                running = None
                save(False)
                dt = time.perf_counter() - t0
                accs = {r["n_cycles"]: r["acc"] for r in summarize(exp.records)
                        if (r["variant"], r["dtype"], r["arm"]) == (variant, dtype, arm)}
                status(f"  {variant:11s} {dtype:8s} {arm:12s} {dt:6.1f}s ({exp.token_rows - rows0} token-rows)  " +
                       " ".join(f"c{c}:{100 * a:.0f}%" for c, a in sorted(accs.items())))
    except KeyboardInterrupt:
        if running is not None:
            del exp.records[n_rec:], exp.layouts[n_lay:]  # a half-run arm would be a biased cell
        save(False, running)
        status(f"exp_recall: interrupted{' during ' + running if running else ''}; kept the {len(done_arms)} "
               f"finished arm(s) in {outdir}/recall.json (continue with --resume)")
        return 3

    out = save(True)
    summary, elapsed = out["summary"], out["runtime_s"]
    if not args.no_plot:
        plot(summary, outdir / "recall.png")
    status(f"exp_recall: done in {elapsed:.0f}s ({out['token_rows']} token-rows); wrote {outdir}/recall.json")
    print(table(summary))
    print(paired_table(out["paired_vs_streamingllm"]))
    print(layout_table(exp.layouts))
    return 0


def run_fingerprint(args, cfg: dict) -> dict:
    """What a resumed run must share with the run it continues (the trials and what every cell means);
    arms, variants and dtypes may be added."""
    return {"model": args.model or "embedded", "dtype": args.dtype, "kernel": args.kernel,
            "filler": os.path.abspath(args.filler), "facts": os.path.abspath(args.facts) if args.facts else None,
            "preamble": args.preamble, "seed": args.seed, "trials": cfg["trials"], "n_facts": cfg["n_facts"],
            "window": args.window, "block": args.block, "cycle_len": args.cycle_len, "delta": args.delta,
            "cap": args.cap, "gen_tokens": args.gen_tokens, "cycles": cfg["cycles"], "bf16_cycles": cfg["bf16_cycles"],
            "unprotected_cycles": cfg["unprotected_cycles"], "quick": args.quick}


def load_resumable(path: Path, fingerprint: dict) -> dict:
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"--resume: cannot read {path}: {e}") from None
    if "fingerprint" not in old or "arms_done" not in old:
        raise UsageError(f"--resume: {path} was written without resume data (an older run); start a fresh --out")
    diff = [k for k in fingerprint if old["fingerprint"].get(k) != fingerprint[k]]
    if diff:
        k = diff[0]
        raise UsageError(f"--resume: {path} was run with {k}={old['fingerprint'].get(k)!r}, this run has "
                         f"{fingerprint[k]!r}" + (f" (and {len(diff) - 1} more setting(s) differ)" if len(diff) > 1
                                                   else ""))
    return old


def unfinished(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("complete") is False
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def build_output(args, cfg, proto, trials, lm0, P_len, Q_len, uncapped, unprotected_sinks, n_preamble, exp,
                 fingerprint, arms_done, elapsed, prior_rows, complete, interrupted) -> dict:
    """recall.json: protocol, summary (Wilson CIs), paired tests, layouts and every trial's record."""
    summary = summarize(exp.records)
    if "pinned" in cfg["variants"] and "unprotected" in cfg["variants"] and "full" in cfg["arms"]:
        for s in [s for s in summary if s["variant"] == "pinned" and s["arm"] == "full" and s["dtype"] == "float32"]:
            if s["n_cycles"] in cfg["unprotected_cycles"]:
                summary.append({**s, "variant": "unprotected", "shared_with": "pinned"})
    return {
        "model": {"path": lm0.path, "name": "SmolLM2-135M-Instruct (embedded GGUF)" if args.model is None else args.model},
        "protocol": {
            "cycle_len": proto.cycle_len, "cycle_definition": "one cycle = cycle_len filler tokens",
            "window": proto.window, "block": proto.block, "chunk": proto.chunk,
            "window_semantics": "the window keeps window..window+block-1 most recent tokens (DESIGN section 3)",
            "delta": proto.delta, "rsqr_uncapped_max_survivors": uncapped, "rsqr_cap_max_survivors": proto.cap,
            "overflow": "fifo",
            "sinks": {"pinned": P_len, "unprotected": unprotected_sinks},
            "preamble": args.preamble, "preamble_tokens": n_preamble,
            "pinned_definition": "n_sink = fact prefix length (preamble + facts): every fact token is a sink, never "
                                 "evicted",
            "unprotected_definition": f"n_sink = preamble + {UNPROTECTED_SINKS} ('The secret number of'): digits "
                                      "survive only in the window or as survivors",
            "n_facts": proto.n_facts, "fact_prefix_tokens": P_len, "question_tokens": Q_len,
            "fact_template": "The secret number of NAME is DDDDDDD.",
            "question_template": " The secret number of NAME is", "gen_tokens": proto.gen_tokens,
            "correct": "the asked number's digit string appears in the greedy answer",
            "digit_positions": trials.digit_pos,
            "arm_policies": {a: arm_policy(a, proto, P_len, uncapped).host() for a in cfg["arms"]},
            "filler": os.path.abspath(args.filler), "facts": os.path.abspath(args.facts) if args.facts else "built-in",
            "replay_evaluation": "short stream per (trial, checkpoint): sinks + last filler tokens (block-aligned)",
            "seed": args.seed,
        },
        "config": {**cfg, "quick": args.quick, "batch": args.batch},
        "complete": complete,
        "interrupted_during": interrupted,
        "arms_done": list(arms_done),
        "fingerprint": fingerprint,
        "summary": summary,
        "paired_vs_streamingllm": paired(exp.records),
        "layout": exp.layouts,
        "published": PUBLISHED,
        "runtime_s": elapsed,
        "token_rows": prior_rows + exp.token_rows,
        "records": exp.records,
    }


def arm_cycle_table(title: str, rows: list[dict], fmt) -> list[str]:
    """One markdown table: an arm per row, an n_cycles per column, fmt(row) in each cell."""
    cyc = sorted({r["n_cycles"] for r in rows})
    lines = [f"\n{title}", "| arm | " + " | ".join(f"c={c}" for c in cyc) + " |", "|---|" + "---|" * len(cyc)]
    for arm in ARMS:
        cells = {r["n_cycles"]: r for r in rows if r["arm"] == arm}
        if cells:
            lines.append(f"| {arm} | " + " | ".join(fmt(cells[c]) if c in cells else "" for c in cyc) + " |")
    return lines


def paired_table(rows: list[dict]) -> str:
    """Discordant pairs vs streamingllm: 'arm-only correct / streamingllm-only correct (exact McNemar p)'."""
    lines = []
    for variant in VARIANTS:
        for dtype in ("float32", "bfloat16"):
            sub = [r for r in rows if r["variant"] == variant and r["dtype"] == dtype]
            if sub:
                lines += arm_cycle_table(
                    f"{variant}, {dtype}: paired vs streamingllm, arm-only / streamingllm-only correct (p)", sub,
                    lambda r: f"{r['arm_only']}/{r['ref_only']} ({r['mcnemar_p']:.2g})")
    return "\n".join(lines)


def layout_table(layouts: list[dict]) -> str:
    """Per arm and n_cycles (float32): 'distance / survivors / digits', digits as counts of
    s(ink) v (survivor) w(indow) e(victed) for the first fact; distance '-' when every digit is gone."""

    def fmt(ly):
        f = ly["facts"][0]
        d = "".join(f"{v}{k[0] if k != 'survivor' else 'v'}" for k, v in f["digits"].items() if v)
        return f"{'-' if f['distance'] is None else f['distance']} / {ly['n_survivors']} / {d}"

    lines = []
    for variant in VARIANTS:
        sub = [ly for ly in layouts if ly["variant"] == variant and ly["dtype"] == "float32"]
        if sub:
            lines += arm_cycle_table(
                f"{variant}, float32: fact distance / survivors cached / digits (s v w e) before the question", sub, fmt)
    return "\n".join(lines)


def table(summary: list[dict]) -> str:
    lines = []
    for variant in VARIANTS:
        for dtype in ("float32", "bfloat16"):
            rows = [s for s in summary if s["variant"] == variant and s["dtype"] == dtype]
            if rows:
                n = max(s["trials"] for s in rows)
                lines += arm_cycle_table(
                    f"{variant}, {dtype}, n={n}/cell: accuracy % [Wilson 95%]", rows,
                    lambda r: f"{100 * r['acc']:.0f} [{100 * r['wilson_lo']:.0f}-{100 * r['wilson_hi']:.0f}]")
    return "\n".join(lines)


if __name__ == "__main__":
    run_main(main)
