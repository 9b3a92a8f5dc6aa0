"""Flax NNX decoders (the supported families, docs/models.md) and their loaders (GGUF files, HF safetensors directories). Above the
core: a model layer calls the cache step (`rsqr_jax.update`); the core never imports a model."""
