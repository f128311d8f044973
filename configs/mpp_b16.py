r"""ViT-B/16 masked patch prediction (paper Appendix B.1.2), self-supervised.

  --config=configs/mpp_b16.py:jft --config.dataset=gs://BUCKET/jft_shards   (default)
  --config=configs/mpp_b16.py:imagenet21k

Fine-tune the result with configs/finetune.py:ViT-B_16,DATASET and
--config.pretrained_path=THIS_WORKDIR (the MPP head and mask token are dropped).
"""

from vit_jax.configs import recipes


def get_config(arg='jft'):
  return recipes.mpp('ViT-B_16', arg)
