"""NumPy arrays as a dataset: an `.npz` file, a folder of `.npy` files, or arrays in Python.

The layout is the one `keras.datasets.*.load_data()` returns and Keras's
`mnist.npz` holds, what a user of tf.data's `from_tensor_slices((x, y))` has:

    np.savez('data.npz', x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)

- `x_<split>`: uint8 images [N, H, W, 3] (RGB), or [N, H, W, 1] / [N, H, W]
  (grey, made RGB a batch at a time); channels last; one size per split;
- `y_<split>`: integer class ids [N] (or [N, 1], as Keras's CIFAR-10);
- `class_names` (optional): str [K]. Otherwise K = the largest id + 1.

Any split name works (`x_validation`, ...), sliced as every other source
(`train[:90%]`). A folder holding `x_train.npy`, `y_train.npy`, ... is the
same, memory-mapped (arrays larger than the host's memory; each process reads
only the pages of its examples); an `.npz` is read into memory, each split
once per process. Files are read with `allow_pickle=False`: object arrays are
refused, never unpickled. Wrong shapes, dtypes and lengths are one-line
`DataError`s saying what to do.

The reader claims registered names, `.npz` paths and folders holding `x_*.npy`.
"""

import functools
import os
import zipfile

import numpy as np

from vit_jax.data import presets
from vit_jax.data import sources
from vit_jax.data.readers import reader
from vit_jax.data.sources import DataError

_LAYOUT = 'x_<split> uint8 [N, H, W, 3] and y_<split> int [N], as keras.datasets gives them'
# Arrays handed over in Python, by name (`register`). A config names its dataset
# with a string (it is saved with the run), so arrays in memory get a name: this process's.
_REGISTERED = {}


def is_arrays(path: str) -> bool:
  """An `.npz` file, or a folder of `x_<split>.npy` files."""
  if path.endswith('.npz'):
    return True
  return os.path.isdir(path) and any(
    f.startswith('x_') and f.endswith('.npy') for f in os.listdir(path)
  )


def _members(path: str):
  """{'x_train': loader, ...}: what the file or folder holds, nothing read yet."""
  if os.path.isdir(path):
    names = [f[:-4] for f in sorted(os.listdir(path)) if f.endswith('.npy')]
    return {n: functools.partial(_load_npy, os.path.join(path, n + '.npy')) for n in names}
  if not os.path.isfile(path):
    raise DataError(
      f'{path}: no such file; pass an existing .npz ({_LAYOUT}), a folder, or a dataset name'
    )
  try:
    with zipfile.ZipFile(path) as archive:
      names = [n[:-4] for n in archive.namelist() if n.endswith('.npy')]
  except (zipfile.BadZipFile, OSError) as e:
    raise DataError(
      f'{path}: not a readable .npz archive ({e}); write it with '
      f'np.savez({os.path.basename(path)!r}, x_train=..., y_train=...)'
    ) from None
  return {n: functools.partial(_load_npz, path, n) for n in names}


def _load_npy(path):
  return _checked_load(path, lambda: np.load(path, mmap_mode='r', allow_pickle=False))


@functools.lru_cache(maxsize=16)
def _load_npz(path, name):
  """One member, read once per process (also for several slices of a split)."""

  def load():
    with np.load(path, allow_pickle=False) as archive:
      return archive[name]

  return _checked_load(f'{path}: {name}', load)


def _checked_load(what, load):
  try:
    return load()
  except ValueError as e:
    if 'allow_pickle' in str(e):
      raise DataError(
        f'{what}: an object array (Python objects, e.g. a list of differently sized images), '
        f'which is not loaded (allow_pickle=False); save {_LAYOUT}'
      ) from None
    raise DataError(f'{what}: not a readable .npy array ({e})') from None
  except (OSError, zipfile.BadZipFile, EOFError) as e:
    raise DataError(
      f'{what}: cannot read it ({e}); write it again with np.save / np.savez'
    ) from None


def split_names(members) -> list:
  return sorted(n[2:] for n in members if n.startswith('x_'))


