r"""R50+ViT-B/16 pre-training, paper Table 3.

--config=configs/r50_vit_b16.py:imagenet21k   (default; also :jft, :imagenet2012, :DATASET,EPOCHS)
"""

from vit_jax.configs import recipes


def get_config(arg='imagenet21k'):
  return recipes.pretrain('R50+ViT-B_16', arg)
