"""`config.dataset` -> a `Source` for a split: names, presets and the five kinds of data.

- `digits`: the built-in dataset (UCI handwritten digits shipped by scikit-learn);
- NumPy arrays (`vit_jax.data.arrays`): an `.npz` file, a directory of
  `x_<split>.npy` / `y_<split>.npy` files, or a name given to arrays in Python
  (`register_arrays`);
- a directory with `info.json`: JFT-style shards (`vit_jax.jft`);
- any other directory: an image folder DIR/<split>/<class>/<image>;
- `imagenet21k`: shards in <tfds_data_dir>/imagenet21k, converted by `vit_jax.jft`;
- a preset (`vit_jax.data.presets`) or any other TFDS name.
"""

import dataclasses
import functools
import os

import numpy as np

from vit_jax.core import files
from vit_jax.data import arrays
from vit_jax.data import folder
from vit_jax.data import presets
from vit_jax.data import shards
from vit_jax.data import sources
from vit_jax.data import tfds
from vit_jax.data.sources import DataError

BUILTIN = presets.BUILTIN
# Arrays handed over in Python, by name (`register_arrays`). A config names its dataset
# with a string (it is saved with the run), so arrays in memory get a name: this process's.
_REGISTERED = {}


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


def register_arrays(name: str, **splits) -> str:
  """Names NumPy arrays as a dataset in this process: `config.dataset = name` then reads them.

  `splits` as an `.npz` holds them (`vit_jax.data.arrays`): x_train=uint8 [N, H, W, 3]
  (or grey [N, H, W]), y_train=int [N], x_test=..., y_test=..., optionally class_names.
  Arrays are checked here (one-line `DataError`s) and read where they are, not copied.
  A resumed run in another process registers them again first. Returns `name`.
  """
  if name in BUILTIN or name in presets.PRESETS or not name or os.sep in name or '.' in name:
    raise DataError(
      f'register_arrays: {name!r} names a dataset or a path already; pick a plain new name'
    )
  _REGISTERED[name] = arrays.from_arrays(name, splits)
  open_split.cache_clear()
  defaults.cache_clear()
  return name


def kind(dataset: str) -> str:
  """'builtin', 'arrays', 'shards', 'folder' or 'tfds'."""
  if dataset in BUILTIN:
    return 'builtin'
  path = os.path.expanduser(dataset)
  if dataset in _REGISTERED or arrays.is_arrays(path):
    return 'arrays'
  if os.path.isdir(path) or dataset.startswith(('/', '.', '~')) or files.is_remote(dataset):
    if shards.is_shard_dir(path):
      return 'shards'
    if files.is_remote(dataset):
      raise DataError(
        f'{dataset}: no info.json there; datasets in object stores are shard directories '
        '(python -m vit_jax.jft --folder DIR --out gs://...); image folders must be local'
      )
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
  if which == 'arrays':
    side = arrays.image_side(_arrays(dataset))
  elif which == 'folder':
    side = _folder_image_side(os.path.expanduser(dataset))
  elif which == 'tfds':
    side = tfds.image_side(dataset, tfds_data_dir)
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
  for name in folder.subfolders(split):
    class_dir = os.path.join(split, name)
    paths += [os.path.join(class_dir, f) for f in folder.images_under(class_dir)[0]]
  step = max(1, len(paths) // _SIZE_SAMPLE)
  sides = []
  for path in paths[::step][:_SIZE_SAMPLE]:
    try:
      with Image.open(path) as image:
        sides.append(min(image.size))
    except (OSError, ValueError, Image.DecompressionBombError):
      continue  # corrupt and huge files are reported when the split is opened
  return int(np.median(sides)) if sides else None


@functools.lru_cache(maxsize=32)
def open_split(
  dataset: str,
  split: str,
  tfds_data_dir=None,
  tfds_manual_dir=None,
  corrupt_images='skip',
  allow_missing_classes=False,
) -> sources.Source:
  """The Source of `split` of `dataset`. Cached: folders are checked once per process."""
  which = kind(dataset)
  if which == 'builtin':
    return _digits(split)
  if which == 'arrays':
    return _array_split(dataset, split)
  if which == 'folder':
    return _folder(os.path.expanduser(dataset), split, corrupt_images, allow_missing_classes)
  if which == 'shards':
    root = os.path.expanduser(dataset)
    if dataset == 'imagenet21k':
      root = os.path.join(tfds.data_dir(tfds_data_dir), 'imagenet21k')
      if not shards.is_shard_dir(root):
        manual = tfds_manual_dir or '<tfds_manual_dir>'
        raise DataError(
          f'imagenet21k: no converted shards in {root}; convert the extracted '
          f'release with python -m vit_jax.jft --folder {manual} --out {root} '
          '(docs/data.md: ImageNet-21k)'
        )
    return shards.open_split(root, split)
  return tfds.open_split(dataset, split, tfds_data_dir, tfds_manual_dir)


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
# NumPy arrays.


def _arrays(dataset: str) -> dict:
  return _REGISTERED.get(dataset) or arrays.load(os.path.expanduser(dataset))


def _array_split(dataset, split):
  name, start, stop = sources.parse_split(split)
  data = _arrays(dataset)
  if name not in data['splits']:
    have = ', '.join(sorted(data['splits']))
    raise DataError(
      f'{dataset}: no split {name!r} (has {have}); add x_{name} and y_{name}, or split '
      'one: --config.pp.train=train[:90%] --config.pp.test=train[90%:]'
    )
  load_images, labels = data['splits'][name]
  source = sources.array_source(
    f'{dataset} {name}', load_images(), labels, data['num_classes'], data['class_names']
  )
  lo, hi = sources.slice_bounds(start, stop, source.num_examples)
  return sources.sliced(source, lo, hi, f'[{start or ""}:{stop or ""}]')


# ---------------------------------------------------------------------------
# Image folders.


def _folder(root, split, corrupt_images, allow_missing_classes):
  name, start, stop = sources.parse_split(split)
  classes = folder.class_names(root)
  if len(classes) == 1:
    # One class: every prediction is right, and training "reaches 100%".
    raise DataError(
      f'{root}: only one class folder ({classes[0]}); classification needs at least two: '
      f'add {root}/train/<another class>/ with images'
    )
  paths, labels = folder.list_split(root, name, classes, corrupt_images)
  if not allow_missing_classes:
    folder.check_same_classes(root)
  source = sources.file_source(os.path.join(root, name), paths, labels, len(classes), classes)
  lo, hi = sources.slice_bounds(start, stop, source.num_examples)
  return sources.sliced(source, lo, hi, f'[{start or ""}:{stop or ""}]')
