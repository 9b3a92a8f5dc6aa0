"""Decode speed: our Session against HF transformers (torch eager, float32, the same weights), one run.

For each cached count C both decoders prefill a prompt of text tokens (C tokens for `full`; for a bounded
policy, a prompt long enough that the cache *holds* C tokens and its survivors are full), then greedily
decode `new` tokens, timed end to end (ours: Session.generate, compiled blocks of gen_block tokens; HF: its
DynamicCache, one model call per token under torch.inference_mode). Our cache is sized to what the run
needs (full: C + new rounded up to 64); the Session's functions are compiled ahead of time (warmup), so
compile time is reported apart. The HF model holds our very arrays (`hf_model_from_ours`), and for `full`
the two greedy continuations are compared token by token as a check.

Sampling costs (`sampled`): each row also times our Session under a chat sampler (CHAT_SAMPLING: Ollama-like
temperature 0.7, top_k 40, top_p 0.95, min_p 0.05, repeat_penalty 1.1 over the last 64 tokens), with the
same compiled functions as greedy (the settings are data), interleaved with the greedy runs; and the
sampler alone is timed on one row of the model's vocabulary: greedy, the chain, and the former sampler
(a full sort of the vocabulary per token, kept here only as the baseline).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from rsqr_jax.cache import cached_positions
from rsqr_jax.eval.runtime import ConfigError, read_text, read_tokens, status, write_json_atomic
from rsqr_jax.policy import FULL, Policy
from rsqr_jax.sampling import DEFAULT_MAX_CANDIDATES, Sampling, sample
from rsqr_jax.session import Session
from rsqr_jax.spec import CacheSpec
from rsqr_lab.studies import base_policy


@dataclasses.dataclass(frozen=True, eq=False)  # holds a Policy (studies.base_policy)
class BenchConfig:
    """One benchmark: a row per cached count. threads: torch threads for HF. policy: the base each row's policy
    is sized from (its mode, sinks, delta, survivor cap, block and overflow; the window fills the row)."""

    text: str
    cached: tuple[int, ...] = (128, 1024, 2048)
    new: int = 50
    repeats: int = 2  # measurements per row and side (the best is reported)
    prefill_chunk: int = 64
    threads: int = 2
    single_thread: bool = False  # recorded only: the caller pins the process to one core
    policy: Policy = base_policy.field("full")
    dtype: str = "float32"
    sampled: bool = True  # also time the chat sampler (end to end and alone)

    def quick(self) -> "BenchConfig":
        """The small CI run: C = 64 128, 8 new tokens, 1 repeat."""
        return dataclasses.replace(self, cached=(64, 128), new=8, repeats=1)

    @property
    def full(self) -> bool:
        return int(self.policy.mode) == FULL

    def check(self) -> None:
        base_policy.check(self.policy)
        if self.new < 1 or self.repeats < 1 or min(self.cached) < 1 or self.threads < 1:
            raise ConfigError("--new, --repeats, --threads and --cached must be positive")
        for c in self.cached:  # bad policy flags fail before the model loads
            self.policy_for(c)

    def policy_for(self, cached: int) -> tuple[Policy, int]:
        """(policy, prompt length): a policy whose cache holds `cached` tokens once the prompt is fed."""
        if self.full:
            return self.policy, cached
        base = self.policy.settings()  # window has no sinks, window and streamingllm no survivors
        n_sink, delta = base["n_sink"], base["delta"]
        surv = min(base["max_survivors"], cached // 4) if delta else 0
        window = cached - n_sink - surv
        if window < max(self.prefill_chunk, 1):
            raise ConfigError(f"cached {cached} is too small for {base['mode']} with {n_sink} sinks and {surv} "
                              "survivors")
        pol = self.policy.replace(window=window, max_survivors=max(surv, 1))
        # enough tokens that every survivor slot is taken: N + S*delta + W (rounded up to whole chunks later)
        prompt = n_sink + surv * max(delta, 1) + window if delta else cached + self.prefill_chunk
        return pol, prompt


CHAT_SAMPLING = Sampling(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, repeat_last_n=64)


def full_sort_sample(logits_BxV, rng, temperature, top_p):
    """The former sampler (temperature, then a nucleus found by sorting the whole vocabulary): the baseline."""
    scaled = logits_BxV.astype(jnp.float32) / temperature
    sorted_desc = jnp.sort(scaled, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    keep = jnp.cumsum(probs, axis=-1) - probs < top_p
    threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jax.random.categorical(rng, jnp.where(scaled >= threshold, scaled, -jnp.inf), axis=-1)


def sampler_costs(vocab_size: int, repeats: int = 100) -> dict:
    """ms per call of the sampler alone on [1, vocab_size] float32 logits (jitted, best of 3 x repeats), with
    a Session's candidate count unless named otherwise."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (1, vocab_size), jnp.float32) * 3
    key = jax.random.PRNGKey(1)
    ring64 = jax.random.randint(jax.random.PRNGKey(2), (1, 64), 0, vocab_size)
    chain = jax.jit(sample, static_argnums=4)
    C = DEFAULT_MAX_CANDIDATES  # what a Session uses
    cases = {
        "greedy_no_ring": lambda: chain(logits, key, Sampling().values(), ring64[:, :0], C),
        "greedy_ring64_penalties_off": lambda: chain(logits, key, Sampling().values(), ring64, C),
        "greedy_ring64_repeat_penalty": lambda: chain(logits, key, Sampling(repeat_penalty=1.1).values(), ring64, C),
        "chat_chain": lambda: chain(logits, key, CHAT_SAMPLING.values(), ring64, C),
        "chat_chain_64_candidates": lambda: chain(logits, key, CHAT_SAMPLING.values(), ring64, 64),
        "full_sort_former": lambda: jax.jit(full_sort_sample)(logits, key, jnp.float32(0.7), jnp.float32(0.95)),
    }
    out = {}
    for name, fn in cases.items():
        jax.block_until_ready(fn())
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(repeats):
                jax.block_until_ready(fn())
            best = min(best, (time.perf_counter() - t0) / repeats)
        out[name] = 1e3 * best
    return out


