"""A real SLURM cluster of one node on this machine (Debian's slurmctld, slurmd and munge),
driven as a user drives one: `launch/slurm.py` writes and submits the job (2 tasks of the
testing model on CPU), and `sbatch`, `srun`, `scancel` and `scontrol` act on it.

The cluster is started once for the module, by PID, from a slurm.conf without cgroups
(`proctrack/linuxproc`, `task/none`: the cgroup plugins need a cgroup namespace that a
container may not have), and stopped at its end. It needs the binaries (`apt-get install
slurmctld slurmd slurm-client munge`, which `.ci/run` does) and root (the daemons run as
root here); without them the tests skip, saying which is missing.
"""

import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time

from conftest import ROOT
from conftest import said
from conftest import subprocess_env
from conftest import tiny_run_flags
import numpy as np
import pytest

from vit_jax import checkpoint

pytestmark = pytest.mark.slow

DAEMONS = ('munged', 'slurmctld', 'slurmd')
CLIENTS = ('sbatch', 'srun', 'scancel', 'scontrol', 'sinfo')
# Progress every 2 steps (a step between two lines is no hook's boundary), and no periodic
# checkpoint: the checkpoints of an interrupted run are the ones its stops write.
FLAGS = tiny_run_flags(progress_every=2, checkpoint_every=1000)


def _missing() -> str:
  """Why the cluster cannot start here ('' when it can)."""
  absent = [
    name
    for name in DAEMONS + CLIENTS
    if not shutil.which(name, path=f'/usr/sbin:/sbin:{os.environ["PATH"]}')
  ]
  if absent:
    return (
      f'no {", ".join(absent)}: apt-get install slurmctld slurmd slurm-client munge (as .ci/run '
      'does)'
    )
  if os.geteuid() != 0:
    return 'the SLURM daemons of the test cluster run as root; run the tests as root (as CI does)'
  host = socket.gethostname().split('.')[0]
  try:
    socket.gethostbyname(host)  # JAX's coordinator under SLURM is the first node, by name
  except OSError:
    return f"this machine's name {host} does not resolve; add it to /etc/hosts"
  return ''


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


class Cluster:
  """One node, one partition; its daemons started by PID and stopped by PID."""

  def __init__(self, root):
    self.root = root
    self.host = socket.gethostname().split('.')[0]
    self.processes = []
    self.conf = os.path.join(root, 'slurm.conf')
    self.env = {**os.environ, 'SLURM_CONF': self.conf}
    self.env['PATH'] = f'/usr/sbin:/sbin:{self.env["PATH"]}'

  def start(self):
    root = self.root
    for folder in ('munge', 'state', 'spool', 'log'):
      os.makedirs(os.path.join(root, folder), exist_ok=True)
    os.chmod(os.path.join(root, 'munge'), 0o755)
    key = os.path.join(root, 'munge', 'munge.key')
    with open(key, 'wb') as f:
      f.write(secrets.token_bytes(128))
    os.chmod(key, 0o600)
    socket_path = os.path.join(root, 'munge', 'socket')
    self._start(
      ['munged', '--foreground', '--force', f'--key-file={key}', f'--socket={socket_path}',
       f'--pid-file={root}/munge/pid', f'--seed-file={root}/munge/seed',
       f'--log-file={root}/log/munged.log'],
      'munged',
    )  # fmt: skip
    self._wait(lambda: os.path.exists(socket_path), 'munged')
    with open(self.conf, 'w') as f:
      f.write(self._config(socket_path))
    self._start(['slurmctld', '-D', '-f', self.conf], 'slurmctld')
    self._start(['slurmd', '-D', '-f', self.conf], 'slurmd')
    self._wait(lambda: self.run('sinfo', '-h', '-o', '%T').stdout.strip() == 'idle', 'the node')

  def _config(self, munge_socket) -> str:
    root = self.root
    return '\n'.join(
      [
        'ClusterName=vitjaxtest',
        f'SlurmctldHost={self.host}(127.0.0.1)',
        # A requeued job waits cred_expire seconds (120 by default) before it starts again.
        f'AuthInfo=socket={munge_socket},cred_expire=5',
        'AuthType=auth/munge',
        'CredType=cred/munge',
        'SlurmUser=root',
        'SlurmdUser=root',
        f'SlurmctldPort={_free_port()}',
        f'SlurmdPort={_free_port()}',
        f'StateSaveLocation={root}/state',
        f'SlurmdSpoolDir={root}/spool',
        f'SlurmctldPidFile={root}/slurmctld.pid',
        f'SlurmdPidFile={root}/slurmd.pid',
        f'SlurmctldLogFile={root}/log/slurmctld.log',
        f'SlurmdLogFile={root}/log/slurmd.log',
        # No cgroups (see the module's docstring).
        'ProctrackType=proctrack/linuxproc',
        'TaskPlugin=task/none',
        'JobAcctGatherType=jobacct_gather/none',
        'AccountingStorageType=accounting_storage/none',
        'MpiDefault=none',
        'SchedulerType=sched/builtin',
        'SchedulerParameters=sched_interval=1',  # a requeued job starts as soon as it may
        'SelectType=select/cons_tres',
        'SelectTypeParameters=CR_CPU',
        'ReturnToService=2',
        'KillWait=30',
        # slurmd answers slowly on a busy machine; a signal whose delivery timed out is sent
        # again later, into the job's next attempt (its steps keep their ids across requeues).
        'MessageTimeout=60',
        'SlurmctldDebug=debug',  # (the logs are in the cluster's folder, for a failure)
        # JAX's coordinator port under SLURM is derived from the job id: ids of their own keep
        # two clusters on one machine (two test sessions) from choosing the same ports.
        f'FirstJobId={random.randrange(1, 16000) * 4096 + random.randrange(4096)}',
        # More CPUs than the machine has (config_overrides): jobs are not held back by them.
        'SlurmdParameters=config_overrides',
        f'NodeName={self.host} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN',
        f'PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP',
        '',
      ]
    )

  def _start(self, command, name):
    log = open(os.path.join(self.root, 'log', f'{name}.out'), 'w')
    self.processes.append(
      subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT)
    )

  def _wait(self, ready, what, timeout=60):
    deadline = time.time() + timeout
    while not ready():
      for p in self.processes:
        if p.poll() is not None:
          raise RuntimeError(f'{p.args[0]} ended ({p.returncode}) before {what} was up')
      if time.time() > deadline:
        raise RuntimeError(f'{what} not up after {timeout} s')
      time.sleep(0.2)

  def stop(self):
    if any(p.poll() is None for p in self.processes[1:]):
      self.run('scancel', '--full', '--partition=test')
    for p in reversed(self.processes):
      if p.poll() is None:
        p.terminate()
        try:
          p.wait(timeout=15)
        except subprocess.TimeoutExpired:
          p.kill()
          p.wait()

  def run(self, *command, check=False):
    result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
    if check and result.returncode:
      raise AssertionError(f'{command}: {result.stderr}')
    return result

  def job(self, job_id) -> dict:
    """`scontrol show job`'s fields."""
    text = self.run('scontrol', 'show', 'job', '-o', str(job_id), check=True).stdout
    return dict(f.split('=', 1) for f in text.split() if '=' in f)


