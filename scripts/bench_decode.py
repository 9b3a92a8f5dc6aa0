#!/usr/bin/env python3
"""Decode speed: our jitted Session against HF transformers (torch eager, float32, same weights), one run.

For each cached count C (default 128, 1024, 2048) both decoders prefill a prompt of Frankenstein tokens
(C tokens for `full`; for a bounded --policy, a prompt long enough that the cache *holds* C tokens and
its survivors are full), then greedily decode --new tokens, one token per step, timed end to end (host
round trip of each sampled token included). HF runs its DynamicCache at C cached tokens:
model(ids, past_key_values=..., use_cache=True) in a loop under torch.inference_mode with 2 threads.
Our cache is sized to what the run needs (full: C + new rounded up to 64); the decode step is
compiled ahead of time (Session.warmup), so compile time is reported apart.

    python scripts/bench_decode.py                          # full, C = 128 1024 2048, 50 new tokens
    python scripts/bench_decode.py --policy rsqr --delta 8 --max-survivors 64
    python scripts/bench_decode.py --quick                  # tiny sanity run
    python scripts/bench_decode.py --no-hf --cached 4096    # ours only

HF's weights are ours: a transformers LlamaForCausalLM is built from the loaded config and filled with
the very arrays our model holds (transposed to torch's layout), and the two greedy continuations are
compared token by token as a check.
"""

from __future__ import annotations

import json
import os
import platform
import time

from _common import (DEFAULT_TEXT, Parser, UsageError, add_model_args, add_policy_args, check_model_args,
                     load_model_from_args, run_main, status)


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--cached", type=int, nargs="+", default=[128, 1024, 2048], help="cached-token counts")
    p.add_argument("--new", type=int, default=50, help="new greedy tokens timed per measurement")
    p.add_argument("--repeats", type=int, default=2, help="measurements per row and side (best is reported)")
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="torch threads for HF")
    p.add_argument("--single-thread", action="store_true",
                   help="one core for both sides (the process is pinned to one CPU; torch 1 thread): "
                   "robust on a busy machine")
    p.add_argument("--no-hf", action="store_true", help="skip HF (ours only)")
    p.add_argument("--quick", action="store_true", help="tiny run: C = 64 128, 8 new tokens, 1 repeat")
    p.add_argument("--text", default=str(DEFAULT_TEXT))
    p.add_argument("--out", default="runs/bench_decode.json")
    add_policy_args(p, default_policy="full")
    add_model_args(p)
    return p


