#!/usr/bin/env python3
"""Policy sweep: a grid of eviction policies streamed over the same text in ONE vmapped, jitted run.

    python scripts/exp_sweep.py --grid "mode=rsqr,rerotate,leave_gaps,streamingllm window=64,128 delta=4,8,16" \\
        --tokens 512 --bucket 128 --out runs/sweep
    python scripts/exp_sweep.py --grid "..." --devices 4      # shard the policy axis over 4 devices
                                                          # (on CPU: 4 simulated host devices)
    python scripts/exp_sweep.py --quick --json                # tiny random model, 8 policies, seconds
    python scripts/exp_sweep.py --quick --processes 2         # 2 local processes (jax.distributed, loopback,
                                                          # CPU devices): the grid split over both
    python scripts/exp_sweep.py ... --coordinator HOST:PORT --num-processes N --process-id I
                                                          # one process per host of a cluster (docs/sweep.md)

Grid: whitespace-separated key=v1,v2 terms (cartesian product; identical policies kept once). Keys:
mode, window, sinks, delta, max_survivors, block, overflow. Writes to --out: sweep.csv, sweep.json
(rows with the per-bucket curve), sweep.md (table sorted by --sort), sweep_ppl.png, nll.npy [P, T-1].
The logic is rsqr_lab.studies.policy_sweep.
"""

from __future__ import annotations

import json
import sys

from rsqr_jax.cli.args import (DEFAULT_TEXT, Parser, UsageError, add_model_args, add_recall_args, check_model_args,
                     cold_store_flags, run_main)

from rsqr_lab.studies import policy_sweep as X


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default=None, help=f"policy grid (default: {X.DEFAULT_GRID!r}; --quick: "
                                                f"{X.QUICK_GRID!r})")
    p.add_argument("--task", default="ppl", help="ppl (streaming perplexity; the only task so far)")
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="UTF-8 text file (default: Frankenstein)")
    p.add_argument("--tokens", type=int, default=None, help="tokens to stream, T-1 are scored (default 1024; "
                                                            "--quick 96)")
    p.add_argument("--devices", type=int, default=None,
                   help="devices to shard the policy axis over (default: all available; on CPU with N > 1, "
                        "N simulated host devices)")
    p.add_argument("--processes", type=int, default=None,
                   help="launch N local processes of one jax.distributed job (loopback coordinator, CPU devices; "
                        "--devices is then the total over all of them, default one per process)")
    g = p.add_argument_group("one process of a multi-process job (what --processes passes; on a cluster: per host)")
    g.add_argument("--coordinator", default=None,
                   help="HOST:PORT of process 0's coordinator, or 'auto' (JAX detects SLURM / Open MPI / k8s)")
    g.add_argument("--num-processes", type=int, default=None, help="processes in the job")
    g.add_argument("--process-id", type=int, default=None, help="this process's index, 0 .. N-1")
    p.add_argument("--chunk", type=int, default=1, help="tokens per step (1 = exact token-by-token eviction)")
    p.add_argument("--segment", type=int, default=None, help="tokens per jitted call (default 256; --quick 32)")
    p.add_argument("--bucket", type=int, default=None, help="tokens per point of the perplexity curve "
                                                            "(default 1000; --quick 32)")
    p.add_argument("--sort", default="ppl", help="table order: ppl, name or grid")
    p.add_argument("--quick", action="store_true", help="tiny random model on random tokens (the CI run)")
    p.add_argument("--out", default="runs/sweep", help="output directory")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true")
    add_recall_args(p, what="the store of grid entries with recall_pages > 0", pages=False)
    add_model_args(p)
    return p


def config_from_args(args) -> X.SweepConfig:
    given = {k: getattr(args, k) for k in ("grid", "tokens", "segment", "bucket") if getattr(args, k) is not None}
    common = dict(task=args.task, chunk=args.chunk, sort=args.sort, devices=args.devices, dtype=args.dtype,
                  progress=not args.no_progress, cold=cold_store_flags(args))
    if args.quick:
        return X.SweepConfig.quick(text=None, **common, **given)
    return X.SweepConfig(text=args.text, **common, **given)


def check_distributed_args(args) -> None:
    given = [a for a in ("num_processes", "process_id") if getattr(args, a) is not None]
    if args.processes is not None and (args.coordinator is not None or given):
        raise UsageError("--processes launches its own processes: not with --coordinator/--num-processes/--process-id")
    if args.coordinator in (None, "auto"):
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} needs --coordinator HOST:PORT")
        return
    if args.num_processes is None or args.process_id is None:
        raise UsageError("--coordinator HOST:PORT needs --num-processes and --process-id")
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
        raise UsageError(f"--process-id must be in [0, {args.num_processes}) and --num-processes >= 1, got "
                         f"{args.process_id} of {args.num_processes}")
    host, sep, port = args.coordinator.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_model_args(args)
    check_distributed_args(args)
    if args.quick and args.model is not None:
        raise UsageError("--quick runs the tiny random model: not both --quick and --model")
    config = config_from_args(args)
    config.validate()

    if args.processes is not None:
        from rsqr_jax.sweep import policy_grid

        policy_grid(config.grid)  # a bad grid -> one line, exit 2, before any process starts
        local = X.check_processes(args.processes, config.devices)
        argv = list(sys.argv[1:] if argv is None else argv)
        i = argv.index("--processes") if "--processes" in argv else None
        argv = argv[:i] + argv[i + 2:] if i is not None else [a for a in argv if not a.startswith("--processes=")]
        return X.launch_local_processes([sys.executable, __file__, *argv], args.processes, local)
    if args.coordinator is not None:  # joins the job before anything initializes a JAX backend
        from rsqr_jax.sweep import init_distributed

        n = args.num_processes
        if config.devices is not None and n and config.devices % n:
            raise UsageError(f"--devices {config.devices} does not split evenly over {n} processes")
        X.request_host_devices(config.devices // n if config.devices and n else None)
        try:
            init_distributed(*(() if args.coordinator == "auto" else (args.coordinator, n, args.process_id)))
        except (RuntimeError, ValueError) as e:
            raise UsageError(f"cannot join the distributed job: {str(e).splitlines()[0] if str(e) else e!r}") from None
    else:
        X.request_host_devices(config.devices)  # before JAX initializes its backends

    from rsqr_jax.sweep import policy_grid

    policy_grid(config.grid)  # a bad grid -> one line, exit 2, before the model loads
    if args.quick:
        apply_fn, params, model_config, name = X.quick_model(config.dtype, args.kernel)
        tokenizer = None
    else:
        from rsqr_jax.models.llama import load_model, split_apply

        loaded = load_model(args.model, config.dtype, weight_format=args.weight_format)
        apply_fn, params = split_apply(loaded.model, kernel=args.kernel)
        model_config, tokenizer, name = loaded.config, loaded.tokenizer, loaded.path
    result = X.run(config, apply_fn, params, model_config, tokenizer, model_name=name)
    import jax

    if jax.process_index() != 0:  # every process holds the gathered result; process 0 reports it
        return 0
    paths = result.write(args.out) if args.out else {}
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    print(result.summary_line())
    for k in ("md", "csv", "json", "png"):
        if k in paths:
            print(f"  {paths[k]}")
    return 0

if __name__ == "__main__":
    run_main(main)
