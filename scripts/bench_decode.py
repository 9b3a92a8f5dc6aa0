#!/usr/bin/env python3
"""Decode speed: our jitted Session against HF transformers (torch eager, float32, same weights), one run.

Both sides prefill a prompt that leaves C tokens cached, then decode --new greedy tokens, timed; compile
time is reported apart (rsqr_lab.studies.decode_timing). HF's model holds our very arrays.

    python scripts/bench_decode.py                          # full, C = 128 1024 2048, 50 new tokens
    python scripts/bench_decode.py --policy rsqr --delta 8 --max-survivors 64
    python scripts/bench_decode.py --quick                  # tiny sanity run
    python scripts/bench_decode.py --no-hf --cached 4096    # ours only
    python scripts/bench_decode.py --no-hf --vs-llama-cpp --cached 128 2048   # and llama.cpp, same GGUF

--vs-llama-cpp (the `bench` extra: llama-cpp-python) times llama.cpp on the same file and token ids, its rounds
interleaved with ours, then the peak RSS of decode.py and llama.cpp completing the same prompt in child processes.
Each row also times our decoding under a chat sampler next to greedy, and the sampler alone (--no-sampled: off).

Writes DIR/bench_decode.json and bench_decode.md (--out DIR); --json prints the JSON on stdout.
"""

from __future__ import annotations

import json
import os

from rsqr_jax.cli.args import (DEFAULT_TEXT, Parser, add_model_args, add_policy_args, check_model_args, load_model_from_args,
                     policy_from_args, run_main)


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--cached", type=int, nargs="+", default=[128, 1024, 2048], help="cached-token counts")
    p.add_argument("--new", type=int, default=50, help="new greedy tokens timed per measurement")
    p.add_argument("--repeats", type=int, default=2, help="measurements per row and side (best is reported)")
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="torch threads for HF")
    p.add_argument("--single-thread", action="store_true",
                   help="one core for both sides (the process is pinned to one CPU; torch 1 thread): "
                   "robust on a busy machine")
    p.add_argument("--no-hf", action="store_true", help="skip HF (ours only)")
    p.add_argument("--vs-llama-cpp", action="store_true",
                   help="also llama.cpp (llama-cpp-python) on the same GGUF and token ids, --threads threads, the rounds "
                   "interleaved; then the peak RSS of decode.py and of llama.cpp on the same prompt, each in a child")
    p.add_argument("--rss-prompt-tokens", type=int, default=1024, help="prompt tokens of the peak-RSS runs")
    p.add_argument("--no-sampled", action="store_true",
                   help="skip the chat-sampler timings (temperature 0.7, top_k 40, top_p 0.95, min_p 0.05, "
                   "repeat_penalty 1.1 over 64; end to end and the sampler alone)")
    p.add_argument("--quick", action="store_true", help="tiny run: C = 64 128, 8 new tokens, 1 repeat")
    p.add_argument("--text", default=str(DEFAULT_TEXT))
    p.add_argument("--out", default="runs/bench_decode", help="output directory ('' = write nothing)")
    p.add_argument("--json", action="store_true", help="print the result JSON on stdout")
    p.add_argument("--no-progress", action="store_true", help="accepted for the common convention (no bars here)")
    add_policy_args(p, default_policy="full")
    add_model_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_model_args(args)
    if args.single_thread:  # before jax starts its thread pools
        # XLA:CPU (jax 0.10) ignores --xla_cpu_multi_thread_eigen=false / intra_op_parallelism_threads=1: a
        # jitted matmul still burns 1.95 CPU-s per wall-s. Pinning the process to one core binds every
        # thread either side starts, so both really run on one core.
        args.threads = 1
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    from rsqr_lab.studies import decode_timing as B
    from rsqr_jax.eval.runtime import ConfigError, status

    config = B.BenchConfig(text=args.text, cached=tuple(args.cached), new=args.new, repeats=args.repeats,
                           prefill_chunk=args.prefill_chunk, threads=args.threads, single_thread=args.single_thread,
                           policy=policy_from_args(args), dtype=args.dtype, sampled=not args.no_sampled)
    config = config.quick() if args.quick else config
    config.check()  # before the model loads
    if not args.no_hf and args.dtype != "float32":
        raise ConfigError("the HF comparison runs float32 (use --dtype float32 or --no-hf)")
    if args.vs_llama_cpp:  # before the model loads
        from rsqr_jax.models.loading import default_model_path

        B.require_llama_cpp(args.model or default_model_path())
    loaded, apply_fn, params = load_model_from_args(args)
    status(f"model {loaded.path} loaded; policy {args.policy}, {args.dtype}")
    hf = None
    if not args.no_hf:
        import transformers

        transformers.logging.set_verbosity_error()
        hf = B.hf_model_from_ours(loaded)
    lcpp = None
    if args.vs_llama_cpp:
        lcpp = B.llama_cpp_model(loaded.path, args.threads, n_ctx=max(args.cached) * 2 + args.new + 256)
    meta = {k: getattr(args, k) for k in ("no_hf", "quick", "out", "model", "kernel", "weight_format")}
    meta["weights"] = loaded.weight_format
    result = B.run(config, apply_fn, params, loaded.config, loaded.tokenizer, hf_model=hf, llama_cpp=lcpp, meta=meta)
    if args.vs_llama_cpp:
        del lcpp
        result.data["peak_rss"] = B.peak_rss_side_by_side(
            loaded.path, loaded.tokenizer, text=args.text, prompt_tokens=args.rss_prompt_tokens, new=args.new,
            threads=args.threads, model_arg=args.model)
    print(json.dumps(result.data) if args.json else result.markdown())
    if args.out:
        result.write_json(os.path.join(args.out, "bench_decode.json"))
        with open(os.path.join(args.out, "bench_decode.md"), "w") as f:
            f.write(result.markdown())
        status(f"wrote {args.out}/bench_decode.json, bench_decode.md")
    return 0


if __name__ == "__main__":
    run_main(main)
