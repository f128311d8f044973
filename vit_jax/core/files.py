"""Files at local paths or behind a scheme (`gs://`): one place for both.

Local paths use the standard library. A path with a scheme goes through
fsspec (`gs://` by gcsfs, as orbax's `etils.epath` does without TensorFlow;
`memory://` serves the tests). Before the first remote operation of a process
the storage host is looked up, so a machine without network stops at once with
one line instead of after the client's minutes of retries; a missing bucket or
missing credentials are one line too.
"""

import contextlib
import functools
import os
import re
import shutil
import socket
import struct
import urllib.parse

from vit_jax.core.errors import UserError

# Hosts that serve each scheme; a scheme not listed here (memory://, file://) is not checked.
_HOSTS = {'gs': 'storage.googleapis.com', 's3': 's3.amazonaws.com'}
_LOOKUP_TIMEOUT_S = 5


class RemoteFilesError(UserError, OSError):
  """A remote path that cannot be reached; the message is one line with what to do."""


def is_remote(path) -> bool:
  return '://' in os.fspath(path)


def _scheme(path) -> str:
  return urllib.parse.urlsplit(os.fspath(path)).scheme


@functools.lru_cache(maxsize=None)
def _unreachable(scheme: str):
  """(host, reason) when the host serving `scheme` cannot be looked up, else None."""
  host = _HOSTS.get(scheme)
  if host is None:
    return None
  previous = socket.getdefaulttimeout()
  socket.setdefaulttimeout(_LOOKUP_TIMEOUT_S)
  try:
    socket.getaddrinfo(host, 443)
  except OSError as e:
    return host, getattr(e, 'strerror', None) or str(e)
  finally:
    socket.setdefaulttimeout(previous)
  return None


def _filesystem(path):
  """(fsspec filesystem, its path) for a remote path, or a one-line error saying what to do."""
  scheme = _scheme(path)
  unreachable = _unreachable(scheme)
  if unreachable:
    raise RemoteFilesError(
      f'{path}: cannot reach {unreachable[0]} ({unreachable[1]}): no network here; copy the '
      'files to a local folder and pass that path instead'
    )
  try:
    import fsspec

    return fsspec.core.url_to_fs(os.fspath(path))
  except ImportError as e:  # gcsfs (gs://) or s3fs (s3://) is missing
    package = {'gs': 'gcsfs', 's3': 's3fs'}.get(scheme, f'the fsspec driver for {scheme}://')
    raise RemoteFilesError(
      f'{path}: {scheme}:// paths need {package}: pip install {package}'
    ) from e
  except ValueError as e:  # an unknown protocol
    raise RemoteFilesError(f'{path}: no file system for {scheme}:// ({e})') from None


def remote_error(path, error: Exception) -> Exception:
  """`error` of a remote operation on `path` as a one-line `RemoteFilesError` where it is the
  user's environment (credentials, permissions, a missing bucket); others unchanged."""
  text = f'{type(error).__name__}: {error}'
  causes = (
    (
      ('DefaultCredentialsError', 'credentials were not found', 'Anonymous caller'),
      'no credentials: run gcloud auth application-default login, or copy the files to a local '
      'folder and pass that path instead',
    ),  # fmt: skip
    (
      ('Forbidden', 'does not have storage'),
      'permission denied: grant this account access to the bucket, or pass a path you can write',
    ),  # fmt: skip
    (
      ('bucket does not exist', 'NoSuchBucket', 'The specified bucket'),
      'no such bucket: check the name, or create it (gcloud storage buckets create)',
    ),  # fmt: skip
  )
  for needles, cause in causes:
    if any(n in text for n in needles):
      return RemoteFilesError(f'{path}: {cause}')
  return error


def _remote_call(path, fn, *args, **kwargs):
  fs, inner = _filesystem(path)
  try:
    return fn(fs, inner, *args, **kwargs)
  except FileNotFoundError:
    raise
  except Exception as e:
    raise remote_error(path, e) from e


def exists(path) -> bool:
  return _remote_call(path, lambda fs, p: fs.exists(p)) if is_remote(path) else os.path.exists(path)


def isdir(path) -> bool:
  return _remote_call(path, lambda fs, p: fs.isdir(p)) if is_remote(path) else os.path.isdir(path)


def makedirs(path) -> None:
  if is_remote(path):
    _remote_call(path, lambda fs, p: fs.makedirs(p, exist_ok=True))
  else:
    os.makedirs(path, exist_ok=True)


def open_file(path, mode: str = 'r'):
  """A file object; text modes are UTF-8."""
  encoding = None if 'b' in mode else 'utf-8'
  if is_remote(path):
    return _remote_call(path, lambda fs, p: fs.open(p, mode, encoding=encoding))
  return open(path, mode, encoding=encoding)


def rename(src, dst) -> None:
  """Replaces `dst` (atomically for local files; a copy and a delete in object stores)."""
  if is_remote(src):
    _remote_call(src, lambda fs, p: fs.mv(p, _filesystem(dst)[1]))
  else:
    os.replace(src, dst)


