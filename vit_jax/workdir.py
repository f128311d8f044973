"""The run directory (workdir): the one module that names its files, reads and writes them.

  WORKDIR/
    config.json            the run's config; a run resumes only when it agrees (training.resume)
    checkpoints/<step>/    orbax checkpoints: train state, data iterator position, run totals
    corrupt_checkpoints/   checkpoints that did not restore, moved aside, never deleted
    summary.json           the finished run: step, accuracy, speed and its model's name
    params.npz             its final parameters in the public layout (params_ema.npz: EMA)
    fewshot.json           results of `python -m vit_jax.fewshot` (TensorBoard: tensorboard/fewshot)
    lock.json              held while a run writes
    metrics.jsonl, tensorboard/   what the run logs as it goes (vit_jax.run_log)

Every path here may be local or behind a scheme (`gs://`, `vit_jax.files`).

One run at a time: `acquire(workdir)` has process 0 take `Lock(workdir)`,
which writes `lock.json` (host, pid, boot id, start time, heartbeat) or
refuses with `WorkdirError` when another run holds it; `release()` removes
it. A lock left by a run that is gone (killed, crashed, machine rebooted) is
stale and taken over: on the same host when its process no longer runs (or
the machine booted since), from another host when its heartbeat, refreshed
every `HEARTBEAT_S` by a background thread, is older than `STALE_AFTER_S`.
Local paths are created exclusively (`O_EXCL`); object stores offer no
create-if-absent, so there the lock is written, left to settle and read back,
and the holder checks at every heartbeat that the lock is still its own
(`lost` otherwise).

Failed writes: within `storage_errors(workdir)`, a write that failed for want
of space, quota or permission, wherever it was raised (our files, orbax's
background threads, TensorStore), leaves the run as one `WorkdirError` line
naming the workdir, what ran out and the checkpoint that is intact
(`storage_failure` recognises one however deep in a library it was raised).
"""

import contextlib
import errno
import functools
import json
import logging as py_logging
import math
import os
import re
import socket
import sys
import threading
import time
from typing import Optional
import uuid

from absl import logging

from vit_jax import files
from vit_jax.errors import UserError

CONFIG_FILE = 'config.json'
CHECKPOINTS = 'checkpoints'
CORRUPT_CHECKPOINTS = 'corrupt_checkpoints'
SUMMARY_FILE = 'summary.json'
PARAMS_FILE = 'params.npz'
PARAMS_EMA_FILE = 'params_ema.npz'
FEWSHOT_FILE = 'fewshot.json'
LOCK_FILE = 'lock.json'
METRICS_FILE = 'metrics.jsonl'  # written by vit_jax.run_log
TENSORBOARD = 'tensorboard'  # event files, by vit_jax.run_log
FEWSHOT_TENSORBOARD = os.path.join(TENSORBOARD, 'fewshot')
# How often the holder refreshes its heartbeat, and how old a heartbeat from
# another host must be before the lock counts as abandoned: long enough for a
# slow object store, short enough that a restarted job on a new machine waits
# minutes, not hours.
HEARTBEAT_S = 60.0
STALE_AFTER_S = 600.0
# Object stores: of two runs that write the lock within this window, the later
# write wins and the earlier run sees it when it reads back.
REMOTE_SETTLE_S = 2.0


class WorkdirError(UserError, RuntimeError):
  """The workdir cannot be used as asked (in use, full, read-only, ...); one line."""


# ---------------------------------------------------------------------------
# The files of a run.


def is_workdir(path) -> bool:
  """Whether a checkpoint path names a directory (a workdir) rather than a file."""
  return files.isdir(path)


def check_folder(workdir: str) -> None:
  """WorkdirError when `workdir`, or a folder it would be made in, is an existing file."""
  if files.is_remote(workdir):
    return
  path = os.path.abspath(workdir)
  while not os.path.lexists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  if os.path.exists(path) and not os.path.isdir(path):
    where = 'is a file' if path == os.path.abspath(workdir) else f'is inside the file {path}'
    raise WorkdirError(
      f"{workdir} {where}: a workdir is a folder (made when missing) for the run's checkpoints "
      'and results; pass another --workdir'
    )


# What makes a folder a run's, for the commands that write elsewhere (`check_output`).
_RUN_WORK = (PARAMS_FILE, PARAMS_EMA_FILE, CHECKPOINTS, SUMMARY_FILE, LOCK_FILE)
_RUN_FILES = _RUN_WORK + (CONFIG_FILE, CORRUPT_CHECKPOINTS, FEWSHOT_FILE, METRICS_FILE, TENSORBOARD)


