"""lm-evaluation-harness model "rsqr_jax": a loaded model streamed through an rsqr_jax cache policy.

    lm = RsqrLM.from_model_args("policy=rsqr,window=256,recall_pages=4")   # loads the embedded SmolLM2
    lm_eval.simple_evaluate(model=lm, tasks=["rsqr_smoke"], task_manager=TaskManager(include_path=...))

or `scripts/eval_tasks.py --policy rsqr --window 256 --tasks ... --include_path ...`. Every policy and recall
flag of the command lines is a model argument (MODEL_ARGS). Tokenization and request handling follow
lm-eval's `TemplateLM` (the one HFLM uses: the same context/continuation split, the same prefix token), so
`policy=full` scores exactly what lm-eval's `hf` backend scores. With batch_size N > 1 the requests run on
`rsqr_jax.eval.harness.StreamsEngine` (N independent streams, requests joining and leaving the slots); with
batch_size 1 or "auto" on `SequentialEngine` (one at a time). Requires the `eval` extra (lm-eval).
"""

from __future__ import annotations

from rsqr_jax.eval.runtime import ConfigError

try:
    from lm_eval.api.model import TemplateLM
except ModuleNotFoundError as e:  # the eval extra is optional
    if e.name != "lm_eval":
        raise
    raise ConfigError("lm-eval is not installed: pip install 'rsqr_jax[eval]'") from None
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

from rsqr_jax.eval.harness import GenerateRequest, RequestEngine, SequentialEngine, StreamsEngine
from rsqr_jax.sampling import Sampling

# The policy and recall arguments (the command lines' flags by name): None = the model's preset (rsqr_jax.presets),
# resolved once the model is loaded, as rsqr_jax.load() and decode.py resolve theirs. share_from: -1 (every layer
# chooses its pages), a layer, or one source per layer as LAYERS:SOURCE items separated by ';' (lm-eval's model
# arguments are separated by ','), e.g. 0-1:none;10-13:9;15-29:14.
PRESET_ARGS = {"policy": str, "window": int, "sinks": int, "delta": int, "max_survivors": int, "block": int,
               "overflow": str, "recall_pages": int, "cold_capacity": int, "page_size": int, "page_score": str,
               "recall_neighbors": int, "placement": str, "reselect": int, "share_from": int, "score_dtype": str}
# Model arguments and their defaults: the preset's above, then the model and the scoring protocol's own.
MODEL_ARGS = {
    **dict.fromkeys(PRESET_ARGS),
    "model": None, "dtype": "float32", "kernel": "auto", "weight_format": "auto",
    "chunk": 32, "max_length": 2048, "gen_block": 16, "max_gen_toks": 256, "seed": 0,
}
# What lm-eval passes every model (accepted; batch_size = the number of streams, see batch_slots).
HARNESS_ARGS = ("batch_size", "max_batch_size", "device")


def _sampling(kw: dict) -> Sampling:
    """The sampler settings of a request's normalised gen_kwargs (popped from kw): greedy unless do_sample
    with a temperature > 0; top_p / top_k as HF generate reads them (top_k 0 = off)."""
    do_sample, temperature = kw.pop("do_sample", False), float(kw.pop("temperature", 0.0))
    top_p, top_k = kw.pop("top_p", None), kw.pop("top_k", None)
    if not do_sample or temperature <= 0:
        return Sampling()
    try:
        return Sampling(temperature=temperature, top_p=1.0 if top_p is None else float(top_p),
                        top_k=0 if top_k is None else int(top_k))
    except ValueError as e:
        raise ConfigError(f"gen_kwargs: {e}") from None


def batch_slots(batch_size) -> int:
    """lm-eval's batch_size as a number of streams: N (an integer, or its string) -> N; None or "auto" -> 1
    (one request at a time: the simplest, no memory probing)."""
    if batch_size is None or (isinstance(batch_size, str) and batch_size.strip().startswith("auto")):
        return 1
    try:
        n = int(str(batch_size).strip())
    except ValueError:
        n = 0
    if isinstance(batch_size, bool) or n < 1:
        raise ConfigError(f"batch_size must be a positive integer or 'auto', got {batch_size!r}")
    return n


def check_model_args(args: dict) -> dict:
    """MODEL_ARGS with `args` applied (one-line ConfigError on an unknown name or a mistyped value)."""
    unknown = sorted(set(args) - set(MODEL_ARGS) - set(HARNESS_ARGS))
    if unknown:
        raise ConfigError(f"unknown model argument {unknown[0]!r}: choose from {', '.join(MODEL_ARGS)}")
    out = dict(MODEL_ARGS)
    for k, v in args.items():
        if k in HARNESS_ARGS:
            if k == "batch_size":  # kept: the number of streams (batch_slots)
                out[k] = v
            continue
        default = MODEL_ARGS[k]
        if k in PRESET_ARGS and v is not None:
            default = 0 if PRESET_ARGS[k] is int else ""
        if k == "share_from" and (isinstance(v, tuple) or isinstance(v, str) and ":" in v):  # one source per layer
            from rsqr_jax.presets import parse_choice_sources

            try:
                out[k] = v if isinstance(v, tuple) else parse_choice_sources(v, sep=";")
            except ValueError as e:
                raise ConfigError(f"model argument share_from: {e}") from None
            continue
        if isinstance(default, int) and not (isinstance(v, int) and not isinstance(v, bool)):
            raise ConfigError(f"model argument {k} must be an integer, got {v!r}")
        if isinstance(v, bool):  # lm-eval's argument parser reads "true" / "false" as booleans
            v = str(v).lower()
        out[k] = None if v is None else (v if isinstance(default, int) else str(v))
    return out


