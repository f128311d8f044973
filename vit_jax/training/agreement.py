"""The processes of one run agree on the step to stop after, and name one that has gone.

A signal reaches one process, or all of them at slightly different steps
(SLURM signals every task, a user kills one pid, a TPU VM's maintenance event
or a Spot preemption ends one host). Each process has an `Agreement`: a thread
that waits on JAX's coordination service (the key-value store that
`jax.distributed.initialize` starts on process 0) for a notice. Any process
posts one (`notify`: a signal, or `roll_call` after an error); then every
process answers with the last step its loop has passed, and all of them stop
after the same step, one past the largest answer. The loop's own cost is a
lock and a comparison per step (`due`): the waiting is in the thread, so a
process whose loop is blocked in a collective still answers.

A process that does not answer within `ANSWER_S` seconds is gone (killed,
crashed, or its machine lost), and one whose coordination service is
unreachable has lost process 0: the thread then ends this process with one
line naming the lost process (`on_lost`), since no collective can complete
without it. Rounds repeat: a roll call after an error is a new round.

A process can also be lost while the others wait in a collective that never
fails (a machine lost with its network link: no connection is closed, and a
GPU collective waits forever): the threads beat too. Every `BEAT_S` seconds
each process writes a count to the store, and process 0 reads them all (one
request): a process whose count stands still for `ANSWER_S` seconds is gone,
and process 0 posts a notice naming it, which ends every process with the
same line. The others ask for process 0's count every beat (one request,
answered at once while its service is up); `ANSWER_S` seconds without an
answer is process 0 lost. A thread that did not run for a while (the process
paused, or starved of CPU) starts counting again rather than blame the others.
"""

import itertools
import threading
import time
from typing import Callable, Optional

import jax

ANSWER_S = 10  # a live process answers in milliseconds; SLURM's KillWait is 30 s by default
BEAT_S = 2  # between two beats of a process (each one request to process 0's service)
FIRST_BEAT_S = 60  # for a process's first beat: the processes reach their loop at their pace
_POLL_MS = 1000  # how long one wait for a notice lasts before the thread looks at `close`
_GONE = 'gone '  # a notice from process 0: `gone 2,3`, processes that stopped beating

# Each run's agreements are numbered alike on every process (they make them in the same
# order), so that their keys in the shared store are the same and never reused.
_numbers = itertools.count()


def _timed_out(error: Exception) -> bool:
  return 'DEADLINE_EXCEEDED' in str(error)


def client():
  """JAX's coordination service client of this multi-process run, or None."""
  from jax._src import distributed  # the client jax.distributed.initialize made

  return distributed.global_state.client


