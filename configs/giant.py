r"""Pre-training the giant ViTs (beyond the paper): ViT-g/14, ViT-G/14, ViT-e/14, ViT-22B/14 on JFT.

--config=configs/giant.py:ViT-22B_14   (default; or ViT-g_14, ViT-G_14, ViT-e_14)
--config=configs/giant.py:ViT-e_14-map (any of them with the MAP head of big_vision)

The paper's JFT recipe (B.1: Adam, sigmoid loss, head bias -10) with the
giant model, as Zhai et al. 2022 and Dehghani et al. 2023 train them: no
pre-logits layer, no dropout, Adam's first moment in bfloat16, the blocks
scanned (compile time flat in depth) and rematerialised keeping the matmul
outputs without a batch dimension. Size the mesh for the slice, e.g.
--config.mesh.fsdp=64 --config.mesh.model=4 (docs/speed_and_scale.md).
"""

from vit_jax.configs import ConfigError
from vit_jax.configs import architectures
from vit_jax.configs import recipes


def get_config(arg='ViT-22B_14'):
  if arg.removesuffix('-map') not in architectures.GIANTS:
    raise ConfigError(
      f'configs/giant.py:{arg}: use one of {", ".join(architectures.GIANTS)}, with or without -map'
    )
  config = recipes.pretrain('ViT-H_14', 'jft')
  config.model = arg
  config.representation_size = None
  config.dropout_rate = 0.0
  config.optim_dtype = 'bfloat16'
  config.scan_layers = True
  config.remat = True
  config.remat_policy = 'dots_with_no_batch_dims_saveable'
  return config