def write_text(path, text: str) -> None:
  """Writes `path` whole: a reader sees the old contents or the new, never a part.

  Local files go through a temporary file and a rename; an object store
  publishes an object only when it is closed.
  """
  if is_remote(path):
    with open_file(path, 'w') as f:
      f.write(text)
    return
  with temporary_beside(path) as tmp:
    with open(tmp, 'w', encoding='utf-8') as f:
      f.write(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------
# Writing a local file or folder whole: under a temporary name first, renamed into place. The
# temporary names carry the writer's process id, so a write that a kill -9 cut short is known
# for one (its process is gone) and removed by the next write of the same path.

_TEMPORARY = re.compile(r'(?P<name>.+)\.tmp-(?P<pid>\d+)$')


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # another user's process
  return True


def remove_stale(path) -> None:
  """Removes what writes of `path` (or of `.NAME` beside it, a staged folder) left when their
  process died: `path.tmp-PID` and `.NAME.tmp-PID`, files or folders."""
  parent, name = os.path.split(os.path.abspath(path))
  try:
    entries = os.listdir(parent)
  except OSError:
    return
  for entry in entries:
    match = _TEMPORARY.fullmatch(entry)
    if match and match.group('name') in (name, f'.{name}') and not _alive(int(match['pid'])):
      stale = os.path.join(parent, entry)
      if os.path.isdir(stale) and not os.path.islink(stale):
        shutil.rmtree(stale, ignore_errors=True)
      else:
        with contextlib.suppress(OSError):
          os.remove(stale)


@contextlib.contextmanager
def temporary_beside(path):
  """`path.tmp-PID` for a file to be renamed onto `path` inside the block; removed if the block
  fails before (a full disk), and stale ones of dead processes removed first."""
  remove_stale(path)
  tmp = f'{os.fspath(path)}.tmp-{os.getpid()}'
  try:
    yield tmp
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


@contextlib.contextmanager
def staged(path):
  """Writes inside the block that appear at the local `path` whole, or not at all.

  Yields where to write instead: `path`'s name inside a folder `.NAME.tmp-PID` beside it (a
  writer may put more files there, as ONNX's external data beside its model). When the block
  ends, each entry there replaces its namesake beside `path` (into an existing folder `path`,
  each entry replaces its namesake inside it: an export into a folder keeps the other files);
  when it fails, the folder is removed and nothing else changed. Remote paths are written in
  place (an object store publishes an object when it is closed).
  """
  if is_remote(path):
    yield os.fspath(path)
    return
  parent, name = os.path.split(os.path.abspath(path))
  os.makedirs(parent, exist_ok=True)
  remove_stale(path)
  folder = os.path.join(parent, f'.{name}.tmp-{os.getpid()}')
  shutil.rmtree(folder, ignore_errors=True)
  try:
    os.makedirs(folder)
  except OSError as e:  # said of `path`, which the caller named
    raise OSError(e.errno, e.strerror, os.fspath(path)) from None
  try:
    yield os.path.join(folder, name)
    for entry in sorted(os.listdir(folder)):
      _replace(os.path.join(folder, entry), os.path.join(parent, entry))
  finally:
    shutil.rmtree(folder, ignore_errors=True)


def _replace(source: str, target: str) -> None:
  """Moves `source` onto `target`; a folder onto a folder, entry by entry."""
  if os.path.isdir(source) and os.path.isdir(target):  # a link to a folder: into that folder
    for entry in sorted(os.listdir(source)):
      inside = os.path.join(target, entry)
      if os.path.isdir(inside) and not os.path.islink(inside):
        shutil.rmtree(inside)
      shutil.move(os.path.join(source, entry), inside)  # the folder may be on another device
    return
  if os.path.islink(target):  # a link to a file: the file it names is what is written
    target = os.path.realpath(target)
  shutil.move(source, target)


def remove(path) -> None:
  """Deletes a file; one that is already gone is fine."""
  try:
    if is_remote(path):
      _remote_call(path, lambda fs, p: fs.rm(p))
    else:
      os.remove(path)
  except FileNotFoundError:
    pass


def listdir(path) -> list:
  """Names in a directory ([] when it does not exist)."""
  if not isdir(path):
    return []
  if is_remote(path):
    entries = _remote_call(path, lambda fs, p: fs.ls(p, detail=False))
    return [os.path.basename(e.rstrip('/')) for e in entries]
  return os.listdir(path)


def mtime(path) -> float:
  """Seconds since the epoch of the last write of `path`."""
  if not is_remote(path):
    return os.path.getmtime(path)
  info = _remote_call(path, lambda fs, p: fs.info(p))
  value = next(info[k] for k in ('mtime', 'updated', 'created', 'LastModified') if k in info)
  if hasattr(value, 'timestamp'):
    return value.timestamp()
  if isinstance(value, str):
    import datetime

    return datetime.datetime.fromisoformat(value.replace('Z', '+00:00')).timestamp()
  return float(value)


def text(path) -> str:
  """`path` as text that any UTF-8 writer takes (a figure title, a TensorBoard tag, JSON).

  A name that is not text in the file system's encoding (bytes of another
  encoding, or any non-ASCII byte in a C locale) reaches Python as surrogate
  escapes, which UTF-8 writers refuse: its bytes are read as UTF-8 here, and
  what is not UTF-8 either becomes U+FFFD.
  """
  return os.fspath(path).encode('utf-8', 'surrogateescape').decode('utf-8', 'replace')


def absolute(path) -> str:
  """An absolute local path; remote paths unchanged."""
  return os.fspath(path) if is_remote(path) else os.path.abspath(path)


# ---------------------------------------------------------------------------
# The TFRecord frame around each record.


def _masked_crc32c(data: bytes) -> int:
  """The CRC32C TFRecord files store: rotated right by 15 bits plus a constant."""
  import google_crc32c

  crc = google_crc32c.value(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord_frame(data: bytes) -> bytes:
  """One record as a TFRecord file stores it: the data's shards (`data.records`) and
  TensorBoard's event files (`workdir.run_log`)."""
  length = struct.pack('<Q', len(data))
  return (
    length
    + struct.pack('<I', _masked_crc32c(length))
    + data
    + struct.pack('<I', _masked_crc32c(data))
  )
