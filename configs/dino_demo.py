"""Self-distillation as DINOv2 on the built-in digits: see vit_jax/configs/dino_demo.py."""

from vit_jax.configs.dino_demo import get_config  # noqa: F401
