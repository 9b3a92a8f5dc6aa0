"""One decoded token's path through the package, seen by a profile hook: the first feed and generate of a session
under the recall tier (tracing, compiling and running the step) calls functions in the files of TOKEN_PATH only,
and every call goes down that list (a file calls only itself or a file below it): no callback up into the model,
no module that reaches back into its caller. docs/design.md lists the same files in the same order.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import rsqr_jax as rj
from rsqr_jax import policy as P
from rsqr_jax.models.tiny import tiny_config, tiny_model
from rsqr_jax.sampling import Sampling
from rsqr_jax.session import Session

PACKAGE = os.path.dirname(rj.__file__)
# Top to bottom. Files of one row are peers: neither calls the other.
TOKEN_PATH = (
    ("session.py",),
    ("engine.py",),
    ("sampling.py", "models/llama.py"),
    ("models/blocks.py", "update.py"),
    ("recall.py",),
    ("cache.py", "policy.py", "attention.py"),
    ("kernels/survivor_attention.py", "kernels/block_matvec.py"),
    ("kernels/recalled_attention.py", "kernels/page_scores.py"),
    ("kernels/exact_rope.py", "kernels/store.py", "kernels/cpu_ffi.py"),
)
RANK = {name: i for i, row in enumerate(TOKEN_PATH) for name in row}
# The files a token may cross at most (TOKEN_PATH holds a few the embedded model's quantized weights add).
MOST_FILES = 16


def _package_file(frame) -> str | None:
    """The package file (relative) of the nearest frame at or above `frame` that is in the package."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PACKAGE + os.sep):
            return os.path.relpath(name, PACKAGE).replace(os.sep, "/")
        frame = frame.f_back
    return None


def test_a_recalling_token_calls_down_a_short_list_of_files():
    seed = 5
    print(f"seed {seed}")
    cfg = tiny_config(layers=3)
    apply_fn, params = tiny_model(cfg, seed)
    cold = rj.ColdStore(32, 4, "max", reselect=2, share_from=(0, 0, 2), score_dtype="int8")
    spec = rj.CacheSpec.for_policies([P.rsqr(8, 2, 3, 4, recall_pages=2)], dims=cfg, max_chunk=4, cold=cold)
    session = Session(apply_fn, params, spec, P.rsqr(8, 2, 3, 4, recall_pages=2), prefill_chunk=4,
                      sampling=Sampling(temperature=0.0), vocab_size=cfg.vocab_size, gen_block=4)
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, 40).tolist()
    files, edges = [], set()

    def hook(frame, event, arg):
        if event != "call":
            return
        callee = _package_file(frame)
        if callee is None or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        if callee not in files:
            files.append(callee)
        caller = _package_file(frame.f_back)
        if caller is not None and caller != callee:
            edges.add((caller, callee))

    sys.setprofile(hook)
    try:
        session.feed(ids)
        session.generate(8)
    finally:
        sys.setprofile(None)
    print("files:", files)
    assert session.cache.cold is not None and int(np.sum(np.asarray(session.cache.cold.pos) >= 0)) > 8
    unlisted = [f for f in files if f not in RANK]
    assert not unlisted, f"a token crosses files off the list: {unlisted} (all: {files})"
    upward = sorted((a, b) for a, b in edges if a in RANK and RANK[b] <= RANK[a])
    assert not upward, f"calls that go up or sideways: {upward}"
    assert len(files) <= MOST_FILES, files
    assert {"recall.py", "kernels/survivor_attention.py", "update.py"} <= set(files)  # the recall path ran
