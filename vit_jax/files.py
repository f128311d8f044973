"""Files at local paths or behind a scheme (`gs://`): one place for both.

Local paths use the standard library; any path with a scheme goes through
`tf.io.gfile`, imported only when such a path is used, so local runs need no
TensorFlow here.
"""

import os


class RemoteFilesError(RuntimeError):
  """A `gs://` (or other scheme) path without TensorFlow to read it; one line."""


def is_remote(path) -> bool:
  return '://' in os.fspath(path)


def gfile():
  """`tf.io.gfile`, or a one-line error saying how to get it."""
  try:
    import tensorflow as tf
  except ImportError as e:
    raise RemoteFilesError('gs:// paths need TensorFlow: pip install tensorflow-cpu') from e
  return tf.io.gfile


def exists(path) -> bool:
  return gfile().exists(path) if is_remote(path) else os.path.exists(path)


def isdir(path) -> bool:
  return gfile().isdir(path) if is_remote(path) else os.path.isdir(path)


def makedirs(path) -> None:
  if is_remote(path):
    gfile().makedirs(path)
  else:
    os.makedirs(path, exist_ok=True)


def open_file(path, mode: str = 'r'):
  """A file object; text modes are UTF-8."""
  if is_remote(path):
    return gfile().GFile(path, mode)
  return open(path, mode, encoding=None if 'b' in mode else 'utf-8')


def rename(src, dst) -> None:
  """Replaces `dst` (atomically for local files)."""
  if is_remote(src):
    gfile().rename(src, dst, overwrite=True)
  else:
    os.replace(src, dst)


def write_text(path, text: str) -> None:
  """Writes `path` whole: a reader sees the old contents or the new, never a part.

  Local files go through a temporary file and a rename; an object store
  publishes an object only when it is closed.
  """
  if is_remote(path):
    with gfile().GFile(path, 'w') as f:
      f.write(text)
    return
  with open(path + '.tmp', 'w', encoding='utf-8') as f:
    f.write(text)
  os.replace(path + '.tmp', path)


def remove(path) -> None:
  """Deletes a file; one that is already gone is fine."""
  if is_remote(path):
    if gfile().exists(path):
      gfile().remove(path)
  else:
    try:
      os.remove(path)
    except FileNotFoundError:
      pass


def listdir(path) -> list:
  """Names in a directory ([] when it does not exist)."""
  if not isdir(path):
    return []
  if is_remote(path):
    return [name.rstrip('/') for name in gfile().listdir(path)]
  return os.listdir(path)


def absolute(path) -> str:
  """An absolute local path; remote paths unchanged."""
  return os.fspath(path) if is_remote(path) else os.path.abspath(path)