def round_up(n: int, m: int = 64) -> int:
    return -(-n // m) * m


# ----------------------------------------------------------------------------------------------------
# The HF side (torch imported lazily: ours-only runs never need it).


def hf_model_from_ours(loaded):
    """A transformers LlamaForCausalLM holding exactly our float32 weights (eager attention).

    `loaded`: the model package's LoadedModel (its .config and the Flax .model's stacked weight arrays)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg, m = loaded.config, loaded.model
    if cfg.arch != "llama" or cfg.rope_scaling is not None:
        raise ConfigError("the HF comparison supports plain llama models (use --no-hf)")
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                         max_position_embeddings=max(cfg.max_position_embeddings, 1 << 16),
                         tie_word_embeddings=cfg.tie_word_embeddings, attn_implementation="eager")
    model = LlamaForCausalLM(hf_cfg).to(torch.float32).eval()
    w = lambda name: np.asarray(m.weight(name), np.float32)  # noqa: E731
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
    import warnings

    import torch
    from transformers import DynamicCache

    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values naming in transformers 5
        t0 = time.perf_counter()
        out = model(torch.tensor([prompt], dtype=torch.long), past_key_values=DynamicCache(), use_cache=True)
        nxt = int(out.logits[0, -1].argmax())
        prefill = time.perf_counter() - t0
        toks = []
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(n_new):
            toks.append(nxt)
            out = model(torch.tensor([[nxt]], dtype=torch.long), past_key_values=out.past_key_values, use_cache=True)
            nxt = int(out.logits[0, -1].argmax())
        return prefill, time.perf_counter() - t0, time.process_time() - c0, toks


# ----------------------------------------------------------------------------------------------------
# The llama.cpp side (llama-cpp-python, an optional dependency: `pip install llama-cpp-python`).


def require_llama_cpp(path: str):
    """The llama_cpp module, checked before any model loads: a one-line error without the package or a GGUF."""
    try:
        import llama_cpp
    except ModuleNotFoundError:
        raise ConfigError("--vs-llama-cpp needs llama-cpp-python: pip install 'rsqr-jax[bench]' "
                          "(or pip install llama-cpp-python)") from None
    if not path.endswith(".gguf"):
        raise ConfigError(f"--vs-llama-cpp needs a GGUF model (llama.cpp reads only GGUF), not {path}")
    return llama_cpp


def llama_cpp_model(path: str, threads: int, n_ctx: int):
    """llama.cpp's own model of the same GGUF file (its own kernels on the file's blocks), `threads` threads."""
    llama_cpp = require_llama_cpp(path)
    return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                           n_batch=512, verbose=False)


def llama_cpp_run(llm, prompt: list[int], n_new: int):
    """(prefill_s, decode_s, decode_cpu_s, tokens) for greedy decoding of the same token ids with llama.cpp."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    nxt = int(llm.sample(temp=0.0))
    prefill = time.perf_counter() - t0
    toks = []
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n_new):
        toks.append(nxt)
        llm.eval([nxt])
        nxt = int(llm.sample(temp=0.0))
    return prefill, time.perf_counter() - t0, time.process_time() - c0, toks


