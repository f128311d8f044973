"""A run's hold on its workdir: one run at a time across hosts, failed writes as one line.

`lock(workdir)`: process 0 takes the workdir's lock (`vit_jax.workdir`) and
tells the other processes whether it could, so that all of them go on or
stop together. `storage_errors(workdir)`: a write that failed for want of
space, quota or permission, wherever it was raised (our files, orbax's
background threads, TensorStore), leaves the run as one `WorkdirError` line
naming the workdir, what ran out and the checkpoint that is intact.
"""

import contextlib
import functools
import logging
import sys
from typing import Optional

import jax
from jax.experimental import multihost_utils
import numpy as np

from vit_jax import files
from vit_jax import workdir as workdir_lib
from vit_jax.training import resume


def lock(workdir: str) -> Optional[workdir_lib.Lock]:
  """Process 0's lock on `workdir` (None on the other processes); WorkdirError when in use."""
  held, error = None, None
  if jax.process_index() == 0:
    try:
      held = workdir_lib.Lock(workdir).acquire()
    except Exception as e:  # noqa: BLE001  raised below, once the other processes know
      error = e
  ok = error is None
  if jax.process_count() > 1:
    ok = bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))
  if error is not None:
    raise error
  if not ok:
    raise workdir_lib.WorkdirError(f'process 0 could not lock {workdir}; see its log')
  if held is not None and held.took_over:
    # A plain stdout line, like the run's other progress lines (run_log.RunLog.info).
    print(
      f'took over {held.path} from a run that is gone (pid {held.took_over.get("pid", "?")} '
      f'on {held.took_over.get("host", "?")})',
      flush=True,
    )
  return held


@contextlib.contextmanager
def storage_errors(workdir: str, keep: tuple = ()):
  """Failed writes to storage leave as one WorkdirError line; errors of the types `keep` pass."""
  _quiet_failed_writes()
  try:
    yield
  except keep:
    raise
  except workdir_lib.WorkdirError:
    raise
  except Exception as e:
    failure = workdir_lib.storage_failure(e)
    if failure is None:
      raise
    raise workdir_lib.WorkdirError(_message(workdir, *failure)) from None


def _message(workdir: str, what: str, path: Optional[str]) -> str:
  where = files.absolute(workdir).rstrip('/')
  if path is not None and not files.absolute(path).startswith(where + '/'):
    return f'{what}: {path}'  # not the workdir (a dataset folder, say)
  # The workdir's entry being written (a checkpoint folder, lock.json), not a file deep inside.
  entry = '/'.join(files.absolute(path)[len(where) + 1 :].split('/')[:2]) if path else ''
  writing = f' (writing {entry})' if entry else ''
  if what in ('no space left on device', 'disk quota exceeded'):
    saved = resume.saved_steps(workdir)
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
    logger = logging.getLogger(name)
    if _not_a_failed_write not in logger.filters:
      logger.addFilter(_not_a_failed_write)
  hook = sys.unraisablehook
  if getattr(hook, 'func', None) is not _drop_closed_loop_reports:
    sys.unraisablehook = functools.partial(_drop_closed_loop_reports, previous=hook)


def _not_a_failed_write(record) -> bool:
  if record.levelno < logging.ERROR or not ('orbax' in record.pathname or record.name == 'asyncio'):
    return True
  text = record.getMessage() + (str(record.exc_info[1]) if record.exc_info else '')
  return workdir_lib.storage_failure(RuntimeError(text)) is None


def _drop_closed_loop_reports(unraisable, previous):
  if isinstance(unraisable.exc_value, RuntimeError) and 'Event loop is closed' in str(
    unraisable.exc_value
  ):
    return
  previous(unraisable)
