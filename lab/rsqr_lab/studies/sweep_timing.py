"""Benchmark: a grid of policies vmapped in one run (`rsqr_jax.sweep.sweep_nll`) vs the same policies run
one after another (`engine.stream_nll` with the same union CacheSpec, so it compiles once too).

Each arm runs in its own process, so its peak RSS (ru_maxrss) is its own: `run` starts
`child_cmd + arm_argv(config, arm)` per arm and reads the one JSON line the child prints; the child (the
command line, which loads the model) calls `run_arm`. Compilation is excluded from the throughput: each
arm first runs a warm-up of one segment, then the timed stream. Besides wall-clock throughput it reports
throughput per CPU-second of the arm's process, far less sensitive to other load on a shared machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys

import numpy as np

from rsqr_jax.eval.runtime import ConfigError, Timer, progress, status, write_json_atomic

ARMS = ("sequential", "vmapped")
# A grid of policies, not one base policy (policy_sweep's grid strings).
DEFAULT_GRID = "mode=rsqr,rerotate,leave_gaps,streamingllm window=64,128 delta=8 max_survivors=32"
QUICK_GRID = "mode=rsqr,rerotate,leave_gaps,streamingllm window=8,16 delta=4 max_survivors=8"
JSON_NAME = "bench_sweep.json"


@dataclasses.dataclass(frozen=True)
class BenchSweepConfig:
    """quick = the tiny random model (`rsqr_lab.studies.policy_sweep.quick_model`) on random tokens, seed 0."""

    grid: str = DEFAULT_GRID
    tokens: int = 256
    segment: int = 128
    chunk: int = 1
    dtype: str = "float32"
    text: str | None = None  # the text file of the real-model run (ignored when quick)
    model: str | None = None  # GGUF file or HF directory (None: the embedded SmolLM2-135M)
    quick: bool = False

    @classmethod
    def make(cls, *, quick: bool = False, **given) -> "BenchSweepConfig":
        """Defaults by mode: quick streams 96 tokens in segments of 32 over QUICK_GRID."""
        base = {"grid": QUICK_GRID, "tokens": 96, "segment": 32} if quick else {}
        given = {k: v for k, v in given.items() if v is not None}
        return cls(quick=quick, **{**base, **given})

    def validate(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.tokens < 2 or self.chunk < 1 or self.segment % self.chunk:
            raise ConfigError("--tokens must be >= 2 and --chunk must divide --segment")
        if not self.quick and (self.text is None or not os.path.isfile(self.text)):
            raise ConfigError(f"text file not found: {self.text}")
        from rsqr_jax.sweep import policy_grid

        policy_grid(self.grid)  # a bad grid -> PolicyError (one line), before any subprocess


def arm_argv(config: BenchSweepConfig, arm: str) -> list[str]:
    """Command-line arguments that make the bench's command line run one arm of `config`."""
    argv = ["--arm", arm, "--grid", config.grid, "--tokens", str(config.tokens), "--dtype", config.dtype,
            "--chunk", str(config.chunk), "--segment", str(config.segment)]
    argv += ["--quick"] if config.quick else ["--text", str(config.text)]
    return argv + (["--model", config.model] if config.model else [])


def _rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_arm(config: BenchSweepConfig, arm: str, apply_fn, params, model_config, tokens_1xT,
            model_name: str, rss_after_load_mib: float | None = None) -> dict:
    """One arm in this process: warm-up (compile) on one segment, then the timed stream of every policy."""
    import jax

    from rsqr_jax.engine import stream_nll
    from rsqr_jax.policy import unstack_policies
    from rsqr_jax.spec import CacheSpec
    from rsqr_jax.sweep import policy_grid, sweep_nll

    if arm not in ARMS:
        raise ConfigError(f"arm must be one of {', '.join(ARMS)}, got {arm!r}")
    policies, names = policy_grid(config.grid)
    rss_loaded = _rss_mib() if rss_after_load_mib is None else rss_after_load_mib
    tokens_1xT = np.asarray(tokens_1xT, np.int32)
    spec = CacheSpec.for_policies(policies, dims=model_config, dtype=config.dtype, max_chunk=config.chunk,
                                  max_len=tokens_1xT.shape[1])
    kw = dict(chunk=config.chunk, segment=config.segment)
    singles = unstack_policies(policies)

    def stream(toks):
        if arm == "vmapped":
            return sweep_nll(apply_fn, params, toks, policies, spec=spec, **kw)
        return np.stack([stream_nll(apply_fn, params, toks, p, spec, **kw)[0] for p in singles])

    with Timer() as warm:  # the sequential arm compiles once: every policy shares the union spec
        warm_tokens = tokens_1xT[:, :config.segment + 1]
        if arm == "vmapped":
            stream(warm_tokens)
        else:
            stream_nll(apply_fn, params, warm_tokens, singles[0], spec, **kw)
    with Timer() as timed:
        nll_PxBxT = stream(tokens_1xT)
    n_pol, n_scored = nll_PxBxT.shape[0], nll_PxBxT.shape[-1]
    return {"arm": arm, "n_policies": n_pol, "names": names, "n_scored": n_scored, "elapsed_s": timed.wall,
            "warmup_s": warm.wall, "policy_tokens_per_s": n_pol * n_scored / timed.wall,
            "cpu_s": timed.cpu, "policy_tokens_per_cpu_s": n_pol * n_scored / timed.cpu,
            "steps_per_s": (n_scored if arm == "vmapped" else n_pol * n_scored) / timed.wall,
            "peak_rss_mib": _rss_mib(), "rss_after_load_mib": rss_loaded,
            "cache_bytes_union": spec.bytes_by_part()["total"], "model": model_name,
            "backend": jax.default_backend(), "ppl": [float(np.exp(x.mean())) for x in nll_PxBxT.astype(np.float64)]}