def check_images(where: str, split: str, x) -> np.ndarray:
  """`x` if it is uint8 [N, H, W, 3], [N, H, W, 1] or [N, H, W] with N, H, W > 0."""
  name = f'{where}: x_{split}'
  if not isinstance(x, np.ndarray) or x.dtype == object:
    raise DataError(
      f'{name}: not a NumPy array of pixels ({type(x).__name__}); give {_LAYOUT} (np.asarray)'
    )
  shape, dtype = x.shape, x.dtype
  if len(shape) == 4 and shape[1] in (1, 3) and shape[-1] not in (1, 3):
    raise DataError(
      f'{name}: images of shape {shape} have their channels first; give [N, H, W, C] '
      '(x.transpose(0, 2, 3, 1))'
    )
  if not (len(shape) == 3 or (len(shape) == 4 and shape[-1] in (1, 3))):
    raise DataError(
      f'{name}: images of shape {shape}; give uint8 [N, H, W, 3] (RGB), [N, H, W, 1] or '
      '[N, H, W] (grey)' + (' (RGBA: x[..., :3])' if len(shape) == 4 and shape[-1] == 4 else '')
    )
  if dtype != np.uint8:
    hint = ' (floats in [0, 1]: np.round(x * 255).astype(np.uint8))'
    raise DataError(
      f'{name}: images of dtype {dtype}; give uint8 pixels 0..255'
      + (hint if np.issubdtype(dtype, np.floating) else '')
    )
  if not all(shape[:3]):
    raise DataError(f'{name}: images of shape {shape}: no pixels; give at least one image')
  return x


def check_labels(where: str, split: str, y, count: int) -> np.ndarray:
  """Integer class ids [N] from `y` ([N] or [N, 1]), N = `count` (the images')."""
  name = f'{where}: y_{split}'
  y = np.asarray(y)  # labels are small: read whole, also from a memory-mapped file
  if y.ndim == 2 and y.shape[1] == 1:
    y = y[:, 0]
  shape, dtype = y.shape, y.dtype
  if len(shape) != 1:
    one_hot = ' (one-hot labels: y.argmax(1))' if len(shape) == 2 else ''
    raise DataError(f'{name}: labels of shape {shape}; give integer class ids [N]{one_hot}')
  if not np.issubdtype(dtype, np.integer):
    raise DataError(
      f'{name}: labels of dtype {dtype}; give integer class ids (y.astype(np.int64) if they are '
      'whole numbers)'
    )
  if shape[0] != count:
    raise DataError(
      f'{where}: x_{split} has {count} images but y_{split} {shape[0]} labels; give each image '
      'one label'
    )
  if y.size and y.min() < 0:
    raise DataError(f'{name}: a label {y.min()} < 0; labels are class ids 0..K-1')
  return y  # in its own dtype: `_classes` checks the largest before the cast to int32


@functools.lru_cache(maxsize=32)
def load(path: str) -> dict:
  """{'splits': {name: (loader of x, labels)}, 'num_classes', 'class_names'} of a file or folder.

  Labels are read and checked here (they are small); images when a split is opened.
  """
  members = _members(path)
  splits = split_names(members)
  if not splits:
    raise DataError(
      f'{path}: no x_<split> arrays (has {", ".join(sorted(members)) or "none"}); save {_LAYOUT}'
    )
  labels = {}
  for split in splits:
    if f'y_{split}' not in members:
      raise DataError(f'{path}: x_{split} without y_{split}; save one label per image')
    x = check_images(path, split, members[f'x_{split}']())
    labels[split] = check_labels(path, split, members[f'y_{split}'](), len(x))
  class_names = None
  if 'class_names' in members:
    class_names = [str(n) for n in np.asarray(members['class_names']()).reshape(-1)]
  classes = _classes(path, labels, class_names)
  labels = _class_ids(path, labels, classes['num_classes'])
  return {'splits': {s: (members[f'x_{s}'], labels[s]) for s in splits}, **classes}


def _class_ids(where: str, labels: dict, num_classes: int) -> dict:
  """{split: int32 class ids}, each checked against `num_classes` in its own dtype first."""
  return {
    split: sources.class_ids(f'{where}: y_{split}', y, num_classes) for split, y in labels.items()
  }


# More classes than any dataset has (JFT: about 18k, ImageNet-21k: 21,843, the largest
# label sets in use some 10^5): a label past this is a wrong id, which would otherwise build a
# head, and a list of names, that size.
MAX_CLASSES = 1_000_000


