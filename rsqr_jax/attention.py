"""Attention dispatch: one call of the two-segment contract routed to a kernel.

Every policy reuses the contract: the window is the pre-rotated segment, the survivor array the segment
rotated inside the kernel (at position 0, the identity, when its keys are stored pre-rotated). What goes
into each segment is decided by rsqr_jax.update; this module only picks the implementation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rsqr_jax.kernels.survivor_attention import survivor_attention, survivor_attention_reference, survivor_attention_xla

KERNELS = ("xla", "pallas", "auto", "reference")


def resolve_kernel(kernel: str) -> str:
    """'auto' -> 'pallas' on GPU, 'xla' elsewhere (Pallas only runs interpreted on CPU).

    'xla' is the CPU-tuned plain-XLA implementation of the contract, 'reference' the simple one that
    both are tested against."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}: choose one of {', '.join(KERNELS)}")
    if kernel == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return kernel


def attend(q_BxCxHqxD, win_k, win_v, win_pos_BxW, surv_k, surv_v, surv_rot_pos_BxS, surv_valid_BxS, q_pos_win_BxC,
           q_pos_surv_BxC, inv_freq, kernel: str, *, scale: float | None = None, logit_cap: float | None = None,
           sliding_window: int | None = None, raw_tail=None):
    """The contract (positions per batch row) with the chosen implementation.

    scale (None: head_dim ** -0.5), logit_cap (attention-logit soft-capping) and sliding_window (a local
    layer's window over the window segment) are static model constants; None leaves the program as it was.
    raw_tail: None, or R more slots of the survivor segment after its own (kernels.store.RawSegment, or
    kernels.store.StoredRuns where they still lie in a store). The XLA kernel attends them as a partial softmax of
    their own, so the two never become one array; the others take the segment joined (their contract has two
    segments)."""
    impl = resolve_kernel(kernel)
    kw = {k: v for k, v in (("scale", scale), ("logit_cap", logit_cap), ("sliding_window", sliding_window))
          if v is not None}
    if raw_tail is not None:
        if impl == "xla":
            kw["raw_tail"] = raw_tail
        else:
            tail_k, tail_v, tail_rot_pos, tail_valid = raw_tail.arrays()
            surv_k, surv_v = jnp.concatenate([surv_k, tail_k], axis=2), jnp.concatenate([surv_v, tail_v], axis=2)
            surv_rot_pos_BxS = jnp.concatenate([surv_rot_pos_BxS, tail_rot_pos], axis=1)
            surv_valid_BxS = jnp.concatenate([surv_valid_BxS, tail_valid], axis=1)
    args = (q_BxCxHqxD, win_k, win_v, win_pos_BxW, surv_k, surv_v, surv_rot_pos_BxS, surv_valid_BxS, q_pos_win_BxC,
            q_pos_surv_BxC, inv_freq)
    fn = {"pallas": survivor_attention, "xla": survivor_attention_xla, "reference": survivor_attention_reference}[impl]
    return fn(*args, **kw)
