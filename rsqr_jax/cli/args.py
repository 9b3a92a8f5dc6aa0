"""Shared command-line plumbing of every command (rsqr_jax.cli, scripts/, the device tools in lab/): argument groups,
policy/model construction, and the one-line-error contract (bad input -> one line on stderr, exit code 2, no
traceback). Importing it imports no jax, so flags fail fast."""

from __future__ import annotations

import argparse
import ast
import functools
import os
import sys
from pathlib import Path

# The default text of every command: Frankenstein (Project Gutenberg #84), this package's data
# (rsqr_jax.data.FRANKENSTEIN, named here without importing jax). The studies read it through
# rsqr_jax.data.read_text, which keeps only the body between the Gutenberg markers.
DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "data" / "frankenstein.txt"


# transformers serves tokenizers and chat templates here; its advice to install PyTorch (absent in a runtime-only
# install) is noise on a user's terminal.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


SHARE_NONE = -1  # --share-choice-from none: every layer chooses its own pages
SAMPLING_DESTS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
                  "frequency_penalty")


class UsageError(Exception):
    """Bad user input: reported as one line, exit code 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help shows each flag's default (unless it is None or False, or the help already says it) and keeps
    the description's examples as written."""

    def _get_help_string(self, action):
        if action.default in (None, False, []) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error instead of usage + error, and defaults in --help."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kw)

    def error(self, message):
        raise UsageError(message)


# The policy flags: each flag's destination and the make_policy keyword it sets; their help.
POLICY_FLAGS = {"window": "window", "sinks": "n_sink", "delta": "delta", "max_survivors": "max_survivors",
                "block": "block", "overflow": "overflow"}
_POLICY_HELP = {"window": "window W (keeps W..W+block-1 recent tokens)", "sinks": "attention sinks N",
                "delta": "survivor stride (0 = no survivors)", "max_survivors": "cap on non-sink survivors",
                "block": "eviction block size", "overflow": "fifo or decimate"}


@functools.cache
def policy_defaults() -> dict:
    """The policy constructors' defaults (rsqr_jax.presets: the generic preset's policy; no jax import)."""
    from rsqr_jax.presets import policy_defaults as defaults

    return defaults()


def add_policy_args(p: argparse.ArgumentParser, *, default_policy: str = "rsqr", preset: bool = False,
                    flags: tuple[str, ...] = ("policy", *POLICY_FLAGS), recall: bool = True, **defaults) -> None:
    """The policy flags, with the library's defaults (policy_defaults()) unless `defaults` gives a command's
    own by flag (window=512; None: the command resolves it, its help says how). flags: the ones to add (a
    study that sets the others itself takes a subset; policy_from_args fills them in). recall: also the recall
    tier's flags. preset: every policy and recall flag defaults to None, resolved from the model's preset by
    `apply_preset` once the model's config is read."""
    unknown = set(defaults) - set(POLICY_FLAGS)
    if unknown:
        raise TypeError(f"add_policy_args: no policy flag {sorted(unknown)[0]!r}")
    lib = policy_defaults()
    g = p.add_argument_group("policy" + (" (default: the model's preset, rsqr_jax/presets)" if preset else ""))
    if "policy" in flags:
        g.add_argument("--policy", default=None if preset else default_policy,
                       help="full, window, streamingllm, leave_gaps, rerotate, replay, rsqr, rsqr_precompute"
                       + (f" (the presets': {default_policy})" if preset else ""))
    for dest, key in POLICY_FLAGS.items():
        if dest in flags:
            default = None if preset else defaults.get(dest, lib[key])
            shown = f" (generic preset: {lib[key]})" if preset else ""
            g.add_argument("--" + dest.replace("_", "-"), type=None if dest == "overflow" else int,
                           default=default, help=_POLICY_HELP[dest] + shown)
    if recall:
        add_recall_args(p, default_pages=None if preset else 0, preset=preset)


