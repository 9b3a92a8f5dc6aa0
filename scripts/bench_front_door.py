#!/usr/bin/env python3
"""decode.py's defaults against rsqr_jax.load().chat(): the same greedy tokens on the memory demo's first turns,
and the time per token of each, side by side.

    python scripts/bench_front_door.py --out runs/front_door          # 3 turns of up to 128 tokens, 3 rounds
"""

from __future__ import annotations

import json

from rsqr_jax.cli.args import Parser, run_main


def main(argv: list[str] | None = None) -> int:
    from rsqr_lab.studies import front_door as F

    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=3, help="the demo's first turns")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="1 turn, 8 tokens, 1 round")
    p.add_argument("--out", default=None, metavar="DIR", help="write DIR/front_door.json and .md")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.turns, args.max_new_tokens, args.rounds = 1, 8, 1
    result = F.run(F.FrontDoorConfig(args.turns, args.max_new_tokens, args.rounds))
    if args.out:
        F.write(result, args.out)
    print(json.dumps(result) if args.json else F.markdown(result), end="")
    return 0 if result["same_replies"] else 1


if __name__ == "__main__":
    run_main(main)
