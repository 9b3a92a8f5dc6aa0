"""rsqr_jax.eval.harness.StreamsEngine (the many-streams engine behind lm-eval's --batch_size > 1) against
SequentialEngine (one request at a time, itself checked against stream_nll and lm-eval's hf backend):
the same scores and greedy flags, the same greedy generations, and one compilation of each function
however many requests join and leave the slots. Tiny random model, random token ids (seed printed)."""

from __future__ import annotations

import numpy as np
import pytest

import rsqr_jax as rj
from rsqr_jax import engine as E
from rsqr_jax.eval.harness import GenerateRequest, SequentialEngine, StreamsEngine
from rsqr_jax.policy import make_policy
from rsqr_jax.models.tiny import tiny_config, tiny_model
from rsqr_lab.testing.tokenizer import ByteTokenizer
from tests.cli import REPO

SEED = 15
CFG = tiny_config()
DIMS = dict(num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim, max_length=64, chunk=8)
RSQR = dict(window=8, n_sink=2, delta=3, max_survivors=4)
BUILTIN = str(REPO / "tests" / "data" / "lm_eval_builtin")
STREAMS_FNS = ("score_streams", "advance_streams", "feed_streams", "generate_streams")


@pytest.fixture(scope="module")
def model():
    return tiny_model(CFG, 0)


def _requests(rng, lengths):
    return [(rng.integers(0, CFG.vocab_size, a).tolist(), rng.integers(0, CFG.vocab_size, b).tolist())
            for a, b in lengths]


@pytest.mark.parametrize("recall", [False, True])
def test_streams_engine_equals_sequential_engine_under_one_compilation(model, recall):
    print(f"seed {SEED}")
    apply_fn, params = model
    rng = np.random.default_rng(SEED + recall)
    policy = make_policy("rsqr", **RSQR, recall_pages=2 if recall else 0)
    cold = dict(cold=rj.ColdStore(32, 4, "mean"), max_recall_pages=2) if recall else None
    seq = SequentialEngine(apply_fn, params, policy, cold_store=cold, gen_block=4, **DIMS)
    streams = StreamsEngine(apply_fn, params, policy, n_slots=2, cold_store=cold, gen_block=4, **DIMS)
    # first scored token in a later chunk / in the first chunk / the last input only / a chunk boundary; all
    # but one overflow the 8-token window
    reqs = _requests(rng, [(30, 10), (3, 21), (44, 1), (8, 8), (1, 2)])
    if not recall:  # a continuation that greedy decoding reproduced (rsqr: scored in chunks, greedy = True)
        reqs.append((reqs[0][0], seq.generate([GenerateRequest(reqs[0][0], 6)])[0]))
    before = {k: E.TRACES[k] for k in STREAMS_FNS}
    want = seq.score(reqs)
    got = streams.score(reqs[:2])  # warm: then more requests than slots (joins into freed slots)
    got = streams.score(reqs)
    np.testing.assert_allclose([lp for lp, _ in got], [lp for lp, _ in want], rtol=1e-5, atol=1e-5)
    assert [g for _, g in got] == [g for _, g in want] and not got[0][1] and (got[-1][1] or recall)
    assert len({round(lp, 3) for lp, _ in got}) == len(got)  # distinct requests, distinct scores

    if not recall:  # generation (one policy is enough: the recall step is the one scoring just ran)
        gen = [GenerateRequest(ctx, n) for (ctx, _), n in zip(reqs, (9, 3, 5, 12, 7))]
        want = seq.generate(gen)
        assert streams.generate(gen) == want and [len(w) for w in want] == [9, 3, 5, 12, 7]
        stopped = [GenerateRequest(c, 12, stop=lambda ids: len(ids) >= 2) for c, _ in reqs[:3]]
        for out, full in zip(streams.generate(stopped), seq.generate([GenerateRequest(c, 12) for c, _ in reqs[:3]])):
            assert 2 <= len(out) < 12 and out == full[:len(out)]  # stopped after the block that met the stop
    traced = {k: E.TRACES[k] - before[k] for k in STREAMS_FNS}
    assert traced == {"score_streams": 1, "advance_streams": 1, "feed_streams": 0 if recall else 1,
                      "generate_streams": 0 if recall else 1}, traced


def test_streams_engine_refuses_bad_slots(model):
    with pytest.raises(ValueError, match="n_slots must be a positive integer"):
        StreamsEngine(*model, make_policy("rsqr", **RSQR), n_slots=0, **DIMS)


