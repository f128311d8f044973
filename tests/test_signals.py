"""Signals: Ctrl-C and SIGTERM stop a run with a checkpoint where one holds something new, a
second signal stops at once, a command exits as a shell expects (130, 143, 141 for a reader
that went away), each with one line."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

from conftest import MAIN
from conftest import STOPPABLE_RUN
from conftest import run_command
from conftest import said
from conftest import subprocess_env
from conftest import wait_for_child
import pytest

from vit_jax.core import cli
from vit_jax.evaluation import classify


def test_signals_ask_for_a_checkpoint_only_where_one_holds_something_new(tmp_path):
  """The policy (`training.stopping.Stop`), signal by signal in this process: before the first
  step a signal stops at once (inside `held`, once the block is done); while stepping the first
  asks for a checkpoint at the next step and a second ends the process at once; a stop whose
  raise Python swallowed (a garbage collector callback) is raised again at the next check."""
  import threading

  from vit_jax.training import stopping

  if threading.current_thread() is not threading.main_thread():
    pytest.skip('signal handlers run in the main thread only')
  previous = signal.getsignal(signal.SIGINT)
  stop = stopping.Stop(str(tmp_path))
  try:
    # Inside `held` (taking the workdir's lock) a signal waits for the block's end.
    reached = []
    with pytest.raises(stopping.StopNow, match=r'^preempted \(SIGTERM\): stopped at once'):
      with stop.held():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        reached.append('the end of the block')
    assert reached == ['the end of the block']
    stop.now = ''
    with pytest.raises(
      stopping.StopNow, match=r'^preempted \(SIGTERM\): stopped at once, without a'
    ):
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(5)
    with pytest.raises(stopping.StopNow, match=r'^preempted \(SIGTERM\): stopped at once'):
      stop.check()  # had the raise been lost
    stop.now = ''
    stop.stepping = True
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.1)
    assert stop.requested == signal.SIGINT and stop.pending and not stop.now
    assert stop.stopped_line(7).startswith('interrupted (Ctrl-C) at step 7; checkpoint written')
    exits = []  # the second signal ends the process (os._exit): here, it is only counted
    stop._exit_now = exits.append
    with pytest.raises(stopping.StopNow, match=r'^interrupted \(Ctrl-C\) again: stopped at once'):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(5)
    assert exits == [stop.now]
    # Inside `held`, a second signal does not wait for the block either.
    stop.now, stop.stepping, stop.requested = '', False, None
    with pytest.raises(stopping.StopNow, match=r'^preempted \(SIGTERM\): stopped at once'):
      with stop.held():  # (the counting `_exit_now` returns, and the handler raises)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
    assert exits[1].startswith('preempted (SIGTERM) again: stopped at once, without a new')
  finally:
    stop.restore()
  assert signal.getsignal(signal.SIGINT) is previous


def test_a_signal_while_the_last_checkpoint_is_written_waits_for_it(tmp_path):
  """Ctrl-C after the last step, as orbax writes the final checkpoint, does not cut the write
  short (no temporary folder left, no traceback, the run's last steps kept): the write ends, then
  the run stops in one line that names the checkpoint kept."""
  import threading
  import types

  from vit_jax.training import loop
  from vit_jax.training import stopping

  if threading.current_thread() is not threading.main_thread():
    pytest.skip('signal handlers run in the main thread only')

  class Manager:  # orbax's, as far as `train` uses it after the last step
    def wait_until_finished(self):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.2)
      os.makedirs(tmp_path / 'checkpoints' / '30')
      written.append(30)

  written = []
  run = types.SimpleNamespace(
    workdir=str(tmp_path), manager=Manager(), config=types.SimpleNamespace(total_steps=30)
  )
  steps_done = types.SimpleNamespace(state=types.SimpleNamespace(step=30))
  stop = stopping.Stop(str(tmp_path))
  try:
    with pytest.raises(stopping.StopNow) as stopped:
      loop.train(run, steps_done, [], stop)
  finally:
    stop.restore()
  assert written == [30]
  assert str(stopped.value) == (
    'interrupted (Ctrl-C): stopped at once, without a new checkpoint (the checkpoint at step 30 '
    'is kept); run the same command again to resume'
  )


@pytest.mark.slow
def test_a_second_ctrl_c_or_a_signal_during_set_up_stops_at_once(tmp_path):
  """As a user meets it: the second Ctrl-C does not wait for the checkpoint; SIGTERM while the
  run sets up (compiles) has nothing to save. Both: one line, the lock released."""
  command = [*MAIN, *STOPPABLE_RUN]
  cases = [
    ('second', signal.SIGINT, 'metrics.jsonl', 'interrupted (Ctrl-C) again'),
    ('set-up', signal.SIGTERM, 'lock.json', 'preempted (SIGTERM)'),
  ]

  def case(name, sig, wait_for):
    run = str(tmp_path / name)
    process = subprocess.Popen(
      [*command, f'--workdir={run}'], env=subprocess_env(), stderr=subprocess.PIPE, text=True
    )
    path = os.path.join(run, wait_for)
    wait_for_child(lambda: os.path.exists(path) and os.path.getsize(path) > 0, process)
    process.send_signal(sig)
    if name == 'second':  # again once the checkpoint the first asked for is being written
      writing = lambda: any('tmp' in n for n in os.listdir(os.path.join(run, 'checkpoints')))  # noqa: E731
      wait_for_child(lambda: writing() or process.poll() is not None, process, check=False)
      process.send_signal(sig)
    stderr = process.communicate(timeout=300)[1]
    return process.returncode, stderr, run

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results = list(pool.map(lambda c: case(*c[:3]), cases))
  for (code, stderr, run), (name, sig, _, what) in zip(results, cases):
    lines = said(stderr)
    if name == 'second' and 'interrupted (Ctrl-C) at step' in stderr:
      pytest.skip('the checkpoint was written before the second Ctrl-C')  # a very fast machine
    assert code == 128 + sig and lines == [lines[-1]], stderr[-3000:]
    assert lines[-1].startswith(f'error: {what}: stopped at once, without a new checkpoint (')
    assert lines[-1].endswith('); run the same command again to resume')
    assert not os.path.exists(os.path.join(run, 'lock.json'))


def test_a_run_a_signal_stopped_exits_as_shells_expect(capsys):
  """A training run stopped by Ctrl-C exits 130 (128 + SIGINT), and 143 for SIGTERM, as a shell
  reports a process the signal ended, not 2 as a bad input."""
  from vit_jax.training import stopping

  for sig, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
    with pytest.raises(SystemExit) as e:
      with cli.reported():
        raise stopping.Stopped('interrupted (Ctrl-C) at step 7; checkpoint written to run', sig)
    assert e.value.code == status
  assert capsys.readouterr().err.count('error: interrupted (Ctrl-C) at step 7;') == 2


def test_ctrl_c_in_a_command_is_one_line(user_files, monkeypatch, capsys):
  """Ctrl-C outside training: nothing to save; one line and exit status 130."""
  from vit_jax import predict

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(classify, 'predict', interrupted)
  argv = [f'--checkpoint={user_files["npz"]}', '--model=testing', str(user_files['png'])]
  assert run_command(predict.main, argv, capsys)[::2] == (130, 'error: interrupted (Ctrl-C)\n')


def test_a_reader_that_goes_away_ends_a_command_quietly(tmp_path):
  """`python -m vit_jax.predict ... | head -1`: the command stops without a BrokenPipeError
  traceback, with a shell's exit status for it (141), as `cat` would."""
  command = (
    'import sys\n'
    'from vit_jax.core import cli\n'
    'def main():\n'
    '  for i in range(10**6):\n'
    "    print(f'image_{i}.png: class {i % 10}')\n"
    'sys.exit(cli.run(main))\n'
  )
  script = tmp_path / 'lines.py'
  script.write_text(command)
  result = subprocess.run(
    ['bash', '-c', f'set -o pipefail; {sys.executable} {script} | head -1'],
    capture_output=True,
    text=True,
    env=subprocess_env(),
    timeout=120,
  )
  assert result.stdout == 'image_0.png: class 0\n'
  assert result.returncode == 141 and said(result.stderr) == [], result.stderr[-3000:]
