"""Which cold pages each layer chooses when the question arrives: the recall tier's page choice, measured.

The unprotected-fact protocol of `recall_probe` (a 7-digit fact outside the sinks, `n_cycles * cycle_len` filler
tokens, the question as one chunk; W = 24, block 8, rsqr capped at 16 survivors plus K recalled pages) is run
with the recall arm, and at every checkpoint the question chunk is fed on a fork of the cache. That chunk's
page choice is the one the first answer token is computed with (a prompt chunk always chooses afresh). The
cache is built with room for every page of the store (`max_recall_pages` = the store's page count) while the
policy recalls K: the layer then ranks every page and keeps the whole order (`cold_choice`), of which it
attends the first K, so the order is read without changing what the model attends (the same first-token
answers as the K-page run up to float reassociation of masked slots).

Per checkpoint and trial: the rank of the fact's page (the page holding its first digit) in each layer's order
(0 = best), and whether the greedy first answer token is the fact's first digit. Summaries: the share of
layers that have the fact's page in their top K, per layer and overall, split by a right and a wrong first
digit.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rsqr_jax.eval.runtime import ConfigError, progress, status
from rsqr_jax.eval.stats import wilson
from rsqr_jax.policy import Policy
from rsqr_jax.spec import ColdStore
from rsqr_lab.studies import base_policy
from rsqr_lab.studies.recall_probe import RecallModel, feed_stream, make_trials, tokenize_filler
from rsqr_lab.studies.recall_setup import UNPROTECTED_SINKS


@dataclasses.dataclass(frozen=True, eq=False)  # holds a Policy (studies.base_policy)
class PageChoiceConfig:
    """The unprotected protocol (recall_probe's rsqr_recall arm: W 24, block 8 = the chunk, delta 8, at most 16
    survivors, K = policy.recall_pages pages) and its cold store; ranks are read at the question of every
    checkpoint in `cycles` (in cycles of cycle_len filler tokens). The sinks are the protocol's (4)."""

    filler: str
    trials: int = 40
    cycles: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
    policy: Policy = base_policy.field(window=24, delta=8, max_survivors=16, block=8, recall_pages=4)
    cold: ColdStore = ColdStore(capacity=1088, page_score="max")
    cycle_len: int = 16
    batch: int = 20
    seed: int = 0

    def __post_init__(self):
        if self.trials < 1 or self.batch < 1 or self.cycle_len < 1 or not self.cycles or min(self.cycles) < 1:
            raise ConfigError("--trials, --batch, --cycle-len and every --cycles value must be >= 1")
        if int(base_policy.check(self.policy).recall_pages) < 1:
            raise ConfigError("--recall-pages must be >= 1: the study ranks the pages recall chooses from")
        if self.cold.neighbors:
            raise ConfigError("--recall-neighbors must be 0: ranks are read from the chosen pages alone")

    def n_filler(self) -> int:
        return max(self.cycles) * self.cycle_len

    def arm(self) -> Policy:
        return self.policy.replace(mode="rsqr", n_sink=UNPROTECTED_SINKS)


def fact_page_ranks(choice_LxBxM, cold_pos_Nc, page_size: int, fact_pos: int) -> np.ndarray:
    """[L, B] rank of the page holding global position fact_pos in each layer's order of pages (the indices
    in choice, best first); M (the page count) where the page is not in the store any more."""
    slots = np.flatnonzero(np.asarray(cold_pos_Nc) == fact_pos)
    L, B, M = choice_LxBxM.shape
    if slots.size == 0:
        return np.full((L, B), M)
    hit = np.asarray(choice_LxBxM) == int(slots[0]) // page_size
    return np.where(hit.any(axis=2), hit.argmax(axis=2), M)


