"""One phase of the GPU check of pallas_kernels.survivor_attention (rsqr_jax.experiments.gpu_check).

    bash scripts/gpu_check.sh                       # all three phases, each its own process (on the GPU)
    python scripts/gpu_check.py --phase gate --out DIR [--cpu-dry-run]

Phases: gate (versions, devices, one bf16 decode case, variants tried in turn), correctness (kernel vs
float64), timing (device-side, HBM-sized, one JSON row at a time). Exit status: 0 pass, 1 fail, 2 bad
input, 3 no GPU backend (gate only). --cpu-dry-run: tiny sizes, interpret=True, any backend.
"""

from __future__ import annotations

import os

from _common import Parser, run_main


def main() -> int:
    from rsqr_jax.experiments.gpu_check import PHASES, GpuCheckConfig, run_phase

    ap = Parser(description=__doc__)
    ap.add_argument("--phase", required=True, help=" | ".join(PHASES))
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_check"), help="folder for <phase>.json")
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes with interpret=True on any backend")
    args = ap.parse_args()
    return run_phase(GpuCheckConfig(phase=args.phase, out_dir=args.out, dry_run=args.cpu_dry_run))


if __name__ == "__main__":
    run_main(main)
