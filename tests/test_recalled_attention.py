"""rsqr_jax.kernels.recalled_attention, the CPU kernel for the recall tier's tokens in the attention: its partial
softmax (o, m, l) against the XLA path's for float32 and bfloat16-bits stores, padded chunk rows, head widths on and
off its vector paths, nothing valid and positions outside the rotation table; its plain loop built for other machines;
under vmap; and a decode whose logits are those with the kernel off, within float32 rounding."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rsqr_jax.kernels.store import read_layer_runs
from rsqr_jax.kernels import recalled_attention as RA
from rsqr_jax.kernels.survivor_attention import MASK_VALUE, _survivor_scores, rotation_table
from rsqr_lab.testing import drawn_seed
from tests.cpu_kernels import build_for_march, recall_decode_logits

if shutil.which("c++") is None:  # the kernel is built with the machine's C++ compiler
    pytest.skip("no C++ compiler: the CPU kernel cannot be built here", allow_module_level=True)


def test_kernel_is_built_here():
    assert RA.available(), RA.unavailable_reason()


def _case(rng, *, B, C, Hkv, G, D, M, Pg, bits, valid_frac=0.8, L=3, N=96):
    k = rng.normal(size=(L, B, Hkv, N, D)).astype(np.float32)
    v = rng.normal(size=(L, B, Hkv, N, D)).astype(np.float32)
    if bits:  # bfloat16 held as uint16 bits, as the cache stores it
        k, v = (jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.bfloat16), jnp.uint16) for x in (k, v))
    else:
        k, v = jnp.asarray(k), jnp.asarray(v)
    starts = jnp.asarray(rng.choice(N // Pg, size=(B, M), replace=True) * Pg, jnp.int32)
    rot = jnp.asarray(rng.integers(0, 40, (B, M * Pg)), jnp.int32)
    valid = jnp.asarray(rng.random((B, M * Pg)) < valid_frac)
    qs = jnp.asarray(rng.normal(size=(B, C, Hkv, G, D)) * 0.3, jnp.float32)
    inv = (1.0 / 1e4 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    return k, v, starts, rot, valid, qs, rotation_table(inv, 48, True)


def _xla_partial(k_stack, v_stack, layer, starts, Pg, rot, valid, qs, table):
    """survivor_attention_xla's partial over the same slots, read out of the store."""
    logical = (lambda x: jax.lax.bitcast_convert_type(x, jnp.bfloat16)) if k_stack.dtype == jnp.uint16 else (lambda x: x)
    k, v = (logical(read_layer_runs(x, layer, starts, Pg)) for x in (k_stack, v_stack))
    s = _survivor_scores(qs, k, rot, table, 4 << 20, 16 << 20)
    mask = valid[:, None, None, None, :]
    s = jnp.where(mask, s, MASK_VALUE)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    o = jnp.einsum("bkgcn,bknd->bkgcd", p, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return o, m, jnp.sum(p, axis=-1, keepdims=True)


@pytest.mark.parametrize("B,C,Hkv,G,D,M,Pg,bits", [(1, 1, 3, 3, 64, 4, 16, False),   # SmolLM2's decode step
                                                   (2, 3, 2, 2, 64, 3, 16, True),    # bfloat16 store, chunk rows
                                                   (1, 2, 1, 4, 128, 2, 8, False),   # head_dim 128
                                                   (2, 1, 2, 2, 18, 3, 5, True)])    # off the vector paths
def test_kernel_partial_is_the_xla_partial(B, C, Hkv, G, D, M, Pg, bits):
    rng = np.random.default_rng(drawn_seed(f"recalled_attention {B} {C} {D} {bits}"))
    k, v, starts, rot, valid, qs, table = _case(rng, B=B, C=C, Hkv=Hkv, G=G, D=D, M=M, Pg=Pg, bits=bits)
    runs = RA.StoredRuns(k, v, jnp.int32(1), starts, Pg, rot, valid)
    got = jax.jit(lambda qs: RA.recalled_partial(runs, qs, table))(qs)
    want = _xla_partial(k, v, 1, starts, Pg, rot, valid, qs, table)
    for name, g, w in zip("oml", got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5, err_msg=name)


def test_nothing_valid_is_an_empty_partial_and_a_position_off_the_table_is_loud():
    rng = np.random.default_rng(drawn_seed("recalled_attention edges"))
    k, v, starts, rot, valid, qs, table = _case(rng, B=2, C=1, Hkv=2, G=2, D=64, M=2, Pg=16, bits=False)
    none = RA.StoredRuns(k, v, jnp.int32(0), starts, 16, rot, jnp.zeros_like(valid))
    o, m, l = RA.recalled_partial(none, qs, table)
    assert not np.asarray(o).any() and not np.asarray(l).any() and (np.asarray(m) == np.float32(MASK_VALUE)).all()
    off = RA.StoredRuns(k, v, jnp.int32(0), starts, 16, rot.at[1, 0].set(table.shape[0]), valid.at[1, 0].set(True))
    o, m, l = RA.recalled_partial(off, qs, table)
    assert np.isnan(np.asarray(m[1])).all() and np.isfinite(np.asarray(m[0])).all()  # only that batch row


def test_kernel_under_vmap_gives_each_element_its_partial():
    rng = np.random.default_rng(drawn_seed("recalled_attention vmap"))
    cases = [_case(rng, B=1, C=1, Hkv=2, G=2, D=64, M=2, Pg=16, bits=False) for _ in range(3)]
    k, v, starts, rot, valid, qs = (jnp.stack([c[i] for c in cases]) for i in range(6))
    table = cases[0][6]
    call = lambda k, v, st, r, va, q: RA.recalled_partial(RA.StoredRuns(k, v, 2, st, 16, r, va), q, table)  # noqa: E731
    got = jax.jit(jax.vmap(call))(k, v, starts, rot, valid, qs)
    for p in range(3):
        for g, w in zip(got, call(*(x[p] for x in (k, v, starts, rot, valid, qs)))):
            np.testing.assert_array_equal(np.asarray(g[p]), np.asarray(w))


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_the_plain_loop_built_for_other_machines_gives_the_same_partial(tmp_path, march):
    """The source built without AVX-512 (its plain loops), registered under a name of its own, against XLA."""
    target = build_for_march(RA.SOURCE, "RecalledAttention", march, tmp_path)
    rng = np.random.default_rng(drawn_seed(f"recalled_attention {march}"))
    k, v, starts, rot, valid, qs, table = _case(rng, B=2, C=2, Hkv=2, G=2, D=64, M=3, Pg=16, bits=True)
    B, C, Hkv, G, D = qs.shape
    out = (jax.ShapeDtypeStruct((B, Hkv, G, C, D), jnp.float32),
           jax.ShapeDtypeStruct((B, Hkv, G, C, 1), jnp.float32), jax.ShapeDtypeStruct((B, Hkv, G, C, 1), jnp.float32))
    got = jax.ffi.ffi_call(target, out)(k, v, jnp.int32(1), starts, qs, rot, valid, jnp.asarray(table))
    for name, g, w in zip("oml", got, _xla_partial(k, v, 1, starts, 16, rot, valid, qs, table)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5, err_msg=name)


def test_decode_logits_are_those_of_the_xla_path(monkeypatch):
    """A decode with the recall tier gives the logits it gives with the kernel off, within float32 rounding (the
    kernel sums in another order), and recall changes them (so the kernel's part shows)."""
    import rsqr_jax as rj
    from rsqr_jax.models.tiny import tiny_config, tiny_model

    cfg = tiny_config(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=64)
    seed = drawn_seed("recalled_attention decode")
    apply_fn, params = tiny_model(cfg, seed)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(1, 72))
    cold = rj.ColdStore(64, 4, "max")
    run = lambda recall_pages=2: recall_decode_logits(  # noqa: E731  (a function of its own: traced anew)
        lambda *a, **k: apply_fn(*a, **k), params, cfg, tokens, cold, recall_pages)

    taken = []
    real = RA.applies
    monkeypatch.setattr(RA, "applies", lambda *a: taken.append(real(*a)) or taken[-1])
    with_kernel = run()
    assert True in taken and False in taken  # decode steps through the kernel, the 40-row prompt through XLA
    monkeypatch.setattr(RA, "applies", lambda *a: False)
    without = run()  # on XLA's path
    scale = np.abs(without).max()  # logits of a few units: float32 rounding through two layers, relative to them
    np.testing.assert_allclose(with_kernel, without, rtol=0, atol=1e-5 * scale)
    assert not np.allclose(with_kernel, run(recall_pages=0), atol=1e-3)