class _Tokenizer(ByteTokenizer):
    """ByteTokenizer with what lm-eval's TemplateLM asks of a tokenizer (an end-of-text id, decode options)."""

    bos_token_id, eos_token_id = None, 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return super().decode([ids] if isinstance(ids, int) else ids)


@pytest.mark.slow
def test_lm_eval_builtin_tasks_through_include_yaml_same_with_streams(model):
    """lm-eval's own lambada_openai and wikitext, run from tests/data/lm_eval_builtin/builtin.yaml (local
    data in their schema) on the tiny model: RsqrLM with batch_size=2 (StreamsEngine) gives the same
    loglikelihoods as batch_size=1 (SequentialEngine) through the whole harness."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from lm_eval.utils import simple_parse_args_string

    from rsqr_jax.eval.lm_eval_model import RsqrLM, check_model_args

    pieces = (*model, CFG, _Tokenizer(CFG.vocab_size))
    # the first test's engines (so their compilations are reused): rsqr W=8 against passages of ~8k bytes
    args = ("policy=rsqr,window=8,sinks=2,delta=3,max_survivors=4,recall_pages=0,chunk=8,max_length=64,gen_block=4,"
            "max_gen_toks=8")
    # batch_size as scripts/eval_tasks.py hands it over: a string, through check_model_args
    lms = [RsqrLM.from_model_args(args, pieces=pieces),
           RsqrLM.from_model_args(check_model_args({**simple_parse_args_string(args), "batch_size": "2"}),
                                  pieces=pieces)]
    assert isinstance(lms[0].engine, SequentialEngine) and isinstance(lms[1].engine, StreamsEngine)
    tasks = TaskManager(include_path=BUILTIN)  # (indexing lm-eval's own tasks takes seconds: once)
    runs = [lm_eval.simple_evaluate(model=lm, tasks=["offline_builtin"], limit=1, log_samples=True,
                                    task_manager=tasks) for lm in lms]
    resps = [{t: [r["resps"] for r in rows] for t, rows in run["samples"].items()} for run in runs]
    assert set(resps[0]) == {"lambada_openai", "wikitext"}
    (ll, _), = resps[0]["lambada_openai"][0][0]  # one passage (the target: its last word)
    (ll3, _), = resps[1]["lambada_openai"][0][0]
    np.testing.assert_allclose([ll3, resps[1]["wikitext"][0][0][0]], [ll, resps[0]["wikitext"][0][0][0]], rtol=1e-5)
    assert ll < 0 and set(runs[0]["results"]["wikitext"]) >= {"word_perplexity,none", "bits_per_byte,none"}
    assert set(runs[1]["results"]["lambada_openai"]) >= {"acc,none", "perplexity,none"}


def test_interleaved_prefill_same_tokens_and_no_stall(model):
    """A 40-token prompt joins a generating stream: prefill-first stalls it for the 5 prefill rounds,
    interleaving (a prefill chunk and a generation block per round) gives it tokens every round, and every
    token is the same (the compilations are the first test's: same Decoder)."""
    from rsqr_jax.streams import Request, StreamScheduler

    apply_fn, params = model
    engine = StreamsEngine(apply_fn, params, make_policy("rsqr", **RSQR), n_slots=2, gen_block=4, **DIMS)
    rng = np.random.default_rng(SEED + 7)
    first, joiner = (Request(tuple(rng.integers(0, CFG.vocab_size, n).tolist()), m) for n, m in ((5, 40), (40, 6)))
    outs, stalls = [], []
    for interleave in (False, True):
        sched = StreamScheduler(apply_fn, params, engine.spec, engine.policy, n_slots=2, prefill_chunk=8, gen_block=4,
                                interleave=interleave)
        sched.submit(first)
        done, stall, longest = [], 0, 0
        while not sched.idle:
            generating = sched.slots[0] is not None and sched.slots[0].budget > 0
            n_before = len(sched.slots[0].out) if sched.slots[0] is not None else 0
            done += sched.step()
            if generating and sched.n_submitted == 1:
                sched.submit(joiner)  # joins once the first stream generates
            elif generating and sched.slots[0] is not None:
                stall = 0 if len(sched.slots[0].out) > n_before else stall + 1  # rounds without a token
                longest = max(longest, stall)
        outs.append(sorted((f.index, f.tokens) for f in done))
        stalls.append(longest)
    assert outs[0] == outs[1] and [len(t) for _, t in outs[0]] == [40, 6]
    assert stalls == [5, 0], stalls