def run(cfg: PageChoiceConfig, model: RecallModel, *, show_progress: bool = True) -> dict:
    """Every trial at every checkpoint; returns {"config", "cells": [per checkpoint summary], "ranks": ...}."""
    import jax
    import jax.numpy as jnp

    from rsqr_jax.engine import Decoder
    from rsqr_jax.spec import CacheSpec

    tok = model.tokenizer
    filler_ids = tokenize_filler(tok, cfg.filler, cfg.n_filler())
    trials = make_trials(tok, cfg.trials, 1, filler_ids, cfg.n_filler(), cfg.seed, None)
    fact_pos, digit0 = trials.digit_pos[0][0], [tok.encode(n[0], add_special_tokens=False)[0] for n in trials.numbers]
    space = tok.encode(" ", add_special_tokens=False)[0]
    pol, B, L = cfg.arm(), min(cfg.batch, cfg.trials), cfg.cycle_len
    C = int(pol.block)  # the chunk: evict-for-space, as recall_probe streams
    if trials.question.shape[1] > C:
        raise ConfigError(f"the question has {trials.question.shape[1]} tokens; --block must be >= that")
    # Every page rankable: the order of the whole store is kept per layer (reselect > 1 keeps a choice; a
    # prompt chunk, such as the question, always chooses afresh, so the answers are the K-page run's).
    cold = dataclasses.replace(cfg.cold, reselect=2)
    spec = CacheSpec.for_policies(pol, dims=model.config, batch=B, max_chunk=C, cold=cold)
    n_pages = spec.cold_pages
    spec = dataclasses.replace(spec, max_recall_pages=n_pages)
    dec = Decoder(model.apply_fn, spec)
    status(f"page_choice: seed {cfg.seed}, {cfg.trials} trials, fact's first digit at position {fact_pos}, "
           f"{n_pages} pages of {cold.page_size} ranked per layer, {int(pol.recall_pages)} attended")
    ranks = {c: [] for c in cfg.cycles}  # c -> [trials] of [L] ranks
    first_ok = {c: [] for c in cfg.cycles}
    pages_held = {}
    with progress(-(-cfg.trials // B) * len(cfg.cycles), "page_choice", enabled=show_progress, unit="ask") as bar:
        for b0 in range(0, cfg.trials, B):
            rows = list(range(b0, min(cfg.trials, b0 + B)))
            pad = lambda x: np.concatenate([x[rows], np.repeat(x[rows][-1:], B - len(rows), 0)])  # noqa: E731
            pre, fil, qs = pad(trials.prefix), pad(trials.filler), pad(trials.question)
            cache = feed_stream(dec, model.params, dec.init_cache(), pol, pre, C)
            done = 0
            for c in cfg.cycles:
                cache = feed_stream(dec, model.params, cache, pol, fil[:, done:c * L], C)
                done = c * L
                fork = jax.tree.map(jnp.copy, cache)
                Q = qs.shape[1]
                logits, fork = dec.feed(model.params, np.pad(qs, ((0, 0), (0, C - Q))), fork, pol, Q)
                first = np.asarray(jnp.argmax(logits[:, Q - 1], axis=-1))
                # The answer is " " then the digits (as the fact was written): the digit comes one step later,
                # from the space's row, which chooses its pages afresh (the first step after a prompt).
                logits, fork = dec.feed(model.params, np.pad(first[:, None], ((0, 0), (0, C - 1))), fork, pol, 1)
                second = np.asarray(jnp.argmax(logits[:, 0], axis=-1))
                digit = np.where(first == space, second, first)
                cold_pos = np.asarray(fork.cold.pos)
                pages_held[c] = int((cold_pos.reshape(n_pages, -1) >= 0).any(axis=1).sum())
                r = fact_page_ranks(np.asarray(fork.cold.choice), cold_pos, cold.page_size, fact_pos)
                for j, i in enumerate(rows):
                    ranks[c].append(r[:, j].tolist())
                    first_ok[c].append(bool(digit[j] == digit0[i]))
                bar.update()
    K = int(pol.recall_pages)
    cells = []
    for c in cfg.cycles:
        R = np.asarray(ranks[c])  # [trials, L]
        ok = np.asarray(first_ok[c])
        in_top = R < K
        n_ok = int(ok.sum())
        cells.append({
            "n_cycles": c, "filler_tokens": c * L, "trials": len(ok),
            "pages": pages_held[c],
            "first_digit_right": n_ok, "first_digit_ci": list(wilson(n_ok, len(ok))),
            "layers_with_fact_in_top_k": float(in_top.mean()),
            "layers_with_fact_in_top_k_right": float(in_top[ok].mean()) if n_ok else None,
            "layers_with_fact_in_top_k_wrong": float(in_top[~ok].mean()) if n_ok < len(ok) else None,
            "per_layer_in_top_k": in_top.mean(axis=0).tolist(),
            "per_layer_median_rank": np.median(R, axis=0).tolist(),
        })
    return {"config": {**base_policy.config_json(cfg, ("window", "block", "delta", "max_survivors", "recall_pages")),
                       "sinks": UNPROTECTED_SINKS, "fact_position": int(fact_pos)},
            "cells": cells, "ranks": {str(c): ranks[c] for c in cfg.cycles},
            "first_digit_right": {str(c): first_ok[c] for c in cfg.cycles}}


def table(result: dict) -> str:
    """One row per checkpoint: pages in the store, the right first digits, the share of layers that had the
    fact's page in their top K (all trials, right ones, wrong ones), and the layers that miss it most."""
    K = result["config"]["recall_pages"]
    lines = [f"| cycles | filler tokens | pages | first digit right | layers with the fact's page in top {K} "
             "| ... when right | ... when wrong | layers that miss most (share in top K) |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: "–" if x is None else f"{x:.2f}"  # noqa: E731
    for cell in result["cells"]:
        per = np.asarray(cell["per_layer_in_top_k"])
        worst = ", ".join(f"{int(i)} ({per[i]:.2f})" for i in np.argsort(per, kind="stable")[:4])
        lo, hi = cell["first_digit_ci"]
        lines.append(f"| {cell['n_cycles']} | {cell['filler_tokens']} | {cell['pages']} | {cell['first_digit_right']}"
                     f"/{cell['trials']} [{lo:.2f}, {hi:.2f}] | {fmt(cell['layers_with_fact_in_top_k'])} | "
                     f"{fmt(cell['layers_with_fact_in_top_k_right'])} | {fmt(cell['layers_with_fact_in_top_k_wrong'])}"
                     f" | {worst} |")
    return "\n".join(lines)
