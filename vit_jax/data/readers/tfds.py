"""TFDS datasets: read once prepared, without TensorFlow; prepared with it.

A prepared TFDS dataset is a folder DATA_DIR/NAME[/CONFIG]/VERSION holding
`dataset_info.json` (splits, shard lengths, file format), `features.json`,
`LABEL.labels.txt` (class names) and ArrayRecord or TFRecord shards of
`tf.train.Example`s. This module reads that layout itself (`records`,
`example_proto`): the examples come in TFDS's own order, split expressions
('train[:98%]', 'train+validation') slice as TFDS slices, and neither
TensorFlow nor the `tensorflow_datasets` package is imported to train or
evaluate.

Preparing (downloading and building) runs TFDS's real builders, which need
TensorFlow: `pip install 'vit_jax[tfds]'`; without it `python -m
vit_jax.prepare` says so in one line.

The reader claims every name no reader before it claimed: it comes last.
"""

import difflib
import functools
import json
import os
import socket
from typing import Optional
import urllib.parse

import numpy as np

from vit_jax.core import console
from vit_jax.core import files
from vit_jax.data import example_proto
from vit_jax.data import presets
from vit_jax.data import records
from vit_jax.data import sources
from vit_jax.data.readers import reader
from vit_jax.data.sources import DataError

_CONNECT_TIMEOUT_S = 10
INSTALL = "pip install 'vit_jax[tfds]' (TensorFlow and tensorflow-datasets)"


def data_dir(tfds_data_dir=None) -> str:
  """TFDS's data folder: `tfds_data_dir`, $TFDS_DATA_DIR, or ~/tensorflow_datasets."""
  return os.path.expanduser(
    tfds_data_dir or os.environ.get('TFDS_DATA_DIR') or '~/tensorflow_datasets'
  )


def _version_key(name: str):
  try:
    return tuple(int(p) for p in name.split('.'))
  except ValueError:
    return None


def find(tfds_name: str, tfds_data_dir=None) -> Optional[str]:
  """The newest prepared version folder of `tfds_name` ('cifar10', 'eurosat/rgb',
  'cifar10:3.0.2'), or None."""
  name, _, version = tfds_name.partition(':')
  folder = os.path.join(data_dir(tfds_data_dir), *name.split('/'))
  candidates = [version] if version else files.listdir(folder)
  versions = sorted(
    (v for v in candidates if _version_key(v) is not None),
    key=_version_key,
    reverse=True,
  )
  for v in versions:
    if files.exists(os.path.join(folder, v, 'dataset_info.json')):
      return os.path.join(folder, v)
  return None


def prepared_names(tfds_data_dir=None):
  """Names of the datasets prepared in the data folder (without configs), for suggestions."""
  root = data_dir(tfds_data_dir)
  return sorted(n for n in files.listdir(root) if files.isdir(os.path.join(root, n)))


# ---------------------------------------------------------------------------
# Reading.


@functools.lru_cache(maxsize=32)
def _metadata(folder: str):
  """(dataset_info.json, the flat {feature name: spec} of features.json) of a prepared folder."""
  try:
    with files.open_file(os.path.join(folder, 'dataset_info.json')) as f:
      info = json.load(f)
    features = {}
    path = os.path.join(folder, 'features.json')
    if files.exists(path):
      with files.open_file(path) as f:
        features = _flat_features(json.load(f))
  except (OSError, ValueError) as e:
    raise DataError(
      f'{folder}: unreadable TFDS metadata ({e}); prepare the dataset again'
    ) from None
  return info, features


def _flat_features(spec, prefix=''):
  """features.json -> {'image': {...}, 'label': {...}, 'objects/size': {...}}."""
  out = {}
  for name, feature in spec.get('featuresDict', {}).get('features', {}).items():
    key = f'{prefix}{name}'
    inner = feature.get('sequence', {}).get('feature', feature)
    if 'featuresDict' in inner:
      out.update(_flat_features(inner, key + '/'))
    else:
      out[key] = inner
  return out


