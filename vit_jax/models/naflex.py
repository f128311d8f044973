"""NaFlex ViT: images at their own aspect ratio and resolution, up to a token budget.

NaViT (Dehghani et al. 2023) and FlexiViT's successor in SigLIP 2 (Tschannen
et al. 2025), as timm's `naflexvit`: each image is resized so that its patch
grid (h, w) keeps its aspect ratio and h * w fits a budget of N tokens, and a
batch holds for every image N patches (its own first, in row order, then
padding), their (row, column) in the image's grid and whether each is real.
Attention ignores the padding (each image's sequence is its real tokens), the
learned 2D position embeddings (a grid of the model's size) are resampled
to each image's grid (`posemb_resample`: bilinearly, as big_vision's SigLIP 2, or with
an antialiased filter, timm NaFlexVit's default being bicubic: `positions.NAFLEX_RESAMPLE`),
and pooling reads real tokens only.

One array carries a packed batch, so the trainer's steps and every
`model.apply(params, x)` take it as they take images: float32 [B, N, P*P*C + 3],
each row a patch's pixels in (row, column, channel) order, then its grid row,
its grid column and 1 for a real patch (0 for padding). An image batch
[B, H, W, C] is taken too, as one full grid per image (evaluation at any
resolution that the patch size divides).

The patch embedding and the encoder are the ViT's (`vit.PatchEmbedding`,
`vit.Encoder`), under the same parameter names, the attention reading a
sequence length per image; `embedding/kernel` keeps the conv layout
[P, P, C, D] (a plain ViT's kernel loads as it is). The position embeddings
are `Transformer/posembed_input/pos_embedding` [1, gh, gw, D] (patches only;
the class token has none, as in timm's naflexvit: `positions.GridPositionEmbs`).
"""

from typing import Optional

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from vit_jax.configs import model_spec
from vit_jax.configs.model_spec import Architecture
from vit_jax.configs.model_spec import Compute
from vit_jax.models import vit

CLASSIFIERS = model_spec.NAFLEX_CLASSIFIERS
_EXTRA = 3  # packed columns after the pixels: grid row, grid column, real


def pack(patches, rows, cols, real) -> np.ndarray:
  """float32 [B, N, P*P*C + 3] of patches [B, N, P*P*C] and per-patch row, column, real."""
  extra = np.stack([rows, cols, real], axis=-1).astype(np.float32)
  return np.concatenate([np.asarray(patches, np.float32), extra], axis=-1)


def patchify(images, patch: int):
  """[B, H, W, C] -> (patches [B, gh*gw, P*P*C], rows, cols, real [B, gh*gw]), row order."""
  b, h, w, c = images.shape
  gh, gw = h // patch, w // patch
  x = images[:, : gh * patch, : gw * patch].reshape(b, gh, patch, gw, patch, c)
  x = jnp.swapaxes(x, 2, 3).reshape(b, gh * gw, patch * patch * c)
  rows, cols = jnp.meshgrid(jnp.arange(gh), jnp.arange(gw), indexing='ij')
  grid = lambda a: jnp.broadcast_to(a.reshape(1, -1), (b, gh * gw)).astype(jnp.float32)
  return x, grid(rows), grid(cols), jnp.ones((b, gh * gw), jnp.float32)


def _tokens(inputs, patch: int):
  """(patches, rows, cols, real) of a packed batch or of an image batch."""
  if inputs.ndim == 4:
    return patchify(inputs, patch)
  if inputs.ndim != 3:
    raise ValueError(f'NaFlex input of shape {inputs.shape}: use [B, N, P*P*C + 3] or [B, H, W, C]')
  return inputs[..., :-_EXTRA], inputs[..., -3], inputs[..., -2], inputs[..., -1]


class NaFlexViT(nn.Module):
  """A ViT taking packed NaFlex batches or images (see above): its architecture's position
  table is NaFlex's 2D one (`posemb='grid'`, `posemb_grid` the (rows, columns) of the grid of
  the resolution it is trained at; `model_spec.naflex_of`). Classifiers: 'token', 'gap' (the
  mean of the real patches' outputs) or 'map' (the MAP head over them, SigLIP 2's). The fields
  are `vit.VisionTransformer`'s.
  """

  num_classes: Optional[int]
  architecture: Architecture
  compute: Compute = Compute()
  head_bias_init: float = 0.0

  @nn.compact
  def __call__(self, inputs, *, train: bool):
    a = self.architecture
    if a.classifier not in CLASSIFIERS:
      raise ValueError(f'classifier={a.classifier!r}: NaFlex ViTs take one of {CLASSIFIERS}')
    dtype = jnp.dtype(self.compute.dtype)
    pixels, rows, cols, real = _tokens(inputs.astype(jnp.float32), a.patch_size[0])
    x = vit.PatchEmbedding(a.hidden_size, a.patch_size, dtype, name='embedding')(pixels)
    x = vit.prepend_tokens(self, x, a)
    num_prefix = x.shape[1] - pixels.shape[1]
    encoder = vit.Encoder(a, self.compute, name='Transformer')
    x = encoder(x, train=train, positions=(rows, cols, real))
    if a.classifier == 'token':
      x = x[:, 0]
    elif a.classifier == 'map':  # the MAP head over the real patches (SigLIP 2, timm's)
      b = a.block
      real_patches = jnp.sum(real > 0, axis=1).astype(jnp.int32)
      head = vit.MAPHead(b.num_heads, b.mlp_dim, b.mlp, b.norm_eps, dtype, name='MAPHead_0')
      x = head(x[:, num_prefix:], real_patches)
    else:  # the mean of the real patches (registers, padding left out)
      weights = real[..., None].astype(x.dtype)
      x = jnp.sum(x[:, num_prefix:] * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1)
    return vit.head(x, self.num_classes, a.representation_size, self.head_bias_init, dtype)
