#!/usr/bin/env python3
"""`python scripts/eval_stream.py ...` in a checkout: the command `rsqr-eval-stream` (rsqr_jax/cli/eval_stream.py)."""

from rsqr_jax.cli.eval_stream import run

if __name__ == "__main__":
    run()
