"""lm-evaluation-harness model (rsqr_jax/eval/lm_eval_model.py, scripts/eval_tasks.py) on the shipped local task group
(tests/data/lm_eval_task: multiple choice, generation, rolling perplexity), offline.

With policy=full every loglikelihood equals lm-eval's own `hf` backend on transformers' loading of the same
GGUF (to float32 rounding: 1e-3 for a continuation, 1e-4 per token for a document) and the greedy generations
are the same, one request at a time and on 4 streams (batch_size 4); bounded policies (rsqr, rsqr + recall) run the same
requests with a window the contexts overflow; bad input gives one-line errors."""

from __future__ import annotations

import functools
import glob
import json
import os

import numpy as np
import pytest

from tests.cli import REPO, assert_one_line_error, run_in_process, run_script

TASKS = str(REPO / "tests" / "data" / "lm_eval_task")
LIMIT = 1  # per task: 1 question x 4 choices, 1 generation, 1 document (the real model is slow on CPU)
# Against lm-eval's hf backend (torch): a loglikelihood is a sum of float32 log-probabilities from another program,
# each within ~1e-4 of torch's (a continuation of a few tokens within 1e-3; a document of N tokens within N * 1e-4:
# measured 1.3e-3 on an 82-token document's -304.53 on an AVX2 machine).
PER_TOKEN_ATOL = 1e-4


def _responses(samples: dict) -> dict:
    """{(task, doc_id): the raw responses} of lm-eval's sample logs (per request: (ll, greedy) / ll / text)."""
    return {(task, s["doc_id"]): s["resps"] for task, rows in samples.items() for s in rows}


def _read_sample_logs(out_dir) -> dict:
    samples = {}
    for path in glob.glob(os.path.join(out_dir, "**", "samples_*.jsonl"), recursive=True):
        task = os.path.basename(path)[len("samples_"):].rsplit("_", 1)[0]
        with open(path) as f:
            samples[task] = [json.loads(line) for line in f]
    return samples


def _lls(resps: dict, task: str) -> np.ndarray:
    return np.array([[r[0][0] if task != "rsqr_rolling" else r[0] for r in v] for (t, _), v in sorted(resps.items())
                     if t == task], np.float64)


