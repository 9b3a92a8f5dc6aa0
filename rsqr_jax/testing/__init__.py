"""Test and experiment support, shared by tests/, rsqr_jax.studies and the GPU check (no copies):
tiny random models (`tiny`), float64 references (`oracle`), transformers' torch reference (`hf_reference`, lazy torch).

Above the core: it may import `rsqr_jax.models`: it wires a real decoder for tests, lazily."""
