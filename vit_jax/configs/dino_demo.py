"""Self-distillation (task='dino') at demo scale: the demo ViT on the built-in digits, offline.

The labels of the digits are not read in training; k-NN (k = 20, T = 0.07) of the teacher's
class tokens on the test split is its evaluation, and `python -m vit_jax.fewshot` probes its
features (docs/self_supervised.md).
"""

from vit_jax.configs import demo


def get_config():
  config = demo.get_config()
  config.task = 'dino'
  config.pp.crop = 16  # global crops: 4 x 4 patches of ViT-Demo_4
  config.batch = 128
  # Length matters most here: 800, 2,000 and 4,000 steps (lr 2e-3, teacher momentum from 0.99)
  # give 46%, 52% and 58% 1-shot probes (docs/self_supervised.md).
  config.total_steps = 4000
  config.warmup_steps = 100
  config.base_lr = 2e-3
  config.weight_decay = 0.04
  config.grad_norm_clip = 3.0
  config.layer_decay = 0.9
  config.posemb_resize = 'bicubic_antialias'
  d = config.dino
  # An 8 x 8 digit holds little: crops keep most of it (DINOv2: 0.32-1 and 0.05-0.32), and
  # local crops (4 of 8 px, 2 x 2 patches at 0.3-0.6) cost 4.6x the time and 8 points of 1-shot
  # accuracy at 1,500 steps: none.
  d.local_crops, d.local_crop = 0, 8  # 8 px and local_scale for --config.dino.local_crops=N
  d.global_scale, d.local_scale = (0.6, 1.0), (0.3, 0.6)
  # Few prototypes balanced by Sinkhorn-Knopp: ten classes of digits, not ImageNet's thousands.
  d.prototypes, d.head_hidden, d.head_bottleneck = 64, 256, 16
  d.centering = 'sinkhorn_knopp'
  d.weight_decay_end = 0.2
  d.teacher_momentum = 0.99  # a teacher that follows within 1,438 images (0.996: -4 points)
  d.teacher_temp_warmup_steps = 400
  d.freeze_last_layer_steps = 4000  # the prototypes stay as drawn: 64 fixed directions
  config.ibot.mask_ratio = (0.25, 0.5)  # at least one block of 4 of the 16 patches
  config.eval_every = 1000
  return config
