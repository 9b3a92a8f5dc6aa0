"""lm-evaluation-harness tasks on a model streamed through an rsqr_jax cache policy.

    python scripts/eval_tasks.py --policy full --tasks rsqr_smoke --include_path tests/data/lm_eval_task
    python scripts/eval_tasks.py --policy rsqr --window 64 --recall-pages 4 --tasks rsqr_facts \\
        --include_path tests/data/lm_eval_task --limit 4 --output_path runs/lm_eval --log_samples
    python scripts/eval_tasks.py --policy streamingllm --window 512 --tasks ruler_niah_single_1 --json

lm-eval's own flags: --tasks --include_path --limit --num_fewshot --output_path --log_samples --batch_size
--seed --gen_kwargs --metadata; ours: the policy / recall / model flags of every script, --chunk, --max-length,
--model_args (the "key=value,..." form of the same settings, which win over the flags). Prints lm-eval's
table (--json: one JSON object, lm-eval's results without the samples). The model is
rsqr_jax.eval.lm_eval_model.RsqrLM (registered in lm-eval as "rsqr_jax").
"""

from __future__ import annotations

import json
import os

from rsqr_jax.cli.args import Parser, UsageError, add_model_args, add_policy_args, check_model_args, cold_store_args, run_main


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    g = p.add_argument_group("lm-evaluation-harness")
    g.add_argument("--tasks", required=True, help="comma-separated task or group names")
    g.add_argument("--include_path", default=None, help="directory of extra task YAMLs")
    g.add_argument("--limit", type=float, default=None, help="examples per task (a fraction if < 1)")
    g.add_argument("--num_fewshot", type=int, default=None)
    g.add_argument("--output_path", default=None, help="write results (and --log_samples samples) here")
    g.add_argument("--log_samples", action="store_true", help="keep every request's inputs and outputs")
    g.add_argument("--batch_size", default="1", help="N > 1: N independent streams (requests run concurrently, "
                                                     "rsqr_jax.eval.harness.StreamsEngine); 1 or auto: one at a time")
    g.add_argument("--seed", type=int, default=0, help="lm-eval's random seeds and the sampler's")
    g.add_argument("--gen_kwargs", default=None, help="generation arguments for every task, key=value,...")
    g.add_argument("--metadata", default=None, help="JSON object handed to the tasks (RULER: tokenizer, "
                                                    "max_seq_lengths)")
    g = p.add_argument_group("engine")
    g.add_argument("--chunk", type=int, default=32, help="tokens per compiled step (capped by the window)")
    g.add_argument("--max-length", type=int, default=2048, help="tokens a full cache holds (full truncates to it)")
    g.add_argument("--model_args", default="", help="the same settings as key=value,... (e.g. policy=rsqr,window=64)")
    p.add_argument("--json", action="store_true", help="print lm-eval's results as one JSON object on stdout")
    add_policy_args(p)
    add_model_args(p)
    return p


def model_args_from(args) -> dict:
    """Flags -> RsqrLM model arguments; --model_args entries override."""
    from rsqr_jax.eval.lm_eval_model import check_model_args as check_lm_args
    from lm_eval.utils import simple_parse_args_string

    a = {"policy": args.policy, "window": args.window, "sinks": args.sinks, "delta": args.delta,
         "max_survivors": args.max_survivors, "block": args.block, "overflow": args.overflow,
         "recall_pages": args.recall_pages, "cold_capacity": args.cold_capacity, "page_size": args.page_size,
         **({"page_score": args.page_score} if args.page_score else {}), "recall_neighbors": args.recall_neighbors,
         **({"placement": args.placement} if args.placement else {}),
         **({"reselect": args.reselect} if args.reselect is not None else {}),
         **({"share_from": args.share_choice_from} if args.share_choice_from is not None else {}),
         **({"score_dtype": args.score_dtype} if args.score_dtype is not None else {}),
         "model": args.model, "dtype": args.dtype, "kernel": args.kernel, "weight_format": args.weight_format,
         "chunk": args.chunk, "max_length": args.max_length, "seed": args.seed, "batch_size": args.batch_size}
    try:
        extra = simple_parse_args_string(args.model_args)
    except ValueError as e:
        raise UsageError(f"--model_args {args.model_args!r}: {e}") from None
    return check_lm_args({**a, **extra})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_model_args(args)
    cold_store_args(args)
    if args.log_samples and not args.output_path:
        raise UsageError("--log_samples needs --output_path")
    if args.limit is not None and args.limit <= 0:
        raise UsageError(f"--limit must be > 0, got {args.limit}")
    if args.include_path is not None and not os.path.isdir(args.include_path):
        raise UsageError(f"--include_path is not a directory: {args.include_path}")
    try:
        metadata = json.loads(args.metadata) if args.metadata else None
    except json.JSONDecodeError as e:
        raise UsageError(f"--metadata is not JSON: {e}") from None
    if metadata is not None and not isinstance(metadata, dict):
        raise UsageError("--metadata must be a JSON object")
    from rsqr_jax.eval.lm_eval_model import RsqrLM  # imports lm_eval (ConfigError if it is not installed)

    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable, make_table

    model_args = model_args_from(args)
    task_manager = TaskManager(include_path=args.include_path, metadata=metadata)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in task_manager.all_tasks]
    if unknown or not tasks:
        raise UsageError(f"unknown task {unknown[0]!r} (lm-eval's task names, or a YAML under --include_path)"
                         if unknown else "--tasks is empty")
    lm = RsqrLM.from_model_args(model_args)
    tracker = EvaluationTracker(output_path=args.output_path) if args.output_path else None
    results = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit, log_samples=args.log_samples,
        task_manager=task_manager, gen_kwargs=args.gen_kwargs, evaluation_tracker=tracker,
        random_seed=args.seed, numpy_random_seed=args.seed, torch_random_seed=args.seed,
        fewshot_random_seed=args.seed)
    samples = results.pop("samples", None)
    results["config"]["model_args"] = lm.description  # the policy and model this run used
    if tracker is not None:
        tracker.save_results_aggregated(results=results, samples=samples if args.log_samples else None)
        if args.log_samples:
            for name in results["configs"]:
                tracker.save_results_samples(task_name=name, samples=samples[name])
    if args.json:
        print(json.dumps(results, default=handle_non_serializable, ensure_ascii=False))
        return 0
    print(f"rsqr_jax ({lm.description['policy_name']}), limit: {args.limit}, num_fewshot: {args.num_fewshot}, "
          f"streams: {lm.description['streams']}")
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    return 0


def run() -> None:
    """The console entry point `rsqr-eval-tasks`: main() as a process (one-line errors, exit status)."""
    run_main(main)


if __name__ == "__main__":
    run()
