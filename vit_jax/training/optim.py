"""Learning-rate schedules and optimizers of the paper (Appendix B.1).

Pre-training: Adam (b1 0.9, b2 0.999), linear warm-up, linear or cosine decay,
high weight decay, gradient clipping at global norm 1. Fine-tuning: SGD with
momentum 0.9, cosine decay, clipping at norm 1, no weight decay. The newer families'
fine-tunes (BEiT's, EVA-02's) add layer-wise learning-rate decay (Clark et al. 2020):
`layer_decay`.
"""

import re

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


_BLOCK = re.compile(r'^encoderblock(_(\d+))?$')
# Before the blocks: their depth is 0 (the patch embedding, a hybrid's ResNet, the tokens,
# position embeddings, CLIP's pre-norm); what is neither these nor a block (final norms, heads)
# is above the last block.
_EMBEDDING = re.compile(
  r'^(embedding|cls|registers|mask_token|posembed_input|pre_norm|conv_root|gn_root|block\d+)$'
)


def _depths(params):
  """(the number of blocks L, depth(path, leaf)): 0 for the embeddings, i + 1 for block i (an
  array over a scanned stack's leading axis), L + 1 for the rest."""
  keys = lambda path: [getattr(k, 'key', None) for k in path]  # noqa: E731
  blocks = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    for key in keys(path):
      match = _BLOCK.match(str(key))
      if match:
        blocks = max(blocks, int(match.group(2)) + 1 if match.group(2) else leaf.shape[0])

  def depth(path, leaf):
    names = [str(k) for k in keys(path)]
    for name in names:
      match = _BLOCK.match(name)
      if match and match.group(2):
        return int(match.group(2)) + 1
      if match:  # scanned: the stack's leading axis is the block
        return jnp.arange(1, leaf.shape[0] + 1).reshape((-1,) + (1,) * (leaf.ndim - 1))
    return 0 if any(_EMBEDDING.match(name) for name in names) else blocks + 1

  return blocks, depth


def layer_factors(tree, rate: float):
  """rate ** (L + 1 - depth) per leaf of a parameter tree (`_depths`): 1 for heads, rate **
  (L - i) for block i (an array over a scanned stack), rate ** (L + 1) for the embeddings."""
  blocks, depth = _depths(tree)
  return jax.tree_util.tree_map_with_path(
    lambda path, leaf: jnp.power(jnp.float32(rate), blocks + 1 - depth(path, leaf)), tree
  )


def layer_decay(rate: float) -> optax.GradientTransformation:
  """Scales each parameter's update by its `layer_factors`: the head by 1, block i by
  rate ** (L - i), the embeddings by rate ** (L + 1)."""

  def update(updates, state, params=None):
    factors = layer_factors(updates, rate)
    scaled = jax.tree.map(lambda u, f: u * f.astype(u.dtype), updates, factors)
    return scaled, state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


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
  if config.layer_decay != 1.0:  # the decay's step too, as a lower learning rate would
    parts.append(layer_decay(config.layer_decay))
  parts.append(optax.scale_by_learning_rate(schedule))
  return optax.chain(*parts), schedule
