"""Failed writes to a workdir, as one line.

Within `storage_errors(workdir)`, a write that failed for want of space, quota
or permission, wherever it was raised (our files, orbax's background threads,
TensorStore), leaves the run as one `WorkdirError` line naming the workdir,
what ran out and the checkpoint that is intact (`storage_failure` recognises
one however deep in a library it was raised).
"""

import contextlib
import errno
import functools
import logging as py_logging
import re
import sys
from typing import Optional

from vit_jax.core import files
from vit_jax.workdir.layout import WorkdirError
from vit_jax.workdir.layout import saved_steps

# errno, what ran out or went wrong, and how libraries that drop the errno
# (TensorStore, tf.io.gfile) spell it.
_STORAGE_ERRORS = (
  (errno.ENOSPC, 'no space left on device', ('no space left on device', "os_error_code='28'")),
  (errno.EDQUOT, 'disk quota exceeded', ('disk quota exceeded', "os_error_code='122'")),
  (errno.EROFS, 'read-only file system', ('read-only file system', "os_error_code='30'")),
  (errno.EACCES, 'permission denied', ('permission denied', "os_error_code='13'")),
  (errno.EPERM, 'permission denied', ('operation not permitted', "os_error_code='1'")),
)


def storage_failure(error: BaseException) -> Optional[tuple]:
  """(what went wrong, the path when known) if `error` or its cause is a failed write."""
  for e in _chain(error):
    text = str(e)
    for number, what, spellings in _STORAGE_ERRORS:
      if (isinstance(e, OSError) and e.errno == number) or any(
        s in text.lower() for s in spellings
      ):
        path = getattr(e, 'filename', None)
        if path is None:
          quoted = re.search(r'"((?:/|gs://)[^"]+)"', text)
          path = quoted.group(1) if quoted else None
        return what, path
  return None


def _chain(error: BaseException):
  """`error` and the errors that caused it, outermost first."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)


@contextlib.contextmanager
def storage_errors(workdir: str, keep: tuple = ()):
  """Failed writes to storage leave as one WorkdirError line; errors of the types `keep` pass."""
  _quiet_failed_writes()
  try:
    yield
  except keep:
    raise
  except WorkdirError:
    raise
  except Exception as e:
    failure = storage_failure(e)
    if failure is None:
      raise
    raise WorkdirError(_storage_message(workdir, *failure)) from None


def _storage_message(workdir: str, what: str, path: Optional[str]) -> str:
  where = files.absolute(workdir).rstrip('/')
  if path is not None and not files.absolute(path).startswith(where + '/'):
    return f'{what}: {path}'  # not the workdir (a dataset folder, say)
  # The workdir's entry being written (a checkpoint folder, lock.json), not a file deep inside.
  entry = '/'.join(files.absolute(path)[len(where) + 1 :].split('/')[:2]) if path else ''
  writing = f' (writing {entry})' if entry else ''
  if what in ('no space left on device', 'disk quota exceeded'):
    saved = saved_steps(workdir)
    kept = f'the checkpoint at step {saved[-1]} is intact' if saved else 'no checkpoint was written'
    return (
      f'{workdir}: {what}{writing}; {kept}. Free space there and run the same command '
      'again to resume'
    )
  return f'{workdir}: {what}{writing}; make it writable or use another --workdir'


def _quiet_failed_writes() -> None:
  """Drops what a checkpoint write that failed for want of space or permission leaves behind.

  Orbax's background threads log the failure, its aborted asyncio tasks log
  it again when collected (as late as interpreter exit) and their callbacks
  report "Event loop is closed": hundreds of lines saying what the one
  WorkdirError line says. The filters stay installed for that reason; they
  drop nothing else.
  """
  for name in ('absl', 'asyncio'):
    logger = py_logging.getLogger(name)
    if _not_a_failed_write not in logger.filters:
      logger.addFilter(_not_a_failed_write)
  hook = sys.unraisablehook
  if getattr(hook, 'func', None) is not _drop_closed_loop_reports:
    sys.unraisablehook = functools.partial(_drop_closed_loop_reports, previous=hook)


def _not_a_failed_write(record) -> bool:
  if record.levelno < py_logging.ERROR or not (
    'orbax' in record.pathname or record.name == 'asyncio'
  ):
    return True
  text = record.getMessage() + (str(record.exc_info[1]) if record.exc_info else '')
  return storage_failure(RuntimeError(text)) is None


def _drop_closed_loop_reports(unraisable, previous):
  if isinstance(unraisable.exc_value, RuntimeError) and 'Event loop is closed' in str(
    unraisable.exc_value
  ):
    return
  previous(unraisable)