@pytest.fixture(scope='module')
def cluster(tmp_path_factory):
  reason = _missing()
  if reason:
    pytest.skip(reason)
  cluster = Cluster(str(tmp_path_factory.mktemp('slurm')))
  try:
    cluster.start()
    yield cluster
  finally:
    cluster.stop()


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """The uninterrupted run, one process with two devices, started at once and run beside the
  job (`reference()` waits for it and gives its parameters)."""
  workdir = str(tmp_path_factory.mktemp('reference'))
  process = subprocess.Popen(
    [sys.executable, '-m', 'vit_jax.main', f'--workdir={workdir}', *FLAGS],
    env=subprocess_env(devices=2), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
  )  # fmt: skip

  def result():
    stderr = process.communicate(timeout=600)[1]
    assert process.returncode == 0, stderr[-3000:]
    return params(workdir)

  yield result
  if process.poll() is None:
    process.kill()


def params(workdir):
  return checkpoint.flatten(checkpoint.load(os.path.join(workdir, 'params.npz')))


def assert_bitwise_equal(a, b):
  assert sorted(a) == sorted(b)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def submit(cluster, workdir, *flags) -> int:
  """`launch/slurm.py` on 2 CPU tasks of the testing model; the job's id."""
  result = subprocess.run(
    [sys.executable, str(ROOT / 'launch' / 'slurm.py'), '--gpus_per_node=0', '--tasks_per_node=2',
     '--cpus_per_gpu=1', f'--venv={sys.prefix}', f'--workdir={workdir}', '--time=10',
     '--grace_s=115', *flags, '--', *FLAGS],
    env={**subprocess_env(devices=1), 'SLURM_CONF': cluster.conf, 'PATH': cluster.env['PATH']},
    capture_output=True, text=True, timeout=60,
  )  # fmt: skip
  assert result.returncode == 0, result.stderr
  return int(result.stdout.split('Submitted batch job ')[1].split()[0])


def wait_for(predicate, what, timeout=600, every=0.2):
  deadline = time.time() + timeout
  while True:
    value = predicate()
    if value:
      return value
    assert time.time() < deadline, f'timed out waiting for {what}'
    time.sleep(every)


