r"""Fine-tuning, paper Table 4: SGD, batch 512, 384 px, zero-initialised head.

--config=configs/finetune.py:ViT-B_16,cifar10
--config=configs/finetune.py:R50+ViT-B_16,imagenet2012 --config.pretrained_path=DIR_OR_NPZ
"""

from vit_jax.configs import recipes


def get_config(arg='ViT-B_16,cifar10'):
  return recipes.finetune(arg)