@dataclasses.dataclass
class BenchSweepResult:
    summary: dict
    arms: dict  # arm name -> run_arm's dict

    def to_json(self) -> dict:
        return {"summary": self.summary, "arms": self.arms}

    def write(self, out_dir) -> str:
        path = os.path.join(out_dir, JSON_NAME)
        write_json_atomic(path, self.to_json())
        return path

    def markdown(self) -> str:
        seq, vm, s = self.arms["sequential"], self.arms["vmapped"], self.summary
        lines = [f"{len(vm['names'])} policies x {vm['n_scored']} scored tokens, {s['dtype']}, chunk {s['chunk']}, "
                 f"{vm['backend']}, model {os.path.basename(vm['model'])}",
                 "| arm | wall s (timed) | warm-up s | policy-tokens/s | CPU s | policy-tokens/CPU-s | peak RSS MiB | "
                 "RSS after load MiB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in (seq, vm):
            lines.append(f"| {r['arm']} | {r['elapsed_s']:.1f} | {r['warmup_s']:.1f} | {r['policy_tokens_per_s']:.1f} "
                         f"| {r['cpu_s']:.1f} | {r['policy_tokens_per_cpu_s']:.1f} | {r['peak_rss_mib']:.0f} | "
                         f"{r['rss_after_load_mib']:.0f} |")
        lines.append(f"throughput ratio vmapped/sequential: {s['throughput_ratio']:.2f}x wall, "
                     f"{s['cpu_throughput_ratio']:.2f}x per CPU-second; peak RSS ratio {s['peak_rss_ratio']:.2f}; "
                     f"max rel. ppl difference {s['max_rel_ppl_diff']:.1e}")
        return "\n".join(lines)


def summarize(config: BenchSweepConfig, arms: dict) -> BenchSweepResult:
    """Ratios vmapped/sequential and the largest relative perplexity difference between the arms."""
    seq, vm = arms["sequential"], arms["vmapped"]
    summary = {
        "throughput_ratio": vm["policy_tokens_per_s"] / seq["policy_tokens_per_s"],
        "cpu_throughput_ratio": vm["policy_tokens_per_cpu_s"] / seq["policy_tokens_per_cpu_s"],
        "peak_rss_ratio": vm["peak_rss_mib"] / seq["peak_rss_mib"],
        "max_rel_ppl_diff": max(abs(a - b) / b for a, b in zip(vm["ppl"], seq["ppl"])),
        "grid": config.grid, "tokens": config.tokens, "chunk": config.chunk, "segment": config.segment,
        "dtype": config.dtype, "quick": config.quick, "cpu_count": os.cpu_count(), "machine": platform.platform(),
        "loadavg_1min": os.getloadavg()[0],
    }
    return BenchSweepResult(summary, dict(arms))


def run(config: BenchSweepConfig, child_cmd: list[str], *, show_progress: bool = True) -> BenchSweepResult:
    """Both arms, each in its own process `child_cmd + arm_argv(config, arm)` (child_cmd: the command line
    that loads the model and calls run_arm, e.g. [sys.executable, "scripts/bench_sweep.py"])."""
    config.validate()
    arms = {}
    with progress(len(ARMS), "bench_sweep", unit="arm", enabled=show_progress) as bar:
        for arm in ARMS:
            bar.set_description(f"bench_sweep: {arm} arm")
            if not show_progress:
                status(f"bench_sweep: running the {arm} arm ...")
            res = subprocess.run([*child_cmd, *arm_argv(config, arm)], capture_output=True, text=True)
            if res.returncode != 0:
                sys.stderr.write(res.stderr[-4000:])
                raise RuntimeError(f"{arm} arm failed (exit {res.returncode})")
            arms[arm] = json.loads(res.stdout.strip().splitlines()[-1])
            bar.update(1)
    return summarize(config, arms)