def log_of(workdir, job_id) -> str:
  path = os.path.join(workdir, f'slurm-{job_id}.out')
  return open(path, encoding='utf-8', errors='replace').read() if os.path.exists(path) else ''


def ended(cluster, job_id) -> bool:
  return cluster.job(job_id)['JobState'] in ('COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT')


def logged_steps(workdir):
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return []
  lines = [json.loads(line) for line in open(path) if line.strip()]
  return [line['step'] for line in lines if 'train_loss' in line]


def ranks(workdir) -> dict:
  """{rank: pid} of the processes of the job's current attempt (`vit_jax.main` on `workdir`)."""
  found = {}
  for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{pid}/cmdline', 'rb') as f:
        command = f.read().split(b'\0')
      with open(f'/proc/{pid}/environ', 'rb') as f:
        environ = dict(entry.split(b'=', 1) for entry in f.read().split(b'\0') if b'=' in entry)
    except OSError:
      continue
    if b'vit_jax.main' in command and f'--workdir={workdir}'.encode() in command:
      found[int(environ[b'SLURM_PROCID'])] = int(pid)
  return found


def freeze(workdir, after_step):
  """Waits for the current attempt of the run to log `after_step` (or later), then pauses its
  processes; returns ({rank: pid}, the last step logged): the run is at that step or the one
  after."""
  before = len(logged_steps(workdir))  # the attempts before (this one has logged nothing yet)
  wait_for(
    lambda: [s for s in logged_steps(workdir)[before:] if s >= after_step], f'step {after_step}'
  )
  pids = wait_for(lambda: (found := ranks(workdir)) and len(found) == 2 and found, 'the ranks')
  for pid in pids.values():
    os.kill(pid, signal.SIGSTOP)
  wait_for(lambda: all(state(pid) == 'T' for pid in pids.values()), 'the pause')
  return pids, logged_steps(workdir)[-1]