def add_recall_args(p: argparse.ArgumentParser, *, default_pages: int | None = 0, what: str = "",
                    pages: bool = True, preset: bool = False) -> None:
    """The recall tier's flags; `what` says which arm they apply to, if not --policy;
    pages=False leaves out --recall-pages (where a grid sets it); preset: every flag defaults to None (the
    model's preset, `apply_preset`)."""
    g = p.add_argument_group("recall tier (rsqr, streamingllm)" + (f": {what}" if what else "")
                             + (" (default: the model's preset)" if preset else ""))
    if pages:
        default_help = ("the preset's under its policy (4 pages), 0 under another policy" if default_pages is None
                        else f"default {default_pages}")
        g.add_argument("--recall-pages", type=int, default=default_pages,
                       help=f"cold pages each layer recalls per step (0 = off; {default_help})")
    g.add_argument("--cold-capacity", type=int, default=None if preset else 4096,
                   help="evicted tokens the cold store keeps at least (a multiple of --page-size; used when recalling)")
    g.add_argument("--page-size", type=int, default=None if preset else 16, help="tokens per cold page")
    g.add_argument("--page-score", default=None, help="how pages are ranked: max (the default: the page's best "
                   "token, exact; a scoring copy of every cold key, the whole store scored each step), "
                   "shortlist (the best token of the 16 x K pages of best mean key: nearly always max's "
                   "choices, no scoring copy; for stores of 16k tokens and more), mean (the query against the "
                   "page's mean key: cheaper, misses more) or quest (Quest's per-channel bound)")
    g.add_argument("--recall-neighbors", type=int, default=None if preset else 0,
                   help="pages on each side of a chosen page recalled with it (a fact across a page boundary)")
    g.add_argument("--reselect", type=int, default=None,
                   help="choose pages afresh every k decode steps (default: the preset's; the generic one: 1, the "
                   "embedded model's: 4); prompts and the step after one always choose; in between each layer "
                   "attends the pages it chose last, so the scoring costs 1/k")
    g.add_argument("--share-choice-from", type=layer_or_none, default=None, metavar="LAYER",
                   help="layers after LAYER attend the pages LAYER chose instead of scoring the store themselves "
                   "(the store is scored in LAYER + 1 layers, not all); none: every layer chooses; or per layer, "
                   "e.g. 0-1:none,10-13:9,15-29:14 (layers 0-1 recall nothing, 10-13 attend layer 9's choice, "
                   "15-29 layer 14's, the rest choose their own; the embedded model's preset)")
    g.add_argument("--score-dtype", default=None,
                   help="the max rule's scoring copy of the cold keys: float32 (exact scores) or int8 (a code per "
                   "value and a scale per key, scored by an int32 dot: a quarter of the copy's memory); default: "
                   "the preset's (the embedded model's: int8, the generic one: float32)")
    g.add_argument("--placement", default=None,
                   help="where recalled tokens sit: rank (the default: at their rank among sinks and survivors, so "
                   "every distance stays within the cache's size), true (at their true distance from the query; "
                   "rsqr only) or fixed (all at the window's distance; rsqr only)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    g.add_argument("--kernel", default="auto",
                   help="attention kernel: xla, pallas, auto (pallas on GPU, xla on CPU), reference")
    g.add_argument("--weight-format", default="auto",
                   help="tiled: keep a GGUF's 4- and 8-bit blocks as int8 codes in the CPU kernel's tiled layout and decode "
                   "through that kernel "
                   "(built on first use with the C++ compiler; logits within float32 rounding); blocks: the same "
                   "codes dequantized inside each step (a quarter of the bytes read per token, the same logits as "
                   "dense); dense: every weight as a --dtype array; auto: tiled on a CPU where it builds, else "
                   "blocks on a CPU, dense elsewhere")


