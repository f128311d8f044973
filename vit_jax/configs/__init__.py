"""Model architecture configs (`vit_jax.configs.models`)."""
