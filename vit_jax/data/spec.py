"""What a global batch looks like, without reading data or importing TensorFlow.

`python -m vit_jax.compile` and the benchmarks describe the trainer's inputs
with it; tests/test_compile.py lowers the trainer's real batches and these to one program.
"""

import jax
import numpy as np


def batch_spec(config, num_classes: int, multi_label: bool, *, train: bool, model_spec=None):
  """Shapes and dtypes of the global batches the trainer's steps take, without reading data.

  As they cross to the devices (`make_train_iterator(..., raw=True)`): images
  uint8 [B, crop, crop, 3] (NaFlex training, where `model_spec` has token budgets: packed
  patches, float32 in [-1, 1] [B, max budget, P*P*3 + 3]); labels int32 [B], or float32
  [B, K] for multi-label data; under Mixup (train) each example's weight, float32 [B];
  eval batches add a float32 mask [B].
  """
  batch = config.batch if train else config.batch_eval
  crop = config.pp.crop
  if train and config.get('task') == 'dino':  # self-distillation: multi-crop (data.multicrop)
    return multicrop_spec(config, num_classes, multi_label, model_spec)
  image = jax.ShapeDtypeStruct((batch, crop, crop, 3), np.uint8)
  if train and model_spec is not None and model_spec.naflex_tokens:  # packed patches
    patch = model_spec.patch_size
    image = jax.ShapeDtypeStruct(
      (batch, max(model_spec.naflex_tokens), patch * patch * 3 + 3), np.float32
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


def multicrop_spec(config, num_classes: int, multi_label: bool, model_spec) -> dict:
  """A multi-crop train batch (`data.multicrop`): 'global' uint8 [B, 2, crop, crop, 3], 'local'
  uint8 [B, L, l, l, 3], 'masks' bool [B, 2, (crop / patch)^2], and the labels."""
  batch, crop = config.batch, config.pp.crop
  local, grid = config.dino.local_crop, crop // model_spec.patch_size
  return {
    'global': jax.ShapeDtypeStruct((batch, 2, crop, crop, 3), np.uint8),
    'local': jax.ShapeDtypeStruct((batch, config.dino.local_crops, local, local, 3), np.uint8),
    'masks': jax.ShapeDtypeStruct((batch, 2, grid * grid), np.bool_),
    'label': jax.ShapeDtypeStruct(
      (batch, num_classes) if multi_label else (batch,), np.float32 if multi_label else np.int32
    ),
  }
