"""Behaviour of the recall tier on a model that really uses what it read: a tiny decoder trained here with
optax (rsqr_lab.testing.train, ~20 s on 2 cores) on one-token facts, filler, then questions about the facts.

Measured (seed 0, 1200 steps, 64 evaluation rows x 4 questions, 40 filler tokens; greedy accuracy at the answers,
chance 1/8; the default `max` page rule): full 0.953, rsqr W=8 without recall 0.141, streamingllm 0.137, rsqr +
recall (page 1, 4 pages) 0.945 (0.945 with the int8 scoring copy), streamingllm + recall 0.949, rsqr + recall
(page 2, 2 pages) 0.926. The thresholds leave a margin of ~0.1.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import rsqr_jax as rj
from rsqr_jax.models.config import ModelConfig
from rsqr_lab.testing.train import AssocTask, assoc_accuracy, assoc_batch, train_assoc_model

TASK = AssocTask()
CFG = ModelConfig("llama", TASK.vocab, 64, 128, 1, 4, 2, 16, 1e-5, 1e4)
FILLER = 40  # the facts are evicted long before the questions under a window of 8


@functools.lru_cache(maxsize=None)
def trained():
    # Trained at XLA's default optimizations whatever the test's setting (tests/conftest.py): 1200 steps run long
    # enough for them to pay (measured on 2 cores: ~3.6 instead of ~18 ms a step, ~2 s more to compile).
    fast = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        apply_fn, params, train_acc = train_assoc_model(TASK, CFG, steps=1200, lr=1e-2, seed=0)
    finally:
        jax.config.update("jax_disable_most_optimizations", fast)
    print(f"trained: last-batch accuracy {train_acc:.2f}")
    return apply_fn, params


def accuracy(policy, cold: rj.ColdStore | None = None) -> float:
    apply_fn, params = trained()
    tokens, mask = assoc_batch(TASK, np.random.default_rng(1), 64, FILLER)
    spec = rj.CacheSpec.for_policies(policy, num_layers=1, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim,
                                     batch=64, max_len=tokens.shape[1], cold=cold)
    acc = assoc_accuracy(apply_fn, params, tokens, mask, policy, spec)
    print(f"{policy.name} {cold}: accuracy {acc:.3f}")
    return acc


@pytest.fixture(scope="module")
def full_acc():
    return accuracy(rj.full())


@pytest.mark.slow
def test_full_attention_answers(full_acc):
    assert full_acc >= 0.85


@pytest.mark.slow
def test_bounded_cache_without_recall_is_near_chance():
    assert accuracy(rj.rsqr(8, 2, 8, 4)) <= 0.35
    assert accuracy(rj.streamingllm(8, 2)) <= 0.35


@pytest.mark.slow
def test_recall_brings_the_evicted_facts_back(full_acc):
    one = accuracy(rj.rsqr(8, 2, 8, 4, recall_pages=4), rj.ColdStore(64, 1))
    assert one >= 0.85 and one >= full_acc - 0.05
    int8 = accuracy(rj.rsqr(8, 2, 8, 4, recall_pages=4), rj.ColdStore(64, 1, score_dtype="int8"))
    assert int8 >= 0.85 and int8 >= one - 0.03  # the int8 scoring copy finds the same facts
    pages_of_two = accuracy(rj.rsqr(8, 2, 8, 4, recall_pages=2), rj.ColdStore(64, 2))
    assert pages_of_two >= 0.82
    assert accuracy(rj.streamingllm(8, 2, recall_pages=4), rj.ColdStore(64, 1)) >= 0.85
