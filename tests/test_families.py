"""The newer families (Qwen3, Mistral, Gemma 2, Gemma 3) against transformers, their loaders (HF directories and
GGUF), and the one-line error every other architecture gets."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from rsqr_jax.models.config import ModelLoadError
from tests import family_fixtures as F
from tests import hf_fixtures

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """{name: (spec, dir)} for the tiny Qwen3 and Mistral models (Gemma: tests/test_hybrid.py), built and saved
    once per module."""
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("families")
    return {name: (F.FAMILY_SPECS[name], F.save_hf_model(F.FAMILY_SPECS[name], root / name))
            for name in ("qwen3", "qwen3_tied", "mistral", "mistral_swa")}


def _ids(spec, T=200, B=1):
    return np.random.default_rng(spec.seed).integers(0, spec.vocab_size, size=(B, T), dtype=np.int64)


WORDS = ("the", "cat", "sat", "on", "a", "mat", "then", "it", "ran", "to", "see", "what", "was", "there", "42")


def _text_ids(directory, spec, T=200):
    """[1, T] ids of a seeded random text, through the directory's own tokenizer as the loader returns it;
    transformers' AutoTokenizer on the same directory must give the same ids."""
    from transformers import AutoTokenizer

    from rsqr_jax.models.loading import load_tokenizer

    rng = np.random.default_rng(spec.seed)
    text = " ".join(rng.choice(WORDS, size=T)) + "."
    ids = load_tokenizer(directory)(text, add_special_tokens=False).input_ids
    assert ids == AutoTokenizer.from_pretrained(str(directory), local_files_only=True)(
        text, add_special_tokens=False).input_ids
    assert len(ids) >= T and max(ids) < spec.vocab_size
    return np.asarray(ids[:T], np.int64)[None]


def _parity(directory, spec, ids, ours_fn=None):
    from rsqr_jax.models.llama import forward_logits

    ref = hf_fixtures.hf_logits(directory, ids)
    ours = np.asarray(forward_logits(str(directory), ids.astype(np.int32)) if ours_fn is None else ours_fn())
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    err = float(np.abs(ours - ref).max())
    assert err < 1e-4, f"{spec.arch} seed {spec.seed}: max |dlogit| = {err:.3g} (logit scale {np.abs(ref).max():.3g})"
    assert (ours.argmax(-1) == ref.argmax(-1)).all(), f"{spec.arch} seed {spec.seed}: greedy tokens differ"
    return ref


STAGE1 = ["qwen3", "qwen3_tied", "mistral"]


@pytest.mark.parametrize("name", STAGE1)
def test_parity_with_transformers(family_dirs, name):
    """~200 tokens of text through the directory's own tokenizer: logits to float32 tolerance, greedy
    tokens identical (the reference is the directory as saved, reloaded by transformers)."""
    spec, directory = family_dirs[name]
    print(f"{name}: seed {spec.seed}")
    _parity(directory, spec, _text_ids(directory, spec))


@pytest.mark.parametrize("name", STAGE1)
def test_tokenizer_is_the_familys_own(family_dirs, name):
    """The loader returns the tokenizer transformers picks for the directory (by model type), with its chat
    template, and the turn markers one id each."""
    from transformers import AutoTokenizer

    from rsqr_jax.models.loading import load_tokenizer

    spec, directory = family_dirs[name]
    tok = load_tokenizer(directory)
    _, specials, _, _ = F.TOKENIZERS[spec.arch]
    assert type(tok) is type(AutoTokenizer.from_pretrained(str(directory), local_files_only=True))
    prompt = tok.apply_chat_template([{"role": "user", "content": "the cat"}], add_generation_prompt=True,
                                     tokenize=False)
    ids = tok(prompt, add_special_tokens=False).input_ids
    markers = set(tok.convert_tokens_to_ids([t for t in specials[1:] if t in prompt]))
    assert markers and markers <= set(ids), (prompt, ids)  # every turn marker in the prompt is one id
    assert "the cat" in tok.decode(ids)


def test_qwen3_config_and_weights(family_dirs):
    from rsqr_jax.models.loading import canonical_shapes, load_config, load_weights

    spec, directory = family_dirs["qwen3"]
    cfg = load_config(directory)
    assert (cfg.arch, cfg.qk_norm, cfg.attention_bias, cfg.head_dim) == ("qwen3", True, False, spec.head_dim)
    assert cfg.head_dim * cfg.num_heads != cfg.hidden_size  # decoupled head_dim is what the fixture exercises
    w = load_weights(directory, cfg)
    assert {k: v.shape for k, v in w.items()} == canonical_shapes(cfg)
    sd = {k: v.numpy() for k, v in F.build_hf_model(spec).state_dict().items()}
    for i in range(cfg.num_layers):
        np.testing.assert_array_equal(w["q_norm"][i], sd[f"model.layers.{i}.self_attn.q_norm.weight"])
        np.testing.assert_array_equal(w["k_norm"][i], sd[f"model.layers.{i}.self_attn.k_norm.weight"])


