"""scripts/bench_streams.py: bad settings are one-line errors before the model loads (the benchmark itself
runs on the real model: docs/streams.md records its command and table)."""

from __future__ import annotations

from tests.cli import assert_one_line_error, run_script


def test_bad_stream_counts_fail_before_the_model_loads():
    assert_one_line_error(run_script("bench_streams.py", "--streams", "1", "0", "--out", ""),
                          "--streams must be positive counts")
    assert_one_line_error(run_script("bench_streams.py", "--join", "64", "--streams", "1", "4", "--out", ""),
                          "--join needs a positive prompt length and --streams counts >= 2")