def state(pid) -> str:
  """The state letter of process `pid` (T: stopped), '' once it has ended."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0]
  except FileNotFoundError:
    return ''


def signalled(pid) -> bool:
  """Whether paused process `pid` has SIGTERM pending, or was let go (SLURM sends SIGCONT with
  the time limit's signal), or has ended."""
  try:
    with open(f'/proc/{pid}/status') as f:
      fields = dict(line.split(':', 1) for line in f if ':' in line)
  except FileNotFoundError:
    return True
  pending = int(fields['ShdPnd'], 16) | int(fields['SigPnd'], 16)
  return bool(pending & (1 << (signal.SIGTERM - 1))) or state(pid) != 'T'


def thaw_when_signalled(pids, timeout=120):
  """Waits until SLURM's SIGTERM reached every paused process, then lets them go on."""
  wait_for(lambda: all(signalled(pid) for pid in pids.values()), 'SIGTERM', timeout=timeout)
  for pid in pids.values():
    try:
      os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
      pass


def attempts(log) -> int:
  return log.count('=== vit_jax: job ')


def attempt_log(log, n) -> str:
  """What attempt `n` of the job wrote to its log."""
  return log.split(f'attempt {n} of at most')[1].split(f'attempt {n + 1} of at most')[0]


def saved_steps(workdir) -> list:
  return sorted(int(s) for s in os.listdir(os.path.join(workdir, 'checkpoints')))


def requeued_after(cluster, workdir, job, n) -> str:
  """Waits for attempt `n` to end and the job to start again; the log of attempt `n`."""
  wait_for(lambda: attempts(log_of(workdir, job)) > n, f'attempt {n + 1}')
  text = attempt_log(log_of(workdir, job), n)
  assert f'attempt {n} stopped (status ' in text and 'requeueing job' in text, text
  return text


def stop_step(text, last) -> int:
  """The step both ranks stopped after in an attempt's log, checked to be within 2 steps of
  the one the signal arrived at (`last` logged, or the one after)."""
  stops = [line for line in text.splitlines() if 'error: preempted (SIGTERM) at step' in line]
  assert len(stops) == 2 and {line[:3] for line in stops} == {'0: ', '1: '}, text
  steps = {int(line.split(' at step ')[1].split(';')[0]) for line in stops}
  assert len(steps) == 1, stops
  (step,) = steps
  assert last < step <= last + 3, (last, step)
  return step


def test_preempted_killed_and_out_of_time_the_job_requeues_itself_and_ends_bitwise(
  cluster, reference, tmp_path
):
  """The job `launch/slurm.py` writes and submits, through three interruptions, each in an
  attempt of its own: `scancel --signal=TERM`, `kill -9` of rank 1, and the time limit's
  grace signal; its last attempt ends the run with the parameters of one process. The run is
  paused (SIGSTOP) while each is set off, so that it is still stepping when it arrives (it
  steps fast: its time goes to starting up), and goes on (SIGCONT) once it is."""
  workdir = str(tmp_path / 'run')
  job = submit(cluster, workdir)

  # 1. scancel --signal=TERM: both ranks checkpoint after the same next step, exit 143, and
  # the job requeues itself.
  pids, last = freeze(workdir, after_step=6)
  n = attempts(log_of(workdir, job))
  cluster.run('scancel', '--signal=TERM', str(job), check=True)
  thaw_when_signalled(pids)
  text = requeued_after(cluster, workdir, job, n)
  assert f'attempt {n} stopped (status 143' in text
  assert stop_step(text, last) == saved_steps(workdir)[-1]

  # 2. kill -9 of rank 1: rank 0 ends within 60 s, with one line naming it; the job requeues.
  kept = saved_steps(workdir)[-1]
  pids, last = freeze(workdir, after_step=kept + 2)
  n = attempts(log_of(workdir, job))
  os.kill(pids[1], signal.SIGKILL)
  os.kill(pids[0], signal.SIGCONT)
  killed = time.time()
  wait_for(lambda: 0 not in ranks(workdir), 'rank 0 to end', every=0.05)
  print(f'rank 0 ended {time.time() - killed:.1f} s after rank 1 was killed')
  assert time.time() - killed < 60
  text = requeued_after(cluster, workdir, job, n)
  errors = [line for line in text.splitlines() if line.startswith(('0: error:', '1: error:'))]
  assert len(errors) == 1 and re.fullmatch(
    r'0: error: process 1 of 2 stopped answering after step (\d+) \(killed, crashed, or its '
    r'machine lost; its own log says why\); process 0 cannot go on without it and stopped\. '
    r'Run the same command again \(under SLURM: the job requeues itself, or resubmit it\) to '
    rf'resume from the checkpoint at step {kept}',
    errors[0],
  ), text
  assert last <= int(errors[0].split(' after step ')[1].split()[0]) <= last + 2
  assert saved_steps(workdir)[-1] == kept  # nothing written since

  # 3. The time limit: a run paused while its job's limit is brought near sees the grace
  # signal (--grace_s=115 s before the limit, at SLURM's next check of time limits, within 30 s),
  # checkpoints and requeues. The job then gets its 10 minutes back for the last attempt.
  pids, last = freeze(workdir, after_step=kept + 2)
  n = attempts(log_of(workdir, job))
  elapsed = time.time() - time.mktime(
    time.strptime(cluster.job(job)['StartTime'], '%Y-%m-%dT%H:%M:%S')
  )
  cluster.run(
    'scontrol', 'update', f'JobId={job}', f'TimeLimit={int(elapsed // 60) + 2}', check=True
  )
  thaw_when_signalled(pids)
  cluster.run('scontrol', 'update', f'JobId={job}', 'TimeLimit=10', check=True)
  stopped = stop_step(requeued_after(cluster, workdir, job, n), last)
  wait_for(lambda: ended(cluster, job), f'job {job}')
  log = log_of(workdir, job)
  fields = cluster.job(job)
  assert (fields['JobState'], fields['ExitCode']) == ('COMPLETED', '0:0'), log
  assert attempts(log) == n + 1, log  # the last attempt ran to the end
  last_attempt = attempt_log(log, n + 1)
  assert f'Resuming from the checkpoint at step {stopped}' in last_attempt
  # One log beside the run, each line of the processes with its rank; only process 0 reports.
  assert os.path.exists(os.path.join(workdir, 'launch.sbatch'))
  assert '0: step 24/24' in last_attempt and '\n1: step ' not in log
  assert_bitwise_equal(params(workdir), reference())


def test_a_run_started_without_srun_in_an_allocation_of_two_tasks_is_one_line(cluster, tmp_path):
  script = tmp_path / 'no_srun.sbatch'
  script.write_text(
    '#!/bin/bash\n#SBATCH --ntasks=2\n'
    f'{sys.executable} -m vit_jax.main --workdir={tmp_path / "run"} {" ".join(FLAGS)}\n'
  )
  log = tmp_path / 'no_srun.out'
  job = int(
    cluster.run(
      'sbatch', f'--output={log}', f'--chdir={ROOT}', str(script), check=True
    ).stdout.split()[-1]
  )
  wait_for(lambda: ended(cluster, job), f'job {job}')
  assert cluster.job(job)['ExitCode'] == '2:0'
  assert said(log.read_text()) == [
    'error: this SLURM allocation has 2 tasks, but the command runs once, outside srun (in the '
    'batch script or an salloc shell): start it with `srun python -m vit_jax.main ...`, one '
    'process per task (launch/slurm.py writes such a script), or with `srun --ntasks=1` for '
    'one process'
  ]
