"""The ViT's forward pass in plain PyTorch, on our parameters as they are stored.

What the ONNX export traces: no timm (whose import needs a torchvision that
matches torch, which CPU-only machines rarely have) and no renaming. Every op
mirrors `vit_jax.models.vit` and `vit_jax.models.resnet`: pre-LN blocks with
LayerNorm eps 1e-6, tanh-approximated GELU, the class token, learned position
embeddings, the MAP head; for hybrids the BiT ResNet with weight-standardised convolutions
(divided by std + 1e-5), GroupNorm (32 groups, eps 1e-6) and TensorFlow's 'SAME' padding.
Input: NHWC float32 in [-1, 1], as our model takes.
"""

import math

import numpy as np

from vit_jax import checkpoint
from vit_jax.interop import torch_layout

_LN_EPS = 1e-6
_STD_CONV_EPS = 1e-5
_GN_EPS = 1e-6
_GN_GROUPS = 32


def build(loaded):
  """A `torch.nn.Module` computing `loaded`'s outputs (logits, or features without a head)."""
  torch = torch_layout.require('torch')
  arch = loaded.spec.architecture
  torch_layout.check_writes(arch, 'ONNX')
  flat = checkpoint.flatten(loaded.params)

  class ViT(torch.nn.Module):
    def __init__(self):
      super().__init__()
      # '/' is not allowed in module attribute names; '__' is not used by ours.
      self.weights = torch.nn.ParameterDict(
        {
          key.replace('/', '__'): torch.nn.Parameter(
            torch.from_numpy(np.asarray(value, np.float32).copy()), requires_grad=False
          )
          for key, value in flat.items()
        }
      )

    def forward(self, images):
      return _forward(_Ops(torch, self.weights, flat), images, arch)

  return ViT().eval()


