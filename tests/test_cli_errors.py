"""`python -m vit_jax.main` and `python -m vit_jax.compile` as a user types them: every error
one `error:` line, from wherever in the command it is raised, and no workdir left behind.

Each case is a child process (JAX must start afresh to meet JAX_PLATFORMS); about 4 s each.
"""

import concurrent.futures
import os
import subprocess
import sys

from conftest import OFFLINE
from conftest import run_module
from conftest import said
from conftest import subprocess_env
import numpy as np
from PIL import Image
import pytest


def _command(name, *args, platform='cpu'):
  env = subprocess_env()
  env['JAX_PLATFORMS'] = platform
  return run_module(name, *args, env=env)


def _one_line(result) -> str:
  assert result.returncode == 2, result.stderr[-3000:]
  lines = said(result.stderr)
  assert len(lines) == 1 and lines[0].startswith('error: '), result.stderr[-3000:]
  return lines[0]


@pytest.mark.parametrize('platform', ['cuda', 'GPU', 'tpu'])
def test_an_absent_jax_platform_is_one_line_also_when_the_warmup_is_fitted(tmp_path, platform):
  """A run of 2 steps fits the demo's warm-up, which asks JAX for the process index: that
  happens inside the command's reporter, so the platform JAX cannot start is the one line."""
  workdir = tmp_path / 'run'
  result = _command('main', f'--workdir={workdir}', '--config.total_steps=2', platform=platform)
  line = _one_line(result)
  assert line.startswith(f'error: JAX_PLATFORMS={platform}: JAX cannot start it on this machine')
  assert line.endswith('unset JAX_PLATFORMS to use what the machine has, or set JAX_PLATFORMS=cpu')
  assert not workdir.exists()


def test_a_batch_larger_than_the_machine_is_one_line_before_the_run_starts(tmp_path):
  workdir = tmp_path / 'run'
  result = _command('main', f'--workdir={workdir}', '--config.batch=100000000000')
  line = _one_line(result)
  assert line.startswith('error: batch=100,000,000,000: one batch of 16 px images takes ')
  assert line.endswith('GiB; lower --config.batch')
  assert not workdir.exists()


def test_config_arguments_a_config_file_does_not_take_are_one_line(tmp_path):
  workdir = tmp_path / 'run'
  result = _command('main', f'--workdir={workdir}', '--config=configs/demo.py:foo')
  assert _one_line(result) == (
    'error: --config=configs/demo.py:foo: get_config() takes 0 positional arguments but 1 was '
    'given; it takes no :ARGS, pass --config=configs/demo.py'
  )
  assert not workdir.exists()


def test_compile_on_an_absent_jax_platform_is_one_line():
  result = _command('compile', '--config=configs/demo.py', platform='cuda')
  assert _one_line(result).startswith('error: JAX_PLATFORMS=cuda: JAX cannot start it')


# ---------------------------------------------------------------------------
# Bad inputs of python -m vit_jax.main and compile, each as a user types it.


LOOKUP_PATCHED = (
  'import runpy, sys; from vit_jax.core import files; '
  f'files._unreachable = lambda scheme: {OFFLINE!r} if scheme == "gs" else None; '
  'sys.argv[0] = "vit_jax.main"; runpy.run_module("vit_jax.main", run_name="__main__")'
)


_TYPO = 'from vit_jax.configs import demo\n\n\ndef get_config():\n  config = demo.get_config()\n'


MAIN_ERRORS = [
  # A misspelt field in a config file, as a flag would be (--config.total_step=4).
  (
    ['--config={tmp}/typo.py'],
    {'typo.py': _TYPO + '  config.total_step = 4\n  return config\n'},
    "config file {tmp}/typo.py: unknown config field 'total_step' (no run reads it); did you "
    'mean total_steps?',
  ),
  (
    ['--config={tmp}/typo.py'],
    {'typo.py': _TYPO + '  config.pp.crops = 8\n  return config\n'},
    "config file {tmp}/typo.py: unknown config field 'pp.crops' (no run reads it); did you mean "
    'pp.crop?',
  ),
  # A config file that is not Python, a workdir that is a file.
  (
    ['--config={tmp}/syntax.py'],
    {'syntax.py': 'def get_config(:\n'},
    'config file {tmp}/syntax.py, line 1: SyntaxError: invalid syntax: def get_config(:; fix',
  ),
  (
    ['--config={tmp}/config.yaml'],
    {'config.yaml': 'total_steps: 4\n'},
    'config file {tmp}/config.yaml is not a Python file',
  ),
  (
    ['--workdir={tmp}/file.txt'],
    {'file.txt': ''},
    "{tmp}/file.txt is a file: a workdir is a folder (made when missing) for the run's",
  ),
  # A class folder in one split only, through the command.
  (
    ['--config.dataset={tmp}/data'],
    {'data/train/circle/a.png': 'png', 'data/train/square/a.png': 'png'}
    | {'data/test/Circle/a.png': 'png', 'data/test/square/a.png': 'png'},
    "{tmp}/data: class folder 'Circle' is in test but not in train (is it 'circle' there?)",
  ),
  # Offline: the fine-tuning recipe's default pretrained checkpoint, and a gs:// workdir.
  (
    ['--config=configs/finetune.py:testing,digits'],
    {},
    '--config.pretrained_path: gs://vit_models/imagenet21k/testing.npz: cannot reach '
    'storage.googleapis.com (Temporary failure in name resolution): no network here; copy the '
    'files to a local folder and pass that path instead (--config.pretrained_path=LOCAL_COPY.npz)',
  ),
  (
    ['--workdir=gs://bucket/run'],
    {},
    'gs://bucket/run/config.json: cannot reach storage.googleapis.com',
  ),
]


