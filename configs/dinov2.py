r"""DINOv2's self-distillation recipes: see vit_jax/configs/dinov2.py.

--config=configs/dinov2.py:ViT-S_14   (default; or ViT-B_14, ViT-L_14, ViT-g_14; NAME-reg4: with
                                       4 registers, e.g. to continue vit_small_patch14_reg4_dinov2)
"""

from vit_jax.configs.dinov2 import get_config  # noqa: F401
