"""`config.dataset` -> a `Source` for a split: names, presets and the four kinds of data.

- `digits`: the built-in dataset (UCI handwritten digits shipped by scikit-learn);
- a directory with `info.json`: JFT-style shards (`vit_jax.jft`);
- any other directory: an image folder DIR/<split>/<class>/<image>;
- `imagenet21k`: shards in <tfds_data_dir>/imagenet21k, converted by `vit_jax.jft`;
- a preset (`vit_jax.presets`) or any other TFDS name.
"""

import dataclasses
import difflib
import functools
import os

import numpy as np

from vit_jax import files
from vit_jax.data import folder
from vit_jax.data import presets
from vit_jax.data import records
from vit_jax.data import shards
from vit_jax.data import sources
from vit_jax.data.sources import DataError

BUILTIN = ('digits',)


@dataclasses.dataclass(frozen=True)
class Defaults:
  """What a dataset brings when the config leaves a field at None."""

  train: str = 'train'
  test: str = 'test'
  flip: bool = True
  inception_crop: bool = True
  area_min: float = 0.05
  why: str = "the paper's, B.1.1"  # where the choice comes from, for people


# Images whose shorter side is below this many pixels are "small" (digits,
# characters, icons, CIFAR-sized crops): an inception crop down to 5% of their
# area keeps a few pixels, blown up to the model's resolution.
SMALL_IMAGE_SIDE = 64
_SIZE_SAMPLE = 32  # image files whose size is read to decide


# Digits are 8x8: a crop keeping most of the digit, and no flip (it changes
# their meaning: 2 vs 5 mirrored).
_DIGITS = Defaults(flip=False, area_min=0.5, why='built-in digits')


def _small_images(side: int) -> Defaults:
  # Crops keep at least half of a small image; flips stay (they help photos,
  # and only the data's meaning says whether a mirror image is the same class:
  # set pp.flip=False for digits and text). Measured in docs/data.md on the
  # digits written out as an image folder and on tiles of scikit-learn's photos.
  return Defaults(
    area_min=0.5,
    why=f'small images: shorter side {side} px < {SMALL_IMAGE_SIDE}',
  )


def kind(dataset: str) -> str:
  """'builtin', 'shards', 'folder' or 'tfds'."""
  if dataset in BUILTIN:
    return 'builtin'
  path = os.path.expanduser(dataset)
  if os.path.isdir(path) or dataset.startswith(('/', '.', '~')) or files.is_remote(dataset):
    if shards.is_shard_dir(path):
      return 'shards'
    if not os.path.isdir(path):
      raise DataError(
        f'{dataset}: no such folder; pass an existing image folder or shard '
        'directory, or a dataset name (digits, cifar10, imagenet2012, ...)'
      )
    return 'folder'
  if dataset == 'imagenet21k':
    return 'shards'
  return 'tfds'


@functools.lru_cache(maxsize=32)
def defaults(dataset: str, tfds_data_dir=None) -> Defaults:
  """The dataset's splits and augmentation: its preset's, or chosen from its image size."""
  if dataset in BUILTIN:
    return _DIGITS
  preset = presets.PRESETS.get(dataset)
  if preset is not None:
    return Defaults(
      preset.train,
      preset.test,
      preset.flip,
      preset.inception_crop,
      preset.area_min,
      why=f'{dataset} preset',
    )
  which = kind(dataset)
  side = None
  if which == 'folder':
    side = _folder_image_side(os.path.expanduser(dataset))
  elif which == 'tfds':
    side = _tfds_image_side(dataset, tfds_data_dir)
  if side is not None and side < SMALL_IMAGE_SIDE:
    return _small_images(side)
  return Defaults()


