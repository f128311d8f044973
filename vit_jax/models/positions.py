"""Learned position embeddings: the paper's 1D table (3.1) and NaFlex's 2D one.

Rotary embeddings, which have no table, are `models.rotary`. Which a model has is its
`Architecture.posemb` slot (`configs.model_spec.POSEMBS`).
"""

from typing import Callable

import flax.linen as nn
import jax.numpy as jnp

from vit_jax.configs import schema
from vit_jax.models import resample

Dtype = object

# How NaFlex's table is resampled to an image's grid: bilinear without antialiasing
# (`resample_grid`, big_vision's), or torch's antialiased filters (`resample.resample_table`;
# timm NaFlexVit's default is bicubic). No checkpoint records which a model was trained with.
NAFLEX_RESAMPLE = schema.allowed('naflex_resample')


class AddPositionEmbs(nn.Module):
  """Learned 1D position embeddings (paper 3.1) `pos_embedding` [1, N, D], added to the N
  tokens it is given."""

  posemb_init: Callable = nn.initializers.normal(stddev=0.02)
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    shape = (1, x.shape[1], x.shape[2])
    pe = self.param('pos_embedding', self.posemb_init, shape, jnp.float32)
    return x + pe.astype(self.dtype)


def _axis(index, size, length):
  """Bilinear sources (lower, upper, weight of upper) of `index` on an axis of `size`
  entries, read from a table axis of `length` (half-pixel centres, edges clamped)."""
  src = jnp.maximum((index + 0.5) * (length / size) - 0.5, 0.0)
  lower = jnp.minimum(jnp.floor(src), length - 1)
  upper = jnp.minimum(lower + 1, length - 1)
  return lower.astype(jnp.int32), upper.astype(jnp.int32), src - lower


def resample_grid(table, rows, cols, real):
  """[B, N, D]: each patch's position embedding from `table` [1, gh, gw, D].

  A patch at (row, col) of an image whose grid is (h, w) (one more than its
  real patches' largest row and column) reads the table bilinearly at
  ((row + 0.5) * gh / h - 0.5, likewise columns), edges clamped, without
  antialiasing: what resizing the table to (h, w) gives it (torch's
  `interpolate(mode='bilinear', align_corners=False)`), for any mix of grids.
  """
  _, gh, gw, _ = table.shape
  height = jnp.max(jnp.where(real > 0, rows, 0), axis=1, keepdims=True) + 1
  width = jnp.max(jnp.where(real > 0, cols, 0), axis=1, keepdims=True) + 1
  y0, y1, fy = _axis(rows, height, gh)
  x0, x1, fx = _axis(cols, width, gw)
  t = table[0]
  fx, fy = fx[..., None], fy[..., None]
  top = t[y0, x0] * (1 - fx) + t[y0, x1] * fx
  bottom = t[y1, x0] * (1 - fx) + t[y1, x1] * fx
  return top * (1 - fy) + bottom * fy


class GridPositionEmbs(nn.Module):
  """NaFlex's learned 2D position embeddings `pos_embedding` [1, gh, gw, D], resampled to each
  image's grid (see NAFLEX_RESAMPLE) and added to its patches, the last of its tokens."""

  grid: tuple
  resample: str = 'bilinear'  # see NAFLEX_RESAMPLE

  @nn.compact
  def __call__(self, x, rows, cols, real):
    """(x with the patches' embeddings added, each image's real tokens [B]): the prefix tokens
    and the real patches, which come first in every image's row."""
    shape = (1, *self.grid, x.shape[-1])
    table = self.param('pos_embedding', nn.initializers.normal(stddev=0.02), shape, jnp.float32)
    first = x.shape[1] - rows.shape[1]  # the prefix tokens have no position embedding
    if self.resample == 'bilinear':
      positions = resample_grid(table, rows, cols, real)
    elif self.resample in NAFLEX_RESAMPLE:
      positions = resample.resample_table(table, rows, cols, real, self.resample)
    else:
      raise ValueError(f'posemb_resample={self.resample!r}; use one of {NAFLEX_RESAMPLE}')
    patches = x[:, first:] + positions.astype(x.dtype)
    real_tokens = (first + jnp.sum(real, axis=1)).astype(jnp.int32)
    return jnp.concatenate([x[:, :first], patches], axis=1), real_tokens
