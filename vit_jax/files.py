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


def listdir(path) -> list:
  """Names in a directory (sub-directories without a trailing slash)."""
  if is_remote(path):
    return [name.rstrip('/') for name in gfile().listdir(path)]
  return os.listdir(path)


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


def absolute(path) -> str:
  """An absolute local path; remote paths unchanged."""
  return os.fspath(path) if is_remote(path) else os.path.abspath(path)
