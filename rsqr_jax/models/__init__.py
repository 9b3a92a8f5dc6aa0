"""Flax NNX decoders (the Llama family) and their loaders (GGUF files, HF safetensors directories). Above the
core: a model layer calls the cache step (`rsqr_jax.update`); the core never imports a model."""
