"""What a chat user gets: decode speed of decode.py's token-by-token reply loop against the in-process engine,
side by side in one process.

Arms (each its own Session, all from the same seed, the same short chat prompt, decode.py's cache):
  * plain rsqr and rsqr + recall (decode.py's default; with a prompt and reply that fit the window, nothing
    leaves it, so the cold store holds nothing recallable and the tier skips its work),
  * the engine (`Session.generate(n)`: compiled blocks of gen_block steps, one host round trip per block)
    and the CLI loop (`conversation.generate_reply`: `generate(1)` per token, incremental detokenization, every
    piece printed with flush to a null stream, as decode.py prints to a terminal),
  * the chat sampler (decode.py's defaults) and greedy (its --temperature 0) on the plain rsqr engine.

Round r runs every arm once, in an order rotated by r, so load on the machine hits every arm alike; each
arm's session is reset and fed the prompt (prefill, timed apart) before its timed reply. End-of-turn
tokens do not end a reply here, so every reply is exactly `new_tokens` long. Ratios are paired per round
(the arms of one round ran back to back) and their median over rounds is reported, of wall time (what
the user waits) and of the process's CPU time (the cost, which other load on the machine disturbs less).
Compilation happens in `warmup` before the rounds and is reported apart; an untimed round of gen_block + 1
tokens per arm precedes the timed ones.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import numpy as np

from rsqr_jax.eval.runtime import ConfigError, status, write_json_atomic
from rsqr_jax.policy import Policy
from rsqr_lab.studies import base_policy

DEFAULT_PROMPT = "What is the capital of France?"


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    recall: bool  # rsqr + recall (decode.py's default) instead of plain rsqr
    loop: str  # "engine" (Session.generate in blocks) or "cli" (conversation.generate_reply, one token per call)
    greedy: bool = False  # temperature 0 instead of the chat sampler


ARMS = (
    Arm("rsqr_engine", recall=False, loop="engine"),
    Arm("rsqr_cli", recall=False, loop="cli"),
    Arm("recall_engine", recall=True, loop="engine"),
    Arm("recall_cli", recall=True, loop="cli"),
    Arm("rsqr_engine_greedy", recall=False, loop="engine", greedy=True),
)

# (name, numerator arms, denominator arms, what is divided, target as (comparison, value)). Several arms on a
# side: their times summed per round; "both" rows pool the 2 x 2 of policy and loop (twice the data of one pair).
RATIOS = (
    ("cli / engine, plain rsqr (tok/s)", ("rsqr_cli",), ("rsqr_engine",), "tok_per_s", (">=", 0.90)),
    ("cli / engine, rsqr + recall (tok/s)", ("recall_cli",), ("recall_engine",), "tok_per_s", (">=", 0.90)),
    ("cli / engine, both policies (tok/s)", ("rsqr_cli", "recall_cli"), ("rsqr_engine", "recall_engine"),
     "tok_per_s", (">=", 0.90)),
    ("recall (empty store) / plain rsqr, engine (ms/token)", ("recall_engine",), ("rsqr_engine",), "ms_per_token",
     ("<=", 1.10)),
    ("recall (empty store) / plain rsqr, cli (ms/token)", ("recall_cli",), ("rsqr_cli",), "ms_per_token",
     ("<=", 1.10)),
    ("recall (empty store) / plain rsqr, both loops (ms/token)", ("recall_engine", "recall_cli"),
     ("rsqr_engine", "rsqr_cli"), "ms_per_token", ("<=", 1.10)),
    ("chat sampler / greedy, plain rsqr engine (ms/token)", ("rsqr_engine",), ("rsqr_engine_greedy",),
     "ms_per_token", None),
)


@dataclasses.dataclass(frozen=True, eq=False)  # holds a Policy (studies.base_policy)
class BenchChatConfig:
    """decode.py's defaults: rsqr with the library's window, sinks and survivors (`policy`, its mode is rsqr),
    the recall arms' 4 pages of a 4096-token cold store (page 16; the plain arms recall nothing, so the pages are
    not the base policy's), prefill chunk 64; `sampling` None = decode.py's chat defaults (chat.CHAT_SAMPLING)."""

    prompt: str = DEFAULT_PROMPT
    system: str | None = None  # None: the chat template's own
    new_tokens: int = 96
    rounds: int = 3
    seed: int = 0
    policy: Policy = base_policy.field()
    recall_pages: int = 4
    cold_capacity: int = 4096
    page_size: int = 16
    prefill_chunk: int = 64
    gen_block: int = 16
    sampling: tuple[tuple[str, float], ...] | None = None

    def __post_init__(self):
        if self.new_tokens < 1 or self.rounds < 1 or self.prefill_chunk < 1:
            raise ConfigError("--new-tokens, --rounds and --prefill-chunk must be positive")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"--seed must be in [0, 2**32), got {self.seed}")
        if not self.prompt.strip():
            raise ConfigError("--prompt must not be empty")
        if self.recall_pages < 1:
            raise ConfigError(f"--recall-pages must be >= 1 (the recall arms need the tier), got {self.recall_pages}")
        from rsqr_jax.spec import ColdStore

        try:
            cold = ColdStore(self.cold_capacity, self.page_size)
        except ValueError as e:
            raise ConfigError(f"recall settings: {e}") from None
        if self.recall_pages > cold.pages:
            raise ConfigError(f"--recall-pages {self.recall_pages} exceeds the cold store's {cold.pages} pages")
        base_policy.check(self.policy)

    def sampling_values(self) -> dict:
        from rsqr_jax.cli.chat import CHAT_SAMPLING

        return dict(CHAT_SAMPLING) if self.sampling is None else dict(self.sampling)

    def quick(self) -> "BenchChatConfig":
        """The small CI run: one round of one generation block."""
        return dataclasses.replace(self, new_tokens=self.gen_block, rounds=1)


def _null_emit():
    """decode.py's emit (print each piece with flush) into a stream that discards it: the per-token write
    and flush are paid, a terminal's rendering is not."""
    sink = open(os.devnull, "w", encoding="utf-8")

    def emit(piece: str) -> None:
        if piece:
            print(piece, end="", file=sink, flush=True)

    return emit, sink


