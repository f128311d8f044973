"""A real SLURM cluster of two nodes on this machine (Debian's slurmctld, two slurmd and munge),
driven as a user drives one: `launch/slurm.py` writes and submits each job (CPU tasks of the
testing model), and `sbatch`, `srun`, `scancel` and `scontrol` act on it; a node is drained,
lost (its daemon and tasks killed) and brought back as an administrator would.

The cluster is started once for the module, by PID, from a slurm.conf without cgroups
(`proctrack/linuxproc`, `task/none`: the cgroup plugins need a cgroup namespace that a
container may not have): nodes n1 and n2 at 127.0.0.2 and 127.0.0.3, each `slurmd -N NAME`
with a port, spool folder and pid file of its own. Each test leaves no process of its jobs
behind, and the module none of the cluster's (both checked). It needs the binaries
(`apt-get install slurmctld slurmd slurm-client munge`, which `.ci/run` does) and root (the
daemons run as root here); without them the tests skip, saying which is missing.
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
from conftest import assert_bitwise_equal
from conftest import final_params
from conftest import free_port
from conftest import said
from conftest import subprocess_env
from conftest import tiny_run_flags
import pytest

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
  return ''


class Cluster:
  """Two nodes on this machine, `n1` and `n2`, one partition; each node its own `slurmd`
  (`slurmd -N NAME`) on an address of the loopback range, with its own port, spool and pid
  file. Every daemon is started by PID and stopped by PID."""

  NODES = {'n1': '127.0.0.2', 'n2': '127.0.0.3'}

  def __init__(self, root):
    self.root = root
    self.host = socket.gethostname().split('.')[0]
    self.processes = []
    self.slurmd = {}  # node name -> its slurmd
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
    for node in self.NODES:
      self.start_node(node)
    self._wait(lambda: self.states() == {node: 'idle' for node in self.NODES}, 'the nodes')

  def start_node(self, node):
    """Starts node `node`'s slurmd (again, after `lose`)."""
    self.slurmd[node] = self._start(['slurmd', '-D', '-N', node, '-f', self.conf], f'slurmd-{node}')

  def states(self) -> dict:
    """{node: its state as sinfo names it (idle, alloc, drain, down, ...)}."""
    text = self.run('sinfo', '-h', '-N', '-o', '%N %T').stdout
    return dict(line.split() for line in text.splitlines() if line.strip())

  def _config(self, munge_socket) -> str:
    root = self.root
    nodes = [
      f'NodeName={node} NodeHostname={self.host} NodeAddr={address} Port={free_port()} CPUs=8 '
      'State=UNKNOWN'
      for node, address in self.NODES.items()
    ]
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
        f'SlurmctldPort={free_port()}',
        f'StateSaveLocation={root}/state',
        # One spool folder, pid file and log per node (%n: the node's name).
        f'SlurmdSpoolDir={root}/spool/%n',
        f'SlurmctldPidFile={root}/slurmctld.pid',
        f'SlurmdPidFile={root}/slurmd-%n.pid',
        f'SlurmctldLogFile={root}/log/slurmctld.log',
        f'SlurmdLogFile={root}/log/slurmd-%n.log',
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
        *nodes,
        f'PartitionName=test Nodes={",".join(self.NODES)} Default=YES MaxTime=INFINITE State=UP',
        '',
      ]
    )

  def _start(self, command, name):
    log = open(os.path.join(self.root, 'log', f'{name}.out'), 'w')
    process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT)
    self.processes.append(process)
    return process

  def _wait(self, ready, what, timeout=60):
    deadline = time.time() + timeout
    while not ready():
      for p in self.processes:
        if p.poll() is not None:
          raise RuntimeError(f'{p.args[0]} ended ({p.returncode}) before {what} was up')
      if time.time() > deadline:
        raise RuntimeError(f'{what} not up after {timeout} s')
      time.sleep(0.2)

  def ours(self) -> dict:
    """{pid: command line} of every process of this cluster: its daemons and all they started
    (job steps, batch scripts, tasks), which carry its SLURM_CONF."""
    mark = f'SLURM_CONF={self.conf}'.encode()
    found = {p.pid: ' '.join(p.args) for p in self.processes if p.poll() is None}
    for pid in filter(str.isdigit, os.listdir('/proc')):
      try:
        with open(f'/proc/{pid}/environ', 'rb') as f:
          if mark not in f.read().split(b'\0'):
            continue
        with open(f'/proc/{pid}/cmdline', 'rb') as f:
          found[int(pid)] = f.read().replace(b'\0', b' ').decode(errors='replace').strip()
      except OSError:
        continue
    return found

  def leftovers(self) -> dict:
    """What of `ours` is not a daemon (nor slurmctld's helper, slurmscriptd): what jobs left
    running."""
    daemons = {p.pid for p in self.processes}
    return {
      pid: command
      for pid, command in self.ours().items()
      if pid not in daemons and not (parent(pid) in daemons and 'slurmscriptd' in command)
    }

  def lose(self, node):
    """Node `node` lost, as a machine is: its slurmd, its job steps and every task on it
    paused, then killed, all at once (no process of it runs a line more, nor says goodbye)."""
    tasks = set()
    for pid, _ in self.leftovers().items():
      try:
        with open(f'/proc/{pid}/environ', 'rb') as f:
          environ = f.read().split(b'\0')
      except OSError:
        continue
      if f'SLURMD_NODENAME={node}'.encode() in environ:
        tasks.add(pid)
    steps = {parent(pid) for pid in tasks} - tasks
    steps = {pid for pid in steps if command_of(pid).startswith('slurmstepd')}
    victims = tasks | steps | {self.slurmd[node].pid}
    for pid in victims:
      os.kill(pid, signal.SIGSTOP)
    for pid in victims:
      os.kill(pid, signal.SIGKILL)
    self.slurmd[node].wait()
    self.processes.remove(self.slurmd[node])
    return tasks

  def restore(self, node):
    """Node `node` back in service and idle, as before `lose` or a drain."""
    if self.slurmd[node].poll() is not None:
      self.start_node(node)
    self._wait(lambda: not self.states().get(node, '*').endswith('*'), f'{node} to answer', 90)
    if self.states()[node] in ('down', 'drained', 'draining', 'drain'):
      self.run('scontrol', 'update', f'nodename={node}', 'state=resume', check=True)
    self._wait(lambda: self.states().get(node) == 'idle', f'{node} idle', 90)

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


