"""The GPU check of pallas_kernels.survivor_attention (scripts/gpu_check.py): correctness first, then
device-side timing. Sections, in order (each guarded: a failure is recorded in the JSON, not fatal):

1. Correctness: the compiled kernel against the pure-jnp reference and the float64 oracle of DESIGN.md
   section 6 (`rsqr_jax.testing.kernel`) - float32 and bfloat16, decode and chunks, GQA 9/3, D 64/128,
   S = 0, W = 1, empty window, a realistic size with the default blocks and splits. If the exact
   (integer) angle reduction fails to compile, the float32-angle variant is tried and recorded.
2. Copy bandwidth (x -> x + 1 over 1 GiB), the yardstick for "fraction of achievable bandwidth".
3. Timing, bfloat16, C = 1, Hq = 9, Hkv = 3, D = 64 (SmolLM2), caches N = 4k..128k, batch 1..64,
   S/N = 1/8 survivors: the kernel; (a) the XLA reference and the lean XLA path; (b)
   jax.experimental.pallas.ops.gpu.decode_attention over N pre-rotated keys; (c) StreamingLLM (all N
   keys raw: the same kernel with W = 0, and XLA rotate-then-attend). Device-side timing: each path
   runs `reps` times inside one jitted lax.fori_loop whose carry feeds a data-dependent zero into q
   and into the position arrays (so XLA can hoist nothing out of the loop); median of several such
   loops after warm-up, divided by reps. "loop_overhead" is the same loop around an empty body: per-call
   times near it are launch-bound, not kernel-bound.
4. If time is left: a small block_k / num_warps / num_splits sweep at one size.

`run_check(out_dir, smoke=..., budget_s=...)` runs them all and returns the exit status (1 if correctness
failed); `smoke` = tiny sizes with interpret=True (proves the code runs on CPU).
"""

from __future__ import annotations

import inspect
import json
import os
import statistics
import sys
import time
import traceback
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.rope import rope_cos_sin, rotate_half_split
from pallas_kernels.survivor_attention import (
    MASK_VALUE,
    survivor_attention,
    survivor_attention_reference,
    survivor_attention_xla,
)
from rsqr_jax.testing.kernel import args_of, decode_step_args, kernel_inputs, oracle_f64, rel_err, rope_inv_freq

ROPE_BASE = 100000.0  # SmolLM2 rope_theta


