"""Prepares a dataset once, before training: `python -m vit_jax.prepare NAME ...`.

  python -m vit_jax.prepare cifar10 --data_dir DIR                  # downloads (needs network)
  python -m vit_jax.prepare imagenet2012 --data_dir DIR --manual_dir TARS
  python -m vit_jax.prepare imagenet21k --data_dir DIR --manual_dir EXTRACTED

TFDS datasets are written as ArrayRecord (random access, what the pipeline
reads fastest); TFRecord preparations are read too. ImageNet-21k is not in
TFDS: its extracted release (one folder of JPEGs per synset) becomes JFT-style
shards in DIR/imagenet21k.
"""

import argparse
import os
import sys

from vit_jax import datasets
from vit_jax import jft
from vit_jax import presets
from vit_jax.sources import DataError


def prepare(name, data_dir, manual_dir=None, file_format='array_record', shards=1024):
  if name == 'imagenet21k':
    if not manual_dir or not os.path.isdir(manual_dir) or not os.listdir(manual_dir):
      raise DataError(f'imagenet21k: manual download missing in {manual_dir}; extract the '
                      'release there (one folder per synset) and see README: ImageNet-21k')
    examples, names = jft.examples_from_folder(manual_dir)
    jft.write_shards(examples, os.path.join(datasets.data_dir(data_dir), 'imagenet21k'), 'train',
                     num_classes=len(names), class_names=names, num_shards=shards,
                     file_format='tfrecord')
    return
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  preset = presets.PRESETS.get(name)
  if preset and preset.manual:
    missing = [f for f in preset.manual_files
               if not manual_dir or not os.path.exists(os.path.join(manual_dir, f))]
    if missing:
      raise DataError(f'{name}: manual download missing in {manual_dir} ({", ".join(missing)}); '
                      'download it from image-net.org and see README: ImageNet')
  builder = tfds.builder(preset.tfds_name if preset else name, data_dir=data_dir,
                         file_format=file_format)
  builder.download_and_prepare(
      download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('name', help='TFDS name or preset (imagenet2012, cifar10, vtab/dtd, ...)')
  parser.add_argument('--data_dir', help='TFDS data_dir (config.tfds_data_dir)')
  parser.add_argument('--manual_dir', help='manual downloads (config.tfds_manual_dir)')
  parser.add_argument('--file_format', default='array_record', choices=['array_record', 'tfrecord'])
  args = parser.parse_args(argv)
  try:
    prepare(args.name, args.data_dir, args.manual_dir, args.file_format)
  except DataError as e:
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  main()