def _classes(what: str, labels: dict, class_names) -> dict:
  """{'num_classes', 'class_names'}: the names' count, else the largest id + 1 (at least 2)."""
  top = max((int(y.max()) for y in labels.values() if y.size), default=-1)
  if class_names is not None:
    if top >= len(class_names):
      raise DataError(
        f'{what}: a label {top} but {len(class_names)} class_names; give a name per class'
      )
    return {'num_classes': len(class_names), 'class_names': class_names}
  if top >= MAX_CLASSES:
    split = next(s for s, y in labels.items() if y.size and int(y.max()) == top)
    raise DataError(
      f'{what}: y_{split} holds a label {top}, which would make {top + 1:,} classes; labels are '
      'class ids 0..K-1: renumber them (np.unique(y, return_inverse=True)[1]) or give '
      'class_names'
    )
  if top < 1:
    raise DataError(
      f'{what}: every label is {max(top, 0)}; classification needs at least two classes'
    )
  return {'num_classes': top + 1, 'class_names': [str(i) for i in range(top + 1)]}


def from_arrays(name: str, arrays: dict) -> dict:
  """`load`'s result for arrays handed over in Python ({'x_train': ..., 'y_train': ...})."""
  splits = split_names(arrays)
  if not splits:
    raise DataError(
      f'{name}: no x_<split> arrays (has {", ".join(sorted(arrays))}); pass {_LAYOUT}'
    )
  unknown = sorted(k for k in arrays if not k.startswith(('x_', 'y_')) and k != 'class_names')
  if unknown:
    raise DataError(f'{name}: unknown array {unknown[0]!r}; pass {_LAYOUT}')
  labels = {}
  for split in splits:
    if f'y_{split}' not in arrays:
      raise DataError(f'{name}: x_{split} without y_{split}; pass one label per image')
    x = check_images(name, split, arrays[f'x_{split}'])
    labels[split] = check_labels(name, split, arrays[f'y_{split}'], len(x))
  names = arrays.get('class_names')
  classes = _classes(name, labels, None if names is None else [str(n) for n in names])
  labels = _class_ids(name, labels, classes['num_classes'])
  return {'splits': {s: (lambda s=s: arrays[f'x_{s}'], labels[s]) for s in splits}, **classes}


def image_side(data: dict):
  """The shorter side (px) of the train images, read from their shape (None: no train split)."""
  if 'train' not in data['splits']:
    return None
  shape = data['splits']['train'][0]().shape
  return int(min(shape[1:3])) if len(shape) >= 3 else None


def register(name: str, splits: dict, replace: bool = False) -> None:
  """Names arrays handed over in Python ({'x_train': ..., 'y_train': ...}) for this process.
  The same arrays again under the same name (a notebook cell run twice) are fine; others are
  refused unless `replace`: a run reading the name would silently train on other data."""
  if (
    name in presets.BUILTIN or name in presets.PRESETS or not name or os.sep in name or '.' in name
  ):
    raise DataError(
      f'register_arrays: {name!r} names a dataset or a path already; pick a plain new name'
    )
  if name in _REGISTERED and not replace and not _same_arrays(_REGISTERED[name]['given'], splits):
    raise DataError(
      f'register_arrays: {name!r} holds other arrays already in this process; pick another '
      f'name, or pass replace=True to read these under it from now on'
    )
  _REGISTERED[name] = {**from_arrays(name, splits), 'given': dict(splits)}


def _same_arrays(before: dict, now: dict) -> bool:
  """Whether two registrations hand over equal arrays (the same objects, or equal values)."""
  if before.keys() != now.keys():
    return False
  for key, value in now.items():
    old = before[key]
    if old is value:
      continue
    old, value = np.asarray(old), np.asarray(value)
    if old.shape != value.shape or old.dtype != value.dtype or not np.array_equal(old, value):
      return False
  return True


def is_registered(name: str) -> bool:
  """Whether `name` names arrays registered in this process (`register`)."""
  return name in _REGISTERED


def _data(dataset: str) -> dict:
  return _REGISTERED.get(dataset) or load(os.path.expanduser(dataset))


def _open_split(dataset: str, split: str, options: reader.Options) -> sources.Source:
  name, start, stop = sources.parse_split(split)
  data = _data(dataset)
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
  return reader.sliced(source, start, stop)


READER = reader.Reader(
  'arrays',
  claims=lambda dataset: dataset in _REGISTERED or is_arrays(os.path.expanduser(dataset)),
  defaults=lambda dataset, options: reader.for_image_side(image_side(_data(dataset))),
  open_split=_open_split,
)
