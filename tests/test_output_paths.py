"""Where the commands write: a folder as the output of a one-file format gets the file inside;
no command writes over a run's work, and files beside it are written."""

import os

from conftest import run_command
from conftest import tiny_workdir
import pytest

from vit_jax import workdir as workdir_lib


@pytest.mark.parametrize('fmt, name', [('npz', 'params.npz'), ('timm', 'model.safetensors')])
def test_export_to_a_folder_writes_the_file_inside(fmt, name, user_files, capsys):
  """A folder as --output of a one-file format gets the file inside (the README shows one for
  hf)."""
  from vit_jax import export

  if fmt == 'timm':
    pytest.importorskip('safetensors')
  out = user_files['tmp'] / 'exported'
  out.mkdir()
  argv = [
    f'--checkpoint={user_files["npz"]}',
    '--model=testing',
    f'--format={fmt}',
    f'--output={out}',
  ]
  code, printed, err = run_command(export.main, argv, capsys)
  assert code == 0 and printed.startswith(f'wrote {fmt} to {out / name}'), err
  assert (out / name).stat().st_size > 1000
  from vit_jax.interop import export as interop

  assert interop.output_path('onnx', f'{out}/') == f'{out}/model.onnx'
  assert interop.output_path('onnx', str(out / 'm.onnx')) == str(out / 'm.onnx')


OVER_A_RUN = [
  (
    'export',
    ['--checkpoint={npz}', '--model=testing', '--format=npz', '--output={run}'],
    '{run}/params.npz is in {run}, which',
  ),
  (
    'export',
    ['--checkpoint={npz}', '--model=testing', '--format=npz', '--output={run}/params.npz'],
    '{run}/params.npz is in {run}, which',
  ),
  ('export', ['--checkpoint={npz}', '--model=testing', '--format=hf', '--output={run}'], '{run}'),
  (
    'analyze',
    ['--checkpoint={npz}', '--model=testing', '--images={png}', '--output={run}'],
    '{run}',
  ),
  (
    'evaluate',
    ['--checkpoint={npz}', '--model=testing', '--dataset=digits', '--output={run}/summary.json'],
    '{run}/summary.json is in {run}, which',
  ),
  ('jft', ['--folder={tmp}/images', '--out={run}'], '{run}'),
  (
    'benchmark',
    ['--model=testing', '--json={run}/summary.json'],
    '{run}/summary.json is in {run}, which',
  ),
]


@pytest.mark.parametrize(
  'name, argv, what', OVER_A_RUN, ids=[f'{i}-{case[0]}' for i, case in enumerate(OVER_A_RUN)]
)
def test_no_command_writes_over_a_runs_work(name, argv, what, user_files, tmp_path, capsys):
  """Every command that writes refuses, in one line and before its work, an output in a run's
  workdir that would replace its files (`workdir.check_output`)."""
  import importlib

  run = tiny_workdir(tmp_path / 'run', 'digits')
  workdir_lib.write_summary(run, {'step': 5, 'model': 'testing'})
  before = {f: (tmp_path / 'run' / f).read_bytes() for f in os.listdir(run)}
  main = importlib.import_module(f'vit_jax.{name}').main
  paths = {**user_files, 'run': run}
  code, out, err = run_command(main, [a.format(**paths) for a in argv], capsys)
  assert code == 2 and out == '' and len(err.strip().splitlines()) == 1, err
  assert err.startswith(
    f"error: --{argv[-1][2:].split('=')[0]} {what.format(**paths)} holds a run's work (params.npz"
  ), err
  assert {f: (tmp_path / 'run' / f).read_bytes() for f in os.listdir(run)} == before


def test_an_export_beside_a_runs_files_is_written(user_files, tmp_path, capsys):
  """What the guard leaves alone: a file of another name in the run's folder, a sub-folder."""
  from vit_jax import export

  run = tiny_workdir(tmp_path / 'run', 'digits')
  for output in (f'{run}/exported.npz', f'{run}/export/'):
    argv = [f'--checkpoint={run}', '--format=npz', f'--output={output}']
    code, out, err = run_command(export.main, argv, capsys)
    assert code == 0 and out.startswith('wrote npz to '), err
  assert sorted(os.listdir(run)) == ['config.json', 'export', 'exported.npz', 'params.npz']
