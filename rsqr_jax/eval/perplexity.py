"""Streaming perplexity on top of `engine.stream_nll`, shared by eval_stream, exp_policies and exp_ppl: a
batch of policies streamed in ONE vmapped evaluation (one compilation, weights shared), fed in pieces so
an interruption keeps what finished; one policy streamed with its summary."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from rsqr_jax import policy as P
from rsqr_jax.engine import stream_nll
from rsqr_jax.eval.runtime import (ConfigError, Timer, check_stream_shape, portable_path, progress, read_text,
                                   read_tokens, status, write_json_atomic)
from rsqr_jax.eval.stats import check_finite, ppl, ppl_curve
from rsqr_jax.policy import Policy
from rsqr_jax.policy import host_policies
from rsqr_jax.spec import CacheSpec, ColdStore


class Model(NamedTuple):
    """A loaded model as the experiments use it (rsqr_jax never imports `models`: the caller loads it).
    config needs num_layers, num_kv_heads, head_dim; tokenizer needs encode(text, add_special_tokens=)."""

    apply_fn: Callable
    params: Any
    config: Any
    tokenizer: Any
    dtype: str = "float32"
    path: str = ""  # how results name the model ("embedded", or its file)


def cache_spec(model: Model, policies, *, chunk: int, max_len: int, cold: ColdStore = ColdStore()) -> CacheSpec:
    """The smallest cache spec of `model` that holds every policy of `policies` (one or a list), with the
    cold store `cold` (recall tier) when a policy recalls."""
    cfg = model.config
    recalls = any(h["recall_pages"] for h in host_policies(policies))
    return CacheSpec.for_policies(policies, dims=cfg, dtype=model.dtype, max_chunk=chunk, max_len=max_len,
                                  cold=cold if recalls else None)


class Interrupted(KeyboardInterrupt):
    """SIGTERM/SIGINT during `stream_policies`; `partial` holds {key: NLL of the pieces finished} and
    `timing` the timing of the interrupted batch. A KeyboardInterrupt, so a caller that does not keep
    partial results stops as on Ctrl-C."""

    def __init__(self, partial: dict, timing: dict):
        super().__init__("interrupted")
        self.partial, self.timing = partial, timing


def stream_policies(model: Model, ids_T, policies: dict[str, Policy], *, chunk: int = 1, segment: int = 256,
                    label: str = "", piece_segments: int = 8, show_progress: bool = True,
                    cold: ColdStore = ColdStore()) -> tuple[dict, dict]:
    """Stream ids_T through every policy of {key: Policy} in ONE vmapped stream_nll evaluation (with the
    cold store `cold` if a policy recalls). Returns ({key: per-token NLL float64 [T-1]}, timing dict).

    The stream is fed in pieces of piece_segments * segment scored tokens, the cache carried from piece to
    piece (exactly the same computation: only the last piece is padded); an interruption (KeyboardInterrupt;
    see common.sigterm_interrupts) raises Interrupted with the NLL of the pieces already done."""
    keys = list(policies)
    pols = [policies[k] for k in keys]
    vmap = len(pols) > 1
    batch = P.stack_policies(pols) if vmap else pols[0]
    spec = cache_spec(model, pols, chunk=chunk, max_len=len(ids_T), cold=cold)
    n = len(ids_T) - 1
    piece = max(1, piece_segments) * segment
    t_seg = [time.perf_counter()]  # segment end times: first-segment (compile) and steady per-token timing

    def timing(tm, scored):
        seg_s = np.diff(t_seg)
        steady = float(np.median(seg_s[1:])) / segment if len(seg_s) > 2 else None
        return {"label": label, "policies": keys, "dtype": model.dtype, "chunk": chunk, "tokens": scored + 1,
                "wall_s": tm.wall, "cpu_s": tm.cpu,
                "first_segment_s": float(seg_s[0]) if len(seg_s) else None, "steady_s_per_token": steady}

    def as_dict(parts):
        if not parts:
            return {k: np.zeros(0) for k in keys}
        nll_PxBxT = np.concatenate([np.asarray(x, np.float64) for x in parts], axis=-1)
        nll_PxT = nll_PxBxT[:, 0] if vmap else nll_PxBxT[None, 0]
        return {k: nll_PxT[i] for i, k in enumerate(keys)}

    status(f"[{label}] {len(keys)} polic{'ies' if vmap else 'y'} ({', '.join(keys)}), {model.dtype}, "
           f"chunk {chunk}, {len(ids_T)} tokens")
    parts, cache = [], None
    with Timer() as tm, progress(n, label, enabled=show_progress) as bar:
        try:
            for a in range(0, n, piece):
                b = min(a + piece, n)

                def on_segment(done, a=a):
                    t_seg.append(time.perf_counter())
                    bar.update(a + done - bar.n)

                nll, cache = stream_nll(model.apply_fn, model.params, np.asarray([ids_T[a:b + 1]]), batch, spec,
                                        chunk=chunk, segment=segment, progress=on_segment, vmap_policies=vmap,
                                        cache=cache)
                parts.append(nll)
        except KeyboardInterrupt:
            tm.__exit__()
            scored = sum(np.shape(x)[-1] for x in parts)
            status(f"[{label}] interrupted after {scored} scored tokens")
            raise Interrupted(as_dict(parts), timing(tm, scored)) from None
    out, tmg = as_dict(parts), timing(tm, n)
    status(f"[{label}] done in {tm.wall:.0f}s wall, {tm.cpu:.0f}s CPU"
           + (f"; steady {1000 * tmg['steady_s_per_token']:.0f} ms/token (wall)" if tmg["steady_s_per_token"] else ""))
    return out, tmg


# ----------------------------------------------------------------------------------------------------
# One policy over one text (scripts/eval_stream.py).


def check_text(path: str) -> None:
    """Fail (one line) on a text that is missing, empty, unreadable or not UTF-8, before a model is loaded.
    (common.read_text lets UnicodeDecodeError/OSError through; the messages here are eval_stream's.)"""
    try:
        read_text(path)
    except UnicodeDecodeError as e:
        raise ConfigError(f"text file {path} is not UTF-8 (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"cannot read text file {path}: {e.strerror}") from None


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """One policy streamed over the first `tokens` tokens of `text`, `chunk` tokens per step, `segment`
    tokens per jitted call; perplexity curve per `bucket` scored tokens. policy_key: its command-line name."""

    text: str
    policy: Policy
    policy_key: str
    tokens: int = 2048
    chunk: int = 1
    segment: int = 256
    bucket: int = 1000
    cold: ColdStore = ColdStore()

    def __post_init__(self):
        check_stream_shape(self.tokens, self.chunk, self.segment, self.bucket)
        h = self.policy.host()
        if h["mode"] != P.FULL and self.chunk > h["window"]:
            raise ConfigError(f"--chunk {self.chunk} is larger than --window {h['window']}")


@dataclasses.dataclass
class StreamResult:
    """The per-token NLL [T-1] (float64) of one stream and its summary (the eval_stream JSON)."""

    nll: np.ndarray
    summary: dict

    def text(self) -> str:
        s = self.summary
        lines = [f"{s['policy_name']}: ppl {s['ppl']:.4f} over {s['n_scored']} scored tokens ({s['elapsed_s']:.1f}s, "
                 f"{s['tokens_per_s']:.1f} tok/s)"]
        lines += [f"  tokens {c['start']:>6}-{c['end']:<6} ppl {c['ppl']:.3f}" for c in s["curve"]]
        return "\n".join(lines) + "\n"

    def save_nll(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        np.save(path, self.nll.astype(np.float32))

    def write(self, out_dir: str) -> None:
        """OUT/eval_stream.json (the summary), eval_stream.md (the text) and nll.npy (float32)."""
        write_json_atomic(os.path.join(out_dir, "eval_stream.json"), self.summary)
        with open(os.path.join(out_dir, "eval_stream.md"), "w") as f:
            f.write(self.text())
        self.save_nll(os.path.join(out_dir, "nll.npy"))


def run_stream(config: StreamConfig, model: Model, *, check_memory: Callable[[int], None] | None = None,
               show_progress: bool = True) -> StreamResult:
    """Stream config.text through model under config.policy. check_memory(cache bytes) may refuse the
    cache before it is allocated."""
    ids_T = read_tokens(model.tokenizer, config.text, config.tokens)
    policy = config.policy
    spec = cache_spec(model, policy, chunk=config.chunk, max_len=config.tokens, cold=config.cold)
    cache_bytes = spec.bytes_by_part(policy)
    if check_memory is not None:
        check_memory(cache_bytes["total"])
    status(f"{policy.name}, {model.dtype}, chunk {config.chunk}: {config.tokens} tokens of "
           f"{os.path.basename(config.text)}; cache {cache_bytes['total'] / 2**20:.1f} MiB")
    with progress(config.tokens - 1, config.policy_key, enabled=show_progress) as bar:
        t0 = time.perf_counter()
        nll, _ = stream_nll(model.apply_fn, model.params, ids_T[None], policy, spec, chunk=config.chunk,
                            segment=config.segment, progress=lambda done: bar.update(done - bar.n))
        elapsed = time.perf_counter() - t0
    nll = nll[0].astype(np.float64)
    check_finite(config.policy_key, nll)
    summary = {"ppl": ppl(nll), "nll": float(nll.mean()), "n_tokens": config.tokens, "n_scored": int(nll.size),
               "policy": config.policy_key, "policy_name": policy.name, "dtype": model.dtype, "chunk": config.chunk,
               "text": portable_path(config.text), "cache_bytes": cache_bytes, "curve": ppl_curve(nll, config.bucket),
               "elapsed_s": elapsed, "tokens_per_s": nll.size / elapsed, "model": model.path}
    return StreamResult(nll, summary)