def _recallable(session) -> int:
    from rsqr_lab.studies.recall_timing import _recallable as count

    return count(session) if session.spec.cold_slots else 0


def build_sessions(cfg: BenchChatConfig, apply_fn, params, model_config) -> dict:
    """One Session per arm (same seed); sessions of one spec and policy share one compilation."""
    from rsqr_jax.sampling import Sampling
    from rsqr_jax.session import Session
    from rsqr_jax.spec import CacheSpec, ColdStore

    chunk = min(cfg.prefill_chunk, int(cfg.policy.window))
    chat_values = cfg.sampling_values()
    setups = {}
    for recall in (False, True):
        pol = cfg.policy.replace(mode="rsqr", recall_pages=cfg.recall_pages if recall else 0)
        cold = ({"cold": ColdStore(cfg.cold_capacity, cfg.page_size), "max_recall_pages": cfg.recall_pages}
                if recall else {})
        setups[recall] = (pol, CacheSpec.for_policies(pol, dims=model_config, max_chunk=chunk, **cold))
    sessions = {}
    for arm in ARMS:
        pol, spec = setups[arm.recall]
        values = {**chat_values, "temperature": 0.0} if arm.greedy else chat_values
        s = Session(apply_fn, params, spec, pol, prefill_chunk=chunk, sampling=Sampling(**values), seed=cfg.seed,
                    eos_ids=(), vocab_size=model_config.vocab_size, gen_block=cfg.gen_block)
        s.warmup()
        status(f"bench_chat: {arm.name}: compiled in {s.compile_s:.1f}s")
        sessions[arm.name] = s
    return sessions


