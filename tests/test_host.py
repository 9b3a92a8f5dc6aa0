"""rsqr_jax.host: the cache directory, the commands' persistent compilation cache, freed heap handed back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rsqr_jax import host
from tests.cli import REPO, run_script, script_env
from tests.hf_fixtures import TinySpec, build_hf_model, write_tiny_gguf


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("RSQR_JAX_CACHE", str(tmp_path / "mine"))
    assert host.cache_dir("xla") == tmp_path / "mine" / "xla"
    monkeypatch.delenv("RSQR_JAX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert host.cache_dir() == tmp_path / "xdg" / "rsqr_jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert host.cache_dir() == tmp_path / "home" / ".cache" / "rsqr_jax"


def _without_compile_cache(env: dict) -> dict:
    """env without the test run's own compilation cache (tests/conftest.py), which a command would keep."""
    return {k: v for k, v in env.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}


def _jax_cache_settings(env: dict) -> dict:
    """jax's compilation-cache settings in a fresh process that called enable_compilation_cache before jax."""
    code = ("import json; from rsqr_jax.host import enable_compilation_cache; enable_compilation_cache(); "
            "import jax; print(json.dumps([jax.config.jax_compilation_cache_dir, "
            "jax.config.jax_compilation_cache_max_size]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_enable_compilation_cache_points_jax_at_the_cache_unless_told_otherwise(tmp_path):
    base = _without_compile_cache(script_env()) | {"RSQR_JAX_CACHE": str(tmp_path)}
    assert _jax_cache_settings(base) == [str(tmp_path / "xla"), host.COMPILE_CACHE_MAX_BYTES]
    assert _jax_cache_settings(base | {"RSQR_COMPILE_CACHE": "0"}) == [None, -1]  # turned off
    theirs = str(tmp_path / "theirs")
    assert _jax_cache_settings(base | {"JAX_COMPILATION_CACHE_DIR": theirs})[0] == theirs  # the user's wins
    # jax imported first (a script that imports the library at its top): the same settings, through jax's config
    code = ("import json, jax; from rsqr_jax.host import enable_compilation_cache; enable_compilation_cache(); "
            "print(json.dumps(jax.config.jax_compilation_cache_dir))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=base, timeout=120)
    assert proc.returncode == 0 and json.loads(proc.stdout.splitlines()[-1]) == str(tmp_path / "xla"), proc.stderr


def test_a_command_run_again_loads_its_programs_from_the_cache(tmp_path):
    """A command keeps its compiled programs under the cache directory; run again, it compiles nothing new (every
    program is a hit: no entry is added) and gives the same answer. Every program is kept here (jax keeps only
    those that took a second to compile, which a tiny model's do not)."""
    spec = TinySpec(intermediate_size=96, seed=6)
    path = write_tiny_gguf(build_hf_model(spec), spec, tmp_path / "q.gguf")
    env = _without_compile_cache(script_env()) | {"RSQR_JAX_CACHE": str(tmp_path / "cache"),
                                                  "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    entries = []
    for run in range(2):
        proc = run_script("bench_weights.py", "--quick", "--no-decode", "--model", str(path), "--formats", "dense",
                          "--out", str(tmp_path / f"out{run}"), env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        entries.append(sorted(p.name for p in (tmp_path / "cache" / "xla").iterdir() if p.name.endswith("-cache")))
    assert entries[0] and entries[1] == entries[0]
    shapes = [json.loads((tmp_path / f"out{r}" / "bench_weights.json").read_text())["micro"]["default"]["bytes"]
              for r in range(2)]
    assert shapes[0] == shapes[1]


def test_release_free_heap_hands_freed_memory_back():
    """On glibc, memory freed by a burst of small allocations leaves the resident set once the heap is trimmed."""
    if host._malloc_trim() is None:
        pytest.skip("no malloc_trim in this C library (not glibc)")

    def rss_mib() -> float:
        return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024

    blocks = [bytearray(64 << 10) for _ in range(4096)]  # 256 MiB of heap blocks below the mmap threshold
    keep = blocks[-1]  # one block at the heap's top stays alive: glibc's own trimming on free cannot shrink past it
    del blocks
    before = rss_mib()
    assert host.release_free_heap()
    after = rss_mib()
    assert before - after > 128, (before, after)
    del keep