def test_qwen3_norms_matter(family_dirs):
    """The q/k norms move the logits: with them dropped the parity bound fails (the test above can fail)."""
    import jax.numpy as jnp

    from rsqr_jax.models.llama import forward_logits, load_model

    spec, directory = family_dirs["qwen3"]
    loaded = load_model(str(directory))
    ids = _ids(spec, T=32)
    ref = forward_logits(loaded, ids.astype(np.int32))
    saved = loaded.model.q_norm[...]
    loaded.model.q_norm[...] = jnp.ones_like(saved)
    try:
        off = forward_logits(loaded, ids.astype(np.int32))
    finally:
        loaded.model.q_norm[...] = saved
    assert float(np.abs(off - ref).max()) > 1e-2


def test_qwen3_gguf_round_trip(family_dirs, tmp_path):
    """A Qwen3 GGUF as llama.cpp writes it (no q/k permutation, attn_q_norm / attn_k_norm) loads back to the
    HF logits."""
    from rsqr_jax.models.loading import load_config

    spec, directory = family_dirs["qwen3"]
    path = F.write_qwen3_gguf(F.build_hf_model(spec), spec, tmp_path / "qwen3.gguf")
    cfg = load_config(path)
    assert (cfg.arch, cfg.qk_norm, cfg.head_dim, cfg.tie_word_embeddings) == ("qwen3", True, spec.head_dim, False)
    _parity(directory, spec, _ids(spec, T=64), ours_fn=lambda: __import__(
        "rsqr_jax.models.llama", fromlist=["x"]).forward_logits(str(path), _ids(spec, T=64).astype(np.int32)))
    # a `llama` (Mistral) file that records a window shorter than its context gets it on every layer, not full
    # attention; Qwen's window is never on (use_sliding_window is false in its checkpoints), so it is ignored
    hf = F.build_hf_model(spec)
    windowed = load_config(F.write_qwen3_gguf(hf, spec, tmp_path / "swa.gguf", sliding_window=24, arch="llama"))
    assert (windowed.local_layers, windowed.local_window) == (spec.num_layers, 24)
    assert load_config(F.write_qwen3_gguf(hf, spec, tmp_path / "q.gguf", sliding_window=24)).local_layers == 0


def _unsupported_dir(tmp_path, family_dirs):
    return _with_config(family_dirs["mistral"][1], tmp_path, "phi", model_type="phi3",
                        architectures=["Phi3ForCausalLM"])


def test_unsupported_architecture_one_line(family_dirs, tmp_path):
    from rsqr_jax.models.loading import load_config

    with pytest.raises(ModelLoadError) as e:
        load_config(_unsupported_dir(tmp_path, family_dirs))
    msg = str(e.value)
    assert "\n" not in msg and "Phi3ForCausalLM" in msg and "Qwen3ForCausalLM" in msg, msg


def test_decode_unsupported_model_exits_2(family_dirs, tmp_path):
    from tests.cli import assert_one_line_error, run_script

    proc = run_script("decode.py", "--model", str(_unsupported_dir(tmp_path, family_dirs)), "--prompt", "hi",
                      "--max-new-tokens", "2")
    assert_one_line_error(proc, "unsupported architecture", after_status=True)


