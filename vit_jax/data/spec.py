"""What a global batch looks like, without reading data or importing TensorFlow.

`python -m vit_jax.compile` and the benchmarks describe the trainer's inputs
with it; tests/test_compile.py lowers the trainer's real batches and these to one program.
"""

import jax
import numpy as np

from vit_jax.configs import architectures


def batch_spec(config, num_classes: int, multi_label: bool, *, train: bool) -> dict:
  """Shapes and dtypes of the global batches the trainer's steps take, without reading data.

  As they cross to the devices (`make_train_iterator(..., raw=True)`): images
  uint8 [B, crop, crop, 3] (NaFlex training: packed patches, float32 in [-1, 1]
  [B, max(naflex_tokens), P*P*3 + 3]); labels int32 [B], or float32 [B, K] for
  multi-label data; under Mixup (train) each example's weight, float32 [B];
  eval batches add a float32 mask [B].
  """
  batch = config.batch if train else config.batch_eval
  crop = config.pp.crop
  image = jax.ShapeDtypeStruct((batch, crop, crop, 3), np.uint8)
  if train and config.get('naflex_tokens'):  # packed patches (vit_jax.models.naflex)
    patch = config.patch_size or architectures.MODEL_CONFIGS[config.model].patches.size[0]
    image = jax.ShapeDtypeStruct(
      (batch, max(config.naflex_tokens), patch * patch * 3 + 3), np.float32
    )
  spec = {
    'image': image,
    'label': jax.ShapeDtypeStruct(
      (batch, num_classes) if multi_label else (batch,), np.float32 if multi_label else np.int32
    ),
  }
  if train and float(config.pp.mixup) > 0:
    spec['mixup'] = jax.ShapeDtypeStruct((batch,), np.float32)
  if not train:
    spec['mask'] = jax.ShapeDtypeStruct((batch,), np.float32)
  return spec