def parent(pid) -> int:
  try:
    with open(f'/proc/{pid}/stat') as f:
      return int(f.read().rsplit(')', 1)[1].split()[1])
  except OSError:
    return 0


def command_of(pid) -> str:
  try:
    with open(f'/proc/{pid}/cmdline', 'rb') as f:
      return f.read().replace(b'\0', b' ').decode(errors='replace')
  except OSError:
    return ''


@pytest.fixture(scope='module')
def cluster(tmp_path_factory):
  """The two-node cluster, for the module; at its end, every daemon stopped and no process of
  it left (checked)."""
  reason = _missing()
  if reason:
    pytest.skip(reason)
  cluster = Cluster(str(tmp_path_factory.mktemp('slurm')))
  try:
    cluster.start()
    yield cluster
  finally:
    cluster.stop()
  left = wait_for(lambda: not cluster.ours() or None, 'the cluster to stop', timeout=30, fail=False)
  assert left is None or not cluster.ours(), cluster.ours()


@pytest.fixture
def nodes(cluster):
  """The cluster with both nodes idle; after the test its jobs cancelled and nothing of them
  left running (checked), and its nodes back in service."""
  for node in cluster.NODES:
    cluster.restore(node)
  yield cluster
  cluster.run('scancel', '--partition=test')
  wait_for(lambda: not cluster.leftovers(), 'the jobs to end', timeout=90, fail=False)
  left = cluster.leftovers()
  for node in cluster.NODES:
    cluster.restore(node)
  assert not left, left


def reference(workdir, devices, flags=FLAGS, processes=1):
  """The same run outside SLURM, started at once beside the job (from the checkpoints already
  in `workdir`, if any): one process with `devices` devices, or `processes` processes of one
  device each; the returned function waits for it and gives its parameters."""
  command = [sys.executable, '-m', 'vit_jax.main', f'--workdir={workdir}', *flags]
  ranks = [[]]
  if processes > 1:
    address = f'127.0.0.1:{free_port()}'
    ranks = [
      [f'--coordinator_address={address}', f'--num_processes={processes}', f'--process_id={i}']
      for i in range(processes)
    ]
  started = [
    subprocess.Popen(
      command + rank,
      env=subprocess_env(devices=devices if processes == 1 else 1),
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
    )  # fmt: skip
    for rank in ranks
  ]

  def result():
    try:
      for process in started:
        stderr = process.communicate(timeout=600)[1]
        assert process.returncode == 0, stderr[-3000:]
    finally:
      for process in started:
        if process.poll() is None:
          process.kill()
    return final_params(workdir)

  return result


