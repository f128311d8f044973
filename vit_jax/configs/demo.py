"""The embedded default: a small ViT on the built-in digits, trained on a CPU in minutes."""

from vit_jax.configs import common


def get_config():
  config = common.get_config()
  config.model = 'ViT-Demo_4'
  config.dataset = 'digits'
  config.pp.crop = 16
  config.batch = 128
  config.batch_eval = 128
  config.optimizer = 'adam'
  config.base_lr = 1e-3
  config.weight_decay = 0.1
  config.warmup_steps = 100
  config.decay_type = 'cosine'
  config.total_steps = 1000
  config.progress_every = 50
  config.eval_every = 250
  config.checkpoint_every = 500
  return config
