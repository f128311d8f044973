"""Launch scripts: the commands of their dry runs, and that a real run executes exactly those.

Real runs use stand-ins for gcloud, ssh, scp, sbatch and srun placed first on
PATH, which record their arguments; the SLURM script is executed by bash.
"""

import os
import pathlib
import shlex
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

  # The committed tree goes to every worker and is installed with the TPU extra.
  assert archive[:4] == ['git', '-C', str(ROOT), 'archive'] and archive[-1] == 'HEAD'
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
  assert command.endswith(' > run.log 2>&1 < /dev/null &')
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
  # git archive really ran: the tarball holds the committed tree.
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

  directives = dict(
    (line[len('#SBATCH ') :] + '=').split('=')[:2]
    for line in script.splitlines()
    if line.startswith('#SBATCH ')
  )
  assert directives == {
    '--job-name': 'vit_jax',
    '--nodes': '4',
    '--ntasks-per-node': '8',
    '--gpus-per-node': '8',
    '--cpus-per-task': '8',
    '--time': '02:00:00',
    '--output': f'{workdir}/slurm-%j.out',
    '--partition': 'gpu',
    '--signal': 'TERM@300',
    '--requeue': '',
  }
  # JAX's share of each GPU's memory: what the compile command checks a program against.
  assert 'export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9' in script.splitlines()
  srun = shlex.split(script.splitlines()[-1])
  assert srun[:5] == ['srun', '--kill-on-bad-exit=1', 'python', '-m', 'vit_jax.main']
  assert flags(srun[5:]) == {'--workdir': str(workdir), '--config.batch': '4096'}

  # Submitting writes that script; bash runs it (with stand-ins for srun and
  # the venv's activate script) into exactly that srun call.
  env = fake_tools(tmp_path, 'sbatch', 'srun')
  launch('slurm.py', *args, env=env)
  assert pathlib.Path(path).read_text() == script + '\n'
  (tmp_path / 'venv' / 'bin').mkdir(parents=True)
  (tmp_path / 'venv' / 'bin' / 'activate').write_text('export VIT_JAX_VENV=1\n')
  subprocess.run(['bash', path], env={**os.environ, **env}, check=True)
  calls = [shlex.split(line) for line in (tmp_path / 'calls').read_text().splitlines()]
  assert calls == [['sbatch', path], srun]


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
  assert shlex.split(steps[-1]) == [
    '.venv/bin/python',
    '-m',
    'vit_jax.main',
    '--workdir=runs/b16',
    '--config.batch=256',
  ]
  assert fetch == [
    'scp',
    'me@box:vit_jax/runs/b16/summary.json',
    'me@box:vit_jax/runs/b16/params.npz',
    'results',
  ]

  env = fake_tools(tmp_path, 'ssh', 'scp')
  args = ('--host=me@box', '--workdir=runs/b16', 'setup', 'run')
  expected = launch('gpu_box.py', '--dry-run', *args, env=env).stdout.splitlines()
  launch('gpu_box.py', *args, env=env)
  calls = (tmp_path / 'calls').read_text().splitlines()
  assert calls == [line for line in expected if not line.startswith('git ')]


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
