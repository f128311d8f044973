"""`config.dataset` -> its reader's defaults and splits, each opened once per process.

What a dataset can be, and which reader reads it, is `vit_jax.data.readers`:
the built-in `digits`; NumPy arrays (an `.npz` file, a folder of `x_<split>.npy`
files, or arrays given a name in Python with `register_arrays`); a directory
with `info.json` (JFT-style shards) or `imagenet21k`; any other directory (an
image folder DIR/<split>/<class>/<image>); a preset or any other TFDS name.
"""

import functools
import os
from typing import Optional, Sequence

from vit_jax.core import files
from vit_jax.data import readers
from vit_jax.data import sources
from vit_jax.data.readers import arrays
from vit_jax.data.readers import reader


def register_arrays(name: str, *, replace: bool = False, **splits) -> str:
  """Names NumPy arrays as a dataset in this process: `config.dataset = name` then reads them.

  `splits` as an `.npz` holds them (`vit_jax.data.readers.arrays`): x_train=uint8 [N, H, W, 3]
  (or grey [N, H, W]), y_train=int [N], x_test=..., y_test=..., optionally class_names.
  Arrays are checked here (one-line `DataError`s) and read where they are, not copied.
  A resumed run in another process registers them again first. Registering other arrays
  under a name already taken is refused unless `replace`. Returns `name`.
  """
  arrays.register(name, splits, replace)
  open_split.cache_clear()
  defaults.cache_clear()
  return name


@functools.lru_cache(maxsize=32)
def defaults(dataset: str, tfds_data_dir=None) -> reader.Defaults:
  """The dataset's splits and augmentation: its preset's, or chosen from its image size."""
  options = reader.Options(tfds_data_dir=tfds_data_dir)
  return readers.reader_for(dataset).defaults(dataset, options)


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
  options = reader.Options(tfds_data_dir, tfds_manual_dir, corrupt_images, allow_missing_classes)
  return readers.reader_for(dataset).open_split(dataset, split, options)


def is_registered(name: str) -> bool:
  """Whether `name` names arrays registered in this process (`register_arrays`)."""
  return arrays.is_registered(name)


def record(dataset: str, num_classes: int, class_names: Optional[Sequence[str]]) -> dict:
  """What a run records of its data (`vit_jax.workdir`'s dataset.json): the name as given, the
  real path of a local folder or file (a resumed run may spell it otherwise), whether it is
  arrays registered in Python (which another process must register again), and the classes
  (the names predict and export give a head, whatever becomes of the data later)."""
  expanded = os.path.expanduser(dataset)
  local = not files.is_remote(dataset) and os.path.exists(expanded)
  return {
    'dataset': dataset,
    'path': os.path.realpath(expanded) if local and not arrays.is_registered(dataset) else None,
    'registered': arrays.is_registered(dataset),
    'num_classes': int(num_classes),
    'class_names': [str(n) for n in class_names] if class_names else None,
  }


def same_path(a: str, b: str) -> bool:
  """Whether two spellings of a dataset name the same local folder or file (a trailing slash,
  a relative path, a symlink)."""
  if files.is_remote(a) or files.is_remote(b):
    return a.rstrip('/') == b.rstrip('/')
  a, b = os.path.expanduser(a), os.path.expanduser(b)
  return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
