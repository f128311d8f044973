"""Prepares a dataset once, before training: TFDS downloads, ImageNet-21k shards.

TFDS datasets are written as ArrayRecord (random access, what the pipeline
reads fastest); TFRecord preparations are read too. ImageNet-21k is not in
TFDS: its extracted release (one folder of JPEGs per synset) becomes JFT-style
shards. `python -m vit_jax.prepare` is the command line.
"""

import os

from vit_jax.data import datasets
from vit_jax.data import presets
from vit_jax.data import shards
from vit_jax.data.sources import DataError


def prepare(name, data_dir, manual_dir=None, file_format='array_record', num_shards=1024):
  if name == 'imagenet21k':
    if not manual_dir or not os.path.isdir(manual_dir) or not os.listdir(manual_dir):
      raise DataError(
        f'imagenet21k: manual download missing in {manual_dir}; extract the '
        'release there (one folder per synset) and see docs/data.md: ImageNet-21k'
      )
    examples, names = shards.examples_from_folder(manual_dir)
    shards.write_shards(
      examples,
      os.path.join(datasets.data_dir(data_dir), 'imagenet21k'),
      'train',
      num_classes=len(names),
      class_names=names,
      num_shards=num_shards,
      file_format='tfrecord',
    )
    return
  import tensorflow_datasets as tfds

  preset = presets.PRESETS.get(name)
  if preset and preset.manual:
    missing = [
      f
      for f in preset.manual_files
      if not manual_dir or not os.path.exists(os.path.join(manual_dir, f))
    ]
    if missing:
      raise DataError(
        f'{name}: manual download missing in {manual_dir} ({", ".join(missing)}); '
        'download it from image-net.org and see docs/data.md: ImageNet'
      )
  builder = tfds.builder(
    preset.tfds_name if preset else name, data_dir=data_dir, file_format=file_format
  )
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
