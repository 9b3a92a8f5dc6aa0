"""A tiny decoder trained in seconds (optax) on synthetic associative recall, so CI can test what a cache
policy remembers without the 135M model.

Task (AssocTask): facts, filler, then queries about the facts. Trained with full attention on short and
long fillers; streamed through a bounded cache the facts are evicted before the queries, so only a
policy that keeps or brings them back answers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class AssocTask:
    """Token layout: 0 pad, 1 query marker, keys, values, facts (one token per key/value pair: the fact
    "key k has value v"), filler. A sequence is n_pairs facts with distinct keys, filler, then queries
    `Q k v`: after `Q k` the model must say v. One fact is one token, so a single attention hop answers
    (the model learns it in seconds) and a cache either holds that token or does not."""

    n_pairs: int = 4
    n_keys: int = 8
    n_values: int = 8
    n_filler_ids: int = 24
    n_queries: int = 4
    n_prefix: int = 2  # filler before the facts (what attention sinks hold)

    @property
    def key0(self) -> int:
        return 2

    @property
    def value0(self) -> int:
        return self.key0 + self.n_keys

    @property
    def fact0(self) -> int:
        return self.value0 + self.n_values

    @property
    def filler0(self) -> int:
        return self.fact0 + self.n_keys * self.n_values

    @property
    def vocab(self) -> int:
        return self.filler0 + self.n_filler_ids

    def length(self, n_filler: int) -> int:
        return self.n_prefix + self.n_pairs + n_filler + 3 * self.n_queries


def assoc_batch(task: AssocTask, rng: np.random.Generator, batch: int, n_filler: int):
    """(tokens [B, T] int32, answer_mask [B, T] bool: positions whose NEXT token is a queried value)."""
    T = task.length(n_filler)
    tokens = np.zeros((batch, T), np.int32)
    mask = np.zeros((batch, T), bool)
    n, a = task.n_pairs, task.n_prefix
    for b in range(batch):
        keys = rng.choice(task.n_keys, n, replace=False)
        vals = rng.integers(0, task.n_values, n)
        tokens[b, :a] = rng.integers(0, task.n_filler_ids, a) + task.filler0
        tokens[b, a:a + n] = task.fact0 + keys * task.n_values + vals
        tokens[b, a + n:a + n + n_filler] = rng.integers(0, task.n_filler_ids, n_filler) + task.filler0
        for i, j in enumerate(rng.integers(0, n, task.n_queries)):
            at = a + n + n_filler + 3 * i
            tokens[b, at:at + 3] = (1, task.key0 + keys[j], task.value0 + vals[j])
            mask[b, at + 1] = True  # after `Q k` comes v
    return tokens, mask


def train_assoc_model(task: AssocTask, cfg, *, steps: int = 600, batch: int = 32, fillers=(0, 8, 24, 40),
                      lr: float = 3e-3, seed: int = 0, log_every: int = 0):
    """(apply_fn, params, final_accuracy) of a `rsqr_jax.models.llama.Llama` trained with optax (Adam, warmup-cosine)
    on the task with full attention; fillers are cycled so every gap length is seen."""
    import optax

    from rsqr_jax.models.llama import Llama, split_apply
    from rsqr_jax import policy as P
    from rsqr_jax.cache import init_cache
    from rsqr_jax.spec import CacheSpec
    from rsqr_jax.models.tiny import tiny_weights
    from rsqr_jax.update import plan_step

    apply_fn, params = split_apply(Llama(cfg, tiny_weights(cfg, seed), dtype=jnp.float32))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), steps)
    opt = optax.adamw(schedule, weight_decay=0.01)
    opt_state = opt.init(params)

    full = P.full()  # concrete, outside the trace

    def loss_fn(params, tokens, mask):
        B, T = tokens.shape
        cache = init_cache(CacheSpec(cfg.num_layers, B, cfg.num_kv_heads, cfg.head_dim, T, 0, max_chunk=T))
        logits, _ = apply_fn(params, tokens, cache, plan_step(cache, full, T))
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        m = mask[:, :-1]
        acc = jnp.sum((jnp.argmax(logits[:, :-1], -1) == tokens[:, 1:]) & m) / jnp.sum(m)
        return jnp.sum(nll * m) / jnp.sum(m), acc

    @jax.jit
    def update(params, opt_state, tokens, mask):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, mask)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    rng = np.random.default_rng(seed)
    acc = 0.0
    # Every batch padded at the end to the longest filler's length (pad tokens after the last answer, outside the
    # loss's mask; the model is causal, so they change nothing before them): one compilation instead of one per
    # filler length.
    T = task.length(max(fillers))
    for i in range(steps):
        f = fillers[i % len(fillers)]
        tokens, mask = assoc_batch(task, rng, batch, f)
        tokens, mask = (np.pad(a, ((0, 0), (0, T - a.shape[1]))) for a in (tokens, mask))
        params, opt_state, loss, acc = update(params, opt_state, jnp.asarray(tokens), jnp.asarray(mask))
        if log_every and i % log_every == 0:
            print(f"step {i} filler {f} loss {float(loss):.3f} acc {float(acc):.2f}", flush=True)
    return apply_fn, params, float(acc)


def assoc_accuracy(apply_fn, params, tokens_BxT, mask_BxT, policy, spec) -> float:
    """Greedy accuracy at the answer positions of a batch streamed token by token through `policy`."""
    from rsqr_jax.engine import Decoder

    dec = Decoder(apply_fn, spec)
    cache, hits, n = dec.init_cache(), 0, 0
    for t in range(tokens_BxT.shape[1] - 1):
        logits, cache = dec.feed(params, tokens_BxT[:, t:t + 1], cache, policy)
        if mask_BxT[:, t].any():
            pred = np.asarray(jnp.argmax(logits[:, 0], -1))
            hits += int(np.sum((pred == tokens_BxT[:, t + 1]) & mask_BxT[:, t]))
            n += int(mask_BxT[:, t].sum())
    return hits / n