def submit(cluster, workdir, *flags, tasks=2, run_flags=FLAGS, env=None) -> int:
  """`launch/slurm.py` on `tasks` CPU tasks per node of the testing model; the job's id."""
  result = subprocess.run(
    [sys.executable, str(ROOT / 'launch' / 'slurm.py'), '--gpus_per_node=0',
     f'--tasks_per_node={tasks}', '--cpus_per_gpu=1', f'--venv={sys.prefix}',
     f'--workdir={workdir}', '--time=10', '--grace_s=115', *flags, '--', *run_flags],
    env={**subprocess_env(devices=1), 'SLURM_CONF': cluster.conf, 'PATH': cluster.env['PATH'],
         **(env or {})},
    capture_output=True, text=True, timeout=60,
  )  # fmt: skip
  assert result.returncode == 0, result.stderr
  return int(result.stdout.split('Submitted batch job ')[1].split()[0])


def wait_for(predicate, what, timeout=600, every=0.2, fail=True):
  """`predicate()`'s first true value, asked every `every` s; after `timeout` s an assertion
  error (`fail`) or None."""
  deadline = time.time() + timeout
  while True:
    value = predicate()
    if value:
      return value
    if time.time() > deadline:
      assert not fail, f'timed out waiting for {what}'
      return None
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
    python = os.path.basename(command[0]).startswith(b'python')  # (not srun's line)
    if python and b'vit_jax.main' in command and f'--workdir={workdir}'.encode() in command:
      found[int(environ[b'SLURM_PROCID'])] = int(pid)
  return found


def freeze(workdir, after_step, count=2):
  """Waits for the current attempt of the run (`count` processes) to log `after_step` (or
  later), then pauses its processes; returns ({rank: pid}, the last step logged): the run is at
  that step or the one after."""
  before = len(logged_steps(workdir))  # the attempts before (this one has logged nothing yet)
  wait_for(
    lambda: [s for s in logged_steps(workdir)[before:] if s >= after_step], f'step {after_step}'
  )
  pids = wait_for(lambda: (found := ranks(workdir)) and len(found) == count and found, 'the ranks')
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
  thaw(pids)


def thaw(pids):
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


def requeued_after(cluster, workdir, job, n, start=True) -> str:
  """Waits for attempt `n` to end, the job to requeue itself and (`start`) start again; the log
  of attempt `n`."""
  if start:
    wait_for(lambda: attempts(log_of(workdir, job)) > n, f'attempt {n + 1}')
  else:
    wait_for(lambda: 'requeueing job' in attempt_log(log_of(workdir, job), n), 'the requeue')
  text = attempt_log(log_of(workdir, job), n)
  assert f'attempt {n} stopped (status ' in text and 'requeueing job' in text, text
  return text


def stop_step(text, last, count=2) -> int:
  """The step all `count` ranks stopped after in an attempt's log, checked to be one step and
  within 3 steps of the one the signal arrived at (`last` logged, or the one after)."""
  stops = [line for line in text.splitlines() if 'error: preempted (SIGTERM) at step' in line]
  assert sorted(line.split(':')[0] for line in stops) == [str(r) for r in range(count)], text
  steps = {int(line.split(' at step ')[1].split(';')[0]) for line in stops}
  assert len(steps) == 1, stops
  (step,) = steps
  assert last < step <= last + 3, (last, step)
  return step


def seconds(fields, name) -> float:
  """A time field of `scontrol show job` (StartTime, EndTime) as seconds since the epoch."""
  return time.mktime(time.strptime(fields[name], '%Y-%m-%dT%H:%M:%S'))


