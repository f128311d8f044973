r"""ViT-H/14 pre-training, paper Table 3.

--config=configs/vit_h14.py:imagenet21k   (default; also :jft, :imagenet2012, :DATASET,EPOCHS)
"""

from vit_jax.configs import recipes


def get_config(arg='imagenet21k'):
  return recipes.pretrain('ViT-H_14', arg)
