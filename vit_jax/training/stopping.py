"""Stopping a run: SIGTERM (preemption) and Ctrl-C, one policy with one owner (`Stop`).

`loop.train_and_evaluate` makes one `Stop` per run; the loop asks it after
every step (`due`) and writes a checkpoint before it stops, and its hooks and
set-up run in its `held` blocks where a stop at once would leave something
half done. A stop ends in `Stopped`: one line, and the exit status a shell
gives a process that signal ended. In a run of several processes they agree
on the step (`training.agreement`), whichever of them the signal reached.
"""

import contextlib
import os
import signal
import sys
import threading
from typing import NoReturn, Optional

import jax

from vit_jax import workdir as workdir_lib
from vit_jax.core import cli
from vit_jax.core import coordinator
from vit_jax.core.errors import UserError
from vit_jax.training import agreement as agreement_lib

# The exit status of a process that stops because another one of its run is gone: what a
# shell reports for a process that SIGTERM ended, as for a preemption (the job scripts of
# `launch/` requeue on it): the run resumes from its last checkpoint once all are back.
EXIT_PEER_LOST = cli.signal_status(signal.SIGTERM)


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

  The signal sets `requested`, and the loop asks `due` after every step.
  Where a checkpoint would hold nothing new -- before this session's first
  step (set-up, compilation) and after the last (final evaluation) -- one
  process stops at once instead (`Stopped`, one line; the workdir's lock is
  released on the way out; a raise that Python swallows, in a garbage-collector
  callback say, is raised again at the next `check`). While the run takes the
  lock and while it writes its last checkpoint, a signal waits for them
  (`held`). A second signal ends the process there and then, with the same
  line and the lock released (`_exit_now`).

  Several processes: the signal's number also goes, from Python's C-level
  handler through a pipe (`signal.set_wakeup_fd`) and a thread, to the others
  at once, even while this process's loop waits in a collective; all stop after
  the step they agree on (`agreement.Agreement`). A first signal before the
  first step stops them after it (a process alone cannot stop at once: the
  others would wait for it), and one after the last step lets the run finish.
  A process that stops answering ends the others with one line naming it
  (`_peer_lost`).
  """

  _WHAT = {signal.SIGTERM: 'preempted (SIGTERM)', signal.SIGINT: 'interrupted (Ctrl-C)'}

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.requested = None  # the signal that asked for a checkpoint and a stop
    self.stepping = False  # between this session's first and last step: worth a checkpoint
    self.now = ''  # the line of a stop at once, once a signal asked for one
    self.signum = signal.SIGTERM  # the signal that stops the run (its exit status)
    self.lock: Optional[workdir_lib.Lock] = None  # released by a stop at once
    self.stopped = False  # stopped after its checkpoint: the process is on its way out
    self._single = jax.process_count() == 1
    self._previous = {}
    self._unraisable = None
    self._held = None  # the signals that arrived inside `held`, while it lasts
    self._wakeup = None  # (previous wakeup fd, our pipe's ends, its reader thread)
    coordination = None if self._single else agreement_lib.client()
    self.agreement = (
      agreement_lib.Agreement(coordination, self._peer_lost) if coordination else None
    )
    if threading.current_thread() is threading.main_thread():
      self._previous = {sig: signal.signal(sig, self._handle) for sig in self._WHAT}
      self._unraisable = sys.unraisablehook
      sys.unraisablehook = self._drop_stops
      if self.agreement is not None:
        self._relay_signals()

  def _relay_signals(self) -> None:
    """Signal numbers to the agreement as they arrive, not when the main thread next runs
    Python (it may be waiting for a collective that the others cannot finish)."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def relay():
      while True:
        received = os.read(read, 16)
        if not received or 0 in received:  # `restore` writes 0
          return
        for signum in received:
          if signum in self._WHAT:
            self.agreement.notify(signum)

    thread = threading.Thread(target=relay, name='vit_jax-signals', daemon=True)
    thread.start()
    self._wakeup = (previous, read, write, thread)

  def _handle(self, signum, frame):
    del frame
    self.signum = signum
    if self._held is not None:
      self._held.append(signum)
      if len(self._held) == 1:
        return
      self._exit_now(self._stopped_line(signum, again=True))  # a second does not wait
    if self.requested is None and (self.stepping or self.agreement is not None):
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

  def _exit_now(self, line: str, status: Optional[int] = None) -> NoReturn:
    """The second signal: out at once. An exception raised here would land in whatever runs,
    typically orbax waiting for its writer threads, which logs it, or waits on them at exit;
    the half-written checkpoint is a temporary folder that the next run removes."""
    if self.lock is not None:
      self.lock.release()
    sys.stdout.flush()
    print(f'error: {line}', file=sys.stderr, flush=True)
    os._exit(status or cli.signal_status(self.signum))

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
    """A stop is asked for (one process: it is due after the current step)."""
    return self.requested is not None

  def due(self, step: int) -> bool:
    """Whether the run stops after `step`, which the loop has just passed (asked every step:
    one attribute read alone, a lock and a comparison with other processes)."""
    if self.agreement is not None:
      return self.agreement.due(step)
    return self.requested is not None

  def roll_call(self) -> None:
    """After an error in a run of several processes: ends this one with one line if another
    is gone (the error was only the sign of it); returns if all are there."""
    if self.agreement is not None:
      self.agreement.roll_call()

  def _peer_lost(self, missing: list, last_step: int) -> NoReturn:
    """Processes of this run stopped answering: this one cannot go on without them."""
    count = jax.process_count()
    who = ', '.join(str(r) for r in missing[:8]) + (' ...' if len(missing) > 8 else '')
    processes = f'process{"es" if len(missing) > 1 else ""} {who} of {count}'
    nodes = coordinator.nodes_of(agreement_lib.client(), missing[:8])
    processes += f' on {", ".join(nodes)}' if nodes else ''
    saved = workdir_lib.saved_steps(self.workdir)
    kept = f'from the checkpoint at step {saved[-1]}' if saved else 'from the start'
    after = f' after step {last_step}' if last_step >= 0 else ' before the first step'
    self.signum = signal.SIGTERM
    self._exit_now(
      f'{processes} stopped answering{after} (killed, crashed, or its machine lost; its own '
      f'log says why); process {jax.process_index()} cannot go on without it and stopped. '
      f'Run the same command again (under SLURM: the job requeues itself, or resubmit it) '
      f'to resume {kept}',
      status=EXIT_PEER_LOST,
    )

  def stopping_signal(self) -> int:
    """The signal that stopped the run: this process's own, else the one the others got."""
    if self.requested is not None:
      return self.requested
    if self.agreement is not None and self.agreement.signal in self._WHAT:
      return self.agreement.signal
    return signal.SIGTERM

  def stopped_line(self, step: int) -> str:
    what = self._WHAT[self.stopping_signal()]
    return (
      f'{what} at step {step}; checkpoint written to {self.workdir}; run the same command '
      'again to resume'
    )

  def restore(self):
    """This run's signal handling undone: the previous handlers back, or, once the run has
    stopped with its checkpoint (`stopped`), signals ignored while the process exits with its
    line (SLURM's `srun --kill-on-bad-exit` sends the other processes SIGTERM then)."""
    if self.agreement is not None:
      self.agreement.close()
    if self._wakeup is not None:
      previous, read, write, thread = self._wakeup
      signal.set_wakeup_fd(previous)
      os.write(write, b'\0')
      thread.join(timeout=1)
      os.close(read)
      os.close(write)
      self._wakeup = None
    for sig, previous in self._previous.items():
      signal.signal(sig, signal.SIG_IGN if self.stopped else previous)
    if self._unraisable is not None and sys.unraisablehook == self._drop_stops:
      sys.unraisablehook = self._unraisable