def check_output(path, flag: str, *, folder: bool = False) -> None:
  """WorkdirError when a command's output `path` could replace a training run's work.

  `folder`: the command writes files into `path` (export to hf or savedmodel,
  analyze, jft, ...), refused when `path` holds a run's work (params.npz,
  params_ema.npz, checkpoints/, summary.json or lock.json); a file `path` is
  refused when it is one of a run's own files in such a folder. Files beside
  a run's (`--output=RUN/model.onnx`) and sub-folders (`RUN/export/`) are fine.
  """
  path = os.fspath(path)
  target = path if folder else os.path.dirname(path) or '.'
  if not folder and os.path.basename(path) not in _RUN_FILES:
    return
  held = [name for name in _RUN_WORK if files.exists(os.path.join(target, name))]
  if held:
    shown = ', '.join(f'{name}/' if name == CHECKPOINTS else name for name in held)
    if folder:
      what, instead = path, f'a new folder (such as {os.path.join(path, "export")})'
    else:
      what, instead = f'{path} is in {target}, which', 'another file name'
    raise WorkdirError(
      f"{flag} {what} holds a run's work ({shown}) that this would replace; pass {instead}"
    )


def checkpoints_dir(workdir: str, absolute: bool = False) -> str:
  """Where orbax writes the run's checkpoints (`absolute`: as orbax needs the path, `_text_path`)."""
  if absolute:
    return _text_path(os.path.join(files.absolute(workdir), CHECKPOINTS))
  return os.path.join(workdir, CHECKPOINTS)


def _text_path(path: str) -> str:
  """`path`, or where a path that is not UTF-8 text can be reached under a name that is.

  TensorStore, which writes orbax's arrays, takes paths as UTF-8 text; a
  local name in bytes of another encoding (or with any non-ASCII letter in a
  C locale) reaches Python as surrogate escapes. Such a folder is reached
  through a symlink in the temporary folder, named by a hash of the path.
  """
  try:
    path.encode('utf-8')
    return path
  except UnicodeEncodeError:
    pass
  import hashlib
  import tempfile

  files.makedirs(path)
  digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:16]
  link = os.path.join(tempfile.gettempdir(), f'vit_jax-checkpoints-{digest}')
  if not (os.path.islink(link) and os.readlink(link) == path):
    temporary = f'{link}.{os.getpid()}'
    os.symlink(path, temporary)
    os.replace(temporary, link)
  return link


def params_path(workdir: str, ema: bool = False) -> str:
  return os.path.join(workdir, PARAMS_EMA_FILE if ema else PARAMS_FILE)


def summary_path(workdir: str) -> str:
  return os.path.join(workdir, SUMMARY_FILE)


def has_params(workdir: str) -> bool:
  """Whether `workdir` holds a finished run's parameters."""
  return files.exists(params_path(workdir))


def _read_json(path: str) -> Optional[dict]:
  if not files.exists(path):
    return None
  with files.open_file(path) as f:
    return json.load(f)


def json_numbers(data: dict) -> dict:
  """`data` with NaN and infinite floats as None: strict JSON (`null`), which every reader
  parses, where Python's json would write the bare `NaN` that most refuse."""
  return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in data.items()}


def _write_json(path: str, data: dict) -> None:
  text = json.dumps(json_numbers(data), indent=2, sort_keys=True, allow_nan=False)
  files.write_text(path, text + '\n')


def read_summary(workdir: str) -> Optional[dict]:
  """The finished run's summary, None when there is none."""
  return _read_json(summary_path(workdir))


def write_summary(workdir: str, summary: dict) -> None:
  _write_json(summary_path(workdir), summary)


def recorded(path, field: str):
  """`field` (`model`, `dataset`, ...) of a workdir's summary, else of its config (a run not
  finished); None for files and unreadable runs."""
  path = os.fspath(path)
  try:
    if not is_workdir(path):
      return None
    return next(
      (r[field] for r in (read_summary(path), read_config(path)) if r and field in r), None
    )
  except (OSError, ValueError):
    return None


def config_as_json(config) -> dict:
  """A ConfigDict as the plain data `config.json` holds."""
  return json.loads(config.to_json_best_effort())


def read_config(workdir: str) -> Optional[dict]:
  """The config the run in `workdir` recorded, None when there is none."""
  return _read_json(os.path.join(workdir, CONFIG_FILE))