def _num_classes_and_names(folder, features, label_key):
  feature = features.get(label_key, {})
  count = feature.get('classLabel', {}).get('numClasses')
  names_path = os.path.join(folder, f'{label_key.replace("/", "-")}.labels.txt')
  names = None
  if files.exists(names_path):
    with files.open_file(names_path) as f:
      names = [line.rstrip('\n') for line in f if line.strip()]
  if count is None and names is None:
    return None, None
  return int(count) if count is not None else len(names), names


def image_side(tfds_name: str, tfds_data_dir=None) -> Optional[int]:
  """The shorter side of a prepared dataset's fixed image shape (mnist: 28), else None."""
  folder = find(tfds_name, tfds_data_dir)
  if folder is None:
    return None
  image = _metadata(folder)[1].get('image', {}).get('image', {})
  dims = image.get('shape', {}).get('dimensions', [])
  sides = [int(d) for d in dims[:2] if int(d) > 0]
  return min(sides) if len(sides) == 2 else None


def _split_files(folder: str, info: dict, split: str):
  """[(path, 0, count)] of a split's shards, in TFDS's order."""
  splits = {s['name']: s for s in info.get('splits', [])}
  if split not in splits:
    raise DataError(
      f'{info.get("name")}: no split {split!r}; splits: {", ".join(sorted(splits)) or "none"}'
    )
  entry, file_format = splits[split], info.get('fileFormat', 'tfrecord')
  lengths = [int(n) for n in entry.get('shardLengths', [])]
  template = entry.get('filepathTemplate') or '{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}'
  paths = []
  for shard, count in enumerate(lengths):
    name = template.format(
      DATASET=info['name'],
      SPLIT=split,
      FILEFORMAT=file_format,
      SHARD_X_OF_Y=f'{shard:05d}-of-{len(lengths):05d}',
    )
    paths.append((os.path.join(folder, name), 0, count))
  return paths, file_format


def _parser(preset, label_key, multi_label, num_classes):
  """record -> (encoded image, int32 label or float32 multi-hot), as the preset builds labels;
  a label outside [0, num_classes) is a DataError, not a class id cast out of range."""
  label_fn = preset.label_fn if preset else None

  def parse(record: bytes):
    example = example_proto.parse(record)
    label = label_fn(example) if label_fn is not None else example[label_key][0]
    if multi_label:
      return example['image'][0], np.asarray(label, np.float32)
    return example['image'][0], sources.class_ids(label_key, label, num_classes)

  return parse


def open_split(dataset: str, split: str, tfds_data_dir=None, tfds_manual_dir=None):
  """The Source of `split` (a TFDS split expression) of a prepared dataset or preset."""
  preset = presets.PRESETS.get(dataset)
  if preset is None and dataset.startswith('vtab/'):
    raise unknown_dataset(dataset, tfds_data_dir)
  tfds_name = preset.tfds_name if preset else dataset
  folder = find(tfds_name, tfds_data_dir)
  if folder is None:
    raise _not_prepared(dataset, tfds_name, preset, tfds_data_dir, tfds_manual_dir)
  info, features = _metadata(folder)
  label_key = preset.label_key if preset else 'label'
  num_classes, names = _num_classes_and_names(folder, features, label_key)
  if preset and preset.num_classes:
    num_classes = preset.num_classes
  if num_classes is None or 'image' not in features:
    raise DataError(
      f'{dataset}: no image and ClassLabel feature {label_key!r}; '
      'only image classification datasets are supported'
    )
  multi_label = bool(preset and preset.multi_label)
  parse = _parser(preset, label_key, multi_label, num_classes)
  parts = (preset.named_splits.get(split) if preset else None) or ((split, None),)
  pieces = []
  for expression, take in parts:
    for part in expression.split('+'):
      name, start, stop = sources.parse_split(part)
      paths, file_format = _split_files(folder, info, name)
      source = sources.record_source(
        f'{dataset} {name}',
        records.open_records(paths, file_format),
        parse,
        num_classes,
        class_names=names,
        multi_label=multi_label,
        mask_empty_labels=bool(preset and preset.mask_empty_labels),
      )
      source = reader.sliced(source, start, stop)
      if take is not None:
        source = sources.sliced(source, 0, min(take, source.num_examples), f'[:{take}]')
      pieces.append(source)
  return sources.concatenated(pieces, f'{dataset} {split}')