def layer_or_none(text: str) -> int | tuple[int, ...]:
    """--share-choice-from: a layer index, none (SHARE_NONE: every layer chooses), or one source per layer
    (presets.parse_choice_sources: 0-1:none,10-13:9,...)."""
    from rsqr_jax.presets import parse_choice_sources

    if text.strip().lower() == "none":
        return SHARE_NONE
    if ":" in text:
        try:
            return parse_choice_sources(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layer index, none or LAYERS:SOURCE,..., got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a layer index >= 0 or none, got {value}")
    return value


# The settings a preset resolves, by command-line dest (rsqr_jax.presets.SETTING_NAMES by name).
PRESET_DESTS = {"policy": "policy", **{d: d for d in POLICY_FLAGS}, "recall_pages": "recall_pages",
                "cold_capacity": "cold_capacity", "page_size": "page_size", "page_score": "page_score",
                "recall_neighbors": "recall_neighbors", "placement": "placement", "reselect": "reselect",
                "share_choice_from": "share_from", "score_dtype": "score_dtype"}


def apply_preset(args, model_config, model_path=None, *, extra: tuple[str, ...] = ()):
    """Resolve the model's preset (or --preset) under the flags given (not None), write every resolved value back
    into `args` and return the rsqr_jax.presets.Settings. extra: further dests resolved the same way (sampling
    fields, prefill_chunk, max_new_tokens, cache_dtype). One-line UsageError for a bad preset or value."""
    from rsqr_jax.models.loading import load_generation_defaults
    from rsqr_jax.presets import PresetError, find_preset, load_preset

    dests = {**PRESET_DESTS, **{d: d for d in extra}}
    try:
        name = getattr(args, "preset", None)
        preset = load_preset(name) if name else find_preset(model_config)
        given = {key: getattr(args, dest) for dest, key in dests.items() if getattr(args, dest, None) is not None}
        model_sampling = load_generation_defaults(model_path) if any(d in SAMPLING_DESTS for d in extra) else None
        settings = preset.resolve(model_sampling=model_sampling, **given)
    except PresetError as e:
        raise UsageError(str(e)) from None
    flat = settings.flat()
    for dest, key in dests.items():
        value = flat[key]
        if dest == "share_choice_from" and value is None:
            value = SHARE_NONE
        setattr(args, dest, value)
    return settings


def policy_from_args(args, **fields):
    """The Policy of the policy flags in `args` (one a command does not take, or leaves None: the library's
    default), with `fields` (make_policy keywords, mode included) set over them."""
    from rsqr_jax.policy import make_policy

    kw = {key: getattr(args, dest) for dest, key in POLICY_FLAGS.items() if getattr(args, dest, None) is not None}
    kw["recall_pages"] = getattr(args, "recall_pages", 0)
    mode = fields.pop("mode", getattr(args, "policy", "rsqr"))
    return make_policy(mode, **{**kw, **fields})


def cold_store_flags(args):
    """The ColdStore of --cold-capacity --page-size --page-score --recall-neighbors --placement; one-line
    errors."""
    from rsqr_jax.spec import ColdStore

    try:
        rule = {"page_score": args.page_score} if args.page_score else {}  # else ColdStore's defaults
        if getattr(args, "placement", None):
            rule["placement"] = args.placement
        if getattr(args, "reselect", None) is not None:
            rule["reselect"] = args.reselect
        if getattr(args, "share_choice_from", None) is not None and args.share_choice_from != SHARE_NONE:
            rule["share_from"] = args.share_choice_from
        if getattr(args, "score_dtype", None) is not None:
            rule["score_dtype"] = args.score_dtype
        return ColdStore(args.cold_capacity, args.page_size, neighbors=args.recall_neighbors, **rule)
    except ValueError as e:
        raise UsageError(f"recall flags: {e}") from None


def cold_store_from_args(args):
    """The recall tier's ColdStore of the flags (None unless recall is on); one-line errors for impossible
    values, before anything loads."""
    k = getattr(args, "recall_pages", 0)
    if k < 0:
        raise UsageError(f"--recall-pages must be >= 0, got {k}")
    if not k:
        return None
    cold = cold_store_flags(args)
    if k > cold.pages:
        raise UsageError(f"--recall-pages {k} exceeds the cold store's {cold.pages} pages")
    return cold


def check_share_layer(args, model_config, share: int | None = None) -> None:
    """--share-choice-from (or `share`) names one of the model's layers that recall (a hybrid model's
    sliding-window layers do not): a one-line error."""
    share = getattr(args, "share_choice_from", None) if share is None else share
    if not getattr(args, "recall_pages", 0):
        return
    n = model_config.num_layers - int(getattr(model_config, "local_layers", 0) or 0)
    if isinstance(share, tuple) and len(share) > n:
        raise UsageError(f"--share-choice-from names layer {len(share) - 1}: the model has {n} layers that recall "
                         f"(0..{n - 1})")
    if isinstance(share, int) and share >= n:
        raise UsageError(f"--share-choice-from {share}: the model has {n} layers that recall (0..{n - 1})")


def cold_store_args(args) -> dict:
    """CacheSpec.for_policies keywords of the recall tier (none unless recall is on)."""
    cold = cold_store_from_args(args)
    return {} if cold is None else {"cold": cold, "max_recall_pages": args.recall_pages}


def check_model_args(args) -> None:
    if args.dtype not in ("float32", "bfloat16"):
        raise UsageError(f"--dtype must be float32 or bfloat16, got {args.dtype!r}")
    if args.kernel not in ("xla", "pallas", "auto", "reference"):
        raise UsageError(f"--kernel must be xla, pallas, auto or reference, got {args.kernel!r}")
    if getattr(args, "weight_format", "auto") not in ("auto", "tiled", "blocks", "dense"):
        raise UsageError(f"--weight-format must be auto, tiled, blocks or dense, got {args.weight_format!r}")
    if getattr(args, "weight_format", "auto") == "tiled":
        from rsqr_jax.kernels import block_matvec

        if not block_matvec.available():
            raise UsageError(f"--weight-format tiled: {block_matvec.unavailable_reason()}")
    if args.model is not None and not os.path.exists(args.model):
        raise UsageError(f"model not found: {args.model}")


def check_cache_fits(cache_bytes: int) -> None:
    """Refuse (one line) a cache that cannot fit in memory, before allocating it."""
    from rsqr_jax.eval.runtime import ConfigError, check_memory

    try:
        check_memory(cache_bytes)
    except ConfigError as e:
        raise UsageError(str(e)) from None


def model_label(args) -> str:
    """How a result names --model: "embedded" (the default model), or the file by its repository path or
    absolute path (never the embedded file's location in this machine's site-packages)."""
    from rsqr_jax.eval.runtime import portable_path

    return portable_path(args.model) if args.model else "embedded"


def load_model_from_args(args):
    from rsqr_jax.models.llama import load_model, split_apply

    loaded = load_model(args.model, args.dtype, weight_format=args.weight_format)
    check_share_layer(args, loaded.config)
    apply_fn, params = split_apply(loaded.model, kernel=args.kernel)
    return loaded, apply_fn, params


def status(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_main(main, argv: list[str] | None = None) -> None:
    """Run main(argv) (None: the process's own arguments) as a process does: user errors are one line on
    stderr and exit code 2, an interrupt exits 130, else main's return value is the exit status. Compiled
    programs are kept between runs (rsqr_jax.host.enable_compilation_cache)."""
    from rsqr_jax.host import enable_compilation_cache

    enable_compilation_cache()  # before the first compilation (and before the imports below import jax)
    from rsqr_jax.models.config import ModelLoadError
    from rsqr_jax.eval.runtime import ConfigError
    from rsqr_jax.policy import PolicyError

    prog = Path(sys.argv[0]).name
    try:
        code = main(argv)
    except (UsageError, PolicyError, ModelLoadError, ConfigError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