def write_config(workdir: str, config) -> None:
  """Records `config` in `workdir`; an unchanged one is not rewritten."""
  text = json.dumps(config_as_json(config), indent=2, sort_keys=True) + '\n'
  path = os.path.join(workdir, CONFIG_FILE)
  if files.exists(path):
    with files.open_file(path) as f:
      if f.read() == text:
        return
  files.write_text(path, text)


def saved_steps(workdir: str) -> list:
  """Steps of the complete checkpoints (unfinished ones carry a suffix), oldest first."""
  names = files.listdir(checkpoints_dir(workdir))
  return sorted(int(name) for name in names if name.isdigit())


def checkpoint_has_item(workdir: str, step: int, item: str) -> bool:
  """Whether the checkpoint at `step` holds the orbax item `item`."""
  return files.exists(os.path.join(workdir, CHECKPOINTS, str(step), item))


def set_aside(workdir: str, step: int) -> str:
  """Moves checkpoint `step` into `corrupt_checkpoints/` (never deleted); its new path."""
  folder = corrupt_checkpoints_dir(workdir)
  files.makedirs(folder)
  target, n = os.path.join(folder, str(step)), 1
  while files.exists(target):
    target, n = os.path.join(folder, f'{step}-{n}'), n + 1
  files.rename(os.path.join(checkpoints_dir(workdir), str(step)), target)
  return target


def corrupt_checkpoints_dir(workdir: str) -> str:
  return os.path.join(workdir, CORRUPT_CHECKPOINTS)


def add_fewshot(workdir: str, scalars: dict) -> str:
  """Adds few-shot `scalars` to `fewshot.json` (other datasets' results kept); its path. A
  training run's own files (summary, metrics) stay as the run wrote them; the TensorBoard
  copy is `run_log.record_fewshot`'s."""
  path = os.path.join(workdir, FEWSHOT_FILE)
  results = _read_json(path) or {}
  results.update(scalars)
  files.makedirs(workdir)
  _write_json(path, results)
  return path


# ---------------------------------------------------------------------------
# One run at a time.


def _boot_id() -> str:
  """This boot of this machine (Linux); '' where unknown."""
  try:
    with open('/proc/sys/kernel/random/boot_id', encoding='utf-8') as f:
      return f.read().strip()
  except OSError:
    return ''


def _pid_running(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  # A killed process that its parent has not reaped yet still answers; it is gone.
  try:
    with open(f'/proc/{pid}/stat', encoding='utf-8') as f:
      return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
  except (OSError, IndexError):
    return True


def is_stale(holder: dict, *, now: float, host: str, boot_id: str) -> bool:
  """Whether the run that wrote `holder` is gone, seen from `host` at time `now`."""
  if holder.get('host') == host:
    if holder.get('boot_id') and boot_id and holder['boot_id'] != boot_id:
      return True  # written before this machine last booted
    return not _pid_running(int(holder.get('pid', -1)))
  return now - float(holder.get('heartbeat', 0.0)) > STALE_AFTER_S


def _in_use(workdir: str, holder: dict) -> str:
  started = time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(holder.get('started', 0)))
  return (
    f'{workdir} is in use by another run (pid {holder.get("pid", "?")} on '
    f'{holder.get("host", "an unknown host")}, started {started}); wait for it to end or use '
    f'another --workdir. If no such run is going, delete {os.path.join(workdir, LOCK_FILE)}'
  )


