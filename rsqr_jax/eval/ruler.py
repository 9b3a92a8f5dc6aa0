"""RULER's synthetic tasks, offline, through the lm-eval model (RsqrLM) for several cache policies.

lm-eval ships RULER's generators (lm_eval/tasks/ruler): each task builds its samples at load time, sized by a
tokenizer that `AutoTokenizer.from_pretrained` loads. Here that tokenizer is the model's own (exported once to
a directory, `export_tokenizer`), so prompt lengths are counted in the tokens the model sees. Every policy
sees the same samples (the same Task objects, built once under one seed), and every answer is kept in a
sqlite cache per policy as soon as it exists (lm-eval's CachingLM, one request per engine call), so a killed
run resumes where it stopped and a finished one is re-reported without a model call.

    spec = RulerSpec(tasks=("niah_single_1", "ruler_vt"), seq_len=4096, limits=(10, 20, 30))
    result = run_ruler(spec, pieces, tokenizer_dir, cache_dir="runs/ruler")
    print(format_table(result))

Offline: the tasks that need a data set from the hub (the essay haystacks, SQuAD/HotpotQA) are refused
(ESSAY_TASKS); nltk's punkt_tab, which lm-eval's RULER module tries to download when it is imported, is used
only by the essay haystack (`sent_tokenize` of the essays), so the download is replaced by a refusal while
the tasks load (`offline_nltk`). Scores are lm-eval's own (`process_results`: the share of expected strings
found in the answer), one per sample; intervals are Wilson's on the summed score (exact for the 0/1 tasks,
an approximation for partial credit: ruler_vt, ruler_fwe, ruler_cwe).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import time

import numpy as np

from rsqr_jax.eval.runtime import ConfigError
from rsqr_jax.eval.stats import wilson
from rsqr_jax.presets import policy_defaults

DEFAULTS = policy_defaults()

# RULER tasks whose samples are generated from nothing but a tokenizer (and the `wonderwords` word lists).
OFFLINE_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_fwe", "ruler_cwe")
DEFAULT_TASKS = ("niah_single_1", "niah_multikey_2", "ruler_vt", "ruler_fwe")
# Their haystacks (or questions) are hub data sets: Paul Graham's essays, SQuAD, HotpotQA.
ESSAY_TASKS = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery",
               "ruler_qa_squad", "ruler_qa_hotpot")
POLICIES = ("full", "streamingllm", "rsqr", "rsqr+recall")


@dataclasses.dataclass(frozen=True)
class RulerSpec:
    """What to run: tasks x policies at one sequence length, each cell growing through `limits` (samples per
    task after each round: every cell gets its first samples before any gets more)."""

    tasks: tuple[str, ...] = DEFAULT_TASKS
    policies: tuple[str, ...] = POLICIES
    seq_len: int = 4096
    limits: tuple[int, ...] = (10, 20, 30)
    window: int = 512  # the protocol's window (the library's default is 256)
    sinks: int = DEFAULTS["n_sink"]
    recall_pages: int = 8
    page_size: int = 16
    cold_capacity: int = 4096
    chunk: int = 32
    # rsqr+recall: layers after this one attend its page choice, or one source per layer (ColdStore.share_from)
    share_from: int | tuple[int, ...] | None = None
    reselect: int = 1  # rsqr+recall: pages chosen afresh every k decode steps (ColdStore.reselect)
    score_dtype: str = "float32"  # rsqr+recall: the max rule's scoring copy (ColdStore.score_dtype)
    max_gen_toks: int | None = None  # None: each task's own (niah 128, vt 30, fwe 50, cwe 120)
    seed: int = 0
    model: str = "embedded"  # a name for the cache key and the report (the caller loads the model)
    # The tasks the model answers (None: every one). All of `tasks` are still generated, in order, under the
    # seed (a task's samples depend on the tasks generated before it) and reported from the caches.
    answer: tuple[str, ...] | None = None
    # The first sample the model answers: samples before it come from an earlier report (merge_reports), so a
    # table grows after its answer cache is gone. Each round answers samples start..limit-1.
    start: int = 0

    def __post_init__(self):
        if not self.tasks:
            raise ConfigError("no tasks")
        if self.answer is not None and (not self.answer or any(t not in self.tasks for t in self.answer)):
            raise ConfigError(f"the tasks to answer must be some of the tasks ({', '.join(self.tasks)}), "
                              f"got {', '.join(self.answer) or 'none'}")
        for t in self.tasks:
            if t in ESSAY_TASKS:
                raise ConfigError(f"task {t!r} needs a hub data set (essays / QA); offline tasks: "
                                  f"{', '.join(OFFLINE_TASKS)}")
            if t not in OFFLINE_TASKS:
                raise ConfigError(f"unknown task {t!r}: choose from {', '.join(OFFLINE_TASKS)}")
        if not self.policies:
            raise ConfigError("no policies")
        for p in self.policies:
            if p not in POLICIES:
                raise ConfigError(f"unknown policy {p!r}: choose from {', '.join(POLICIES)}")
        if len(set(self.tasks)) != len(self.tasks) or len(set(self.policies)) != len(self.policies):
            raise ConfigError("tasks and policies must not repeat")
        if self.seq_len < 256:
            raise ConfigError(f"seq_len must be >= 256, got {self.seq_len}")
        if "ruler_vt" in self.tasks and self.seq_len < 1024:  # lm-eval's generator loops forever there
            raise ConfigError(f"ruler_vt needs seq_len >= 1024 (its worked example alone is ~850 tokens), "
                              f"got {self.seq_len}")
        if not self.limits or any(n < 1 for n in self.limits) or list(self.limits) != sorted(set(self.limits)):
            raise ConfigError(f"limits must be increasing positive sample counts, got {list(self.limits)}")
        if not 0 <= self.start < self.limits[0]:
            raise ConfigError(f"start must be in [0, the first limit {self.limits[0]}), got {self.start}")
        if self.window < 8 or self.window >= self.seq_len:
            raise ConfigError(f"window must be in [8, seq_len), got {self.window}")
        if self.reselect < 1 or (isinstance(self.share_from, int) and self.share_from < 0):
            raise ConfigError(f"reselect must be >= 1 and share_from a layer >= 0, got {self.reselect} and "
                              f"{self.share_from}")
        from rsqr_jax.spec import SCORE_DTYPES

        if self.score_dtype not in SCORE_DTYPES:
            raise ConfigError(f"score_dtype must be one of {', '.join(SCORE_DTYPES)}, got {self.score_dtype!r}")
        if self.max_gen_toks is not None and self.max_gen_toks < 1:
            raise ConfigError(f"max_gen_toks must be >= 1, got {self.max_gen_toks}")

    def model_args(self, policy: str) -> dict:
        """RsqrLM model arguments of one policy (`full` holds the whole prompt plus the answer)."""
        common = {"chunk": self.chunk, "max_length": self.seq_len + 256, "seed": self.seed, "sinks": self.sinks}
        if policy == "full":
            return {**common, "policy": "full"}
        # Every recall setting explicit: the model's preset fills in only what a model argument leaves out.
        a = {**common, "policy": "rsqr" if policy.startswith("rsqr") else policy, "window": self.window,
             "recall_pages": 0}
        if policy == "rsqr+recall":
            a.update(recall_pages=self.recall_pages, page_size=self.page_size, cold_capacity=self.cold_capacity,
                     reselect=self.reselect, score_dtype=self.score_dtype, share_from=-1)
            if isinstance(self.share_from, tuple):
                from rsqr_jax.presets import format_choice_sources

                a["share_from"] = format_choice_sources(self.share_from, sep=";")
            elif self.share_from is not None:
                a["share_from"] = self.share_from
        return a

    def describe(self, policy: str) -> str:
        a = self.model_args(policy)
        if policy == "full":
            return "full"
        s = f"{a['policy']}(W={self.window}, N={self.sinks})"
        shared = (f", page choice per layer {a['share_from']}" if isinstance(self.share_from, tuple) else
                  f", shared from layer {self.share_from}" if self.share_from is not None else "") + \
            (f", chosen every {self.reselect} steps" if self.reselect != 1 else "") + \
            (f", {self.score_dtype} scoring copy" if self.score_dtype != "float32" else "")
        return s + (f" + recall {self.recall_pages}x{self.page_size} of {self.cold_capacity}{shared}"
                    if policy == "rsqr+recall" else "")

    def cache_path(self, cache_dir: str, policy: str) -> str:
        """One sqlite cache per policy and settings (lm-eval's keys are the requests only)."""
        key = json.dumps({"model": self.model, **self.model_args(policy)}, sort_keys=True)  # + the requests
        tag = hashlib.sha256(key.encode()).hexdigest()[:10]
        return os.path.join(cache_dir, f"{policy.replace('+', '_')}_{self.seq_len}_{tag}")


def export_tokenizer(tokenizer, directory: str) -> str:
    """Save a transformers tokenizer where `AutoTokenizer.from_pretrained(directory)` loads it (RULER's
    generators count prompt tokens with it); returns the directory."""
    os.makedirs(directory, exist_ok=True)
    tokenizer.save_pretrained(directory)
    return directory


@contextlib.contextmanager
def offline_nltk():
    """nltk.download refuses (returns False, no network) while lm-eval's RULER module is imported: the
    punkt_tab data it asks for serves only the essay haystack's `sent_tokenize`."""
    import nltk

    saved = nltk.download
    nltk.download = lambda *a, **k: False
    try:
        yield
    finally:
        nltk.download = saved


def task_manager(spec: RulerSpec, tokenizer_dir: str):
    """lm-eval's TaskManager over its RULER folder only: indexing all of lm-eval's tasks takes ~8 s, and
    simple_evaluate builds such an index on every call unless it is handed one."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    folder = os.path.join(os.path.dirname(lm_eval.tasks.__file__), "ruler")
    return TaskManager(include_path=folder, include_defaults=False,
                       metadata={"tokenizer": tokenizer_dir, "max_seq_lengths": [spec.seq_len]})


def load_tasks(spec: RulerSpec, tokenizer_dir: str, manager=None) -> dict:
    """{task name: lm-eval Task} with samples generated at spec.seq_len by the tokenizer in tokenizer_dir,
    under spec.seed (Python's and NumPy's global generators: RULER's generators draw from them)."""
    try:
        import wonderwords  # noqa: F401  (lm-eval's RULER generators import it)
    except ModuleNotFoundError:
        raise ConfigError("RULER's generators need the wonderwords package: pip install wonderwords") from None
    from lm_eval.tasks import get_task_dict

    manager = manager or task_manager(spec, tokenizer_dir)
    random.seed(spec.seed)
    np.random.seed(spec.seed)
    with offline_nltk():
        tasks = get_task_dict(list(spec.tasks), manager)
    missing = [t for t in spec.tasks if t not in tasks]
    if missing:
        raise ConfigError(f"lm-eval has no task {missing[0]!r}")
    if spec.max_gen_toks is not None:  # in the requests themselves (so in their cache keys)
        for task in tasks.values():
            task.set_config(key="generation_kwargs", value={"max_gen_toks": spec.max_gen_toks}, update=True)
    return {t: tasks[t] for t in spec.tasks}


def _open_cache(path: str):
    from sqlitedict import SqliteDict

    return SqliteDict(path + "_rank0.db", flag="r") if os.path.exists(path + "_rank0.db") else None


def cached_scores(task, limit: int, cache_path: str, seq_len: int, start: int = 0) -> list[dict]:
    """The samples of `task` from `start` (up to `limit`, stopping at the first one not answered yet) scored
    by the task's own process_results from the answers in the cache: [{doc_id, score, answer, target}]."""
    from lm_eval.api.model import hash_args

    task.build_all_requests(limit=limit, rank=0, world_size=1)
    db, rows = _open_cache(cache_path), []
    try:
        for inst in sorted(task.instances, key=lambda i: i.doc_id)[start:]:
            key = hash_args("generate_until", inst.args)
            if db is None or key not in db:
                break
            answer = db[key]
            score = task.process_results(inst.doc, [answer])[str(seq_len)]
            rows.append({"doc_id": inst.doc_id, "score": float(score), "answer": answer,
                         "target": list(inst.doc["outputs"]), "length": int(inst.doc["length"])})
    finally:
        if db is not None:
            db.close()
    return rows


def summarize(rows: list[dict]) -> dict:
    """n, mean score and its Wilson 95% interval (on the summed score) of one cell's samples."""
    return _cell([r["score"] for r in rows], [r["target"] for r in rows], [r["length"] for r in rows])


def _cell(scores: list[float], targets: list, lengths: list[int]) -> dict:
    n, k = len(scores), float(sum(scores))
    lo, hi = wilson(k, n)
    return {"n": n, "score": k / n if n else None, "ci": [lo, hi], "scores": scores, "targets": targets,
            "lengths": lengths}


def _targets(task, limit: int) -> list[list[str]]:
    """The expected strings of the first `limit` samples (generated, not answered)."""
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    return [list(i.doc["outputs"]) for i in sorted(task.instances, key=lambda i: i.doc_id)]


def needle_distances(task, limit: int, tokenizer) -> list[int]:
    """Per sample of a needle task (its first `limit`): how many prompt tokens the needle (the first place its
    first expected string appears) lies before the prompt's end, which decides whether a bounded cache or a
    cold store of a given size still holds it when the question comes."""
    task.build_all_requests(limit=limit, rank=0, world_size=1)
    out = []
    for inst in sorted(task.instances, key=lambda i: i.doc_id):
        prompt, needle = inst.args[0], inst.doc["outputs"][0]
        at = prompt.find(needle)
        out.append(len(tokenizer.encode(prompt[at:], add_special_tokens=False)) if at >= 0 else -1)
    return out


def report(spec: RulerSpec, tasks: dict, cache_dir: str, limit: int | None = None, extra: dict | None = None,
           needles: dict | None = None) -> dict:
    """Every cell's cached answers (up to `limit`, default the last round) as one JSON-able dict, with the needle
    tasks' needle distances when given (`needle_distance`: {task: [tokens per sample]}). With spec.start > 0
    a cell holds samples from `first` = start on, and `skipped_targets` (the samples before it) for the check
    that an earlier report's cells are these samples (merge_reports)."""
    limit = spec.limits[-1] if limit is None else limit
    cells = {}
    for t, task in tasks.items():
        cells[t] = {}
        skipped = _targets(task, spec.start) if spec.start else None
        for p in spec.policies:
            rows = cached_scores(task, limit, spec.cache_path(cache_dir, p), spec.seq_len, spec.start)
            cells[t][p] = summarize(rows)
            if skipped is not None:
                cells[t][p].update(first=spec.start, skipped_targets=skipped)
    return {"config": {**dataclasses.asdict(spec), "describe": {p: spec.describe(p) for p in spec.policies}},
            "cells": cells, **({"needle_distance": needles} if needles else {}), **(extra or {})}


# What must agree for two reports' cells to be the same cells (the samples then agree too: checked).
_SAME_CELLS = ("seq_len", "window", "sinks", "recall_pages", "page_size", "cold_capacity", "chunk", "max_gen_toks",
               "seed", "model", "share_from", "reselect", "score_dtype")


def merge_reports(earlier: dict, result: dict) -> dict:
    """`result` with, in every cell, the longer of its samples and an earlier report's (say, cells whose caches
    are gone); a cell of `result` that starts at sample `first` > 0 follows the earlier cell's first `first`
    samples. The two must share their settings, and the samples they share must have the same targets
    (the same generated samples): otherwise a ConfigError."""
    a, b = earlier["config"], result["config"]
    default = {f.name: f.default for f in dataclasses.fields(RulerSpec)}  # a setting older reports lack
    same = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731  (a report read back holds lists)
    differ = [k for k in _SAME_CELLS if same(a.get(k, default[k])) != same(b.get(k, default[k]))]
    if differ:
        raise ConfigError(f"the earlier report has other settings ({', '.join(differ)}): its cells are not these")
    cells = {t: dict(row) for t, row in result["cells"].items()}
    merged = []
    for t, row in earlier["cells"].items():
        for p, old in row.items():
            new = cells.get(t, {}).get(p)
            if new is not None and new.get("first"):
                cells[t][p] = _follow(old, new, f"{t} / {p}")
                merged.append(f"{t}/{p}")
                continue
            if new is not None:
                n = min(old["n"], new["n"])
                if old["targets"][:n] != new["targets"][:n]:
                    raise ConfigError(f"{t} / {p}: the earlier report's samples are not these (other targets)")
                if new["n"] >= old["n"]:
                    continue
            if t in cells and p in b["policies"]:
                cells[t][p] = old
                merged.append(f"{t}/{p}")
    return {**result, "cells": cells, "merged_from_earlier": merged}


def _follow(old: dict, new: dict, name: str) -> dict:
    """The earlier cell's samples before new["first"], then the new cell's (or the earlier cell whole, when it
    is longer): one cell from sample 0."""
    first = new["first"]
    if old.get("first"):
        raise ConfigError(f"{name}: the earlier report's cell starts at sample {old['first']}, not at 0")
    if old["n"] < first:
        raise ConfigError(f"{name}: the earlier report holds {old['n']} samples; samples from {first} on "
                          f"need the {first} before them")
    m = min(old["n"] - first, new["n"])
    if old["targets"][:first] != new["skipped_targets"] or old["targets"][first:first + m] != new["targets"][:m]:
        raise ConfigError(f"{name}: the earlier report's samples are not these (other targets)")
    if old["n"] >= first + new["n"]:
        return old
    return _cell(old["scores"][:first] + new["scores"], old["targets"][:first] + new["targets"],
                 old["lengths"][:first] + new["lengths"])


def run_ruler(spec: RulerSpec, pieces, tokenizer_dir: str, cache_dir: str, *, out_json: str | None = None,
              run: bool = True, earlier: dict | None = None, log=print) -> dict:
    """Run (or, with run=False, only report) every cell, round by round; the report is rewritten to
    out_json after each policy of each round. pieces: (apply_fn, params, model_config, tokenizer).
    The report holds, per policy, the number of requests the model itself answered in this call; with an
    `earlier` report, each cell holds the longer of its samples and the earlier one's (merge_reports)."""
    import lm_eval

    from rsqr_jax.eval.lm_eval_model import RsqrLM

    os.makedirs(cache_dir, exist_ok=True)
    manager = task_manager(spec, tokenizer_dir)
    tasks = load_tasks(spec, tokenizer_dir, manager)
    log(f"RULER: {len(tasks)} tasks x {len(spec.policies)} policies at {spec.seq_len} tokens, "
        f"rounds {list(spec.limits)}, seed {spec.seed}")
    answered = {p: 0 for p in spec.policies}
    seconds = {p: 0.0 for p in spec.policies}

    def save(result):
        if earlier is not None:
            result = merge_reports(earlier, result)
        if out_json:
            os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)
            tmp = out_json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f, indent=1)
            os.replace(tmp, out_json)
        return result

    tokenizer = pieces[3]  # the samples' needle distances do not change between rounds: computed once
    needles = {} if tokenizer is None else \
        {t: needle_distances(task, spec.limits[-1], tokenizer) for t, task in tasks.items() if t.startswith("niah")}
    result = save(report(spec, tasks, cache_dir, extra={"model_requests": answered, "seconds": seconds},
                         needles=needles))
    if not run:
        return result
    answering = [task for t, task in tasks.items() if spec.answer is None or t in spec.answer]
    lms = {}
    for limit in spec.limits:
        for p in spec.policies:
            if p not in lms:
                lm = RsqrLM.from_model_args(spec.model_args(p), pieces=pieces)
                inner = lm.engine.generate

                def counted(batch, inner=inner, p=p):
                    answered[p] += len(batch)
                    return inner(batch)

                lm.engine.generate = counted
                lms[p] = lm
            t0 = time.perf_counter()
            chosen = {"limit": limit} if not spec.start else \
                {"samples": {task.config.task: list(range(spec.start, limit)) for task in answering}}
            lm_eval.simple_evaluate(model=lms[p], tasks=answering, **chosen,
                                    use_cache=spec.cache_path(cache_dir, p), task_manager=manager, random_seed=spec.seed,
                                    numpy_random_seed=spec.seed, torch_random_seed=spec.seed,
                                    fewshot_random_seed=spec.seed)
            seconds[p] += time.perf_counter() - t0
            result = save(report(spec, tasks, cache_dir, extra={"model_requests": answered, "seconds": seconds},
                                 needles=needles))
            log(f"round {limit}: {p} done ({answered[p]} answered by the model, {seconds[p]:.0f} s so far)")
    return result


