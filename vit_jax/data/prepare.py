"""Prepares a dataset once, before training: TFDS downloads, ImageNet-21k shards.

TFDS datasets are written as ArrayRecord (random access, what the pipeline
reads fastest); TFRecord preparations are read too. Building them runs TFDS's
own code, which needs TensorFlow (`data/readers/tfds.py`). ImageNet-21k is not in
TFDS: its extracted release (one folder of JPEGs per synset) becomes JFT-style
shards. `python -m vit_jax.prepare` is the command line.
"""

import os

from vit_jax.data.readers import shards
from vit_jax.data.readers import tfds
from vit_jax.data.sources import DataError


def prepare(name, data_dir, manual_dir=None, file_format='array_record', num_shards=1024) -> str:
  """Downloads and prepares `name`; returns the directory it is in."""
  if name != 'imagenet21k':
    return tfds.prepare(name, data_dir, manual_dir, file_format)
  if not manual_dir or not os.path.isdir(manual_dir) or not os.listdir(manual_dir):
    raise DataError(
      f'imagenet21k: manual download missing in {manual_dir}; extract the '
      'release there (one folder per synset) and see docs/data.md: ImageNet-21k'
    )
  examples, names = shards.examples_from_folder(manual_dir)
  out = os.path.join(tfds.data_dir(data_dir), 'imagenet21k')
  shards.write_shards(
    examples,
    out,
    'train',
    num_classes=len(names),
    class_names=names,
    num_shards=num_shards,
    file_format=file_format,
  )
  return out
