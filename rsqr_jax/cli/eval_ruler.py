"""RULER's synthetic tasks, offline, through the lm-eval model for full, streamingllm, rsqr and rsqr + recall.

    python scripts/eval_ruler.py --cache-dir runs/ruler --out runs/ruler/ruler_4096.json \\
        --plot runs/ruler/ruler_4096.png                     # 4 tasks x 4 policies at 4096 tokens, 30 samples
    python scripts/eval_ruler.py --cache-dir runs/ruler --out runs/ruler/ruler_4096.json --report-only
    python scripts/eval_ruler.py --quick --cache-dir /tmp/q   # CI smoke: tiny random model, 2 samples, 1024 tokens

Every answer is cached per policy under --cache-dir as soon as it exists: the same command resumes a killed run,
and a finished one re-reports without a model call. Samples grow in rounds (--limits 10,20,30: every cell gets
its first 10 before any gets more); --start N with --merge REPORT answers samples from N on and reports them after
the earlier report's first N. Prints one table (task x policy: score, Wilson 95% interval, n) and writes
the JSON (--out) and a plot (--plot).
"""

from __future__ import annotations

import os

from rsqr_jax.cli.args import Parser, UsageError, layer_or_none, run_main


def build_parser() -> Parser:
    from rsqr_jax.eval.ruler import DEFAULT_TASKS, POLICIES

    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="comma-separated RULER tasks (offline ones)")
    p.add_argument("--answer", default=None, metavar="TASKS",
                   help="comma-separated: the tasks the model answers (default: every --tasks task; the others are "
                   "still generated, so every task keeps its samples, and reported from the cache)")
    p.add_argument("--merge", default=None, metavar="REPORT",
                   help="an earlier report JSON of the same settings: each cell keeps the longer of its samples and "
                   "the earlier report's (their shared samples must match)")
    p.add_argument("--start", type=int, default=0, metavar="N",
                   help="answer samples from N on; the first N come from --merge's report (which must hold them): "
                   "a table grows after its answer cache is gone")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated: " + ", ".join(POLICIES))
    p.add_argument("--seq-len", type=int, default=4096, help="RULER's max_seq_length: prompt + answer tokens")
    p.add_argument("--limits", default=None, help="samples per task after each round (increasing; default "
                   "10,20,30, or 2 with --quick)")
    p.add_argument("--window", type=int, default=512, help="window W of the bounded policies")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--recall-pages", type=int, default=8, help="pages recalled per step (rsqr+recall)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--cold-capacity", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=32, help="tokens per compiled prefill step")
    p.add_argument("--share-choice-from", type=layer_or_none, default=None, metavar="LAYER",
                   help="rsqr+recall: layers after LAYER attend the pages LAYER chose, or one source per layer, e.g. "
                   "0-1:none,10-13:9,15-29:14 (decode.py's choice on the embedded model; default: every layer "
                   "chooses)")
    p.add_argument("--reselect", type=int, default=1, help="rsqr+recall: choose pages afresh every k decode steps")
    p.add_argument("--score-dtype", default="float32", help="rsqr+recall: the max rule's scoring copy, float32 or int8")
    p.add_argument("--max-gen-toks", type=int, default=None, help="cap every task's answer length (default: "
                                                                  "each task's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--cache-dir", default="runs/ruler", help="answers (sqlite, per policy) and the tokenizer")
    p.add_argument("--out", default=None, help="write the report JSON here (rewritten after every round)")
    p.add_argument("--plot", default=None, help="write a PNG of the table here")
    p.add_argument("--report-only", action="store_true", help="report the cached answers; no model call")
    p.add_argument("--quick", action="store_true", help="smoke: a tiny random model (the real tokenizer), 1024 "
                                                       "tokens, 2 samples (or --limits), W=64, 8 answer tokens")
    return p


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{flag} must be comma-separated integers, got {text!r}") from None


def spec_from(args):
    from rsqr_jax.eval.ruler import RulerSpec

    kw = dict(tasks=tuple(t.strip() for t in args.tasks.split(",") if t.strip()),
              policies=tuple(t.strip() for t in args.policies.split(",") if t.strip()),
              seq_len=args.seq_len, limits=_ints(args.limits or "10,20,30", "--limits"), window=args.window, sinks=args.sinks,
              recall_pages=args.recall_pages, page_size=args.page_size, cold_capacity=args.cold_capacity,
              chunk=args.chunk, max_gen_toks=args.max_gen_toks, seed=args.seed,
              share_from=None if args.share_choice_from == -1 else args.share_choice_from,
              reselect=args.reselect, score_dtype=args.score_dtype,
              model=os.path.abspath(args.model) if args.model else "embedded", start=args.start,
              answer=None if args.answer is None else tuple(t.strip() for t in args.answer.split(",") if t.strip()))
    if args.quick:  # the smoke's sizes
        kw.update(seq_len=1024, limits=_ints(args.limits or "2", "--limits"), window=64, recall_pages=2, cold_capacity=512, max_gen_toks=8,
                  model="tiny-random")
    return RulerSpec(**kw)


def load_pieces(spec, model: str | None):
    """(apply_fn, params, config, tokenizer): the model (or, for the smoke, a tiny random Llama over the
    real tokenizer's vocabulary)."""
    from rsqr_jax.models.loading import load_tokenizer

    if spec.model == "tiny-random":
        import dataclasses

        from rsqr_jax.models.tiny import tiny_config, tiny_model

        tokenizer = load_tokenizer(model)
        cfg = dataclasses.replace(tiny_config(vocab=len(tokenizer)), eos_token_ids=(tokenizer.eos_token_id,))
        return (*tiny_model(cfg, spec.seed), cfg, tokenizer)
    from rsqr_jax.models.llama import load_model, split_apply

    loaded = load_model(model)
    return (*split_apply(loaded.model, kernel="auto"), loaded.config, loaded.tokenizer)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rsqr_jax.eval.ruler import export_tokenizer, format_table, plot, run_ruler

    spec = spec_from(args)  # ConfigError (one line, exit 2) on a bad task, policy or size
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:  # an optional dependency: before any model call
            raise UsageError("--plot needs matplotlib (pip install 'rsqr_jax[plot]')")
    if spec.start and args.merge is None:
        raise UsageError(f"--start {spec.start} needs --merge REPORT: the report that holds samples 0..{spec.start - 1}")
    earlier = None
    if args.merge is not None:
        import json

        try:
            with open(args.merge) as f:
                earlier = json.load(f)
        except (OSError, ValueError) as e:
            raise UsageError(f"--merge {args.merge}: not a readable RULER report ({type(e).__name__})") from None
        if not isinstance(earlier, dict) or not {"config", "cells"} <= earlier.keys():
            raise UsageError(f"--merge {args.merge}: not a readable RULER report (no config and cells)")
    if args.report_only:  # the tokenizer only: no model call
        from rsqr_jax.models.loading import load_tokenizer

        pieces = (None, None, None, load_tokenizer(args.model))
    else:
        pieces = load_pieces(spec, args.model)
    tok_dir = export_tokenizer(pieces[3], os.path.join(args.cache_dir, "tokenizer"))
    result = run_ruler(spec, pieces, tok_dir, args.cache_dir, out_json=args.out, run=not args.report_only,
                       earlier=earlier)
    print(format_table(result))
    print("model requests answered in this run: " + ", ".join(f"{p} {n}" for p, n in result["model_requests"].items()))
    if args.plot:
        print(f"plot: {plot(result, args.plot)}")
    return 0


def run() -> None:
    """The command as a process (one-line errors, exit status 2)."""
    run_main(main)


if __name__ == "__main__":
    run()
