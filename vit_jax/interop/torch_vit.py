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
  functional = torch.nn.functional
  config = loaded.config
  torch_layout.check_standard_blocks(config, 'ONNX')
  flat = checkpoint.flatten(loaded.params)

  def same_pad(x, kernel, stride, value=0.0):
    """TensorFlow 'SAME' padding of NCHW `x` (more at the bottom/right when odd)."""
    pads = []
    for size in (x.shape[3], x.shape[2]):
      total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
      pads += [total // 2, total - total // 2]
    return functional.pad(x, pads, value=value)

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

    def p(self, key):
      return self.weights[key.replace('/', '__')]

    def conv(self, x, name, stride, padding, standardize=False):
      kernel = self.p(f'{name}/kernel')  # [kh, kw, in, out]
      if standardize:
        mean = kernel.mean(dim=(0, 1, 2), keepdim=True)
        std = kernel.std(dim=(0, 1, 2), unbiased=False, keepdim=True)
        # As models.resnet.weight_standardize (the official formula): eps on the std.
        kernel = (kernel - mean) / (std + _STD_CONV_EPS)
      if padding == 'SAME':
        x = same_pad(x, kernel.shape[0], stride)
      bias = self.p(f'{name}/bias') if f'{name}/bias' in flat else None
      return functional.conv2d(x, kernel.permute(3, 2, 0, 1), bias, stride=stride)

    def group_norm(self, x, name):
      return functional.group_norm(
        x, _GN_GROUPS, self.p(f'{name}/scale'), self.p(f'{name}/bias'), _GN_EPS
      )

    def layer_norm(self, x, name):
      scale = self.p(f'{name}/scale')
      return functional.layer_norm(x, scale.shape, scale, self.p(f'{name}/bias'), _LN_EPS)

    def dense(self, x, name):
      return x @ self.p(f'{name}/kernel') + self.p(f'{name}/bias')

    def resnet(self, x):
      x = self.conv(x, 'conv_root', 2, 'SAME', standardize=True)
      x = functional.relu(self.group_norm(x, 'gn_root'))
      x = functional.max_pool2d(same_pad(x, 3, 2, value=-math.inf), 3, 2)
      for i, units in enumerate(config.resnet.num_layers):
        for u in range(units):
          stride = 2 if i > 0 and u == 0 else 1
          name = f'block{i + 1}/unit{u + 1}'
          residual = x
          if f'{name}/conv_proj/kernel' in flat:
            residual = self.conv(x, f'{name}/conv_proj', stride, 'SAME', standardize=True)
            residual = self.group_norm(residual, f'{name}/gn_proj')
          y = self.conv(x, f'{name}/conv1', 1, 'SAME', standardize=True)
          y = functional.relu(self.group_norm(y, f'{name}/gn1'))
          y = self.conv(y, f'{name}/conv2', stride, 'SAME', standardize=True)
          y = functional.relu(self.group_norm(y, f'{name}/gn2'))
          y = self.group_norm(
            self.conv(y, f'{name}/conv3', 1, 'SAME', standardize=True), f'{name}/gn3'
          )
          x = functional.relu(residual + y)
      return x

    def attention(self, x, name, inputs_kv=None):
      kv = x if inputs_kv is None else inputs_kv
      q, k, v = (
        torch.einsum('bnd,dhk->bhnk', y, self.p(f'{name}/{part}/kernel'))
        + self.p(f'{name}/{part}/bias')[:, None]
        for y, part in ((x, 'query'), (kv, 'key'), (kv, 'value'))
      )
      weights = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
      y = weights @ v
      return torch.einsum('bhnk,hkd->bnd', y, self.p(f'{name}/out/kernel')) + self.p(
        f'{name}/out/bias'
      )

    def forward(self, images):
      x = images.permute(0, 3, 1, 2)  # NHWC -> NCHW
      if config.get('resnet') is not None:
        x = self.resnet(x)
      x = self.conv(x, 'embedding', config.patches.size[0], 'VALID')
      x = x.flatten(2).transpose(1, 2)  # [b, tokens, width], row-major over the grid
      if 'cls' in flat:
        x = torch.cat([self.p('cls').expand(x.shape[0], -1, -1), x], dim=1)
      x = x + self.p('Transformer/posembed_input/pos_embedding')
      for i in range(config.transformer.num_layers):
        block = f'Transformer/encoderblock_{i}'
        x = x + self.attention(
          self.layer_norm(x, f'{block}/LayerNorm_0'), f'{block}/MultiHeadDotProductAttention_1'
        )
        y = self.layer_norm(x, f'{block}/LayerNorm_2')
        y = functional.gelu(self.dense(y, f'{block}/MlpBlock_3/Dense_0'), approximate='tanh')
        x = x + self.dense(y, f'{block}/MlpBlock_3/Dense_1')
      x = self.layer_norm(x, 'Transformer/encoder_norm')
      if config.classifier == 'token':
        x = x[:, 0]
      elif config.classifier == 'gap':
        x = x.mean(dim=1)
      elif config.classifier == 'map':  # models.vit.MAPHead
        probe = self.p('MAPHead_0/probe').expand(x.shape[0], -1, -1)
        x = self.attention(probe, 'MAPHead_0/MultiHeadDotProductAttention_0', inputs_kv=x)
        y = self.layer_norm(x, 'MAPHead_0/LayerNorm_0')
        y = functional.gelu(self.dense(y, 'MAPHead_0/MlpBlock_0/Dense_0'), approximate='tanh')
        x = (x + self.dense(y, 'MAPHead_0/MlpBlock_0/Dense_1'))[:, 0]
      if 'pre_logits/kernel' in flat:
        x = torch.tanh(self.dense(x, 'pre_logits'))  # paper 3.1
      return self.dense(x, 'head') if 'head/kernel' in flat else x

  return ViT().eval()
