#!/usr/bin/env python3
"""`python scripts/eval_tasks.py ...` in a checkout: the command `rsqr-eval-tasks` (rsqr_jax/cli/eval_tasks.py)."""

from rsqr_jax.cli.eval_tasks import run

if __name__ == "__main__":
    run()
