"""Masked patch prediction at demo scale: the demo ViT on the built-in digits.

Self-supervised (paper B.1.2): the labels of the digits are not read. Its
workdir fine-tunes with configs/finetune.py (docs/evaluation.md: masked patch prediction).
"""

from vit_jax.configs import demo


def get_config():
  config = demo.get_config()
  config.task = 'mpp'
  config.weight_decay = 0.1
  config.total_steps = 2000
  return config
