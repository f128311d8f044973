"""The numbers behind the paper's analyses of a trained ViT (Figure 7, Appendix D.7-D.8).

- `mean_attention_distance`: D.7 / Figure 7 right.
- `attention_rollout` and `rollout_maps`: D.8 (Abnar & Zuidema 2020).
- `posemb_similarity`: Figure 7 centre.
- `embedding_filter_components`: Figure 7 left.

All take and return numpy arrays; `vit_jax.analyze` draws them. Token
sequences are [prefix tokens (the class token, if any)] + patches in
row-major order, as `models.VisionTransformer` builds them.
"""

from typing import Optional, Sequence

import numpy as np


def patch_centres(grid_shape: Sequence[int], pixels_per_patch: float) -> np.ndarray:
  """[N, 2] (row, column) pixel coordinates of the patch centres, row-major."""
  rows, cols = np.meshgrid(np.arange(grid_shape[0]), np.arange(grid_shape[1]), indexing='ij')
  return (np.stack([rows.ravel(), cols.ravel()], axis=1) + 0.5) * pixels_per_patch


def patch_distances(grid_shape: Sequence[int], pixels_per_patch: float) -> np.ndarray:
  """[N, N] Euclidean pixel distances between patch centres."""
  centres = patch_centres(grid_shape, pixels_per_patch)
  return np.linalg.norm(centres[:, None] - centres[None], axis=-1)


def _patch_block(attention: np.ndarray, grid_shape, num_prefix_tokens: int) -> np.ndarray:
  attention = np.asarray(attention, np.float64)
  num_patches = int(np.prod(grid_shape))
  if (
    attention.shape[-1] != num_prefix_tokens + num_patches
    or attention.shape[-2] != attention.shape[-1]
  ):
    raise ValueError(
      f'attention of shape {attention.shape} does not fit {num_prefix_tokens} '
      f'prefix tokens + a {grid_shape[0]}x{grid_shape[1]} patch grid'
    )
  return attention[..., num_prefix_tokens:, num_prefix_tokens:]


def mean_attention_distance(
  attention: np.ndarray,
  grid_shape: Sequence[int],
  pixels_per_patch: float,
  num_prefix_tokens: int = 1,
) -> np.ndarray:
  """Per head, the attention-weighted pixel distance between patches (paper D.7).

  For each query patch: sum over key patches of attention weight x distance
  between the two patch centres, in pixels of the input image; then the mean
  over query patches (and over the batch).

  The class token is left out on both sides: it has no position in the
  image. A query's weights over the patches are renormalised to sum to 1,
  so a head that parks most of its attention on the class token is measured
  by where its remaining attention goes rather than counted as local.

  Args:
    attention: [..., heads, T, T] softmax weights (rows are queries), T =
      num_prefix_tokens + grid rows * grid columns.
    grid_shape: (rows, columns) of the patch grid.
    pixels_per_patch: input pixels per patch step (the patch size; for
      hybrids, the backbone's total stride).
    num_prefix_tokens: 1 with a class token, 0 without.

  Returns:
    [heads] mean distances in pixels, averaged over all leading axes.
  """
  weights = _patch_block(attention, grid_shape, num_prefix_tokens)
  weights = weights / np.maximum(weights.sum(axis=-1, keepdims=True), 1e-12)
  per_query = np.einsum('...qk,qk->...q', weights, patch_distances(grid_shape, pixels_per_patch))
  per_head = per_query.mean(axis=-1)
  return per_head.reshape(-1, per_head.shape[-1]).mean(axis=0)