# Runs argv[2:] in a child and writes the child's own peak RSS (KiB, wait4's ru_maxrss) to argv[1]: what
# `/usr/bin/time -f %M` reports, without needing that program.
_RSS_SHIM = """import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def peak_rss(cmd: list[str], env: dict | None = None) -> dict:
    """Peak resident memory (MiB) of `cmd` run to its end (in `env`, default this process's), and its exit status.

    The command is forked by a small interpreter, not by this process: Linux records the memory image a process
    replaces at exec in its peak, and a child forked from this process (which holds a model) starts as a copy
    of it."""
    import subprocess
    import sys
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".rss") as f:
        proc = subprocess.run([sys.executable, "-c", _RSS_SHIM, f.name, *cmd], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=env)
        kib = f.read().strip()
    err = proc.stderr.strip().splitlines()
    return {"peak_rss_mib": int(kib) / 1024 if kib.isdigit() else float("nan"),
            "exit": proc.returncode, "last_stderr": err[-1] if err else ""}


def peak_rss_side_by_side(gguf_path: str, tokenizer, *, text: str, prompt_tokens: int, new: int, threads: int,
                          model_arg: str | None = None, rounds: int = 2) -> dict:
    """Peak RSS (MiB) of the decode command (its defaults: rsqr + recall; plain rsqr; full) and of llama.cpp
    through its Python bindings (context: the model's 8192 positions, as llama-cli's default), each a fresh child
    completing the same prompt (the first `prompt_tokens` tokens of `text`) greedily for `new` tokens; the
    larger peak of `rounds` rounds is kept. The decode command runs twice per round on an empty compilation cache
    of its own (rsqr_jax.host): first compiling its programs (a first run), then loading them (every later run)."""
    import shutil
    import sys
    import tempfile

    ids = tokenizer.encode(read_text(text), add_special_tokens=False)[:prompt_tokens]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(tokenizer.decode(ids))
    common = [sys.executable, "-m", "rsqr_jax.cli.decode", "--raw", "--prompt-file", f.name, "--max-new-tokens",
              str(new), "--temperature", "0"] + (["--model", model_arg] if model_arg else [])
    lcpp = (f"import llama_cpp; llm = llama_cpp.Llama(model_path={gguf_path!r}, n_ctx=8192, n_threads={threads}, "
            f"verbose=False); llm(open({f.name!r}).read(), max_tokens={new}, temperature=0)")
    cmds = {"decode.py (rsqr + recall: its defaults)": common,
            "decode.py --recall-pages 0 (plain rsqr)": common + ["--recall-pages", "0"],
            "decode.py --policy full": common + ["--policy", "full"],
            "llama.cpp (n_ctx 8192)": [sys.executable, "-c", lcpp]}
    out: dict[str, float] = {}
    try:
        for _ in range(rounds):
            for name, cmd in cmds.items():
                runs = [(name, None)]
                if "decode.py" in name:
                    cache = tempfile.mkdtemp(prefix="rsqr-rss-xla-")
                    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache}
                    runs = [(f"{name}, first run", env), (f"{name}, again (programs cached)", env)]
                for label, env in runs:
                    r = peak_rss(cmd, env)
                    if r["exit"] != 0:
                        raise ConfigError(f"{label} failed (exit {r['exit']}): {r['last_stderr']}")
                    out[label] = max(out.get(label, 0.0), r["peak_rss_mib"])
                    status(f"peak RSS {label}: {r['peak_rss_mib']:.0f} MiB")
                if len(runs) > 1:
                    shutil.rmtree(cache, ignore_errors=True)
    finally:
        os.unlink(f.name)
    return {"prompt_tokens": len(ids), "new_tokens": new, "mib": out}


# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BenchResult:
    """The benchmark JSON (`data`: args, rows, machine) and its table."""

    data: dict

    def markdown(self) -> str:
        a, rows = self.data["args"], self.data["rows"]
        hf = any("hf_tok_s" in r for r in rows)
        lcpp = any("llama_cpp_tok_s" in r for r in rows)
        lines = [f"Decode speed, {a['new']} new greedy tokens, {a['dtype']}, policy {a['policy']}, "
                 f"{self.data['machine']['cpus']} CPUs (HF torch threads {a['threads']}"
                 f"{', pinned to one core' if a['single_thread'] else ''}); load average "
                 f"{self.data['machine']['loadavg_end']:.1f}", ""]
        sampled = any("sampled_tok_s" in r for r in rows)
        head = ["cached", "ours tok/s", "ours ms/tok"] + (["sampled tok/s", "sampled ms/tok"] if sampled else []) + \
            (["HF tok/s", "HF ms/tok", "ours/HF", "CPU-time ratio",
                                                           "greedy agree"] if hf else []) + \
            (["llama.cpp tok/s", "ours/llama.cpp", "prefill tok/s ours / llama.cpp", "greedy agree (llama.cpp)"]
             if lcpp else [])
        lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for r in rows:
            cells = [str(r["cached"]), f"{r['ours_tok_s']:.1f}", f"{r['ours_ms_per_token']:.1f}"]
            if sampled:
                cells += [f"{r['sampled_tok_s']:.1f}", f"{r['sampled_ms_per_token']:.1f}"]
            if hf:
                agree = r.get("greedy_agreement")
                cells += [f"{r['hf_tok_s']:.1f}", f"{r['hf_ms_per_token']:.1f}", f"{r['ratio']:.2f}x",
                          f"{r['cpu_ratio']:.2f}x", "-" if agree is None else f"{agree:.0%}"]
            if lcpp:
                cells += [f"{r['llama_cpp_tok_s']:.1f}", f"{r['vs_llama_cpp']:.2f}x",
                          f"{r['prefill_tok_s']:.0f} / {r['llama_cpp_prefill_tok_s']:.0f}",
                          f"{r['greedy_agreement_llama_cpp']:.0%}"]
            lines.append("| " + " | ".join(cells) + " |")
        rss = self.data.get("peak_rss")
        if rss:
            lines += ["", f"Peak RSS, a child process completing {rss['prompt_tokens']} prompt tokens greedily for "
                      f"{rss['new_tokens']} more (MiB):", ""] + [f"* {k}: {v:.0f}" for k, v in rss["mib"].items()]
        if sampled:
            lines += ["", f"sampled: {self.data['sampling']}", "",
                      "Sampler alone, one row of the vocabulary (ms per call):", ""]
            lines += [f"* {k}: {v:.3f}" for k, v in self.data["sampler_ms"].items()]
        return "\n".join(lines) + "\n"

    def write_json(self, path) -> None:
        write_json_atomic(path, self.data)


def run(config: BenchConfig, apply_fn, params, model_config, tokenizer, *, hf_model=None, llama_cpp=None,
        meta: dict | None = None) -> BenchResult:
    """Benchmark ours (apply_fn, params) and, when given, `hf_model` (from hf_model_from_ours) and `llama_cpp`
    (from llama_cpp_model, on the same GGUF and token ids) row by row, the measurements interleaved."""
    config.check()
    if hf_model is not None:
        import torch

        if config.dtype != "float32":
            raise ConfigError("the HF comparison runs float32 (use --dtype float32 or --no-hf)")
        torch.set_num_threads(config.threads)
    chunk = config.prefill_chunk
    n_text = max(round_up(config.policy_for(c)[1], chunk) for c in config.cached) + 8
    text_ids = read_tokens(tokenizer, config.text, n_text).tolist()
    if hf_model is not None:  # warm both sides up once (first-call allocations, thread pools)
        hf_run(hf_model, text_ids[:32], 4)
    rows = []
    for cached in config.cached:
        policy, prompt_len = config.policy_for(cached)
        prompt_len = round_up(prompt_len, chunk) if not config.full else prompt_len
        max_len = round_up(prompt_len + config.new + 1) if config.full else 0
        spec = CacheSpec.for_policies(policy, dims=model_config, dtype=config.dtype, max_chunk=chunk, max_len=max_len)
        # Equal Sessions share one compilation (their Decoders compare equal): a fresh one per measurement.
        new_session = lambda sampling=Sampling(): Session(apply_fn, params, spec, policy,  # noqa: E731
                                                          prefill_chunk=chunk, sampling=sampling, seed=0)
        s = new_session()
        s.warmup()
        compile_s = s.compile_s
        s.feed(text_ids[:chunk])
        s.generate(2)  # first execution of the compiled functions, untimed
        prompt, hf_prompt = text_ids[:prompt_len], text_ids[:cached]
        o_meas, h_meas, s_meas, l_meas = [], [], [], []
        for _ in range(config.repeats):  # interleaved, so both sides see the same machine load
            if config.sampled:  # same compiled functions as greedy: the settings are data
                s = new_session(CHAT_SAMPLING)
                s.feed(prompt)
                t0 = time.perf_counter()
                s_toks = s.generate(config.new)
                s_meas.append((time.perf_counter() - t0) * config.new / max(len(s_toks), 1))
            s = new_session()
            t0 = time.perf_counter()
            s.feed(prompt)
            o_pre = time.perf_counter() - t0
            c0, t0 = time.process_time(), time.perf_counter()
            o_toks = s.generate(config.new)
            o_meas.append((o_pre, time.perf_counter() - t0, time.process_time() - c0))
            if hf_model is not None:
                h_pre, h_dt, h_cpu, h_toks = hf_run(hf_model, hf_prompt, config.new)
                h_meas.append((h_pre, h_dt, h_cpu))
            if llama_cpp is not None:
                l_pre, l_dt, l_cpu, l_toks = llama_cpp_run(llama_cpp, prompt, config.new)
                l_meas.append((l_pre, l_dt, l_cpu))
        o_best, o_cpu = min(d for _, d, _ in o_meas), min(c for _, _, c in o_meas)
        row = {"cached": cached, "prompt_tokens_ours": len(prompt), "new_tokens": config.new,
               "policy": policy.name, "win_capacity": spec.win_capacity, "surv_capacity": spec.surv_capacity,
               "compile_s": compile_s, "ours_tok_s": config.new / o_best,
               "ours_ms_per_token": 1e3 * o_best / config.new,
               "ours_tok_s_all": [config.new / d for _, d, _ in o_meas], "ours_prefill_s": min(p for p, _, _ in o_meas),
               "ours_cpu_ms_per_token": 1e3 * o_cpu / config.new, "cache_bytes": spec.bytes_by_part(policy)}
        if s_meas:
            row.update(sampled_tok_s=config.new / min(s_meas), sampled_ms_per_token=1e3 * min(s_meas) / config.new,
                       sampled_tok_s_all=[config.new / d for d in s_meas])
        if not config.full:
            row["cached_after_decode_ours"] = len(cached_positions(s.cache, s.policy))
        if hf_model is not None:
            h_best, h_cpu = min(d for _, d, _ in h_meas), min(c for _, _, c in h_meas)
            row.update(hf_tok_s=config.new / h_best, hf_ms_per_token=1e3 * h_best / config.new,
                       hf_tok_s_all=[config.new / d for _, d, _ in h_meas], hf_prefill_s=min(p for p, _, _ in h_meas),
                       hf_cpu_ms_per_token=1e3 * h_cpu / config.new, ratio=h_best / o_best, cpu_ratio=h_cpu / o_cpu)
            if config.full:
                first_diff = next((i for i, (a, b) in enumerate(zip(o_toks, h_toks)) if a != b), None)
                row.update(greedy_agreement=float(np.mean(np.asarray(o_toks) == np.asarray(h_toks[:len(o_toks)]))),
                           first_divergence=first_diff)
        if llama_cpp is not None:
            l_best = min(d for _, d, _ in l_meas)
            row.update(llama_cpp_tok_s=config.new / l_best, llama_cpp_ms_per_token=1e3 * l_best / config.new,
                       llama_cpp_tok_s_all=[config.new / d for _, d, _ in l_meas],
                       llama_cpp_prefill_s=min(p for p, _, _ in l_meas),
                       prefill_tok_s=len(prompt) / row["ours_prefill_s"],
                       llama_cpp_prefill_tok_s=len(prompt) / min(p for p, _, _ in l_meas),
                       vs_llama_cpp=l_best / o_best, vs_llama_cpp_prefill=min(p for p, _, _ in l_meas) / row["ours_prefill_s"],
                       greedy_agreement_llama_cpp=float(np.mean(np.asarray(o_toks) == np.asarray(l_toks[:len(o_toks)]))))
        row["loadavg_1min"] = os.getloadavg()[0]
        rows.append(row)
        status(f"C={cached}: ours {row['ours_tok_s']:.1f} tok/s" +
               (f", HF {row['hf_tok_s']:.1f} tok/s, ratio {row['ratio']:.2f}x" if hf_model is not None else "") +
               (f", llama.cpp {row['llama_cpp_tok_s']:.1f} tok/s, ours/llama.cpp {row['vs_llama_cpp']:.2f}x"
                if llama_cpp is not None else ""))
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
               "backend": jax.default_backend(), "loadavg_end": os.getloadavg()[0]}
    if hf_model is not None:
        import torch
        import transformers

        machine.update(torch=torch.__version__, transformers=transformers.__version__)
    keys = ("policy", "window", "sinks", "delta", "max_survivors", "block", "overflow")
    data = {"args": {**base_policy.config_json(config, keys), **(meta or {})}, "rows": rows, "machine": machine}
    if config.sampled:
        data.update(sampling=CHAT_SAMPLING.to_json(), sampler_ms=sampler_costs(model_config.vocab_size))
    return BenchResult(data)
