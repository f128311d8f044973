"""NaFlex ViT: images at their own aspect ratio and resolution, up to a token budget.

NaViT (Dehghani et al. 2023) and FlexiViT's successor in SigLIP 2 (Tschannen
et al. 2025), as timm's `naflexvit`: each image is resized so that its patch
grid (h, w) keeps its aspect ratio and h * w fits a budget of N tokens, and a
batch holds for every image N patches (its own first, in row order, then
padding), their (row, column) in the image's grid and whether each is real.
Attention ignores the padding (each image's sequence is its real tokens), the
learned 2D position embeddings (a grid of the model's size) are resampled
bilinearly to each image's grid, and pooling reads real tokens only.

One array carries a packed batch, so the trainer's steps and every
`model.apply(params, x)` take it as they take images: float32 [B, N, P*P*C + 3],
each row a patch's pixels in (row, column, channel) order, then its grid row,
its grid column and 1 for a real patch (0 for padding). An image batch
[B, H, W, C] is taken too, as one full grid per image (evaluation at any
resolution that the patch size divides).

The encoder blocks are `vit.py`'s, under the same parameter names, with the
attention reading a sequence length per image; `embedding/kernel` keeps the
conv layout [P, P, C, D] (a plain ViT's kernel loads as it is). The position
embeddings are `Transformer/posembed_input/pos_embedding` [1, gh, gw, D]
(patches only; the class token has none, as in timm's naflexvit).
"""

from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.core import hardware
from vit_jax.core import sharding
from vit_jax.models import vit

CLASSIFIERS = ('token', 'gap')
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
  """Learned 2D position embeddings `pos_embedding` [1, gh, gw, D], added per patch."""

  grid: tuple

  @nn.compact
  def __call__(self, x, rows, cols, real):
    shape = (1, *self.grid, x.shape[-1])
    table = self.param('pos_embedding', nn.initializers.normal(stddev=0.02), shape, jnp.float32)
    return x + resample_grid(table, rows, cols, real).astype(x.dtype)


class MaskedAttention(nn.Module):
  """`vit.MultiHeadDotProductAttention`'s parameters, attending over each image's first
  `lengths` tokens (its real ones): padding is neither read nor mixed in."""

  num_heads: int
  dtype: Any = jnp.float32
  attention: str = 'auto'

  @nn.compact
  def __call__(self, x, lengths):
    d = x.shape[-1]
    head_dim = d // self.num_heads
    qkv = [
      vit._Projection((d, self.num_heads, head_dim), (self.num_heads, head_dim), 1, name=n)()
      for n in ('query', 'key', 'value')
    ]
    out_kernel, out_bias = vit._Projection((self.num_heads, head_dim, d), (d,), 2, name='out')()
    q, k, v = (
      jnp.einsum('bnd,dhk->bnhk', x, kernel.astype(self.dtype)) + bias.astype(self.dtype)
      for kernel, bias in qkv
    )
    if self.is_mutable_collection('intermediates'):
      y = self._explicit(q, k, v, lengths)  # the weights, for the analyses (vit.py's too)
    else:
      implementation = self.attention
      if implementation in ('auto', 'explicit'):
        implementation = (
          'cudnn' if hardware.cudnn_attention_applies(self.dtype, head_dim) else 'xla'
        )
      y = jax.nn.dot_product_attention(
        q,
        k,
        v,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        implementation=implementation,
      )
    return jnp.einsum('bnhk,hkd->bnd', y, out_kernel.astype(self.dtype)) + out_bias.astype(
      self.dtype
    )

  def _explicit(self, q, k, v, lengths):
    """Attention with its weights [B, heads, N, N] sown as `attention_weights` (what
    `vit.MultiHeadDotProductAttention` sows): padding keys get none, padding queries none."""
    n = q.shape[1]
    real = jnp.arange(n)[None, :] < lengths[:, None]  # [B, N]
    logits = jnp.einsum('bqhk,bshk->bhqs', q, k).astype(jnp.float32) / np.sqrt(q.shape[-1])
    logits = jnp.where(real[:, None, None, :], logits, jnp.finfo(jnp.float32).min)
    weights = jnp.where(real[:, None, :, None], jax.nn.softmax(logits, axis=-1), 0.0)
    self.sow('intermediates', 'attention_weights', weights)
    return jnp.einsum('bhqs,bshk->bqhk', weights.astype(v.dtype), v)


