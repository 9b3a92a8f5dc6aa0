"""The recall study's inputs and diagnostics, free of any model: facts files, trial token layouts, answer
scoring, where a fact's digits sit in the cache, and the replay short-stream length."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np

from rsqr_jax.eval.runtime import ConfigError

ARMS = ("full", "replay", "rerotate", "leave_gaps", "streamingllm", "rsqr", "rsqr_cap", "rsqr_recall")
VARIANTS = ("pinned", "unprotected")
UNPROTECTED_SINKS = 4  # "The secret number of": the unprotected variant's sinks (after any preamble)
GLOBAL_MODES = ("full", "window", "leave_gaps")  # attention sees global positions; the others see ranks
DEFAULT_NAMES = ("Alice Bob Carol David Emma Frank Grace Henry Jack Kate Mary Nina Oscar Paul Rose Sam Tom Victor "
                 "Wendy Anna Ben Clara Daniel Eva George Hannah Ivan Julia Kevin Laura Mark Peter Rachel Simon "
                 "Walter").split()


def read_facts(path: str) -> list[tuple[str, str]]:
    """A facts file: JSON ([{"name": .., "number": ..}, ...] or {"NAME": "NUMBER", ...}) or text lines
    "NAME NUMBER" (blank lines and lines starting with # ignored). Numbers are digit strings, all of one
    length; names are distinct single words."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read facts file {path}: {e.strerror or e}") from None
    pairs: list[tuple[str, str]] = []
    stripped = text.strip()
    if stripped.startswith(("[", "{")):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise ConfigError(f"facts file {path}: invalid JSON ({e.msg}, line {e.lineno})") from None
        if isinstance(data, dict):
            pairs = [(str(k), str(v)) for k, v in data.items()]
        else:
            for i, item in enumerate(data):
                if not isinstance(item, dict) or "name" not in item or "number" not in item:
                    raise ConfigError(f"facts file {path}: item {i} must be an object with name and number")
                pairs.append((str(item["name"]), str(item["number"])))
    else:
        for ln, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ConfigError(f"facts file {path}, line {ln}: expected 'NAME NUMBER', got {line!r}")
            pairs.append((parts[0], parts[1]))
    if not pairs:
        raise ConfigError(f"facts file {path} has no facts")
    for name, number in pairs:
        if not re.fullmatch(r"\d+", number):
            raise ConfigError(f"facts file {path}: number {number!r} of {name!r} is not a digit string")
        if not re.fullmatch(r"\S+", name):
            raise ConfigError(f"facts file {path}: name {name!r} must be one word")
    if len({len(n) for _, n in pairs}) != 1:
        raise ConfigError(f"facts file {path}: all numbers must have the same number of digits")
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ConfigError(f"facts file {path}: duplicate names")
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


@dataclasses.dataclass
class Trials:
    prefix: np.ndarray        # [T, P] fact prefix token ids
    filler: np.ndarray        # [T, F] filler token ids
    question: np.ndarray      # [T, Q]
    numbers: list               # [T] digit string asked for
    names: list                 # [T] name asked for
    queried: np.ndarray       # [T] index of the asked fact
    digit_pos: list             # [n_facts] list of global positions of each fact's digit tokens
    filler_offset: np.ndarray  # [T] token offset of the filler slice


def chat_preamble(tokenizer) -> list[int]:
    """The chat template rendered up to the user's content (system turn + '<|im_start|>user\\n'): the
    author's study-2 sinks were this preamble of their model."""
    marker = "@@USERCONTENT@@"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    if marker not in text:
        raise ConfigError("the tokenizer's chat template does not render the user's content")
    return tokenizer.encode(text[:text.index(marker)], add_special_tokens=False)


def make_trials(tokenizer, n_trials: int, n_facts: int, filler_ids, n_filler: int, seed: int,
                facts_pool: list[tuple[str, str]] | None, preamble: list[int] = ()) -> Trials:
    rng = np.random.default_rng(seed)
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    if facts_pool is None:
        names = [n for n in DEFAULT_NAMES if len(enc(" " + n)) == 1]
        if len(names) < n_facts:
            raise ConfigError(f"only {len(names)} single-token default names; --n-facts {n_facts} is too many")
    elif len(facts_pool) < n_facts:
        raise ConfigError(f"the facts file has {len(facts_pool)} facts; --n-facts {n_facts} needs at least that many")
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
            raise ConfigError(f"{what} token lengths differ across trials ({sorted({len(s) for s in seqs})}): use "
                             f"names that tokenize to the same number of tokens and numbers of one length")
    if len({tuple(map(tuple, d)) for d in digit_pos_all}) != 1:
        raise ConfigError("digit positions differ across trials: use names and numbers of equal token length")
    filler = np.stack([filler_ids[o:o + n_filler] for o in offsets]).astype(np.int32)
    return Trials(np.asarray(prefixes, np.int32), filler, np.asarray(questions, np.int32), numbers, asked_names,
                  np.asarray(queried), digit_pos_all[0], np.asarray(offsets))


def layout_of(cache, policy, mode: str, n_sink: int, digit_pos: list[list[int]]) -> dict:
    """Where each fact's digit tokens are before the question (sink / survivor / window / evicted), and
    the distance, on the arm's attention timeline, from the next position to the fact's first digit."""
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
