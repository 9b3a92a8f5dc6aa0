"""Weight formats for decode on a CPU, measured side by side: which one reads the fewest bytes fastest.

At batch 1 a decode step reads every weight once, so its time is set by the bytes of weights read and by how
XLA:CPU turns a compact format back into numbers. Formats (each a `matmul(x, w)` the decoder takes,
`Llama.__call__(matmul=...)`, on the same weights):

* dense: float32 weights (the GGUF dequantized at load), `x @ W`.
* blocks: the GGUF's Q4_1 / Q8_0 blocks as int8 codes with float32 scales (rsqr_jax.models.blocks), dequantized
  inside the step, then `x @ W`: the float32 path's logits bit for bit.
* tiled: the same codes in the CPU kernel's layout; decode rows go through rsqr_jax.kernels.block_matvec (each
  code read once, no dequantized matrix; the products summed in another order), a prompt's rows through XLA.
* blocks_mixed: no dequantized matrix: per block of 32 inputs a float32 x int8 dot (`lax.dot_general` with
  mixed operands), scaled and summed over the blocks (the same numbers, summed in another order).
* blocks_int8: llama.cpp's scheme: the activations quantized to int8 per block of 32 (a scale each), an
  int8 x int8 -> int32 dot per block, scaled and summed (not exact: the activations are rounded).

Measured here: one projection (576 -> 1536, the MLP's gate) and the 30-layer stack of projections alone
(`micro`), and whole-model decode at each cached count (`decode`), every format in one process with the
rounds interleaved, so each ratio compares the same machine load. XLA:CPU's library flags (oneDNN, XNNPACK,
YNNPACK) are set per process: `scripts/bench_weights.py --flags` runs the projection benchmark once per flag
set in a child process.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rsqr_jax.eval.runtime import ConfigError, status

FORMATS = ("dense", "blocks", "tiled", "blocks_mixed", "blocks_int8")
# XLA:CPU flag sets tried for the projection benchmark (`--flags`): name -> XLA_FLAGS
FLAG_SETS = {
    "default": "",
    "onednn": "--xla_cpu_use_onednn=true",
    "onednn_fusion": "--xla_cpu_experimental_onednn_fusion_type=dot,eltwise",
    "xnn_fusion": "--xla_cpu_experimental_xnn_fusion_type=dot,eltwise,reduce",
    "ynn_fusion": "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce",
    "no_xnnpack": "--xla_cpu_use_xnnpack=false",
}


def _per_block(w, x):
    """x [..., in] as [nb, ..., 32] (the blocks first, as the dots below batch them) and w's scale / offset
    as [nb, 1..., out]."""
    nb = w.codes.shape[0]
    xb = jnp.moveaxis(x.reshape(x.shape[:-1] + (nb, 32)), -2, 0)
    lift = lambda a: None if a is None else a.reshape((nb,) + (1,) * (x.ndim - 1) + (-1,))  # noqa: E731
    return xb, lift(w.scale), lift(w.offset)


def _blocked_dot(xb, codes, preferred):
    """[nb, ..., 32] x [nb, 32, out] -> [nb, ..., out], batched over the blocks."""
    return jax.lax.dot_general(xb, codes, (((xb.ndim - 1,), (1,)), ((0,), (0,))), preferred_element_type=preferred)


def mixed_matmul(x, w):
    """blocks_mixed: sum_b scale_b (x_b . codes_b) + offset_b sum(x_b), float32 x int8 dots."""
    from rsqr_jax.models.blocks import BlockWeights
    from rsqr_jax.models.llama import dense_matmul

    if not isinstance(w, BlockWeights):
        return dense_matmul(x, w)
    xb, scale, offset = _per_block(w, x.astype(jnp.float32))
    y = jnp.sum(_blocked_dot(xb, w.codes, jnp.float32) * scale, axis=0)
    if offset is not None:
        y = y + jnp.sum(jnp.sum(xb, -1, keepdims=True) * offset, axis=0)
    return y.astype(x.dtype)


def int8_matmul(x, w):
    """blocks_int8: the activations rounded to int8 per block (scale max|x_b| / 127), int8 x int8 -> int32."""
    from rsqr_jax.models.blocks import BlockWeights
    from rsqr_jax.models.llama import dense_matmul

    if not isinstance(w, BlockWeights):
        return dense_matmul(x, w)
    xb, scale, offset = _per_block(w, x.astype(jnp.float32))
    sx = jnp.max(jnp.abs(xb), -1, keepdims=True) / 127.0
    xq = jnp.round(xb / jnp.where(sx > 0, sx, 1.0)).astype(jnp.int8)
    y = jnp.sum(_blocked_dot(xq, w.codes, jnp.int32).astype(jnp.float32) * sx * scale, axis=0)
    if offset is not None:
        y = y + jnp.sum(jnp.sum(xb, -1, keepdims=True) * offset, axis=0)
    return y.astype(x.dtype)


def matmul_of(fmt: str) -> Callable | None:
    """The decoder's matmul for a format (None: the decoder's own, dequantize then dot)."""
    return {"dense": None, "blocks": None, "tiled": None, "blocks_mixed": mixed_matmul, "blocks_int8": int8_matmul}[fmt]


def read_models(path: str, formats) -> dict:
    """The model each format runs on, read once per weight layout: {format: LoadedModel}."""
    from rsqr_jax.models.llama import read_model

    layout = {"dense": "dense", "tiled": "tiled"}
    read = {}
    for f in formats:
        key = layout.get(f, "blocks")
        if key not in read:
            read[key] = read_model(path, "float32", blocks=key != "dense", tiled=key == "tiled")
    return {f: read[layout.get(f, "blocks")] for f in formats}


@dataclasses.dataclass(frozen=True)
class WeightsConfig:
    """formats: FORMATS to compare; cached: tokens in the cache before the timed decode (policy `full`);
    new: tokens decoded per measurement; rounds: interleaved measurements per format (the best is reported);
    micro_rounds: of the projection benchmarks; text: the prompt's source."""

    text: str
    formats: tuple[str, ...] = FORMATS
    cached: tuple[int, ...] = (128, 2048)
    new: int = 48
    rounds: int = 3
    micro_rounds: int = 5

    def __post_init__(self):
        bad = [f for f in self.formats if f not in FORMATS]
        if bad or not self.formats:
            raise ConfigError(f"--formats: unknown {','.join(bad) or '(none)'}; choose from {','.join(FORMATS)}")
        if self.new < 1 or self.rounds < 1 or self.micro_rounds < 1 or not self.cached or min(self.cached) < 1:
            raise ConfigError("--new, --rounds, --micro-rounds and --cached must be positive")


