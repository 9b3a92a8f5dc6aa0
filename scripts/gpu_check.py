"""GPU check of pallas_kernels.survivor_attention: correctness first, then device-side timing.

    bash scripts/gpu_check.sh                 # on a GPU machine (writes $OUT/gpu_check.json)
    python scripts/gpu_check.py --cpu-smoke   # tiny sizes, interpret=True: proves this script runs

Sections (correctness, copy bandwidth, timing, tuning) and their cases: rsqr_jax.experiments.gpu_check;
inputs and the float64 oracle: rsqr_jax.testing.kernel. A table is printed last. Every section is
guarded: a failure is recorded in the JSON, not fatal, except that a correctness failure makes the exit
status 1.
"""

from __future__ import annotations

import argparse
import os
import sys

from rsqr_jax.experiments.gpu_check import run_check


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_check"))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes with interpret=True on CPU")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds before optional parts are skipped")
    args = ap.parse_args()
    return run_check(args.out, smoke=args.cpu_smoke, budget_s=args.budget)


if __name__ == "__main__":
    sys.exit(main())
