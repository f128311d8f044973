"""`python -m vit_jax.main` and `python -m vit_jax.compile` as a user types them: every error
one `error:` line, from wherever in the command it is raised, and no workdir left behind.

Each case is a child process (JAX must start afresh to meet JAX_PLATFORMS); about 4 s each.
"""

import subprocess
import sys

from conftest import ROOT
from conftest import said
from conftest import subprocess_env
import pytest


def _command(name, *args, platform='cpu'):
  env = subprocess_env()
  env['JAX_PLATFORMS'] = platform
  return subprocess.run(
    [sys.executable, '-m', f'vit_jax.{name}', *args],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,  # where configs/ is
  )


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
