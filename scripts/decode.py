#!/usr/bin/env python3
"""`python scripts/decode.py ...` in a checkout: the command `rsqr-decode` (rsqr_jax/cli/decode.py)."""

from rsqr_jax.cli.decode import run

if __name__ == "__main__":
    run()
