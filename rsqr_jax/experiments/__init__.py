"""Every experiment and benchmark as importable code: a frozen config dataclass, `run(config, ...)` that
takes the loaded model (so rsqr_jax stays model-agnostic), and a result object that writes its JSON,
markdown table and plot. The scripts in scripts/ are thin command lines over these modules.
Shared pieces (token reading, statistics, atomic JSON, interruption handling, progress) live in
`rsqr_jax.experiments.common`."""
