"""The memory demo measured: the demo conversation of `decode.py` (facts stated once, unrelated turns until
the facts have left the window and the survivors, then the question that asks for them), sampled under many
seeds for each arm, each fact scored in the answer, rates with Wilson intervals.

Every seed is one stream of a `StreamScheduler` (the streams of an arm run together, vmapped); a
conversation continues its stream turn after turn (`StreamScheduler.follow_up`), so a stream sees what a lone
`Session` with that seed sees (the scheduler's equivalence), at a fraction of the wall time. Before the
question the fact tokens' positions are looked up in each stream's device cache (window, sinks, survivors)
and cold store, so the table says whether a remembered fact came from the device cache or from recall.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from rsqr_jax import conversation
from rsqr_jax.cli import chat
from rsqr_jax.eval.runtime import ConfigError, status, write_json_atomic
from rsqr_jax.eval.stats import wilson
from rsqr_jax.policy import Policy
from rsqr_jax.presets import load_preset
from rsqr_lab.studies import base_policy

# The embedded model's preset: the recall arm's settings are decode.py's defaults on it.
EMBEDDED = load_preset("SmolLM2-135M-Instruct").resolve()
# arm -> (policy, recall pages); the cache of decode.py's defaults.
ARMS = {"full": ("full", 0), "rsqr": ("rsqr", 0), "rsqr_recall": ("rsqr", EMBEDDED.recall_pages)}


@dataclasses.dataclass(frozen=True, eq=False)  # holds a Policy (studies.base_policy)
class MemoryConfig:
    """seeds: conversations per arm (seeds first_seed, first_seed + 1, ...); policy: the bounded arms' window,
    sinks and survivors (each arm sets its mode and recall pages), the cache decode.py's defaults; sampling:
    decode.py's chat defaults unless given (by Sampling field)."""

    arms: tuple[str, ...] = tuple(ARMS)
    seeds: int = 20
    first_seed: int = 0
    max_new_tokens: int = 128
    policy: Policy = base_policy.field()
    cold_capacity: int = 4096
    page_size: int = 16
    prefill_chunk: int = 64
    sampling: tuple[tuple[str, float], ...] = ()
    history: tuple[str, ...] = ()  # recorded replies to every turn but the question (then only the answer is sampled)
    # The recall arm's page choice: the model's preset (default: the embedded model's, decode.py's default there).
    reselect: int = EMBEDDED.recall["reselect"]
    share_from: int | tuple[int, ...] | None = EMBEDDED.recall["share_from"]
    score_dtype: str = EMBEDDED.recall["score_dtype"]

    def __post_init__(self):
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown or not self.arms:
            raise ConfigError(f"unknown arm {unknown[0] if unknown else ''!r}: choose from {', '.join(ARMS)}")
        if self.seeds < 1 or self.max_new_tokens < 1:
            raise ConfigError("--seeds and --max-new-tokens must be >= 1")
        chat.check_sampling(dict(self.sampling))
        base_policy.check(self.policy)

    @property
    def sampling_values(self) -> dict:
        return chat.resolve_sampling(dict(self.sampling))

    def to_json(self) -> dict:
        return {**base_policy.config_json(self, ("window", "n_sink", "delta", "max_survivors")),
                "sampling": self.sampling_values}


def read_history(path: str) -> tuple[str, ...]:
    """The recorded replies of a JSON file {"replies": [str, ...]} (ConfigError, one line, otherwise)."""
    try:
        with open(path, encoding="utf-8") as f:
            replies = json.load(f)["replies"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"cannot read a recorded history from {path}: {e}") from None
    if not isinstance(replies, list) or not all(isinstance(r, str) for r in replies):
        raise ConfigError(f"{path}: \"replies\" must be a list of strings")
    return tuple(replies)


def check_history(history: tuple[str, ...], demo: chat.MemoryDemo = chat.DEMO) -> None:
    if history and len(history) != len(demo.turns) - 1:
        raise ConfigError(f"a recorded history needs {len(demo.turns) - 1} replies (one per turn but the question), "
                          f"got {len(history)}")