def _not_prepared(dataset, tfds_name, preset, tfds_data_dir, tfds_manual_dir):
  where = os.path.join(data_dir(tfds_data_dir), *tfds_name.split(':')[0].split('/'))
  if preset and preset.manual:
    manual = tfds_manual_dir or '<tfds_manual_dir>'
    return DataError(
      f'{dataset}: not prepared in {where}; put {", ".join(preset.manual_files)} '
      f'in {manual} and run python -m vit_jax.prepare {dataset} '
      f'--manual_dir {manual} (docs/data.md: ImageNet)'
    )
  if preset is None and _suggestions(dataset, tfds_data_dir) and not _in_catalog(tfds_name):
    return unknown_dataset(dataset, tfds_data_dir)
  return DataError(
    f'{dataset}: not prepared in {where}; run python -m vit_jax.prepare '
    f'{dataset} where it can download (docs/data.md: TFDS datasets)'
  )


def _in_catalog(tfds_name: str) -> bool:
  """Whether TFDS has a builder of this name; False when TFDS cannot be imported."""
  try:
    with console.native_info_hidden():
      import tensorflow  # noqa: F401  TFDS's catalog needs it; without, it retries for a minute
      import tensorflow_datasets
  except ImportError:
    return False
  return tfds_name.split('/')[0].split(':')[0] in tensorflow_datasets.list_builders()


def _suggestions(dataset, tfds_data_dir):
  known = [*presets.BUILTIN, 'imagenet21k', *presets.PRESETS, *prepared_names(tfds_data_dir)]
  return difflib.get_close_matches(dataset, list(dict.fromkeys(known)), n=3, cutoff=0.6)


def unknown_dataset(dataset, tfds_data_dir=None):
  close = _suggestions(dataset, tfds_data_dir)
  hint = (
    f'did you mean {" or ".join(close)}?'
    if close
    else 'use a prepared TFDS name, a preset (docs/data.md), digits, or a folder path'
  )
  return DataError(f'unknown dataset {dataset!r}: {hint}')


def _defaults(dataset: str, options: reader.Options) -> reader.Defaults:
  """A preset's splits and augmentation, else chosen from the prepared image size."""
  preset = presets.PRESETS.get(dataset)
  if preset is None:
    return reader.for_image_side(image_side(dataset, options.tfds_data_dir))
  return reader.Defaults(
    preset.train,
    preset.test,
    preset.flip,
    preset.inception_crop,
    preset.area_min,
    why=f'{dataset} preset',
  )


READER = reader.Reader(
  'tfds',
  claims=lambda dataset: True,
  defaults=_defaults,
  open_split=lambda dataset, split, options: open_split(
    dataset, split, options.tfds_data_dir, options.tfds_manual_dir
  ),
)


# ---------------------------------------------------------------------------
# Preparing: TFDS's own builders, with TensorFlow.


def _tensorflow_datasets():
  try:
    with console.native_info_hidden():
      import tensorflow  # noqa: F401
      import tensorflow_datasets
  except ImportError:
    raise DataError(f'preparing TFDS datasets needs TensorFlow: {INSTALL}') from None
  return tensorflow_datasets


def prepare(name, tfds_data_dir, manual_dir=None, file_format='array_record') -> str:
  """Downloads and prepares TFDS dataset or preset `name`; returns the folder it is in."""
  tfds = _tensorflow_datasets()
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
    builder = tfds.builder(tfds_name, data_dir=tfds_data_dir, file_format=file_format)
  except tfds.core.registered.DatasetNotFoundError:
    raise unknown_dataset(name, tfds_data_dir) from None
  if builder.is_prepared():
    return builder.data_dir
  _check_downloadable(name, tfds_name, builder, manual_dir)
  try:
    builder.download_and_prepare(
      download_config=tfds.download.DownloadConfig(manual_dir=manual_dir)
    )
  except (OSError, tfds.download.NonMatchingChecksumError) as e:
    # Network, disk or checksum failures: the user's environment, not a bug.
    raise DataError(
      f'{name}: download or preparation failed ({first_line(e)}); check the network '
      f'and free space in {data_dir(tfds_data_dir)}, then run the command again'
    ) from None
  return builder.data_dir


def _check_downloadable(name, tfds_name, builder, manual_dir):
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


def first_line(error):
  return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
