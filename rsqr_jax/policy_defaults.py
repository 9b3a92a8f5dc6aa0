"""The library's policy defaults, the one set (rsqr_jax.policy.make_policy, its constructors, every command's
policy flags and the lm-eval model's arguments). A module of literals with no imports, so that a command line
shows them in --help and rejects bad flags before jax loads."""

DEFAULTS = {"window": 256, "n_sink": 4, "delta": 8, "max_survivors": 64, "block": 1, "overflow": "fifo",
            "recall_pages": 0}
