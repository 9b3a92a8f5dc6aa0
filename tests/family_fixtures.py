"""Tiny random Hugging Face models of the newer families (Qwen3, Mistral, Gemma 2, Gemma 3), built offline and
saved with save_pretrained together with a tiny tokenizer of the family's own class (a character-level BPE with a
few merges and a chat template), and their F32 GGUF as llama.cpp's converter writes it (Qwen3, Gemma 2, Gemma 3).

Weights are drawn large enough that every piece moves the logits (norm weights away from their neutral value,
q/k norms too), so a missing or misplaced norm, scale or soft-cap cannot hide under the parity tolerance."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """A tiny model of `arch` (qwen3, mistral, gemma2, gemma3); GQA (4 query heads, 2 KV heads), head_dim
    decoupled from hidden / heads. sliding_window: the local layers' window (None: none)."""

    arch: str
    vocab_size: int = 128  # the tokenizers below use ~106 ids
    hidden_size: int = 64
    intermediate_size: int = 96
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    max_position_embeddings: int = 512
    extra: tuple = ()  # further config keys, as sorted dict items
    seed: int = 0

    @property
    def config_kwargs(self) -> dict:
        return dict(self.extra)


FAMILY_SPECS = {
    "qwen3": FamilySpec("qwen3", seed=11),
    "qwen3_tied": FamilySpec("qwen3", tie_word_embeddings=True, head_dim=16, num_kv_heads=1, rope_theta=1e6,
                             seed=12),
    "mistral": FamilySpec("mistral", seed=13),
    "mistral_swa": FamilySpec("mistral", sliding_window=24, seed=14),
    "gemma2": FamilySpec("gemma2", num_layers=4, sliding_window=24, tie_word_embeddings=True, seed=15,
                         extra=tuple(sorted({"query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0,
                                             "final_logit_softcapping": 3.0}.items()))),
    "gemma3": FamilySpec("gemma3", num_layers=4, sliding_window=24, tie_word_embeddings=True, rope_theta=1e6, seed=16,
                         extra=tuple(sorted({"query_pre_attn_scalar": 24, "sliding_window_pattern": 2,
                                             "rope_local_base_freq": 10000.0,
                                             "rope_scaling": {"rope_type": "linear", "factor": 4.0}}.items()))),
}
# Full attention: the same Gemma models with a window that spans the context (512 = max_position_embeddings).
FAMILY_SPECS["gemma2_full"] = dataclasses.replace(FAMILY_SPECS["gemma2"], sliding_window=512, seed=17)
FAMILY_SPECS["gemma3_full"] = dataclasses.replace(FAMILY_SPECS["gemma3"], sliding_window=512, seed=18)


