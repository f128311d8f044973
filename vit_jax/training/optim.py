"""Learning-rate schedules and optimizers of the paper (Appendix B.1).

Pre-training: Adam (b1 0.9, b2 0.999), linear warm-up, linear or cosine decay,
high weight decay, gradient clipping at global norm 1. Fine-tuning: SGD with
momentum 0.9, cosine decay, clipping at norm 1, no weight decay.
"""

import jax
import jax.numpy as jnp
import optax

from vit_jax.configs import ConfigError
from vit_jax.configs import schema

OPTIMIZERS = schema.allowed('optimizer')  # pre-training, fine-tuning (paper B.1)
DECAY_TYPES = schema.allowed('decay_type')


def learning_rate_schedule(config):
  """Linear warm-up from 0 to `base_lr`, then linear decay to `linear_end` or cosine to 0.

  As the official `utils.create_learning_rate_schedule`, whose linear decay
  ends at linear_end=1e-5 (the paper's pre-training runs).
  """
  total, warmup = config.total_steps, config.warmup_steps
  if not 0 <= warmup < total:
    raise ConfigError(f'warmup_steps={warmup} must be in [0, total_steps={total})')
  if config.decay_type == 'linear':
    decay = optax.linear_schedule(config.base_lr, config.linear_end, total - warmup)
  elif config.decay_type == 'cosine':
    decay = optax.cosine_decay_schedule(config.base_lr, total - warmup)
  else:
    raise ConfigError(f'decay_type={config.decay_type!r}: use one of {", ".join(DECAY_TYPES)}')
  warm = optax.linear_schedule(0.0, config.base_lr, warmup)
  return optax.join_schedules([warm, decay], [warmup])


def decay_mask(params):
  """Weight decay applies to kernels only, not to biases, norms or embeddings."""
  return jax.tree_util.tree_map_with_path(
    lambda path, _: getattr(path[-1], 'key', None) == 'kernel', params
  )


def make_optimizer(config):
  """The optimizer named by `config.optimizer`, with clipping and weight decay.

  Weight decay is decoupled from the gradient statistics (as in AdamW): each
  step multiplies kernels by (1 - lr_t * weight_decay), lr_t the scheduled rate.
  """
  schedule = learning_rate_schedule(config)
  moment_dtype = jnp.dtype(config.optim_dtype)
  if config.optimizer == 'adam':
    direction = optax.scale_by_adam(b1=config.b1, b2=config.b2, mu_dtype=moment_dtype)
  elif config.optimizer == 'sgd':
    direction = optax.trace(decay=config.momentum, accumulator_dtype=moment_dtype)
  else:
    raise ConfigError(f'optimizer={config.optimizer!r}: use one of {", ".join(OPTIMIZERS)}')
  parts = []
  if config.grad_norm_clip:
    parts.append(optax.clip_by_global_norm(config.grad_norm_clip))
  parts.append(direction)
  if config.weight_decay:
    parts.append(optax.add_decayed_weights(config.weight_decay, mask=decay_mask))
  parts.append(optax.scale_by_learning_rate(schedule))
  return optax.chain(*parts), schedule
