"""rsqr_jax.kernels.page_scores, the CPU kernel for the recall tier's page scores on its int8 scoring copy: the same
scores as XLA's path (recall.live_page_scores / page_scores on pack_int8_keys' rows) for every fill, block size,
chunk of real and padded rows and head layout; its plain loop (machines without AVX-512 VNNI, or shapes off its fast
path) the same; under vmap; inside a decode step, the same logits as with the kernel turned off."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rsqr_jax.kernels.store import run_slots
from rsqr_jax.kernels import page_scores as PS
from rsqr_jax.recall import (Recall, ScoringCopy, _int8_kernel_applies, _int8_kernel_scores, live_page_scores,
                             pack_int8_keys, page_scores)
from rsqr_lab.testing import drawn_seed
from tests.cpu_kernels import build_for_march, recall_decode_logits

if shutil.which("c++") is None:  # the kernel is built with the machine's C++ compiler
    pytest.skip("no C++ compiler: the CPU kernel cannot be built here", allow_module_level=True)


def test_kernel_is_built_here():
    assert PS.available(), PS.unavailable_reason()


def _store(rng, L, B, Hkv, n_pages, Pg, D):
    keys = rng.normal(size=(L, B, Hkv, n_pages * Pg, D)).astype(np.float32)
    keys[0, :, :, :Pg] = 0.0  # a page of all-zero keys: scale 0
    return pack_int8_keys(jnp.asarray(keys))


def _xla_scores(q, rows, layer, cold_pos, rc, inv, n_pages):
    """XLA's scores for the same layer: its reader is a plain function, which the kernel never takes."""
    B, Hkv = rows.shape[1], rows.shape[2]
    gather = lambda starts, n: rows[layer, jnp.arange(B)[:, None, None], jnp.arange(Hkv)[None, :, None],  # noqa: E731
                                    run_slots(starts, n)[:, None, :]]
    summ = jnp.zeros((B, Hkv, n_pages, 0), jnp.float32)
    if rc.score_block:
        return live_page_scores(q, summ, cold_pos, rc, inv, None, None, gather)
    return page_scores(q, summ, cold_pos, rc, inv, None, None, gather(jnp.zeros((B, 1), jnp.int32), cold_pos.shape[0]))


@pytest.mark.parametrize("B,C,Hq,Hkv,D,Pg", [(1, 1, 9, 3, 64, 16),   # SmolLM2's decode step (the fast path)
                                            (2, 3, 4, 2, 64, 16),   # batch rows, a chunk with a padded row
                                            (1, 2, 4, 1, 128, 32),  # head_dim 128: two blocks of words
                                            (2, 1, 4, 2, 16, 3)])   # off the fast path: the plain loop
def test_kernel_scores_equal_xla_for_every_fill_and_block(B, C, Hq, Hkv, D, Pg):
    rng = np.random.default_rng(drawn_seed(f"page_scores {B} {C} {Hq} {Hkv} {D} {Pg}"))
    L, n_pages, layer = 3, 9, 1
    Nc = n_pages * Pg
    rows = _store(rng, L, B, Hkv, n_pages, Pg, D)
    q = jnp.asarray(rng.normal(size=(B, C, Hq, D)), jnp.float32)
    inv = jnp.asarray(1.0 / 10000 ** (np.arange(0, D, 2) / D), jnp.float32)
    real = np.arange(C) < max(C - 1, 1)  # the last row of a chunk is padding
    copy = ScoringCopy(rows, jnp.int32(layer))
    for filled in (0, 1, Pg + 2, Nc - 3, Nc):
        cold_pos = np.where(np.arange(Nc) < filled, np.arange(Nc) + 40, -1).astype(np.int32)
        valid = (cold_pos >= 0) & (rng.random(Nc) < 0.7)
        live = -(-int(np.flatnonzero(valid).max(initial=-1) + 1) // Pg)
        for block in (0, 2, 4, n_pages):  # 0: every page scored, no blocks
            rc = Recall(jnp.int32(2), jnp.asarray(valid), jnp.zeros((1,), jnp.int32),
                        jnp.asarray(100 + np.arange(C), jnp.int32), jnp.asarray(real), jnp.asarray(True), 2,
                        page_score="max", live_pages=jnp.int32(live), score_block=block)
            assert _int8_kernel_applies(q, copy, rc)
            want = _xla_scores(q, rows, layer, jnp.asarray(cold_pos), rc, inv, n_pages)
            got = jax.jit(lambda q, rows, cold_pos: _int8_kernel_scores(q, ScoringCopy(rows, jnp.int32(layer)), n_pages,
                                                                       cold_pos, rc, inv))(q, rows, jnp.asarray(cold_pos))
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"fill {filled}, block {block}")
        assert np.isfinite(np.asarray(want)).sum() == B * np.any(valid.reshape(n_pages, Pg), 1).sum()