def hf_config(spec: FamilySpec):
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Qwen3Config

    common = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                  num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                  num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, rms_norm_eps=1e-5,
                  max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=spec.tie_word_embeddings,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager")
    extra = spec.config_kwargs
    if spec.arch == "qwen3":
        return Qwen3Config(**common, rope_theta=spec.rope_theta, use_sliding_window=False)
    if spec.arch == "mistral":
        return MistralConfig(**common, rope_theta=spec.rope_theta, sliding_window=spec.sliding_window)
    if spec.arch == "gemma2":
        return Gemma2Config(**common, rope_theta=spec.rope_theta, sliding_window=spec.sliding_window, **extra)
    if spec.arch == "gemma3":
        pattern = extra.pop("sliding_window_pattern")
        local_theta = extra.pop("rope_local_base_freq")
        scaling = extra.pop("rope_scaling")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(spec.num_layers)]
        rope = {"full_attention": {"rope_theta": spec.rope_theta, **scaling},
                "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
        return Gemma3TextConfig(**common, sliding_window=spec.sliding_window, layer_types=types, rope_parameters=rope,
                                **extra)
    raise ValueError(spec.arch)


def model_class(arch: str):
    import transformers

    return getattr(transformers, {"qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
                                  "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[arch])


def build_hf_model(spec: FamilySpec):
    """A float32 random model: matrices N(0, 0.2); Llama-style norm weights 1 + N(0, 0.1) and Gemma's
    (1 + w) ones w = N(0, 0.3), so every norm visibly matters."""
    import torch

    torch.manual_seed(spec.seed)
    model = model_class(spec.arch)(hf_config(spec)).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(spec.seed)
    gemma = spec.arch.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen) if gemma else 1.0 + 0.1 * torch.randn(
                    p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def save_hf_model(spec: FamilySpec, directory: str | os.PathLike) -> Path:
    """The model and its tokenizer, saved the way a checkpoint on the hub is."""
    directory = Path(directory)
    build_hf_model(spec).save_pretrained(directory, safe_serialization=True)
    build_tokenizer(spec.arch).save_pretrained(directory)
    return directory


# The tokenizer class each family's checkpoints name, its special tokens (ids 0, 1, 2 are the configs' pad /
# bos / eos), how it marks a space, and a chat template in the family's format.
_QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                   "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
                   "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
_MISTRAL_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} "
                     "[/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
TOKENIZERS = {
    "qwen3": ("Qwen2Tokenizer", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "\u0120", _QWEN_TEMPLATE),
    "gemma2": ("GemmaTokenizer", ("<pad>", "<bos>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>"), "\u2581",
               _GEMMA_TEMPLATE),
    "gemma3": ("GemmaTokenizer", ("<pad>", "<bos>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>"), "\u2581",
               _GEMMA_TEMPLATE),
    "mistral": ("LlamaTokenizer", ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), "\u2581", _MISTRAL_TEMPLATE),
}


def build_tokenizer(arch: str):
    """A tiny tokenizer of `arch`'s own class: its special tokens, printable ASCII and newline one id each
    (byte-level for Qwen, "\u2581" spaces for the SentencePiece-style ones), and merges up to " the"."""
    import transformers

    cls, specials, space, template = TOKENIZERS[arch]
    newline = "\u010a" if arch == "qwen3" else "\n"
    vocab = {t: i for i, t in enumerate(specials)}
    for c in [space, newline, *map(chr, range(33, 127))]:
        vocab.setdefault(c, len(vocab))
    merges = [(space, "t"), ("h", "e"), (space + "t", "he")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    kw = {"unk_token": specials[0], "eos_token": specials[2], "pad_token": specials[0]}
    if arch != "qwen3":
        kw.update(bos_token=specials[1], unk_token="<unk>")
    tok = getattr(transformers, cls)(vocab=vocab, merges=merges, **kw)
    # the turn markers are special tokens (one id each, never split), as in the families' own tokenizers
    tok.add_special_tokens({"additional_special_tokens": [t for t in specials if t not in tok.all_special_tokens]})
    tok.chat_template = template
    return tok


def write_qwen3_gguf(hf_model, spec: FamilySpec, path: str | os.PathLike, sliding_window: int | None = None,
                     arch: str = "qwen3") -> Path:
    """An F32 GGUF of a tiny Qwen3 the way convert_hf_to_gguf writes one (Qwen3Model: Qwen2's tensor names, q/k
    rows not permuted, the per-head norms as attn_q_norm / attn_k_norm). Token list: placeholders <t{i}>.
    sliding_window: also write <arch>.attention.sliding_window; arch: the architecture the file names (another
    one only for tests of the loader's metadata)."""
    from tests.hf_fixtures import gguf_writer

    assert spec.arch == "qwen3"
    w = gguf_writer(path, arch, spec, 1e-5, sliding_window)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf_model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    names = [("input_layernorm.weight", "attn_norm.weight"), ("self_attn.q_proj.weight", "attn_q.weight"),
             ("self_attn.k_proj.weight", "attn_k.weight"), ("self_attn.v_proj.weight", "attn_v.weight"),
             ("self_attn.o_proj.weight", "attn_output.weight"), ("self_attn.q_norm.weight", "attn_q_norm.weight"),
             ("self_attn.k_norm.weight", "attn_k_norm.weight"), ("post_attention_layernorm.weight", "ffn_norm.weight"),
             ("mlp.gate_proj.weight", "ffn_gate.weight"), ("mlp.up_proj.weight", "ffn_up.weight"),
             ("mlp.down_proj.weight", "ffn_down.weight")]
    for i in range(spec.num_layers):
        for hf, gg in names:
            w.add_tensor(f"blk.{i}.{gg}", np.ascontiguousarray(sd[f"model.layers.{i}.{hf}"]))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not spec.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def write_sentencepiece_model(tok, path: str | os.PathLike) -> Path:
    """A tiny tokenizer of build_tokenizer as the SentencePiece BPE model file Gemma checkpoints ship
    (tokenizer.model, which llama.cpp's converter reads): its pieces in id order, the special tokens as control
    pieces (the unknown token as unknown), scores falling with the id (llama.cpp merges by score)."""
    from sentencepiece import sentencepiece_model_pb2 as sp

    m = sp.ModelProto()
    special = set(tok.all_special_tokens)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    for piece, i in vocab:
        kind = sp.ModelProto.SentencePiece.UNKNOWN if piece == tok.unk_token else (
            sp.ModelProto.SentencePiece.CONTROL if piece in special else sp.ModelProto.SentencePiece.NORMAL)
        m.pieces.add(piece=piece, score=0.0 if piece in special else -float(i), type=kind)
    ids = tok.get_vocab()
    t = m.trainer_spec
    t.model_type, t.vocab_size, t.byte_fallback = sp.TrainerSpec.BPE, len(vocab), False
    t.unk_id, t.bos_id, t.eos_id, t.pad_id = (ids[x] for x in (tok.unk_token, tok.bos_token, tok.eos_token,
                                                                tok.pad_token))
    n = m.normalizer_spec
    n.name, n.add_dummy_prefix, n.remove_extra_whitespaces, n.escape_whitespaces = "identity", False, False, True
    Path(path).write_bytes(m.SerializeToString())
    return Path(path)


# HF Gemma tensor names (under model.layers.{i}.) -> llama.cpp's (under blk.{i}.), as convert_hf_to_gguf maps them
_GEMMA_TENSORS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                  "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                  "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
                  "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
                  "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gemma_gguf(spec: FamilySpec, directory: str | os.PathLike, path: str | os.PathLike, *,
                     sliding_window_pattern=None, omit: tuple[str, ...] = ()) -> Path:
    """An F32 GGUF of a saved tiny Gemma 2 / Gemma 3 directory (with its tokenizer.model: write_sentencepiece_model)
    the way convert_hf_to_gguf writes one (Gemma2Model / Gemma3Model). Metadata: the window, the soft-caps (Gemma
    2 both; Gemma 3 the logit one when set), Gemma 3's global RoPE base and linear scaling and its local base as
    rope.freq_base_swa, no RoPE base for Gemma 2, and neither the local:global pattern nor the query scale (llama.cpp
    assumes them). Tensors: llama.cpp's names, q/k rows not permuted, 1 added to every norm weight (Gemma's
    (1 + w)), no output.weight (tied). Vocabulary: tokenizer.model's pieces padded with [PAD{i}] to the config's
    vocab_size, its special tokens and chat template (gguf's SpecialVocab, as the converter reads them).
    sliding_window_pattern: also write attention.sliding_window_pattern (llama.cpp reads it; the converter does not
    for these families); omit: metadata keys to leave out."""
    import json

    import gguf
    from safetensors.numpy import load_file
    from sentencepiece import SentencePieceProcessor

    from tests.hf_fixtures import gguf_writer

    directory = Path(directory)
    cfg = json.loads((directory / "config.json").read_text())
    w = gguf_writer(path, spec.arch, spec, cfg["rms_norm_eps"], cfg["sliding_window"], rope=False, vocab=False)
    if spec.arch == "gemma3":
        rope = cfg["rope_parameters"]
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        if rope["full_attention"].get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    else:
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if sliding_window_pattern is not None:
        w.add_sliding_window_pattern(sliding_window_pattern)

    sp = SentencePieceProcessor(model_file=str(directory / "tokenizer.model"))
    n = cfg["vocab_size"]
    tokens, scores, types = [f"[PAD{i}]" for i in range(n)], [-10000.0] * n, [gguf.TokenType.UNUSED] * n
    for i in range(sp.vocab_size()):
        tokens[i], scores[i] = sp.IdToPiece(i), sp.GetScore(i)
        types[i] = (gguf.TokenType.UNKNOWN if sp.IsUnknown(i) else gguf.TokenType.CONTROL if sp.IsControl(i)
                    else gguf.TokenType.NORMAL)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    gguf.SpecialVocab(directory, n_vocab=n).add_to_gguf(w)
    w.add_add_space_prefix(False)
    for key in omit:
        del w.kv_data[0][key]

    sd = load_file(str(directory / "model.safetensors"))
    shift = lambda name, x: x + np.float32(1) if name.endswith("norm.weight") else x  # noqa: E731
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(spec.num_layers):
        for hf, gg in _GEMMA_TENSORS.items():
            name = f"model.layers.{i}.{hf}.weight"
            if name in sd:
                w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(shift(name, sd[name])))
    w.add_tensor("output_norm.weight", shift("model.norm.weight", sd["model.norm.weight"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


STEPS: dict = {}  # (id(model), CacheSpec) -> (jitted step, params); a test module clears it when it ends


def stream_logits(model, policy, ids_T, chunks, **spec_kw):
    """Logits [T, V] (numpy) of ids_T fed to a loaded model (rsqr_jax.models.llama.load_model) in chunks of the
    given sizes, then one token at a time, under `policy`; and the final cache and its spec (made from the model
    config, so a hybrid model's local layers get their rings)."""
    import jax
    import jax.numpy as jnp

    from rsqr_jax.cache import init_cache
    from rsqr_jax.models.llama import split_apply
    from rsqr_jax.spec import CacheSpec
    from rsqr_jax.recall import config_of
    from rsqr_jax.engine import step

    T = len(ids_T)
    spec = CacheSpec.for_policies(policy, dims=model.config, max_chunk=max(chunks), max_len=T, **spec_kw)
    key = (id(model), spec)
    if key not in STEPS:  # one jitted step per model and spec: policies are traced values, so they share it
        apply_fn, params = split_apply(model.model)
        STEPS[key] = (jax.jit(lambda p, tok, c, pol: step(apply_fn, p, tok, c, pol, recall=config_of(spec))), params)
    run, params = STEPS[key]
    cache, out, n = init_cache(spec), [], 0
    sizes = list(chunks)
    while n < T:
        c = min(sizes.pop(0) if sizes else 1, T - n)
        logits, cache = run(params, jnp.asarray(ids_T[None, n:n + c], jnp.int32), cache, policy)
        out.append(np.asarray(logits[0]))
        n += c
    return np.concatenate(out), cache, spec
