"""Prepares a dataset once, before training: TFDS downloads, ImageNet-21k shards.

TFDS datasets are written as ArrayRecord (random access, what the pipeline
reads fastest); TFRecord preparations are read too. ImageNet-21k is not in
TFDS: its extracted release (one folder of JPEGs per synset) becomes JFT-style
shards. `python -m vit_jax.prepare` is the command line.

Before TFDS downloads anything, the hosts it will download from are checked:
on a machine without internet access the command stops at once with one line
instead of after TFDS's minutes of retries.
"""

import os
import socket
from typing import Optional
import urllib.parse

from vit_jax.data import datasets
from vit_jax.data import presets
from vit_jax.data import shards
from vit_jax.data.sources import DataError

_CONNECT_TIMEOUT_S = 10


def prepare(name, data_dir, manual_dir=None, file_format='array_record', num_shards=1024) -> str:
  """Downloads and prepares `name`; returns the directory it is in."""
  if name == 'imagenet21k':
    if not manual_dir or not os.path.isdir(manual_dir) or not os.listdir(manual_dir):
      raise DataError(
        f'imagenet21k: manual download missing in {manual_dir}; extract the '
        'release there (one folder per synset) and see docs/data.md: ImageNet-21k'
      )
    examples, names = shards.examples_from_folder(manual_dir)
    out = os.path.join(datasets.data_dir(data_dir), 'imagenet21k')
    shards.write_shards(
      examples,
      out,
      'train',
      num_classes=len(names),
      class_names=names,
      num_shards=num_shards,
      file_format='tfrecord',
    )
    return out
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
  tfds_name = preset.tfds_name if preset else name
  try:
    builder = tfds.builder(tfds_name, data_dir=data_dir, file_format=file_format)
  except tfds.core.registered.DatasetNotFoundError:
    raise datasets.unknown_dataset(name, tfds.list_builders()) from None
  if builder.is_prepared():
    return builder.data_dir
  if builder.MANUAL_DOWNLOAD_INSTRUCTIONS and not (manual_dir and os.path.isdir(manual_dir)):
    raise DataError(
      f'{name}: TFDS cannot download it; download it by hand as its TFDS page says '
      f'(tensorflow.org/datasets/catalog/{tfds_name.split("/")[0]}) and pass --manual_dir'
    )
  unreachable = first_unreachable_host(builder.url_infos or {})
  if unreachable:
    host, why = unreachable
    raise DataError(
      f'{name}: cannot reach {host} to download it ({why}); run this command on a machine '
      f'with internet access, then copy {builder.data_dir} to the same place here'
    )
  try:
    builder.download_and_prepare(
      download_config=tfds.download.DownloadConfig(manual_dir=manual_dir)
    )
  except (OSError, tfds.download.NonMatchingChecksumError) as e:
    # Network, disk or checksum failures: the user's environment, not a bug.
    raise DataError(
      f'{name}: download or preparation failed ({datasets.first_line(e)}); check the '
      f'network and free space in {datasets.data_dir(data_dir)}, then run the command again'
    ) from None
  return builder.data_dir


def first_unreachable_host(urls) -> Optional[tuple]:
  """(host, reason) of the first download host that does not accept a connection, else None."""
  hosts = {}
  for url in urls:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme in ('http', 'https') and parts.hostname:
      hosts[parts.hostname] = parts.port or (443 if parts.scheme == 'https' else 80)
  for host, port in sorted(hosts.items()):
    try:
      socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as e:
      return host, getattr(e, 'strerror', None) or str(e) or type(e).__name__
  return None