@register_model("rsqr_jax")
class RsqrLM(TemplateLM):
    """lm-eval's LM API over a RequestEngine: loglikelihood, loglikelihood_rolling, generate_until.

    `policy=full` truncates like HFLM (the last max_length tokens; rolling documents in max_length
    windows); a bounded policy streams every request and every document whole through its cache."""

    def __init__(self, engine: RequestEngine, tokenizer, *, max_gen_toks: int = 256, description: dict | None = None):
        super().__init__()
        self.engine, self.tokenizer = engine, tokenizer
        self.max_gen_toks = max_gen_toks
        self.description = description or {}

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "RsqrLM":
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string or ""), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "RsqrLM":
        extra = {k: v for k, v in (additional_config or {}).items() if k == "batch_size" and v is not None}
        return cls.from_model_args({**extra, **dict(arg_dict)})

    @classmethod
    def from_model_args(cls, args: str | dict, *, pieces=None) -> "RsqrLM":
        """Build from model arguments ("policy=rsqr,window=64" or a dict). pieces: (apply_fn, params,
        model_config, tokenizer) of a model already loaded (tests); else `model` (default: the embedded
        SmolLM2) is loaded."""
        a = check_model_args(simple_parse_args_string(args) if isinstance(args, str) else args)
        slots = batch_slots(a.get("batch_size"))
        for k in ("chunk", "gen_block", "max_gen_toks"):
            if a[k] < 1:
                raise ConfigError(f"model argument {k} must be >= 1, got {a[k]}")
        if a["max_length"] <= a["max_gen_toks"]:
            raise ConfigError(f"max_length {a['max_length']} must exceed max_gen_toks {a['max_gen_toks']}")
        if pieces is None:
            from rsqr_jax.models.llama import load_model, split_apply

            loaded = load_model(a["model"], a["dtype"], weight_format=a["weight_format"])
            apply_fn, params = split_apply(loaded.model, kernel=a["kernel"])
            pieces = (apply_fn, params, loaded.config, loaded.tokenizer)
        apply_fn, params, cfg, tokenizer = pieces
        from rsqr_jax.api import cold_store_of, policy_of
        from rsqr_jax.presets import find_preset

        try:
            settings = find_preset(cfg).resolve(**{k: a[k] for k in PRESET_ARGS if a[k] is not None})
            policy, store = policy_of(settings), cold_store_of(settings)
        except ValueError as e:  # PresetError, PolicyError, a ColdStore's ValueError
            raise ConfigError(f"policy and recall model arguments: {e}") from None
        a.update({k: settings.flat()[k] for k in PRESET_ARGS})
        cold = {} if store is None else {"cold": store, "max_recall_pages": settings.recall_pages}
        kw = dict(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dims=cfg,
                  max_length=a["max_length"], chunk=a["chunk"], dtype=a["dtype"], cold_store=cold,
                  gen_block=a["gen_block"], eos_ids=cfg.eos_token_ids, seed=a["seed"])
        try:
            engine = (StreamsEngine(apply_fn, params, policy, n_slots=slots, **kw) if slots > 1
                      else SequentialEngine(apply_fn, params, policy, **kw))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return cls(engine, tokenizer, max_gen_toks=a["max_gen_toks"],
                   description={**a, "policy_name": policy.name, "streams": slots})

    # --- tokenization (as HFLM: the tokenizer's own special tokens; no BOS added twice) -----------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.engine.max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        bos = self.tokenizer.decode(self.prefix_token_id)
        if add_special_tokens is None and bos and string.startswith(bos):
            kw["add_special_tokens"] = False
        return self.tokenizer.encode(string, **kw)

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # --- the three request types -------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        out = self.engine.score([(ctx, cont) for _, ctx, cont in requests])
        for (key, _, _), res in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [text for (text,) in [r.args for r in requests]]
        windows, owner = [], []  # every document's windows in one engine call (streams run them concurrently)
        for d, text in enumerate(texts):
            ids = self.tok_encode(text)
            if self.engine.bounded:  # the whole document through the bounded cache
                doc = [([self.prefix_token_id], ids)]
            else:
                doc = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    token_list=ids, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)]
            windows += doc
            owner += [d] * len(doc)
        totals = [0.0] * len(texts)
        for d, (lp, _) in zip(owner, self.engine.score(windows)):
            totals[d] += lp
        for text, total in zip(texts, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        batch, stops = [], []
        for context, gen_kwargs in [r.args for r in requests]:
            kw = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kw.pop("until", None), eos=eos)
            max_new = int(kw.pop("max_gen_toks"))
            if not self.engine.bounded and max_new >= self.max_length:
                raise ConfigError(f"max_gen_toks {max_new} must be below max_length {self.max_length} for full")
            sampling = _sampling(kw)

            def stop(ids, until=until):
                text = self.tok_decode(ids)
                return any(t and t in text for t in until)

            batch.append(GenerateRequest(self.tok_encode(context), max_new, sampling, stop))
            stops.append(until)
        # One engine call for all requests on streams (they run concurrently); one request per call otherwise,
        # so lm-eval's use_cache keeps each answer as soon as it exists (a killed run resumes there).
        step = len(batch) if isinstance(self.engine, StreamsEngine) else 1
        args, out = [r.args for r in requests], []
        for lo in range(0, len(batch), step):
            for (context, gen_kwargs), until, ids in zip(args[lo:lo + step], stops[lo:lo + step],
                                                         self.engine.generate(batch[lo:lo + step])):
                text = postprocess_generated_text(self.tok_decode(ids), until, None)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                out.append(text)
        return out