@functools.lru_cache(maxsize=None)
def _task_manager():
    """The local tasks only, indexed once: indexing lm-eval's own tasks too took ~30 s per TaskManager on a
    loaded 2-core machine (measured), and every task here is a local one (eval_tasks.py indexes both)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=TASKS, include_defaults=False)


def _evaluate(lm, tasks="rsqr_smoke"):
    import lm_eval

    return lm_eval.simple_evaluate(model=lm, tasks=[tasks], limit=LIMIT, log_samples=True,
                                   task_manager=_task_manager(), random_seed=0, numpy_random_seed=0,
                                   torch_random_seed=0, fewshot_random_seed=0)


@pytest.mark.slow
def test_full_matches_lm_eval_hf_backend_and_bounded_policies_run(tmp_path, smollm2_path, smollm2_hf_model):
    # Our model through the command line (--json, --log_samples, --output_path), in this process (one model
    # load for the whole test; eval_tasks.py runs as its own process in test_bad_input_one_line_errors).
    out = tmp_path / "full"
    proc = run_in_process("eval_tasks.py", "--policy", "full", "--model", smollm2_path, "--tasks", "rsqr_smoke",
                      "--include_path", TASKS, "--limit", str(LIMIT), "--output_path", str(out), "--log_samples",
                      "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    assert set(results["results"]) >= {"rsqr_facts", "rsqr_gen", "rsqr_rolling"}
    assert results["config"]["model_args"]["policy"] == "full"
    samples = _read_sample_logs(out)
    ours = _responses(samples)

    # lm-eval's own hf backend on transformers' loading of the same GGUF, same tokenizer.
    from lm_eval.models.huggingface import HFLM

    from rsqr_jax.models.llama import load_model, split_apply
    from rsqr_jax.eval.lm_eval_model import RsqrLM
    from rsqr_jax import engine as E

    loaded = load_model(smollm2_path)
    import torch

    hf = HFLM(pretrained=smollm2_hf_model, tokenizer=loaded.tokenizer, device="cpu", batch_size=1, dtype="float32")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a loaded 2-core machine 2 torch threads made a forward 7-14x slower (measured)
    try:
        theirs = _responses(_evaluate(hf)["samples"])
    finally:
        torch.set_num_threads(threads)
    assert set(ours) == set(theirs) and len(ours) == 3 * LIMIT
    # Two programs (XLA's, torch's) in float32: each token's log-probability to within its rounding. A rolling
    # loglikelihood sums one per token of the document, so its bound is the per-token one times its length.
    n_tokens = np.array([len(hf.tok_encode(s["doc"]["text"]))
                         for s in sorted(samples["rsqr_rolling"], key=lambda s: s["doc_id"])])
    atol = {"rsqr_facts": 1e-3, "rsqr_rolling": PER_TOKEN_ATOL * n_tokens}

    def assert_close(got: dict):
        for task in ("rsqr_facts", "rsqr_rolling"):
            np.testing.assert_array_less(np.abs(_lls(got, task) - _lls(theirs, task)).ravel(), atol[task], task)

    assert_close(ours)
    assert all(ours[k][0][0].strip() for k in ours if k[0] == "rsqr_gen")  # real text, not an empty answer
    assert [ours[k] for k in sorted(ours) if k[0] == "rsqr_gen"] == [theirs[k] for k in sorted(theirs)
                                                                     if k[0] == "rsqr_gen"]
    greedy = [str(c[0][1]) for k in sorted(ours) if k[0] == "rsqr_facts" for c in ours[k]]  # logs hold "True"
    assert greedy == [str(c[0][1]) for k in sorted(theirs) if k[0] == "rsqr_facts" for c in theirs[k]]

    apply_fn, params = split_apply(loaded.model, kernel="xla")
    pieces = (apply_fn, params, loaded.config, loaded.tokenizer)
    # The same with --batch_size 4: the requests on 4 independent streams (StreamsEngine), in process.
    streams = _responses(_evaluate(RsqrLM.from_model_args("policy=full,batch_size=4", pieces=pieces))["samples"])
    assert_close(streams)
    assert [streams[k] for k in sorted(streams) if k[0] == "rsqr_gen"] == [theirs[k] for k in sorted(theirs)
                                                                           if k[0] == "rsqr_gen"]

    # Bounded policies on the same multiple-choice requests: contexts of ~90 tokens through a 16-token window.
    full = _lls(ours, "rsqr_facts")
    for args in ("policy=rsqr,window=16,sinks=4,delta=4,max_survivors=8,chunk=16,recall_pages=0",
                 "policy=rsqr,window=16,sinks=4,delta=4,max_survivors=8,chunk=16,recall_pages=2,page_size=8,"
                 "cold_capacity=128"):
        lm = RsqrLM.from_model_args(args, pieces=pieces)
        before = dict(E.TRACES)
        got = _lls(_responses(_evaluate(lm, "rsqr_facts")["samples"]), "rsqr_facts")
        # 4 requests of different lengths, one compilation of each chunk function
        assert {k: E.TRACES[k] - before.get(k, 0) for k in ("feed", "advance")} == {"feed": 1, "advance": 1}
        assert got.shape == full.shape and np.isfinite(got).all()
        assert np.abs(got - full).max() > 1e-2, args  # the window really evicted


def test_bad_input_one_line_errors():
    assert_one_line_error(run_script("eval_tasks.py", "--tasks", "rsqr_facts", "--no_such_flag", "1"),
                          "unrecognized arguments: --no_such_flag")
    from rsqr_jax.eval.lm_eval_model import RsqrLM
    from rsqr_jax.eval.runtime import ConfigError

    with pytest.raises(ConfigError, match="unknown model argument 'windw'"):
        RsqrLM.from_model_args("policy=rsqr,windw=64")
    with pytest.raises(ConfigError, match="window must be an integer"):
        RsqrLM.from_model_args("policy=rsqr,window=big")
    with pytest.raises(ConfigError, match="batch_size must be a positive integer or 'auto', got 'many'"):
        RsqrLM.from_model_args("policy=rsqr,batch_size=many")


def test_recall_model_arguments_reach_the_cold_store():
    """Every recall setting of the command line is a model argument that reaches the engine's ColdStore (none is
    accepted and ignored); a layer the model does not have is a one-line error."""
    from rsqr_jax.eval.lm_eval_model import RsqrLM
    from rsqr_jax.eval.runtime import ConfigError
    from rsqr_jax.spec import ColdStore
    from rsqr_jax.models.tiny import tiny_config, tiny_model
    from rsqr_lab.testing.tokenizer import WordTokenizer

    cfg = tiny_config()
    pieces = (*tiny_model(cfg, 0), cfg, WordTokenizer(cfg.vocab_size))
    args = "policy=rsqr,window=8,sinks=2,recall_pages=2,cold_capacity=32,page_size=4,page_score=mean,"
    lm = RsqrLM.from_model_args(args + "placement=true,reselect=3,share_from=0", pieces=pieces)
    assert lm.engine.spec.cold == ColdStore(32, 4, "mean", placement="true", reselect=3, share_from=0)
    assert RsqrLM.from_model_args(args, pieces=pieces).engine.spec.cold == ColdStore(32, 4, "mean")
    preset = RsqrLM.from_model_args("", pieces=pieces)  # nothing given: the model's preset (here the generic one)
    assert preset.engine.spec.cold == ColdStore() and preset.description["policy_name"].endswith("recall=4)")
    assert RsqrLM.from_model_args("policy=streamingllm", pieces=pieces).engine.spec.cold is None
    with pytest.raises(ConfigError, match="share_from 2 is not one of the 2 layers that recall"):
        RsqrLM.from_model_args(args + "share_from=2", pieces=pieces)
    # one source per layer, ';'-separated (lm-eval splits model arguments at ','): layer 0 recalls nothing
    per_layer = RsqrLM.from_model_args(args + "reselect=3,share_from=0:none;1:1", pieces=pieces)
    assert per_layer.engine.spec.cold == ColdStore(32, 4, "mean", reselect=3, share_from=(-1, 1))
    from rsqr_jax.cli.eval_tasks import build_parser, model_args_from  # eval_tasks.py's flag, parsed to a tuple

    flags = build_parser().parse_args(["--tasks", "lambada_openai", "--share-choice-from", "0:none"])
    assert model_args_from(flags)["share_from"] == (-1,)
    with pytest.raises(ConfigError, match="LAYER.-LAYER.:SOURCE items"):
        RsqrLM.from_model_args(args + "share_from=0:all", pieces=pieces)
    with pytest.raises(ConfigError, match="layer 1 attends layer 0's choice, but layer 0 does not"):
        RsqrLM.from_model_args(args + "share_from=0:none;1:0", pieces=pieces)


def test_sequential_engine_scores_equal_stream_nll_on_a_tiny_model():
    """SequentialEngine.score (advance chunks, then feed chunks, the last one padded) == -sum of stream_nll at
    the continuation's positions, for rsqr whose 8-token window the 40-token requests overflow (full is
    checked against lm-eval's hf backend above). Tiny random model, random tokens (seed 11)."""
    from rsqr_jax.engine import stream_nll
    from rsqr_jax.eval.harness import SequentialEngine
    from rsqr_jax.policy import make_policy
    from rsqr_jax.spec import CacheSpec
    from rsqr_jax.models.tiny import tiny_config, tiny_model

    cfg = tiny_config()
    apply_fn, params = tiny_model(cfg, 0)
    rng = np.random.default_rng(11)
    dims = dict(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    reqs = [(rng.integers(0, cfg.vocab_size, n_ctx).tolist(), rng.integers(0, cfg.vocab_size, n_cont).tolist())
            for n_ctx, n_cont in ((30, 10), (3, 21))]  # scoring starts in a later chunk / in the first one
    policy = make_policy("rsqr", window=8, n_sink=2, delta=3, max_survivors=4)
    engine = SequentialEngine(apply_fn, params, policy, max_length=64, chunk=8, **dims)
    spec = CacheSpec.for_policies(policy, max_chunk=8, max_len=64, **dims)
    for (ctx, cont), (lp, _) in zip(reqs, engine.score(reqs)):
        nll, _ = stream_nll(apply_fn, params, np.asarray([ctx + cont]), policy, spec, chunk=8, segment=8)
        np.testing.assert_allclose(lp, -nll[0, -len(cont):].sum(), rtol=1e-5)
