#!/usr/bin/env python3
"""The memory demo over many sampled seeds: full vs rsqr vs rsqr + recall, each fact scored in the answer.

    python scripts/exp_memory.py --seeds 20 --out runs/memory        # every reply sampled (about 1 h on 2 CPU cores)
    python scripts/exp_memory.py --seeds 20 --history tests/data/memory_history.json --out runs/memory_history
                                          # a recorded conversation, only the answer sampled (about 10 min)
    python scripts/exp_memory.py --quick                              # 2 seeds, CI smoke
"""

from __future__ import annotations

import json

from rsqr_jax.cli.args import Parser, add_model_args, check_model_args, load_model_from_args, run_main


def main(argv: list[str] | None = None) -> int:
    from rsqr_lab.studies import memory as M

    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default=",".join(M.ARMS), help="comma-separated: " + ", ".join(M.ARMS))
    p.add_argument("--seeds", type=int, default=20, help="conversations per arm (seeds first-seed, first-seed+1, ...)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per reply at most")
    p.add_argument("--temperature", type=float, default=None, help="default: decode.py's chat default")
    p.add_argument("--history", default=None, metavar="JSON",
                   help="replay the recorded replies of JSON ({\"replies\": [...]}, one per turn but the question) "
                        "and sample only the answer")
    p.add_argument("--quick", action="store_true", help="2 seeds, 48 tokens per reply")
    p.add_argument("--out", default=None, metavar="DIR", help="write DIR/memory.json and DIR/memory.md")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--no-progress", action="store_true", help="accepted for the common convention")
    add_model_args(p)
    args = p.parse_args(argv)
    check_model_args(args)
    sampling = (("temperature", args.temperature),) if args.temperature is not None else ()
    history = M.read_history(args.history) if args.history else ()
    from rsqr_jax.models.loading import load_config
    from rsqr_jax.presets import find_preset

    recall = find_preset(load_config(args.model)).resolve().recall  # the recall arm: the model's preset
    M.check_history(history)  # before the model loads
    cfg = M.MemoryConfig(arms=tuple(a for a in args.arms.split(",") if a), seeds=2 if args.quick else args.seeds,
                         first_seed=args.first_seed, max_new_tokens=48 if args.quick else args.max_new_tokens,
                         sampling=sampling, history=history,
                         **{k: recall[k] for k in ("reselect", "share_from", "score_dtype")})
    loaded, apply_fn, params = load_model_from_args(args)
    result = M.run(cfg, apply_fn, params, loaded.config, loaded.tokenizer)
    if args.out:
        M.write(result, args.out)
    print(json.dumps(result) if args.json else M.markdown(result), end="")
    return 0


if __name__ == "__main__":
    run_main(main)
