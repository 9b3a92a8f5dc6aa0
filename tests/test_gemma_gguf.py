"""Gemma 2 and Gemma 3 (text) from GGUF files as llama.cpp's converter writes them (tests/family_fixtures.py
write_gemma_gguf): the config the HF directory gives, its weights and logits, the tokenizer from the file, what
the loader assumes where the file is silent (as llama.cpp does), and `decode.py --policy rsqr` on the file."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from rsqr_jax.models.config import GLOBAL, LOCAL, ModelLoadError
from tests import family_fixtures as F
from tests.test_families import _hf_greedy_reply, _parity, _text_ids

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _items(**kw) -> tuple:
    return tuple(sorted(kw.items()))


# The tiny Gemma models of tests/test_hybrid.py (GQA, a decoupled head_dim, a 24-token window, norm weights and
# soft-caps that move the logits), with what a GGUF can carry: llama.cpp reads no query scale from the file (it
# is head_dim ** -0.5 but for the 27B models), so query_pre_attn_scalar is head_dim; the converter writes no
# local:global pattern and llama.cpp assumes Gemma 3's 5:1, so the Gemma 3 model has six layers, the last global.
SPECS = {
    "gemma2": dataclasses.replace(F.FAMILY_SPECS["gemma2"], seed=31, extra=_items(
        query_pre_attn_scalar=32, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": dataclasses.replace(F.FAMILY_SPECS["gemma3"], num_layers=6, seed=32, extra=_items(
        query_pre_attn_scalar=32, sliding_window_pattern=6, rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0})),
}
LAYER_TYPES = {"gemma2": (LOCAL, GLOBAL) * 2, "gemma3": (LOCAL,) * 5 + (GLOBAL,)}


def _save(spec, directory):
    """The saved HF directory with the tokenizer.model the converter reads."""
    F.save_hf_model(spec, directory)
    F.write_sentencepiece_model(F.build_tokenizer(spec.arch), directory / "tokenizer.model")
    return directory


@pytest.fixture(scope="module")
def gemma_files(tmp_path_factory):
    """{name: (spec, HF dir, GGUF path)}, built once per module."""
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("gemma_gguf")
    out = {}
    for name, spec in SPECS.items():
        directory = _save(spec, root / name)
        out[name] = spec, directory, F.write_gemma_gguf(spec, directory, root / f"{name}.gguf")
    return out


@pytest.mark.parametrize("name", list(SPECS))
def test_config_equals_hf(gemma_files, name):
    """Every field of the config (window, layer types, soft-caps, query scale, both RoPEs, eos ids ...) is the
    one the HF directory gives."""
    from rsqr_jax.models.loading import load_config

    spec, directory, path = gemma_files[name]
    cfg = load_config(path)
    assert cfg == load_config(directory)
    assert cfg.layer_types == LAYER_TYPES[name] and cfg.local_window == 24 and cfg.qk_norm == (name == "gemma3")
    assert cfg.eos_token_ids == (2, 5)  # <eos>, and <end_of_turn> (llama.cpp ends generation on it by its text)


@pytest.mark.parametrize("name", list(SPECS))
def test_weights_equal_hf(gemma_files, name):
    """The canonical weights are the directory's: the norms with the converter's +1 taken off again (to float32
    rounding of w + 1), everything else to the bit."""
    from rsqr_jax.models.loading import load_config, load_weights

    spec, directory, path = gemma_files[name]
    ours, ref = load_weights(path), load_weights(directory, load_config(directory))
    assert ours.keys() == ref.keys()
    for k in ref:
        if k.endswith("norm"):
            np.testing.assert_allclose(ours[k], ref[k], rtol=0, atol=1.2e-7, err_msg=k)
            assert np.abs(ref[k]).mean() > 0.1  # the norms are away from their neutral value: the +1 matters
        else:
            np.testing.assert_array_equal(ours[k], ref[k], err_msg=k)


@pytest.mark.parametrize("name", list(SPECS))
def test_logits_equal_hf(gemma_files, name):
    """200 tokens of text (past the 24-token window) from the GGUF: transformers' logits on the directory to
    float32 tolerance, greedy tokens identical."""
    from rsqr_jax.models.llama import forward_logits

    spec, directory, path = gemma_files[name]
    print(f"{name}: seed {spec.seed}")
    ids = _text_ids(directory, spec)
    ours = forward_logits(str(path), ids.astype(np.int32))
    ref = _parity(directory, spec, ids, ours_fn=lambda: ours)
    print(f"{name}: max |dlogit| = {float(np.abs(np.asarray(ours) - ref).max()):.3g}")


@pytest.mark.parametrize("name", list(SPECS))
def test_tokenizer_from_gguf(gemma_files, name):
    """The file's tokenizer (transformers' Gemma GGUF converter) splits text as the directory's does, renders the
    same chat prompt with each turn marker one id, and adds <bos> as llama.cpp does for a SentencePiece
    vocabulary."""
    from transformers import AutoTokenizer

    from rsqr_jax.models.loading import load_tokenizer

    spec, directory, path = gemma_files[name]
    ours, ref = load_tokenizer(path), AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    text = "the cat sat on the mat,\nthen it ran to see what was there: 42."
    assert ours(text, add_special_tokens=False).input_ids == ref(text, add_special_tokens=False).input_ids
    assert ours(text).input_ids[0] == ours.bos_token_id == 1
    chat = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"}]
    prompt = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert prompt == ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = ours(prompt, add_special_tokens=False).input_ids
    assert ids == ref(prompt, add_special_tokens=False).input_ids
    assert {1, 4, 5} <= set(ids)  # <bos>, <start_of_turn>, <end_of_turn>: one id each


def _config_of(spec, directory, path, **kw):
    from rsqr_jax.models.loading import load_config

    return load_config(F.write_gemma_gguf(spec, directory, path, **kw))


def test_what_llamacpp_assumes(gemma_files, tmp_path):
    """Where a Gemma file is silent the loader assumes what llama.cpp does: Gemma 2's 4096 window (then spanning
    this context), 50 and 30 soft-caps and 1:1 pattern, Gemma 3's local RoPE base 10000 and no window without
    the key (every layer global, one RoPE); an explicit attention.sliding_window_pattern (a period or one flag per
    layer) is read; the 27B layer counts (46, 62) scale queries by hidden / heads."""
    (s2, d2, _), (s3, d3, _) = gemma_files["gemma2"], gemma_files["gemma3"]
    silent = _config_of(s2, d2, tmp_path / "g2.gguf", omit=("gemma2.attention.sliding_window",
                                                            "gemma2.attn_logit_softcapping",
                                                            "gemma2.final_logit_softcapping"))
    assert (silent.sliding_window, silent.layer_types) == (None, LAYER_TYPES["gemma2"])  # 4096 >= 512
    assert (silent.attn_logit_softcap, silent.final_logit_softcap, silent.local_rope_theta) == (50.0, 30.0, None)
    from rsqr_jax.models.loading import load_config

    no_swa_base = _config_of(s3, d3, tmp_path / "g3.gguf", omit=("gemma3.rope.freq_base_swa",))
    assert no_swa_base == load_config(d3) and no_swa_base.local_rope_theta == 10000.0
    no_window = _config_of(s3, d3, tmp_path / "g3w.gguf", omit=("gemma3.attention.sliding_window",))
    assert (no_window.layer_types, no_window.local_window, no_window.local_rope_theta) == (None, 0, None)
    for pattern in (2, [True, False] * 3):
        typed = _config_of(s3, d3, tmp_path / "g3p.gguf", sliding_window_pattern=pattern)
        assert typed.layer_types == (LOCAL, GLOBAL) * 3, pattern
    assert _config_of(s3, d3, tmp_path / "g3a.gguf", sliding_window_pattern=0).layer_types == (LOCAL,) * 6
    for spec, directory, layers in ((s2, d2, 46), (s3, d3, 62)):  # metadata of a 27B; config only
        big = _config_of(dataclasses.replace(spec, num_layers=layers), directory, tmp_path / "big.gguf")
        assert big.query_pre_attn_scalar == spec.hidden_size // spec.num_heads != spec.head_dim
        assert big.layer_types[:6] == ((LOCAL, GLOBAL) * 3 if spec.arch == "gemma2" else LAYER_TYPES["gemma3"])


def test_bad_gemma_gguf_one_line(gemma_files, tmp_path):
    """What cannot be known is refused in one line: a Gemma file without its RMSNorm epsilon (llama.cpp requires
    it too), a pattern naming another layer count; decode.py exits 2 with the line."""
    from rsqr_jax.models.loading import load_config
    from tests.cli import assert_one_line_error, run_in_process

    spec, directory, _ = gemma_files["gemma3"]
    no_eps = F.write_gemma_gguf(spec, directory, tmp_path / "eps.gguf",
                                omit=("gemma3.attention.layer_norm_rms_epsilon",))
    with pytest.raises(ModelLoadError, match="layer_norm_rms_epsilon missing") as e:
        load_config(no_eps)
    assert "\n" not in str(e.value)
    with pytest.raises(ModelLoadError, match="sliding_window_pattern has 4 entries for 6 layers"):
        _config_of(spec, directory, tmp_path / "pattern.gguf", sliding_window_pattern=[True, False] * 2)
    proc = run_in_process("decode.py", "--model", str(no_eps), "--prompt", "hi", "--max-new-tokens", "2")
    assert_one_line_error(proc, "layer_norm_rms_epsilon missing", after_status=True)


@pytest.mark.slow
def test_decode_rsqr_on_gemma_gguf(gemma_files, capsys):
    """`decode.py --model tiny_gemma.gguf --policy rsqr` (rsqr_jax.cli.decode.main, in process): the greedy reply
    is transformers' on the directory the file came from (the prompt overflows the local window), and the local
    layers keep their rings."""
    from rsqr_jax.cli import decode

    prompt, n = "the cat sat on the mat and then it ran", 12
    for name in SPECS:
        spec, directory, path = gemma_files[name]
        assert decode.main(["--model", str(path), "--policy", "rsqr", "--prompt", prompt, "--max-new-tokens", str(n),
                            "--temperature", "0", "--repeat-penalty", "1", "--json", "--no-progress"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["n_prompt_tokens"] > 24 and out["cache_bytes"]["local_window"] > 0, out
        assert out["text"] == _hf_greedy_reply(directory, prompt, out["n_generated"]), (name, out)