def test_preempted_and_killed_the_job_requeues_itself_and_ends_bitwise(nodes, tmp_path):
  """The job `launch/slurm.py` writes and submits, on 2 tasks of one node, through two
  interruptions, each in an attempt of its own: `scancel --signal=TERM` and `kill -9` of rank
  1; its last attempt ends the run with the parameters of one process with 2 devices. The run
  is paused (SIGSTOP) while each is set off, so that it is still stepping when it arrives (it
  steps fast: its time goes to starting up), and goes on (SIGCONT) once it is."""
  cluster = nodes
  workdir = str(tmp_path / 'run')
  expected = reference(str(tmp_path / 'reference'), devices=2)
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

  # 2. kill -9 of rank 1: rank 0 ends within 60 s, with one line naming it and its node; the
  # job requeues.
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
    r'0: error: process 1 of 2 on n1 stopped answering after step (\d+) \(killed, crashed, or '
    r'its machine lost; its own log says why\); process 0 cannot go on without it and stopped\. '
    r'Run the same command again \(under SLURM: the job requeues itself, or resubmit it\) to '
    rf'resume from the checkpoint at step {kept}',
    errors[0],
  ), text
  assert last <= int(errors[0].split(' after step ')[1].split()[0]) <= last + 2
  assert saved_steps(workdir)[-1] == kept  # nothing written since

  wait_for(lambda: ended(cluster, job), f'job {job}')
  log = log_of(workdir, job)
  fields = cluster.job(job)
  assert (fields['JobState'], fields['ExitCode']) == ('COMPLETED', '0:0'), log
  assert attempts(log) == n + 1, log  # the last attempt ran to the end
  last_attempt = attempt_log(log, n + 1)
  assert f'Resuming from the checkpoint at step {kept}' in last_attempt
  # One log beside the run, each line of the processes with its rank; only process 0 reports,
  # and says where the processes run and meet.
  assert os.path.exists(os.path.join(workdir, 'launch.sbatch'))
  assert '0: step 24/24' in last_attempt and '\n1: step ' not in log
  assert '\n0: 2 processes: 0-1 on n1; coordinator n1 (127.0.0.2:' in last_attempt
  assert_bitwise_equal(final_params(workdir), expected())


def test_two_nodes_drained_or_out_of_time_stop_all_ranks_at_one_step_and_end_bitwise(
  nodes, tmp_path
):
  """A job of 2 nodes x 2 tasks, through a drained node and the time limit's grace signal, each
  in an attempt of its own: every rank on both nodes stops after the same step with one
  checkpoint, the job requeues once for each, and the last attempt ends bitwise equal to the
  same run uninterrupted in 4 processes. (Not to one process with 4 devices: gloo's ring sums
  the 4 gradients in another order than one process does, 2e-6 apart at the end; with 2 they
  are equal, as the other tests show.) The drained node is brought back once the job waits for
  it (a job of 2 nodes needs 2)."""
  cluster = nodes
  workdir = str(tmp_path / 'run')
  expected = reference(str(tmp_path / 'reference'), devices=1, processes=4)
  job = submit(cluster, workdir, '--nodes=2', '--drain_check_s=2')

  # 1. A node drained: the batch script sees it within --drain_check_s and signals the job.
  pids, last = freeze(workdir, after_step=6, count=4)
  n = attempts(log_of(workdir, job))
  cluster.run('scontrol', 'update', 'nodename=n2', 'state=drain', 'reason=maintenance', check=True)
  thaw_when_signalled(pids)
  text = requeued_after(cluster, workdir, job, n, start=False)
  assert '=== vit_jax: node n2 drained: the run stops at its next step' in text, text
  assert f'attempt {n} stopped (status 143' in text
  assert stop_step(text, last, count=4) == saved_steps(workdir)[-1]
  assert len(saved_steps(workdir)) == 1
  wait_for(lambda: cluster.job(job)['JobState'] == 'PENDING', 'the job to wait for n2')
  cluster.restore('n2')

  # 2. The time limit: a run paused while its job's limit is brought near sees the grace
  # signal (--grace_s=115 s before the limit, at SLURM's next check of time limits, within 30 s)
  # on every rank of both nodes. The job then gets its 10 minutes back for the last attempt.
  kept = saved_steps(workdir)[-1]
  pids, last = freeze(workdir, after_step=kept + 2, count=4)
  assert cluster.job(job)['NodeList'] == 'n[1-2]'
  n = attempts(log_of(workdir, job))
  elapsed = time.time() - seconds(cluster.job(job), 'StartTime')
  cluster.run(
    'scontrol', 'update', f'JobId={job}', f'TimeLimit={int(elapsed // 60) + 2}', check=True
  )
  thaw_when_signalled(pids)
  cluster.run('scontrol', 'update', f'JobId={job}', 'TimeLimit=10', check=True)
  stopped = stop_step(requeued_after(cluster, workdir, job, n), last, count=4)
  assert saved_steps(workdir) == [kept, stopped]

  wait_for(lambda: ended(cluster, job), f'job {job}')
  log = log_of(workdir, job)
  fields = cluster.job(job)
  assert (fields['JobState'], fields['ExitCode']) == ('COMPLETED', '0:0'), log
  assert attempts(log) == n + 1, log
  last_attempt = attempt_log(log, n + 1)
  assert f'Resuming from the checkpoint at step {stopped}' in last_attempt
  assert '\n0: 4 processes: 0-1 on n1, 2-3 on n2; coordinator n1 (127.0.0.2:' in last_attempt
  assert_bitwise_equal(final_params(workdir), expected())


