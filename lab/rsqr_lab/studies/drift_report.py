"""Drift report: the markdown tables (drift_section.md) and the plots (drift_*.png) of a results dict."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rsqr_lab.studies.drift_model import START_PRECISION


def make_plots(res: dict, out_dir: Path) -> dict:
    """Draw the plots of the parts in res into out_dir; {file name: path}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}

    def save(fig, name):
        p = out_dir / name
        fig.savefig(p, dpi=90, bbox_inches="tight")
        plt.close(fig)
        files[name] = str(p)

    if "keys" in res:
        keys = res["keys"]
        # 1. error vs rotations
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, s in zip(axes, keys["shifts"]):
            for kname, ls in (("random", "-"), ("captured", "--")):
                for dt, col in (("float32", "tab:blue"), ("bfloat16", "tab:red")):
                    rows = keys["sweep"].get(f"{kname}/{dt}/s={s}")
                    if not rows:
                        continue
                    h = [r["h"] for r in rows]
                    ax.loglog(h, [r["rerotate"]["rel_l2"]["median"] for r in rows], ls, color=col, marker="o", ms=3,
                              label=f"rerotate {dt} {kname}")
                    ax.loglog(h, [r["rsqr"]["rel_l2"]["median"] for r in rows], ls, color=col, alpha=0.4,
                              label=f"rsqr {dt} {kname}")
            ax.set_title(f"key error vs float64, hops of -{s}")
            ax.set_xlabel("rotations h (1 = written once)")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].set_ylabel("median relative L2 error")
        axes[1].legend(fontsize=7)
        save(fig, "drift_keys.png")

        # 2. P and s
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        hmax = max(res["config"]["grid_h"])
        s0 = min(res["config"]["grid_s"])
        for kname, ls in (("random", "-"), ("captured", "--")):
            for dt, col in (("float32", "tab:blue"), ("bfloat16", "tab:red")):
                for ang, mk in (("exact", "o"), ("naive", "x")):
                    cells = keys["grid"].get(f"{kname}/{dt}/{ang}")
                    if not cells:
                        continue
                    c = [x for x in cells if x["s"] == s0 and x["h"] == hmax]
                    axes[0].loglog([max(x["P"], 1) for x in c], [x["rerotate_rel_l2"] for x in c], ls, color=col,
                                   marker=mk, ms=4, alpha=1 if ang == "exact" else 0.5,
                                   label=f"rerotate {dt} {kname} {ang}")
                    c1 = [x for x in cells if x["s"] == s0 and x["h"] == 1 and x["rsqr_rel_l2"] > 0]
                    axes[0].loglog([max(x["P"], 1) for x in c1], [x["rsqr_rel_l2"] for x in c1], ":", color=col,
                                   marker=mk, ms=3, alpha=0.5)
                    if ang == "exact":
                        P0 = sorted({x["P"] for x in cells})[len({x["P"] for x in cells}) // 2]
                        c = [x for x in cells if x["P"] == P0 and x["h"] == hmax]
                        axes[1].loglog([x["s"] for x in c], [x["rerotate_rel_l2"] for x in c], ls, color=col, marker=mk,
                                       ms=4, label=f"rerotate {dt} {kname} (P={P0})")
        axes[0].set_title(f"error vs base position P (s={s0}, h={hmax}); dotted: one rotation")
        axes[0].set_xlabel("P (0 plotted at 1)")
        axes[0].set_ylabel("median relative L2 error")
        axes[1].set_title(f"error vs shift s = evict_n (h={hmax})")
        axes[1].set_xlabel("s")
        for kname, ls in (("random", "-"), ("captured", "--")):
            for dt, col in (("float32", "tab:blue"), ("bfloat16", "tab:red")):
                rows = keys.get("traverse", {}).get(f"{kname}/{dt}")
                if rows:
                    axes[2].loglog([r["s"] for r in rows], [r["rerotate_rel_l2"] for r in rows], ls, color=col,
                                   marker="o", ms=4, label=f"rerotate {dt} {kname}")
                    axes[2].loglog([r["s"] for r in rows], [r["rsqr_rel_l2"] for r in rows], ":", color=col,
                                   alpha=0.5)
        axes[2].set_title(f"a key crossing {keys.get('distance')} positions in hops of s (dotted: rsqr)")
        axes[2].set_xlabel("s (= block b); hops = distance / s")
        for ax in axes:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
        save(fig, "drift_grid.png")

        # 3. per pair
        fig, ax = plt.subplots(figsize=(8, 4))
        for key, d in keys["pairs"].items():
            kname, dt, s = key.split("/")
            if dt != "bfloat16":
                continue
            ax.semilogy(d["rerotate_rel_rms"], "-" if kname == "random" else "--", marker=".",
                        label=f"rerotate {kname} {s}")
        d0 = next(iter(v for k, v in keys["pairs"].items() if "bfloat16" in k))
        ax.semilogy(d0["rsqr_rel_rms"], ":", color="k", label="rsqr (one rotation)")
        ax.set_xlabel("frequency pair j (0 = fastest)")
        ax.set_ylabel("relative RMS error of the pair")
        ax.set_title("bfloat16, h=100 rotations: which pairs drift")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, "drift_pairs.png")

    if "attention" in res:
        # 4. attention
        att = res["attention"]
        fig, ax = plt.subplots(figsize=(8, 4))
        for key, rows in att["uniform"].items():
            W, dt, s = key.split("/")
            col = "tab:red" if dt == "bfloat16" else "tab:blue"
            ls = "-" if s == "s=1" else "--"
            h = [r["h"] for r in rows]
            ax.loglog(h, [max(r["rerotate"]["kl"]["mean"], 1e-18) for r in rows], ls, color=col, marker="o", ms=3,
                      label=f"rerotate {dt} {s}")
            ax.loglog(h, [max(r["rsqr"]["kl"]["mean"], 1e-18) for r in rows], ls, color=col, alpha=0.35,
                      label=f"rsqr {dt} {s} (window at ~{att['rsqr_global_offset']:.0e})")
            if s == "s=1":
                ax.loglog(h, [max(r["rank_once"]["kl"]["mean"], 1e-18) for r in rows], ":", color="k", alpha=0.6,
                          label=f"streamingllm (once, at rank) {dt}")
        ax.set_xlabel("rotations h of every window key")
        ax.set_ylabel("mean KL(p64 || p) of attention")
        ax.set_title(f"captured SmolLM2 q/k, {att['n_sink']} sinks + {res['config']['att_uniform_W']} window keys")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, "drift_attention.png")

    # 5. model
    mod = res.get("model")
    if mod:
        names = list(mod["configs"])
        fig, axes = plt.subplots(len(names), 1, figsize=(9, 1.9 * len(names)), sharex=True)
        axes = np.atleast_1d(axes)
        for ax, cname in zip(axes, names):
            for pname, col in (("f32+bf16cache", "tab:orange"), ("bf16", "tab:red"), ("f32", "tab:blue"),
                               (START_PRECISION, "tab:purple")):
                for m, ls in (("rerotate", "-"), ("rsqr", ":")):
                    ser = mod["series"].get(f"{pname}/{cname}/{m}")
                    if ser is None:
                        continue
                    if pname == "f32" and mod["configs"][cname]["reference"].endswith(m):
                        continue
                    kl = np.maximum(np.asarray(ser["kl"]), 1e-13)
                    c = np.concatenate([[0.0], np.cumsum(kl)])
                    lo = np.maximum(np.arange(1, len(kl) + 1) - 32, 0)
                    sm = (c[1:] - c[lo]) / (np.arange(1, len(kl) + 1) - lo)  # trailing 32-step mean
                    ax.semilogy(sm, ls, color=col, lw=1, label=f"{m} {pname}")
            ax.axvline(mod["configs"][cname]["first_eviction_step"], color="k", lw=0.5)
            ax.set_ylabel("KL, 32-step mean", fontsize=8)
            ax.set_ylim(1e-13, 1e-1)
            ax.set_title(cname, fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=6, ncol=3)
        axes[-1].set_xlabel("stream step t (vertical line: first eviction)")
        fig.suptitle("per-step KL(reference || policy) of the next-token distribution", fontsize=10)
        save(fig, "drift_model.png")
    return files


