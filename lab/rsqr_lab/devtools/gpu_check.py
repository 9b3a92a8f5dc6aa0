"""The GPU check of rsqr_jax.kernels.survivor_attention, in three short phases (scripts/gpu_check.sh runs
each in its own process, with its own timeout and JSON file, so a hang or a sticky CUDA error in one
phase loses only that phase):

1. gate (<= 90 s, gate.json): versions, `jax.devices()`; exits at once (status 3) on a non-GPU backend.
   Then one bfloat16 decode case against the float64 oracle, trying kernel variants in turn (defaults,
   branch-free loops, float32 angles, a conservative one) and logging each traceback; the first variant
   that passes is the one the later phases use (fixed for the whole run, never flipped mid-run).
2. correctness (<= 120 s, correctness.json): the kernel against the float64 oracle only (docs/design.md
   §6, `rsqr_lab.testing.kernel`): float32 / bfloat16, decode and chunks, GQA 9/3, head_dim 128
   GQA (Hq 32, Hkv 8), S = 0, W = 0, W = 1, empty windows, nothing visible, realistic sizes with the
   default blocks and splits. Saved after every case.
3. timing (<= 180 s, timing.json, one row at a time): the copy bandwidth (x -> x + 1 over 1 GiB), then
   bfloat16 decode (C = 1, SmolLM2 heads) on HBM-sized caches: each path is timed on the device inside
   one jitted loop that cycles over several copies of the cache (>= 512 MB in all, so the 60 MB L2
   cannot hold them) with a data-dependent zero threaded into q and the positions (nothing can be
   hoisted); the same loop around an empty body is subtracted. Paths: the kernel (its defaults, and at
   the split count given to decode_attention), jax's `decode_attention.mqa` over N pre-rotated keys with
   that split count, plain XLA attention over pre-rotated keys, and the lean XLA rsqr path. Bandwidth =
   K/V bytes / net time, also as a fraction of the measured copy bandwidth.

`run_phase(config)` runs one phase and returns its exit status. `dry_run` = tiny sizes with
interpret=True on any backend (the CPU test of the three phases).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import statistics
import sys
import time
import traceback
import zlib
from pathlib import Path

from rsqr_jax.eval.runtime import ConfigError, write_json_atomic

PHASES = ("gate", "correctness", "timing")
PHASE_BUDGET_S = {"gate": 90, "correctness": 120, "timing": 180}  # the shell's timeouts for each process
ROPE_BASE = 100000.0  # SmolLM2 rope_theta
EXIT_NOT_GPU = 3
L2_DEFEAT_BYTES = 512e6  # distinct K/V bytes each timed loop cycles over (H200 L2: 60 MB)

# name: kernel keyword arguments, tried in this order by the gate
VARIANTS = (
    ("default", {}),
    ("branch_free", {"skip_empty_blocks": False}),
    ("float32_angles", {"exact_angles": False}),
    ("conservative", {"exact_angles": False, "skip_empty_blocks": False, "num_stages": 1, "num_warps": 4}),
)


@dataclasses.dataclass(frozen=True)
class GpuCheckConfig:
    phase: str
    out_dir: str
    dry_run: bool = False  # tiny sizes, interpret=True, any backend

    def __post_init__(self):
        if self.phase not in PHASES:
            raise ConfigError(f"unknown phase {self.phase!r}; use one of {', '.join(PHASES)}")


@dataclasses.dataclass(frozen=True)
class Case:
    """One correctness case: shapes, K/V dtype, kernel_inputs extras, kernel kwargs (blocks, splits)."""

    name: str
    B: int
    C: int
    Hq: int
    Hkv: int
    D: int
    W: int
    S: int
    dtype: str
    inputs: tuple = ()
    kernel: tuple = ()


GATE_CASE = Case("gate_decode_bf16", 2, 1, 9, 3, 64, 300, 130, "bfloat16", (("empty_window", 40),))
GATE_CASE_DRY = Case("gate_decode_bf16", 1, 1, 9, 3, 64, 40, 23, "bfloat16", (("empty_window", 3),),
                     (("block_k", 16), ("num_splits", 2)))

_SMALL = (("block_k", 16), ("num_splits", 2))
CORRECTNESS_CASES = (
    Case("decode_gqa_f32", 2, 1, 9, 3, 64, 40, 23, "float32", (("empty_window", 3),), _SMALL),
    Case("decode_gqa_bf16", 2, 1, 9, 3, 64, 50, 30, "bfloat16", (("empty_window", 2),), _SMALL),
    Case("decode_d128_gqa_bf16", 2, 1, 32, 8, 128, 70, 40, "bfloat16", (("empty_window", 5),), _SMALL),
    Case("chunk_d128_f32", 1, 5, 3, 1, 128, 37, 11, "float32", (), _SMALL),
    Case("chunk_rows_blocks_bf16", 1, 8, 6, 2, 64, 45, 9, "bfloat16", (("empty_window", 5),),
         (("block_k", 16), ("block_q", 16))),
    Case("no_survivors_f32", 2, 1, 3, 1, 64, 29, 0, "float32", (), _SMALL),
    Case("survivors_only_bf16", 1, 1, 9, 3, 64, 0, 40, "bfloat16", (("surv_invalid_frac", 0.0),), (("block_k", 16),)),
    Case("window_of_one_f32", 1, 1, 3, 3, 64, 1, 21, "float32", (), (("block_k", 16),)),
    Case("window_empty_f32", 1, 2, 9, 3, 64, 24, 18, "float32", (("all_window_empty", True),), (("block_k", 16),)),
    Case("nothing_visible_f32", 1, 1, 3, 1, 64, 17, 5, "float32",
         (("all_window_empty", True), ("surv_invalid_frac", 1.1)), (("block_k", 16),)),
)
CORRECTNESS_CASES_FULL = (  # realistic sizes, the kernel's own blocks and splits
    Case("default_decode_bf16", 4, 1, 9, 3, 64, 3584, 512, "bfloat16", (("empty_window", 100),)),
    Case("default_decode_f32", 2, 1, 9, 3, 64, 3000, 700, "float32", (("empty_window", 100),)),
    Case("default_chunk16_bf16", 2, 16, 9, 3, 64, 1024, 256, "bfloat16"),
    Case("default_d128_gqa_bf16", 2, 1, 32, 8, 128, 2048, 384, "bfloat16"),
    Case("default_d128_chunk8_bf16", 1, 8, 32, 8, 128, 1024, 256, "bfloat16"),
)
CORRECTNESS_CASES_DRY = tuple(c for c in CORRECTNESS_CASES if c.name == "decode_d128_gqa_bf16")

# timing rows: (N cache keys, batch, survivor fraction S/N); SmolLM2 heads Hq 9, Hkv 3, D 64, bfloat16
TIMING_ROWS = ((16384, 16, 1 / 8), (65536, 4, 1 / 8), (65536, 4, 1 / 2), (131072, 1, 1 / 8), (32768, 64, 1 / 8))
TIMING_ROWS_DRY = ((256, 1, 1 / 8),)


class Phase:
    """One phase's state: its JSON (written after every step) and its clock."""

    def __init__(self, config: GpuCheckConfig):
        self.config = config
        self.t0 = time.time()
        self.path = Path(config.out_dir) / f"{config.phase}.json"
        self.results: dict = {"phase": config.phase, "dry_run": config.dry_run, "argv": sys.argv, "done": False}

    def elapsed(self) -> float:
        return time.time() - self.t0

    def log(self, *a) -> None:
        print(f"[{self.config.phase} {self.elapsed():6.1f}s]", *a, flush=True)

    def save(self) -> None:
        self.results["elapsed_s"] = self.elapsed()
        write_json_atomic(self.path, self.results)

    def deadline(self, margin_s: float) -> float:
        return PHASE_BUDGET_S[self.config.phase] - margin_s