class _Ops:
  """The layers of the forward pass, each reading its stored parameters by their path."""

  def __init__(self, torch, weights, flat):
    self.torch, self.functional = torch, torch.nn.functional
    self._weights, self.flat = weights, flat

  def p(self, key):
    return self._weights[key.replace('/', '__')]

  def same_pad(self, x, kernel, stride, value=0.0):
    """TensorFlow 'SAME' padding of NCHW `x` (more at the bottom/right when odd)."""
    pads = []
    for size in (x.shape[3], x.shape[2]):
      total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
      pads += [total // 2, total - total // 2]
    return self.functional.pad(x, pads, value=value)

  def conv(self, x, name, stride, padding, standardize=False):
    kernel = self.p(f'{name}/kernel')  # [kh, kw, in, out]
    if standardize:
      mean = kernel.mean(dim=(0, 1, 2), keepdim=True)
      std = kernel.std(dim=(0, 1, 2), unbiased=False, keepdim=True)
      # As models.resnet.weight_standardize (the official formula): eps on the std.
      kernel = (kernel - mean) / (std + _STD_CONV_EPS)
    if padding == 'SAME':
      x = self.same_pad(x, kernel.shape[0], stride)
    bias = self.p(f'{name}/bias') if f'{name}/bias' in self.flat else None
    return self.functional.conv2d(x, kernel.permute(3, 2, 0, 1), bias, stride=stride)

  def group_norm(self, x, name):
    return self.functional.group_norm(
      x, _GN_GROUPS, self.p(f'{name}/scale'), self.p(f'{name}/bias'), _GN_EPS
    )

  def layer_norm(self, x, name):
    scale = self.p(f'{name}/scale')
    return self.functional.layer_norm(x, scale.shape, scale, self.p(f'{name}/bias'), _LN_EPS)

  def dense(self, x, name):
    return x @ self.p(f'{name}/kernel') + self.p(f'{name}/bias')

  def mlp(self, x, name):
    y = self.functional.gelu(self.dense(x, f'{name}/Dense_0'), approximate='tanh')
    return self.dense(y, f'{name}/Dense_1')

  def attention(self, x, name, inputs_kv=None):
    kv = x if inputs_kv is None else inputs_kv
    q, k, v = (
      self.torch.einsum('bnd,dhk->bhnk', y, self.p(f'{name}/{part}/kernel'))
      + self.p(f'{name}/{part}/bias')[:, None]
      for y, part in ((x, 'query'), (kv, 'key'), (kv, 'value'))
    )
    weights = self.torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
    y = weights @ v
    return self.torch.einsum('bhnk,hkd->bnd', y, self.p(f'{name}/out/kernel')) + self.p(
      f'{name}/out/bias'
    )


def _forward(ops, images, arch):
  x = images.permute(0, 3, 1, 2)  # NHWC -> NCHW
  if arch.resnet is not None:
    x = _resnet(ops, x, arch.resnet.num_layers)
  x = ops.conv(x, 'embedding', arch.patch_size[0], 'VALID')
  x = x.flatten(2).transpose(1, 2)  # [b, tokens, width], row-major over the grid
  first = 1 if 'cls' in ops.flat else 0
  if 'cls' in ops.flat:
    x = ops.torch.cat([ops.p('cls').expand(x.shape[0], -1, -1), x], dim=1)
  registers = ops.flat['registers'].shape[1] if 'registers' in ops.flat else 0
  if registers:  # models.vit.prepend_tokens: after the class token
    reg = ops.p('registers').expand(x.shape[0], -1, -1)
    x = ops.torch.cat([x[:, :first], reg, x[:, first:]], dim=1)
  x = x + ops.p('Transformer/posembed_input/pos_embedding')
  for i in range(arch.num_layers):
    block = f'Transformer/encoderblock_{i}'
    x = x + ops.attention(
      ops.layer_norm(x, f'{block}/LayerNorm_0'), f'{block}/MultiHeadDotProductAttention_1'
    )
    x = x + ops.mlp(ops.layer_norm(x, f'{block}/LayerNorm_2'), f'{block}/MlpBlock_3')
  x = ops.layer_norm(x, 'Transformer/encoder_norm')
  if registers:  # dropped before pooling
    x = ops.torch.cat([x[:, :first], x[:, first + registers :]], dim=1)
  x = _pool(ops, x, arch.classifier)
  if 'pre_logits/kernel' in ops.flat:
    x = ops.torch.tanh(ops.dense(x, 'pre_logits'))  # paper 3.1
  return ops.dense(x, 'head') if 'head/kernel' in ops.flat else x


def _pool(ops, x, classifier):
  """The representation the head reads: the class token, the mean token or the MAP head's."""
  if classifier == 'token':
    return x[:, 0]
  if classifier == 'gap':
    return x.mean(dim=1)
  if classifier == 'map':  # models.vit.MAPHead
    probe = ops.p('MAPHead_0/probe').expand(x.shape[0], -1, -1)
    x = ops.attention(probe, 'MAPHead_0/MultiHeadDotProductAttention_0', inputs_kv=x)
    x = x + ops.mlp(ops.layer_norm(x, 'MAPHead_0/LayerNorm_0'), 'MAPHead_0/MlpBlock_0')
    return x[:, 0]
  return x  # the unpooled classifiers: every token


def _resnet(ops, x, units_per_stage):
  """The BiT ResNet stem of the hybrids (models.resnet)."""
  functional = ops.functional
  x = ops.conv(x, 'conv_root', 2, 'SAME', standardize=True)
  x = functional.relu(ops.group_norm(x, 'gn_root'))
  x = functional.max_pool2d(ops.same_pad(x, 3, 2, value=-math.inf), 3, 2)
  for i, units in enumerate(units_per_stage):
    for u in range(units):
      stride = 2 if i > 0 and u == 0 else 1
      name = f'block{i + 1}/unit{u + 1}'
      residual = x
      if f'{name}/conv_proj/kernel' in ops.flat:
        residual = ops.conv(x, f'{name}/conv_proj', stride, 'SAME', standardize=True)
        residual = ops.group_norm(residual, f'{name}/gn_proj')
      y = ops.conv(x, f'{name}/conv1', 1, 'SAME', standardize=True)
      y = functional.relu(ops.group_norm(y, f'{name}/gn1'))
      y = ops.conv(y, f'{name}/conv2', stride, 'SAME', standardize=True)
      y = functional.relu(ops.group_norm(y, f'{name}/gn2'))
      y = ops.group_norm(ops.conv(y, f'{name}/conv3', 1, 'SAME', standardize=True), f'{name}/gn3')
      x = functional.relu(residual + y)
  return x
