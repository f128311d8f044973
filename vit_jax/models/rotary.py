"""2D rotary position embeddings (RoPE; Su et al. 2021) as EVA-02 (Fang et al. 2023) and DINOv3
(Siméoni et al. 2025) use them.

Each attention head's queries and keys of the patch tokens are rotated, pair of channels by
pair of channels, by angles that grow with the patch's row (the first half of the pairs) and
column (the second half): the dot product of a query and a key then depends on their
positions' difference. The class token and registers are not rotated. EVA-02 measures
positions on the grid it was pre-trained at (`ref_grid`): a patch of another grid sits at
its scaled position, so a new resolution needs no resizing of anything. Nothing here is a
parameter: the angles are a fixed function of the grid, as timm's `RotaryEmbeddingCat` with
`in_pixels=False` and `ref_feat_shape` computes them.

DINOv3 (`dinov3_tables`) measures a patch's centre on coordinates normalised to [-1, 1] per
axis (any grid spans the same range: a new resolution needs nothing either), its periods
`temperature ** (2k / (head_dim / 2))` with temperature 100, and pairs channel k with channel
k + head_dim / 2 (the "half" layout, `rotate(..., half=True)`) instead of neighbours.
"""

from typing import Tuple

import jax.numpy as jnp
import numpy as np

TEMPERATURE = 10000.0  # the frequencies' base, as the language models' RoPE


def tables(grid: Tuple[int, int], scheme, head_dim: int):
  """(sin, cos) float32 [rows * columns, head_dim] of the patches of `grid` in row order, by
  `scheme` (`Architecture.rotary`): 'normalised' (DINOv3's: `dinov3_tables`), or EVA-02's reference grid:
  for each channel pair, the sine and cosine of its angle, repeated over the pair's two
  channels."""
  if scheme == 'normalised':
    return dinov3_tables(grid, head_dim)
  ref_grid = scheme
  if head_dim % 4:
    raise ValueError(f'rotary embeddings need a head width divisible by 4, not {head_dim}')
  bands = head_dim // 4  # per axis: half of a head's channel pairs
  frequencies = 1.0 / TEMPERATURE ** (np.arange(bands, dtype=np.float32) / np.float32(bands))
  axes = [
    np.arange(size, dtype=np.float32) / np.float32(size) * np.float32(ref)
    for size, ref in zip(grid, ref_grid)
  ]
  rows, cols = np.meshgrid(*axes, indexing='ij')
  angles = np.concatenate(
    [rows.reshape(-1, 1) * frequencies, cols.reshape(-1, 1) * frequencies], axis=1
  )  # [N, head_dim / 2]: the row's bands, then the column's
  angles = np.repeat(angles, 2, axis=1)  # each pair's two channels share its angle
  return np.sin(angles).astype(np.float32), np.cos(angles).astype(np.float32)


DINOV3_TEMPERATURE = 100.0


def half(scheme) -> bool:
  """Whether `scheme` pairs channel k with k + head_dim / 2 (DINOv3) rather than neighbours."""
  return scheme == 'normalised'


def dinov3_tables(grid: Tuple[int, int], head_dim: int):
  """(sin, cos) float32 [rows * columns, head_dim] of DINOv3's rotary embeddings for the patches
  of `grid` in row order, in the half layout: the row's bands, then the column's, the whole
  repeated once (channel k and k + head_dim / 2 share an angle)."""
  if head_dim % 4:
    raise ValueError(f'rotary embeddings need a head width divisible by 4, not {head_dim}')
  bands = head_dim // 4
  exponents = np.float32(2.0) * np.arange(bands, dtype=np.float32) / np.float32(head_dim // 2)
  periods = np.float32(DINOV3_TEMPERATURE) ** exponents
  axes = [
    np.float32(2.0) * ((np.arange(size, dtype=np.float32) + np.float32(0.5)) / np.float32(size))
    - np.float32(1.0)
    for size in grid
  ]  # each patch's centre, the grid spanning [-1, 1] on each axis
  rows, cols = np.meshgrid(*axes, indexing='ij')
  coords = np.stack([rows.reshape(-1), cols.reshape(-1)], axis=1)[:, :, None]
  angles = (np.float32(2 * np.pi) * coords / periods).reshape(len(coords), -1)
  angles = np.concatenate([angles, angles], axis=1)
  return np.sin(angles).astype(np.float32), np.cos(angles).astype(np.float32)


def padded(sin, cos, first: int, length: int):
  """(sin, cos) [length, head_dim] for a sequence whose patches start at `first`: the other
  tokens (class token, registers, padding) get the angle 0, which leaves them as they are."""
  after = length - first - sin.shape[0]
  pad = lambda t, value: np.pad(t, ((first, after), (0, 0)), constant_values=value)  # noqa: E731
  return pad(sin, 0.0), pad(cos, 1.0)


def rotate(y, sin, cos, layout: str, half: bool = False):
  """Queries or keys `y` in `layout` ('bnhk' or 'bhnk') rotated by their tokens' angles
  ([tokens, head_dim], `padded`): each channel pair (a, b) -> (a cos - b sin, b cos + a sin),
  a pair two neighbouring channels, or (`half`) channels k and k + head_dim / 2."""
  shape = (-1, 1, y.shape[-1]) if layout == 'bnhk' else (-1, y.shape[-1])
  sin = jnp.asarray(sin).reshape(shape).astype(y.dtype)
  cos = jnp.asarray(cos).reshape(shape).astype(y.dtype)
  if half:
    first, second = jnp.split(y, 2, axis=-1)
    swapped = jnp.concatenate([-second, first], axis=-1)
  else:
    pairs = y.reshape(*y.shape[:-1], -1, 2)
    swapped = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(y.shape)
  return y * cos + swapped * sin
