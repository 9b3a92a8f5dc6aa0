"""The front door: `load()` a model with its preset, then chats, sessions and one-call generation under it.

    import rsqr_jax as rj
    model = rj.load()                                   # the embedded SmolLM2-135M-Instruct and its preset
    print(model.chat().send("What is the capital of France?"))

Every default comes from the model's preset (rsqr_jax.presets): the policy, the recall tier, sampling and the
prefill chunk. Any of them can be overridden by keyword (`model.chat(window=512, temperature=0)`), by the
command lines' names (`recall_pages=0`, `share_from=...`), or with a whole `policy=rj.streamingllm(...)`.
The command line `decode.py` builds its sessions through `Model.session` too, so a library call and the command
with the same settings give the same tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

__all__ = ["Model", "cold_store_of", "load", "policy_of", "resolve_weights_dtype", "sampling_of"]


def policy_of(settings):
    """The rsqr_jax.policy.Policy of resolved rsqr_jax.presets.Settings."""
    from rsqr_jax.policy import make_policy

    kw = settings.policy_kwargs
    return make_policy(kw.pop("mode"), **kw)


def cold_store_of(settings):
    """The recall tier's rsqr_jax.spec.ColdStore of resolved settings (None when recall is off)."""
    from rsqr_jax.spec import ColdStore

    kw = settings.cold_store_kwargs
    return None if kw is None else ColdStore(**kw)


def sampling_of(settings):
    """The rsqr_jax.sampling.Sampling of resolved settings."""
    from rsqr_jax.sampling import Sampling

    return Sampling(**settings.sampling)


def resolve_weights_dtype(weights_dtype: str, cache_dtype: str, platform: str) -> str:
    """`auto`: float32 on CPU (XLA:CPU runs bfloat16 matmuls 4-5x slower than float32), the cache dtype on
    accelerators (bfloat16 weights halve the memory traffic there)."""
    if weights_dtype != "auto":
        return weights_dtype
    return "float32" if platform == "cpu" else cache_dtype


def load(path=None, *, preset=None, dtype: str = "auto", weight_format: str = "auto",
         kernel: str = "auto") -> "Model":
    """A model ready to chat: a GGUF file or HF directory (default: the embedded SmolLM2-135M-Instruct) with its
    preset (the shipped one that matches the model, else the generic one; `preset`: a preset's name or .json file).

    dtype: the weights' dtype ("auto": float32 on CPU, the preset's cache dtype elsewhere). weight_format: how a
    GGUF's quantized blocks are held (rsqr_jax.models.llama.load_model). kernel: the attention kernel (xla,
    pallas, reference, or auto: pallas on GPU, xla on CPU). Errors a user can cause raise one-line exceptions
    (ModelLoadError, PresetError)."""
    import jax

    from rsqr_jax.models.llama import load_model
    from rsqr_jax.models.loading import default_model_path, load_config
    from rsqr_jax.presets import find_preset, load_preset

    path = default_model_path() if path is None else str(path)
    chosen = load_preset(preset) if preset is not None else find_preset(load_config(path))
    weights_dtype = resolve_weights_dtype(dtype, chosen.generation["cache_dtype"], jax.default_backend())
    return Model(load_model(path, weights_dtype, weight_format=weight_format), chosen, kernel)


@dataclasses.dataclass(eq=False)
class Model:
    """A loaded model (rsqr_jax.models.llama.LoadedModel) and the preset its defaults come from.

    `session(**overrides)` streams tokens, `chat(**overrides)` text through the chat template, `generate(prompt)`
    returns one reply. The overrides are rsqr_jax.presets.SETTING_NAMES (policy, window, sinks, recall_pages,
    temperature, ...); `settings(**overrides)` shows what they resolve to."""

    loaded: object
    preset: object
    kernel: str = "auto"

    @property
    def config(self):
        return self.loaded.config

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def identity(self) -> dict:
        """What a saved session must match to be resumed on this model."""
        return self.loaded.identity

    @functools.cached_property
    def model_sampling(self) -> dict:
        """The sampling defaults the model's own files carry (they come before the preset's)."""
        from rsqr_jax.models.loading import load_generation_defaults

        return load_generation_defaults(self.loaded.path)

    def settings(self, **overrides):
        """The rsqr_jax.presets.Settings of a session with these overrides."""
        return self.preset.resolve(model_sampling=self.model_sampling, **overrides)

    def session(self, *, settings=None, seed: int = 0, pins: int = 0, max_len: int | None = None,
                gen_block: int = 16, **overrides):
        """A rsqr_jax.session.Session under the preset with `overrides` (or under `settings`, already resolved).

        seed: the sampler's seed. pins: room for that many pinned tokens (`Session.pin_next`). max_len: the
        positions a `full` policy's cache holds (default: the model's context; the bounded policies need none)."""
        from rsqr_jax.session import Session
        from rsqr_jax.spec import CacheSpec

        if settings is None:
            settings = self.settings(**overrides)
        elif overrides:
            raise TypeError("give settings= or overrides, not both")
        cfg = self.config
        policy = policy_of(settings)
        spec = CacheSpec.for_policies(policy, dims=cfg, dtype=settings.cache_dtype, max_chunk=settings.chunk,
                                      max_len=cfg.max_position_embeddings if max_len is None else max_len,
                                      cold=cold_store_of(settings), pins=pins)
        apply_fn, params = self.loaded.split(self.kernel)
        return Session(apply_fn, params, spec, policy, prefill_chunk=settings.chunk, sampling=sampling_of(settings),
                       seed=seed, eos_ids=cfg.eos_token_ids, vocab_size=cfg.vocab_size, gen_block=gen_block)

    def chat(self, *, system: str | None = None, pins=None, stop: tuple[str, ...] = (), seed: int = 0,
             max_new_tokens: int | None = None, **overrides):
        """A rsqr_jax.conversation.Chat: `send(text)` replies through the chat template, `complete(text)` continues
        plain text. pins: what the conversation keeps forever (rsqr_jax.conversation.Pins, e.g. the system
        prompt); the cache gets room for it."""
        from rsqr_jax.conversation import Chat, Pins

        settings = self.settings(**overrides)
        pins = Pins() if pins is None else pins
        room = pins.room(self.tokenizer, system, FIRST_TURN_ROOM) if pins else 0
        session = self.session(settings=settings, seed=seed, pins=room)
        return Chat(session, self.tokenizer, system=system, pins=pins, stop=stop,
                    max_new_tokens=settings.max_new_tokens if max_new_tokens is None else max_new_tokens)

    def generate(self, prompt: str, *, chat: bool = True, system: str | None = None, stop: tuple[str, ...] = (),
                 seed: int = 0, max_new_tokens: int | None = None, on_text: Callable[[str], None] | None = None,
                 **overrides) -> str:
        """One reply in one call: `prompt` as a user turn (chat=False: plain text to continue)."""
        c = self.chat(system=system, stop=stop, seed=seed, max_new_tokens=max_new_tokens, **overrides)
        return c.send(prompt, on_text=on_text) if chat else c.complete(prompt, on_text=on_text)


# Pinned slots a conversation that pins its whole first turn reserves (its length is known only when it is sent).
FIRST_TURN_ROOM = 1024
