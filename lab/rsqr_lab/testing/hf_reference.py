"""transformers' own float32 model of a GGUF file, and its streamed per-token NLL: the independent torch
reference for our loader and decoder (tests/, the experiments' HF rows). torch and transformers are
imported lazily, so importing this module costs nothing."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Callable

import numpy as np


def hf_gguf_model(gguf_path: str | os.PathLike):
    """transformers' own loading of a GGUF file as a float32 torch model (its own dequantization and its own
    q/k reverse permutation) — the independent reference for our GGUF loader.

    `from_pretrained(..., gguf_file=...)` requires `accelerate`; without it we drive transformers' GGUF
    reader (`load_gguf_checkpoint`, the function from_pretrained uses) directly.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(gguf_path)
    kw = dict(gguf_file=path.name, local_files_only=True)
    if importlib.util.find_spec("accelerate") is not None:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), dtype=torch.float32, attn_implementation="eager", **kw
        )
        return model.eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), **kw)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"transformers GGUF state dict mismatch: missing={missing[:3]} unexpected={unexpected[:3]}")
    model.tie_weights()
    return model.to(torch.float32).eval()


def hf_stream_nll(model, ids_T, *, chunk: int = 512, progress: Callable[[int], None] | None = None) -> np.ndarray:
    """Per-token NLL [T-1] (float64) of a torch causal LM over ids_T, fed in chunks with past_key_values
    (full attention: the reference every exact policy is compared with). progress(n_scored) per chunk."""
    import torch

    x = torch.as_tensor(np.asarray([ids_T], np.int64))
    n = x.shape[1] - 1
    past, out = None, []
    with torch.no_grad():
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            res = model(input_ids=x[:, s:e], past_key_values=past, use_cache=True)
            past = res.past_key_values
            logp = torch.log_softmax(res.logits.to(torch.float32), dim=-1)
            out.append(-logp.gather(-1, x[:, s + 1:e + 1, None])[0, :, 0].numpy())
            if progress is not None:
                progress(e)
    return np.concatenate(out).astype(np.float64)


def hf_reference_nll(model_path: str, ids_T, *, chunk: int = 512,
                     show_progress: bool = True) -> tuple[np.ndarray, dict]:
    """Per-token NLL [T-1] of HF transformers' own float32 model (torch, eager, full attention) of the same
    GGUF weights (hf_gguf_model), fed in chunks with past_key_values; and its timing."""
    import torch

    from rsqr_jax.eval.runtime import Timer, progress

    with Timer() as tm, progress(len(ids_T) - 1, "hf", enabled=show_progress) as bar:
        nll = hf_stream_nll(hf_gguf_model(model_path), ids_T, chunk=chunk, progress=lambda e: bar.update(e - bar.n))
    return nll, {"label": "hf", "wall_s": tm.wall, "cpu_s": tm.cpu, "chunk": chunk, "tokens": len(ids_T),
                 "torch_threads": torch.get_num_threads()}
