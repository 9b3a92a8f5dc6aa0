"""Drift, level 3 (model): stream tokens one by one through the engine (`Decoder.feed`, a vmapped policy
batch per precision) under rerotate and rsqr, sinks + window (block 1 and 8) and one configuration with
survivors, in up to four precisions: float32 model + float32 cache, float32 model + bfloat16 cache,
bfloat16 model + bfloat16 cache, and the float32-model/bfloat16-cache stream started at global position
1e5. Per-step logits are compared (max-abs, KL, top-1, NLL) with a float32 reference on the same token
set: `streamingllm` (a different code path: raw ring, every key rotated from raw at its rank every step)
for the delta = 0 configurations, float32 `rsqr` for the survivor one. The float32 streams are checked
against the float64 rank oracle (rsqr_lab.testing.oracle) on a prefix.
"""

from __future__ import annotations

import numpy as np

from rsqr_jax import policy as P
from rsqr_jax.engine import Decoder
from rsqr_jax.eval.runtime import progress as progress_bar
from rsqr_jax.eval.runtime import status
from rsqr_lab.studies.drift_keys import N_SINK
from rsqr_jax.spec import CacheSpec
from rsqr_lab.testing.oracle import reference_token_sets, stream_logits_f64

LATE_START = 100_000  # a bfloat16-cache stream that starts at this global position
START_PRECISION = "f32+bf16cache@1e5"
PRECISIONS = {
    "f32": "float32 model, float32 cache", "f32+bf16cache": "float32 model, bfloat16 KV cache",
    "bf16": "bfloat16 model (weights and activations), bfloat16 KV cache",
    START_PRECISION: f"float32 model, bfloat16 KV cache, stream starting at global position {LATE_START}"}