def _folder_image_side(root: str):
  """Median shorter side (px) of up to _SIZE_SAMPLE train images, from their headers."""
  from PIL import Image

  split = os.path.join(root, 'train')
  if not os.path.isdir(split):
    return None
  paths = []
  for name in sorted(os.listdir(split)):
    class_dir = os.path.join(split, name)
    if os.path.isdir(class_dir):
      paths += [
        os.path.join(class_dir, f)
        for f in sorted(os.listdir(class_dir))
        if f.lower().endswith(folder.EXTENSIONS)
      ]
  step = max(1, len(paths) // _SIZE_SAMPLE)
  sides = []
  for path in paths[::step][:_SIZE_SAMPLE]:
    try:
      with Image.open(path) as image:
        sides.append(min(image.size))
    except (OSError, ValueError):
      continue  # corrupt files are reported when the split is opened
  return int(np.median(sides)) if sides else None


def _tfds_image_side(dataset: str, tfds_data_dir):
  """The shorter side of a TFDS dataset's fixed image shape (mnist: 28), else None."""
  import tensorflow_datasets as tfds

  try:
    shape = tfds.builder(dataset, data_dir=tfds_data_dir).info.features['image'].shape
  except (tfds.core.registered.DatasetNotFoundError, KeyError, AttributeError, ValueError):
    return None  # unknown names and datasets without an 'image' are reported when opened
  return min(shape[:2]) if None not in shape[:2] else None


def data_dir(tfds_data_dir):
  return os.path.expanduser(
    tfds_data_dir or os.environ.get('TFDS_DATA_DIR') or '~/tensorflow_datasets'
  )


@functools.lru_cache(maxsize=32)
def open_split(
  dataset: str, split: str, tfds_data_dir=None, tfds_manual_dir=None, corrupt_images='skip'
) -> sources.Source:
  """The Source of `split` of `dataset`. Cached: folders are checked once per process."""
  which = kind(dataset)
  if which == 'builtin':
    return _digits(split)
  if which == 'folder':
    return _folder(os.path.expanduser(dataset), split, corrupt_images)
  if which == 'shards':
    root = os.path.expanduser(dataset)
    if dataset == 'imagenet21k':
      root = os.path.join(data_dir(tfds_data_dir), 'imagenet21k')
      if not shards.is_shard_dir(root):
        manual = tfds_manual_dir or '<tfds_manual_dir>'
        raise DataError(
          f'imagenet21k: no converted shards in {root}; convert the extracted '
          f'release with python -m vit_jax.jft --folder {manual} --out {root} '
          '(docs/data.md: ImageNet-21k)'
        )
    return shards.open_split(root, split)
  return _tfds(dataset, split, tfds_data_dir, tfds_manual_dir)


# ---------------------------------------------------------------------------
# Built-in: digits.


def load_digits():
  """(images uint8 [1797, 8, 8, 3], labels [1797]) from scikit-learn's copy of UCI digits."""
  from sklearn import datasets as sk_datasets

  digits = sk_datasets.load_digits()
  # Pixels are counts 0..16 of set bits in 4x4 blocks of the 32x32 scans.
  grey = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
  return np.repeat(grey[..., None], 3, axis=-1), digits.target.astype(np.int32)


def digits_split_indices(test_fraction=0.2, seed=0):
  """Fixed stratified split: per class, a seeded 20% are test. (train, test) indices."""
  _, labels = load_digits()
  rng = np.random.default_rng(seed)
  train, test = [], []
  for c in range(10):
    members = rng.permutation(np.flatnonzero(labels == c))
    n_test = int(round(test_fraction * len(members)))
    test += members[:n_test].tolist()
    train += members[n_test:].tolist()
  return np.sort(train), np.sort(test)


def _digits(split):
  name, start, stop = sources.parse_split(split)
  if name not in ('train', 'test'):
    raise DataError(f'digits: no split {name!r}; use train or test (e.g. train[:90%])')
  images, labels = load_digits()
  index = digits_split_indices()[0 if name == 'train' else 1]
  source = sources.array_source(
    f'digits {name}', images[index], labels[index], 10, [str(d) for d in range(10)]
  )
  lo, hi = sources.slice_bounds(start, stop, source.num_examples)
  return sources.sliced(source, lo, hi, f'[{start or ""}:{stop or ""}]')


# ---------------------------------------------------------------------------
# Image folders.


def _folder(root, split, corrupt_images):
  name, start, stop = sources.parse_split(split)
  classes = folder.class_names(root)
  if len(classes) == 1:
    # One class: every prediction is right, and training "reaches 100%".
    raise DataError(
      f'{root}: only one class folder ({classes[0]}); classification needs at least two: '
      f'add {root}/train/<another class>/ with images'
    )
  paths, labels = folder.list_split(root, name, classes, corrupt_images)
  source = sources.file_source(os.path.join(root, name), paths, labels, len(classes), classes)
  lo, hi = sources.slice_bounds(start, stop, source.num_examples)
  return sources.sliced(source, lo, hi, f'[{start or ""}:{stop or ""}]')


# ---------------------------------------------------------------------------
# TFDS.


def unknown_dataset(dataset, tfds_names):
  known = list(dict.fromkeys([*BUILTIN, 'imagenet21k', *presets.PRESETS, *tfds_names]))
  close = difflib.get_close_matches(dataset, known, n=3, cutoff=0.6)
  hint = (
    f'did you mean {" or ".join(close)}?'
    if close
    else ('use a TFDS name, a preset (docs/data.md), digits, or a folder path')
  )
  return DataError(f'unknown dataset {dataset!r}: {hint}')


def _tfds(dataset, split, tfds_data_dir, tfds_manual_dir):
  import tensorflow_datasets as tfds

  preset = presets.PRESETS.get(dataset)
  if preset is None and dataset.startswith('vtab/'):
    raise unknown_dataset(dataset, [])
  tfds_name = preset.tfds_name if preset else dataset
  try:
    builder = tfds.builder(tfds_name, data_dir=tfds_data_dir)
  except tfds.core.registered.DatasetNotFoundError:
    raise unknown_dataset(dataset, tfds.list_builders()) from None
  except Exception as e:
    # A bad config name ('eurosat/nope') or an unreadable data_dir.
    raise DataError(
      f'{dataset}: cannot open TFDS builder {tfds_name!r} '
      f'({first_line(e)}); check the name and tfds_data_dir'
    ) from None

  parts = (preset.named_splits.get(split) if preset else None) or ((split, None),)
  features = builder.info.features
  label_key = preset.label_key if preset else 'label'
  if preset and preset.num_classes:
    num_classes = preset.num_classes
  elif label_key in features and hasattr(features[label_key], 'num_classes'):
    num_classes = features[label_key].num_classes
  else:
    raise DataError(
      f'{dataset}: no ClassLabel feature {label_key!r}; '
      'only image classification datasets are supported'
    )
  names = getattr(features[label_key], 'names', None) if label_key in features else None
  multi_label = bool(preset and preset.multi_label)

  def parse(record):
    import tensorflow as tf

    example = features.deserialize_example(record, decoders={'image': tfds.decode.SkipDecoding()})
    label = preset.label_fn(example) if preset and preset.label_fn else example[label_key]
    label = tf.cast(label, tf.float32 if multi_label else tf.int32)
    return {'image': example['image'], 'label': label}

  pieces = []
  for expr, take in parts:
    reader = _tfds_reader(builder, dataset, expr, tfds_data_dir, tfds_manual_dir, preset)
    source = sources.record_source(
      f'{dataset} {expr}',
      reader,
      parse,
      num_classes,
      class_names=names,
      multi_label=multi_label,
      mask_empty_labels=bool(preset and preset.mask_empty_labels),
    )
    if take is not None:
      source = sources.sliced(source, 0, min(take, source.num_examples), f'[:{take}]')
    pieces.append(source)
  return sources.concatenated(pieces, f'{dataset} {split}')


def _tfds_reader(builder, dataset, expr, tfds_data_dir, tfds_manual_dir, preset):
  import tensorflow_datasets as tfds

  try:
    data_source = builder.as_data_source(
      expr, deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES
    )
    return records.DataSourceReader(data_source, f'{dataset} {expr}')
  except Exception as e:
    error = e
  if not builder.is_prepared():
    where = builder.data_dir
    if preset and preset.manual:
      manual = tfds_manual_dir or '<tfds_manual_dir>'
      raise DataError(
        f'{dataset}: not prepared in {where}; put {", ".join(preset.manual_files)} '
        f'in {manual} and run python -m vit_jax.prepare {dataset} '
        f'--manual_dir {manual} (docs/data.md: ImageNet)'
      ) from None
    raise DataError(
      f'{dataset}: not prepared in {where}; run python -m vit_jax.prepare '
      f'{dataset} where it can download (docs/data.md: TFDS datasets)'
    ) from None
  if isinstance(error, NotImplementedError):
    # Prepared as TFRecord: our own random access over TFDS's files.
    try:
      instructions = builder.info.splits[expr].file_instructions
    except Exception as e:
      raise _bad_split(dataset, expr, builder, e) from None
    files = [
      (
        fi.filename
        if os.path.isabs(fi.filename) or '://' in fi.filename
        else os.path.join(builder.data_dir, fi.filename),
        fi.skip,
        fi.take if fi.take >= 0 else fi.examples_in_shard - fi.skip,
      )
      for fi in instructions
    ]
    return records.TFRecordReader(files)
  raise _bad_split(dataset, expr, builder, error) from None


def _bad_split(dataset, expr, builder, error):
  have = ', '.join(sorted(builder.info.splits)) or 'none'
  return DataError(f'{dataset}: cannot read split {expr!r} ({first_line(error)}); splits: {have}')


def first_line(error):
  return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