def test_the_kernel_takes_only_the_int8_copy_and_a_decode_steps_queries():
    rows = jnp.zeros((2, 1, 2, 32, 17), jnp.int32)
    rc = Recall(jnp.int32(2), jnp.ones(32, bool), jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32),
                jnp.ones((1,), bool), jnp.asarray(True), 2, page_score="max")
    q = lambda C: jnp.zeros((1, C, 4, 64), jnp.float32)  # noqa: E731  G = 2 per KV head
    assert _int8_kernel_applies(q(1), ScoringCopy(rows, jnp.int32(0)), rc)
    assert _int8_kernel_applies(q(PS.QUERIES_MAX // 2), ScoringCopy(rows, jnp.int32(0)), rc)
    assert not _int8_kernel_applies(q(PS.QUERIES_MAX // 2 + 1), ScoringCopy(rows, jnp.int32(0)), rc)  # a prompt chunk
    assert not _int8_kernel_applies(q(1), ScoringCopy(rows.astype(jnp.float32), jnp.int32(0)), rc)  # float32 copy
    assert not _int8_kernel_applies(q(1), lambda s, n: rows, rc)  # a reader that is not the copy itself
    import dataclasses

    assert not _int8_kernel_applies(q(1), ScoringCopy(rows, jnp.int32(0)), dataclasses.replace(rc, page_score="mean"))


def test_kernel_under_vmap_scores_each_element():
    rng = np.random.default_rng(drawn_seed("page_scores vmap"))
    P, B, C, Hkv, G, D, Pg, n_pages = 3, 1, 1, 2, 2, 64, 16, 5
    rows = jnp.stack([_store(rng, 2, B, Hkv, n_pages, Pg, D) for _ in range(P)])
    codes = jnp.asarray(rng.integers(-127, 128, (P, B, C, Hkv, G, D)), jnp.int8)
    scale = jnp.asarray(rng.uniform(0.001, 0.01, (P, B, C, Hkv, G)), jnp.float32)
    valid, real = jnp.ones(n_pages * Pg, bool), jnp.ones((C,), bool)
    call = lambda r, c, s, n: PS.page_scores_int8(r, 1, c, s, valid, real, n, Pg)  # noqa: E731
    got = jax.jit(jax.vmap(call))(rows, codes, scale, jnp.asarray([0, 3, 5], jnp.int32))
    for p, n in enumerate((0, 3, 5)):
        np.testing.assert_array_equal(np.asarray(got[p]), np.asarray(call(rows[p], codes[p], scale[p], n)))
    assert np.isneginf(np.asarray(got[0])).all() and np.isneginf(np.asarray(got[1, :, 3:])).all()


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_the_plain_loop_built_for_other_machines_gives_the_same_scores(tmp_path, march):
    """The source built without AVX-512 VNNI (its plain loop), registered under a name of its own: the same scores as
    the path this machine runs."""
    target = build_for_march(PS.SOURCE, "PageScoresInt8", march, tmp_path)
    rng = np.random.default_rng(drawn_seed(f"page_scores {march}"))
    B, C, Hkv, G, D, Pg, n_pages = 2, 2, 3, 3, 64, 16, 6
    rows = _store(rng, 2, B, Hkv, n_pages, Pg, D)
    codes = jnp.asarray(rng.integers(-127, 128, (B, C, Hkv, G, D)), jnp.int8)
    scale = jnp.asarray(rng.uniform(0.001, 0.01, (B, C, Hkv, G)), jnp.float32)
    valid = jnp.asarray(rng.random(n_pages * Pg) < 0.6)
    real = jnp.asarray([True, False])
    out = jax.ShapeDtypeStruct((B, n_pages), jnp.float32)
    args = (rows, jnp.int32(1), codes, scale, valid, real, jnp.int32(5))
    got = jax.ffi.ffi_call(target, out)(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(PS.page_scores_int8(*args[:6], 5, Pg)))


def test_decode_logits_are_those_of_the_xla_scores(monkeypatch):
    """A decode with the recall tier on the int8 copy (pages chosen at every step, in every layer) gives the logits it
    gives with the kernel turned off, bit for bit: the kernel moves no page choice. (The prompt, one chunk of 40 rows,
    is scored by XLA either way; recall changes the logits, so a different choice would show.)"""
    import rsqr_jax as rj
    from rsqr_jax.models.tiny import tiny_config, tiny_model

    cfg = tiny_config(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=64)
    seed = drawn_seed("page_scores decode")
    apply_fn, params = tiny_model(cfg, seed)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(1, 72))
    cold = rj.ColdStore(64, 4, "max", score_dtype="int8")
    run = lambda recall_pages=2: recall_decode_logits(  # noqa: E731  (a function of its own: traced anew)
        lambda *a, **k: apply_fn(*a, **k), params, cfg, tokens, cold, recall_pages)

    taken = []
    real = PS.applies
    monkeypatch.setattr(PS, "applies", lambda n: taken.append(real(n)) or taken[-1])
    with_kernel = run()
    assert True in taken and False in taken  # decode steps through the kernel, the 40-row prompt through XLA
    monkeypatch.setattr(PS, "applies", lambda n: False)
    np.testing.assert_array_equal(with_kernel, run())  # on XLA's scores
    assert not np.array_equal(with_kernel, run(recall_pages=0))