def _with_config(directory, tmp_path, name, **changes):
    """A copy of a saved model directory with config.json keys changed."""
    out = tmp_path / name
    shutil.copytree(directory, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_mistral_sliding_window(family_dirs, tmp_path):
    """A Mistral window (24) shorter than the context: every layer keeps a ring of exactly its window (no policy
    layer is left), matching transformers over 200 tokens in one chunk and streamed (a chunk longer than the
    window, shorter ones, then token by token) under any policy; a window that spans max_position_embeddings
    is full attention."""
    from rsqr_jax import policy as P
    from rsqr_jax.models.llama import forward_logits, load_model
    from rsqr_jax.models.loading import load_config

    spec, directory = family_dirs["mistral_swa"]
    print(f"mistral_swa: seed {spec.seed}")
    model = load_model(str(directory))
    cfg = model.config
    assert (cfg.local_layers, cfg.local_window) == (cfg.num_layers, 24)
    ids = _text_ids(directory, spec)
    ref = _parity(directory, spec, ids, ours_fn=lambda: forward_logits(model, ids.astype(np.int32)))[0]
    try:
        streamed, cache, cspec = F.stream_logits(model, P.rsqr(window=16, sinks=2, delta=3, max_survivors=6),
                                                 ids[0, :80], [40, 16])
    finally:
        F.STEPS.clear()
    assert (cspec.num_layers, cspec.local_layers) == (0, cfg.num_layers) and cache.win_k.size == 0
    assert float(np.abs(streamed - ref[:80]).max()) < 1e-4 and (streamed.argmax(-1) == ref[:80].argmax(-1)).all()
    assert sorted(int(g) for g in np.asarray(cache.loc_pos)) == list(range(80 - 24, 80))
    _, plain = family_dirs["mistral"]
    cfg = load_config(_with_config(plain, tmp_path, "wide", sliding_window=spec.max_position_embeddings))
    assert (cfg.arch, cfg.local_layers, cfg.sliding_window) == ("mistral", 0, None)
    assert load_config(plain).sliding_window is None


def _hf_greedy_reply(directory, prompt: str, n: int) -> str:
    """transformers' greedy reply to one chat turn, from the saved directory and its own tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, local_files_only=True).eval()
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    ids = torch.as_tensor([tok(text, add_special_tokens=False).input_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


@pytest.mark.slow
def test_decode_rsqr_on_each_family(family_dirs):
    """`decode.py --model DIR --policy rsqr` on a saved tiny Qwen3 and Mistral, and a Mistral whose 24-token
    sliding window the prompt overflows (one process for all): the greedy reply is transformers' greedy reply
    (the prompt fits the policy's window, so rsqr attends everything the model itself does)."""
    from tests.cli import run_scripts

    prompt, n = "the cat sat on the mat", 12
    names = ["qwen3", "mistral", "mistral_swa"]
    args = ["--policy", "rsqr", "--prompt", prompt, "--max-new-tokens", str(n), "--temperature", "0",
            "--repeat-penalty", "1", "--json", "--no-progress"]
    procs = run_scripts([("decode.py", ["--model", str(family_dirs[name][1]), *args]) for name in names])
    for name, proc in zip(names, procs):
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = json.loads(proc.stdout)
        assert out["policy"] == "rsqr" and out["n_generated"] >= 1, out
        print(name, repr(out["text"]), out["n_generated"])
        assert out["text"] == _hf_greedy_reply(family_dirs[name][1], prompt, out["n_generated"]), (name, out)


def test_sweep_and_session_on_qwen3(family_dirs, tmp_path):
    """What a policy reaches, on a tiny Qwen3: a vmapped sweep gives each policy's own streamed NLL, and a
    session saved mid-stream resumes exactly."""
    from rsqr_jax import policy as P
    from rsqr_jax.engine import stream_nll
    from rsqr_jax.models.llama import load_model, split_apply
    from rsqr_jax.session import Session
    from rsqr_jax.spec import CacheSpec
    from rsqr_jax.sweep import sweep_nll

    spec, directory = family_dirs["qwen3"]
    model = load_model(str(directory))
    cfg = model.config
    apply_fn, params = split_apply(model.model)
    ids = _text_ids(directory, spec, T=48).astype(np.int32)
    pols = [P.rsqr(window=16, sinks=2, delta=3, max_survivors=6), P.streamingllm(window=16, sinks=2)]
    swept = np.asarray(sweep_nll(apply_fn, params, ids, pols, config=cfg, chunk=4))
    for p, pol in enumerate(pols):
        own = CacheSpec.for_policies(pol, dims=cfg, max_chunk=4, max_len=48)
        nll, _ = stream_nll(apply_fn, params, ids, pol, own, chunk=4, segment=4)
        np.testing.assert_allclose(swept[p], np.asarray(nll), rtol=2e-4, atol=2e-4)
    assert np.abs(swept[0] - swept[1]).max() > 1e-3  # survivors change the stream's NLL

    kw = dict(dims=cfg, chunk=8, seed=5, vocab_size=cfg.vocab_size)
    a = Session.create(apply_fn, params, pols[0], **kw)
    a.feed(ids[0, :40].tolist())
    a.generate(4)
    a.save(tmp_path / "qwen3.session", model.identity)
    rest = a.generate(8)
    b = Session.load(tmp_path / "qwen3.session", apply_fn, params, model.identity)
    assert b.generate(8) == rest