class Lock:
  """The right to write one workdir; see the module docstring."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.path = os.path.join(workdir, LOCK_FILE)
    self.took_over: Optional[dict] = None  # the stale lock this one replaced
    self.lost = False  # another run replaced this lock (object stores, see above)
    self._token = uuid.uuid4().hex
    self._started = time.time()
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None

  def acquire(self) -> 'Lock':
    """Takes the lock (over a stale one) and starts the heartbeat; WorkdirError when held."""
    files.makedirs(self.workdir)
    host, boot_id = socket.gethostname(), _boot_id()
    # A few rounds: a stale lock removed here may be re-taken by a third run first.
    for _ in range(3):
      holder = self._read()
      if holder is not None:
        if not is_stale(holder, now=time.time(), host=host, boot_id=boot_id):
          raise WorkdirError(_in_use(self.workdir, holder))
        self._remove_if_unchanged(holder)
        self.took_over = holder
      if self._create():
        self._thread = threading.Thread(target=self._beat, name='workdir-lock', daemon=True)
        self._thread.start()
        return self
    raise WorkdirError(_in_use(self.workdir, self._read() or {}))

  def release(self) -> None:
    """Stops the heartbeat and removes the lock if it is still this run's."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    try:
      if (self._read() or {}).get('token') == self._token:
        self._remove()
    except Exception as e:  # noqa: BLE001  cleanup must not hide the error that ended the run
      logging.warning('could not remove %s: %s', self.path, e)

  def _record(self) -> dict:
    return {
      'token': self._token,
      'host': socket.gethostname(),
      'pid': os.getpid(),
      'boot_id': _boot_id(),
      'started': self._started,
      'heartbeat': time.time(),
      'command': ' '.join(sys.argv),
    }

  def _read(self) -> Optional[dict]:
    """The lock's contents; None when there is none. A half-written one ages by its mtime."""
    try:
      with files.open_file(self.path) as f:
        text = f.read()
    except FileNotFoundError:
      return None
    except Exception:  # noqa: BLE001  tf.io.gfile raises its own NotFoundError
      if not files.exists(self.path):
        return None
      raise
    try:
      holder = json.loads(text)
      if isinstance(holder, dict):
        return holder
    except ValueError:
      pass
    return {'heartbeat': _mtime(self.path)}

  def _create(self) -> bool:
    """Writes this run's lock where there is none; whether it is now this run's."""
    text = json.dumps(self._record(), indent=2)
    if not files.is_remote(self.path):
      return _create_whole(self.path, text, f'{self.path}.{self._token}.tmp')
    with files.open_file(self.path, 'w') as f:
      f.write(text)
    time.sleep(REMOTE_SETTLE_S)
    return (self._read() or {}).get('token') == self._token

  def _remove_if_unchanged(self, holder: dict) -> None:
    current = self._read()
    if current is not None and current.get('token') == holder.get('token'):
      self._remove()

  def _remove(self) -> None:
    files.remove(self.path)

  def _beat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      try:
        if (self._read() or {}).get('token') != self._token:
          self.lost = True
          logging.warning('%s was replaced by another run', self.path)
          return
        files.write_text(self.path, json.dumps(self._record(), indent=2))
      except Exception as e:  # noqa: BLE001  a storage hiccup: try again at the next beat
        logging.warning('could not refresh %s: %s', self.path, e)


def acquire(workdir: str) -> Optional[Lock]:
  """Process 0's lock on `workdir` (None on the other processes); WorkdirError when in use.

  Process 0 tells the others whether it could take the lock, so that all of
  them go on or stop together (the hosts of one run share a workdir).
  """
  import jax
  from jax.experimental import multihost_utils
  import numpy as np

  held, error = None, None
  if jax.process_index() == 0:
    try:
      held = Lock(workdir).acquire()
    except Exception as e:  # noqa: BLE001  raised below, once the other processes know
      error = e
  ok = error is None
  if jax.process_count() > 1:
    ok = bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))
  if error is not None:
    raise error
  if not ok:
    raise WorkdirError(f'process 0 could not lock {workdir}; see its log')
  if held is not None and held.took_over:
    # A plain stdout line, like the run's other progress lines (run_log.RunLog.info).
    print(
      f'took over {held.path} from a run that is gone (pid {held.took_over.get("pid", "?")} '
      f'on {held.took_over.get("host", "?")})',
      flush=True,
    )
  return held


def _create_whole(path: str, text: str, temporary: str) -> bool:
  """Creates the local file `path` holding `text` unless it exists; whether this call made it.

  The text is written to `temporary` first and hard-linked to `path` (which,
  like O_EXCL, fails when `path` exists): a second run never reads a lock
  that is there but still empty ("pid ?"). File systems without hard links
  get O_EXCL and the write after it.
  """
  try:
    try:
      with open(temporary, 'w', encoding='utf-8') as f:
        f.write(text)
    except OSError as e:
      e.filename = path  # what this writes, for the one line of a failed write (storage_errors)
      raise
    return _link_or_create(temporary, path, text)
  finally:
    if os.path.lexists(temporary):
      os.remove(temporary)


def _link_or_create(temporary: str, path: str, text: str) -> bool:
  try:
    os.link(temporary, path)
    return True
  except FileExistsError:
    return False
  except OSError as e:
    if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
      raise
  try:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    return False
  with os.fdopen(fd, 'w', encoding='utf-8') as f:
    f.write(text)
  return True


def _mtime(path: str) -> float:
  if files.is_remote(path):
    return files.mtime(path)
  return os.path.getmtime(path)


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
