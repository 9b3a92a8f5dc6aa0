"""H200 compile report of the fused kernel, made on a machine without a GPU (docs/kernel.md, "GPU / H200").

For each configuration in CONFIGS: lower `survivor_attention` for CUDA under an abstract mesh whose
abstract device says "NVIDIA H200" (jax >= 0.11 refuses to lower Pallas Triton without a GPU or such
a device), take the Triton IR out of the `__gpu$xla.gpu.triton` custom call, compile it to sm_90a with
pip Triton and its bundled ptxas, and read registers, spills, stack and shared memory off `ptxas -v`.
Configurations in DEFAULT must not spill: the exit status is 1 if one does (or fails to compile).

Run through scripts/gpu_compile_check.sh (it builds the Python 3.12 venv with the device's jax and
Triton). By hand, inside that venv, from the root whose kernel is to be checked:

    PYTHONPATH=.:lab python -m rsqr_lab.devtools.compile_report --out runs/gpu_compile [--only a,b] [--json]

Caveat: XLA compiles the same Triton IR with the Triton it bundles, not pip Triton; the numbers are a
close proxy of what the device runs (same IR, same num_warps / num_stages, same ptxas target), not a
copy of it. Imports only jax, numpy and (for compiling) triton; the pure helpers (`parse_ptxas`,
`occupancy`, `gate`) are tested under the CPU venv's jax too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

DEVICE_KIND = "NVIDIA H200"
SM_COUNT = 132  # H200 SXM
CAPABILITY = 90  # ptxas target sm_90a (Triton picks the "a" variant for capability 9.0)
ROPE_BASE = 100000.0  # SmolLM2 rope_theta
TRITON_TARGET_NAME = "__gpu$xla.gpu.triton"

# Hopper per-SM limits (CUDA occupancy rules): 64K 32-bit registers, allocated per warp in units of 256;
# at most 64 warps / 32 blocks per SM; 228 KiB shared memory per SM, 1 KiB of it reserved per block.
_REGS_PER_SM, _REG_UNIT, _MAX_WARPS, _MAX_BLOCKS = 65536, 256, 64, 32
_SMEM_PER_SM, _SMEM_RESERVED = 228 * 1024, 1024


@dataclasses.dataclass(frozen=True)
class Config:
    """One kernel configuration: shapes of one call (decode C = 1, or a prefill chunk) and kernel kwargs."""

    name: str
    what: str
    B: int
    C: int
    Hq: int
    Hkv: int
    D: int
    W: int
    S: int
    dtype: str  # "bfloat16" | "float32"
    kwargs: tuple = ()  # extra survivor_attention keyword arguments, as (name, value) pairs


# SmolLM2-135M: Hq 9, Hkv 3, D 64; a window of 2048 slots and 1024 survivors (the cache sizes the
# experiments use are of this order; registers depend on the tiles, not on W / S beyond block choice).
CONFIGS = (
    Config("smollm_decode_bf16", "SmolLM2 decode, bf16 K/V", 8, 1, 9, 3, 64, 2048, 1024, "bfloat16"),
    Config("smollm_decode_f32", "SmolLM2 decode, f32 K/V", 8, 1, 9, 3, 64, 2048, 1024, "float32"),
    Config("smollm_chunk_bf16", "SmolLM2 16-token chunk, bf16", 2, 16, 9, 3, 64, 2048, 1024, "bfloat16"),
    Config("smollm_chunk_f32", "SmolLM2 16-token chunk, f32", 2, 16, 9, 3, 64, 2048, 1024, "float32"),
    Config("gqa_d128_decode_bf16", "head_dim 128 GQA decode (Hq 32, Hkv 8), bf16", 8, 1, 32, 8, 128, 2048, 1024,
           "bfloat16"),
    Config("window_only_bf16", "SmolLM2 decode, window only (S = 0)", 8, 1, 9, 3, 64, 2048, 0, "bfloat16"),
    Config("survivors_only_bf16", "SmolLM2 decode, survivors only (W = 0: StreamingLLM)", 8, 1, 9, 3, 64, 0, 3072,
           "bfloat16"),
    Config("gqa_d128_decode_bf16_w8", "head_dim 128 GQA decode at num_warps=8", 8, 1, 32, 8, 128, 2048, 1024,
           "bfloat16", (("num_warps", 8),)),
)
# The configurations that must not spill (the SmolLM2 ones and the head_dim-128 decode).
DEFAULT = ("smollm_decode_bf16", "smollm_decode_f32", "smollm_chunk_bf16", "smollm_chunk_f32", "gqa_d128_decode_bf16")
CONFIG_BY_NAME = {c.name: c for c in CONFIGS}


# ----------------------------------------------------------------------------------------------------
# Pure helpers (no jax / triton needed)
# ----------------------------------------------------------------------------------------------------
_PTXAS_PATTERNS = {
    "registers": r"Used (\d+) registers",
    "stack_bytes": r"(\d+) bytes stack frame",
    "spill_store_bytes": r"(\d+) bytes spill stores",
    "spill_load_bytes": r"(\d+) bytes spill loads",
    "ptxas_smem_bytes": r"(\d+) bytes smem",
    "barriers": r"used (\d+) barriers",
}


def parse_ptxas(log: str) -> dict:
    """Numbers of one entry function from `ptxas -v` output; a missing 'Used N registers' is an error."""
    out = {}
    for key, pat in _PTXAS_PATTERNS.items():
        m = re.search(pat, log)
        out[key] = int(m.group(1)) if m else 0
    if not re.search(_PTXAS_PATTERNS["registers"], log):
        raise ValueError(f"no register count in the ptxas output: {log[:300]!r}")
    out["spill_bytes"] = out["spill_store_bytes"] + out["spill_load_bytes"]
    return out


def occupancy(registers: int, num_warps: int, shared_bytes: int) -> dict:
    """Programs (thread blocks) per SM allowed by registers, warps and shared memory; the least wins."""
    regs_per_warp = _REG_UNIT * math.ceil(max(registers, 1) * 32 / _REG_UNIT)
    by_regs = (_REGS_PER_SM // regs_per_warp) // num_warps
    by_warps = _MAX_WARPS // num_warps
    by_smem = _SMEM_PER_SM // (shared_bytes + _SMEM_RESERVED)
    return {"by_registers": by_regs, "by_warps": by_warps, "by_shared": by_smem,
            "programs_per_sm": min(by_regs, by_warps, by_smem, _MAX_BLOCKS)}


def gate(rows: list[dict], default: tuple[str, ...] = DEFAULT) -> list[str]:
    """Why the report fails: each default configuration that spills, failed, or is missing."""
    by_name = {r["name"]: r for r in rows}
    problems = []
    for name in default:
        r = by_name.get(name)
        if r is None:
            problems.append(f"{name}: not compiled")
        elif "error" in r:
            problems.append(f"{name}: {r['error'].splitlines()[0][:200]}")
        elif r["spill_bytes"] > 0:
            problems.append(f"{name}: spills {r['spill_store_bytes']} B stored / {r['spill_load_bytes']} B loaded")
    return problems


def table(rows: list[dict]) -> str:
    """Markdown table of the report rows (a row with an error shows it)."""
    head = ("| config | default | warps | stages | registers | spill st/ld B | stack B | shared B | programs/SM "
            "| grid | waves on 132 SMs | SASS instrs | compile s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        d = "yes" if r["default"] else ""
        if "error" in r:
            lines.append(f"| {r['name']} | {d} | ERROR: {r['error'].splitlines()[0][:120]} |")
            continue
        lines.append(
            f"| {r['name']} | {d} | {r['num_warps']} | {r['num_stages']} | {r['registers']} "
            f"| {r['spill_store_bytes']}/{r['spill_load_bytes']} | {r['stack_bytes']} | {r['shared_bytes']} "
            f"| {r['occupancy']['programs_per_sm']} | {r['programs']} | {r['waves']:.2f} "
            f"| {r.get('sass_instructions') or '-'} | {r['compile_s']:.1f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Lowering (jax) and compiling (triton)
# ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def h200_lowering():
    """Abstract one-device mesh whose device is an H200: lets Pallas Triton lower for CUDA without a GPU."""
    import jax
    from jax.sharding import AbstractDevice, AbstractMesh

    device = AbstractDevice(device_kind=DEVICE_KIND, num_cores=SM_COUNT, platform="gpu")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device)):
        yield


def _inputs(cfg: Config):
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(cfg.dtype)
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    B, C, Hq, Hkv, D, W, S = cfg.B, cfg.C, cfg.Hq, cfg.Hkv, cfg.D, cfg.W, cfg.S
    args = [sds((B, C, Hq, D), dt), sds((B, Hkv, W, D), dt), sds((B, Hkv, W, D), dt), sds((B, W), i32),
            sds((B, Hkv, S, D), dt), sds((B, Hkv, S, D), dt), sds((B, S), i32), sds((B, S), jnp.bool_),
            sds((B, C), i32), sds((B, C), i32)]
    inv_freq = (ROPE_BASE ** (-np.arange(0, D, 2, dtype=np.float64) / D)).astype(np.float32)  # concrete: exact angles
    return args, inv_freq


def triton_calls(cfg: Config) -> list[dict]:
    """Lower cfg for CUDA (H200) and return each Triton custom call's backend config (ir = MLIR bytecode)."""
    import jax

    from rsqr_jax.kernels.survivor_attention import survivor_attention

    args, inv_freq = _inputs(cfg)
    kw = dict(cfg.kwargs)
    fn = jax.jit(lambda *a: survivor_attention(*a, inv_freq, interpret=False, **kw))
    with h200_lowering():
        lowered = fn.trace(*args).lower(lowering_platforms=("cuda",))
    calls = []

    def walk(op):
        for region in op.regions:
            for block in region:
                for child in block:
                    if child.name == "stablehlo.custom_call" and \
                            str(child.attributes["call_target_name"]).strip('"') == TRITON_TARGET_NAME:
                        bc = child.attributes["mhlo.backend_config"]
                        calls.append({
                            "name": str(bc["name"]).strip('"'),
                            "ir": bc["ir"].value_bytes,
                            **{k: int(str(bc[k]).split(":")[0]) for k in
                               ("num_warps", "num_stages", "grid_x", "grid_y", "grid_z")},
                        })
                    walk(child)

    walk(lowered.compiler_ir("stablehlo").operation)
    return calls