def _write(tmp_path, written):
  for name, text in written.items():
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if text == 'png':
      Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(path)
    else:
      path.write_text(text)


def _main(tmp_path, argv, env=None, **kw):
  args = [a.format(tmp=tmp_path) for a in argv]
  if not any(a.startswith('--workdir') for a in args):
    args.append(f'--workdir={tmp_path}/run')
  return subprocess.run(
    [sys.executable, '-c', LOOKUP_PATCHED, *args],
    env=env or subprocess_env(),
    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    capture_output=True,
    text=True,
    timeout=300,
    **kw,
  )


@pytest.mark.slow
def test_main_says_one_line_for_each_bad_input(tmp_path):
  def case(i):
    argv, written, _ = MAIN_ERRORS[i]
    _write(tmp_path / str(i), written)
    return _main(tmp_path / str(i), argv)

  # A process start each (most of the time): two at a time.
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results = list(pool.map(case, range(len(MAIN_ERRORS))))
  for i, result in enumerate(results):
    lines = said(result.stderr)
    assert result.returncode == 2 and lines == [lines[-1]], result.stderr[-2000:]
    assert lines[-1].startswith('error: ' + MAIN_ERRORS[i][2].format(tmp=tmp_path / str(i)))
    assert not os.path.exists(tmp_path / str(i) / 'run' / 'lock.json')


FLAG_CASES = [
  (
    'main',
    ['--foo'],
    {},
    'error: unknown flag --foo; the flags are --config, --coordinator_address, --num_processes, '
    '--process_id, --verbosity, --workdir and --config.FIELD=VALUE (python -m vit_jax.main '
    '--help lists them)',
  ),
  ('main', ['--workdr=x'], {}, 'error: unknown flag --workdr; did you mean --workdir? the flags'),
  (
    'main',
    ['--config={tmp}/imports.py'],
    {},
    'error: config file {tmp}/imports.py, line 1: ModuleNotFoundError: No module named '
    "'no_such_module' (import no_such_module); install the module or fix the import",
  ),
  (
    'main',
    ['--config={tmp}/returns_dict.py', '--config.total_steps=4'],
    {},
    'error: config file {tmp}/returns_dict.py: get_config() returned a dict, not an '
    'ml_collections.ConfigDict; return one',
  ),
  (
    'main',
    ['--config=configs/vit_b16.py:imagenet21k'],
    {},
    'error: config file configs/vit_b16.py not found in {tmp}; the clone has {root}/configs/'
    'vit_b16.py: pass --config={root}/configs/vit_b16.py:imagenet21k (or run from {root})',
  ),
  (
    'main',
    ['--config.total_steps=0'],  # were the variable ignored, this line would say so instead
    {'VIT_JAX_VERBOSITY': 'abc'},
    "error: VIT_JAX_VERBOSITY='abc' is not an integer; set -1 (warnings only, the default), 0 "
    '(full library logs) or 1 (debug), or unset it',
  ),
  (
    'compile',
    ['--config={root}/configs/demo.py', '--bar=1'],
    {},
    'error: unknown flag --bar; the flags are --config, --fit,',
  ),
]


@pytest.mark.parametrize(
  'command, argv, env, line', FLAG_CASES, ids=[f'{i}-{c[0]}' for i, c in enumerate(FLAG_CASES)]
)
def test_a_flag_or_config_file_main_cannot_take_is_one_line(command, argv, env, line, tmp_path):
  """A config file importing a missing module or whose get_config returns a dict, an unknown flag
  (with the flag it may mean), a config path relative to another folder, and
  VIT_JAX_VERBOSITY=abc: each one line."""
  (tmp_path / 'imports.py').write_text('import no_such_module\n')
  (tmp_path / 'returns_dict.py').write_text('def get_config():\n  return {"total_steps": 4}\n')
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  argv = [a.format(tmp=tmp_path, root=root) for a in argv]
  result = subprocess.run(
    [sys.executable, '-m', f'vit_jax.{command}', *argv]
    + ([f'--workdir={tmp_path}/w'] if command == 'main' else []),
    env={**subprocess_env(), **env},
    capture_output=True,
    text=True,
    cwd=tmp_path,
    timeout=300,
  )
  lines = said(result.stderr)
  assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
  assert lines[0].startswith(line.format(tmp=tmp_path, root=root)), lines[0]
  assert not os.path.exists(tmp_path / 'w')


@pytest.mark.parametrize('platform', ['gpu', 'cuda'])
def test_a_platform_the_machine_lacks_is_one_line(platform, user_files):
  """`JAX_PLATFORMS=gpu` or `=cuda` without a GPU is one line saying what to set."""
  env = subprocess_env()
  env['JAX_PLATFORMS'] = platform
  argv = ['-m', 'vit_jax.predict', f'--checkpoint={user_files["npz"]}', '--model=testing']
  result = subprocess.run(
    [sys.executable, *argv, str(user_files['png'])], env=env, capture_output=True, text=True
  )
  if result.returncode == 0:
    pytest.skip(f'this machine has a {platform} device')
  assert result.returncode == 2 and said(result.stderr) == [
    f'error: JAX_PLATFORMS={platform}: JAX cannot start it on this machine (its GPU plugin '
    'found no GPU, or no CUDA); unset JAX_PLATFORMS to use what the machine has, or set '
    'JAX_PLATFORMS=cpu'
  ], result.stderr[-3000:]
