"""BiT ResNet backbone of the R+ViT hybrids (paper section 3.1, "Hybrid Architecture").

Weight-standardised convolutions and GroupNorm with 32 groups, as in BiT
(Kolesnikov et al. 2020). Parameter names follow the public hybrid checkpoints:
`conv_root`, `gn_root`, `block{s}/unit{u}/{conv1,gn1,conv2,gn2,conv3,gn3,conv_proj,gn_proj}`.
"""

from typing import Any, Sequence

import flax.linen as nn
import jax.numpy as jnp

Dtype = Any


def weight_standardize(w, axis, eps):
  """Subtracts the mean and divides by (standard deviation + eps) over `axis`.

  The epsilon is added to the standard deviation, not to the variance, as in
  the official `models_resnet.weight_standardize` that trained the released
  hybrid checkpoints; with small kernels the two differ by far more than 1e-5.
  """
  w = w - jnp.mean(w, axis=axis, keepdims=True)
  return w / (jnp.std(w, axis=axis, keepdims=True) + eps)


class StdConv(nn.Conv):
  """A convolution whose kernel is standardised over its spatial and input axes."""

  def param(self, name, *args, **kwargs):
    param = super().param(name, *args, **kwargs)
    if name == 'kernel':
      param = weight_standardize(param, axis=(0, 1, 2), eps=1e-5)
    return param


class ResidualUnit(nn.Module):
  """Bottleneck unit: 1x1 -> 3x3 (strided) -> 1x1, with a projected shortcut."""

  features: int
  strides: Sequence[int] = (1, 1)
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    conv = lambda f, k, s, name: StdConv(
      f, k, strides=s, use_bias=False, dtype=self.dtype, name=name
    )
    gn = lambda name, **kw: nn.GroupNorm(dtype=self.dtype, name=name, **kw)

    residual = x
    if x.shape[-1] != self.features * 4 or tuple(self.strides) != (1, 1):
      residual = conv(self.features * 4, (1, 1), self.strides, 'conv_proj')(residual)
      residual = gn('gn_proj')(residual)

    y = nn.relu(gn('gn1')(conv(self.features, (1, 1), (1, 1), 'conv1')(x)))
    y = nn.relu(gn('gn2')(conv(self.features, (3, 3), self.strides, 'conv2')(y)))
    # Zero-initialised last GroupNorm scale: each unit starts as the identity.
    y = gn('gn3', scale_init=nn.initializers.zeros)(
      conv(self.features * 4, (1, 1), (1, 1), 'conv3')(y)
    )
    return nn.relu(residual + y)


class ResNetStage(nn.Module):
  """`block_size` residual units; the first one may downsample."""

  block_size: int
  features: int
  first_stride: Sequence[int]
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = ResidualUnit(self.features, self.first_stride, self.dtype, name='unit1')(x)
    for i in range(1, self.block_size):
      x = ResidualUnit(self.features, (1, 1), self.dtype, name=f'unit{i + 1}')(x)
    return x


def resnet_stem(x, num_layers: Sequence[int], width_factor: float, dtype: Dtype):
  """Root (7x7/2 conv, GroupNorm, ReLU, 3x3/2 max-pool) and the residual stages.

  A function, not a module: called inside the ViT's compact `__call__`, its
  layers land at the top of the parameter tree beside `embedding`, as in the
  public hybrid checkpoints. Three stages give a total stride of 16 (R50 with
  units (3, 4, 9)); four give 32.
  """
  width = int(64 * width_factor)
  x = StdConv(width, (7, 7), strides=(2, 2), use_bias=False, dtype=dtype, name='conv_root')(x)
  x = nn.relu(nn.GroupNorm(dtype=dtype, name='gn_root')(x))
  x = nn.max_pool(x, (3, 3), strides=(2, 2), padding='SAME')
  for i, block_size in enumerate(num_layers):
    x = ResNetStage(
      block_size, width * 2**i, (1, 1) if i == 0 else (2, 2), dtype, name=f'block{i + 1}'
    )(x)
  return x
