"""Masked patch prediction (paper Appendix B.1.2), a self-supervised objective.

Half of the patch embeddings of each image are corrupted: of those, 80% are
replaced by a learnable `mask_token`, 10% by another patch's embedding and 10%
are left as they are. From each corrupted position's output token the model
predicts the patch's 3-bit mean colour (512 classes); the loss counts the
corrupted positions only.

Colour classes. Images are in [-1, 1]. Each patch's per-channel mean m is
quantised to level = floor((m + 1) / 2 * 8), clipped to 0..7 (so level k holds
means in [-1 + k/4, -1 + (k+1)/4), and 1.0 belongs to level 7). The class is
64 * red + 8 * green + blue: bits 8-6 are red, 5-3 green, 2-0 blue.

`MppViT` names its layers as `vit.VisionTransformer` does (`embedding`,
`cls`, `Transformer/...`) and adds `mask_token` and `mpp_head`, so
`checkpoint.load_pretrained` turns an MPP checkpoint into a classifier to
fine-tune: it drops those two like `pre_logits`.
"""

from typing import NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.configs.model_spec import Architecture
from vit_jax.configs.model_spec import Compute
from vit_jax.models import vit

NUM_COLOUR_BITS = 3
NUM_COLOURS = 2 ** (3 * NUM_COLOUR_BITS)  # 512
# Paper B.1.2 proportions.
CORRUPT_RATIO = 0.5
MASK_PROB = 0.8
RANDOM_PROB = 0.1