def fmt(x):
    if x == 0:
        return "0"
    if abs(x) >= 0.01 and abs(x) < 1000:
        return f"{x:.3g}"
    return f"{x:.1e}"


def markdown(res, cmd: str) -> str:
    L = [f"<!-- generated by: {cmd} -->", ""]
    if "keys" in res:
        L += ["### Keys: error after h rotations (median relative L2 / median max-abs, vs float64)", ""]
        keys = res["keys"]
        hs = [h for h in keys["rotations"] if h in (1, 2, 10, 100, 1000)]
        L.append("| keys | dtype | s | path | " + " | ".join(f"h={h}" for h in hs) + " |")
        L.append("|---|---|---|---|" + "---|" * len(hs))
        for key, rows in keys["sweep"].items():
            kname, dt, s = key.split("/")
            by = {r["h"]: r for r in rows}
            for path in ("rerotate", "rsqr"):
                L.append(f"| {kname} | {dt} | {s[2:]} | {path} | " + " | ".join(
                    f"{fmt(by[h][path]['rel_l2']['median'])} / {fmt(by[h][path]['max_abs']['median'])}"
                    for h in hs) + " |")
        L += ["", f"### P x s grid (rerotate, median relative L2 at h={max(res['config']['grid_h'])})", ""]
        for key, cells in keys["grid"].items():
            hmax = max(c["h"] for c in cells)
            Ps = sorted({c["P"] for c in cells})
            ss = sorted({c["s"] for c in cells})
            L.append(f"**{key}**  ")
            L.append("| P \\ s | " + " | ".join(str(s) for s in ss) + " |")
            L.append("|---|" + "---|" * len(ss))
            for P_ in Ps:
                row = {c["s"]: c for c in cells if c["P"] == P_ and c["h"] == hmax}
                L.append(f"| {P_} | " + " | ".join(fmt(row[s]["rerotate_rel_l2"]) for s in ss) + " |")
            L.append("")
        if "traverse" in keys:
            tr = keys["traverse"]
            ss = [r["s"] for r in next(iter(tr.values()))]
            L += [f"### A key crossing {keys['distance']} positions in hops of s (median relative L2 at the end)", "",
                  "| keys / dtype | " + " | ".join(f"s={s_} ({keys['distance'] // s_} hops)" for s_ in ss) +
                  " | rsqr (one rotation) |", "|---|" + "---|" * (len(ss) + 1)]
            for key, rows in tr.items():
                L.append(f"| {key} | " + " | ".join(fmt(r["rerotate_rel_l2"]) for r in rows) +
                         f" | {fmt(rows[0]['rsqr_rel_l2'])} |")
            L.append("")
        L += ["### One rotation from raw (rsqr / streamingllm) vs position P (median relative L2, exact angles)", "",
              "| keys / dtype | " + " | ".join(f"P={p_}" for p_ in
                                               sorted({c["P"] for c in next(iter(keys["grid"].values()))}))
              + " |", "|---|" + "---|" * len({c["P"] for c in next(iter(keys["grid"].values()))})]
        for key, cells in keys["grid"].items():
            Ps = sorted({c["P"] for c in cells})
            s0 = min(c["s"] for c in cells)
            row = {c["P"]: c for c in cells if c["s"] == s0 and c["h"] == 1}
            L.append(f"| {key} | " + " | ".join(fmt(row[p_]["rsqr_rel_l2"]) for p_ in Ps) + " |")
        L.append("")
    if "attention" in res:
        att = res["attention"]
        L += ["### Attention (captured q/k): KL(p64 || p), mean / max over layers x heads x queries", "",
              "| case | dtype | max rotations | rerotate KL mean | rerotate KL max | rsqr KL mean | rsqr KL max | "
              "rank-once KL mean | rerotate TV mean | rsqr TV mean |", "|---|---|---|---|---|---|---|---|---|---|"]
        for key, s in att["steady"].items():
            W, b, dt = key.split("/")
            L.append(f"| steady {W}, {b} | {dt} | {s['max_rotations']} | {fmt(s['rerotate']['kl']['mean'])} | "
                     f"{fmt(s['rerotate']['kl']['max'])} | {fmt(s['rsqr']['kl']['mean'])} | "
                     f"{fmt(s['rsqr']['kl']['max'])} | "
                     f"{fmt(s['rank_once']['kl']['mean'])} | {fmt(s['rerotate']['tv']['mean'])} | "
                     f"{fmt(s['rsqr']['tv']['mean'])} |")
        for key, rows in att["uniform"].items():
            W, dt, s_ = key.split("/")
            for r in rows:
                if r["h"] in (1, 10, 100, 1000):
                    L.append(f"| uniform {W}, {s_} | {dt} | {r['h']} | {fmt(r['rerotate']['kl']['mean'])} | "
                             f"{fmt(r['rerotate']['kl']['max'])} | {fmt(r['rsqr']['kl']['mean'])} | "
                             f"{fmt(r['rsqr']['kl']['max'])} | {fmt(r['rank_once']['kl']['mean'])} | "
                             f"{fmt(r['rerotate']['tv']['mean'])} | {fmt(r['rsqr']['tv']['mean'])} |")
        L += ["", "rsqr attention floor vs the global position of the window (KL mean; window keys rotated once at "
              "g + offset, query at t + offset):", "",
              "| case | dtype | " + " | ".join(f"offset {o}" for o in att["rsqr_offsets"]) + " |",
              "|---|---|" + "---|" * len(att["rsqr_offsets"])]
        for key, s in att["steady"].items():
            W, b, dt = key.split("/")
            L.append(f"| {W}, {b} | {dt} | " + " | ".join(
                fmt(s["rsqr" if o == att["rsqr_global_offset"] else f"rsqr@{o}"]["kl"]["mean"])
                for o in att["rsqr_offsets"])
                + " |")
    mod = res.get("model")
    if mod:
        L += ["", f"### Model: per-step logits vs the float32 reference, {mod['tokens']} Frankenstein tokens "
              "(steps after the first eviction)", "",
              "| config | precision | policy | max rotations | KL mean | KL max | KL mean (last quarter) | "
              "max-abs mean | max-abs max | top-1 agree | dNLL mean |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for key, s in mod["summary"].items():
            pname, cname, m = key.split("/")
            ref = mod["configs"][cname]["reference"]
            if pname == "f32" and ref.endswith(m):
                continue
            L.append(f"| {cname} | {pname} | {m} | {s['max_rotations']} | {fmt(s['kl_mean'])} | {fmt(s['kl_max'])} | "
                     f"{fmt(s['kl_mean_last_quarter'])} | {fmt(s['max_abs_mean'])} | {fmt(s['max_abs_max'])} | "
                     f"{s['top1_agree']:.3f} | {s['dnll_mean']:+.4f} |")
        if "oracle" in mod:
            L += ["", f"Float32 stream vs the float64 rank oracle, first {mod['oracle']['tokens']} tokens:", "",
                  "| config / policy | max-abs logits | KL max |", "|---|---|---|"]
            for key, o in mod["oracle"].items():
                if not isinstance(o, dict):
                    continue
                L.append(f"| {key} | {fmt(o['max_abs'])} | {fmt(o['kl_max'])} |")
    return "\n".join(L) + "\n"

