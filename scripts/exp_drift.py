#!/usr/bin/env python3
"""Experiment 1, "Drift": error of keys rotated again and again (`rerotate`) against one
rotation from raw (`rsqr` / `streamingllm`), at the key, attention and model level (what each level
measures: lab/rsqr_lab/studies/drift.py).

    python scripts/exp_drift.py --quick --out /tmp/drift_quick     # CI smoke run (< 3 min)
    nice -n 10 python scripts/exp_drift.py --out runs/exp_drift     # full run (~17 min on 2 busy cores)
    python scripts/exp_drift.py --parts keys --out runs/exp_drift   # redo one part (keys, attention, model)
    python scripts/exp_drift.py --replot --out runs/exp_drift       # redraw plots + markdown from results.json

Writes results.json, drift_*.png and drift_section.md (markdown tables) to --out; --json prints the
results as one JSON object on stdout.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from rsqr_jax.cli.args import DEFAULT_TEXT, Parser, UsageError, run_main


def build_parser():
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small CI run (< 3 min)")
    p.add_argument("--out", default="runs/exp_drift", help="output directory (results.json, PNGs, markdown)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded SmolLM2)")
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="text to capture keys from and to stream")
    p.add_argument("--seed", type=int, default=0, help="seed of the random key set")
    p.add_argument("--model-tokens", type=int, default=None, help="override the model-level stream length")
    p.add_argument("--parts", default="keys,attention,model",
                   help="comma-separated subset of keys,attention,model (plots/markdown cover what ran)")
    p.add_argument("--no-oracle", action="store_true", help="skip the float64 oracle check of the references")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--replot", action="store_true",
                   help="only redraw the plots and markdown from OUT/results.json (no computation)")
    return p


def capture_fn(loaded, info: dict, n_check: int = 64):
    """capture_qk(tokens) for the experiment; records how far the capture's logits are from the model's
    own forward pass (forward_logits) on the first n_check tokens."""
    from rsqr_jax.models.capture import capture_qk
    from rsqr_jax.models.llama import forward_logits

    def capture(tokens_T):
        q, k, logits = capture_qk(loaded.model, tokens_T)
        n = min(len(tokens_T), n_check)
        ref = forward_logits(loaded, np.asarray(tokens_T)[None, :n])[0]
        info["capture_check_max_abs_logits"] = float(np.abs(ref - logits[:n]).max())
        return q, k

    return capture


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from rsqr_lab.studies import drift
    from rsqr_jax.eval.runtime import read_tokens, status

    out_dir = Path(args.out)
    cmd = "python scripts/exp_drift.py" + (" --quick" if args.quick else "") + f" --out {args.out}"
    if args.replot:
        if not (out_dir / "results.json").is_file():
            raise UsageError(f"--replot: no {out_dir / 'results.json'}")
        res = drift.DriftResult.load(out_dir / "results.json")
        res.data.setdefault("command", cmd)
        res.write(out_dir)
    else:
        parts = tuple(p for p in args.parts.split(",") if p)
        kw = dict(parts=parts, oracle=not args.no_oracle, seed=args.seed)
        if args.model_tokens:
            kw["model_tokens"] = args.model_tokens
        config = drift.DriftConfig.quick_run(**kw) if args.quick else drift.DriftConfig(**kw)

        import jax.numpy as jnp

        from rsqr_jax.models.capture import weights_of
        from rsqr_jax.models.llama import Llama, load_model, split_apply

        loaded = load_model(args.model, "float32")
        cfg = loaded.config
        tokens = read_tokens(loaded.tokenizer, args.text, config.tokens_needed)
        status(f"loaded {loaded.path} and {len(tokens)} tokens")
        weights = weights_of(loaded.model)
        models = {"float32": split_apply(loaded.model, kernel="xla")}
        if "bf16" in config.precisions and "model" in parts:
            models["bfloat16"] = split_apply(Llama(cfg, weights, dtype=jnp.bfloat16), kernel="xla")
        info = {}  # the capture check, filled by the capture
        if set(parts) != set(drift.PARTS):
            cmd += f" --parts {args.parts}"
        res = drift.run(config, model_cfg=cfg, tokens=tokens, capture_qk=capture_fn(loaded, info), models=models,
                        weights=weights, progress=not args.no_progress, command=cmd, model_name=loaded.path)
        res.data.update(info)
        res.merge_previous(out_dir / "results.json")
        res.write(out_dir, plots=not args.no_plots)
        status(f"done in {res.data['timings_s']['total']:.0f}s -> {out_dir}")
    if args.json:
        print(json.dumps(res.to_json()))
    return 0


if __name__ == "__main__":
    run_main(main)