def attention_rollout(attentions: Sequence[np.ndarray]) -> np.ndarray:
  """Attention rollout through the layers (paper D.8).

  Per layer: average the heads, add the identity for the residual
  connection, re-normalise the rows; then multiply through the layers, the
  last layer on the left.

  Args:
    attentions: per layer, first to last, [B, heads, T, T] (or [heads, T, T]).

  Returns:
    [B, T, T] (or [T, T]): row q is how much each input token flows into
    output token q.
  """
  rollout = None
  for attention in attentions:
    a = np.asarray(attention, np.float64).mean(axis=-3)
    a = a + np.eye(a.shape[-1])
    a = a / a.sum(axis=-1, keepdims=True)
    rollout = a if rollout is None else a @ rollout
  if rollout is None:
    raise ValueError('attention_rollout needs the attention weights of at least one layer')
  return rollout


def rollout_maps(
  rollout: np.ndarray,
  grid_shape: Sequence[int],
  num_prefix_tokens: int = 1,
  readout: Optional[np.ndarray] = None,
) -> np.ndarray:
  """[B, rows, cols]: the rollout onto the patches of what the classifier reads.

  With a class token that is the class token's row; without one (`gap`) the
  classifier averages all tokens, so the map is the mean of the patch rows;
  with a MAP head, `readout` [B, T] (its probe's attention, heads averaged)
  weighs the rows.
  """
  rollout = np.asarray(rollout)
  if readout is not None:
    row = np.einsum('...t,...ts->...s', np.asarray(readout, rollout.dtype), rollout)
    row = row[..., num_prefix_tokens:]
  elif num_prefix_tokens:
    row = rollout[..., 0, num_prefix_tokens:]
  else:
    row = rollout.mean(axis=-2)
  return row.reshape(*row.shape[:-1], *grid_shape)


def posemb_similarity(
  posemb: np.ndarray, grid_shape: Sequence[int], num_prefix_tokens: int = 1
) -> np.ndarray:
  """Cosine similarity between patch position embeddings (Figure 7 centre).

  Args:
    posemb: [1, T, D] (or [T, D]) learned position embeddings.

  Returns:
    [rows, cols, rows, cols]: entry (i, j, k, l) compares patch (i, j) with
    patch (k, l); [i, j] is one tile of the paper's grid of grids.
  """
  posemb = np.asarray(posemb, np.float64).reshape(-1, np.shape(posemb)[-1])
  patches = posemb[num_prefix_tokens:]
  if len(patches) != int(np.prod(grid_shape)):
    raise ValueError(
      f'{len(posemb)} position embeddings do not fit {num_prefix_tokens} prefix '
      f'tokens + a {grid_shape[0]}x{grid_shape[1]} patch grid'
    )
  unit = patches / np.maximum(np.linalg.norm(patches, axis=-1, keepdims=True), 1e-12)
  return (unit @ unit.T).reshape(*grid_shape, *grid_shape)


def embedding_filter_components(kernel: np.ndarray, num_components: int = 28) -> tuple:
  """Principal components of the patch-embedding filters (Figure 7 left).

  Each of the D output channels of the `embedding` convolution is a filter
  of ph x pw x C weights. The filters are centred (mean filter subtracted)
  and decomposed; each component's sign is chosen so that its largest
  absolute weight is positive (the sign of a principal component is
  arbitrary).

  Args:
    kernel: [ph, pw, C, D] the `embedding/kernel` parameter.
    num_components: how many to return (at most min(D - 1, ph*pw*C): centring
      the D filters leaves at most D - 1 directions of variance).

  Returns:
    (components [k, ph, pw, C], explained variance ratio [k]).
  """
  kernel = np.asarray(kernel, np.float64)
  ph, pw, c, d = kernel.shape
  filters = kernel.reshape(ph * pw * c, d).T
  filters = filters - filters.mean(axis=0)
  _, singular, vt = np.linalg.svd(filters, full_matrices=False)
  k = min(num_components, d - 1, len(singular))
  if k < 1:
    raise ValueError(f'{d} embedding filter(s): principal components need at least 2')
  vt = vt[:k]
  signs = np.sign(vt[np.arange(k), np.abs(vt).argmax(axis=1)])
  variance = singular**2
  return (vt * signs[:, None]).reshape(k, ph, pw, c), variance[:k] / variance.sum()
