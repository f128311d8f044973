"""A workdir is written by one run at a time, and a failed write says why in one line.

`Lock(workdir).acquire()` writes `WORKDIR/lock.json` (host, pid, boot id,
start time, heartbeat) or refuses with `WorkdirError` when another run holds
it; `release()` removes it. A lock left by a run that is gone (killed,
crashed, machine rebooted) is stale and taken over: on the same host when its
process no longer runs (or the machine booted since), from another host when
its heartbeat, refreshed every `HEARTBEAT_S` by a background thread, is older
than `STALE_AFTER_S`. Local paths are created exclusively (`O_EXCL`); object
stores (`gs://`) offer no create-if-absent through `tf.io.gfile`, so there the
lock is written, left to settle and read back, and the holder checks at every
heartbeat that the lock is still its own (`lost` otherwise). In a multi-host
run only process 0 takes the lock (the hosts of one run share a workdir).

`storage_failure(error)` recognises a write that failed for want of space,
quota or permission, however deep in a library it was raised.
"""

import errno
import json
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

LOCK_FILE = 'lock.json'
# How often the holder refreshes its heartbeat, and how old a heartbeat from
# another host must be before the lock counts as abandoned: long enough for a
# slow object store, short enough that a restarted job on a new machine waits
# minutes, not hours.
HEARTBEAT_S = 60.0
STALE_AFTER_S = 600.0
# Object stores: of two runs that write the lock within this window, the later
# write wins and the earlier run sees it when it reads back.
REMOTE_SETTLE_S = 2.0


class WorkdirError(RuntimeError):
  """The workdir cannot be used as asked (in use, full, read-only, ...); one line."""


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
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        return False
      with os.fdopen(fd, 'w', encoding='utf-8') as f:
        f.write(text)
      return True
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


def _mtime(path: str) -> float:
  if files.is_remote(path):
    return files.gfile().stat(path).mtime_nanos / 1e9
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
