"""ONNX through PyTorch: our weights in timm's ViT, exported by `torch.onnx` (dynamo).

Why this route (checked with the packages PyPI has for this JAX):
- jax2tf + tf2onnx: jax2tf now always serialises the model as one
  `XlaCallModule` op holding StableHLO, which tf2onnx cannot convert.
- jax2onnx: pins an older orbax-checkpoint and pulls equinox and more.
- timm + `torch.onnx.export(dynamo=True)`: timm holds every architecture of
  the paper (hybrids and `gap` included), `interop_timm` makes it numerically
  ours, and torch's exporter is maintained; it needs torch, timm, onnx and
  onnxscript, and nothing else.

The ONNX model has the SavedModel's interface: input `images`, float32
[batch, H, W, 3] in [-1, 1] (NHWC, transposed inside), output `logits`
(or `features` without a head); the batch is dynamic. The pre-logits layer,
which timm lacks, is added around timm's features-only model.
"""

import os

import numpy as np

from vit_jax import checkpoint
from vit_jax.evaluation import inference
from vit_jax.interop import timm
from vit_jax.interop import torch_layout

OPSET = 18
_ONNX_FILE_LIMIT = 2 * 1024**3  # protobuf's limit; larger weights go to OUTPUT.data


def torch_module(loaded: inference.LoadedModel):
  """A torch.nn.Module computing `loaded`'s outputs from NHWC images in [-1, 1]."""
  torch = torch_layout.require('torch')
  flat = checkpoint.flatten(loaded.params)
  head = {k: flat.pop(k) for k in list(flat) if k.startswith(('head/', 'pre_logits/'))}
  backbone = timm.build_model(loaded.config, None, loaded.image_size)
  backbone.load_state_dict(
    {k: torch.from_numpy(v) for k, v in timm.to_timm(flat).items()}, strict=True
  )

  def linear(prefix):
    if f'{prefix}/kernel' not in head:
      return None
    kernel, bias = np.asarray(head[f'{prefix}/kernel']), np.asarray(head[f'{prefix}/bias'])
    layer = torch.nn.Linear(*kernel.shape)
    with torch.no_grad():
      layer.weight.copy_(torch.from_numpy(kernel.T.copy()))
      layer.bias.copy_(torch.from_numpy(bias))
    return layer

  class Serving(torch.nn.Module):
    """NHWC -> timm's NCHW backbone -> pre-logits (Dense + tanh, paper 3.1) -> head."""

    def __init__(self):
      super().__init__()
      self.backbone, self.pre_logits, self.head = backbone, linear('pre_logits'), linear('head')

    def forward(self, images):
      x = self.backbone(images.permute(0, 3, 1, 2))
      if self.pre_logits is not None:
        x = torch.tanh(self.pre_logits(x))
      return x if self.head is None else self.head(x)

  return Serving().eval()


def save(loaded: inference.LoadedModel, output: str) -> str:
  """Writes `output` (.onnx); returns it."""
  torch = torch_layout.require('torch')
  torch_layout.require('onnx')
  torch_layout.require('onnxscript')
  module = torch_module(loaded)
  size = loaded.image_size
  example = torch.zeros(2, size, size, 3)  # batch 2: a batch of 1 would be specialised
  num_bytes = 4 * sum(p.numel() for p in module.parameters())
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  program = torch.onnx.export(
    module,
    (example,),
    input_names=['images'],
    output_names=['features' if loaded.model.num_classes is None else 'logits'],
    dynamic_shapes={'images': {0: torch.export.Dim('batch')}},
    opset_version=OPSET,
    dynamo=True,
    verbose=False,
  )
  program.save(output, external_data=num_bytes >= _ONNX_FILE_LIMIT)
  return output
