"""Per-token decode latency of rsqr with the recall tier against cold-store size and fill, side by side with
plain rsqr in one process (rounds interleaved, so load on the machine hits every arm alike): the recall
overhead as a ratio, and the cold store's memory. Each prompt length is its own arm (a prompt shorter than
the window leaves the store empty; longer ones fill it to prompt - window tokens, and past its capacity the
ring wraps); each row reports how many tokens were recallable when its timing began and ended.

`fill`: a long prompt that fills the store is fed once per store size, page rule and scoring copy with recall off
(recall_pages = 0: the store, its summaries and its scoring copy are written as ever, nothing is scored), and
every arm with that store starts from the filled state - so a full 64k-token store costs one plain prefill per
store layout, not one recall prefill per arm. Plain rsqr starts from the
same state without the store (the window and survivors do not depend on it)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from rsqr_jax.eval.runtime import ConfigError, read_tokens, status, write_json_atomic
from rsqr_jax.policy import Policy
from rsqr_jax.spec import DEFAULT_PAGE_SCORE
from rsqr_lab.studies import base_policy


@dataclasses.dataclass(frozen=True, eq=False)  # holds a Policy (studies.base_policy)
class BenchRecallConfig:
    """policy: rsqr's window, sinks and survivors (its mode is rsqr); recall_pages: the recalling arms' pages
    (plain rsqr recalls none, so they are not the base policy's)."""

    text: str
    cold_sizes: tuple[int, ...] = (0, 4096, 16384, 65536)  # 0 = plain rsqr (no cold store)
    recall_pages: int = 4
    page_size: int = 16
    policy: Policy = base_policy.field()
    prompt_tokens: tuple[int, ...] = (512,)  # one arm per length, each recalling arm against plain rsqr's
    new_tokens: int = 64
    rounds: int = 3
    page_scores: tuple[str, ...] = (DEFAULT_PAGE_SCORE,)  # every recalling size runs under each rule (spec.PAGE_SCORES)
    reselects: tuple[int, ...] = (1,)  # and under each ColdStore.reselect (pages chosen afresh every k steps)
    share_froms: tuple = (None,)  # and each ColdStore.share_from (None: every layer chooses; a layer or a tuple)
    score_dtypes: tuple[str, ...] = ("float32",)  # and each ColdStore.score_dtype (the "max" rule's scoring copy)
    fill: bool = False  # feed each size's prompt once with recall off; every arm starts from that state

    def __post_init__(self):
        if not self.cold_sizes or any(c < 0 or c % self.page_size for c in self.cold_sizes):
            raise ConfigError(f"--cold-sizes must be multiples of --page-size {self.page_size} (0 = no recall)")
        if isinstance(self.prompt_tokens, int):
            object.__setattr__(self, "prompt_tokens", (self.prompt_tokens,))
        if self.rounds < 1 or self.new_tokens < 1 or not self.prompt_tokens or min(self.prompt_tokens) < 2:
            raise ConfigError("--rounds, --new-tokens must be >= 1 and every --prompt-tokens >= 2")
        from rsqr_jax.spec import PAGE_SCORES

        if not self.page_scores or any(r not in PAGE_SCORES for r in self.page_scores):
            raise ConfigError(f"--page-scores must be a list of {', '.join(PAGE_SCORES)}, got {self.page_scores}")
        if not self.reselects or min(self.reselects) < 1:
            raise ConfigError(f"--reselect must be a list of integers >= 1, got {self.reselects}")
        if not self.share_froms or any(isinstance(r, int) and r < 0 for r in self.share_froms):
            raise ConfigError(f"--share-choice-from must be a list of layers >= 0 or 'none', got {self.share_froms}")
        from rsqr_jax.spec import SCORE_DTYPES

        if not self.score_dtypes or any(d not in SCORE_DTYPES for d in self.score_dtypes):
            raise ConfigError(f"--score-dtypes must be a list of {', '.join(SCORE_DTYPES)}, got {self.score_dtypes}")
        base_policy.check(self.policy)


def weightless_matmul(x, w):
    """A projection that reads no weights (bench_recall --no-weights): x's features repeated to w's output width.
    Every cache operation of a step runs on the shapes it has with the model's weights, while the weights' memory
    traffic, most of a step's time and the part a shared machine's load moves most, is gone: the difference
    between two arms is then what the cache machinery adds (the logits mean nothing)."""
    import jax.numpy as jnp

    n = w.shape[-1]
    return jnp.take(x, jnp.asarray(np.arange(n) % x.shape[-1]), axis=-1) * 0.5 + 0.01


def _recallable(session) -> int:
    """Cold slots holding a token that has left the window (what recall may choose from)."""
    from rsqr_jax.policy import window_start

    c, pol = session.cache, session.policy
    w0 = int(window_start(c.t, pol.window, pol.block, c.start))
    if c.cold is None:
        return 0
    pos = np.asarray(c.cold.pos)
    return int(((pos >= 0) & (pos < w0)).sum())


def _adopt(session, src) -> None:
    """`session` continues from `src`'s stream: every cache field of the same shape is taken over; the others
    (the cold store for plain rsqr, the kept page choice for reselect > 1) stay as `session` initialised them."""
    import dataclasses as dc

    import jax.numpy as jnp

    fields = {}
    for f in dc.fields(session.cache):
        mine, theirs = getattr(session.cache, f.name), getattr(src.cache, f.name)
        if f.name == "cold":
            if mine is not None and theirs is not None:  # the same store: its arrays of the same shape
                fields["cold"] = mine.replace(**{
                    g.name: jnp.copy(getattr(theirs, g.name)) for g in dc.fields(mine)
                    if g.name != "page_size" and getattr(mine, g.name) is not None
                    and getattr(theirs, g.name) is not None
                    and getattr(mine, g.name).shape == getattr(theirs, g.name).shape})
        elif mine.shape == theirs.shape:
            fields[f.name] = jnp.copy(theirs)  # a copy of its own: steps donate the cache they are given
        else:
            raise ValueError(f"cannot start from the filled stream: cache field {f.name} differs in shape")
    session.cache = session.cache.replace(**fields)
    session.recent, session.pending, session.rng = jnp.copy(src.recent), src.pending, jnp.copy(src.rng)


def run(cfg: BenchRecallConfig, apply_fn, params, model_config, tokenizer) -> dict:
    from rsqr_jax.session import Session
    from rsqr_jax.spec import CacheSpec, ColdStore

    prompts = {n: read_tokens(tokenizer, cfg.text, n) for n in cfg.prompt_tokens}
    chunk = min(64, int(cfg.policy.window))
    sessions = {}  # (cold size, page rule or None, reselect, share_from, score dtype, prompt length) -> (session, ...)
    filled = {}  # (cold size, prompt length, page rule, score dtype) -> the Session fed with recall off (fill)
    for size in sorted(cfg.cold_sizes, reverse=cfg.fill):  # fill: plain rsqr takes a filled state
        for rule, every, share, sd in ([(r, e, sh, d) for r in cfg.page_scores for e in cfg.reselects
                                        for sh in cfg.share_froms for d in cfg.score_dtypes]
                                       if size else [(None, 1, None, "float32")]):
            k = cfg.recall_pages if size else 0
            pol = cfg.policy.replace(mode="rsqr", recall_pages=k)
            cold = (ColdStore(size, cfg.page_size, rule, reselect=every, share_from=share, score_dtype=sd)
                    if size else None)
            spec = CacheSpec.for_policies(pol, cold=cold, dims=model_config, max_chunk=chunk)
            for n, prompt in prompts.items():  # sessions of one spec share its compilation
                s = Session(apply_fn, params, spec, pol, prefill_chunk=chunk)
                s.warmup()
                if not cfg.fill:
                    s.feed(prompt)
                else:
                    # A store's fill serves the arms whose cold store has its shapes (a page rule's summaries, the
                    # scoring copy); plain rsqr takes any fill of its prompt.
                    src = next((v for (c, m, r, d), v in filled.items()
                                if m == n and (not size or (c, r, d) == (size, rule, sd))), None)
                    if src is None:  # this store's fill: the same spec, recall off
                        src = Session(apply_fn, params, spec, pol.replace(recall_pages=0), prefill_chunk=chunk)
                        t0 = time.perf_counter()
                        src.feed(prompt)
                        status(f"bench_recall: cold {size}: {n} prompt tokens fed with recall off in "
                               f"{time.perf_counter() - t0:.0f}s")
                        filled[size, n, rule, sd] = src
                    _adopt(s, src)
                sessions[size, rule, every, share, sd, n] = (s, spec.bytes_by_part(pol), _recallable(s))
            status(f"bench_recall: cold {size} ({rule or 'no recall'}, reselect {every}, share from {share}, {sd}): compiled in "
                   f"{s.compile_s:.1f}s")
    filled.clear()
    times = {key: [] for key in sessions}
    for r in range(cfg.rounds):
        for key, (s, *_) in sessions.items():
            t0 = time.perf_counter()
            s.generate(cfg.new_tokens)
            times[key].append((time.perf_counter() - t0) / cfg.new_tokens)
        status(f"bench_recall: round {r + 1}/{cfg.rounds}")
    first = next((key for key in sessions if key[0] == 0), next(iter(sessions)))  # plain rsqr, when it ran
    base = {n: float(np.median(times[first[:5] + (n,)])) for n in cfg.prompt_tokens}
    rows = []
    for (size, rule, every, share, sd, n), (s, parts, before) in sorted(sessions.items(), key=lambda kv: kv[0][0]):
        ms = 1000 * float(np.median(times[size, rule, every, share, sd, n]))
        rows.append({"cold_capacity": size, "page_score": rule, "recall_pages": cfg.recall_pages if size else 0,
                     "reselect": every, "share_from": share, "score_dtype": sd, "prompt_tokens": n, "recallable": [before, _recallable(s)] if size else [0, 0],
                     "ms_per_token": ms, "ms_rounds": [1000 * t for t in times[size, rule, every, share, sd, n]],
                     "ratio": ms / (1000 * base[n]), "cold_store_MiB": parts["cold_store"] / 2**20,
                     "device_cache_MiB": (parts["total"] - parts["cold_store"]) / 2**20})
    return {"config": base_policy.config_json(cfg, ("window", "n_sink", "delta", "max_survivors")), "rows": rows}


def markdown(result: dict) -> str:
    out = ["| cold store (tokens) | recall pages | page score | scoring copy | reselect | choice shared from | prompt | "
           "recallable (start-end) | ms/token (median) | ratio to the first row's prompt | cold store MiB | "
           "window + survivors MiB |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        a, b = r["recallable"]
        out.append(f"| {r['cold_capacity']} | {r['recall_pages']} | {r.get('page_score') or '-'} | "
                   f"{r.get('score_dtype', 'float32') if r.get('page_score') == 'max' else '-'} | "
                   f"{r.get('reselect', 1) if r['recall_pages'] else '-'} | "
                   f"{_shared(r) if r['recall_pages'] else '-'} | "
                   f"{r['prompt_tokens']} | {a}-{b} | {r['ms_per_token']:.1f} | {r['ratio']:.2f} | "
                   f"{r['cold_store_MiB']:.0f} | {r['device_cache_MiB']:.1f} |")
    return "\n".join(out) + "\n"


def _shared(row: dict) -> str:
    share = row.get("share_from")
    if isinstance(share, (list, tuple)):  # one source per layer: the layers that score, share and recall nothing
        own = [i for i, src in enumerate(share) if src == i]
        return f"per layer ({len(own)} choose, {sum(src < 0 for src in share)} recall nothing)"
    return "every layer chooses" if share is None else f"layer {share}"


def write(result: dict, out_dir) -> None:
    import pathlib

    write_json_atomic(pathlib.Path(out_dir) / "bench_recall.json", result)
    (pathlib.Path(out_dir) / "bench_recall.md").write_text(markdown(result))
