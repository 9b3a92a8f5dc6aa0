"""Test and experiment support, shared by tests/, rsqr_jax.experiments and the GPU check (no copies):
tiny random models (`tiny`), float64 references (`oracle`), transformers' torch reference (`hf`, lazy torch).

The one place under rsqr_jax that may import `models`: it wires a real decoder for tests, lazily."""