def _error(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}


def environment() -> dict:
    """Versions and devices; never raises (a backend that fails to start is recorded)."""
    import jax
    import jaxlib
    import numpy as np

    env = {"python": sys.version.split()[0], "jax": jax.__version__, "jaxlib": jaxlib.__version__,
           "numpy": np.__version__, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS")}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - optional
        env["triton"] = None
    try:
        env["backend"] = jax.default_backend()
        env["devices"] = [{"str": str(d), "kind": d.device_kind, "platform": d.platform,
                           "cores": getattr(d, "core_count", None)} for d in jax.devices()]
    except Exception as e:  # noqa: BLE001 - no backend: the gate reports it and exits
        env["backend"] = None
        env["backend_error"] = f"{type(e).__name__}: {e}"[:2000]
    return env


def kernel_kwargs(variant: dict, extra: dict, interpret: bool) -> tuple[dict, list[str]]:
    """The variant's and case's kwargs that survivor_attention accepts (and the names it dropped)."""
    from rsqr_jax.kernels import survivor_attention

    params = inspect.signature(survivor_attention).parameters
    kw = {**variant, **extra, "interpret": interpret}
    return {k: v for k, v in kw.items() if k in params}, sorted(k for k in kw if k not in params)


def check_case(case: Case, variant: dict, interpret: bool) -> dict:
    """The kernel on one seeded case against the float64 oracle (bf16 2e-2, f32 1e-4; 2e-3 with float32 angles)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rsqr_jax.kernels import survivor_attention
    from rsqr_lab.testing.kernel import args_of, kernel_inputs, oracle_f64, rel_err

    seed = zlib.crc32(case.name.encode())
    row = {"case": case.name, "seed": seed, **{k: getattr(case, k) for k in ("B", "C", "Hq", "Hkv", "D", "W", "S",
                                                                              "dtype")}}
    t0 = time.perf_counter()
    try:
        inp, inv = kernel_inputs(seed, B=case.B, C=case.C, Hq=case.Hq, Hkv=case.Hkv, D=case.D, W=case.W, S=case.S,
                                 dtype=jnp.dtype(case.dtype), rope_base=ROPE_BASE, **dict(case.inputs))
        args = args_of(inp)
        kw, dropped = kernel_kwargs(variant, dict(case.kernel), interpret)
        row["kwargs"], row["dropped_kwargs"] = {k: v for k, v in kw.items() if k != "interpret"}, dropped
        out = np.asarray(jax.block_until_ready(survivor_attention(*args, inv, **kw)), np.float64)
        o64 = oracle_f64(*args, inv)
        row["finite"] = bool(np.isfinite(out).all())
        row["err_kernel_f64"] = rel_err(out, o64) if np.abs(o64).max() > 0 else float(np.abs(out).max())
        if case.name.startswith("nothing_visible"):
            row["pass"] = row["finite"] and bool((out == 0).all())
        else:
            tol = 1e-4 if case.dtype == "float32" else 2e-2
            if kw.get("exact_angles") is False:
                tol = max(tol, 2e-3)
            row["tol"] = tol
            row["pass"] = row["finite"] and row["err_kernel_f64"] < tol
    except Exception as e:  # noqa: BLE001 - recorded; the phase's status says it failed
        row.update(_error(e), **{"pass": False})
    row["s"] = time.perf_counter() - t0
    return row


def _describe(row: dict) -> str:
    if "error" in row:
        return f"FAIL {row['case']}: ERROR {row['error'][:400]}"
    return (f"{'PASS' if row['pass'] else 'FAIL'} {row['case']}: err_kernel_f64={row['err_kernel_f64']:.2e} "
            f"({row['s']:.1f} s)")


def _gate_variant(out_dir: str) -> tuple[str, dict]:
    """The variant the gate chose (default when the gate left no choice on disk)."""
    path = Path(out_dir) / "gate.json"
    if path.is_file():
        gate = json.loads(path.read_text())
        if gate.get("variant"):
            return gate["variant"], dict(gate["variant_kwargs"])
    return VARIANTS[0][0], dict(VARIANTS[0][1])


# --------------------------------------------------------------------------------------------------
# phases
# --------------------------------------------------------------------------------------------------
def gate(ph: Phase) -> int:
    import jax

    ph.results["environment"] = env = environment()
    ph.log(f"python {env['python']}, jax {env['jax']}, jaxlib {env['jaxlib']}, triton {env['triton']}, "
           f"backend {env['backend']}, devices {[d['str'] for d in env.get('devices', [])]}")
    ph.save()
    if env["backend"] != "gpu" and not ph.config.dry_run:
        ph.results["not_gpu"] = env.get("backend_error") or f"backend is {env['backend']!r}, not gpu"
        ph.save()
        ph.log(f"STOP: no GPU backend ({ph.results['not_gpu'][:300]}); nothing else runs")
        return EXIT_NOT_GPU
    case = GATE_CASE_DRY if ph.config.dry_run else GATE_CASE
    interpret = ph.config.dry_run
    ph.results["attempts"] = []
    for name, variant in VARIANTS:
        if ph.elapsed() > ph.deadline(15):
            ph.log("deadline: no further variants")
            break
        row = {"variant": name, **check_case(case, variant, interpret)}
        ph.results["attempts"].append(row)
        ph.save()
        ph.log(f"variant {name}: " + _describe(row))
        if "traceback" in row:
            print(row["traceback"], flush=True)
        if row["pass"]:
            ph.results.update(variant=name, variant_kwargs=variant)
            break
        jax.clear_caches()
    ph.results["pass"] = bool(ph.results.get("variant"))
    ph.results["done"] = True
    ph.save()
    return 0 if ph.results["pass"] else 1


def correctness(ph: Phase) -> int:
    name, variant = _gate_variant(ph.config.out_dir)
    ph.results.update(variant=name, variant_kwargs=variant, cases=[])
    ph.log(f"kernel variant {name} {variant}")
    cases = CORRECTNESS_CASES_DRY if ph.config.dry_run else CORRECTNESS_CASES + CORRECTNESS_CASES_FULL
    for case in cases:
        if ph.elapsed() > ph.deadline(15):
            ph.results.setdefault("skipped", []).append(case.name)
            continue
        row = check_case(case, variant, ph.config.dry_run)
        ph.results["cases"].append(row)
        ph.save()
        ph.log(_describe(row))
    rows = ph.results["cases"]
    ph.results["pass"] = bool(rows) and all(r["pass"] for r in rows) and not ph.results.get("skipped")
    ph.results["done"] = True
    ph.save()
    ph.log(f"{'PASS' if ph.results['pass'] else 'FAIL'}: {sum(r['pass'] for r in rows)}/{len(rows)} cases"
           + (f", skipped (deadline) {ph.results['skipped']}" if ph.results.get("skipped") else ""))
    return 0 if ph.results["pass"] else 1


def loop_seconds(fn, copies, reps_per_copy: int, trials: int, q_idx: int = 0, pos_idx: tuple = ()) -> float:
    """Median device seconds per call of fn over `copies` (tuples of its arguments), timed as one jitted loop.

    Each iteration calls fn once per copy (distinct buffers, so a copy is cold in L2 when it comes round
    again); a data-dependent zero from the previous output is added to q and to the position arguments,
    so no call can be hoisted or overlapped with the next."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def run(copies):
        def body(_, carry):
            z, acc = carry
            for args in copies:
                b = list(args)
                b[q_idx] = b[q_idx] + z.astype(b[q_idx].dtype)
                for i in pos_idx:
                    b[i] = b[i] + z
                s = jnp.sum(fn(*b).astype(jnp.float32))
                z, acc = (s > 1e30).astype(jnp.int32), acc + s
            return z, acc

        return lax.fori_loop(0, reps_per_copy, body, (jnp.int32(0), jnp.float32(0)))

    f = jax.jit(run)
    jax.block_until_ready(f(copies))  # compile
    jax.block_until_ready(f(copies))  # warm
    ts = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(f(copies))
        ts.append((time.perf_counter() - t0) / (reps_per_copy * len(copies)))
    return statistics.median(ts)


def copy_bandwidth(dry_run: bool) -> dict:
    """Read + write bandwidth of x -> x + 1 over 1 GiB of float16 (the yardstick for 'fraction of HBM')."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    n = (1 << 16) if dry_run else (1 << 29)
    x = jnp.ones((n,), jnp.float16)
    reps = 2 if dry_run else 20
    f = jax.jit(lambda x: lax.fori_loop(0, reps, lambda _, y: y + jnp.float16(1), x))
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(3 if dry_run else 5):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append((time.perf_counter() - t0) / reps)
    t = statistics.median(ts)
    return {"bytes_per_iter": 2 * 2 * n, "s_per_iter": t, "GBps": 2 * 2 * n / t / 1e9}


def decode_attention_fn(interpret: bool):
    """jax's Pallas decode_attention.mqa over [B*Hkv] rows (GQA as MQA per KV head, no transposes)."""
    from jax.experimental.pallas.ops.gpu import decode_attention as da

    def fn(q, k, v, *, splits):
        B, C, Hq, D = q.shape
        Hkv, N = k.shape[1], k.shape[2]
        o = da.mqa(q.reshape(B * Hkv, Hq // Hkv, D), k.reshape(B * Hkv, N, D), v.reshape(B * Hkv, N, D),
                   k_splits=splits, block_k=min(128, N // splits), interpret=interpret)
        return o.reshape(B, C, Hq, D)

    return fn


def plain_xla(q_rot, k, v, kpos, qpos):
    """Plain XLA attention over pre-rotated keys (the no-survivor baseline)."""
    import jax.numpy as jnp

    from rsqr_jax.kernels import MASK_VALUE

    B, C, Hq, D = q_rot.shape
    Hkv = k.shape[1]
    qg = q_rot.astype(jnp.float32).reshape(B, C, Hkv, Hq // Hkv, D) * D**-0.5
    s = jnp.einsum("bckgd,bknd->bkgcn", qg, k.astype(jnp.float32))
    mask = ((kpos[:, None, :] >= 0) & (kpos[:, None, :] <= qpos[:, :, None]))[:, None, None]
    s = jnp.where(mask, s, MASK_VALUE)
    p = jnp.where(mask, jnp.exp(s - jnp.max(s, -1, keepdims=True)), 0.0)
    o = jnp.einsum("bkgcn,bknd->bkgcd", p, v.astype(jnp.float32)) / jnp.sum(p, -1, keepdims=True)
    return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(B, C, Hq, D).astype(q_rot.dtype)


def split_count(batch: int, Hkv: int, N: int) -> int:
    """Key splits that give 132 SMs about two programs each, with >= 256 keys per split (a power of two)."""
    want = max(1, math.ceil(2 * 132 / (batch * Hkv)))
    splits = 1 << (want - 1).bit_length()
    return max(1, min(splits, 64, N // 256))


def timing(ph: Phase) -> int:
    import jax
    import jax.numpy as jnp

    from rsqr_jax.kernels import survivor_attention
    from rsqr_jax.kernels import survivor_attention_xla
    from rsqr_jax.kernels.exact_rope import rope_cos_sin, rotate_half_split
    from rsqr_lab.testing.kernel import decode_step_args, rope_inv_freq

    dry = ph.config.dry_run
    name, variant = _gate_variant(ph.config.out_dir)
    ph.results.update(variant=name, variant_kwargs=variant, rows=[])
    try:
        ph.results["copy_bandwidth"] = cb = copy_bandwidth(dry)
        copy_Bps = cb["GBps"] * 1e9
        ph.log(f"copy bandwidth {cb['GBps']:.0f} GB/s (read + write)")
    except Exception as e:  # noqa: BLE001
        ph.results["copy_bandwidth"] = _error(e)
        copy_Bps = None
    ph.save()
    Hq, Hkv, D, dtype = 9, 3, 64, jnp.bfloat16
    inv = rope_inv_freq(D, ROPE_BASE)
    da_fn = decode_attention_fn(interpret=dry)
    target_s, trials = (0.001, 2) if dry else (0.02, 5)
    for N, B, frac in (TIMING_ROWS_DRY if dry else TIMING_ROWS):
        if ph.elapsed() > ph.deadline(25):
            ph.results.setdefault("skipped_rows", []).append([N, B, frac])
            continue
        S = int(N * frac)
        kv_bytes = 2 * B * Hkv * N * D * 2
        n_copies = 1 if dry else int(min(16, max(2, math.ceil(L2_DEFEAT_BYTES / kv_bytes))))
        splits = split_count(B, Hkv, N)
        row = {"N": N, "batch": B, "S": S, "S_over_N": frac, "kv_bytes": kv_bytes, "copies": n_copies,
               "splits": splits, "us": {}, "errors": {}}
        seed = N * 131 + B * 7 + S
        row["seed"] = seed
        keys = jax.random.split(jax.random.key(seed), 1 + 2 * n_copies)
        q = jax.random.normal(keys[0], (B, 1, Hq, D), dtype)
        layouts = []
        for c in range(n_copies):
            k_all = jax.random.normal(keys[1 + 2 * c], (B, Hkv, N, D), dtype)
            v_all = jax.random.normal(keys[2 + 2 * c], (B, Hkv, N, D), dtype)
            layouts.append((k_all, v_all, decode_step_args(q, k_all, v_all, S)))
        kw, dropped = kernel_kwargs(variant, {}, dry)
        kw_j, _ = kernel_kwargs(variant, {"num_splits": splits}, dry)
        rsqr = [lay["rsqr"] for _, _, lay in layouts]
        plain = [(q, k, v, lay["kpos"], lay["q_pos"]) for k, v, lay in layouts]

        def x_plain(q_, k_, v_, kpos_, qpos_):
            c, s = rope_cos_sin(qpos_, inv)
            return plain_xla(rotate_half_split(q_, c[:, :, None], s[:, :, None]).astype(q_.dtype), k_, v_, kpos_, qpos_)

        paths = {  # name: (fn, copies, position argument indices)
            "loop_overhead": (lambda q_, *rest: q_, rsqr, (3, 6)),
            "kernel": (lambda *a: survivor_attention(*a, inv, **kw), rsqr, (3, 6)),
            "kernel_at_splits": (lambda *a: survivor_attention(*a, inv, **kw_j), rsqr, (3, 6)),
            "decode_attn_at_splits": (lambda q_, k_, v_, *rest: da_fn(q_, k_, v_, splits=splits), plain, ()),
            "xla_plain": (x_plain, plain, (3,)),
            "xla_rsqr": (lambda *a: survivor_attention_xla(*a, inv), rsqr, (3, 6)),
        }
        for path, (fn, copies, pos_idx) in paths.items():
            if ph.elapsed() > ph.deadline(15):
                row["errors"][path] = "skipped: deadline"
                continue
            est = 5e-6 + kv_bytes / (1e9 if dry else 3e12) * (4 if path.startswith("xla") else 1)
            reps = max(1, round(target_s / (est * n_copies)))
            try:
                row["us"][path] = loop_seconds(fn, copies, reps, trials, 0, pos_idx) * 1e6
            except Exception as e:  # noqa: BLE001 - recorded per path
                row["errors"][path] = _error(e)["error"]
        us = row["us"]
        base = us.get("loop_overhead", 0.0)
        row["net_us"] = {k: max(v - base, 1e-3) for k, v in us.items() if k != "loop_overhead"}
        row["GBps"] = {k: kv_bytes / (v * 1e-6) / 1e9 for k, v in row["net_us"].items()}
        if copy_Bps:
            row["bw_frac_of_copy"] = {k: v * 1e9 / copy_Bps for k, v in row["GBps"].items()}
        net = row["net_us"]
        if "kernel_at_splits" in net and "decode_attn_at_splits" in net:
            row["kernel_over_decode_attn"] = net["kernel_at_splits"] / net["decode_attn_at_splits"]
        if "kernel" in net and "xla_plain" in net:
            row["kernel_over_xla_plain"] = net["kernel"] / net["xla_plain"]
        ph.results["rows"].append(row)
        ph.save()
        ph.log(f"N={N} B={B} S/N={frac:g} splits={splits} copies={n_copies}: "
               + " ".join(f"{k}={v:.1f}us" for k, v in us.items())
               + (f" errors={list(row['errors'])}" if row["errors"] else ""))
        del layouts, rsqr, plain, paths
        jax.clear_caches()
    ph.results["table_md"] = timing_table(ph.results["rows"])
    ph.results["done"] = True
    ph.save()
    print(ph.results["table_md"], flush=True)
    measured = [r for r in ph.results["rows"] if "kernel" in r["us"]]
    return 0 if measured else 1


def timing_table(rows: list[dict]) -> str:
    cols = ["kernel", "kernel_at_splits", "decode_attn_at_splits", "xla_plain", "xla_rsqr"]
    lines = ["| N | batch | S/N | splits | copies | loop us | " + " | ".join(f"{c} us (net)" for c in cols)
             + " | kernel/decode_attn | kernel/xla_plain | kernel BW / copy BW |",
             "|" + "---|" * (len(cols) + 9)]
    for r in rows:
        net = r["net_us"]
        frac = r.get("bw_frac_of_copy", {}).get("kernel")
        ratio = lambda k: f"{r[k]:.2f}" if k in r else "-"  # noqa: E731
        lines.append(f"| {r['N']} | {r['batch']} | {r['S_over_N']:g} | {r['splits']} | {r['copies']} "
                     f"| {r['us'].get('loop_overhead', float('nan')):.1f} | "
                     + " | ".join(f"{net[c]:.1f}" if c in net else "-" for c in cols)
                     + f" | {ratio('kernel_over_decode_attn')} | {ratio('kernel_over_xla_plain')} "
                     + f"| {'-' if frac is None else f'{frac:.2f}'} |")
    return "\n".join(lines)


def run_phase(config: GpuCheckConfig) -> int:
    """Run one phase; returns its exit status (0 pass, 1 fail, 3 no GPU backend at the gate)."""
    ph = Phase(config)
    ph.save()
    try:
        return {"gate": gate, "correctness": correctness, "timing": timing}[config.phase](ph)
    except Exception as e:  # noqa: BLE001 - the JSON keeps the traceback; the shell goes on to the next phase
        ph.results.update(_error(e))
        ph.save()
        ph.log(f"phase failed: {type(e).__name__}: {e}")
        print(ph.results["traceback"], flush=True)
        return 1


def main(argv: list[str] | None = None) -> int:
    """One phase as a command line: `python -m rsqr_lab.devtools.gpu_check --phase gate --out DIR [--cpu-dry-run]`
    (exit status: 0 pass, 1 fail, 2 bad input, 3 no GPU backend, gate only)."""
    from rsqr_jax.cli.args import Parser

    ap = Parser(prog="gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--phase", required=True, help=" | ".join(PHASES))
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_check"), help="folder for <phase>.json")
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes with interpret=True on any backend")
    args = ap.parse_args(argv)
    return run_phase(GpuCheckConfig(phase=args.phase, out_dir=args.out, dry_run=args.cpu_dry_run))


if __name__ == "__main__":
    from rsqr_jax.cli.args import run_main

    run_main(main)
