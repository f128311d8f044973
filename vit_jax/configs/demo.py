"""The embedded default: a small ViT on the built-in digits, trained on a CPU in minutes.

`python -m vit_jax.main` with no --config runs this: offline, on a laptop CPU.
"""

from vit_jax.configs import common


def get_config():
  config = common.get_config()
  config.model = 'ViT-Demo_4'
  config.dataset = 'digits'
  config.pp.crop = 16
  config.batch = 128
  config.batch_eval = 512
  config.optimizer = 'adam'
  config.base_lr = 1e-3
  config.weight_decay = 0.1
  config.warmup_steps = 200
  config.decay_type = 'cosine'
  config.total_steps = 2000
  config.progress_every = 100
  config.eval_every = 500
  config.checkpoint_every = 500
  return config