def policy_of(arm: str, config: MemoryConfig) -> Policy:
    mode, pages = ARMS[arm]
    return config.policy.replace(mode=mode, recall_pages=pages)


def run_arm(arm: str, config: MemoryConfig, apply_fn, params, model_config, tokenizer,
            demo: chat.MemoryDemo = chat.DEMO) -> list[dict]:
    """One conversation per seed under `arm`, all streams at once: per seed, the replies, the memory check
    (where every earlier mention of a fact is: device cache or cold store), which facts the answer names.
    With config.history the replies before the question are that recorded transcript (fed, not generated):
    only the answer is sampled."""
    from rsqr_jax.sampling import Sampling
    from rsqr_jax.spec import CacheSpec, ColdStore
    from rsqr_jax.streams import Request, StreamScheduler

    check_history(config.history, demo)
    policy = policy_of(arm, config)
    recall = ARMS[arm][1]
    cold = {"cold": ColdStore(config.cold_capacity, config.page_size, reselect=config.reselect,
                              share_from=config.share_from, score_dtype=config.score_dtype)} if recall else {}
    n = config.seeds
    max_len = chat.full_max_len(tokenizer, demo.turns, config.max_new_tokens, demo.system)
    if config.history:
        max_len += sum(len(tokenizer.encode(r)) for r in config.history)
    spec = CacheSpec.for_policies(policy, dims=model_config, max_chunk=config.prefill_chunk, max_len=max_len,
                                  **({**cold, "max_recall_pages": recall} if recall else {}))
    sched = StreamScheduler(apply_fn, params, spec, policy, n_slots=n, prefill_chunk=config.prefill_chunk,
                            sampling=Sampling(**config.sampling_values), eos_ids=model_config.eos_token_ids,
                            vocab_size=model_config.vocab_size)
    system = [{"role": "system", "content": demo.system}]
    rows = [{"seed": config.first_seed + i, "replies": [], "stops": []} for i in range(n)]
    mentions: list[list[int]] = [[] for _ in range(n)]

    def ask(ids_of: list[list[int]], first: bool) -> list[list[int]]:
        """Submit one request per stream, run them, record replies; returns each stream's fed reply ids."""
        t_N = np.asarray(sched.cache.t) - np.asarray(sched.cache.start)
        index_of = {}
        for i in range(n):
            req = Request(tuple(ids_of[i]), config.max_new_tokens, config.first_seed + i)
            index_of[sched.submit(req) if first else sched.follow_up(i, req)] = i
        fed = [[] for _ in range(n)]
        for f in sched.run():
            i = index_of[f.index]
            fed[i] = [t for t in f.tokens if t not in sched.eos_ids]
            rows[i]["replies"].append(tokenizer.decode(fed[i], skip_special_tokens=True))
            rows[i]["stops"].append(f.stop)
            rows[i]["reply_start"] = int(t_N[i]) + len(ids_of[i])
        return fed

    if config.history:  # the recorded conversation, then the question: one request per stream
        messages = list(system)
        for turn, reply in zip(demo.turns[:-1], config.history):
            messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": reply}]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        history_ids = tokenizer.encode(text, add_special_tokens=False)
        ids = history_ids + conversation.ChatFeed(tokenizer, messages, text).user_turn(demo.question)
        for i in range(n):
            mentions[i] = demo.positions(tokenizer, history_ids, 0)
        ask([ids] * n, first=True)
    else:
        feeders = [conversation.ChatFeed(tokenizer, list(system)) for _ in range(n)]
        for turn_index, turn in enumerate(demo.turns):
            ids = [f.user_turn(turn) for f in feeders]
            t_N = np.asarray(sched.cache.t) - np.asarray(sched.cache.start)
            asking = turn == demo.question
            if not asking:
                for i in range(n):
                    mentions[i] += demo.positions(tokenizer, ids[i], int(t_N[i]))
            fed = ask(ids, first=turn_index == 0)
            for i in range(n):
                feeders[i].assistant_reply(rows[i]["replies"][-1])
                if not asking:
                    mentions[i] += demo.positions(tokenizer, fed[i], rows[i]["reply_start"])
    # Positions already evicted never come back into the device cache, so the check after the answer says
    # where the earlier mentions were when the question was asked.
    t_N = np.asarray(sched.cache.t) - np.asarray(sched.cache.start)
    for i, r in enumerate(rows):
        r["answer_names"] = demo.score(r["replies"][-1])
        r["memory"] = chat.memory_check(_stream(sched.cache, i), mentions[i], bool(recall))
        r["session_tokens"] = int(t_N[i])
        del r["reply_start"]
    return rows