def colour_targets(images: jnp.ndarray, patch_size) -> jnp.ndarray:
  """The 3-bit mean colour class of every patch.

  Args:
    images: [B, H, W, 3], values in [-1, 1].
    patch_size: (ph, pw); H and W must be multiples.

  Returns:
    [B, (H/ph)*(W/pw)] int32 class ids in [0, 512), patches in row-major
    order (the order of the ViT's token sequence).
  """
  b, h, w, c = images.shape
  ph, pw = patch_size
  if h % ph or w % pw or c != 3:
    raise ValueError(
      f'images of shape {images.shape} do not tile into {ph}x{pw} RGB patches; '
      'resize them to a multiple of the patch size'
    )
  means = images.astype(jnp.float32).reshape(b, h // ph, ph, w // pw, pw, c).mean(axis=(2, 4))
  levels = 2**NUM_COLOUR_BITS
  q = jnp.clip(jnp.floor((means + 1.0) / 2.0 * levels), 0, levels - 1).astype(jnp.int32)
  ids = (q[..., 0] * levels + q[..., 1]) * levels + q[..., 2]
  return ids.reshape(b, -1)


class Corruption(NamedTuple):
  """Which patch embeddings to corrupt, and how; all [B, N]."""

  corrupted: jnp.ndarray  # bool: the positions the loss counts
  masked: jnp.ndarray  # bool: replaced by the mask token
  replaced: jnp.ndarray  # bool: replaced by the embedding at `source`
  source: jnp.ndarray  # int32: another position of the same image


def sample_corruption(
  rng,
  batch_size: int,
  num_patches: int,
  *,
  corrupt_ratio: float = CORRUPT_RATIO,
  mask_prob: float = MASK_PROB,
  random_prob: float = RANDOM_PROB,
) -> Corruption:
  """Draws the corruption of paper B.1.2.

  Exactly round(corrupt_ratio * N) positions per image are corrupted (every
  image sees the same amount of corruption); each of them independently is
  masked with `mask_prob`, replaced with `random_prob`, else left as it is.
  A replacement comes from another position of the same image, so it is a
  real patch of the same picture and sharding over the batch needs no
  communication.
  """
  if num_patches < 2:
    raise ValueError(f'masked patch prediction needs at least 2 patches, got {num_patches}')
  if not 0.0 <= mask_prob + random_prob <= 1.0 or min(mask_prob, random_prob) < 0:
    raise ValueError(
      f'mask_prob={mask_prob} and random_prob={random_prob} must be >= 0 and sum to at most 1'
    )
  num_corrupt = round(corrupt_ratio * num_patches)
  select_rng, kind_rng, source_rng = jax.random.split(rng, 3)
  shape = (batch_size, num_patches)
  # The num_corrupt positions with the smallest noise: a uniform random subset.
  rank = jnp.argsort(jnp.argsort(jax.random.uniform(select_rng, shape), axis=1), axis=1)
  corrupted = rank < num_corrupt
  u = jax.random.uniform(kind_rng, shape)
  masked = corrupted & (u < mask_prob)
  replaced = corrupted & (u >= mask_prob) & (u < mask_prob + random_prob)
  offset = jax.random.randint(source_rng, shape, 1, num_patches)  # never the position itself
  source = (jnp.arange(num_patches) + offset) % num_patches
  return Corruption(corrupted, masked, replaced, source.astype(jnp.int32))


def apply_corruption(
  embeddings: jnp.ndarray, corruption: Corruption, mask_token: jnp.ndarray
) -> jnp.ndarray:
  """[B, N, D] patch embeddings with the corruption applied."""
  others = jnp.take_along_axis(embeddings, corruption.source[..., None], axis=1)
  x = jnp.where(corruption.replaced[..., None], others, embeddings)
  return jnp.where(corruption.masked[..., None], mask_token.astype(x.dtype), x)


class MppViT(nn.Module):
  """A ViT with a mask token and a per-patch colour head (paper B.1.2).

  Its architecture is a `VisionTransformer`'s; hybrids and pre-logits layers are refused
  (the targets are pixel patches, the head reads patch tokens). Returns logits [B, N, 512]
  for every patch position.
  """

  architecture: Architecture
  compute: Compute = Compute()

  @nn.compact
  def __call__(self, images, corruption: Optional[Corruption] = None, *, train: bool):
    a = self.architecture
    if a.resnet is not None or a.representation_size is not None:
      raise ValueError(
        f'{a.name or "this model"}: masked patch prediction works on '
        'plain ViTs without pre-logits; pick a ViT-* model'
      )
    if a.classifier not in ('token', 'gap'):
      raise ValueError(f'classifier={a.classifier!r}; MPP models use token or gap')
    dtype = jnp.dtype(self.compute.dtype)
    x = vit.embed_patches(images, a, dtype)
    num_patches = x.shape[1]
    shape = (1, 1, a.hidden_size)
    mask_token = self.param('mask_token', nn.initializers.normal(stddev=0.02), shape, jnp.float32)
    if corruption is not None:
      x = apply_corruption(x, corruption, mask_token)
    # The class token takes part, so the encoder sees the sequence it will see
    # when fine-tuned from this checkpoint.
    x = vit.prepend_tokens(self, x, a)
    x = vit.Encoder(a, self.compute, name='Transformer')(x, train=train)
    logits = nn.Dense(NUM_COLOURS, dtype=dtype, name='mpp_head')(x[:, -num_patches:])
    return logits.astype(jnp.float32)


def masked_cross_entropy(logits: jnp.ndarray, targets: jnp.ndarray, weights: jnp.ndarray) -> tuple:
  """Mean softmax cross-entropy over the positions where `weights` is true.

  Args:
    logits: [B, N, 512]; targets: [B, N] int; weights: [B, N] bool.

  Returns:
    (loss, {'loss', 'accuracy', 'num_corrupted'}); accuracy is over the
    weighted positions too.
  """
  weights = weights.astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  count = jnp.maximum(weights.sum(), 1.0)
  loss = jnp.sum(nll * weights) / count
  accuracy = jnp.sum((jnp.argmax(logits, axis=-1) == targets) * weights) / count
  return loss, {'loss': loss, 'accuracy': accuracy, 'num_corrupted': weights.sum()}


def loss_fn(
  params,
  images,
  rng,
  *,
  model: MppViT,
  train: bool,
  corrupt_ratio: float = CORRUPT_RATIO,
  mask_prob: float = MASK_PROB,
  random_prob: float = RANDOM_PROB,
) -> tuple:
  """The MPP loss of a batch: (loss, metrics), pure in (params, images, rng).

  `rng` draws the corruption and, when `train`, the dropout masks.
  """
  corruption_rng, dropout_rng = jax.random.split(rng)
  targets = colour_targets(images, model.architecture.patch_size)
  corruption = sample_corruption(
    corruption_rng,
    *targets.shape,
    corrupt_ratio=corrupt_ratio,
    mask_prob=mask_prob,
    random_prob=random_prob,
  )
  logits = model.apply(
    {'params': params}, images, corruption, train=train, rngs={'dropout': dropout_rng}
  )
  return masked_cross_entropy(logits, targets, corruption.corrupted)


def eval_counts(params, images, mask, *, model: MppViT) -> dict:
  """{'correct', 'count'}: the corrupted patches of the real examples (`mask`) whose colour
  `model` predicts, under a fixed corruption, so the evaluations of one run are comparable."""
  targets = colour_targets(images, model.architecture.patch_size)
  corruption = sample_corruption(jax.random.PRNGKey(0), *targets.shape)
  logits = model.apply({'params': params}, images, corruption, train=False)
  counted = corruption.corrupted * mask[:, None]
  correct = (jnp.argmax(logits, axis=-1) == targets) * counted
  return {'correct': jnp.sum(correct), 'count': jnp.sum(counted)}
