"""One run at a time in a workdir.

`acquire(workdir)` has process 0 take `Lock(workdir)`, which writes
`lock.json` (host, pid, boot id, start time, heartbeat) or refuses with
`WorkdirError` when another run holds it; `release()` removes it. A lock left
by a run that is gone (killed, crashed, machine rebooted) is stale and taken
over: on the same host when its process no longer runs (or the machine booted
since), from another host when its heartbeat, refreshed every `HEARTBEAT_S` by
a background thread, is older than `STALE_AFTER_S`. Local paths are created
exclusively (`O_EXCL`); object stores offer no create-if-absent, so there the
lock is written, left to settle and read back, and the holder checks at every
heartbeat that the lock is still its own (`lost` otherwise).
"""

import errno
import json
import os
import socket
import sys
import threading
import time
from typing import Optional
import uuid

from absl import logging

from vit_jax.core import files
from vit_jax.workdir.layout import LOCK_FILE
from vit_jax.workdir.layout import WorkdirError

# How often the holder refreshes its heartbeat, and how old a heartbeat from
# another host must be before the lock counts as abandoned: long enough for a
# slow object store, short enough that a restarted job on a new machine waits
# minutes, not hours.
HEARTBEAT_S = 60.0
STALE_AFTER_S = 600.0
# Object stores: of two runs that write the lock within this window, the later
# write wins and the earlier run sees it when it reads back.
REMOTE_SETTLE_S = 2.0


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
  if jax.process_count() > 1 and not files.is_remote(workdir):
    _check_shared(workdir, held)
  if held is not None and held.took_over:
    # A plain stdout line, like the run's other progress lines (run_log.RunLog.info).
    print(
      f'took over {held.path} from a run that is gone (pid {held.took_over.get("pid", "?")} '
      f'on {held.took_over.get("host", "?")})',
      flush=True,
    )
  return held


def _check_shared(workdir: str, held: Optional[Lock]) -> None:
  """Every process sees the lock that process 0 wrote, or all of them stop with WorkdirError:
  a workdir on a disk of each node's own would split the run's checkpoints between them."""
  from jax.experimental import multihost_utils
  import numpy as np

  mark = int(held._token[:7], 16) if held is not None else 0  # 28 bits: fits an int32
  mark = int(multihost_utils.broadcast_one_to_all(np.int32(mark)))
  seen = held is not None or _sees_lock(workdir, mark)
  blind = np.flatnonzero(multihost_utils.process_allgather(np.int32(seen)) == 0).tolist()
  if blind:
    if held is not None:
      held.release()
    which = f'process{"es" if len(blind) > 1 else ""} {", ".join(map(str, blind))}'
    raise WorkdirError(
      f'{workdir} is not shared between the processes of this run: {which} cannot see the '
      f'{LOCK_FILE} that process 0 wrote there. Put the workdir on a filesystem that every '
      'node mounts (or gs://BUCKET/PATH), or run all processes on one node'
    )


def _sees_lock(workdir: str, mark: int, wait_s: float = 10.0) -> bool:
  """Whether `workdir`'s lock is the one process 0 took (`mark`), waiting a little for a
  network filesystem that shows another node's new file late."""
  deadline = time.time() + wait_s
  while True:
    try:
      with open(os.path.join(workdir, LOCK_FILE), encoding='utf-8') as f:
        if int(json.load(f)['token'][:7], 16) == mark:
          return True
    except (OSError, ValueError, KeyError, TypeError):
      pass
    if time.time() > deadline:
      return False
    time.sleep(0.5)


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
