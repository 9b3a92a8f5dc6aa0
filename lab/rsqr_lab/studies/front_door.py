"""decode.py's defaults against `rsqr_jax.load().chat()` on the memory demo's first turns: the same greedy
tokens, and the time per token of each, side by side.

Each arm runs in a process of its own (rounds alternate which runs first, so load on the machine hits both
alike): `decode.py --chat` reading the turns from stdin, and the front door (`python -m
rsqr_lab.studies.front_door --arm library`), both greedy, with the demo's system prompt and everything else
left to the embedded model's preset. Time per token is a turn's prefill and generation over the tokens it
generated, compilation excluded on both sides (decode.py compiles before the first turn; the library arm warms
its session up the same way)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from rsqr_jax.cli.chat import DEMO
from rsqr_jax.eval.runtime import ConfigError, status, write_json_atomic

REPO = Path(__file__).resolve().parents[3]


@dataclasses.dataclass(frozen=True)
class FrontDoorConfig:
    turns: int = 3  # the demo's first turns
    max_new_tokens: int = 128  # the demo's reply length
    rounds: int = 3

    def __post_init__(self):
        if not 1 <= self.turns <= len(DEMO.turns) or self.max_new_tokens < 1 or self.rounds < 1:
            raise ConfigError(f"--turns must be in 1..{len(DEMO.turns)}, --max-new-tokens and --rounds >= 1")


def _env() -> dict:
    lab = str(REPO / "lab")
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": lab if not path else f"{lab}{os.pathsep}{path}"}


def run_cli(cfg: FrontDoorConfig) -> dict:
    """decode.py with its defaults (greedy, the demo's system prompt), the turns on stdin."""
    cmd = [sys.executable, str(REPO / "scripts" / "decode.py"), "--chat", "--system", DEMO.system, "--temperature",
           "0", "--max-new-tokens", str(cfg.max_new_tokens), "--json"]
    proc = subprocess.run(cmd, input="".join(t + "\n" for t in DEMO.turns[:cfg.turns]), capture_output=True,
                          text=True, cwd=REPO, env=_env())
    if proc.returncode:
        raise ConfigError(f"decode.py failed: {proc.stderr.strip().splitlines()[-1]}")
    r = json.loads(proc.stdout)
    seconds = r["prefill_s"] + r["n_generated"] / r["tokens_per_s"]
    return {"replies": r["replies"], "n_generated": r["n_generated"], "seconds": seconds}


def run_library(cfg: FrontDoorConfig) -> dict:
    """The front door in this process: rsqr_jax.load().chat(...) with the same settings."""
    import rsqr_jax as rj

    chat = rj.load().chat(system=DEMO.system, temperature=0, max_new_tokens=cfg.max_new_tokens)
    chat.session.warmup()
    replies, n, seconds = [], 0, 0.0
    for turn in DEMO.turns[:cfg.turns]:
        t0 = time.perf_counter()
        replies.append(chat.send(turn))
        seconds += time.perf_counter() - t0
        n += chat.n_generated
    return {"replies": replies, "n_generated": n, "seconds": seconds}


def _library_process(cfg: FrontDoorConfig) -> dict:
    cmd = [sys.executable, "-m", "rsqr_lab.studies.front_door", "--arm", "library", "--turns", str(cfg.turns),
           "--max-new-tokens", str(cfg.max_new_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=_env())
    if proc.returncode:
        raise ConfigError(f"the library arm failed: {proc.stderr.strip().splitlines()[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(cfg: FrontDoorConfig) -> dict:
    arms = {"decode.py": run_cli, "rsqr_jax.load().chat()": _library_process}
    rows: dict[str, list[dict]] = {name: [] for name in arms}
    for r in range(cfg.rounds):
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]
        for name in order:
            status(f"front door: round {r + 1}/{cfg.rounds}, {name}")
            rows[name].append(arms[name](cfg))
    first = {name: runs[0]["replies"] for name, runs in rows.items()}
    same = len({json.dumps(v) for v in first.values()}) == 1
    ms = {name: [1e3 * x["seconds"] / x["n_generated"] for x in runs] for name, runs in rows.items()}
    cli, lib = ms["decode.py"], ms["rsqr_jax.load().chat()"]
    return {"config": dataclasses.asdict(cfg), "same_replies": same, "replies": first,
            "ms_per_token": ms, "median_ms": {k: float(np.median(v)) for k, v in ms.items()},
            "ratio_library_to_cli": float(np.median(np.asarray(lib) / np.asarray(cli)))}


def markdown(result: dict) -> str:
    lines = ["| arm | ms/token (median of rounds) | per round |", "|---|---|---|"]
    for name, v in result["ms_per_token"].items():
        lines.append(f"| {name} | {result['median_ms'][name]:.1f} | {', '.join(f'{x:.1f}' for x in v)} |")
    lines += ["", f"Same greedy replies on the demo's first {result['config']['turns']} turns: "
              f"{'yes' if result['same_replies'] else 'NO'}; library / decode.py per round, median: "
              f"{result['ratio_library_to_cli']:.2f}x"]
    return "\n".join(lines) + "\n"


def write(result: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    write_json_atomic(os.path.join(out_dir, "front_door.json"), result)
    Path(out_dir, "front_door.md").write_text(markdown(result))


def _main() -> None:
    """The library arm as a process of its own (one JSON line on stdout)."""
    p = argparse.ArgumentParser()
    p.add_argument("--arm", choices=["library"], required=True)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    a = p.parse_args()
    print(json.dumps(run_library(FrontDoorConfig(a.turns, a.max_new_tokens, 1))))


if __name__ == "__main__":
    _main()
