#!/usr/bin/env python3
"""Benchmark: 8 policies vmapped in one run vs the same 8 run one after another.

Both arms stream the same tokens through the same segment code (`rsqr_jax.stream.stream_nll`: the
vmapped arm via `rsqr_jax.sweep.sweep_nll`, the sequential arm one policy at a time with the same
union CacheSpec, so it compiles once too). Each arm runs in its own subprocess, so its peak RSS
(resource.getrusage ru_maxrss) is its own. Compilation is excluded from the throughput: each arm first
runs a warm-up of one segment, then the timed stream. Besides wall-clock throughput it reports
throughput per CPU-second of the arm's process (time.process_time), which is far less sensitive to
other load on a shared machine. Prints a table and writes JSON.

    python scripts/bench_sweep.py                  # SmolLM2-135M, 256 tokens of Frankenstein (~minutes)
    python scripts/bench_sweep.py --tokens 512
    python scripts/bench_sweep.py --quick          # tiny random model, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from _common import DEFAULT_TEXT, REPO_ROOT, Parser, UsageError, run_main, status

DEFAULT_GRID = "mode=rsqr,rerotate,leave_gaps,streamingllm window=64,128 delta=8 max_survivors=32"
QUICK_GRID = "mode=rsqr,rerotate,leave_gaps,streamingllm window=8,16 delta=4 max_survivors=8"


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default=None, help=f"policy grid (default: {DEFAULT_GRID!r}, 8 policies)")
    p.add_argument("--tokens", type=int, default=None, help="tokens to stream (default 256; --quick 96)")
    p.add_argument("--text", default=str(DEFAULT_TEXT))
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    p.add_argument("--chunk", type=int, default=1)
    p.add_argument("--segment", type=int, default=None, help="tokens per jitted call (default 128; --quick 32)")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded SmolLM2-135M)")
    p.add_argument("--quick", action="store_true", help="tiny random model, short stream")
    p.add_argument("--out", default=str(REPO_ROOT / "runs" / "bench_sweep.json"))
    p.add_argument("--arm", choices=("vmapped", "sequential"), default=None, help=argparse.SUPPRESS)  # child
    return p


def _rss_mib() -> float:
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 1024


def _setup(args):
    """(apply_fn, params, config, token ids [1, T]) for the arm."""
    import numpy as np

    if args.quick:
        import jax.numpy as jnp

        from models.llama import Llama, split_apply
        from rsqr_jax.testing.tiny import tiny_config, tiny_weights

        cfg = tiny_config(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=256)
        apply_fn, params = split_apply(Llama(cfg, tiny_weights(cfg, 0), dtype=jnp.dtype(args.dtype)))
        ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=args.tokens)
        return apply_fn, params, cfg, np.asarray([ids], np.int32), "tiny-random"
    from eval_stream import read_tokens
    from models.llama import load_model, split_apply

    loaded = load_model(args.model, args.dtype)
    apply_fn, params = split_apply(loaded.model)
    ids = read_tokens(loaded.tokenizer, args.text, args.tokens)
    return apply_fn, params, loaded.config, np.asarray([ids], np.int32), loaded.path


def run_arm(args) -> dict:
    """One arm in this process: warm-up (compile) then the timed stream; prints one JSON line."""
    import jax
    import numpy as np

    from rsqr_jax.spec import CacheSpec
    from rsqr_jax.policy import unstack_policies
    from rsqr_jax.engine import stream_nll
    from rsqr_jax.sweep import policy_grid, sweep_nll

    policies, names = policy_grid(args.grid)
    apply_fn, params, cfg, tokens, model = _setup(args)
    rss_loaded = _rss_mib()
    T = tokens.shape[1]
    spec = CacheSpec.for_policies(policies, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                  head_dim=cfg.head_dim, dtype=args.dtype, max_chunk=args.chunk, max_len=T)
    warm = tokens[:, :args.segment + 1]
    kw = dict(chunk=args.chunk, segment=args.segment)
    if args.arm == "vmapped":
        def run(toks):
            return sweep_nll(apply_fn, params, toks, policies, spec=spec, **kw)
    else:
        singles = unstack_policies(policies)

        def run(toks):
            return np.stack([stream_nll(apply_fn, params, toks, p, spec, **kw)[0] for p in singles])

    t0 = time.perf_counter()
    if args.arm == "vmapped":
        run(warm)
    else:
        stream_nll(apply_fn, params, warm, unstack_policies(policies)[0], spec, **kw)
    compile_s = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    nll = run(tokens)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    n_pol, n_scored = nll.shape[0], nll.shape[-1]
    return {"arm": args.arm, "n_policies": n_pol, "names": names, "n_scored": n_scored, "elapsed_s": elapsed,
            "warmup_s": compile_s, "policy_tokens_per_s": n_pol * n_scored / elapsed,
            "cpu_s": cpu, "policy_tokens_per_cpu_s": n_pol * n_scored / cpu,
            "steps_per_s": (n_scored if args.arm == "vmapped" else n_pol * n_scored) / elapsed,
            "peak_rss_mib": _rss_mib(), "rss_after_load_mib": rss_loaded,
            "cache_bytes_union": spec.bytes_by_part()["total"], "model": model, "backend": jax.default_backend(),
            "ppl": [float(np.exp(x.mean())) for x in nll.astype(np.float64)]}


def main() -> int:
    args = build_parser().parse_args()
    if args.dtype not in ("float32", "bfloat16"):
        raise UsageError(f"--dtype must be float32 or bfloat16, got {args.dtype!r}")
    args.grid = args.grid or (QUICK_GRID if args.quick else DEFAULT_GRID)
    args.tokens = args.tokens or (96 if args.quick else 256)
    args.segment = args.segment or (32 if args.quick else 128)
    if args.tokens < 2 or args.chunk < 1 or args.segment % args.chunk:
        raise UsageError("--tokens must be >= 2 and --chunk must divide --segment")
    if not args.quick and not os.path.isfile(args.text):
        raise UsageError(f"text file not found: {args.text}")
    from rsqr_jax.sweep import policy_grid

    policy_grid(args.grid)  # bad grid -> one line, exit 2, before any subprocess

    if args.arm is not None:  # child
        print(json.dumps(run_arm(args)))
        return 0

    results = {}
    for arm in ("sequential", "vmapped"):
        cmd = [sys.executable, os.path.abspath(__file__), "--arm", arm, "--grid", args.grid, "--tokens",
               str(args.tokens), "--text", args.text, "--dtype", args.dtype, "--chunk", str(args.chunk),
               "--segment", str(args.segment)] + (["--quick"] if args.quick else []) + \
              (["--model", args.model] if args.model else [])
        status(f"bench_sweep: running the {arm} arm ...")
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            sys.stderr.write(res.stderr[-4000:])
            raise RuntimeError(f"{arm} arm failed (exit {res.returncode})")
        results[arm] = json.loads(res.stdout.strip().splitlines()[-1])
    seq, vm = results["sequential"], results["vmapped"]
    ppl_diff = max(abs(a - b) / b for a, b in zip(vm["ppl"], seq["ppl"]))
    summary = {
        "throughput_ratio": vm["policy_tokens_per_s"] / seq["policy_tokens_per_s"],
        "cpu_throughput_ratio": vm["policy_tokens_per_cpu_s"] / seq["policy_tokens_per_cpu_s"],
        "peak_rss_ratio": vm["peak_rss_mib"] / seq["peak_rss_mib"],
        "max_rel_ppl_diff": ppl_diff,
        "grid": args.grid, "tokens": args.tokens, "chunk": args.chunk, "segment": args.segment, "dtype": args.dtype,
        "quick": args.quick, "cpu_count": os.cpu_count(), "machine": platform.platform(),
        "loadavg_1min": os.getloadavg()[0],
    }
    out = {"summary": summary, "arms": results}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{len(vm['names'])} policies x {vm['n_scored']} scored tokens, {args.dtype}, chunk {args.chunk}, "
          f"{vm['backend']}, model {os.path.basename(vm['model'])}")
    print("| arm | wall s (timed) | warm-up s | policy-tokens/s | CPU s | policy-tokens/CPU-s | peak RSS MiB | "
          "RSS after load MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in (seq, vm):
        print(f"| {r['arm']} | {r['elapsed_s']:.1f} | {r['warmup_s']:.1f} | {r['policy_tokens_per_s']:.1f} | "
              f"{r['cpu_s']:.1f} | {r['policy_tokens_per_cpu_s']:.1f} | {r['peak_rss_mib']:.0f} | "
              f"{r['rss_after_load_mib']:.0f} |")
    print(f"throughput ratio vmapped/sequential: {summary['throughput_ratio']:.2f}x wall, "
          f"{summary['cpu_throughput_ratio']:.2f}x per CPU-second; "
          f"peak RSS ratio {summary['peak_rss_ratio']:.2f}; max rel. ppl difference {ppl_diff:.1e}")
    print(f"  {args.out}")
    return 0


if __name__ == "__main__":
    run_main(main)
