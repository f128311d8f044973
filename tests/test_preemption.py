"""A run of two processes (jax.distributed on 127.0.0.1, CPU, gloo) stopped by a signal to one
of them, or by the death of one: what each process does, and the resumed result.

Each run is `python -m vit_jax.main` twice, one process per rank, as SLURM or a TPU pod starts
it; the reference is the same run in one process with two devices (bitwise the same steps).
"""

import json
import os
import signal
import socket
import subprocess
import time

from conftest import MAIN
from conftest import assert_bitwise_equal
from conftest import final_params
from conftest import said
from conftest import start_ranks
from conftest import subprocess_env
from conftest import tiny_run_flags
import pytest

# Progress every 2 steps (so that a step between two lines is not a boundary of any hook), no
# periodic checkpoint: the only checkpoint of a stopped run is the one its stop writes.
FLAGS = tiny_run_flags(progress_every=2, checkpoint_every=1000)


def main_command(workdir, *extra):
  return [*MAIN, f'--workdir={workdir}', *FLAGS, *extra]


def start_two(workdir, logs, workdirs=None):
  """The two processes of one run, each writing its stdout and stderr to `logs`/rank{i}.*
  (`workdirs`: one for each, as if each node had a disk of its own)."""
  argv = lambda i: [f'--workdir={workdirs[i] if workdirs else workdir}', *FLAGS]  # noqa: E731
  return start_ranks(argv, logs=logs)


def wait_all(processes, timeout):
  deadline = time.time() + timeout
  for p in processes:
    try:
      p.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
      for q in processes:
        q.kill()
      raise
  return [p.returncode for p in processes]


def read(path):
  with open(path, encoding='utf-8', errors='replace') as f:
    return f.read()


def logged_steps(workdir):
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return []
  lines = [json.loads(line) for line in read(path).splitlines() if line.strip()]
  return [line['step'] for line in lines if 'train_loss' in line]


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """The uninterrupted run, one process with two devices."""
  workdir = str(tmp_path_factory.mktemp('reference'))
  result = subprocess.run(
    main_command(workdir), env=subprocess_env(devices=2), capture_output=True, text=True,
    timeout=600,
  )  # fmt: skip
  assert result.returncode == 0, result.stderr[-3000:]
  return final_params(workdir)


def stop_by_sigterm(workdir, logs, rank, after_step):
  """Starts the run's two processes, sends SIGTERM to `rank` once a step from `after_step` on
  is logged, and checks that both stop after the same step within 2 of it, with one line each
  and a checkpoint there; returns that step."""
  processes = start_two(workdir, logs)
  wait_for_step(workdir, after_step, processes, logs)
  # Both paused, so that the step the signal arrives at is known: the last one logged, or the
  # one after it (progress lines come every 2 steps).
  for p in processes:
    p.send_signal(signal.SIGSTOP)
  last = logged_steps(workdir)[-1]
  processes[rank].send_signal(signal.SIGTERM)
  for p in processes:
    p.send_signal(signal.SIGCONT)
  codes = wait_all(processes, timeout=120)
  errors = [said(read(os.path.join(logs, f'rank{i}.err'))) for i in range(2)]
  assert codes == [143, 143], errors
  saved = max(int(s) for s in os.listdir(os.path.join(workdir, 'checkpoints')))
  assert last < saved <= last + 3, (last, saved)  # within 2 steps of the signal
  for lines in errors:
    assert lines == [
      f'error: preempted (SIGTERM) at step {saved}; checkpoint written to {workdir}; run the '
      'same command again to resume'
    ]
  assert not os.path.exists(os.path.join(workdir, 'params.npz'))
  return saved


@pytest.mark.slow
def test_sigterm_to_either_rank_stops_both_at_the_next_step_and_resumes_bitwise(
  reference, tmp_path
):
  """SIGTERM to process 0, then (resumed) to process 1: both processes stop after the same
  next step each time, and the run, resumed at last in one process with both devices (a run
  may resume on another number of hosts), ends with bitwise the parameters of one
  uninterrupted run."""
  workdir = str(tmp_path / 'run')
  first = stop_by_sigterm(workdir, str(tmp_path / 'logs0'), rank=0, after_step=6)
  second = stop_by_sigterm(workdir, str(tmp_path / 'logs1'), rank=1, after_step=first + 2)
  assert f'Resuming from the checkpoint at step {first}' in read(
    str(tmp_path / 'logs1' / 'rank0.out')
  )
  result = subprocess.run(
    main_command(workdir), env=subprocess_env(devices=2), capture_output=True, text=True,
    timeout=300,
  )  # fmt: skip
  assert result.returncode == 0, result.stderr[-3000:]
  assert f'Resuming from the checkpoint at step {second}' in result.stdout
  assert_bitwise_equal(final_params(workdir), reference)


