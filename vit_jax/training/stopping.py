"""Stopping a run: SIGTERM (preemption) and Ctrl-C, one policy with one owner (`Stop`).

`loop.train_and_evaluate` makes one `Stop` per run; the loop asks it after
every step (`pending`, `reached`) and writes a checkpoint before it stops,
and its hooks and set-up run in its `held` blocks where a stop at once
would leave something half done. A stop ends in `Stopped`: one line, and
the exit status a shell gives a process that signal ended.
"""

import contextlib
import os
import signal
import sys
import threading
from typing import NoReturn, Optional

import jax
from jax.experimental import multihost_utils

from vit_jax import workdir as workdir_lib
from vit_jax.core import cli
from vit_jax.core.errors import UserError


class Stopped(UserError, RuntimeError):
  """A run stopped by SIGTERM or Ctrl-C (`Stop`); one line, and the exit status a shell gives
  a process that signal ended (`exit_status`: 130 for Ctrl-C, 143 for SIGTERM)."""

  def __init__(self, line: str, signum: int):
    super().__init__(line)
    self.exit_status = cli.signal_status(signum)


class StopNow(BaseException):
  """What a signal raises where it stops a run at once: a BaseException, as KeyboardInterrupt,
  so that no `except Exception` on the way (a checkpoint that did not restore) takes it for a
  failure of its own; `loop.train_and_evaluate` turns it into `Stopped`."""


class Stop:
  """SIGTERM (preemption) and Ctrl-C: a checkpoint at the next step boundary, then one line.

  One process: the signal sets `requested`, which the loop reads after every
  step. Where a checkpoint would hold nothing new -- before this session's
  first step (set-up, compilation) and after the last (final evaluation) --
  it stops the run at once instead (`Stopped`, one line; the workdir's lock is
  released on the way out; a raise that Python swallows, in a garbage-collector
  callback say, is raised again at the next `check`). While the run takes the
  lock and while it writes its last checkpoint, a signal waits for them
  (`held`). A second signal ends the process there and then, with the same
  line and the lock released (`_exit_now`). Several processes: JAX's
  coordination service catches SIGTERM, and every process asks
  `reached_preemption_sync_point` at the same (boundary) steps, so all agree
  on the step to stop at; Ctrl-C is Python's there (`vit_jax.core.cli.run`: one
  line).
  """

  _WHAT = {signal.SIGTERM: 'preempted (SIGTERM)', signal.SIGINT: 'interrupted (Ctrl-C)'}

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.requested = None  # the signal that asked for a checkpoint and a stop
    self.stepping = False  # between this session's first and last step: worth a checkpoint
    self.now = ''  # the line of a stop at once, once a signal asked for one
    self.signum = signal.SIGTERM  # the signal that stops the run (its exit status)
    self.lock: Optional[workdir_lib.Lock] = None  # released by a stop at once
    self._single = jax.process_count() == 1
    self._previous = {}
    self._unraisable = None
    self._held = None  # the signals that arrived inside `held`, while it lasts
    if self._single and threading.current_thread() is threading.main_thread():
      self._previous = {sig: signal.signal(sig, self._handle) for sig in self._WHAT}
      self._unraisable = sys.unraisablehook
      sys.unraisablehook = self._drop_stops

  def _handle(self, signum, frame):
    del frame
    self.signum = signum
    if self._held is not None:
      self._held.append(signum)
      if len(self._held) == 1:
        return
      self._exit_now(self._stopped_line(signum, again=True))  # a second does not wait
    if self.stepping and self.requested is None:
      self.requested = signum
      return
    again = self.requested is not None
    self.now = self._stopped_line(signum, again=again)
    if again:
      self._exit_now(self.now)
    raise StopNow(self.now)

  def _stopped_line(self, signum, again: bool) -> str:
    saved = workdir_lib.saved_steps(self.workdir)
    kept = f'the checkpoint at step {saved[-1]} is kept' if saved else 'no checkpoint yet'
    return (
      f'{self._WHAT[signum]}{" again" if again else ""}: stopped at once, without a new '
      f'checkpoint ({kept}); run the same command again to resume'
    )

  def _exit_now(self, line: str) -> NoReturn:
    """The second signal: out at once. An exception raised here would land in whatever runs,
    typically orbax waiting for its writer threads, which logs it, or waits on them at exit;
    the half-written checkpoint is a temporary folder that the next run removes."""
    if self.lock is not None:
      self.lock.release()
    sys.stdout.flush()
    print(f'error: {line}', file=sys.stderr, flush=True)
    os._exit(cli.signal_status(self.signum))

  @contextlib.contextmanager
  def held(self):
    """Signals wait until the block is done, then act as if they arrived then."""
    self._held = []
    try:
      yield
    finally:
      held, self._held = self._held, None
    for signum in held:
      self._handle(signum, None)

  def check(self) -> None:
    """Raises a stop at once that a signal asked for, if its own raise was swallowed."""
    if self.now:
      raise StopNow(self.now)

  def _drop_stops(self, unraisable) -> None:
    if not isinstance(unraisable.exc_value, StopNow):  # the next `check` raises it
      self._unraisable(unraisable)

  @property
  def pending(self) -> bool:
    """A stop is due now (single process only; hosts agree at boundaries)."""
    return self._single and self.requested is not None

  def reached(self, step: int) -> bool:
    if self._single:
      return self.requested is not None
    try:
      return multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError:  # no preemption service on this platform
      return False

  def stopped_line(self, step: int) -> str:
    what = self._WHAT.get(self.requested, self._WHAT[signal.SIGTERM])
    return (
      f'{what} at step {step}; checkpoint written to {self.workdir}; run the same command '
      'again to resume'
    )

  def restore(self):
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    if self._unraisable is not None and sys.unraisablehook == self._drop_stops:
      sys.unraisablehook = self._unraisable
