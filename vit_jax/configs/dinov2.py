"""DINOv2's self-distillation recipes (Oquab et al. 2023; task='dino', vit_jax.training.dino).

Values from DINOv2's `ssl_default_config.yaml` and, for the large models, its
`train/vitl14.yaml` and `train/vitg14.yaml`, with epochs of 1,250 steps (its
`OFFICIAL_EPOCH_LENGTH`) turned into steps, at a global batch of 2,048 (DINOv2 sets a batch
per GPU) and its learning rate scaled by sqrt(batch / 1024) as its `sqrt_wrt_1024` rule does:

- ViT-S/14 and ViT-B/14: the default recipe (100 epochs, warm-up 10, lr 0.004 at batch
  1,024, layer decay 0.9, drop path 0.3, one DINO head of 65,536 prototypes shared with iBOT,
  the running centre);
- ViT-L/14 and ViT-g/14: 500 epochs, warm-up 80, lr 2e-4 at batch 1,024, no layer decay,
  drop path 0.4, teacher momentum 0.994, weight decay to 0.2, Sinkhorn-Knopp, heads of
  131,072 prototypes (DINO's bottleneck 384) with a separate iBOT head.

The models are DINOv2's released architectures under timm's names (`configs.families`);
`NAME-reg4` takes the one with 4 registers. DINOv2's ViT-L/14 recipe names a SwiGLU MLP, but
its released ViT-L/14 (distilled from the g) has the plain MLP, which this recipe trains.
"""

import math

from vit_jax.configs import ConfigError
from vit_jax.configs import common

_MODELS = {
  'ViT-S_14': 'vit_small_patch14{}_dinov2',
  'ViT-B_14': 'vit_base_patch14{}_dinov2',
  'ViT-L_14': 'vit_large_patch14{}_dinov2',
  'ViT-g_14': 'vit_giant_patch14{}_dinov2',
}
EPOCH = 1250  # DINOv2's OFFICIAL_EPOCH_LENGTH: steps per "epoch"
BATCH = 2048


def names() -> tuple:
  return tuple(_MODELS) + tuple(f'{n}-reg4' for n in _MODELS)


def get_config(arg: str = 'ViT-S_14'):
  """The recipe of `arg` (see `names`)."""
  size = arg.removesuffix('-reg4')
  if size not in _MODELS:
    raise ConfigError(f'configs/dinov2.py:{arg}: use one of {", ".join(names())}')
  large = size in ('ViT-L_14', 'ViT-g_14')
  config = common.get_config()
  config.task = 'dino'
  config.model = _MODELS[size].format('_reg4' if arg.endswith('-reg4') else '')
  config.dataset = 'imagenet2012'
  config.pp.crop = 224
  config.dtype = 'bfloat16'
  config.batch = BATCH
  config.batch_eval = 1024
  epochs, warmup = (500, 80) if large else (100, 10)
  config.total_steps = epochs * EPOCH
  config.warmup_steps = warmup * EPOCH
  config.optimizer = 'adam'
  config.base_lr = (2e-4 if large else 4e-3) * math.sqrt(BATCH / 1024)
  config.weight_decay = 0.04
  config.layer_decay = 1.0 if large else 0.9
  config.grad_norm_clip = 3.0
  config.drop_path_rate = 0.4 if large else 0.3
  config.posemb_resize = 'bicubic_antialias'
  d = config.dino
  d.local_crops, d.local_crop = 8, 98
  d.weight_decay_end = 0.2 if large else 0.4
  d.teacher_momentum = 0.994 if large else 0.992
  d.teacher_temp_warmup_steps = 30 * EPOCH
  d.freeze_last_layer_steps = EPOCH
  d.centering = 'sinkhorn_knopp' if large else 'centre'
  if large:
    d.prototypes, d.head_bottleneck = 131072, 384
    config.ibot.separate_head = True
    config.ibot.prototypes = 131072
    config.scan_layers = True  # compile time flat in depth (configs/giant.py does the same)
  config.eval_every = 10 * EPOCH
  config.checkpoint_every = EPOCH
  config.progress_every = 100
  return config
