"""Launch scripts: the commands of their dry runs, and that a real run executes exactly those.

Real runs use stand-ins for gcloud, ssh, scp, sbatch and srun placed first on
PATH, which record their arguments; the SLURM script is executed by bash.
"""

import os
import pathlib
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAUNCH = ROOT / 'launch'


def launch(script, *args, env=None, check=True):
  result = subprocess.run(
    [sys.executable, str(LAUNCH / script), *args],
    capture_output=True,
    text=True,
    env={**os.environ, **(env or {})},
    check=False,
  )
  if check:
    assert result.returncode == 0, result.stderr
  return result


def dry_run(script, *args):
  return [shlex.split(line) for line in launch(script, '--dry-run', *args).stdout.splitlines()]


def flags(command):
  """{'--zone': 'z', ...} of `--name=value` arguments."""
  return dict(a.split('=', 1) for a in command if a.startswith('--') and '=' in a)


def fake_tools(tmp_path, *names):
  """Executables that append their command line (shell-quoted) to tmp_path/calls."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir(exist_ok=True)
  for name in names:
    tool = bin_dir / name
    tool.write_text(
      '#!/usr/bin/env python3\nimport os, shlex, sys\n'
      f'open({str(tmp_path / "calls")!r}, "a").write(shlex.join('
      '[os.path.basename(sys.argv[0])] + sys.argv[1:]) + "\\n")\n'
    )
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
  return {'PATH': f'{bin_dir}{os.pathsep}{os.environ["PATH"]}', 'TMPDIR': str(tmp_path)}


TPU_ARGS = (
  '--name=vit-b16',
  '--zone=us-central2-b',
  '--accelerator_type=v4-32',
  '--workdir=gs://bucket/vit/b16',
  '--config=vit_jax/configs/demo.py',
  '--project=my-project',
)


def test_tpu_vm_dry_run():
  commands = dry_run('tpu_vm.py', *TPU_ARGS, '--spot', '--', '--config.batch=4096')
  create, archive, scp, install, run, mkdir, fetch = commands
  assert create[:6] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create', 'vit-b16']
  assert flags(create) == {
    '--zone': 'us-central2-b',
    '--project': 'my-project',
    '--accelerator-type': 'v4-32',
    '--version': 'tpu-ubuntu2204-base',
  }
  assert '--spot' in create

  # The working tree (HEAD, or a commit of its edits) goes to every worker, installed with the
  # TPU extra.
  assert archive[:4] == ['git', '-C', str(ROOT), 'archive']
  assert archive[-1] == 'HEAD' or re.fullmatch('[0-9a-f]{40}', archive[-1])
  tarball = archive[archive.index('-o') + 1]
  assert scp[:6] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'scp', tarball]
  assert '--worker=all' in scp and scp[6] == 'vit-b16:vit_jax-src.tar.gz'
  assert install[4:6] == ['ssh', 'vit-b16'] and '--worker=all' in install
  assert 'pip install -q -e "./vit_jax[tpu]"' in flags(install)['--command']

  # Every worker runs the same vit_jax.main on the gs:// workdir.
  assert run[4:6] == ['ssh', 'vit-b16'] and '--worker=all' in run
  remote = shlex.split(flags(run)['--command'].split(' && ', 1)[1])
  assert remote[:3] == ['python3', '-m', 'vit_jax.main']
  assert flags(remote) == {
    '--workdir': 'gs://bucket/vit/b16',
    '--config': 'vit_jax/configs/demo.py',
    '--config.batch': '4096',
  }
  assert mkdir == ['mkdir', '-p', 'results']
  assert fetch == [
    'gcloud',
    'storage',
    'cp',
    'gs://bucket/vit/b16/summary.json',
    'gs://bucket/vit/b16/params.npz',
    'results',
  ]

  (delete,) = dry_run('tpu_vm.py', 'delete', *TPU_ARGS)
  assert delete[4:6] == ['delete', 'vit-b16'] and '--quiet' in delete

  # Detached: the run outlives ssh, `logs` reads worker 0's log, nothing is fetched yet.
  detached = dry_run('tpu_vm.py', '--detach', *TPU_ARGS)
  assert [c[:5] for c in detached][-1] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh']
  command = flags(detached[-1])['--command']
  assert command.startswith('cd vit_jax && nohup python3 -m vit_jax.main ')
  assert command.endswith(' >> run.log 2>&1 < /dev/null &')  # after the earlier runs' log
  (logs,) = dry_run('tpu_vm.py', 'logs', *TPU_ARGS)
  assert '--worker=0' in logs and flags(logs)['--command'] == 'tail -n 100 vit_jax/run.log'


def test_tpu_vm_runs_exactly_its_dry_run(tmp_path):
  env = fake_tools(tmp_path, 'gcloud')
  expected = launch(
    'tpu_vm.py', *TPU_ARGS, 'create', 'install', 'run', 'fetch', '--dry-run', env=env
  ).stdout
  launch('tpu_vm.py', *TPU_ARGS, 'create', 'install', 'run', 'fetch', env=env)
  gcloud_lines = [line for line in expected.splitlines() if line.startswith('gcloud')]
  assert (tmp_path / 'calls').read_text().splitlines() == gcloud_lines
  # git archive really ran: the tarball holds the tree.
  listing = subprocess.run(
    ['tar', 'tzf', str(tmp_path / 'vit-b16-vit_jax-src.tar.gz')],
    capture_output=True,
    text=True,
    check=True,
  ).stdout.split()
  assert 'vit_jax/vit_jax/main.py' in listing and 'vit_jax/setup.py' in listing


def test_tpu_vm_errors_are_one_line():
  for args, message in [
    (('--workdir=/tmp/run',), 'share no disk'),
    (('--workdir=gs://b/r', '--accelerator_type=v4'), 'such as v4-8'),
    (('--workdir=gs://b/r', 'launch'), "unknown action 'launch'"),
    (('--workdir=gs://b/r', '--', '--batch=8'), 'only --config.FIELD=VALUE'),
  ]:
    result = launch('tpu_vm.py', '--name=n', '--zone=z', *args, '--dry-run', check=False)
    assert result.returncode == 2 and message in result.stderr
    assert result.stderr.count('\n') == 1 and not result.stdout


def sbatch_directives(script):
  return dict(
    (line[len('#SBATCH ') :] + '=').split('=')[:2]
    for line in script.splitlines()
    if line.startswith('#SBATCH ')
  )


def test_slurm_dry_run_and_the_script_under_srun(tmp_path):
  workdir = tmp_path / 'run'
  args = (
    '--nodes=4',
    '--gpus_per_node=8',
    f'--workdir={workdir}',
    '--partition=gpu',
    '--time=02:00:00',
    f'--venv={tmp_path / "venv"}',
    '--',
    '--config.batch=4096',
  )
  output = launch('slurm.py', '--dry-run', *args).stdout
  heredoc, submit = output.split('\nEOF\n')
  header, script = heredoc.split('\n', 1)
  path = str(workdir / 'launch.sbatch')
  assert shlex.split(header) == ['cat', '>', path, '<<EOF']
  assert shlex.split(submit) == ['sbatch', path]

  assert sbatch_directives(script) == {
    '--job-name': 'vit_jax',
    '--nodes': '4',
    '--ntasks-per-node': '8',
    '--gpus-per-node': '8',
    '--cpus-per-task': '8',
    '--time': '02:00:00',
    '--output': f'{workdir}/slurm-%j.out',
    '--open-mode': 'append',
    '--partition': 'gpu',
    '--signal': 'TERM@300',
    '--requeue': '',
  }
  # JAX's share of each GPU's memory: what the compile command checks a program against.
  assert 'export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9' in script.splitlines()
  (srun_line,) = [line for line in script.splitlines() if line.startswith('srun ')]
  srun = shlex.split(srun_line.removesuffix(' &'))  # (run beside the drain check)
  assert srun[:6] == ['srun', '--kill-on-bad-exit=1', '--label', 'python', '-m', 'vit_jax.main']
  assert flags(srun[6:]) == {'--workdir': str(workdir), '--config.batch': '4096'}

  # Submitting writes that script; bash runs it (with stand-ins for srun, scontrol and the
  # venv's activate script) into exactly that srun call.
  env = fake_tools(tmp_path, 'sbatch', 'srun', 'scontrol')
  launch('slurm.py', *args, env=env)
  assert pathlib.Path(path).read_text() == script + '\n'
  (tmp_path / 'venv' / 'bin').mkdir(parents=True)
  (tmp_path / 'venv' / 'bin' / 'activate').write_text('export VIT_JAX_VENV=1\n')
  job = {'SLURM_JOB_ID': '77', 'SLURM_JOB_NODELIST': 'gpu[1-4]'}
  done = subprocess.run(
    ['bash', path], env={**os.environ, **env, **job}, capture_output=True, text=True
  )
  assert done.returncode == 0, done.stderr
  assert done.stdout.startswith('=== vit_jax: job 77, attempt 1 of at most 10, started ')
  calls = [shlex.split(line) for line in (tmp_path / 'calls').read_text().splitlines()]
  assert calls == [['sbatch', path], srun]


def fake_srun(tmp_path, status):
  """An srun that exits with `status` (and records its call, as `fake_tools`)."""
  env = fake_tools(tmp_path, 'srun', 'scontrol')
  srun = tmp_path / 'bin' / 'srun'
  srun.write_text(srun.read_text() + f'sys.exit({status})\n')
  return env


@pytest.mark.parametrize(
  'status, attempt, requeued',
  [
    (143, 1, True),  # preempted, the time limit, scancel --signal=TERM: checkpointed
    (137, 1, True),  # a process killed (the others stopped with one line)
    (143, 3, False),  # the last attempt (--max_attempts=3)
    (130, 1, False),  # Ctrl-C
    (2, 1, False),  # an error of the run itself
    (0, 1, False),
  ],
)
def test_the_slurm_job_requeues_itself_after_a_stop_but_not_an_error(
  tmp_path, status, attempt, requeued
):
  workdir = tmp_path / 'run'
  args = ('--gpus_per_node=0', '--tasks_per_node=2', f'--workdir={workdir}', '--max_attempts=3')
  env = fake_srun(tmp_path, status)
  launch('slurm.py', *args, env=fake_tools(tmp_path, 'sbatch'))
  job = {'SLURM_JOB_ID': '77', 'SLURM_JOB_NODELIST': 'n1', 'SLURM_RESTART_COUNT': str(attempt - 1)}
  done = subprocess.run(
    ['bash', str(workdir / 'launch.sbatch')], env={**os.environ, **env, **job},
    capture_output=True, text=True,
  )  # fmt: skip
  calls = (tmp_path / 'calls').read_text().splitlines()
  assert ('scontrol requeue 77' in calls) == requeued
  assert done.returncode == (0 if requeued else status), done.stdout
  if status >= 128 and status != 130 and not requeued:
    assert 'was the last of --max_attempts=3; resubmit the job' in done.stdout


def test_slurm_on_cpus_and_a_relative_workdir(tmp_path):
  """--gpus_per_node=0: no GRES, --tasks_per_node processes per node; a relative workdir is in
  --repo, where the job runs, and so are its script and log."""
  output = launch(
    'slurm.py', '--dry-run', '--gpus_per_node=0', '--tasks_per_node=2', '--workdir=runs/cpu',
    f'--repo={tmp_path}', '--max_attempts=5',
  ).stdout  # fmt: skip
  heredoc, submit = output.split('\nEOF\n')
  header, script = heredoc.split('\n', 1)
  run = tmp_path / 'runs' / 'cpu'
  assert shlex.split(header)[2] == str(run / 'launch.sbatch')
  directives = sbatch_directives(script)
  assert directives['--ntasks-per-node'] == '2' and '--gpus-per-node' not in directives
  assert directives['--output'] == f'{run}/slurm-%j.out'
  assert 'XLA_PYTHON_CLIENT_MEM_FRACTION' not in script
  assert f'--workdir={run}' in script and 'attempt $attempt of at most 5' in script


@pytest.mark.parametrize(
  'args, message',
  [
    (('--gpus_per_node=0',), 'runs on CPUs: give the processes per node, --tasks_per_node=N'),
    (('--gpus_per_node=8', '--tasks_per_node=1'), 'it takes one process per GPU'),
    (('--max_attempts=0',), 'must be at least 1'),
    (('--time=abc',), '--time=abc: not a SLURM time limit; pass HH:MM:SS, D-HH:MM:SS or minutes'),
    (('--grace_s=-5',), '--grace_s=-5: pass the seconds (1 to 65535) before the time limit'),
    (('--time=5', '--grace_s=300'), '--grace_s=300 is not less than --time=5 (300 s)'),
    (('--cpus_per_gpu=0',), '--cpus_per_gpu=0: each process needs at least 1 CPU core'),
    (('--config=vit_jax/configs/nope.py',), '--config=vit_jax/configs/nope.py: no such file in'),
    (('--nodes=2-1',), '--nodes=2-1: the range goes down; pass MIN-MAX, e.g. 1-2'),
    (('--nodes=two',), '--nodes=two: pass a number of nodes (4), or a range (2-4)'),
    (('--drain_check_s=-1',), '--drain_check_s=-1: pass seconds between checks, or 0 for none'),
  ],
)
def test_slurm_errors_are_one_line_before_anything_is_written_or_submitted(tmp_path, args, message):
  workdir = tmp_path / 'run'
  env = fake_tools(tmp_path, 'sbatch')
  result = launch('slurm.py', f'--workdir={workdir}', *args, env=env, check=False)
  assert result.returncode == 2 and message in result.stderr, result.stderr
  assert result.stderr.count('\n') == 1 and not result.stdout
  assert not workdir.exists() and not (tmp_path / 'calls').exists()


def test_slurm_on_a_workdir_that_is_a_file_is_one_line(tmp_path):
  taken = tmp_path / 'taken'
  taken.write_text('a file\n')
  env = fake_tools(tmp_path, 'sbatch')
  for workdir in (taken, taken / 'run'):
    result = launch('slurm.py', f'--workdir={workdir}', env=env, check=False)
    assert result.returncode == 2 and result.stderr == (
      f'launch/slurm.py: error: --workdir={workdir}: {taken} is a file; pass a directory for '
      'the run (it need not exist yet)\n'
    )
    assert not result.stdout and not (tmp_path / 'calls').exists()
  assert taken.read_text() == 'a file\n'


@pytest.mark.parametrize(
  'text, seconds',
  [('10', 600), ('1:30', 90), ('24:00:00', 86400), ('2-0', 172800), ('1-2:03', 93780),
   ('1-00:00:05', 86405), ('UNLIMITED', None), ('0', None)],
)  # fmt: skip
def test_slurm_time_limits_read_as_sbatch_reads_them(text, seconds):
  sys.path.insert(0, str(LAUNCH))
  try:
    import slurm
  finally:
    sys.path.remove(str(LAUNCH))
  assert slurm.time_limit_s(text) == seconds


def test_slurm_on_a_range_of_nodes_starts_the_tasks_on_the_nodes_it_got():
  """--nodes=1-2: whole nodes and no task count in the request (SLURM would hold a requeued
  job until it gets as many tasks again); srun starts N per node on what the job got."""
  output = launch(
    'slurm.py', '--dry-run', '--nodes=1-2', '--gpus_per_node=0', '--tasks_per_node=2',
    '--cpus_per_gpu=3', '--workdir=/shared/run',
  ).stdout  # fmt: skip
  script = output.split("<<'EOF'\n", 1)[1].split('\nEOF\n')[0]
  directives = sbatch_directives(script)
  assert directives['--nodes'] == '1-2' and directives['--exclusive'] == ''
  assert '--ntasks-per-node' not in directives and '--cpus-per-task' not in directives
  (srun_line,) = [line for line in script.splitlines() if line.startswith('srun ')]
  assert shlex.split(srun_line)[:5] == [
    'srun',
    '--kill-on-bad-exit=1',
    '--label',
    '--ntasks-per-node=2',
    '--cpus-per-task=3',
  ]


def test_a_drained_node_stops_the_slurm_job_to_requeue_it(tmp_path):
  """The batch script checks the job's nodes every --drain_check_s seconds; a drained one
  (scontrol's state `MIXED+DRAIN`) makes it signal the job's processes (which checkpoint and
  exit 143: here srun waits for that signal) and requeue the job."""
  workdir = tmp_path / 'run'
  args = ('--gpus_per_node=0', '--tasks_per_node=2', f'--workdir={workdir}', '--drain_check_s=1')
  launch('slurm.py', *args, env=fake_tools(tmp_path, 'sbatch'))
  env = fake_tools(tmp_path, 'srun', 'scontrol', 'scancel')
  bin_dir = tmp_path / 'bin'
  signalled = tmp_path / 'signalled'
  with open(bin_dir / 'scontrol', 'a') as f:
    f.write(
      'if sys.argv[1:3] == ["show", "node"]:\n'
      '  print("NodeName=n1 Arch=x86_64 State=MIXED Reason=None")\n'
      '  print("NodeName=n2 Arch=x86_64 State=MIXED+DRAIN Reason=maintenance")\n'
    )
  with open(bin_dir / 'scancel', 'a') as f:
    f.write(f'open({str(signalled)!r}, "w").close()\n')
  with open(bin_dir / 'srun', 'a') as f:
    f.write(
      'import time\n'
      f'while not os.path.exists({str(signalled)!r}):\n  time.sleep(0.1)\n'
      'sys.exit(143)\n'
    )
  job = {'SLURM_JOB_ID': '77', 'SLURM_JOB_NODELIST': 'n[1-2]'}
  done = subprocess.run(
    ['bash', str(workdir / 'launch.sbatch')], env={**os.environ, **env, **job},
    capture_output=True, text=True, timeout=60,
  )  # fmt: skip
  assert done.returncode == 0, done.stdout + done.stderr
  assert '=== vit_jax: node n2 drained: the run stops at its next step with a checkpoint' in (
    done.stdout
  )
  calls = (tmp_path / 'calls').read_text().splitlines()
  assert "scontrol show node --oneliner 'n[1-2]'" in calls
  assert calls[-2:] == ['scancel --signal=TERM 77', 'scontrol requeue 77']


def test_gpu_box_dry_runs(tmp_path):
  local = dry_run('gpu_box.py', '--workdir=runs/b16', '--config=vit_jax/configs/demo.py')
  venv_python = str(ROOT / '.venv' / 'bin' / 'python')
  assert local[0] == ['python3', '-m', 'venv', str(ROOT / '.venv')]
  assert local[1] == [venv_python, '-m', 'pip', 'install', '-q', '-e', f'{ROOT}[gpu]']
  assert local[2][:2] == [venv_python, '-c'] and 'jax.devices("gpu")' in local[2][2]
  assert local[3] == [
    'env',
    'XLA_PYTHON_CLIENT_MEM_FRACTION=0.9',
    venv_python,
    '-m',
    'vit_jax.main',
    '--workdir=runs/b16',
    '--config=vit_jax/configs/demo.py',
  ]

  remote = dry_run('gpu_box.py', '--host=me@box', '--workdir=runs/b16', '--', '--config.batch=256')
  archive, scp, setup, run, mkdir, fetch = remote
  assert archive[3] == 'archive' and scp == [
    'scp',
    archive[archive.index('-o') + 1],
    'me@box:vit_jax-src.tar.gz',
  ]
  assert setup[:2] == ['ssh', 'me@box'] and 'pip install -q -e ".[gpu]"' in setup[2]
  steps = run[2].split(' && ')
  assert run[:2] == ['ssh', 'me@box'] and steps[0] == 'cd vit_jax'
  assert steps[1] == 'export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9'
  # A relative workdir is in the login directory, beside the checkout (`setup` unpacks the
  # code over the checkout: nothing inside it is a run's).
  assert shlex.split(steps[-1]) == [
    '.venv/bin/python',
    '-m',
    'vit_jax.main',
    '--workdir=../runs/b16',
    '--config.batch=256',
  ]
  assert fetch == [
    'scp',
    'me@box:runs/b16/summary.json',
    'me@box:runs/b16/params.npz',
    'results',
  ]

  env = fake_tools(tmp_path, 'ssh', 'scp')
  args = ('--host=me@box', '--workdir=runs/b16', 'setup', 'run')
  expected = launch('gpu_box.py', '--dry-run', *args, env=env).stdout.splitlines()
  launch('gpu_box.py', *args, env=env)
  calls = (tmp_path / 'calls').read_text().splitlines()
  assert calls == [line for line in expected if not line.startswith('git ')]


def _clone(tmp_path):
  """A git checkout holding the launch scripts and a committed config, as a user's clone."""
  import shutil

  root = tmp_path / 'clone'
  (root / 'configs').mkdir(parents=True)
  shutil.copytree(LAUNCH, root / 'launch', ignore=shutil.ignore_patterns('__pycache__'))
  (root / 'configs' / 'demo.py').write_text('committed = 1\n')
  (root / '.gitignore').write_text('ignored/\n')
  git = lambda *args: subprocess.run(
    ['git', '-C', str(root), *args], check=True, capture_output=True
  )
  git('init', '-q')
  git('add', '.')
  git('-c', 'user.name=u', '-c', 'user.email=u@x', 'commit', '-q', '-m', 'clone')
  return root


def test_the_tpu_vm_and_gpu_box_ship_the_working_tree_as_the_user_has_it(tmp_path):
  """An edited config travels edited, an untracked one travels, ignored files stay; stderr says
  what was added to HEAD. The checkout itself is left as it was (no stash, no new file)."""
  root = _clone(tmp_path)
  (root / 'configs' / 'demo.py').write_text('committed = 1\nedited = 2\n')
  (root / 'configs' / 'mine.py').write_text('mine = 3\n')
  (root / 'ignored').mkdir()
  (root / 'ignored' / 'big.bin').write_bytes(b'0' * 1000)
  status = subprocess.run(['git', '-C', str(root), 'status', '--porcelain'], capture_output=True,
                          text=True).stdout  # fmt: skip
  env = fake_tools(tmp_path, 'gcloud', 'ssh', 'scp')
  for script, args, tarball in (
    ('tpu_vm.py', ('install', *TPU_ARGS), 'vit-b16-vit_jax-src.tar.gz'),
    ('gpu_box.py', ('setup', '--host=me@box', '--workdir=runs/b16'), 'gpu_box-vit_jax-src.tar.gz'),
  ):
    result = subprocess.run(
      [sys.executable, str(root / 'launch' / script), *args],
      capture_output=True, text=True, env={**os.environ, **env},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
      f'shipping the working tree of {root}: HEAD with 1 edited and 1 untracked '
      '(configs/mine.py) file(s)'
    ]
    path = str(tmp_path / tarball)
    listing = subprocess.run(['tar', 'tzf', path], capture_output=True, text=True).stdout.split()
    assert 'vit_jax/configs/mine.py' in listing and not any('ignored' in n for n in listing)
    shipped = subprocess.run(['tar', 'xzf', path, '-O', 'vit_jax/configs/demo.py'],
                             capture_output=True, text=True).stdout  # fmt: skip
    assert shipped == 'committed = 1\nedited = 2\n'
  after = subprocess.run(['git', '-C', str(root), 'status', '--porcelain'], capture_output=True,
                         text=True).stdout  # fmt: skip
  assert after == status
  assert not subprocess.run(['git', '-C', str(root), 'stash', 'list'], capture_output=True,
                            text=True).stdout  # fmt: skip


def test_untracked_files_too_large_to_ship_are_one_line(tmp_path):
  """A dataset left untracked in the checkout would travel to every worker: refused, naming it."""
  root = _clone(tmp_path)
  with open(root / 'cifar.npz', 'wb') as f:
    f.truncate(60 * 2**20)  # sparse: 60 MiB to git and os.path.getsize, nothing on disk
  result = subprocess.run(
    [sys.executable, str(root / 'launch' / 'tpu_vm.py'), 'install', *TPU_ARGS, '--dry-run'],
    capture_output=True, text=True,
  )  # fmt: skip
  assert result.returncode == 2 and not result.stdout
  assert result.stderr.splitlines() == [
    f'error: 60 MiB of untracked files in {root} would be shipped (the largest: cifar.npz); add '
    'them to .gitignore, or move them out of the checkout'
  ]


def test_gpu_box_run_without_a_gpu_is_one_line():
  """`run` where JAX sees no GPU (this machine): the check's one line, exit status 2, nothing
  of the libraries' start-up and no training started."""
  venv = os.path.dirname(os.path.dirname(sys.executable))
  result = launch('gpu_box.py', 'run', '--workdir=/nonexistent/run', f'--venv={venv}', check=False)
  assert result.returncode == 2, result.stderr
  [line] = result.stderr.splitlines()
  assert line.startswith('error: JAX sees no GPU on this machine (') and line.endswith(
    'check that nvidia-smi lists one and that the venv holds vit_jax[gpu] (JAX with its CUDA '
    'wheels: run setup)'
  )
  [check] = result.stdout.splitlines()  # the check's command, printed as it ran; no training
  assert 'jax.devices("gpu")' in check and 'vit_jax.main' not in check
  assert not os.path.exists('/nonexistent/run')


@pytest.mark.parametrize('script', ['tpu_vm.py', 'slurm.py', 'gpu_box.py'])
def test_help_names_every_flag(script):
  text = launch(script, '--help').stdout
  assert '--workdir' in text and '--dry-run' in text and '--config' in text


def test_tpu_vm_multi_slice_dry_run():
  create, archive, scp, install, run, mkdir, fetch = dry_run(
    'tpu_vm.py', *TPU_ARGS, '--num_slices=2', '--', '--config.batch=8192'
  )
  # Two v4-32 slices as one queued resource; every action reaches all of them.
  assert create[:6] == ['gcloud', 'compute', 'tpus', 'queued-resources', 'create', 'vit-b16']
  assert flags(create) == {
    '--zone': 'us-central2-b',
    '--project': 'my-project',
    '--node-count': '2',
    '--node-prefix': 'vit-b16',
    '--accelerator-type': 'v4-32',
    '--runtime-version': 'tpu-ubuntu2204-base',
  }
  for command in (scp, install, run):
    assert command[:5] == ['gcloud', 'compute', 'tpus', 'queued-resources', command[4]]
    assert '--node=all' in command and '--worker=all' in command
  assert flags(shlex.split(flags(run)['--command'].split(' && ', 1)[1]))['--config.batch'] == '8192'
  (delete,) = dry_run('tpu_vm.py', 'delete', *TPU_ARGS, '--num_slices=2')
  assert delete[3:6] == ['queued-resources', 'delete', 'vit-b16'] and '--force' in delete
  (logs,) = dry_run('tpu_vm.py', 'logs', *TPU_ARGS, '--num_slices=2')
  assert '--node=0' in logs and '--worker=0' in logs


STEP = {'SLURM_JOB_ID': '7', 'SLURM_STEP_ID': '0', 'SLURM_NODEID': '1', 'SLURM_PROCID': '9'}


@pytest.mark.parametrize(
  'environ, num_processes, mistake',
  [
    ({}, None, ''),  # not under SLURM
    ({'SLURM_NTASKS': '1', **STEP}, None, ''),  # one process, all the node's GPUs
    # sbatch --ntasks=2 running the command itself, without srun: it has no job step.
    ({'SLURM_NTASKS': '2', 'SLURM_JOB_ID': '7'}, None, 'runs once, outside srun'),
    # 8 tasks on each of 2 nodes, 8 GPUs each: one per GPU.
    ({'SLURM_NTASKS': '16', 'SLURM_STEP_TASKS_PER_NODE': '8(x2)', 'SLURM_GPUS_ON_NODE': '8',
      **STEP}, None, ''),
    # One task per node on 8-GPU nodes: GPU 0 alone would work.
    ({'SLURM_NTASKS': '2', 'SLURM_STEP_TASKS_PER_NODE': '1(x2)', 'SLURM_GPUS_ON_NODE': '8',
      **STEP}, None, '1 task on a node with 8 GPUs: JAX gives each task the GPU numbered '
     'SLURM_LOCALID, so 7 of them would sit idle'),
    ({'SLURM_NTASKS': '3', 'SLURM_STEP_TASKS_PER_NODE': '2,1', 'SLURM_GPUS_ON_NODE': '2',
      **STEP}, None, '1 task on a node with 2 GPUs'),  # node 1 of "2,1"
    # CPU tasks: no GPUs to leave idle.
    ({'SLURM_NTASKS': '2', 'SLURM_STEP_TASKS_PER_NODE': '1(x2)', **STEP}, None, ''),
    # Flags that contradict the job step.
    ({'SLURM_NTASKS': '4', **STEP}, 2, 'SLURM started 4 tasks but JAX would join 2 processes'),
    ({'SLURM_NTASKS': '2', **STEP}, 2, ''),
  ],
)  # fmt: skip
def test_slurm_launch_mistakes_are_named(environ, num_processes, mistake):
  from vit_jax.core import processes

  found = processes.slurm_mistake(environ, num_processes)
  assert (found.startswith(mistake) or mistake in found) if mistake else found == ''
  assert '\n' not in found


def config_fields(path):
  """The dotted names of every field of the config file `path` (its `get_config()`)."""
  import importlib.util

  spec = importlib.util.spec_from_file_location('launched_config', ROOT / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)

  def names(config, prefix=''):
    for key, value in config.items():
      yield prefix + key
      if hasattr(value, 'items'):
        yield from names(value, f'{prefix}{key}.')

  return set(names(module.get_config()))


def main_commands(commands):
  """The `vit_jax.main` command lines inside a dry run's commands (also within ssh's strings
  and an sbatch script)."""
  found = []
  for command in commands:
    for text in [' '.join(command)] + [a.split('=', 1)[-1] for a in command]:
      for part in text.replace('&&', '\n').splitlines():
        words = shlex.split(part) if 'vit_jax.main' in part else []
        if 'vit_jax.main' in words:
          found.append(words[words.index('vit_jax.main') + 1 :])
  return found


@pytest.mark.parametrize(
  'script, args',
  [
    ('tpu_vm.py', (*TPU_ARGS, '--detach', '--', '--config.batch=4096')),
    ('tpu_vm.py', ('install', 'run', *TPU_ARGS, '--num_slices=2')),
    ('gpu_box.py', ('--host=me@box', '--workdir=runs/b16', '--', '--config.batch=256')),
    ('gpu_box.py', ('--workdir=runs/b16', '--config=vit_jax/configs/demo.py')),
    ('slurm.py', ('--workdir=/shared/b16', '--', '--config.pp.crop=32', '--config.mesh.fsdp=2')),
  ],
)
def test_a_rerun_deletes_nothing_and_the_dry_runs_use_the_current_configs(tmp_path, script, args):
  """Whatever gpu_box.py or tpu_vm.py run again, no command deletes or truncates a file
  (`setup` and `install` unpack the code over the checkout; a detached run appends to its
  log), and every `vit_jax.main` command of a launcher names a config file of this checkout
  and fields it has."""
  output = launch(script, '--dry-run', *args).stdout
  if script != 'slurm.py':  # (which writes its own sbatch script, `cat > ...`)
    assert not re.search(r'\brm\b|(?<![>&])> ', output), output
  commands = [shlex.split(line) for line in output.splitlines() if not line.startswith('#')]
  runs = main_commands(commands)
  assert runs, output
  for run in runs:
    named = dict(a.split('=', 1) for a in run if a.startswith('--') and '=' in a)
    path = named.get('--config', 'vit_jax/configs/demo.py')
    assert (ROOT / path).is_file(), path
    fields = config_fields(path)
    overrides = [k[len('--config.') :] for k in named if k.startswith('--config.')]
    assert all(o in fields for o in overrides), (overrides, path)


def test_the_docs_show_the_sbatch_script_slurm_py_writes():
  docs = (ROOT / 'docs' / 'speed_and_scale.md').read_text()
  shown = docs.split('writes `WORKDIR/launch.sbatch` and runs `sbatch` on it')[1]
  shown = shown.split('```bash\n', 1)[1].split('```', 1)[0]
  output = launch(
    'slurm.py', '--nodes=4', '--gpus_per_node=8', '--workdir=/shared/runs/b16',
    '--partition=gpu', '--time=24:00:00', '--venv=/shared/vit_jax/.venv',
    '--repo=/path/to/vit_jax', '--dry-run', '--', '--config.batch=4096',
  ).stdout  # fmt: skip
  assert shown == output.split("<<'EOF'\n", 1)[1].split('\nEOF\n')[0] + '\n'


@pytest.mark.parametrize(
  'hostlist, names',
  [
    ('n1', ['n1']),
    ('n[1-2]', ['n1', 'n2']),
    ('gpu[08-10,12],cpu7', ['gpu08', 'gpu09', 'gpu10', 'gpu12', 'cpu7']),
    ('r[1-2]n[01-02]', ['r1n01', 'r1n02', 'r2n01', 'r2n02']),
  ],
)
def test_slurm_hostlists_expand_to_the_node_names(hostlist, names):
  from vit_jax.core import coordinator

  assert coordinator.hostnames(hostlist) == names


def fake_scontrol(stdout='', returncode=0, missing=False):
  """subprocess.run for `scontrol show node` answering `stdout` (or absent: `missing`)."""

  def run(command, **kwargs):
    assert command[:3] == ['scontrol', 'show', 'node'], command
    if missing:
      raise FileNotFoundError('scontrol')
    return subprocess.CompletedProcess(command, returncode, stdout=stdout, stderr='')

  return run


def test_the_slurm_coordinator_is_the_first_node_at_its_node_addr_and_jax_port():
  """Process 0's node, at the address SLURM reaches it by (NodeAddr), on JAX's own port for the
  job; the name where scontrol gives none; an address or port the user set wins."""
  from jax._src.clusters import slurm_cluster

  from vit_jax.core import coordinator

  step = {'SLURM_JOB_ID': '1234567', 'SLURM_STEP_NODELIST': 'gpu[07-08]'}
  jax_port = int(
    mock_environ(step, slurm_cluster.SlurmCluster.get_coordinator_address, None, None)
    .rsplit(':', 1)[1]
  )  # fmt: skip
  shown = 'NodeName=gpu07 Arch=x86_64 CoresPerSocket=8 NodeAddr=10.1.0.7 NodeHostName=gpu07\n'
  assert coordinator.slurm_coordinator(step, run=fake_scontrol(shown)) == (
    coordinator.Coordinator('gpu07', '10.1.0.7', jax_port, "gpu07's NodeAddr")
  )
  for run in (fake_scontrol(missing=True), fake_scontrol('', returncode=1)):
    found = coordinator.slurm_coordinator(step, run=run)
    assert (found.node, found.host, found.port) == ('gpu07', 'gpu07', jax_port)
  found = coordinator.slurm_coordinator({**step, 'JAX_COORDINATOR_PORT': '7000'}, run=run)
  assert found.port == 7000
  given = {**step, 'JAX_COORDINATOR_ADDRESS': '[fd00::7]:9000'}
  found = coordinator.slurm_coordinator(given, run=fake_scontrol(missing=True))
  assert found == coordinator.Coordinator('gpu07', 'fd00::7', 9000, 'JAX_COORDINATOR_ADDRESS')
  assert found.address == '[fd00::7]:9000'
  found = coordinator.slurm_coordinator(step, explicit='10.0.0.1:8476', run=run)
  assert (found.host, found.port, found.source) == ('10.0.0.1', 8476, '--coordinator_address')


def mock_environ(environ, function, *args):
  """`function(*args)` with os.environ holding `environ` (as JAX's SLURM detection reads it)."""
  saved = dict(os.environ)
  os.environ.update(environ)
  try:
    return function(*args)
  finally:
    os.environ.clear()
    os.environ.update(saved)


JOIN_SCRIPT = """
import sys, time
from vit_jax.core import coordinator
place = coordinator.Coordinator('n1', '127.0.0.1', int(sys.argv[1]), "n1's NodeAddr")
join = coordinator.Join(place, 1, 2, 'n2', {'VIT_JAX_JOIN_TIMEOUT_S': sys.argv[2]})
def initialize(address, timeout):  # a coordinator that never lets it in
  print('joining', flush=True)
  time.sleep(600)
join.run(initialize)
"""


@pytest.mark.parametrize('signalled', [False, True])
def test_a_join_that_never_completes_ends_in_one_line(signalled):
  """A process waiting to join: at its deadline, one line naming its node, the coordinator's
  address and what to check, status 2 (no requeue); a SIGTERM well before the deadline (a
  preemption) ends it with status 143 (requeued), in one line too."""
  with socket.socket() as closed:
    closed.bind(('127.0.0.1', 0))
    port = closed.getsockname()[1]  # nothing listens there
  process = subprocess.Popen(
    [sys.executable, '-c', JOIN_SCRIPT, str(port), '60' if signalled else '3'],
    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    env={**os.environ, 'PYTHONPATH': str(ROOT)},
  )  # fmt: skip
  assert process.stdout.readline() == 'joining\n'
  if signalled:
    process.send_signal(signal.SIGTERM)
  stderr = process.communicate(timeout=60)[1]
  if signalled:
    assert process.returncode == 143
    assert stderr == (
      'error: process 1 of 2 (node n2) stopped by SIGTERM while the processes were joining at '
      f"n1 (127.0.0.1:{port}, n1's NodeAddr) (preempted, cancelled, or another process ended: "
      'its line says why); nothing was written. Run the same command again (under SLURM: the '
      'job requeues itself) to start\n'
    )
  else:
    assert process.returncode == 2
    assert stderr == (
      'error: process 1 of 2 (node n2) gave up after 3 s: could not join the coordinator n1 '
      f"(127.0.0.1:{port}, n1's NodeAddr): connection refused (nothing listens there: process 0 "
      'is not up, or it is another host). Check that every node reaches '
      f'127.0.0.1:{port} (the port open between the nodes, the address on their network) and '
      "the other processes' lines; if the processes only start more than that apart, raise "
      'VIT_JAX_JOIN_TIMEOUT_S\n'
    )