class CheckRun:
    """The state of one check: its results dict (written as gpu_check.json) and its clock."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.t_start = time.time()
        self.results: dict = {"sections": {}}

    def elapsed(self) -> float:
        return time.time() - self.t_start

    def log(self, *a) -> None:
        print(f"[{self.elapsed():6.1f}s]", *a, flush=True)

    def save(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, "gpu_check.json"), "w") as fh:
            json.dump(self.results, fh, indent=1, default=str)


# --------------------------------------------------------------------------------------------------
# 1. correctness
# --------------------------------------------------------------------------------------------------
def correctness(run, interpret, smoke):
    f32, bf16 = jnp.float32, jnp.bfloat16
    # name: (B, C, Hq, Hkv, D, W, S, dtype, input kwargs, kernel kwargs)
    cases = {
        "decode_gqa_f32": (2, 1, 9, 3, 64, 40, 23, f32, {"empty_window": 3}, dict(block_k=16, num_splits=2)),
        "decode_gqa_bf16": (2, 1, 9, 3, 64, 50, 30, bf16, {"empty_window": 2}, dict(block_k=16, num_splits=2)),
        "chunk_d128_f32": (1, 5, 3, 1, 128, 37, 11, f32, {}, dict(block_k=16, num_splits=2)),
        "chunk_rows_blocks_bf16": (1, 8, 6, 2, 64, 45, 9, bf16, {"empty_window": 5}, dict(block_k=16, block_q=16)),
        "no_survivors_f32": (2, 1, 3, 1, 64, 29, 0, f32, {}, dict(block_k=16, num_splits=2)),
        "window_of_one_f32": (1, 1, 3, 3, 64, 1, 21, f32, {}, dict(block_k=16)),
        "window_empty_f32": (1, 2, 9, 3, 64, 24, 18, f32, {"all_window_empty": True}, dict(block_k=16)),
        "nothing_visible_f32": (1, 1, 3, 1, 64, 17, 5, f32, {"all_window_empty": True, "surv_invalid_frac": 1.1},
                                dict(block_k=16)),
    }
    if not smoke:
        cases.update({
            "default_blocks_bf16": (4, 1, 9, 3, 64, 3584, 512, bf16, {"empty_window": 100}, {}),
            "default_blocks_f32": (2, 1, 9, 3, 64, 3000, 700, f32, {"empty_window": 100}, {}),
            "chunk16_default_bf16": (2, 16, 9, 3, 64, 1024, 256, bf16, {}, {}),
            "d128_default_bf16": (2, 1, 8, 2, 128, 2048, 300, bf16, {}, {}),
        })
    rows, ok = [], True
    exact_mode = None
    for name, (B, C, Hq, Hkv, D, W, S, dtype, ikw, kkw) in cases.items():
        args, inv = kernel_inputs(zlib.crc32(name.encode()), B=B, C=C, Hq=Hq, Hkv=Hkv, D=D, W=W, S=S, dtype=dtype,
                                  rope_base=ROPE_BASE, **ikw)
        args = args_of(args)
        row = {"case": name}
        try:
            try:
                out = jax.block_until_ready(
                    survivor_attention(*args, inv, interpret=interpret, exact_angles=exact_mode, **kkw))
            except Exception as e:  # exact angle reduction did not compile: record, fall back
                if exact_mode is not None:
                    raise
                run.log(f"  {name}: exact-angle kernel failed ({type(e).__name__}: {str(e)[:300]}); "
                    "retrying with float32 angles")
                run.results["exact_angle_failure"] = traceback.format_exc()[-4000:]
                exact_mode = False
                out = jax.block_until_ready(
                    survivor_attention(*args, inv, interpret=interpret, exact_angles=False, **kkw))
            ref = jax.jit(lambda *a: survivor_attention_reference(*a, inv))(*args)
            xla = jax.jit(lambda *a: survivor_attention_xla(*a, inv))(*args)
            o64 = oracle_f64(*args, inv)
            out64 = np.asarray(out, np.float64)
            row.update(finite=bool(np.isfinite(out64).all()), err_kernel_f64=rel_err(out, o64),
                       err_ref_f64=rel_err(ref, o64), err_xla_f64=rel_err(xla, o64),
                       err_kernel_ref=rel_err(out, ref))
            if name.startswith("nothing_visible"):
                passed = row["finite"] and (out64 == 0).all()
            else:
                tol = 1e-4 if dtype == f32 else 2e-2
                if exact_mode is False:
                    tol = max(tol, 2e-3)
                passed = row["finite"] and row["err_kernel_f64"] < tol and row["err_kernel_ref"] < max(tol, 1e-5)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:3000]
            row["traceback"] = traceback.format_exc()[-4000:]
            passed = False
        row["pass"] = bool(passed)
        ok &= row["pass"]
        rows.append(row)
        run.log(f"  {'PASS' if row['pass'] else 'FAIL'} {name}: "
            + ", ".join(f"{k}={v:.2e}" for k, v in row.items() if k.startswith("err_"))
            + (f" ERROR {row['error'][:500]}" if "error" in row else ""))
    run.results["exact_angles"] = exact_mode is None
    return ok, rows


# --------------------------------------------------------------------------------------------------
# 2./3. device-side timing
# --------------------------------------------------------------------------------------------------
def loop_timer(fn, args, q_idx, pos_idx, reps):
    """jit(fori_loop(reps x fn)) with a data-dependent zero threaded into q and the position args."""

    def run(*a):
        def body(_, carry):
            z, acc = carry
            b = list(a)
            b[q_idx] = b[q_idx] + z.astype(b[q_idx].dtype)
            for i in pos_idx:
                b[i] = b[i] + z
            out = fn(*b)
            s = jnp.sum(out.astype(jnp.float32))
            return (s > 1e30).astype(jnp.int32), acc + s

        return lax.fori_loop(0, reps, body, (jnp.int32(0), jnp.float32(0)))

    return jax.jit(run)


def device_time(fn, args, q_idx, pos_idx, est_s, target_s, trials):
    """Median seconds per call of fn(*args), measured as jitted loops of `reps` calls on the device.

    reps comes from an a-priori estimate (est_s, from bytes / bandwidth) so each path compiles once."""
    reps = int(min(1000, max(3, target_s / max(est_s, 1e-6))))
    fr = loop_timer(fn, args, q_idx, pos_idx, reps)
    jax.block_until_ready(fr(*args))  # compile
    jax.block_until_ready(fr(*args))  # warm-up
    ts = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(fr(*args))
        ts.append((time.perf_counter() - t0) / reps)
    return statistics.median(ts), reps


def copy_bandwidth(interpret, smoke):
    n = (1 << 20) if smoke else (1 << 29)  # float16 elements: 2 MiB / 1 GiB
    x = jnp.ones((n,), jnp.float16)

    def step(x):
        return x + jnp.float16(1)

    def run(x, reps):
        return lax.fori_loop(0, reps, lambda _, y: step(y), x)

    f = jax.jit(run, static_argnums=1)
    jax.block_until_ready(f(x, 2))
    reps = 4 if smoke else 20
    jax.block_until_ready(f(x, reps))
    ts = []
    for _ in range(3 if smoke else 7):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, reps))
        ts.append((time.perf_counter() - t0) / reps)
    t = statistics.median(ts)
    return {"bytes_per_iter": 2 * 2 * n, "s_per_iter": t, "GBps": 2 * 2 * n / t / 1e9}


def decode_attention_fn(interpret):
    """jax.experimental.pallas.ops.gpu.decode_attention.mqa over [B*Hkv] rows (GQA without transposes).

    Returns (fn(q [B,1,Hq,D], k, v [B,Hkv,N,D]) -> [B,1,Hq,D], info) or (None, error)."""
    try:
        from jax.experimental.pallas.ops.gpu import decode_attention as da
    except Exception as e:  # noqa: BLE001
        return None, f"import failed: {type(e).__name__}: {e}"
    mqa = getattr(da, "mqa", None)
    if mqa is None:
        return None, "decode_attention has no mqa"
    params = inspect.signature(mqa).parameters
    kw = {k: v for k, v in dict(interpret=interpret).items() if k in params}

    def fn(q, k, v):
        B, C, Hq, D = q.shape
        Hkv, N = k.shape[1], k.shape[2]
        G = Hq // Hkv
        qr = q.reshape(B * Hkv, G, D)  # C == 1
        splits = max(1, min(16, N // 256))
        o = mqa(qr, k.reshape(B * Hkv, N, D), v.reshape(B * Hkv, N, D), k_splits=splits,
                block_k=min(256, N // splits), **kw)
        return o.reshape(B, C, Hq, D)

    return fn, f"decode_attention.mqa kwargs={sorted(kw)}"


def plain_xla(q_rot, k, v, kpos, qpos):
    B, C, Hq, D = q_rot.shape
    Hkv = k.shape[1]
    qg = q_rot.astype(jnp.float32).reshape(B, C, Hkv, Hq // Hkv, D) * D**-0.5
    s = jnp.einsum("bckgd,bknd->bkgcn", qg, k.astype(jnp.float32))
    mask = ((kpos[:, None, :] >= 0) & (kpos[:, None, :] <= qpos[:, :, None]))[:, None, None]
    s = jnp.where(mask, s, MASK_VALUE)
    p = jnp.where(mask, jnp.exp(s - jnp.max(s, -1, keepdims=True)), 0.0)
    o = jnp.einsum("bkgcn,bknd->bkgcd", p, v.astype(jnp.float32)) / jnp.sum(p, -1, keepdims=True)
    return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(B, C, Hq, D).astype(q_rot.dtype)


def timing(run, interpret, smoke, copy_bw, deadline, exact):
    Hq, Hkv, D, frac = 9, 3, 64, 1 / 8
    dtype = jnp.bfloat16
    inv = rope_inv_freq(D, ROPE_BASE)
    if smoke:
        Ns, Bs, target, trials, bw_guess = (256,), (1, 2), 0.002, 2, 1e9
    else:
        Ns, Bs, target, trials, bw_guess = (4096, 16384, 65536, 131072), (1, 8, 64), 0.03, 5, 3e12
    da_fn, da_info = decode_attention_fn(interpret)
    run.results["decode_attention"] = da_info
    kern = dict(interpret=interpret, exact_angles=None if exact else False)
    cos_tab = {}
    rows = []
    for N in Ns:
        for B in Bs:
            if run.elapsed() > deadline:
                run.log(f"  deadline reached, skipping N={N} B={B} and later")
                run.results["timing_truncated"] = True
                return rows
            S = int(N * frac)
            key = jax.random.key(N * 131 + B)
            ks = jax.random.split(key, 4)
            q = jax.random.normal(ks[0], (B, 1, Hq, D), dtype)
            k_all = jax.random.normal(ks[1], (B, Hkv, N, D), dtype)
            v_all = jax.random.normal(ks[2], (B, Hkv, N, D), dtype)
            layout = decode_step_args(q, k_all, v_all, S)
            kpos, rank, qpw, qps = layout["kpos"], layout["rank"], layout["q_pos"], layout["q_rank"]
            rsqr_args, stream_args = layout["rsqr"], layout["stream"]
            if N not in cos_tab:
                ang = np.arange(N, dtype=np.float64)[:, None] * inv.astype(np.float64)
                cos_tab[N] = (jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32))
            ct, st = cos_tab[N]
            kv_bytes = 2 * B * Hkv * N * D * jnp.dtype(dtype).itemsize

            def k_rsqr(*a):
                return survivor_attention(*a, inv, **kern)

            def x_ref(*a):
                return survivor_attention_reference(*a, inv)

            def x_lean(*a):
                return survivor_attention_xla(*a, inv)

            def x_plain(q_, k_, v_, kpos_, qpos_):
                c, s = rope_cos_sin(qpos_, inv)
                return plain_xla(rotate_half_split(q_, c[:, :, None], s[:, :, None]).astype(q_.dtype), k_, v_,
                                 kpos_, qpos_)

            def x_stream(q_, k_, v_, rank_, qrank_, ct_, st_):
                kr = rotate_half_split(k_, ct_[None, None], st_[None, None]).astype(k_.dtype)
                c, s = rope_cos_sin(qrank_, inv)
                return plain_xla(rotate_half_split(q_, c[:, :, None], s[:, :, None]).astype(q_.dtype), kr, v_,
                                 rank_, qrank_)

            # name: (fn, args, q index, position arg indices)
            def empty(q_, *rest):  # the loop's own cost: perturbation, output sum, iteration
                return q_

            paths = {
                "loop_overhead": (empty, rsqr_args, 0, (3, 6)),
                "kernel": (k_rsqr, rsqr_args, 0, (3, 6)),
                "xla_ref": (x_ref, rsqr_args, 0, (3, 6)),
                "xla_lean": (x_lean, rsqr_args, 0, (3, 6)),
                "xla_plain": (x_plain, (q, k_all, v_all, kpos, qpw), 0, (3,)),
                "stream_kernel": (k_rsqr, stream_args, 0, (6,)),
                "stream_xla": (x_stream, (q, k_all, v_all, rank, qps, ct, st), 0, (3,)),
            }
            if da_fn is not None:
                paths["decode_attn"] = (da_fn, (q, k_all, v_all), 0, ())
            row = {"N": N, "batch": B, "S": S, "kv_bytes": kv_bytes, "us": {}, "reps": {}, "errors": {}}
            for name, (fn, args, qi, pi) in paths.items():
                if run.elapsed() > deadline:
                    row["errors"][name] = "skipped: deadline"
                    continue
                try:
                    est = 20e-6 + kv_bytes / bw_guess * (4 if name.startswith(("xla", "stream_xla")) else 1)
                    sec, reps = device_time(fn, args, qi, pi, est, target, trials)
                    row["us"][name] = sec * 1e6
                    row["reps"][name] = reps
                except Exception as e:  # noqa: BLE001
                    row["errors"][name] = f"{type(e).__name__}: {e}"[:1500]
            us = row["us"]
            if "kernel" in us:
                row["kernel_GBps"] = kv_bytes / (us["kernel"] * 1e-6) / 1e9
                row["kernel_bw_frac"] = row["kernel_GBps"] * 1e9 / copy_bw if copy_bw else None
            if "decode_attn" in us:
                row["decode_attn_bw_frac"] = kv_bytes / (us["decode_attn"] * 1e-6) / copy_bw if copy_bw else None
            rows.append(row)
            run.log(f"  N={N:6d} B={B:2d} " + " ".join(f"{k}={v:.1f}us" for k, v in us.items())
                + (f" errors={list(row['errors'])}" if row["errors"] else ""))
            del paths, rsqr_args, stream_args, layout, k_all, v_all
    return rows


def tuning(run, interpret, smoke, deadline, exact):
    """block_k x num_warps x num_splits at one size (kernel only)."""
    if smoke:
        N, B, grid = 256, 1, [(16, None, None, True), (32, None, 2, False)]
    else:
        N, B = 32768, 8
        grid = [(bk, nw, None, skip) for bk in (64, 128, 256) for nw in (4, 8) for skip in (True, False)]
        grid += [(128, 4, ns, True) for ns in (1, 4, 16)]
    Hq, Hkv, D, dtype = 9, 3, 64, jnp.bfloat16
    inv = rope_inv_freq(D, ROPE_BASE)
    S = N // 8
    ks = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(ks[0], (B, 1, Hq, D), dtype)
    k_all = jax.random.normal(ks[1], (B, Hkv, N, D), dtype)
    v_all = jax.random.normal(ks[2], (B, Hkv, N, D), dtype)
    args = decode_step_args(q, k_all, v_all, S)["rsqr"]
    rows = []
    kv_bytes = 2 * B * Hkv * N * D * 2
    for bk, nw, ns, skip in grid:
        if run.elapsed() > deadline:
            break
        kw = dict(interpret=interpret, block_k=bk, num_warps=nw, num_splits=ns, skip_empty_blocks=skip,
                  exact_angles=None if exact else False)
        cfg = {"N": N, "batch": B, "block_k": bk, "num_warps": nw, "num_splits": ns, "skip_empty_blocks": skip}
        try:
            sec, _ = device_time(lambda *a, kw=kw: survivor_attention(*a, inv, **kw), args, 0, (3, 6),
                                 20e-6 + kv_bytes / (1e9 if smoke else 3e12), 0.002 if smoke else 0.03,
                                 2 if smoke else 5)
            rows.append({**cfg, "us": sec * 1e6, "GBps": kv_bytes / sec / 1e9})
            run.log(f"  {cfg}: {sec * 1e6:.1f}us")
        except Exception as e:  # noqa: BLE001
            rows.append({**cfg, "error": f"{type(e).__name__}: {e}"[:800]})
            run.log(f"  {cfg}: ERROR {type(e).__name__}: {str(e)[:300]}")
    return rows


def table(rows, copy_bw):
    cols = ["kernel", "xla_ref", "xla_lean", "decode_attn", "stream_kernel", "stream_xla", "xla_plain",
            "loop_overhead"]
    lines = ["| N | batch | " + " | ".join(f"{c} us" for c in cols)
             + " | kernel/decode_attn | ref/kernel | stream_kernel/kernel | kernel BW frac |",
             "|" + "---|" * (len(cols) + 6)]
    for r in rows:
        us = r["us"]
        g = lambda k: f"{us[k]:.1f}" if k in us else "-"  # noqa: E731
        ratio = lambda a, b: f"{us[a] / us[b]:.2f}" if a in us and b in us else "-"  # noqa: E731
        bw = r.get("kernel_bw_frac")
        lines.append(f"| {r['N']} | {r['batch']} | " + " | ".join(g(c) for c in cols)
                     + f" | {ratio('kernel', 'decode_attn')} | {ratio('xla_ref', 'kernel')} "
                     + f"| {ratio('stream_kernel', 'kernel')} | {'-' if bw is None else f'{bw:.2f}'} |")
    return "\n".join(lines)


def run_check(out_dir: str, *, smoke: bool = False, budget_s: float = 420.0, argv=None) -> int:
    """All four sections; writes out_dir/gpu_check.json after each. Returns 0, or 1 if correctness failed."""
    run = CheckRun(out_dir)
    interpret = True if smoke else None  # None: interpret on CPU, compile on GPU
    run.results["meta"] = {"jax": jax.__version__, "backend": jax.default_backend(),
                           "devices": [str(d) for d in jax.devices()], "smoke": smoke,
                           "argv": sys.argv if argv is None else argv}
    run.log(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
    if not smoke and jax.default_backend() != "gpu":
        run.log("WARNING: no GPU backend; the kernel will run in interpret mode (slow). Use --cpu-smoke.")

    run.log("1. correctness")
    ok, rows = correctness(run, interpret, smoke)
    run.results["sections"]["correctness"] = {"pass": ok, "cases": rows}
    run.save()
    if not ok:
        print("\n" + "!" * 80 + "\nCORRECTNESS FAILED - see gpu_check.json; timings below are NOT trustworthy\n"
              + "!" * 80 + "\n", flush=True)
    exact = run.results.get("exact_angles", True)

    copy_bw = None
    try:
        run.log("2. copy bandwidth")
        cb = copy_bandwidth(interpret, smoke)
        copy_bw = cb["GBps"] * 1e9
        run.results["sections"]["copy_bandwidth"] = cb
        run.log(f"  copy: {cb['GBps']:.0f} GB/s (read + write)")
    except Exception as e:  # noqa: BLE001
        run.results["sections"]["copy_bandwidth"] = {"error": f"{type(e).__name__}: {e}"}
    run.save()

    run.log("3. timing")
    rows = []
    try:
        rows = timing(run, interpret, smoke, copy_bw, budget_s * 0.8, exact)
    except Exception as e:  # noqa: BLE001
        run.results["sections"]["timing_error"] = traceback.format_exc()[-4000:]
        run.log(f"  timing failed: {type(e).__name__}: {e}")
    run.results["sections"]["timing"] = rows
    run.save()

    run.log("4. tuning")
    try:
        run.results["sections"]["tuning"] = tuning(run, interpret, smoke, budget_s, exact)
    except Exception as e:  # noqa: BLE001
        run.results["sections"]["tuning"] = {"error": f"{type(e).__name__}: {e}"}
    run.results["wall_s"] = run.elapsed()
    tab = table(rows, copy_bw)
    run.results["table_md"] = tab
    run.save()

    cases = run.results["sections"]["correctness"]["cases"]
    print()
    print(f"correctness: {'PASS' if ok else 'FAIL'} ({sum(r['pass'] for r in cases)}/{len(cases)} cases); "
          f"exact angles: {exact}; copy bandwidth: {'-' if copy_bw is None else f'{copy_bw / 1e9:.0f} GB/s'}; "
          f"decode_attention: {run.results.get('decode_attention')}")
    print(f"bf16, C=1, Hq=9, Hkv=3, D=64, S/N=1/8; device time per call (us); wrote {out_dir}/gpu_check.json")
    print(tab)
    return 0 if ok else 1