def round_up(n: int, m: int = 64) -> int:
    return -(-n // m) * m


def policy_for(args, cached: int):
    """(policy, prompt length): a policy whose cache holds `cached` tokens once the prompt is fed."""
    from rsqr_jax.policy import make_policy

    mode = args.policy
    if mode == "full":
        return make_policy("full"), cached
    n_sink = 0 if mode == "window" else args.sinks
    delta = 0 if mode in ("window", "streamingllm") else args.delta
    surv = min(args.max_survivors, cached // 4) if delta else 0
    window = cached - n_sink - surv
    if window < max(args.prefill_chunk, 1):
        raise UsageError(f"cached {cached} is too small for {mode} with {n_sink} sinks and {surv} survivors")
    pol = make_policy(mode, window=window, n_sink=n_sink, delta=delta, max_survivors=max(surv, 1),
                      block=args.block, overflow=args.overflow)
    # enough tokens that every survivor slot is taken: N + S*delta + W, rounded up to whole chunks
    prompt = n_sink + surv * max(delta, 1) + window if delta else cached + args.prefill_chunk
    return pol, prompt


def read_tokens(tokenizer, path: str, n: int) -> list[int]:
    if not os.path.isfile(path):
        raise UsageError(f"text file not found: {path}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    ids = tokenizer.encode(text[: max(8 * n, 4096)], add_special_tokens=False)
    if len(ids) < n:
        raise UsageError(f"{path} has only {len(ids)} tokens; asked for {n}")
    return ids[:n]


def hf_model_from_ours(loaded):
    """A transformers LlamaForCausalLM holding exactly our float32 weights (eager attention)."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg, m = loaded.config, loaded.model
    if cfg.arch != "llama" or cfg.rope_scaling is not None:
        raise UsageError("the HF comparison supports plain llama models (use --no-hf)")
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                         max_position_embeddings=max(cfg.max_position_embeddings, 1 << 16),
                         tie_word_embeddings=cfg.tie_word_embeddings, attn_implementation="eager")
    model = LlamaForCausalLM(hf_cfg).to(torch.float32).eval()
    w = lambda name: np.asarray(getattr(m, name)[...], np.float32)  # noqa: E731
    t = lambda x: torch.from_numpy(np.array(x, np.float32, copy=True))  # noqa: E731
    sd = {"model.embed_tokens.weight": t(w("embed")), "model.norm.weight": t(w("final_norm"))}
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    stacked = {k: w(k) for k in list(names) + ["attn_norm", "mlp_norm"]}
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        for ours, theirs in names.items():
            sd[pre + theirs + ".weight"] = t(stacked[ours][i].T)
        sd[pre + "input_layernorm.weight"] = t(stacked["attn_norm"][i])
        sd[pre + "post_attention_layernorm.weight"] = t(stacked["mlp_norm"][i])
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = t(w("lm_head").T)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"HF state dict mismatch: missing={missing[:3]} unexpected={unexpected[:3]}")
    model.tie_weights()
    return model


def hf_run(model, prompt: list[int], n_new: int):
    """(prefill_s, decode_s, decode_cpu_s, tokens) for greedy decoding with HF's DynamicCache."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        ids = torch.tensor([prompt], dtype=torch.long)
        t0 = time.perf_counter()
        cache = DynamicCache()
        out = model(ids, past_key_values=cache, use_cache=True)
        nxt = int(out.logits[0, -1].argmax())
        prefill = time.perf_counter() - t0
        toks = []
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(n_new):
            toks.append(nxt)
            out = model(torch.tensor([[nxt]], dtype=torch.long), past_key_values=out.past_key_values, use_cache=True)
            nxt = int(out.logits[0, -1].argmax())
        return prefill, time.perf_counter() - t0, time.process_time() - c0, toks


class Ours:
    """One Session per row (compiled once per cache spec; the compiled steps are reused across repeats)."""

    def __init__(self, args, loaded, apply_fn, params, cached: int):
        from rsqr_jax.spec import CacheSpec
        from rsqr_jax.session import Session

        cfg = loaded.config
        self.policy, self.prompt_len = policy_for(args, cached)
        chunk = args.prefill_chunk
        self.prompt_len = round_up(self.prompt_len, chunk) if args.policy != "full" else self.prompt_len
        max_len = round_up(self.prompt_len + args.new + 1) if args.policy == "full" else 0
        self.spec = CacheSpec.for_policies(self.policy, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                           head_dim=cfg.head_dim, dtype=args.dtype, max_chunk=chunk, max_len=max_len)
        self.make = lambda: Session(apply_fn, params, self.spec, self.policy, prefill_chunk=chunk)  # noqa: E731
        s = self.make()
        s.warmup()
        self.compile_s = s.compile_s
        self._compiled = s._compiled

    def run(self, prompt: list[int], n_new: int):
        s = self.make()
        s._compiled = self._compiled
        t0 = time.perf_counter()
        s.feed(prompt)
        prefill = time.perf_counter() - t0
        c0, t0 = time.process_time(), time.perf_counter()
        toks = s.generate(n_new)
        dt = time.perf_counter() - t0
        return prefill, dt, time.process_time() - c0, toks, s


def main() -> int:
    args = build_parser().parse_args()
    check_model_args(args)
    if args.quick:
        args.cached, args.new, args.repeats = [64, 128], 8, 1
    if args.new < 1 or args.repeats < 1 or min(args.cached) < 1 or args.threads < 1:
        raise UsageError("--new, --repeats, --threads and --cached must be positive")
    if args.single_thread:  # before jax is imported
        # XLA:CPU (jax 0.10) ignores --xla_cpu_multi_thread_eigen=false / intra_op_parallelism_threads=1: a
        # jitted matmul still burns 1.95 CPU-s per wall-s. Pinning the process to one core binds every
        # thread either side starts, so both really run on one core.
        args.threads = 1
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import numpy as np

    import jax
    from rsqr_jax.cache import cached_positions

    rows_meta = [(c,) + policy_for(args, c) for c in args.cached]  # bad policy flags fail before loading

    t0 = time.perf_counter()
    loaded, apply_fn, params = load_model_from_args(args)
    status(f"model {loaded.path} loaded in {time.perf_counter() - t0:.1f}s; policy {args.policy}, "
           f"{args.dtype}, backend {jax.default_backend()}")
    hf = None
    if not args.no_hf:
        if args.dtype != "float32":
            raise UsageError("the HF comparison runs float32 (use --dtype float32 or --no-hf)")
        import warnings

        import torch
        import transformers

        warnings.filterwarnings("ignore", category=FutureWarning)  # past_key_values naming in transformers 5
        transformers.logging.set_verbosity_error()
        torch.set_num_threads(args.threads)
        hf = hf_model_from_ours(loaded)
    n_text = max(round_up(p, args.prefill_chunk) for _, _, p in rows_meta) + 8
    text_ids = read_tokens(loaded.tokenizer, args.text, n_text)

    if hf is not None:  # warm both sides up once (first-call allocations, thread pools)
        hf_run(hf, text_ids[:32], 4)
    rows = []
    for cached in args.cached:
        ours = Ours(args, loaded, apply_fn, params, cached)
        prompt = text_ids[:ours.prompt_len]
        hf_prompt = text_ids[:cached]
        ours.run(prompt[:args.prefill_chunk], 2)  # first execution of the compiled steps, untimed
        o_meas, h_meas = [], []
        for _ in range(args.repeats):  # interleaved, so both sides see the same machine load
            o_pre, o_dt, o_cpu, o_toks, sess = ours.run(prompt, args.new)
            o_meas.append((o_pre, o_dt, o_cpu))
            if hf is not None:
                h_pre, h_dt, h_cpu, h_toks = hf_run(hf, hf_prompt, args.new)
                h_meas.append((h_pre, h_dt, h_cpu))
        n_cached_ours = len(cached_positions(sess.cache, sess.policy)) if args.policy != "full" else None
        o_best = min(d for _, d, _ in o_meas)
        o_cpu = min(c for _, _, c in o_meas)
        row = {"cached": cached, "prompt_tokens_ours": len(prompt), "new_tokens": args.new,
               "policy": sess.policy.name, "win_capacity": ours.spec.win_capacity,
               "surv_capacity": ours.spec.surv_capacity, "compile_s": ours.compile_s,
               "ours_tok_s": args.new / o_best, "ours_ms_per_token": 1e3 * o_best / args.new,
               "ours_tok_s_all": [args.new / d for _, d, _ in o_meas], "ours_prefill_s": min(p for p, _, _ in o_meas),
               "ours_cpu_ms_per_token": 1e3 * o_cpu / args.new,
               "cache_bytes": ours.spec.bytes_by_part(ours.policy)}
        if n_cached_ours is not None:
            row["cached_after_decode_ours"] = n_cached_ours
        if hf is not None:
            h_best = min(d for _, d, _ in h_meas)
            h_cpu = min(c for _, _, c in h_meas)
            row.update(hf_tok_s=args.new / h_best, hf_ms_per_token=1e3 * h_best / args.new,
                       hf_tok_s_all=[args.new / d for _, d, _ in h_meas], hf_prefill_s=min(p for p, _, _ in h_meas),
                       hf_cpu_ms_per_token=1e3 * h_cpu / args.new, ratio=h_best / o_best, cpu_ratio=h_cpu / o_cpu)
            if args.policy == "full":
                agree = np.mean(np.asarray(o_toks) == np.asarray(h_toks[:len(o_toks)]))
                first_diff = next((i for i, (a, b) in enumerate(zip(o_toks, h_toks)) if a != b), None)
                row.update(greedy_agreement=float(agree), first_divergence=first_diff)
        row["loadavg_1min"] = os.getloadavg()[0]
        rows.append(row)
        status(f"C={cached}: ours {row['ours_tok_s']:.1f} tok/s" +
               (f", HF {row['hf_tok_s']:.1f} tok/s, ratio {row['ratio']:.2f}x" if hf is not None else ""))

    print(f"\ndecode speed, {args.new} new greedy tokens, {args.dtype}, policy {args.policy}, "
          f"{os.cpu_count()} CPUs (HF torch threads {args.threads}"
          f"{', pinned to one core' if args.single_thread else ''}); load average {os.getloadavg()[0]:.1f}")
    hdr = f"{'cached':>7} {'ours tok/s':>11} {'ours ms/tok':>12}"
    if hf is not None:
        hdr += f" {'HF tok/s':>9} {'HF ms/tok':>10} {'ours/HF':>8} {'CPU-time ratio':>15} {'greedy agree':>13}"
    print(hdr)
    for r in rows:
        line = f"{r['cached']:>7} {r['ours_tok_s']:>11.1f} {r['ours_ms_per_token']:>12.1f}"
        if hf is not None:
            agree = r.get("greedy_agreement")
            line += (f" {r['hf_tok_s']:>9.1f} {r['hf_ms_per_token']:>10.1f} {r['ratio']:>7.2f}x"
                     f" {r['cpu_ratio']:>14.2f}x "
                     f"{'-' if agree is None else f'{agree:.0%}':>13}")
        print(line)
    result = {"args": {k: v for k, v in vars(args).items()}, "rows": rows,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
                          "backend": jax.default_backend()}}
    if hf is not None:
        import torch
        import transformers

        result["machine"].update(torch=torch.__version__, transformers=transformers.__version__)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    status(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    run_main(main)
