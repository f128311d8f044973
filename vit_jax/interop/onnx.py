"""ONNX through PyTorch: our forward pass in torch (`torch_vit`), exported by `torch.onnx` (dynamo).

Why this route (checked with the packages PyPI has for this JAX):
- jax2tf + tf2onnx: jax2tf now always serialises the model as one
  `XlaCallModule` op holding StableHLO, which tf2onnx cannot convert.
- jax2onnx: pins an older orbax-checkpoint and pulls equinox and more.
- a torch module + `torch.onnx.export(dynamo=True)`: torch's exporter is
  maintained; it needs torch, onnx and onnxscript and nothing else (not timm,
  whose torchvision import fails beside a CPU-only torch).

The ONNX model has the SavedModel's interface: input `images`, float32
[batch, H, W, 3] in [-1, 1] (NHWC), output `logits` (or `features` without a
head); the batch is dynamic.
"""

import os

from vit_jax.evaluation import loader
from vit_jax.interop import torch_layout
from vit_jax.interop import torch_vit

OPSET = 18
_ONNX_FILE_LIMIT = 2 * 1024**3  # protobuf's limit; larger weights go to OUTPUT.data


def torch_module(loaded: loader.LoadedModel):
  """A torch.nn.Module computing `loaded`'s outputs from NHWC images in [-1, 1]."""
  return torch_vit.build(loaded)


def save(loaded: loader.LoadedModel, output: str) -> str:
  """Writes `output` (.onnx); returns it."""
  torch = torch_layout.require('torch')
  torch_layout.require('onnx')
  torch_layout.require('onnxscript')
  module = torch_module(loaded)
  size = loaded.spec.image_size
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
