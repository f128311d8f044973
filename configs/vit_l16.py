r"""ViT-L/16 pre-training, paper Table 3.

--config=configs/vit_l16.py:imagenet21k   (default; also :jft, :imagenet2012, :DATASET,EPOCHS)
"""

from vit_jax.configs import recipes


def get_config(arg='imagenet21k'):
  return recipes.pretrain('ViT-L_16', arg)