def log_softmax64(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def nll_of(lp_TxV, targets_T):
    """NLL of each target (-1 = none: NaN)."""
    t = np.asarray(targets_T)
    v = np.where(t >= 0, t, 0)
    nll = -np.take_along_axis(lp_TxV, v[:, None], axis=-1)[:, 0]
    return np.where(t >= 0, nll, np.nan)


def _token_sets(T, h):
    return [set(s) for _, s in reference_token_sets(
        T, window=h["window"], n_sink=h["n_sink"], delta=h["delta"], max_survivors=h["max_survivors"],
        block=h["block"], overflow=P.OVERFLOWS[h["overflow"]])]


def rotation_counts(T, h) -> tuple[np.ndarray, np.ndarray]:
    """Per step: max (int) and mean (float32) over the cached keys of the rotations each went through.

    A rerotate key is rotated when written and again whenever its rank changes (one hop per eviction
    event that renumbers it); every other policy stores a key rotated once (or raw). Derived from the
    token-set model, because the engine does not expose the per-step plan (see the report)."""
    rerotate = P.MODE_TRAITS[P.MODES[h["mode"]]].rerotate
    count, rank = {}, {}
    r_max, r_mean = np.zeros(T, np.int64), np.zeros(T, np.float32)
    for t, cached in enumerate(_token_sets(T, h)):
        for i, g in enumerate(sorted(cached)):
            if g not in count:
                count[g] = 1
            elif rerotate and rank[g] != i:
                count[g] += 1
            rank[g] = i
        c = [count[g] for g in cached]
        r_max[t], r_mean[t] = max(c), np.float32(sum(c)) / np.float32(len(c))
    return r_max, r_mean


def _configs(cfg):
    """[(name, reference mode, {mode: policy})]: the delta = 0 configurations, then the survivor one."""
    configs = []
    for W, b in cfg.model_configs:
        kw = dict(window=W, n_sink=N_SINK, delta=0, block=b)
        configs.append((f"W={W},b={b}", "streamingllm", {
            "streamingllm": P.make_policy("streamingllm", window=W, n_sink=N_SINK, block=b),
            "rsqr": P.make_policy("rsqr", **kw), "rerotate": P.make_policy("rerotate", **kw)}))
    sc = cfg.surv_policy.settings()
    configs.append((f"W={sc['window']},b={sc['block']},delta={sc['delta']},S={sc['max_survivors']}", "rsqr", {
        "rsqr": cfg.surv_policy.replace(mode="rsqr"), "rerotate": cfg.surv_policy.replace(mode="rerotate")}))
    return configs


def exp_model(model_cfg, models: dict, weights: dict | None, tokens_T, cfg, *, progress: bool = True) -> dict:
    """Stream `tokens_T` under every (configuration, policy) in each precision; compare logits per step."""
    T, K = len(tokens_T), cfg.segment
    configs = _configs(cfg)
    all_pols = [p for _, _, d in configs for p in d.values()]
    f32 = models["float32"]
    # name: ((apply_fn, params), cache dtype, modes, stream start); "f32" first: it holds the references.
    # The late-start stream (init_cache(spec, start)): rank-timeline logits do not depend on the start, so
    # the float32 references at start 0 still apply; rsqr's window keys are rotated at global positions.
    table = {"f32": (f32, "float32", None, 0), "f32+bf16cache": (f32, "bfloat16", ("rsqr", "rerotate"), 0),
             "bf16": (models.get("bfloat16"), "bfloat16", ("rsqr", "rerotate"), 0),
             START_PRECISION: (f32, "bfloat16", ("rsqr", "rerotate"), LATE_START)}
    streams = {}
    for pname, (model, cdt, modes, start) in table.items():
        if pname not in cfg.precisions:
            continue
        if model is None:
            raise ValueError(f"precision {pname} needs models[{'bfloat16'!r}]")
        idx = [(ci, m) for ci, (_, _, d) in enumerate(configs) for m in d if modes is None or m in modes]
        spec = CacheSpec.for_policies(all_pols, dims=model_cfg, dtype=cdt)
        dec = Decoder(model[0], spec, vmap_policies=True)
        streams[pname] = dict(idx=idx, policies=P.stack_policies([configs[ci][2][m] for ci, m in idx]), dec=dec,
                              cache=dec.init_cache(len(idx), start), params=model[1])
    ref_of = {ci: j for j, (ci, m) in enumerate(streams["f32"]["idx"]) if m == configs[ci][1]}
    rot = {(ci, m): rotation_counts(T, p.host()) for ci, (_, _, d) in enumerate(configs) for m, p in d.items()}

    # float64 oracle on a prefix for the first delta = 0 configuration (and the survivor configuration).
    T_o = min(cfg.oracle_tokens, T) if cfg.oracle and weights is not None else 0
    oracle_cis = ([0, len(configs) - 1] if cfg.oracle_configs == "both" else [0]) if T_o else []
    keep = {}  # (ci, mode) -> [T_o, V] f32 logits of the f32 stream

    series = {pn: {f"{configs[ci][0]}/{m}": {"kl": [], "max_abs": [], "top1": [], "nll": []} for ci, m in st["idx"]}
              for pn, st in streams.items()}
    ref_nll = {configs[ci][0]: [] for ci in ref_of}
    with progress_bar(T, "drift model", enabled=progress) as bar:
        for seg in range(T // K):
            targets = np.full(K, -1, np.int64)
            nxt = tokens_T[seg * K + 1:(seg + 1) * K + 1]
            targets[:len(nxt)] = nxt
            ref_lp, ref_logits = None, None
            for pname, st in streams.items():  # "f32" first: it holds the references
                out = []
                for tok in tokens_T[seg * K:(seg + 1) * K]:
                    logits, st["cache"] = st["dec"].feed(st["params"], np.full((1, 1), tok, np.int32), st["cache"],
                                                         st["policies"])
                    out.append(logits[:, 0, 0])
                logits = np.stack([np.asarray(x) for x in out], axis=1).astype(np.float64)  # [n, K, V]
                if pname == "f32":
                    ref_logits = {ci: logits[j] for ci, j in ref_of.items()}
                    ref_lp = {ci: log_softmax64(x) for ci, x in ref_logits.items()}
                    for ci in ref_of:
                        ref_nll[configs[ci][0]].append(nll_of(ref_lp[ci], targets))
                    for j, (ci, m) in enumerate(st["idx"]):
                        if ci in oracle_cis and seg * K < T_o:
                            keep.setdefault((ci, m), []).append(logits[j].astype(np.float32))
                for j, (ci, m) in enumerate(st["idx"]):
                    lp, lr = log_softmax64(logits[j]), ref_lp[ci]
                    ser = series[pname][f"{configs[ci][0]}/{m}"]
                    ser["kl"].append(np.maximum(np.sum(np.exp(lr) * (lr - lp), -1), 0.0))
                    ser["max_abs"].append(np.abs(logits[j] - ref_logits[ci]).max(-1))
                    ser["top1"].append(np.argmax(lp, -1) == np.argmax(lr, -1))
                    ser["nll"].append(nll_of(lp, targets))
            bar.update(K)

    out = {"tokens": T, "n_sink": N_SINK, "configs": {}, "precisions": dict(PRECISIONS), "series": {}, "summary": {}}
    for ci, (name, ref_mode, d) in enumerate(configs):
        h = d[ref_mode].host()
        out["configs"][name] = {"policy_params": {m: p.host() for m, p in d.items()}, "reference": f"f32 {ref_mode}",
                                "first_eviction_step": h["window"] + h["block"] - 1,  # 0-based
                                "ref_nll_mean": float(np.nanmean(np.concatenate(ref_nll[name])))}
    for pname, sers in series.items():
        for j, (ci, m) in enumerate(streams[pname]["idx"]):
            key = f"{configs[ci][0]}/{m}"
            cname = configs[ci][0]
            fe = out["configs"][cname]["first_eviction_step"]
            arr = {k: np.concatenate(v).astype(np.float64) for k, v in sers[key].items()}
            arr["max_rot"], arr["mean_rot"] = (x.astype(np.float64) for x in rot[(ci, m)])
            out["series"][f"{pname}/{key}"] = {k: [float(f"{x:.4g}") for x in arr[k]] for k in
                                              ("kl", "max_abs", "max_rot", "mean_rot")}
            after = slice(fe, T - 1)  # steps with at least one eviction; the last step has no target
            last_q = slice(T - 1 - (T - 1 - fe) // 4, T - 1)
            nll = arr["nll"][after]
            ref = np.concatenate(ref_nll[cname])[after]
            out["summary"][f"{pname}/{key}"] = {
                "kl_mean": float(arr["kl"][after].mean()), "kl_median": float(np.median(arr["kl"][after])),
                "kl_max": float(arr["kl"][after].max()), "kl_mean_last_quarter": float(arr["kl"][last_q].mean()),
                "max_abs_mean": float(arr["max_abs"][after].mean()), "max_abs_max": float(arr["max_abs"][after].max()),
                "top1_agree": float(arr["top1"][after].mean()),
                "nll_mean": float(nll.mean()), "dnll_mean": float((nll - ref).mean()),
                "max_rotations": int(arr["max_rot"].max()), "mean_rotations_end": float(arr["mean_rot"][-1]),
                "kl_before_eviction_max": float(arr["kl"][:fe].max()) if fe > 0 else 0.0,
            }
    if T_o:
        out["oracle"] = {"tokens": T_o}
        for ci in oracle_cis:
            name, ref_mode, d = configs[ci]
            lo = stream_logits_f64(weights, model_cfg, tokens_T[:T_o], _token_sets(T_o, d[ref_mode].host()), "rank")
            lr = log_softmax64(lo)
            for m in d:
                got = np.concatenate(keep[(ci, m)], axis=0)[:T_o].astype(np.float64)
                lp = log_softmax64(got)
                kl = np.maximum(np.sum(np.exp(lr) * (lr - lp), -1), 0.0)
                out["oracle"][f"{name}/{m}"] = {"max_abs": float(np.abs(got - lo).max()), "kl_max": float(kl.max()),
                                                "kl_mean": float(kl.mean())}
            status(f"oracle {name}: {T_o} tokens: " +
                   ", ".join(f"{m} max-abs {out['oracle'][f'{name}/{m}']['max_abs']:.1e}" for m in d))
    return out
