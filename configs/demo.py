"""The default demo (what `python -m vit_jax.main` runs): see vit_jax/configs/demo.py."""

from vit_jax.configs.demo import get_config  # noqa: F401
