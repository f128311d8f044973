"""Masked patch prediction on the built-in digits: see vit_jax/configs/mpp_demo.py."""

from vit_jax.configs.mpp_demo import get_config  # noqa: F401