def wait_for_step(workdir, step, processes, logs):
  deadline = time.time() + 300
  while not [s for s in logged_steps(workdir) if s >= step]:
    assert time.time() < deadline and all(p.poll() is None for p in processes), read(
      os.path.join(logs, 'rank0.err')
    )[-3000:]
    time.sleep(0.02)


@pytest.mark.slow
def test_a_killed_rank_ends_the_other_within_seconds_with_one_line(tmp_path):
  """`kill -9` of process 1: process 0 names it in one line and ends, well within a minute,
  with the exit status of a preemption (a job script requeues on it)."""
  workdir, logs = str(tmp_path / 'run'), str(tmp_path / 'logs')
  processes = start_two(workdir, logs)
  wait_for_step(workdir, 6, processes, logs)
  for p in processes:
    p.send_signal(signal.SIGSTOP)
  last = logged_steps(workdir)[-1]
  processes[1].kill()
  processes[0].send_signal(signal.SIGCONT)
  killed = time.time()
  assert wait_all(processes, timeout=60) == [143, -signal.SIGKILL]
  seconds = time.time() - killed
  (line,) = said(read(os.path.join(logs, 'rank0.err')))
  step = int(line.split(' after step ')[1].split()[0])
  assert last <= step <= last + 2
  assert line == (
    f'error: process 1 of 2 on {socket.gethostname().split(".")[0]} stopped answering after '
    f'step {step} (killed, crashed, or its '
    'machine lost; its own log says why); process 0 cannot go on without it and stopped. Run '
    'the same command again (under SLURM: the job requeues itself, or resubmit it) to resume '
    'from the start'
  )
  assert seconds < 30, seconds  # 10 s for process 1 to answer, then out
  assert not os.path.exists(os.path.join(workdir, 'lock.json'))  # released on the way out


@pytest.mark.slow
def test_a_workdir_the_processes_do_not_share_is_one_line_on_each(tmp_path):
  """Each process on a disk of its own (here: a folder each): process 1 cannot see the lock
  that process 0 took, and both stop before any work, in one line."""
  workdirs = [str(tmp_path / 'node0' / 'run'), str(tmp_path / 'node1' / 'run')]
  logs = str(tmp_path / 'logs')
  processes = start_two(None, logs, workdirs=workdirs)
  assert wait_all(processes, timeout=300) == [2, 2]
  for i in range(2):
    assert said(read(os.path.join(logs, f'rank{i}.err'))) == [
      f'error: {workdirs[i]} is not shared between the processes of this run: process 1 cannot '
      'see the lock.json that process 0 wrote there. Put the workdir on a filesystem that every '
      'node mounts (or gs://BUCKET/PATH), or run all processes on one node'
    ]
  assert not os.path.exists(os.path.join(workdirs[0], 'checkpoints'))  # before any work
  assert not os.path.exists(os.path.join(workdirs[0], 'lock.json'))  # released


def test_the_docs_quote_the_measured_cost_of_the_stop_check():
  """docs/training.md's figures are `benchmarks/stop_check.py`'s record, as it names it."""
  from conftest import ROOT

  name = '20261127T2002_stop_check.json'
  record = json.loads((ROOT / 'benchmarks' / name).read_text())
  docs = ' '.join((ROOT / 'docs' / 'training.md').read_text().split())
  due = record['due_seconds_per_call']
  share = f'{record["share_of_a_step"]:.1e}'.replace('e-0', 'e-')
  quoted = (
    f'asking costs the loop {due["one_process_s"] * 1e6:.2f} µs a step in one process and at '
    f'most {max(due["two_processes_s"]) * 1e6:.1f} µs, a lock and a comparison, in each of two, '
    f'{share} of a '
    f'{record["testing_model_two_processes"]["step_s"] * 1e3:.0f} ms step of the `testing` '
    f'model: `python benchmarks/stop_check.py`, `benchmarks/{name}`'
  )
  assert quoted in docs
  assert record['share_of_a_step'] < 1e-3  # no measurable step time
