"""The studies and benchmarks as importable code: a frozen config dataclass, `run(config, ...)` that takes the
loaded model (so the core stays model-agnostic), and a result object that writes its JSON, markdown table and
plot. scripts/exp_*.py and scripts/bench_*.py are their thin command lines. Nothing in the library imports a
study."""
