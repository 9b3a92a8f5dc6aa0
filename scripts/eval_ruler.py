#!/usr/bin/env python3
"""`python scripts/eval_ruler.py ...` in a checkout: RULER offline through the lm-eval model (rsqr_jax/cli/eval_ruler.py)."""

from rsqr_jax.cli.eval_ruler import run

if __name__ == "__main__":
    run()