def format_table(result: dict) -> str:
    """One markdown table: a row per task, a column per policy, 'score [lo, hi] n=N' in each cell."""
    cfg, cells = result["config"], result["cells"]
    pols = cfg["policies"]
    head = "| task | " + " | ".join(f"`{cfg['describe'][p]}`" for p in pols) + " |"
    lines = [f"RULER at {cfg['seq_len']} tokens (score = share of expected strings found; Wilson 95%)",
             head, "|" + "---|" * (len(pols) + 1)]
    for t, row in cells.items():
        out = []
        for p in pols:
            c = row[p]
            out.append("not measured" if not c["n"] else
                       f"{c['score']:.2f} [{c['ci'][0]:.2f}, {c['ci'][1]:.2f}] n={c['n']}")
        lines.append(f"| {t} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> str:
    """Grouped bars (task x policy) with Wilson intervals, written to path (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, cells = result["config"], result["cells"]
    pols, tasks = cfg["policies"], list(cells)
    width = 0.8 / len(pols)
    fig, ax = plt.subplots(figsize=(4.5 + 1.6 * len(tasks), 3.6))
    for j, p in enumerate(pols):
        xs, ys, err, ns = [], [], [[], []], []
        for i, t in enumerate(tasks):
            c, x = cells[t][p], i + (j - (len(pols) - 1) / 2) * width
            if not c["n"]:
                ax.text(x, 0.01, "not run", rotation=90, ha="center", va="bottom", fontsize=6, color="grey")
                continue
            xs.append(x)
            ys.append(c["score"])
            err[0].append(c["score"] - c["ci"][0])
            err[1].append(c["ci"][1] - c["score"])
            ns.append(c["n"])
        ax.bar(xs, ys, width, yerr=err if xs else None, capsize=2, color=f"C{j}")
        for x, y, n in zip(xs, ys, ns):
            ax.text(x, 1.07, f"{n}", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(tasks)))
    ax.set_xticklabels(tasks, fontsize=8)
    ax.text(-0.6, 1.07, "n:", ha="right", va="bottom", fontsize=6)
    ax.set_ylim(0, 1.15)
    ax.set_ylabel("score (Wilson 95%)")
    ax.set_title(f"RULER at {cfg['seq_len']} tokens", fontsize=10)
    from matplotlib.patches import Patch

    ax.set_xlim(-0.5, len(tasks) - 0.5)
    ax.legend(handles=[Patch(color=f"C{j}", label=cfg["describe"][p]) for j, p in enumerate(pols)], fontsize=7,
              loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