def _best_ms(fn, args, rounds: int, repeats: int = 5) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeats):
            jax.block_until_ready(fn(*args))
        out.append(1e3 * (time.perf_counter() - t0) / repeats)
    return out


def micro(models: dict, formats, rounds: int) -> dict:
    """ms per call of one projection (layer 0's MLP gate, one row) and of every layer's seven projections under
    a lax.scan (one row through the stack, as a decode step reads them), per format; rounds interleaved.
    models: {format: LoadedModel} (read_models)."""
    from rsqr_jax.models.blocks import BlockWeights, StackedLayer
    from rsqr_jax.models.llama import dense_matmul

    names = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    stacks = {f: {n: getattr(models[f].model, n).get_value() for n in names} for f in formats}
    if not all(isinstance(stacks[f]["w_gate"], BlockWeights) for f in formats if f != "dense"):
        raise ConfigError("the model file has no 4- or 8-bit blocks to compare (a GGUF of Q4_0 / Q4_1 / Q8_0)")
    cfg = models[formats[0]].config
    x = jnp.full((1, cfg.hidden_size), 0.01, jnp.float32)

    def chain(x, stack, mm, tiled):
        def body(x, w):
            if tiled:  # the kernel reads the stack in place (as Llama.__call__ passes it)
                w = {n: StackedLayer(a, w) for n, a in stack.items()}
            q, k, v = mm(x, w["wq"]), mm(x, w["wk"]), mm(x, w["wv"])
            h = mm(x, w["w_gate"]) * mm(x, w["w_up"]) * 1e-3
            y = mm(q * 1e-3, w["wo"]) + mm(h, w["w_down"])
            return x + 1e-6 * y + 1e-9 * (jnp.sum(k) + jnp.sum(v)), None
        return jax.lax.scan(body, x, jnp.arange(cfg.num_layers, dtype=jnp.int32) if tiled else stack)[0]

    fns = {}
    for f in formats:
        mm = matmul_of(f) or dense_matmul
        tiled = isinstance(stacks[f]["w_gate"], BlockWeights) and stacks[f]["w_gate"].tiled
        one = (StackedLayer(stacks[f]["w_gate"], jnp.int32(0)) if tiled else
               jax.tree.map(lambda a: a[0], stacks[f]["w_gate"]))
        fns[f] = (jax.jit(lambda x, w, mm=mm: mm(x, w)), (x, one),
                  jax.jit(lambda x, s, mm=mm, tiled=tiled: chain(x, s, mm, tiled)), (x, stacks[f]))
        for fn, args in ((fns[f][0], fns[f][1]), (fns[f][2], fns[f][3])):
            jax.block_until_ready(fn(*args))  # compile
    one_ms, stack_ms = {f: [] for f in formats}, {f: [] for f in formats}
    for _ in range(rounds):
        for f in formats:
            one_ms[f] += _best_ms(fns[f][0], fns[f][1], 1, repeats=50)
            stack_ms[f] += _best_ms(fns[f][2], fns[f][3], 1)
    return {"projection_ms": {f: min(v) for f, v in one_ms.items()},
            "stack_ms": {f: min(v) for f, v in stack_ms.items()},
            "projection_shape": list(stacks[formats[0]]["w_gate"].shape[1:]),
            "bytes": {f: int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(stacks[f]))) for f in formats}}


