"""Aggregate throughput of many concurrent streams (rsqr_jax.streams), side by side in one run.

For each stream count N the scheduler gets N requests (prompts of `prompt_len` text tokens taken at
different offsets, `new` greedy tokens each, no end-of-sequence stop, so every stream does the same
work) on N slots, compiled ahead of time (compile time reported apart). Each round is timed: prefill
rounds and generation blocks separately, so the table reports generated tokens per second over the
whole run and over the generation blocks alone, and the ratio of each to the 1-stream row. Check: the
first request is the same text for every N, and its greedy tokens must be the same in every row.

join_len > 0 (`--join N`): the stall a joining prompt causes. Per stream count N >= 2, N-1 requests start
together; once each has generated, one more request with a prompt of join_len tokens joins. Both schedules
run side by side (prefill-first, and interleaved: a prefill chunk and a generation block per round); the
table reports tokens/s and the longest stall of a generating stream (the longest wall time between two
rounds that gave it tokens), and checks that every request's tokens are the same under both schedules.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time

import jax

from rsqr_jax.eval.runtime import ConfigError, read_tokens, status, write_json_atomic
from rsqr_jax.policy import Policy
from rsqr_jax.spec import CacheSpec
from rsqr_lab.studies import base_policy
from rsqr_jax.streams import Request, StreamScheduler


@dataclasses.dataclass(frozen=True, eq=False)  # holds a Policy (studies.base_policy)
class BenchStreamsConfig:
    text: str
    streams: tuple[int, ...] = (1, 4, 16)
    prompt_len: int = 128
    new: int = 64
    repeats: int = 2  # timed runs per row (the best is reported)
    prefill_chunk: int = 64
    policy: Policy = base_policy.field()
    dtype: str = "float32"
    gen_block: int = 16
    join_len: int = 0  # > 0: the join-stall mode (see the module docstring)

    def quick(self) -> "BenchStreamsConfig":
        """The small CI run: 1 and 4 streams, 16-token prompts, 8 new tokens, 1 repeat (with --join: 2 and 4
        streams, 16 new tokens in blocks of 4, a joiner of at most 32 tokens in chunks of 8)."""
        if self.join_len:  # 4 blocks of 4 tokens: the others still generate when the joiner comes
            return dataclasses.replace(self, streams=(2, 4), prompt_len=16, new=16, repeats=1, gen_block=4,
                                       join_len=min(self.join_len, 32), prefill_chunk=min(self.prefill_chunk, 8))
        return dataclasses.replace(self, streams=(1, 4), prompt_len=16, new=8, repeats=1)

    def check(self) -> None:
        if not self.streams or min(self.streams) < 1:
            raise ConfigError("--streams must be positive counts")
        if min(self.prompt_len, self.new, self.repeats, self.prefill_chunk, self.gen_block) < 1:
            raise ConfigError("--prompt-len, --new, --repeats, --prefill-chunk and --gen-block must be positive")
        if self.join_len < 0 or (self.join_len and min(self.streams) < 2):
            raise ConfigError("--join needs a positive prompt length and --streams counts >= 2 (one joins the others)")
        if self.join_len and self.new <= self.gen_block:
            raise ConfigError(f"--join needs --new > --gen-block ({self.new} <= {self.gen_block}): the others must "
                              "still be generating when the prompt joins")
        base_policy.check(self.policy)


@dataclasses.dataclass
class BenchStreamsResult:
    data: dict

    def markdown(self) -> str:
        d = self.data
        if d["config"]["join_len"]:
            c = d["config"]
            lines = [f"# A {c['join_len']}-token prompt joins generating streams: {c['policy']}, prompts of "
                     f"{c['prompt_len']} tokens, {c['new']} new each, prefill chunk {c['prefill_chunk']}, "
                     f"gen block {c['gen_block']} ({d['platform']})", "",
                     "| streams | schedule | generated | run s | tok/s | longest stall s | stall vs prefill-first |",
                     "|---:|---|---:|---:|---:|---:|---:|"]
            for r in d["rows"]:
                lines.append(f"| {r['streams']} | {r['schedule']} | {r['generated']} | {r['run_s']:.2f} | "
                             f"{r['tok_s']:.1f} | {r['stall_s']:.3f} | {r['stall_ratio']:.2f} |")
            lines += ["", f"every request's tokens equal under both schedules: {d['outputs_match']}"]
            return "\n".join(lines) + "\n"
        lines = [f"# Concurrent streams: {d['config']['policy']}, prompts of {d['config']['prompt_len']} tokens, "
                 f"{d['config']['new']} new each ({d['platform']})", "",
                 "| streams | generated | run s | tok/s (run) | x vs 1 | gen s | tok/s (gen) | x vs 1 | compile s |",
                 "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in d["rows"]:
            lines.append(f"| {r['streams']} | {r['generated']} | {r['run_s']:.2f} | {r['tok_s']:.1f} | "
                         f"{r['ratio_vs_1']:.2f} | {r['gen_s']:.2f} | {r['gen_tok_s']:.1f} | {r['gen_ratio_vs_1']:.2f} | "
                         f"{r['compile_s']:.1f} |")
        lines += ["", f"first request's tokens equal in every row: {d['outputs_match']}"]
        return "\n".join(lines) + "\n"

    def write(self, out_dir: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        write_json_atomic(os.path.join(out_dir, "bench_streams.json"), self.data)
        with open(os.path.join(out_dir, "bench_streams.md"), "w", encoding="utf-8") as f:
            f.write(self.markdown())


def _timed_run(sched: StreamScheduler, requests: list[Request], join: Request | None = None
               ) -> tuple[float, float, list, float]:
    """(run seconds, generation-block seconds, finished results, longest stall of the first requests) of one
    scheduler session; `join` is submitted once every request has generated (the stall is measured on those).
    Generation-block seconds count the rounds without prefill (meaningful without `join`)."""
    for r in requests:
        sched.submit(r)
    done, gen_s, got_at = [], 0.0, {}  # got_at: request index -> end times of the rounds that gave it tokens
    t0 = time.perf_counter()
    while not sched.idle or join is not None:
        if join is not None and len(got_at) == len(requests):
            sched.submit(join)
            join = None
        before = {s.index: len(s.out) for s in sched.slots if s is not None}
        prefill = any(s is not None and s.todo.size > 1 for s in sched.slots) or sched.queue
        t1 = time.perf_counter()
        finished = sched.step()
        jax.block_until_ready(sched.cache)
        t2 = time.perf_counter()
        if not prefill:
            gen_s += t2 - t1
        after = {s.index: len(s.out) for s in sched.slots if s is not None} | {f.index: len(f.tokens) for f in finished}
        for i, n in after.items():
            if n > before.get(i, 0):
                got_at.setdefault(i, []).append(t2)
        done += finished
    stall = max((b - a for i, ts in got_at.items() if i < len(requests) for a, b in zip(ts, ts[1:])), default=0.0)
    return time.perf_counter() - t0, gen_s, sorted(done, key=lambda f: f.index), stall


def _run_join(config: BenchStreamsConfig, apply_fn, params, model_config, spec, policy, chunk, prompts, joiner):
    rows, match = [], True
    for n in config.streams:
        outputs = []
        for interleave in (False, True):
            sched = StreamScheduler(apply_fn, params, spec, policy, n_slots=n, prefill_chunk=chunk,
                                    vocab_size=model_config.vocab_size, gen_block=config.gen_block,
                                    interleave=interleave)
            sched.warmup()  # (the same Decoder for both schedules: compiled once)
            requests = [Request(p, config.new) for p in prompts[:n - 1]]
            best = None
            for _ in range(config.repeats):
                run_s, _, done, stall = _timed_run(sched, requests, Request(joiner, config.new))
                if best is None or run_s < best[0]:
                    best = (run_s, done, stall)
            run_s, done, stall = best
            outputs.append([f.tokens for f in done])
            generated = sum(len(f.tokens) for f in done)
            rows.append(dict(streams=n, schedule="interleave" if interleave else "prefill-first", generated=generated,
                             run_s=run_s, tok_s=generated / run_s, stall_s=stall, compile_s=sched.compile_s,
                             rounds=sched.rounds))
            rows[-1]["stall_ratio"] = stall / rows[-2]["stall_s"] if interleave and rows[-2]["stall_s"] else 1.0
            status(f"{n:3d} streams, {rows[-1]['schedule']}: {generated / run_s:.1f} tok/s, longest stall {stall:.3f}s")
        match &= outputs[0] == outputs[1]
    return rows, match


def _config_json(config: BenchStreamsConfig) -> dict:
    return base_policy.config_json(config, ("policy", "window", "sinks", "delta", "max_survivors", "block", "overflow"))


def run(config: BenchStreamsConfig, apply_fn, params, model_config, tokenizer, *, meta: dict | None = None
        ) -> BenchStreamsResult:
    config.check()
    policy = config.policy
    n_max = max(config.streams)
    ids = read_tokens(tokenizer, config.text, n_max * config.prompt_len + config.join_len)
    prompts = [tuple(int(t) for t in ids[i * config.prompt_len:(i + 1) * config.prompt_len]) for i in range(n_max)]
    if len(prompts[-1]) < config.prompt_len:
        raise ConfigError(f"the text has fewer than {n_max * config.prompt_len} tokens")
    chunk = min(config.prefill_chunk, int(policy.window))  # full's window is unbounded
    spec = CacheSpec.for_policies(policy, dims=model_config, dtype=config.dtype, max_chunk=chunk,
                                  max_len=-(-(max(config.prompt_len, config.join_len) + config.new) // 64) * 64)
    platform_name = (f"{jax.default_backend()} ({platform.processor() or platform.machine()}, "
                     f"{os.cpu_count()} cores)")
    if config.join_len:
        joiner = tuple(int(t) for t in ids[n_max * config.prompt_len:])
        if len(joiner) < config.join_len:
            raise ConfigError(f"the text has fewer than {n_max * config.prompt_len + config.join_len} tokens")
        rows, match = _run_join(config, apply_fn, params, model_config, spec, policy, chunk, prompts, joiner)
        return BenchStreamsResult(dict(config=_config_json(config), rows=rows, outputs_match=match,
                                       platform=platform_name, policy_name=policy.name, meta=meta or {}))
    rows, first = [], []
    for n in config.streams:
        sched = StreamScheduler(apply_fn, params, spec, policy, n_slots=n, prefill_chunk=chunk,
                                vocab_size=model_config.vocab_size, gen_block=config.gen_block, interleave=False)
        sched.warmup()
        requests = [Request(p, config.new) for p in prompts[:n]]
        best = None
        for _ in range(config.repeats):
            run_s, gen_s, done, _ = _timed_run(sched, requests)
            if best is None or run_s < best[0]:
                best = (run_s, gen_s, done)
        run_s, gen_s, done = best
        generated = sum(len(f.tokens) for f in done)
        first.append(done[0].tokens)
        rows.append(dict(streams=n, generated=generated, run_s=run_s, tok_s=generated / run_s, gen_s=gen_s,
                         gen_tok_s=generated / gen_s if gen_s > 0 else float("nan"),
                         compile_s=sched.compile_s, rounds=sched.rounds))
        status(f"{n:3d} streams: {generated} tokens in {run_s:.2f}s = {generated / run_s:.1f} tok/s "
               f"(generation blocks {rows[-1]['gen_tok_s']:.1f} tok/s), compiled in {sched.compile_s:.1f}s")
    base = next((r for r in rows if r["streams"] == 1), rows[0])
    for r in rows:
        r["ratio_vs_1"] = r["tok_s"] / base["tok_s"]
        r["gen_ratio_vs_1"] = r["gen_tok_s"] / base["gen_tok_s"]
    data = dict(config=_config_json(config), rows=rows, outputs_match=all(f == first[0] for f in first),
                platform=platform_name, policy_name=policy.name, meta=meta or {})
    return BenchStreamsResult(data)
