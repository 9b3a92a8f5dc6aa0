"""One fact planted far before its question, through a streaming session (what `decode.py --prompt-file`
does): "The secret number of NAME is NUM." + n_filler tokens of a text + " The secret number of NAME is",
prefilled in chunks and answered greedily. With lead_max > 0 a random 0..lead_max filler tokens come first,
so the fact sits mid-stream at every alignment to the cold store's pages (it straddles page boundaries). Correct iff NUM appears in the answer. Arms: full, rsqr, and
rsqr with the recall tier (docs/design.md §3b) - the recall tier's acceptance check."""

from __future__ import annotations

import dataclasses

import numpy as np

from rsqr_jax import policy as P
from rsqr_jax.eval.runtime import ConfigError, progress, read_text, status, write_json_atomic
from rsqr_jax.eval.stats import wilson
from rsqr_jax.spec import ColdStore
from rsqr_lab.studies import base_policy

NAMES = ("Ada", "Boris", "Chloe", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kira", "Lars")
ARMS = ("full", "rsqr", "rsqr_recall")


@dataclasses.dataclass(frozen=True, eq=False)  # holds a Policy (studies.base_policy)
class FactConfig:
    """policy: the rsqr arms' policy (its mode is rsqr whatever it was); recall_pages: the rsqr_recall arm's
    (an arm apart, so not in the base policy: the plain arms recall nothing)."""

    filler: str
    trials: int = 20
    n_filler: int = 1200
    arms: tuple[str, ...] = ARMS
    policy: P.Policy = base_policy.field()
    recall_pages: int = 4
    cold: ColdStore = ColdStore()
    lead_max: int = 0
    prefill_chunk: int = 64
    gen_tokens: int = 12
    seed: int = 7

    def __post_init__(self):
        if self.trials < 1 or self.n_filler < 1 or self.lead_max < 0:
            raise ConfigError("--trials and --filler-tokens must be >= 1, --lead-max >= 0")
        bad = [a for a in self.arms if a not in ARMS]
        if bad:
            raise ConfigError(f"unknown arm {bad[0]!r}: choose from {', '.join(ARMS)}")
        base_policy.check(self.policy)

    def arm_policy(self, arm: str) -> P.Policy:
        if arm == "full":
            return P.full()
        return self.policy.replace(mode="rsqr", recall_pages=self.recall_pages if arm == "rsqr_recall" else 0)

    def to_json(self) -> dict:
        return base_policy.config_json(self, ("window", "n_sink", "delta", "max_survivors"))


def run(cfg: FactConfig, apply_fn, params, model_config, tokenizer, *, show_progress: bool = True) -> dict:
    """Every trial under every arm; returns the result dict (records, summary with Wilson intervals)."""
    from rsqr_jax.session import Session
    from rsqr_jax.spec import CacheSpec

    ids = tokenizer.encode(read_text(cfg.filler), add_special_tokens=False)
    if len(ids) < cfg.n_filler + cfg.lead_max + 2:
        raise ConfigError(f"{cfg.filler} has {len(ids)} tokens; a trial needs {cfg.n_filler + cfg.lead_max}")
    rng = np.random.default_rng(cfg.seed)
    status(f"fact_probe: seed {cfg.seed}, {cfg.trials} trials, {cfg.n_filler} filler tokens of {cfg.filler}")
    records = []
    bar = progress(cfg.trials * len(cfg.arms), "fact_probe", enabled=show_progress, unit="run")
    for trial in range(cfg.trials):
        name, num = NAMES[trial % len(NAMES)], str(rng.integers(1_000_000, 10_000_000))
        off = int(rng.integers(0, len(ids) - cfg.n_filler - cfg.lead_max - 1))
        lead = int(rng.integers(0, cfg.lead_max + 1)) if cfg.lead_max else 0  # no draw: old seeds reproduce
        fact = f"{' ' if lead else ''}The secret number of {name} is {num}."
        prompt = (ids[off:off + lead] + tokenizer.encode(fact, add_special_tokens=False)
                  + ids[off + lead:off + lead + cfg.n_filler]
                  + tokenizer.encode(f" The secret number of {name} is", add_special_tokens=False))
        for arm in cfg.arms:
            pol = cfg.arm_policy(arm)
            cold = {"cold": cfg.cold} if arm == "rsqr_recall" else {}
            spec = CacheSpec.for_policies(pol, dims=model_config, max_chunk=cfg.prefill_chunk,
                                          max_len=len(prompt) + max(16, cfg.gen_tokens), **cold)
            s = Session(apply_fn, params, spec, pol, prefill_chunk=cfg.prefill_chunk)
            s.feed(prompt)
            answer = tokenizer.decode(s.generate(cfg.gen_tokens))
            records.append({"trial": trial, "arm": arm, "number": num, "prompt_tokens": len(prompt), "lead": lead,
                            "answer": answer, "correct": num in answer})
            bar.update(1)
    bar.close()
    summary = []
    for arm in cfg.arms:
        k = sum(r["correct"] for r in records if r["arm"] == arm)
        lo, hi = wilson(k, cfg.trials)
        summary.append({"arm": arm, "policy": cfg.arm_policy(arm).name, "correct": k, "trials": cfg.trials,
                        "acc": k / cfg.trials, "wilson_lo": lo, "wilson_hi": hi})
    return {"config": cfg.to_json(), "summary": summary, "records": records}


def markdown(result: dict) -> str:
    rows = ["| arm | policy | correct | accuracy [Wilson 95%] |", "|---|---|---|---|"]
    for s in result["summary"]:
        rows.append(f"| {s['arm']} | `{s['policy']}` | {s['correct']}/{s['trials']} | "
                    f"{100 * s['acc']:.0f}% [{100 * s['wilson_lo']:.0f}-{100 * s['wilson_hi']:.0f}] |")
    return "\n".join(rows) + "\n"


def write(result: dict, out_dir) -> None:
    import pathlib

    out = pathlib.Path(out_dir)
    write_json_atomic(out / "fact_probe.json", result)
    (out / "fact_probe.md").write_text(markdown(result))
