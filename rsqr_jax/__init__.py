"""rsqr_jax."""
