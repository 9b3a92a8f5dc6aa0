"""rsqr_lab: the experiments, benchmarks, device tools and test support of rsqr_jax, kept out of the library's
wheel. `studies` the experiments and benchmarks (scripts/exp_*.py and scripts/bench_*.py are their command
lines); `devtools` the GPU checks; `testing` float64 oracles, kernel inputs and transformers' reference.
Installed from a checkout for development: `pip install -e ./lab` (scripts/dev.sh setup does it)."""
