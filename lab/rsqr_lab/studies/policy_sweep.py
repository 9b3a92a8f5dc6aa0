"""Policy sweep experiment: a grid of eviction policies streamed over the same tokens in ONE vmapped,
jitted run (`rsqr_jax.sweep.sweep_nll`), optionally sharded over devices, summarized per policy.

    config = SweepConfig(grid="mode=rsqr,streamingllm window=64,128 delta=4,8", text="book.txt", tokens=512)
    result = run(config, apply_fn, params, model_config, tokenizer, model_name="SmolLM2")
    result.write("runs/sweep")     # sweep.csv, sweep.json, sweep.md, sweep_ppl.png, nll.npy [P, T-1]

The grid/mesh/summary logic is `rsqr_jax.sweep`; this module adds the configuration, token loading,
per-policy cache sizes and the output files. With `text=None` the tokens are random ids (seeded), the
stream the tiny random model of `quick_model` is run on.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from rsqr_jax.eval.runtime import (ConfigError, check_stream_shape, portable_path, progress, read_tokens, status,
                                   write_json_atomic)
from rsqr_jax.spec import ColdStore

# A sweep is a grid of policies, not one base policy: a key a grid leaves out takes the library's default.
DEFAULT_GRID = "mode=rsqr,rerotate,leave_gaps,streamingllm window=128,256 delta=4,8,16"
QUICK_GRID = "mode=rsqr,rerotate,leave_gaps,streamingllm window=8,16 delta=4 max_survivors=8"
TASKS = ("ppl",)
SORTS = ("ppl", "name", "grid")
CSV_COLUMNS = ("rank", "name", "mode", "window", "n_sink", "delta", "max_survivors", "block", "overflow",
               "recall_pages", "ppl", "nll", "cache_kib")
MODE_COLORS = {"full": "black", "window": "tab:gray", "streamingllm": "tab:blue", "leave_gaps": "tab:orange",
               "rerotate": "tab:red", "replay": "tab:purple", "rsqr": "tab:green", "rsqr_precompute": "tab:olive"}


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """One sweep. Error messages name the command-line flag of each field (scripts/exp_sweep.py)."""

    grid: str = DEFAULT_GRID
    text: str | None = None  # UTF-8 text file; None = random token ids from `seed` (tiny-model runs)
    tokens: int = 1024  # tokens streamed (T-1 are scored)
    chunk: int = 1  # tokens per step (1 = exact token-by-token eviction)
    segment: int = 256  # tokens per jitted call (progress granularity)
    bucket: int = 1000  # tokens per point of the perplexity curve
    sort: str = "ppl"  # table order: ppl, name or grid
    devices: int | None = None  # devices the policy axis is sharded over (None: all available)
    dtype: str = "float32"
    task: str = "ppl"
    seed: int = 0  # random token ids when text is None
    progress: bool = True
    cold: ColdStore = ColdStore()  # the recall tier's store, for grid entries with recall_pages > 0

    @classmethod
    def quick(cls, **overrides) -> "SweepConfig":
        """The small CI run: 8 policies x 96 random tokens on the tiny model."""
        return cls(**{"grid": QUICK_GRID, "tokens": 96, "segment": 32, "bucket": 32, **overrides})

    def validate(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"--task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.sort not in SORTS:
            raise ConfigError(f"--sort must be one of {', '.join(SORTS)}, got {self.sort!r}")
        check_stream_shape(self.tokens, self.chunk, self.segment, self.bucket)
        if self.devices is not None and self.devices < 1:
            raise ConfigError(f"--devices must be >= 1, got {self.devices}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.text is not None and not os.path.isfile(self.text):
            raise ConfigError(f"text file not found: {self.text}")


def request_host_devices(n: int | None) -> None:
    """Let the CPU platform expose n devices. Call before JAX initializes its backends (XLA_FLAGS is read
    then, not at import); no effect on GPU/TPU backends."""
    if n is None or n <= 1:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def check_processes(n: int, devices: int | None) -> int:
    """Devices per local process for `--processes n` (one-line ConfigError if this machine cannot run them).

    Each process needs a core of its own (they step in lockstep through the collectives, so two on one core
    only take turns); `devices` is the total over all processes (default: one per process)."""
    cores = os.cpu_count() or 1
    if n < 1:
        raise ConfigError(f"--processes must be >= 1, got {n}")
    if n > cores:
        raise ConfigError(f"--processes {n}: this machine has {cores} CPU core(s), one local process per core at most")
    total = n if devices is None else devices
    if total % n:
        raise ConfigError(f"--devices {total} does not split evenly over --processes {n}")
    return total // n


def _loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local_processes(argv: list[str], n: int, local_devices: int, *, timeout: float | None = None) -> int:
    """Run `argv` (a command line that accepts --coordinator/--num-processes/--process-id) as the n processes
    of one jax.distributed job on a loopback coordinator, each with `local_devices` CPU devices.

    Process 0's stderr is this terminal's, its stdout is relayed when it ends without gloo's connection
    notices (which gloo prints on stdout, and which would break --json); the others write to temporary
    files. If one fails, the rest are stopped and its last stderr line is reported. Returns the exit code."""
    port = _loopback_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f)
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={local_devices}".strip()
    procs, logs = [], []
    with tempfile.TemporaryDirectory(prefix="rsqr_sweep_") as tmp:
        for i in range(n):
            cmd = [*argv, "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i)]
            log = open(os.path.join(tmp, f"process{i}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=env, stdout=log if i == 0 else subprocess.DEVNULL,
                                          stderr=None if i == 0 else log))
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                codes = [p.poll() for p in procs]
                failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
                if failed or all(c == 0 for c in codes):
                    logs[0].seek(0)
                    sys.stdout.write("".join(ln for ln in logs[0] if not ln.startswith("[Gloo]")))
                    sys.stdout.flush()
                if failed:
                    i = failed[0]
                    if i:  # process 0 reported its own error on this terminal
                        logs[i].seek(0)
                        lines = [ln for ln in logs[i].read().splitlines() if ln.strip()]
                        status(f"error: process {i} of {n} exited with code {codes[i]}: "
                               f"{lines[-1] if lines else '(no output)'}")
                    return codes[i]
                if all(c == 0 for c in codes):
                    return 0
                if deadline is not None and time.monotonic() > deadline:
                    status(f"error: the {n} processes did not finish within {timeout:.0f}s")
                    return 1
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()


def quick_model(dtype: str = "float32", kernel: str = "xla"):
    """(apply_fn, params, model_config, name) of the tiny random model the quick runs use (seed 0)."""
    from rsqr_jax.models.tiny import tiny_config, tiny_model

    cfg = tiny_config(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=256)
    apply_fn, params = tiny_model(cfg, 0, dtype=dtype, kernel=kernel)
    return apply_fn, params, cfg, "tiny-random"


def load_tokens(text: str | None, n: int, *, tokenizer=None, vocab_size: int = 0, seed: int = 0) -> np.ndarray:
    """Token ids [1, n] int32: the first n tokens of the text file, or n random ids (seed) if text is None."""
    if text is None:
        ids = np.random.default_rng(seed).integers(0, vocab_size, size=n)
    else:
        if tokenizer is None:
            raise ConfigError("a text file needs the model's tokenizer")
        ids = read_tokens(tokenizer, text, n)
    return np.asarray([ids], np.int32)


def sorted_rows(rows: list[dict], sort: str) -> list[dict]:
    if sort == "ppl":
        return sorted(rows, key=lambda r: r["ppl"])
    if sort == "name":
        return sorted(rows, key=lambda r: r["name"])
    return list(rows)


@dataclasses.dataclass
class SweepResult:
    """meta (run description), rows (one per policy, grid order) and nll_PxT (first text row)."""

    config: SweepConfig
    meta: dict
    rows: list[dict]
    nll_PxT: np.ndarray

    @property
    def ordered(self) -> list[dict]:
        return sorted_rows(self.rows, self.config.sort)

    @property
    def best(self) -> dict:
        return sorted_rows(self.rows, "ppl")[0]

    def to_json(self) -> dict:
        return {"meta": self.meta, "rows": self.ordered}

    def summary_line(self) -> str:
        m, b = self.meta, self.best
        return (f"{m['n_policies']} policies in {m['elapsed_s']:.1f}s ({m['policy_tokens_per_s']:.0f} "
                f"policy-tokens/s); best: {b['name']} ppl {b['ppl']:.3f}")

    def markdown(self) -> str:
        m, rows = self.meta, self.ordered
        text = os.path.basename(m["text"]) if m["text"] else f"random tokens (seed {self.config.seed})"
        head = (f"Streaming perplexity, {m['n_scored']} scored tokens of {text}, {m['dtype']}, chunk {m['chunk']}; "
                f"{m['n_policies']} policies in one vmapped run on {m['devices']} device(s).\n\n")
        buckets = rows[0]["bucket_end"] if rows else []
        curve_cols = [f"ppl@{b}" for b in buckets] if len(buckets) > 1 else []
        lines = ["| # | policy | ppl | cache KiB |" + "".join(f" {c} |" for c in curve_cols),
                 "|---:|---|---:|---:|" + "---:|" * len(curve_cols)]
        for i, r in enumerate(rows, 1):
            curve = "".join(f" {v:.2f} |" for v in r["ppl_curve"]) if curve_cols else ""
            lines.append(f"| {i} | `{r['name']}` | {r['ppl']:.3f} | {r['cache_kib']:.0f} |{curve}")
        return head + "\n".join(lines) + "\n"

    def write(self, out_dir) -> dict[str, str]:
        """Write sweep.csv / .json / .md / _ppl.png and nll.npy into out_dir; returns {kind: path}."""
        os.makedirs(out_dir, exist_ok=True)
        paths = {k: os.path.join(out_dir, f) for k, f in (("md", "sweep.md"), ("csv", "sweep.csv"),
                 ("json", "sweep.json"), ("png", "sweep_ppl.png"), ("npy", "nll.npy"))}
        np.save(paths["npy"], self.nll_PxT)
        with open(paths["csv"], "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(CSV_COLUMNS), extrasaction="ignore")
            w.writeheader()
            for i, r in enumerate(self.ordered, 1):
                w.writerow({**r, "rank": i, "ppl": f"{r['ppl']:.6f}", "nll": f"{r['nll']:.6f}"})
        write_json_atomic(paths["json"], self.to_json())
        with open(paths["md"], "w") as f:
            f.write(self.markdown())
        self.plot(paths["png"])
        return paths

    def plot(self, path) -> None:
        """Left: perplexity per bucket (colour = mode, line style = window); right: overall perplexity."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows, m = self.rows, self.meta
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, max(4.5, 0.17 * len(rows) + 1.5)),
                                     gridspec_kw={"width_ratios": [1.2, 1]})
        windows = sorted({r["window"] for r in rows if r["mode"] != "full"}, reverse=True)
        styles = dict(zip(windows, itertools.cycle(["-", "--", ":", "-."])))
        for r in rows:
            x = np.asarray(r["bucket_end"])
            ax.plot(x, r["ppl_curve"], styles.get(r["window"], "-"), marker="o" if len(x) < 30 else None, ms=3,
                    lw=1.2, color=MODE_COLORS.get(r["mode"], "tab:brown"), alpha=0.85, label=r["name"])
        ax.set_xlabel("scored tokens (end of bucket)")
        ax.set_ylabel(f"perplexity per {m['bucket']}-token bucket")
        ax.set_yscale("log")
        ax.set_title(f"{m['n_policies']} policies, {m['n_scored']} tokens, {m['dtype']}")
        ax.grid(alpha=0.3)
        if len(rows) <= 12:
            ax.legend(fontsize=7)
        ordered = sorted_rows(rows, "ppl")
        y = np.arange(len(ordered))
        bx.barh(y, [r["ppl"] for r in ordered], color=[MODE_COLORS.get(r["mode"], "tab:brown") for r in ordered])
        bx.set_yticks(y, [r["name"] for r in ordered], fontsize=6)
        bx.invert_yaxis()
        bx.set_xlim(ordered[0]["ppl"] * 0.9, ordered[-1]["ppl"] * 1.02)
        bx.set_xlabel("overall perplexity (lower is better)")
        bx.grid(axis="x", alpha=0.3)
        if len(rows) > 12:
            modes = {r["mode"] for r in rows}
            handles = [plt.Line2D([], [], color=c, lw=3, label=k) for k, c in MODE_COLORS.items() if k in modes]
            handles += [plt.Line2D([], [], color="gray", ls=ls, label=f"W={w}") for w, ls in list(styles.items())[:4]]
            ax.legend(handles=handles, fontsize=8, loc="upper left", ncol=2)
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        plt.close(fig)