def test_a_lost_node_ends_the_job_in_one_line_and_it_goes_on_on_the_node_left(nodes, tmp_path):
  """A job of 1-2 nodes x 2 tasks loses node n2 (its slurmd, job step and tasks killed at
  once): the ranks on n1 end within 30 s, each with one line naming n2 and the checkpoint to
  resume from; once SLURM has marked n2 down (here at once: `scontrol update state=down`, as
  SlurmdTimeout would later) it requeues the job, which goes on with the 2 tasks of n1 and
  ends bitwise equal to one process with 2 devices resumed from the same checkpoint."""
  cluster = nodes
  workdir = str(tmp_path / 'run')
  flags = tiny_run_flags(progress_every=2, checkpoint_every=4)
  job = submit(cluster, workdir, '--nodes=1-2', run_flags=flags)

  pids, last = freeze(workdir, after_step=6, count=4)
  kept = saved_steps(workdir)[-1]
  assert cluster.job(job)['NodeList'] == 'n[1-2]'
  n = attempts(log_of(workdir, job))
  lost = cluster.lose('n2')
  assert {pids[2], pids[3]} <= lost
  thaw({0: pids[0], 1: pids[1]})
  killed = time.time()
  wait_for(lambda: not ranks(workdir), 'the ranks on n1 to end', every=0.05)
  print(f'the ranks on n1 ended {time.time() - killed:.1f} s after n2 was lost')
  assert time.time() - killed <= 30
  text = attempt_log(log_of(workdir, job), n)
  errors = sorted(line for line in text.splitlines() if re.match(r'\d+: error:', line))
  assert [line[:2] for line in errors] == ['0:', '1:'], text
  for rank, line in enumerate(errors):
    assert re.fullmatch(
      rf'{rank}: error: processes 2, 3 of 4 on n2 stopped answering after step (\d+) \(killed, '
      r'crashed, or its machine lost; its own log says why\); process '
      rf'{rank} cannot go on without it and stopped\. Run the same command again \(under SLURM: '
      rf'the job requeues itself, or resubmit it\) to resume from the checkpoint at step {kept}',
      line,
    ), line
  resumed = str(tmp_path / 'reference')
  shutil.copytree(workdir, resumed, ignore=shutil.ignore_patterns('slurm-*.out', '*.sbatch'))

  cluster.run('scontrol', 'update', 'nodename=n2', 'state=down', 'reason=lost', check=True)
  expected = reference(resumed, devices=2, flags=flags)
  wait_for(lambda: ended(cluster, job), f'job {job}')
  log = log_of(workdir, job)
  fields = cluster.job(job)
  assert (fields['JobState'], fields['ExitCode'], fields['Restarts']) == ('COMPLETED', '0:0', '1')
  assert attempts(log) == n + 1, log
  last_attempt = attempt_log(log, n + 1)
  assert f'Resuming from the checkpoint at step {kept}' in last_attempt
  assert '\n0: 2 processes: 0-1 on n1; coordinator n1 (127.0.0.2:' in last_attempt
  assert_bitwise_equal(final_params(workdir), expected())


