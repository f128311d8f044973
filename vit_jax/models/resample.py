"""Antialiased resampling, as torch's `interpolate(..., antialias=True)` and PIL compute it.

timm resizes position embeddings and patch kernels with these filters by default
(bicubic), and its NaFlexVit resamples its position table to each image's grid with them;
the paper's code and big_vision use linear resizes without antialiasing
(`vit_checkpoint.resize_matrix` holds both kinds). The weights are written once, for NumPy
(the resize matrices of checkpoints) and for JAX (`resample_table`: a NaFlex ViT's table at
every image's own grid inside the model).
"""

import jax
import jax.numpy as jnp
import numpy as np

# Keys' cubic convolution kernel with a = -0.5, as PIL and torch's antialiased bicubic take it
# (torch's bicubic without antialiasing takes -0.75).
_CUBIC_A = -0.5


def _triangle(x, xp):
  return xp.maximum(1.0 - xp.abs(x), 0.0)


def _keys_cubic(x, xp):
  x, a = xp.abs(x), _CUBIC_A
  near = ((a + 2) * x - (a + 3)) * x * x + 1
  far = (((x - 5) * x + 8) * x - 4) * a
  return xp.where(x < 1, near, xp.where(x < 2, far, 0.0))


# Each method's filter: (kernel of the distance in input samples, its radius).
FILTERS = {'bilinear_antialias': (_triangle, 1.0), 'bicubic_antialias': (_keys_cubic, 2.0)}


def antialias_window(index, size, length, method: str, xp=np):
  """Weights [..., length] of the input entries that output `index` of an axis of `size`
  entries reads from an input axis of `length`: the filter centred on the output's
  half-pixel centre, widened by the shrink factor when shrinking, cut to the entries torch
  lets it reach and normalised to sum to one. `xp` is numpy or jax.numpy (`size` may then
  be traced, one per image)."""
  kernel, radius = FILTERS[method]
  scale = length / size
  widen = xp.maximum(scale, 1.0)
  center = (index + 0.5) * scale
  reach = radius * widen
  j = xp.arange(length)
  lo = xp.floor(center - reach + 0.5)[..., None]
  hi = xp.floor(center + reach + 0.5)[..., None]
  weights = kernel(((j + 0.5) - center[..., None]) / widen[..., None], xp)
  weights = xp.where((j >= lo) & (j < hi), weights, 0.0)
  return weights / xp.sum(weights, axis=-1, keepdims=True)


def resample_table(table, rows, cols, real, method: str):
  """[B, N, D]: each patch's position embedding from a NaFlex table [1, gh, gw, D], as
  resizing the table to its image's grid (one more than its real patches' largest row and
  column) by `method` gives it: the weighted sum of the table's entries, one matmul."""
  _, gh, gw, d = table.shape
  height = jnp.max(jnp.where(real > 0, rows, 0), axis=1, keepdims=True) + 1
  width = jnp.max(jnp.where(real > 0, cols, 0), axis=1, keepdims=True) + 1
  wy = antialias_window(rows, height, gh, method, jnp)  # [B, N, gh]
  wx = antialias_window(cols, width, gw, method, jnp)  # [B, N, gw]
  weights = (wy[..., :, None] * wx[..., None, :]).reshape(*rows.shape, gh * gw)
  return jnp.matmul(weights, table.reshape(gh * gw, d), precision=jax.lax.Precision.HIGHEST)