def ttir_text(ir_bytes: bytes) -> str:
    """MLIR bytecode of a Triton module (written by jaxlib's MLIR) as text Triton can parse.

    pip Triton's MLIR cannot read jaxlib's bytecode version, so jaxlib (with its Triton dialect) prints it."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jaxlib.triton import dialect as tt_dialect

    ctx = mlir.make_ir_context()
    tt_dialect.register_dialect(ctx)
    with ctx:
        return ir.Module.parse(ir_bytes).operation.get_asm(enable_debug_info=False)


def _ptxas_path() -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(CAPABILITY).path


def compile_ttir(text: str, num_warps: int, num_stages: int, work_dir: str) -> dict:
    """Triton IR text -> sm_90a with pip Triton; ptxas -v numbers, Triton's shared memory, SASS size."""
    import triton
    from triton.backends.compiler import GPUTarget

    path = os.path.join(work_dir, "kernel.ttir")
    with open(path, "w") as fh:
        fh.write(text)
    kernel = triton.compile(path, target=GPUTarget("cuda", CAPABILITY, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = os.path.join(work_dir, "kernel.ptx")
    with open(ptx, "w") as fh:
        fh.write(kernel.asm["ptx"])
    arch = re.search(r"^\.target\s+(\S+)", kernel.asm["ptx"], re.M).group(1)
    ptxas = _ptxas_path()
    # the flags Triton's own make_cubin passes (line info, fmad on, verbose)
    res = subprocess.run([ptxas, "-lineinfo", "-v", f"--gpu-name={arch}", ptx, "-o", ptx + ".o"],
                         capture_output=True, text=True, check=True)
    out = {"arch": arch, "shared_bytes": int(kernel.metadata.shared), **parse_ptxas(res.stderr + res.stdout)}
    cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
    if os.path.exists(cuobjdump):  # SASS instruction count: a size proxy for the survivor-path arithmetic
        sass = subprocess.run([cuobjdump, "-sass", ptx + ".o"], capture_output=True, text=True)
        if sass.returncode == 0:
            out["sass_instructions"] = len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+[^;]*;", sass.stdout))
    return out


def compile_config(cfg: Config, work_dir: str) -> dict:
    """One report row: lower, compile, measure; an exception becomes row['error'] (one line + tail)."""
    row = {"name": cfg.name, "what": cfg.what, "default": cfg.name in DEFAULT,
           **{k: getattr(cfg, k) for k in ("B", "C", "Hq", "Hkv", "D", "W", "S", "dtype")},
           "kwargs": dict(cfg.kwargs)}
    t0 = time.perf_counter()
    try:
        calls = triton_calls(cfg)
        if len(calls) != 1:
            raise RuntimeError(f"expected one Triton custom call, found {len(calls)}")
        call = calls[0]
        res = compile_ttir(ttir_text(call["ir"]), call["num_warps"], call["num_stages"], work_dir)
        programs = call["grid_x"] * call["grid_y"] * call["grid_z"]
        occ = occupancy(res["registers"], call["num_warps"], res["shared_bytes"])
        row.update(num_warps=call["num_warps"], num_stages=call["num_stages"],
                   grid=[call["grid_x"], call["grid_y"], call["grid_z"]], programs=programs, **res, occupancy=occ,
                   waves=programs / (SM_COUNT * max(occ["programs_per_sm"], 1)))
    except Exception as e:  # noqa: BLE001 - recorded per configuration; the gate fails on default ones
        import traceback

        row["error"] = f"{type(e).__name__}: {e}".strip() + "\n" + traceback.format_exc()[-3000:]
    row["compile_s"] = time.perf_counter() - t0
    return row


def versions() -> dict:
    import jax
    import jaxlib

    meta = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": sys.version.split()[0],
            "device_kind": DEVICE_KIND, "capability": CAPABILITY}
    try:
        import triton

        meta["triton"] = triton.__version__
        res = subprocess.run([_ptxas_path(), "--version"], capture_output=True, text=True)
        release = [ln for ln in res.stdout.splitlines() if "release" in ln]
        meta["ptxas"] = "ptxas " + (release[0].split("release")[-1].strip(" ,") if release else res.stdout.strip())
    except Exception as e:  # noqa: BLE001
        meta["triton_error"] = f"{type(e).__name__}: {e}"
    return meta


def _compile_named(name: str, work_dir: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    os.makedirs(work_dir)
    return compile_config(CONFIG_BY_NAME[name], work_dir)


def run(names: tuple[str, ...], out_dir: str | None, log=print, jobs: int = 1) -> dict:
    """Compile each named configuration (in `jobs` worker processes: ptxas and lowering are single-threaded);
    write compile_report.json / .md under out_dir; return the report (rows in the order of names)."""
    t0 = time.perf_counter()
    report = {"meta": versions(), "default": list(DEFAULT), "rows": [], "jobs": jobs}
    with tempfile.TemporaryDirectory(prefix="rsqr_compile_") as tmp:
        os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(tmp, "triton_cache"))
        work = [os.path.join(tmp, n) for n in names]
        if jobs > 1:
            import concurrent.futures
            import multiprocessing

            with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
                rows = ex.map(_compile_named, names, work)
        else:
            rows = map(_compile_named, names, work)
        for name, row in zip(names, rows):
            report["rows"].append(row)
            if "error" in row:
                log(f"  {name}: ERROR {row['error'].splitlines()[0][:300]}")
            else:
                log(f"  {name}: {row['registers']} registers, spills {row['spill_store_bytes']}/"
                    f"{row['spill_load_bytes']} B, shared {row['shared_bytes']} B, "
                    f"{row['occupancy']['programs_per_sm']} programs/SM ({row['compile_s']:.1f} s)")
    report["problems"] = gate(report["rows"], tuple(n for n in DEFAULT if n in names))
    report["pass"] = not report["problems"]
    report["wall_s"] = time.perf_counter() - t0
    report["table_md"] = table(report["rows"])
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        tmp_path = os.path.join(out_dir, "compile_report.json.tmp")
        with open(tmp_path, "w") as fh:
            json.dump(report, fh, indent=1)
        os.replace(tmp_path, os.path.join(out_dir, "compile_report.json"))
        with open(os.path.join(out_dir, "compile_report.md"), "w") as fh:
            fh.write(report["table_md"] + "\n")
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="H200 compile report of the fused kernel (registers, spills, "
                                 "shared memory per configuration); exit 1 on spills in the default ones.")
    ap.add_argument("--out", default=None, help="folder for compile_report.json / .md")
    ap.add_argument("--only", default=None, help="comma-separated configuration names (default: all)")
    ap.add_argument("--list", action="store_true", help="print the configurations and exit")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout (progress to stderr)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes (default 2)")
    args = ap.parse_args(argv)
    if args.list:
        for c in CONFIGS:
            print(f"{c.name:26s} {'default' if c.name in DEFAULT else '       '}  {c.what}")
        return 0
    names = tuple(CONFIG_BY_NAME) if args.only is None else tuple(n.strip() for n in args.only.split(",") if n.strip())
    unknown = [n for n in names if n not in CONFIG_BY_NAME]
    if unknown or not names:
        print(f"compile_report: error: unknown configuration {unknown or args.only!r}; "
              f"known: {', '.join(CONFIG_BY_NAME)}", file=sys.stderr)
        return 2
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else \
        (lambda *a: print(*a, flush=True))
    meta = versions()
    log(f"H200 compile report: jax {meta['jax']}, triton {meta.get('triton')}, {meta.get('ptxas', '')}")
    if args.jobs < 1:
        print(f"compile_report: error: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    report = run(names, args.out, log, jobs=min(args.jobs, len(names)))
    if args.json:
        print(json.dumps({k: v for k, v in report.items() if k != "table_md"}))
    else:
        print()
        print(report["table_md"])
        print()
        print(f"default (must not spill): {', '.join(DEFAULT)}")
        print("PASS" if report["pass"] else "FAIL: " + "; ".join(report["problems"]),
              f"({report['wall_s']:.1f} s{', wrote ' + args.out if args.out else ''})")
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