def _stream(cache, i: int):
    """Stream i of a vmap_streams cache (its position fields)."""
    import types

    cold = None if cache.cold is None else types.SimpleNamespace(pos=np.asarray(cache.cold.pos)[i])
    return types.SimpleNamespace(win_pos=np.asarray(cache.win_pos)[i], surv_pos=np.asarray(cache.surv_pos)[i],
                                 cold=cold)


def summarize(rows_by_arm: dict[str, list[dict]], demo: chat.MemoryDemo = chat.DEMO) -> list[dict]:
    """Per arm: each fact's rate, both facts, with 95% Wilson intervals; how many runs had every fact token
    out of the device cache (and, with recall, in the cold store) at question time."""
    out = []
    for arm, rows in rows_by_arm.items():
        n = len(rows)
        row = {"arm": arm, "n": n}
        for f in [x.label for x in demo.facts] + ["both"]:
            k = sum(all(r["answer_names"].values()) if f == "both" else r["answer_names"][f] for r in rows)
            lo, hi = wilson(k, n)
            row[f] = {"k": k, "rate": k / n, "lo": lo, "hi": hi}
        row["facts_out_of_device_cache"] = sum(r["memory"]["in_device_cache"] == 0 for r in rows)
        if rows and "in_cold_store" in rows[0]["memory"]:
            row["facts_all_in_cold_store"] = sum(r["memory"]["in_cold_store"] == len(r["memory"]["fact_positions"])
                                                 for r in rows)
        row["mean_session_tokens"] = float(np.mean([r["session_tokens"] for r in rows]))
        out.append(row)
    return out


def run(config: MemoryConfig, apply_fn, params, model_config, tokenizer) -> dict:
    result = {"config": config.to_json(),
              "demo": dataclasses.asdict(chat.DEMO), "arms": {}}
    for arm in config.arms:
        t0 = time.perf_counter()
        result["arms"][arm] = run_arm(arm, config, apply_fn, params, model_config, tokenizer)
        status(f"{arm}: {config.seeds} conversations in {time.perf_counter() - t0:.0f}s")
    result["summary"] = summarize(result["arms"])
    return result


def markdown(result: dict) -> str:
    facts = [f["label"] for f in result["demo"]["facts"]]
    head = "| arm | n | " + " | ".join(f"{f} named" for f in facts) + " | both | facts out of the device cache |"
    lines = [head, "|" + "---|" * (len(facts) + 4)]
    for s in result["summary"]:
        cells = [f"{s[f]['k']}/{s['n']} ({100 * s[f]['rate']:.0f}%, {100 * s[f]['lo']:.0f}-{100 * s[f]['hi']:.0f}%)"
                 for f in facts + ["both"]]
        out = f"{s['facts_out_of_device_cache']}/{s['n']}"
        if "facts_all_in_cold_store" in s:
            out += f" (all in the cold store: {s['facts_all_in_cold_store']}/{s['n']})"
        lines.append(f"| {s['arm']} | {s['n']} | " + " | ".join(cells) + f" | {out} |")
    return "\n".join(lines) + "\n"


def write(result: dict, out_dir: str) -> Path:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    write_json_atomic(d / "memory.json", result)
    (d / "memory.md").write_text(markdown(result), encoding="utf-8")
    return d / "memory.json"


def transcript(result: dict, arm: str, seed_index: int = 0) -> str:
    """One conversation as text (turn, reply)."""
    turns = result["demo"]["turns"]
    row = result["arms"][arm][seed_index]
    return "\n\n".join(f">>> {t}\n{r}" for t, r in zip(turns, row["replies"]))


__all__ = ["ARMS", "MemoryConfig", "markdown", "run", "run_arm", "summarize", "transcript", "write"]
