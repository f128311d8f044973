r"""Measures the logits of every export against ours, at full size: the README's table.

  python examples/export_parity.py [--models=ViT-B_16,R50+ViT-B_16] [--formats=timm,hf,...]

For each released architecture (random weights at initialisation scale, a
1000-way head, 224 px, two random images) it exports with `vit_jax.export`,
loads the result in the target framework and prints
max |ours - theirs| / max |theirs|. Hybrids are read by `timm.create_model` as
timm ships it (its own weight standardisation and GroupNorm epsilon) and by
`vit_jax.interop.timm.build_model` (the original code's).
"""

import argparse
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax import checkpoint
from vit_jax import models
from vit_jax.configs import architectures
from vit_jax.interop import export

SIZE = 224


def random_npz(name, path, seed=0):
  config = architectures.MODEL_CONFIGS[name]
  model = models.VisionTransformer(num_classes=1000, **config)
  shapes = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, SIZE, SIZE, 3)), train=False)
  )['params']
  rng = np.random.default_rng(seed)
  flat = {}
  for key, s in checkpoint.flatten(shapes).items():
    fan_in = int(np.prod(s.shape[:-1])) if key.endswith('kernel') and len(s.shape) > 1 else 0
    std = np.sqrt(2.0 / fan_in) if fan_in else 0.05  # He-scale kernels, small vectors
    flat[key] = (std * rng.normal(size=s.shape) + key.endswith('/scale')).astype(np.float32)
  checkpoint.save_npz(checkpoint.unflatten(flat), path)
  return model, checkpoint.unflatten(flat)


def relative_error(ours, theirs):
  return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


def theirs_timm(out, images, config=None):
  """timm.create_model as timm ships it; with `config`, interop_timm.build_model's model."""
  import json

  import safetensors
  import safetensors.torch
  import timm
  import torch

  from vit_jax.interop import timm as interop_timm

  if config is None:
    with safetensors.safe_open(out, 'np') as f:
      meta = f.metadata()
    model = timm.create_model(meta['timm_model'], **json.loads(meta['timm_kwargs'])).eval()
  else:
    model = interop_timm.build_model(config, 1000, SIZE)
  model.load_state_dict(safetensors.torch.load_file(out), strict=True)
  with torch.no_grad():
    return model(torch.from_numpy(images.transpose(0, 3, 1, 2).copy())).numpy()


def theirs_hf(out, images):
  import torch
  import transformers

  model = transformers.ViTForImageClassification.from_pretrained(out).eval()
  with torch.no_grad():
    return model(pixel_values=torch.from_numpy(images.transpose(0, 3, 1, 2).copy())).logits.numpy()


def theirs_savedmodel(out, images):
  import tensorflow as tf

  return (
    tf.saved_model.load(out)
    .signatures['serving_default'](images=tf.constant(images))['logits']
    .numpy()
  )


def theirs_onnx(out, images):
  import onnxruntime

  return onnxruntime.InferenceSession(out).run(['logits'], {'images': images})[0]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--models', default='ViT-B_16,R50+ViT-B_16')
  parser.add_argument('--formats', default='timm,hf,savedmodel,onnx')
  args = parser.parse_args()
  images = np.random.default_rng(1).uniform(-1, 1, (2, SIZE, SIZE, 3)).astype(np.float32)
  readers = {
    'timm': theirs_timm,
    'hf': theirs_hf,
    'savedmodel': theirs_savedmodel,
    'onnx': theirs_onnx,
  }
  print('| model | format | read by | relative error |\n|---|---|---|---:|')
  with tempfile.TemporaryDirectory() as tmp:
    for name in args.models.split(','):
      npz = os.path.join(tmp, 'model.npz')
      model, params = random_npz(name, npz)
      ours = np.asarray(
        jax.jit(lambda p, x: model.apply({'params': p}, x, train=False))(params, images)
      )
      hybrid = model.resnet is not None
      for fmt in args.formats.split(','):
        if fmt == 'hf' and hybrid:
          continue
        out = os.path.join(tmp, f'out-{fmt}')
        export.export(npz, fmt, out, name)
        reader = {
          'timm': 'timm.create_model' + (' as shipped' if hybrid else ''),
          'hf': 'transformers',
          'savedmodel': 'tensorflow',
          'onnx': 'onnxruntime',
        }[fmt]
        error = relative_error(ours, readers[fmt](out, images))
        print(f'| {name} | {fmt} | {reader} | {error:.1e} |', flush=True)
        if fmt == 'timm' and hybrid:
          config = architectures.MODEL_CONFIGS[name]
          error = relative_error(ours, theirs_timm(out, images, config))
          print(f'| {name} | {fmt} | `interop.timm.build_model` | {error:.1e} |', flush=True)


if __name__ == '__main__':
  main()