def run(config: SweepConfig, apply_fn, params, model_config, tokenizer=None, *, model_name: str = "") -> SweepResult:
    """Stream every policy of config.grid over the tokens in one vmapped run; one summary row per policy.

    `model_config` needs num_layers / num_kv_heads / head_dim / vocab_size. With more than one device the
    policy axis is sharded over a ("policy", "batch") mesh (on CPU call `request_host_devices` first).
    Raises ConfigError (bad config, too few devices) or PolicyError (bad grid)."""
    import jax

    from rsqr_jax.policy import MODES, OVERFLOWS, unstack_policies
    from rsqr_jax.spec import CacheSpec
    from rsqr_jax.sweep import make_mesh, policy_grid, summarize, sweep_nll

    config.validate()
    policies, names = policy_grid(config.grid)
    n_avail = len(jax.devices())
    n_dev = n_avail if config.devices is None else config.devices
    if n_dev > n_avail:
        raise ConfigError(f"--devices {n_dev}: only {n_avail} {jax.default_backend()} device(s) available")
    if jax.process_count() > 1 and n_dev != n_avail:  # every process must hold a part of the mesh
        raise ConfigError(f"--devices {n_dev}: a {jax.process_count()}-process run shards over all {n_avail} devices")
    tokens_1xT = load_tokens(config.text, config.tokens, tokenizer=tokenizer, vocab_size=model_config.vocab_size,
                             seed=config.seed)
    n_pol = len(names)
    mesh = make_mesh(n_dev) if n_dev > 1 else None
    source = os.path.basename(config.text) if config.text else f"random tokens (seed {config.seed})"
    if jax.process_index() == 0:
        status(f"{n_pol} policies x {config.tokens} tokens of {source}, {config.dtype}, chunk {config.chunk}, "
               f"{n_dev} {jax.default_backend()} device(s) in {jax.process_count()} process(es)")

    first = jax.process_index() == 0
    with progress(config.tokens - 1, f"sweep x{n_pol}", enabled=config.progress and first) as bar:
        t0 = time.perf_counter()
        nll_PxBxT = sweep_nll(apply_fn, params, tokens_1xT, policies, config=model_config, dtype=config.dtype,
                              chunk=config.chunk, segment=config.segment, mesh=mesh, cold=config.cold,
                              progress=lambda n: bar.update(n - bar.n))
        elapsed = time.perf_counter() - t0
    if not np.all(np.isfinite(nll_PxBxT)):
        status("warning: non-finite NLL in some policies")

    rows = summarize(nll_PxBxT, names, tokens_per_bucket=config.bucket)
    for r, pol in zip(rows, unstack_policies(policies)):
        h = pol.host()
        own = CacheSpec.for_policies(pol, dims=model_config, dtype=config.dtype, max_chunk=config.chunk,
                                     max_len=config.tokens, cold=config.cold if h["recall_pages"] else None)
        r.update(mode=MODES[h["mode"]], window=h["window"], n_sink=h["n_sink"], delta=h["delta"],
                 max_survivors=h["max_survivors"], block=h["block"], overflow=OVERFLOWS[h["overflow"]],
                 recall_pages=h["recall_pages"],
                 cache_kib=own.bytes_by_part(pol)["total"] / 1024)
    n_scored = int(nll_PxBxT.shape[-1])
    meta = {"task": config.task, "grid": config.grid, "text": portable_path(config.text) if config.text else None,
            "seed": config.seed, "n_tokens": config.tokens, "n_scored": n_scored, "dtype": config.dtype,
            "chunk": config.chunk, "segment": config.segment, "bucket": config.bucket, "n_policies": n_pol,
            "devices": n_dev, "processes": jax.process_count(), "backend": jax.default_backend(), "model": model_name, "elapsed_s": elapsed,
            "policy_tokens_per_s": n_pol * n_scored / elapsed}
    return SweepResult(config, meta, rows, nll_PxBxT[:, 0])