def run(cfg: BenchChatConfig, apply_fn, params, model_config, tokenizer) -> dict:
    from rsqr_jax import conversation
    from rsqr_jax.cli import chat

    is_chat = conversation.has_chat_template(tokenizer)
    prompt = chat.prompt_ids(tokenizer, cfg.prompt, is_chat, cfg.system)
    window = int(cfg.policy.window)
    if len(prompt) + cfg.new_tokens > window:
        raise ConfigError(f"the prompt ({len(prompt)} tokens) and --new-tokens {cfg.new_tokens} must fit the window "
                          f"{window}: the recall arms measure an empty cold store")
    status(f"bench_chat: seed {cfg.seed}; prompt {len(prompt)} tokens"
           f"{' (chat template)' if is_chat else ''}; {cfg.new_tokens} new tokens x {cfg.rounds} rounds")
    sessions = build_sessions(cfg, apply_fn, params, model_config)
    emit, sink = _null_emit()
    load_before = _load_average()
    secs = {a.name: [] for a in ARMS}
    cpu = {a.name: [] for a in ARMS}  # the process's CPU time (all threads): the cost, less sensitive to load
    prefill = {a.name: [] for a in ARMS}
    texts = {a.name: [] for a in ARMS}  # each reply's text (the same tokens give the same text)
    recallable = {a.name: 0 for a in ARMS}

    def reply(arm: Arm, n_new: int) -> tuple[float, float, float, str]:
        """(prefill s, reply s, reply CPU s, reply text) of one round of `arm`: reset, feed the prompt, reply."""
        s = sessions[arm.name]
        s.reset()
        t0 = time.perf_counter()
        s.feed(prompt)
        t1, c1 = time.perf_counter(), time.process_time()
        if arm.loop == "engine":
            ids = s.generate(n_new)
            t2, c2 = time.perf_counter(), time.process_time()
            n, text = len(ids), tokenizer.decode(ids, skip_special_tokens=True)  # untimed: a check
        else:
            text, n, _ = conversation.generate_reply(s, tokenizer, n_new, (), emit)
            t2, c2 = time.perf_counter(), time.process_time()
        if n != n_new:  # end-of-turn tokens are not ends here: a short reply is a bug
            raise RuntimeError(f"{arm.name} generated {n} of {n_new} tokens")
        return t1 - t0, t2 - t1, c2 - c1, text

    try:
        # One untimed round first: the host-side work a session does once (eager array ops of reset, feed and
        # the first block) is paid there, not by whichever arm happens to run first.
        for arm in ARMS:
            reply(arm, min(cfg.new_tokens, cfg.gen_block + 1))
        for r in range(cfg.rounds):
            order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]
            for arm in order:
                t_feed, t_reply, c_reply, text = reply(arm, cfg.new_tokens)
                cpu[arm.name].append(c_reply)
                texts[arm.name].append(text)
                prefill[arm.name].append(t_feed)
                secs[arm.name].append(t_reply)
                recallable[arm.name] = max(recallable[arm.name], _recallable(sessions[arm.name]))
            status(f"bench_chat: round {r + 1}/{cfg.rounds}: "
                   + ", ".join(f"{a.name} {cfg.new_tokens / secs[a.name][-1]:.1f}" for a in ARMS) + " tok/s")
    finally:
        sink.close()
    rows = []
    for arm in ARMS:
        t = secs[arm.name]
        rows.append({"arm": arm.name, "policy": "rsqr + recall" if arm.recall else "rsqr", "loop": arm.loop,
                     "sampling": "greedy" if arm.greedy else "chat", "new_tokens": cfg.new_tokens,
                     "tok_per_s": cfg.new_tokens / float(np.median(t)),
                     "ms_per_token": 1000 * float(np.median(t)) / cfg.new_tokens,
                     "tok_per_s_rounds": [cfg.new_tokens / x for x in t],
                     "cpu_ms_per_token": 1000 * float(np.median(cpu[arm.name])) / cfg.new_tokens,
                     "cpu_ms_per_token_rounds": [1000 * x / cfg.new_tokens for x in cpu[arm.name]],
                     "prefill_ms": 1000 * float(np.median(prefill[arm.name])),
                     "compile_s": sessions[arm.name].compile_s, "recallable": recallable[arm.name]})
    ratios = []
    for name, num, den, field, target in RATIOS:
        a, b = (den, num) if field == "tok_per_s" else (num, den)  # a speed ratio is the inverse time ratio

        def per_round(times):
            return [sum(times[x][i] for x in a) / sum(times[x][i] for x in b) for i in range(cfg.rounds)]

        def meets(v):
            return None if target is None else (v >= target[1] if target[0] == ">=" else v <= target[1])

        wall, cpu_round = per_round(secs), per_round(cpu)
        value, cpu_value = float(np.median(wall)), float(np.median(cpu_round))
        ratios.append({"ratio": name, "numerator": list(num), "denominator": list(den), "of": field, "value": value,
                       "rounds": wall, "cpu_value": cpu_value, "cpu_rounds": cpu_round,
                       "target": None if target is None else f"{target[0]} {target[1]:.2f}",
                       "meets": meets(value), "cpu_meets": meets(cpu_value)})
    same = {f"{a} == {b}": texts[a] == texts[b] for a, b in
            (("rsqr_cli", "rsqr_engine"), ("recall_cli", "recall_engine"), ("recall_engine", "rsqr_engine"))}
    return {"config": base_policy.config_json(cfg, ("window", "n_sink", "delta", "max_survivors")), "seed": cfg.seed, "sampling": cfg.sampling_values(),
            "prompt_tokens": len(prompt), "chat_template": is_chat, "rows": rows, "ratios": ratios,
            "same_text": same, "load_average": {"before": load_before, "after": _load_average()}}


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def markdown(result: dict) -> str:
    cfg = result["config"]
    out = [f"seed {result['seed']}; prompt {result['prompt_tokens']} tokens; {cfg['new_tokens']} new tokens per "
           f"reply, {cfg['rounds']} rounds (median)", "",
           "| arm | policy | loop | sampling | tok/s | ms/token | CPU ms/token | prefill ms | compile s | recallable |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        out.append(f"| {r['arm']} | {r['policy']} | {r['loop']} | {r['sampling']} | {r['tok_per_s']:.1f} | "
                   f"{r['ms_per_token']:.1f} | {r['cpu_ms_per_token']:.1f} | {r['prefill_ms']:.0f} | "
                   f"{r['compile_s']:.1f} | {r['recallable']} |")
    out += ["", "| ratio (median of per-round ratios) | wall time | CPU time | target | meets (wall, CPU) |",
            "|---|---|---|---|---|"]
    yes = {None: "-", True: "yes", False: "no"}
    for q in result["ratios"]:
        meets = "-" if q["meets"] is None else f"{yes[q['meets']]}, {yes[q['cpu_meets']]}"
        out.append(f"| {q['ratio']} | {q['value']:.3f} | {q['cpu_value']:.3f} | {q['target'] or '-'} | {meets} |")
    same = ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in result["same_text"].items())
    out += ["", "chat: decode.py's sampler; greedy: its --temperature 0 (the other defaults kept). CPU: the "
            "process's CPU time (all threads), less sensitive to other load than wall time. compile s: "
            "warmup; the first session of each cache compiles, the others reuse its compilation. recallable: "
            "tokens in the cold store that have left the window (0: the recall tier skips its work).",
            "", f"same reply text in every round: {same}"]
    return "\n".join(out) + "\n"


def write(result: dict, out_dir) -> None:
    import pathlib

    write_json_atomic(pathlib.Path(out_dir) / "bench_chat.json", result)
    (pathlib.Path(out_dir) / "bench_chat.md").write_text(markdown(result))


def finite_positive(result: dict) -> bool:
    """Every row's speed figures are positive and finite (what a test can assert without timing thresholds)."""
    keys = ("tok_per_s", "ms_per_token", "cpu_ms_per_token", "prefill_ms")
    return all(math.isfinite(r[k]) and r[k] > 0 for r in result["rows"] for k in keys)