def test_a_coordinator_the_nodes_cannot_reach_is_one_line_on_every_rank_and_not_requeued(
  nodes, tmp_path
):
  """Three jobs of 2 nodes x 1 task whose processes cannot meet: the coordinator's address does
  not resolve, it is no host's here, or its port on n1 is taken. Each rank says so in one line
  naming its node, the address and what to check, within a minute (VIT_JAX_JOIN_TIMEOUT_S
  unset: the default), and the job ends with status 2, not requeued."""
  cluster = nodes
  holder = socket.socket()
  holder.bind(('0.0.0.0', 0))
  holder.listen()
  port = holder.getsockname()[1]
  cases = {
    'unresolvable': {'JAX_COORDINATOR_ADDRESS': 'nowhere.invalid:1234'},
    'unreachable': {'JAX_COORDINATOR_ADDRESS': '192.0.2.1:1234'},  # TEST-NET-1: no host
    'port_taken': {'JAX_COORDINATOR_PORT': str(port)},
  }
  flags = tiny_run_flags(total_steps=2)
  jobs = {
    name: submit(cluster, str(tmp_path / name), '--nodes=2', tasks=1, run_flags=flags, env=env)
    for name, env in cases.items()
  }
  try:
    for job in jobs.values():
      wait_for(lambda: ended(cluster, job), f'job {job}', timeout=180)
  finally:
    holder.close()
  lines = {}
  for name, job in jobs.items():
    log = log_of(str(tmp_path / name), job)
    fields = cluster.job(job)
    assert (fields['JobState'], fields['ExitCode'], fields['Restarts']) == ('FAILED', '2:0', '0')
    errors = sorted(line for line in log.splitlines() if re.match(r'\d+: error:', line))
    assert [line[:2] for line in errors] == ['0:', '1:'], log
    assert 'requeueing' not in log and 'Traceback' not in log and 'Check failure' not in log
    took = seconds(fields, 'EndTime') - seconds(fields, 'StartTime')
    print(f'{name}: the job ended {took:.0f} s after it started')
    assert took <= 75  # a minute to join, and the job's start and end around it
    lines[name] = errors
  assert lines['unresolvable'] == [
    f'{rank}: error: process {rank} of 2 (node n{rank + 1}) cannot resolve the coordinator n1 '
    '(nowhere.invalid:1234, JAX_COORDINATOR_ADDRESS): Name or service not known. Check that '
    'every node resolves nowhere.invalid (DNS or /etc/hosts), or set '
    'JAX_COORDINATOR_ADDRESS=HOST:PORT to an address of the first node that all nodes reach'
    for rank in (0, 1)
  ]
  for rank, line in enumerate(lines['unreachable']):
    assert line.startswith(
      f'{rank}: error: process {rank} of 2 (node n{rank + 1}) gave up after 60 s: could not '
      'join the coordinator n1 (192.0.2.1:1234, JAX_COORDINATOR_ADDRESS): '
    ), line
    assert line.endswith(
      'Check that every node reaches 192.0.2.1:1234 (the port open between the nodes, the '
      "address on their network) and the other processes' lines; if the processes only start "
      'more than that apart, raise VIT_JAX_JOIN_TIMEOUT_S'
    ), line
  assert lines['port_taken'][0] == (
    f'0: error: process 0 of 2 (node n1) cannot start the coordinator on port {port} (Address '
    'already in use): another program (another job on n1?) holds it; set JAX_COORDINATOR_PORT '
    'to a free port for the job'
  )
  assert lines['port_taken'][1].startswith(
    '1: error: process 1 of 2 (node n2) gave up after 60 s: could not join the coordinator n1 '
    f"(127.0.0.2:{port}, n1's NodeAddr): "
  )


def test_hostlists_expand_as_scontrol_expands_them(cluster):
  from vit_jax.core import coordinator

  for hostlist in ('n[1-2]', 'n1', 'gpu[08-11,20],cpu7', 'r[1-2]n[01-02]', 'a[1-2],b,c[3,5-6]'):
    expected = cluster.run('scontrol', 'show', 'hostnames', hostlist, check=True).stdout.split()
    assert coordinator.hostnames(hostlist) == expected, hostlist


def test_a_run_started_without_srun_in_an_allocation_of_two_tasks_is_one_line(nodes, tmp_path):
  cluster = nodes
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
