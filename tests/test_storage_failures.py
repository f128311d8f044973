"""Writes that fail or are cut short: a full disk is one line and leaves nothing behind; what a
killed process left half-written is removed by the next write of the same path."""

import errno
import os
import subprocess
import sys

from conftest import run_command
from conftest import tiny_params
import pytest

from vit_jax import checkpoint


def _dead_pid() -> int:
  """The id of a process that has ended (what a kill -9 leaves behind in a temporary name)."""
  child = subprocess.Popen([sys.executable, '-c', 'pass'])
  child.wait()
  return child.pid


class _Full:
  """Writes that fail as on a full disk, after `after` bytes."""

  @staticmethod
  def savez(file, **arrays):
    file.write(b'\0' * 1000)
    raise OSError(errno.ENOSPC, 'No space left on device', getattr(file, 'name', None))

  @staticmethod
  def safetensors(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError(
      'Error while serializing: I/O error: No space left on device (os error 28)'
    )


@pytest.mark.parametrize('fmt', ['npz', 'hf', 'timm'])
def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(
  fmt, user_files, monkeypatch, capsys
):
  """An export onto a full disk, in each format, is one line and leaves no file behind (no
  x.npz.tmp-*, no SafetensorError traceback)."""
  pytest.importorskip('safetensors')
  from vit_jax import export
  from vit_jax.interop import torch_layout

  monkeypatch.setattr(checkpoint.np, 'savez', _Full.savez)
  monkeypatch.setattr(torch_layout, 'save_safetensors', _Full.safetensors)
  out = user_files['tmp'] / 'out'
  out.mkdir()
  argv = [f'--checkpoint={user_files["npz"]}', '--model=testing', f'--format={fmt}']
  code, _, err = run_command(export.main, argv + [f'--output={out}/x'], capsys)
  assert code == 2 and err == (
    f'error: {out}/x: cannot write it (no space left on device); nothing was written there. '
    'Free space there, or pass another --output\n'
  ), err
  assert os.listdir(out) == []


def test_a_full_disk_or_a_kill_leaves_no_temporary_npz_for_good(tmp_path, monkeypatch):
  """A failed write of params.npz removes its temporary file, and the next write removes one that
  a killed process left (a live process's is kept)."""
  params = tiny_params(3)
  stale = tmp_path / f'params.npz.tmp-{_dead_pid()}'
  stale.write_bytes(b'half a file')
  running = tmp_path / f'params.npz.tmp-{os.getppid()}'  # a live process's write: kept
  running.write_bytes(b'being written')
  with monkeypatch.context() as patch:
    patch.setattr(checkpoint.np, 'savez', _Full.savez)
    with pytest.raises(OSError):
      checkpoint.save_npz(params, tmp_path / 'params.npz')
  assert sorted(os.listdir(tmp_path)) == [running.name]
  checkpoint.save_npz(params, tmp_path / 'params.npz')
  assert sorted(os.listdir(tmp_path)) == ['params.npz', running.name]


def test_an_export_a_kill_cut_short_is_cleaned_by_the_next(user_files, capsys):
  """What a `kill -9` during an export left beside the output (a staged folder, a temporary file)
  is removed by the next export of the same path."""
  from vit_jax import export

  out, pid = user_files['tmp'] / 'exports', _dead_pid()
  (out / f'.x.npz.tmp-{pid}' / 'x.npz').mkdir(parents=True)  # a staged export, killed
  (out / f'x.npz.tmp-{pid}').write_bytes(b'half')  # a save_npz writing in place, killed
  argv = [f'--checkpoint={user_files["npz"]}', '--model=testing', '--format=npz']
  code, out_, err = run_command(export.main, argv + [f'--output={out}/x.npz'], capsys)
  assert code == 0, err
  assert os.listdir(out) == ['x.npz']


@pytest.mark.slow
def test_a_savedmodel_export_replaces_what_a_killed_one_left(user_files, capsys):
  """TensorFlow writes a SavedModel's variables under variables/variables_temp first; what a kill
  -9 left there is replaced by the next export into the same folder."""
  pytest.importorskip('tensorflow')
  from vit_jax import export

  out = user_files['tmp'] / 'sm'
  left = out / 'variables' / 'variables_temp' / 'part-00000-of-00001.data-00000-of-00001.temp'
  left.parent.mkdir(parents=True)
  left.write_bytes(b'half')
  argv = [f'--checkpoint={user_files["npz"]}', '--model=testing', '--format=savedmodel']
  code, out_, err = run_command(export.main, argv + [f'--output={out}'], capsys)
  assert code == 0 and out_ == f'wrote savedmodel to {out}\n' and err == '', err
  assert sorted(os.listdir(out / 'variables')) == [
    'variables.data-00000-of-00001',
    'variables.index',
  ]
  assert [p for p in os.listdir(user_files['tmp']) if '.tmp-' in p] == []
