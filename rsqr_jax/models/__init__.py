"""Flax NNX decoders of the supported families and their loaders (GGUF files, HF safetensors directories). Above the
core: a model layer calls the cache step (`rsqr_jax.update`); the core never imports a model."""
