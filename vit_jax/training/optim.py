"""Learning-rate schedules and optimizers of the paper (Appendix B.1).

Pre-training: Adam (b1 0.9, b2 0.999), linear warm-up, linear or cosine decay,
high weight decay, gradient clipping at global norm 1. Fine-tuning: SGD with
momentum 0.9, cosine decay, clipping at norm 1, no weight decay.
"""

import jax
import jax.numpy as jnp
import optax


def learning_rate_schedule(config):
  """Linear warm-up from 0 to `base_lr`, then linear decay to `linear_end` or cosine to 0.

  As the official `utils.create_learning_rate_schedule`, whose linear decay
  ends at linear_end=1e-5 (the paper's pre-training runs).
  """
  total, warmup = config.total_steps, config.warmup_steps  # 0 <= warmup < total: the schema's
  decay = {  # keyed by the schema's decay_type values
    'linear': lambda: optax.linear_schedule(config.base_lr, config.linear_end, total - warmup),
    'cosine': lambda: optax.cosine_decay_schedule(config.base_lr, total - warmup),
  }[config.decay_type]()
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
  step multiplies the parameters `weight_decay_on` names (kernels, or all) by
  (1 - lr_t * weight_decay), lr_t the scheduled rate.
  """
  schedule = learning_rate_schedule(config)
  moment_dtype = jnp.dtype(config.optim_dtype)
  direction = {  # keyed by the schema's optimizer values
    'adam': lambda: optax.scale_by_adam(b1=config.b1, b2=config.b2, mu_dtype=moment_dtype),
    'sgd': lambda: optax.trace(decay=config.momentum, accumulator_dtype=moment_dtype),
  }[config.optimizer]()
  parts = []
  if config.grad_norm_clip:
    parts.append(optax.clip_by_global_norm(config.grad_norm_clip))
  parts.append(direction)
  if config.weight_decay:
    mask = {'kernels': decay_mask, 'all': None}[config.weight_decay_on]
    parts.append(optax.add_decayed_weights(config.weight_decay, mask=mask))
  parts.append(optax.scale_by_learning_rate(schedule))
  return optax.chain(*parts), schedule
