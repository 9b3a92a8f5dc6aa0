"""Shared pieces of the streaming-perplexity experiments (exp_policies.py, exp_ppl.py): policy batches
streamed in one vmapped `stream_nll` call, single-policy runs, the torch reference, summaries, timing."""

from __future__ import annotations

import math
import sys
import time

import numpy as np

from _common import REPO_ROOT, status


class Timer:
    """Wall and process-CPU seconds of a block (CPU time counts every thread of this process)."""

    def __enter__(self):
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.w0
        self.cpu = time.process_time() - self.c0



def block_bootstrap(x, block: int, n: int = 2000, seed: int = 0) -> list[float]:
    """95% interval of the mean of x by resampling contiguous blocks (neighbouring tokens are dependent)."""
    nb = len(x) // block
    if nb < 2:
        return [float("nan"), float("nan")]
    means = x[:nb * block].reshape(nb, block).mean(1)
    rng = np.random.default_rng(seed)
    boots = means[rng.integers(0, nb, size=(n, nb))].mean(1)
    return [float(v) for v in np.percentile(boots, [2.5, 97.5])]

class Interrupted(Exception):
    """SIGTERM/SIGINT during a run; `partial` holds {key: NLL scored so far} of the interrupted batch."""

    def __init__(self, partial: dict, timing: dict):
        super().__init__("interrupted")
        self.partial, self.timing = partial, timing


def stream_policies(loaded, apply_fn, params, ids, policies: dict, *, chunk: int = 1, segment: int = 256,
                    label: str = "", piece_segments: int = 8) -> tuple[dict, dict]:
    """Stream the token ids through every policy of {key: Policy} in ONE vmapped stream_nll evaluation (one
    compilation, weights shared). Returns ({key: per-token NLL float64 [T-1]}, timing dict).

    The stream is fed in pieces of piece_segments * segment scored tokens, the cache carried from piece to
    piece (exactly the same computation: only the last piece is padded); an interruption (KeyboardInterrupt,
    which the scripts raise on SIGTERM) raises Interrupted with the NLL of the pieces already done."""
    from rsqr_jax import policy as P
    from rsqr_jax.spec import CacheSpec
    from rsqr_jax.engine import stream_nll

    cfg = loaded.config
    keys = list(policies)
    pols = [policies[k] for k in keys]
    vmap = len(pols) > 1
    batch = P.stack_policies(pols) if vmap else pols[0]
    spec = CacheSpec.for_policies(pols, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                  head_dim=cfg.head_dim, dtype=loaded.dtype, max_chunk=chunk, max_len=len(ids))
    n = len(ids) - 1
    piece = max(1, piece_segments) * segment
    t_seg = [time.perf_counter()]
    done_before = [0]

    def progress(done):
        t_seg.append(time.perf_counter())
        dt = t_seg[-1] - t_seg[-2]
        status(f"  [{label}] {done_before[0] + done}/{n} tokens ({dt:.1f}s for the last segment)")

    def timing(tm, scored):
        seg_times = np.diff(t_seg)
        steady = float(np.median(seg_times[1:])) / segment if len(seg_times) > 2 else None
        return {"label": label, "policies": keys, "dtype": loaded.dtype, "chunk": chunk, "tokens": scored + 1,
                "wall_s": tm.wall, "cpu_s": tm.cpu,
                "first_segment_s": float(seg_times[0]) if len(seg_times) else None, "steady_s_per_token": steady}

    def as_dict(parts):
        if not parts:
            return {k: np.zeros(0) for k in keys}
        nll = np.concatenate([np.asarray(x, np.float64) for x in parts], axis=-1)
        nll = nll[:, 0] if vmap else nll[None, 0]
        return {k: nll[i] for i, k in enumerate(keys)}

    status(f"[{label}] {len(keys)} polic{'ies' if vmap else 'y'} ({', '.join(keys)}), {loaded.dtype}, "
           f"chunk {chunk}, {len(ids)} tokens")
    parts, cache = [], None
    with Timer() as tm:
        try:
            for a in range(0, n, piece):
                b = min(a + piece, n)
                done_before[0] = a
                nll, cache = stream_nll(apply_fn, params, np.asarray([ids[a:b + 1]]), batch, spec, chunk=chunk,
                                        segment=segment, progress=progress, vmap_policies=vmap, cache=cache)
                parts.append(nll)
        except KeyboardInterrupt:
            tm.__exit__()
            scored = sum(np.shape(x)[-1] for x in parts)
            status(f"[{label}] interrupted after {scored} scored tokens")
            raise Interrupted(as_dict(parts), timing(tm, scored)) from None
    out = as_dict(parts)
    tmg = timing(tm, n)
    status(f"[{label}] done in {tm.wall:.0f}s wall, {tm.cpu:.0f}s CPU"
           + (f"; steady {1000 * tmg['steady_s_per_token']:.0f} ms/token (wall)" if tmg["steady_s_per_token"] else ""))
    return out, tmg


def hf_reference_nll(model_path: str, ids, *, chunk: int = 512) -> tuple[np.ndarray, dict]:
    """Per-token NLL [T-1] of HF transformers' own float32 model (torch, eager, full attention) of the same
    GGUF weights (tests/hf_fixtures.hf_gguf_model), fed in chunks with past_key_values."""
    import torch

    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from hf_fixtures import hf_gguf_model

    with Timer() as tm:
        model = hf_gguf_model(model_path)
        x = torch.as_tensor(np.asarray([ids], np.int64))
        n = x.shape[1] - 1
        past, out = None, []
        with torch.no_grad():
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                res = model(input_ids=x[:, s:e], past_key_values=past, use_cache=True)
                past = res.past_key_values
                logp = torch.log_softmax(res.logits.to(torch.float32), dim=-1)
                out.append(-logp.gather(-1, x[:, s + 1:e + 1, None])[0, :, 0].numpy())
                status(f"  [hf] {e}/{n} tokens")
    nll = np.concatenate(out).astype(np.float64)
    return nll, {"label": "hf", "wall_s": tm.wall, "cpu_s": tm.cpu, "chunk": chunk, "tokens": len(ids),
                 "torch_threads": torch.get_num_threads()}


def ppl(nll) -> float:
    return float(math.exp(float(np.mean(nll))))


def ppl_curve(nll, bucket: int) -> list[dict]:
    """Perplexity of each consecutive bucket of scored tokens (the last one may be shorter)."""
    return [{"start": s, "end": min(s + bucket, len(nll)), "ppl": ppl(nll[s:s + bucket])}
            for s in range(0, len(nll), bucket)]


def check_finite(key: str, nll) -> None:
    if not np.all(np.isfinite(nll)):
        raise RuntimeError(f"{key}: non-finite NLL (numerical failure)")
