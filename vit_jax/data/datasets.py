"""`config.dataset` -> its reader's defaults and splits, each opened once per process.

What a dataset can be, and which reader reads it, is `vit_jax.data.readers`:
the built-in `digits`; NumPy arrays (an `.npz` file, a folder of `x_<split>.npy`
files, or arrays given a name in Python with `register_arrays`); a directory
with `info.json` (JFT-style shards) or `imagenet21k`; any other directory (an
image folder DIR/<split>/<class>/<image>); a preset or any other TFDS name.
"""

import functools
import hashlib
import os
from typing import Optional, Sequence

from vit_jax.core import files
from vit_jax.data import readers
from vit_jax.data import sources
from vit_jax.data.readers import arrays
from vit_jax.data.readers import folder
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


def record(
  dataset: str, num_classes: int, class_names: Optional[Sequence[str]], previous=None
) -> dict:
  """What a run records of its data (`vit_jax.workdir`'s dataset.json): the name as given, the
  real path of a local folder or file (a resumed run may spell it otherwise), whether it is
  arrays registered in Python (which another process must register again), the classes
  (the names predict and export give a head, whatever becomes of the data later), and the
  `fingerprint` of a local folder or file (a run whose data moved resumes from the new path
  when it matches). `previous`: the record so far, whose fingerprint is kept for the same
  path (not read again at every start)."""
  expanded = os.path.expanduser(dataset)
  local = not files.is_remote(dataset) and os.path.exists(expanded)
  path = os.path.realpath(expanded) if local and not arrays.is_registered(dataset) else None
  kept = (previous or {}).get('fingerprint') if (previous or {}).get('path') == path else None
  return {
    'dataset': dataset,
    'path': path,
    'registered': arrays.is_registered(dataset),
    'num_classes': int(num_classes),
    'class_names': [str(n) for n in class_names] if class_names else None,
    'fingerprint': kept or (fingerprint(path) if path else None),
  }


# A dataset that is one file is hashed whole up to this size, else its first and last
# _ENDS bytes; in a folder, the files that are not images are hashed up to _SMALL (labels,
# info.json, class lists) and images count by name and size (reading a million of them at
# every start would cost minutes).
_WHOLE = 1 << 28
_ENDS = 1 << 24
_SMALL = 1 << 24


def _hash_file(digest, path: str, size: int, whole: int) -> None:
  with open(path, 'rb') as f:
    if size <= whole:
      for block in iter(lambda: f.read(1 << 20), b''):
        digest.update(block)
      return
    digest.update(f.read(_ENDS))
    f.seek(size - _ENDS)
    digest.update(f.read(_ENDS))


def fingerprint(path: str) -> dict:
  """{'files', 'bytes', 'sha256'} of a local dataset file or folder: what tells the same data
  at another path. The digest covers each file's path relative to `path` and its size, the
  content of a dataset that is one file, and of a folder's files that are not images (see
  _SMALL); folders are walked as the readers walk them (tools' entries left out, symlinked
  folders followed)."""
  digest = hashlib.sha256()
  if os.path.isfile(path):
    size = os.path.getsize(path)
    _hash_file(digest, path, size, _WHOLE)
    return {'files': 1, 'bytes': size, 'sha256': digest.hexdigest()}
  count = total = 0
  for top, dirs, names in folder.walk(path):
    dirs[:] = sorted(d for d in dirs if not folder.is_tool_entry(d))
    for name in sorted(n for n in names if not folder.is_tool_entry(n)):
      full = os.path.join(top, name)
      try:
        size = os.path.getsize(full)
      except OSError:  # a broken link: named, without a size
        size = -1
      digest.update(f'{os.path.relpath(full, path)}\0{size}\0'.encode('utf-8', 'surrogateescape'))
      if size >= 0 and not folder.is_image_name(name):
        _hash_file(digest, full, size, _SMALL)
      count, total = count + 1, total + max(size, 0)
  return {'files': count, 'bytes': total, 'sha256': digest.hexdigest()}


def same_path(a: str, b: str) -> bool:
  """Whether two spellings of a dataset name the same local folder or file (a trailing slash,
  a relative path, a symlink)."""
  if files.is_remote(a) or files.is_remote(b):
    return a.rstrip('/') == b.rstrip('/')
  a, b = os.path.expanduser(a), os.path.expanduser(b)
  return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