def decode(models: dict, config: WeightsConfig, ids: list[int]) -> list[dict]:
    """Whole-model greedy decode at each cached count (policy `full`), ms per token per format (best of the
    interleaved rounds), and each format's greedy tokens compared with dense's. models: {format: LoadedModel}."""
    from rsqr_jax import policy as P
    from rsqr_jax.models.llama import split_apply
    from rsqr_jax.session import Session
    from rsqr_jax.spec import CacheSpec

    rows = []
    fns = {f: split_apply(models[f].model, matmul=matmul_of(f)) for f in config.formats}
    dims = models[config.formats[0]].config
    for cached in config.cached:
        pol = P.full()
        spec = CacheSpec.for_policies(pol, dims=dims, max_chunk=64,
                                      max_len=-(-(cached + config.new + 8) // 64) * 64)
        new_session = lambda f: Session(*fns[f], spec, pol, prefill_chunk=64)  # noqa: E731
        for f in config.formats:  # compile and first execution, untimed
            s = new_session(f)
            s.feed(ids[:64])
            s.generate(2)
        ms, toks = {f: [] for f in config.formats}, {}
        for _ in range(config.rounds):
            for f in config.formats:
                s = new_session(f)
                s.feed(ids[:cached])
                t0 = time.perf_counter()
                toks[f] = s.generate(config.new)
                ms[f].append(1e3 * (time.perf_counter() - t0) / config.new)
        row = {"cached": cached, "ms_per_token": {f: min(v) for f, v in ms.items()},
               "ms_all": ms, "tok_s": {f: 1e3 / min(v) for f, v in ms.items()},
               "same_tokens_as_dense": {f: toks[f] == toks.get("dense", toks[f]) for f in config.formats},
               "loadavg_1min": os.getloadavg()[0]}
        rows.append(row)
        status("weights: C=" + str(cached) + " " + ", ".join(f"{f} {row['tok_s'][f]:.1f} tok/s" for f in config.formats))
    return rows


def markdown(result: dict) -> str:
    """The benchmark's tables: projections (ms, and the ratio to dense), then decode (tok/s, ratio)."""
    fm = result["config"]["formats"]
    lines = []
    for flags, m in result["micro"].items():
        lines += [f"Projections alone, XLA flags `{flags}` (ms; ratio to dense):", "",
                  "| format | bytes read (MiB) | one projection " + "x".join(map(str, m["projection_shape"])) +
                  " | the 30-layer stack |", "|---|---|---|---|"]
        for f in fm:
            if f in m["stack_ms"]:
                lines.append(f"| {f} | {m['bytes'][f] / 2**20:.0f} | {m['projection_ms'][f]:.3f} "
                             f"({m['projection_ms'][f] / m['projection_ms']['dense']:.2f}x) | {m['stack_ms'][f]:.2f} "
                             f"({m['stack_ms'][f] / m['stack_ms']['dense']:.2f}x) |")
        lines.append("")
    if result["decode"]:
        lines += ["Whole-model greedy decode, policy full (tok/s; speed-up over dense; same greedy tokens as dense):",
                  "", "| cached | " + " | ".join(fm) + " |", "|---" * (len(fm) + 1) + "|"]
        for r in result["decode"]:
            cells = [f"{r['tok_s'][f]:.1f} ({r['ms_per_token']['dense'] / r['ms_per_token'][f]:.2f}x"
                     f"{'' if r['same_tokens_as_dense'][f] else ', tokens differ'})" for f in fm]
            lines.append(f"| {r['cached']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
