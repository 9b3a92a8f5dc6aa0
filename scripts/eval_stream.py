#!/usr/bin/env python3
"""Streaming perplexity: the NLL of the first N tokens of a text, streamed through the cache.

    python scripts/eval_stream.py --policy full --tokens 2048 --json
    python scripts/eval_stream.py --policy rsqr --tokens 4096 --window 256 --sinks 4 --delta 8 --chunk 1
"""

from __future__ import annotations

import json
import math
import os
import time

from _common import (DEFAULT_TEXT, Parser, UsageError, add_model_args, add_policy_args, check_cache_fits,
                     check_model_args, load_model_from_args, policy_from_args, run_main, status)


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="UTF-8 text file (default: Frankenstein)")
    p.add_argument("--tokens", type=int, default=2048, help="number of tokens to score")
    p.add_argument("--chunk", type=int, default=1, help="tokens per step (1 = exact token-by-token eviction)")
    p.add_argument("--segment", type=int, default=256, help="tokens per jitted call (progress granularity)")
    p.add_argument("--bucket", type=int, default=1000, help="tokens per point of the perplexity curve")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--save-nll", default=None, metavar="PATH", help="write the per-token NLL (float32 .npy)")
    p.add_argument("--no-progress", action="store_true")
    add_policy_args(p, default_policy="rsqr")
    add_model_args(p)
    return p


def read_text(path: str) -> str:
    """The text of a UTF-8 file; UsageError (one line) if missing, unreadable, not UTF-8 or empty."""
    if not os.path.isfile(path):
        raise UsageError(f"text file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise UsageError(f"text file {path} is not UTF-8 (byte {e.start})") from None
    except OSError as e:
        raise UsageError(f"cannot read text file {path}: {e.strerror}") from None
    if not text.strip():
        raise UsageError(f"text file {path} is empty")
    return text


def read_tokens(tokenizer, path: str, n: int) -> list[int]:
    """The first n tokens of a text file (tokenizing only as much text as needed)."""
    text = read_text(path)
    chars = max(8 * n, 4096)
    while True:
        ids = tokenizer.encode(text[:chars], add_special_tokens=False)
        if len(ids) > n or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n:
        raise UsageError(f"{path} has only {len(ids)} tokens; asked for {n}")
    return ids[:n]


def curve(nll, bucket: int) -> list[dict]:
    """Perplexity of each consecutive bucket of scored tokens."""
    out = []
    for s in range(0, len(nll), bucket):
        part = nll[s:s + bucket]
        out.append({"start": s, "end": s + len(part), "ppl": float(math.exp(float(part.mean())))})
    return out


def main() -> int:
    args = build_parser().parse_args()
    check_model_args(args)
    if args.tokens < 2:
        raise UsageError(f"--tokens must be >= 2, got {args.tokens}")
    if args.chunk < 1 or args.segment < 1 or args.segment % args.chunk:
        raise UsageError("--chunk must be >= 1 and divide --segment")
    if args.bucket < 1:
        raise UsageError(f"--bucket must be >= 1, got {args.bucket}")
    read_text(args.text)  # fail before loading the model
    policy = policy_from_args(args)
    if args.policy != "full" and args.chunk > args.window:
        raise UsageError(f"--chunk {args.chunk} is larger than --window {args.window}")

    from rsqr_jax.spec import CacheSpec
    from rsqr_jax.engine import stream_nll

    loaded, apply_fn, params = load_model_from_args(args)
    cfg = loaded.config
    ids = read_tokens(loaded.tokenizer, args.text, args.tokens)
    spec = CacheSpec.for_policies(policy, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                  head_dim=cfg.head_dim, dtype=args.dtype, max_chunk=args.chunk, max_len=args.tokens)
    cache_bytes = spec.bytes_by_part(policy)
    check_cache_fits(cache_bytes["total"])
    status(f"{policy.name}, {args.dtype}, chunk {args.chunk}: {args.tokens} tokens of {os.path.basename(args.text)}; "
           f"cache {cache_bytes['total'] / 2**20:.1f} MiB")

    import numpy as np

    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.tokens - 1, unit="tok", desc=args.policy, leave=False)
    done = [0]

    def progress(n):
        if bar is not None:
            bar.update(n - done[0])
        done[0] = n

    t0 = time.perf_counter()
    nll, _ = stream_nll(apply_fn, params, np.asarray([ids]), policy, spec, chunk=args.chunk, segment=args.segment,
                        progress=progress)
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if args.save_nll:
        os.makedirs(os.path.dirname(os.path.abspath(args.save_nll)), exist_ok=True)
        np.save(args.save_nll, nll[0].astype(np.float32))
    nll = nll[0].astype(np.float64)
    if not np.all(np.isfinite(nll)):
        raise RuntimeError("non-finite NLL: numerical failure")
    ppl = float(math.exp(nll.mean()))
    result = {"ppl": ppl, "nll": float(nll.mean()), "n_tokens": args.tokens, "n_scored": int(nll.size),
              "policy": args.policy, "policy_name": policy.name, "dtype": args.dtype, "chunk": args.chunk,
              "text": os.path.abspath(args.text), "cache_bytes": cache_bytes, "curve": curve(nll, args.bucket),
              "elapsed_s": elapsed, "tokens_per_s": nll.size / elapsed, "model": loaded.path}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{policy.name}: ppl {ppl:.4f} over {nll.size} scored tokens ({elapsed:.1f}s, "
              f"{nll.size / elapsed:.1f} tok/s)")
        for c in result["curve"]:
            print(f"  tokens {c['start']:>6}-{c['end']:<6} ppl {c['ppl']:.3f}")
    return 0


if __name__ == "__main__":
    run_main(main)