class MaskedEncoderBlock(nn.Module):
  """`vit.Encoder1DBlock` (pre-LN, the same parameter names) over sequences of `lengths`."""

  mlp_dim: int
  num_heads: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  attention: str = 'auto'

  @nn.compact
  def __call__(self, x, lengths, deterministic: bool):
    x = sharding.constrain(x, ('batch', None, None))
    y = vit._layer_norm('LayerNorm_0', self.dtype)(x)
    y = MaskedAttention(
      self.num_heads, self.dtype, self.attention, name='MultiHeadDotProductAttention_1'
    )(y, lengths)
    x = x + nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
    y = vit._layer_norm('LayerNorm_2', self.dtype)(x)
    mlp = vit.MlpBlock(self.mlp_dim, self.dropout_rate, self.dtype, name='MlpBlock_3')
    return x + mlp(y, deterministic=deterministic)


class PatchEmbedding(nn.Module):
  """Paper 3.1's linear projection of flattened patches, with `nn.Conv`'s parameters
  (kernel [P, P, C, D], its initialisation, bias), so a plain ViT's loads unchanged."""

  patch: int
  hidden_size: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, pixels):
    channels = pixels.shape[-1] // (self.patch * self.patch)
    shape = (self.patch, self.patch, channels, self.hidden_size)
    kernel = self.param('kernel', nn.initializers.lecun_normal(), shape, jnp.float32)
    bias = self.param('bias', nn.initializers.zeros, (self.hidden_size,), jnp.float32)
    kernel = kernel.reshape(-1, self.hidden_size).astype(self.dtype)
    return jnp.einsum('bnp,pd->bnd', pixels.astype(self.dtype), kernel) + bias.astype(self.dtype)


class NaFlexEncoder(nn.Module):
  """`vit.Encoder` for NaFlex: position embeddings on the patches, then the prefix tokens,
  the blocks over each image's real tokens, the final LayerNorm."""

  grid: tuple
  num_layers: int
  mlp_dim: int
  num_heads: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  attention: str = 'auto'

  @nn.compact
  def __call__(self, x, prefix, rows, cols, real, *, train: bool):
    if self.attention_dropout_rate:
      raise ValueError('NaFlex ViTs have no attention dropout; set attention_dropout_rate=0')
    x = GridPositionEmbs(self.grid, name='posembed_input')(x, rows, cols, real)
    x = jnp.concatenate([prefix, x], axis=1)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
    # Real patches come first in every image's row: its sequence is prefix + real.
    lengths = (prefix.shape[1] + jnp.sum(real, axis=1)).astype(jnp.int32)
    for i in range(self.num_layers):
      x = MaskedEncoderBlock(
        self.mlp_dim,
        self.num_heads,
        self.dropout_rate,
        self.dtype,
        self.attention,
        name=f'encoderblock_{i}',
      )(x, lengths, not train)
    return vit._layer_norm('encoder_norm', self.dtype)(x)


class NaFlexViT(nn.Module):
  """A ViT of `MODEL_CONFIGS` sizes taking packed NaFlex batches or images (see above).

  `posemb_grid` is the (rows, columns) of the learned position embeddings: the
  grid of the resolution it is trained at. Classifiers: 'token' or 'gap'
  (the mean of the real patches' outputs).
  """

  num_classes: Optional[int]
  patches: Mapping[str, Any]
  transformer: Mapping[str, Any]
  hidden_size: int
  posemb_grid: tuple
  representation_size: Optional[int] = None
  classifier: str = 'token'
  head_bias_init: float = 0.0
  model_name: Optional[str] = None
  dtype: Any = jnp.float32
  attention: str = 'auto'
  num_registers: int = 0  # register tokens after the class token (vit.prepend_tokens)

  @nn.compact
  def __call__(self, inputs, *, train: bool):
    if self.classifier not in CLASSIFIERS:
      raise ValueError(f'classifier={self.classifier!r}: NaFlex ViTs take one of {CLASSIFIERS}')
    patch = self.patches['size'][0]
    pixels, rows, cols, real = _tokens(inputs.astype(jnp.float32), patch)
    x = PatchEmbedding(patch, self.hidden_size, self.dtype, name='embedding')(pixels)
    prefix = jnp.zeros((x.shape[0], 0, self.hidden_size), self.dtype)
    prefix = vit.prepend_tokens(self, prefix, self.classifier, self.num_registers)
    x = NaFlexEncoder(
      grid=tuple(self.posemb_grid),
      dtype=self.dtype,
      attention=self.attention,
      name='Transformer',
      **self.transformer,
    )(x, prefix, rows, cols, real, train=train)
    if self.classifier == 'token':
      x = x[:, 0]
    else:  # the mean of the real patches (registers, padding left out)
      weights = real[..., None].astype(x.dtype)
      x = jnp.sum(x[:, prefix.shape[1] :] * weights, axis=1) / jnp.maximum(
        jnp.sum(weights, axis=1), 1
      )
    return vit.head(x, self.num_classes, self.representation_size, self.head_bias_init, self.dtype)