class Agreement:
  """One process's side of the agreement: the step to stop after (`stop_at`, `due`).

  `on_lost(missing, last_step)` ends the process when processes stop
  answering (`missing`, their indices); it does not return.
  """

  def __init__(self, coordination, on_lost: Callable[[list, int], None]):
    self._client = coordination
    self._on_lost = on_lost
    self.rank, self.count = jax.process_index(), jax.process_count()
    self._key = f'vit_jax/stop/{next(_numbers)}'
    self._lock = threading.Lock()  # held by the thread for a round: the loop waits at `due`
    self._notice_lock = threading.Lock()  # a signal's notice and this process's answer
    self._rounds = threading.Condition()
    self._last = -1  # the last step the loop passed (-1: none yet)
    self._next = 0  # the round this process has not answered yet
    self._done = 0  # rounds completed
    self.local_signal = 0  # a signal this process got, carried in its answers
    self.stop_at: Optional[int] = None  # every process stops after this step
    self.signal = 0  # the signal that asked for the stop (the first one answered)
    self._closed = threading.Event()
    self._beats = 0  # this process's count
    now = time.monotonic()
    self._beat_at = now  # when this thread last beat
    self._heard = {r: (None, now + FIRST_BEAT_S - ANSWER_S) for r in range(self.count)}
    self._thread = threading.Thread(target=self._watch, name='vit_jax-agreement', daemon=True)
    self._thread.start()

  def due(self, step: int) -> bool:
    """Whether the loop stops after `step`, the step it has just passed (every step)."""
    with self._lock:
      self._last = step
      return self.stop_at is not None and step >= self.stop_at

  def notify(self, signum: int) -> None:
    """A signal reached this process: every process hears of it and they agree on a step."""
    with self._notice_lock:
      self.local_signal = self.local_signal or int(signum)
      round_ = self._next
    self._post(round_, str(int(signum)))

  def roll_call(self) -> None:
    """After an error in the loop: are all processes still there? If one is not, `on_lost`
    ends this process; otherwise this returns (within ANSWER_S and a little) and the error
    is the loop's own."""
    with self._notice_lock:
      round_ = self._next
    self._post(round_, 'check')
    with self._rounds:
      self._rounds.wait_for(lambda: self._done > round_, timeout=ANSWER_S + 5)

  def close(self) -> None:
    """This process is done with the run: others no longer wait for its answers."""
    self._closed.set()
    try:
      self._client.key_value_set(f'{self._key}/closed/{self.rank}', '1')
    except Exception:  # noqa: BLE001  the service is gone: nobody is waiting
      pass
    self._thread.join(timeout=2 * _POLL_MS / 1000)

  def _post(self, round_: int, notice: str) -> None:
    try:
      self._client.key_value_set(f'{self._key}/{round_}/notice', notice)
    except Exception:  # noqa: BLE001  posted already (that round is under way), or no service
      pass

  def _watch(self) -> None:
    while not self._closed.is_set():
      try:
        if not self._beat():
          return
        notice = self._client.blocking_key_value_get(f'{self._key}/{self._next}/notice', _POLL_MS)
      except Exception as e:  # noqa: BLE001
        if _timed_out(e):
          continue
        self._service_lost()
        return
      if notice.startswith(_GONE):
        if not self._closed.is_set():
          self._on_lost([int(r) for r in notice[len(_GONE) :].split(',')], self._last)
        return
      self._round(notice)

  def _beat(self) -> bool:
    """Every BEAT_S: this process's count to the store, and (process 0) the others' read, or
    (the others) process 0's asked for. False once a lost process has ended this one."""
    now = time.monotonic()
    if now - self._beat_at < BEAT_S:
      return True
    if now - self._beat_at > ANSWER_S / 2:  # this thread stood still: nobody is to blame
      self._heard = {r: (count, max(heard, now)) for r, (count, heard) in self._heard.items()}
    self._beat_at = now
    self._beats += 1
    beat = (f'{self._key}/beat/{self.rank}', str(self._beats), True)
    if self.rank != 0:
      try:
        # Answered at once while process 0's service is up; only then the beat, which has no
        # deadline of its own (a service cut off by the network would hold it).
        self._client.blocking_key_value_get(f'{self._key}/beat/0', _POLL_MS)
        self._heard[0] = (None, now)
        self._client.key_value_set(*beat)
      except Exception as e:  # noqa: BLE001
        if not _timed_out(e):
          raise
      if now - self._heard[0][1] > ANSWER_S and not self._closed.is_set():
        self._service_lost()
        return False
      return True
    self._client.key_value_set(*beat)
    counts = dict(self._client.key_value_dir_get(f'{self._key}/beat/'))
    closed = {
      k.rsplit('/', 1)[1] for k, _ in self._client.key_value_dir_get(f'{self._key}/closed/')
    }
    for rank in range(self.count):
      count = counts.get(f'{self._key}/beat/{rank}')
      if count is not None and count != self._heard[rank][0]:
        self._heard[rank] = (count, now)
    gone = [
      r
      for r, (_, heard) in self._heard.items()
      if r != 0 and str(r) not in closed and now - heard > ANSWER_S
    ]
    if gone and not self._closed.is_set():
      self._post(self._next, _GONE + ','.join(map(str, gone)))
    return True

  def _round(self, notice: str) -> None:
    with self._lock:
      with self._notice_lock:
        round_, answer = self._next, f'{self._last} {self.local_signal}'
        self._next += 1
      key = f'{self._key}/{round_}'
      try:
        self._client.key_value_set(f'{key}/at/{self.rank}', answer)
        try:
          self._client.wait_at_barrier(f'{key}/answered', ANSWER_S * 1000)
        except Exception as e:  # noqa: BLE001  who did not answer: below
          if not _timed_out(e):
            raise
        answers = dict(self._client.key_value_dir_get(f'{key}/at/'))
        closed = {
          k.rsplit('/', 1)[1] for k, _ in self._client.key_value_dir_get(f'{self._key}/closed/')
        }
      except Exception:  # noqa: BLE001  the coordination service is unreachable
        if not self._closed.is_set():
          self._service_lost()
        return
      steps = {int(k.rsplit('/', 1)[1]): [int(x) for x in v.split()] for k, v in answers.items()}
      missing = [r for r in range(self.count) if r not in steps and str(r) not in closed]
      if missing and not self._closed.is_set():
        self._on_lost(missing, self._last)
        return
      signals = [s for _, s in steps.values() if s] + ([int(notice)] if notice.isdigit() else [])
      if signals and self.stop_at is None and steps:
        self.stop_at = max(last for last, _ in steps.values()) + 1
        self.signal = self.local_signal or signals[0]
    with self._rounds:
      self._done = round_ + 1
      self._rounds.notify_all()

  def _service_lost(self) -> None:
    """The coordination service, which process 0 runs, no longer answers: process 0 is gone
    (a run that ends normally keeps it until every process has closed its agreement:
    `jax.distributed.shutdown` waits for all of them)."""
    if not self._closed.is_set() and self.rank != 0:
      self._on_lost([0], self._last)
