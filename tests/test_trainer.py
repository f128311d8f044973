"""Whole runs of `python -m vit_jax.main`: outputs, resume, preemption, NaN, devices, hosts.

Each run is a subprocess on the built-in dataset with a tiny schedule, so a
test sees exactly what a user sees: files in the workdir, exit codes, stderr.
"""

import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from conftest import MAIN
from conftest import assert_bitwise_equal
from conftest import assert_close
from conftest import assert_trees_close
from conftest import batch_sharding
from conftest import data_config
from conftest import final_params
from conftest import gpu_plugin_notice
from conftest import heartbeat_line
from conftest import said
from conftest import start_ranks
from conftest import subprocess_env
from conftest import tiny_run_config
from conftest import tiny_run_flags
import jax
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import workdir as workdir_lib
from vit_jax.configs import common
from vit_jax.data import pipeline
from vit_jax.evaluation import classify
from vit_jax.evaluation import loader
from vit_jax.training import loop

# The tests' one tiny run (conftest.TINY_RUN), as flags of python -m vit_jax.main.
TINY = tiny_run_flags()


def command(workdir, *overrides):
  return [*MAIN, f'--workdir={workdir}', *TINY, *overrides]


def run(workdir, *overrides, devices=1, check=True, timeout=600):
  result = subprocess.run(
    command(workdir, *overrides),
    env=subprocess_env(devices),
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  if check and result.returncode:
    raise AssertionError(f'run failed ({result.returncode}):\n{result.stderr[-3000:]}')
  return result


def snapshot(workdir):
  """Every file under `workdir` with its bytes."""
  files = {}
  for root, _, names in os.walk(workdir):
    for name in names:
      path = os.path.join(root, name)
      with open(path, 'rb') as f:
        files[os.path.relpath(path, workdir)] = f.read()
  return files


def copy_run(workdir, target, leave_out=()):
  shutil.copytree(
    workdir, target, ignore=lambda folder, names: [n for n in names if n in leave_out]
  )
  return str(target)


def one_line_error(result):
  """The error line of a refused run, after checking it is the only thing said besides progress."""
  assert result.returncode == 2, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  # Progress is absl INFO lines; W/E lines or anything else would be noise.
  lines = said(result.stderr)
  assert len(lines) == 1 and lines[0].startswith('error: '), result.stderr[-3000:]
  return lines[0]


@pytest.fixture(scope='module')
def reference_run(tmp_path_factory):
  """One uninterrupted run that other tests compare against."""
  workdir = str(tmp_path_factory.mktemp('reference'))
  # Few-shot probes at step 12 and at the end (they do not change training).
  result = run(
    workdir,
    "--config.fewshot.datasets=('digits',)",
    '--config.fewshot.every=12',
    '--config.fewshot.shots=(1,5)',
    '--config.fewshot.seeds=(0,)',
  )
  return workdir, result


@pytest.mark.slow
def test_outputs_of_a_run(reference_run):
  workdir, result = reference_run
  summary = json.load(open(os.path.join(workdir, 'summary.json')))
  for key in ('step', 'train_loss', 'test_accuracy', 'wall_time_s', 'img_per_sec'):
    assert key in summary
  assert summary['step'] == 24
  # Every test example, exactly once.
  assert summary['test_examples'] == pipeline.get_info(common.get_config()).num_test
  assert summary['img_per_sec'] > 0
  # The same accuracy from params.npz alone, through `python -m vit_jax.evaluate`'s code.
  loaded = loader.load_model(workdir, 'testing')
  recomputed = classify.evaluate(
    loaded, data_config('digits', batch_eval=100, **{'pp.crop': 16}), 'test', batch_sharding()
  )
  assert recomputed['top1'] == summary['test_accuracy'] > 0.2
  lines = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  logged = [l for l in lines if 'train_loss' in l]
  assert [l['step'] for l in logged] == [4, 8, 12, 16, 20, 24]
  for l in logged:
    assert {'learning_rate', 'grad_norm', 'img_per_sec', 'mfu'} <= set(l)
    assert 0.0 < l['mfu'] < 1.0
  assert any('test_accuracy' in l and l['step'] == 12 for l in lines)
  fewshot_lines = [l for l in lines if 'fewshot/digits_5shot' in l]
  assert [l['step'] for l in fewshot_lines] == [12, 24]
  assert summary['fewshot/digits_5shot'] == fewshot_lines[-1]['fewshot/digits_5shot'] > 0.2
  assert logged[-1]['train_loss'] < logged[0]['train_loss'] - 0.1  # it learns
  assert 'step 24/24' in result.stdout and 'ETA' in result.stdout
  # params.npz is the public layout of the configured model.
  flat = final_params(workdir)
  assert flat['Transformer/posembed_input/pos_embedding'].shape == (1, 2, 10)
  assert flat['head/kernel'].shape == (10, 10)
  # Three most recent checkpoints are kept.
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['16', '24', '8']


@pytest.mark.slow
def test_rerun_of_a_finished_run_reports_it_and_changes_nothing(reference_run, tmp_path):
  workdir = copy_run(reference_run[0], tmp_path / 'done')
  before = snapshot(workdir)
  result = run(workdir)
  assert f'{workdir} has finished: step 24, test accuracy' in result.stdout
  # The same bytes: summary.json (few-shot entries included), params, metrics, checkpoints.
  assert snapshot(workdir) == before


@pytest.mark.slow
def test_a_run_stopped_after_its_last_checkpoint_sums_up_the_whole_run(reference_run, tmp_path):
  workdir = copy_run(reference_run[0], tmp_path / 'cut', leave_out=('summary.json', 'params.npz'))
  summary = loop.train_and_evaluate(tiny_run_config(), workdir)
  assert summary['resumed_from_step'] == 24
  assert json.load(open(os.path.join(workdir, 'summary.json'))) == summary
  reference = json.load(open(os.path.join(reference_run[0], 'summary.json')))
  # The loss of the last progress line and the loop's speed come from the earlier session.
  assert summary['train_loss'] == reference['train_loss']
  totals = json.load(open(os.path.join(workdir, 'checkpoints', '24', 'run', 'metadata')))
  assert summary['img_per_sec'] == pytest.approx(
    32 * totals['timed_steps'] / totals['train_time_s']
  )
  assert totals['timed_steps'] == 23 and summary['wall_time_s'] > totals['wall_time_s'] > 0
  assert_bitwise_equal(final_params(workdir), final_params(reference_run[0]))


@pytest.mark.slow
def test_a_truncated_latest_checkpoint_is_set_aside_and_the_one_before_resumed(
  reference_run, tmp_path
):
  workdir = copy_run(reference_run[0], tmp_path / 'bad', leave_out=('summary.json', 'params.npz'))
  latest = os.path.join(workdir, 'checkpoints', '24')
  for root, _, names in os.walk(latest):
    for name in names:
      path = os.path.join(root, name)
      os.truncate(path, os.path.getsize(path) // 2)
  truncated = snapshot(latest)
  result = run(workdir)
  # Nothing but INFO lines: no traceback, no orbax errors.
  assert said(result.stderr) == [], result.stderr[-3000:]
  assert (
    'checkpoint at step 24 does not restore (JSONDecodeError: ' in result.stdout
    and f'moved to {workdir}/corrupt_checkpoints; resuming from step 16' in result.stdout
  )
  assert 'Resuming from the checkpoint at step 16' in result.stdout
  # Kept aside as it was, not deleted; the run finished as if nothing had happened.
  assert snapshot(os.path.join(workdir, 'corrupt_checkpoints', '24')) == truncated
  assert_bitwise_equal(final_params(workdir), final_params(reference_run[0]))
  summary = json.load(open(os.path.join(workdir, 'summary.json')))
  reference = json.load(open(os.path.join(reference_run[0], 'summary.json')))
  assert summary['step'] == 24 and summary['train_loss'] == reference['train_loss']


@pytest.mark.slow
def test_resuming_with_another_model_or_batch_is_one_line(reference_run, tmp_path):
  workdir = copy_run(reference_run[0], tmp_path / 'run', leave_out=('summary.json',))
  before = snapshot(workdir)
  result = run(workdir, '--config.model=ViT-Demo_4', '--config.batch=64', check=False)
  assert one_line_error(result) == (
    f"error: {workdir} holds a run with batch=32, model='testing' where this command has "
    "batch=64, model='ViT-Demo_4'. To resume it, run with --config.batch=32 "
    '--config.model=testing; to start afresh, use another --workdir '
    f'(--config.pretrained_path={workdir} starts from its weights)'
  )
  assert snapshot(workdir) == before


@pytest.mark.slow
def test_a_second_run_on_a_workdir_is_refused_and_the_first_loses_nothing(reference_run, tmp_path):
  workdir = str(tmp_path / 'shared')
  first = subprocess.Popen(
    command(workdir), env=subprocess_env(), stderr=subprocess.PIPE, text=True
  )
  _wait_for(lambda: os.path.exists(os.path.join(workdir, 'lock.json')), first)
  # Paused, so that it is surely still running when the second one (this process) starts.
  first.send_signal(signal.SIGSTOP)
  try:
    with pytest.raises(workdir_lib.WorkdirError) as second:
      loop.train_and_evaluate(tiny_run_config(), workdir)
  finally:
    first.send_signal(signal.SIGCONT)
  assert str(second.value).startswith(f'{workdir} is in use by another run (pid {first.pid} on ')
  first_stderr = first.communicate(timeout=600)[1]
  assert first.returncode == 0, first_stderr[-3000:]
  assert not os.path.exists(os.path.join(workdir, 'lock.json'))  # released
  assert_bitwise_equal(final_params(workdir), final_params(reference_run[0]))


@pytest.fixture
def small_disk(tmp_path):
  """A 4 MiB file system of its own (tmpfs), so that it can fill up or turn read-only."""
  mount = tmp_path / 'disk'
  mount.mkdir()
  if (
    os.geteuid() != 0
    or subprocess.run(
      ['mount', '-t', 'tmpfs', '-o', 'size=4m', 'tmpfs', str(mount)], capture_output=True
    ).returncode
  ):
    pytest.skip('mounting a small tmpfs needs root')
  try:
    yield mount
  finally:
    subprocess.run(['umount', '-l', str(mount)], check=True)


def _remount(mount, mode):
  subprocess.run(['mount', '-o', f'remount,{mode}', str(mount)], check=True)


@pytest.mark.slow
def test_a_full_disk_or_read_only_workdir_is_one_line_and_the_run_resumes(
  reference_run, small_disk
):
  # A run that has checkpointed step 8; the disk then holds 100 kB more, less than a checkpoint.
  workdir = str(small_disk / 'run')
  os.makedirs(os.path.join(workdir, 'checkpoints'))
  shutil.copytree(
    os.path.join(reference_run[0], 'checkpoints', '8'), os.path.join(workdir, 'checkpoints', '8')
  )
  filler = small_disk / 'filler'
  free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
  filler.write_bytes(b'\0' * (free - 100 * 1024))

  full = run(workdir, check=False)
  assert one_line_error(full) == (
    f'error: {workdir}: no space left on device (writing checkpoints/16.orbax-checkpoint-tmp); '
    'the checkpoint at step 8 is intact. Free space there and run the same command again to '
    'resume'
  )
  names = os.listdir(os.path.join(workdir, 'checkpoints'))
  assert '8' in names and any('orbax-checkpoint-tmp' in n for n in names)

  _remount(small_disk, 'ro')
  try:
    with pytest.raises(workdir_lib.WorkdirError) as read_only:
      loop.train_and_evaluate(tiny_run_config(), workdir)
  finally:
    _remount(small_disk, 'rw')
  assert str(read_only.value) == (
    f'{workdir}: read-only file system (writing lock.json); make it writable or use '
    'another --workdir'
  )

  filler.unlink()
  assert loop.train_and_evaluate(tiny_run_config(), workdir)['resumed_from_step'] == 8
  # The unfinished temporary checkpoint was cleaned up; the result is the uninterrupted run's.
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['16', '24', '8']
  assert_bitwise_equal(final_params(workdir), final_params(reference_run[0]))


def _wait_for(predicate, process, timeout=300):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return
    if process.poll() is not None:
      raise AssertionError(f'process ended early: {process.stderr.read()[-3000:]}')
    time.sleep(0.05)
  raise AssertionError('timed out')


@pytest.mark.slow
def test_sigkill_and_resume_is_bitwise(reference_run, tmp_path):
  workdir = str(tmp_path / 'killed')
  process = subprocess.Popen(
    command(workdir), env=subprocess_env(), stderr=subprocess.PIPE, text=True
  )
  checkpoints = os.path.join(workdir, 'checkpoints')
  _wait_for(lambda: os.path.isdir(os.path.join(checkpoints, '8')), process)
  process.send_signal(signal.SIGKILL)
  process.wait()
  assert not os.path.exists(os.path.join(workdir, 'params.npz'))
  # The killed run's lock stays behind; its process is gone, so the next run takes it over.
  assert json.load(open(os.path.join(workdir, 'lock.json')))['pid'] == process.pid
  # A write cut off mid-way leaves a temporary directory; it must not be used.
  os.makedirs(os.path.join(checkpoints, '16.orbax-checkpoint-tmp-1234', 'state'))
  result = run(workdir)
  assert f'from a run that is gone (pid {process.pid} on ' in result.stdout
  assert 'Resuming from the checkpoint at step' in result.stdout
  assert_bitwise_equal(final_params(workdir), final_params(reference_run[0]))


@pytest.mark.slow
def test_an_npz_of_the_digits_trains_evaluates_and_resumes_as_the_builtin_digits(
  reference_run, tmp_path
):
  """Arrays as a dataset: the built-in digits saved as Keras users have them (grey [N, 8, 8],
  int64 labels, CIFAR-style [N, 1] test labels) train to bitwise the reference run's
  parameters, also when the run is killed after a checkpoint and resumed, and evaluate to
  its accuracy (the same source, crops and order as the built-in arrays)."""
  from vit_jax.data.readers import builtin

  pixels, labels = builtin.load_digits()
  train, test = builtin.digits_split_indices()
  path = tmp_path / 'digits.npz'
  np.savez(
    path,
    x_train=pixels[train, ..., 0],
    y_train=labels[train].astype(np.int64),
    x_test=pixels[test, ..., 0],
    y_test=labels[test][:, None].astype(np.uint8),
  )
  workdir = str(tmp_path / 'run')
  flags = [f'--config.dataset={path}', '--config.pp.flip=False']  # the digits' default
  process = subprocess.Popen(
    command(workdir, *flags), env=subprocess_env(), stderr=subprocess.PIPE, text=True
  )
  _wait_for(lambda: os.path.isdir(os.path.join(workdir, 'checkpoints', '8')), process)
  process.send_signal(signal.SIGKILL)
  process.wait()
  result = run(workdir, *flags)
  assert 'Resuming from the checkpoint at step' in result.stdout
  assert_bitwise_equal(final_params(workdir), final_params(reference_run[0]))
  summary = json.load(open(os.path.join(workdir, 'summary.json')))
  reference = json.load(open(os.path.join(reference_run[0], 'summary.json')))
  assert summary['test_examples'] == reference['test_examples'] == 359
  assert summary['test_accuracy'] == reference['test_accuracy']
  evaluated = subprocess.run(
    [sys.executable, '-m', 'vit_jax.evaluate', f'--checkpoint={workdir}', f'--dataset={path}',
     '--batch=64'],
    env=subprocess_env(), capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  result = json.loads(evaluated.stdout)
  assert (result['top1'], result['examples']) == (reference['test_accuracy'], 359)


@pytest.mark.slow
@pytest.mark.parametrize(
  'sig, said',
  [(signal.SIGTERM, 'preempted (SIGTERM)'), (signal.SIGINT, 'interrupted (Ctrl-C)')],
  ids=['SIGTERM', 'Ctrl-C'],
)
def test_sigterm_or_ctrl_c_writes_a_checkpoint_and_resumes(reference_run, tmp_path, sig, said):
  workdir = str(tmp_path / 'preempted')
  slow = ['--config.total_steps=24', '--config.checkpoint_every=1000']
  process = subprocess.Popen(
    command(workdir, *slow), env=subprocess_env(), stderr=subprocess.PIPE, text=True
  )
  metrics = os.path.join(workdir, 'metrics.jsonl')
  _wait_for(lambda: os.path.exists(metrics) and os.path.getsize(metrics) > 0, process)
  process.send_signal(sig)
  stderr = process.communicate(timeout=300)[1]
  steps = os.listdir(os.path.join(workdir, 'checkpoints'))
  if process.returncode == 0:
    pytest.skip('the run finished before the signal arrived')  # a very fast machine
  assert process.returncode == 128 + sig  # as a shell reports a process the signal ended
  assert f'{said} at step' in stderr and 'Traceback' not in stderr
  assert not os.path.exists(os.path.join(workdir, 'lock.json'))
  assert len(steps) == 1 and 0 < int(steps[0]) < 24
  result = run(workdir, *slow)
  assert f'Resuming from the checkpoint at step {steps[0]}' in result.stdout
  assert_bitwise_equal(final_params(workdir), final_params(reference_run[0]))


@pytest.mark.slow
def test_nan_loss_stops_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, capsys):
  config = tiny_run_config(total_steps=12, warmup_steps=2, checkpoint_every=4, eval_every=100)
  config.pp.mixup = 0.2
  make = loop.pipeline.make_train_iterator

  class Poisoned:
    """The training batches, the 7th with a NaN Mixup weight (pixels cross as uint8)."""

    def __init__(self, *args, **kwargs):
      self._it = make(*args, **kwargs)
      self._count = 0

    def __next__(self):
      batch = next(self._it)
      self._count += 1
      if self._count == 7:
        weights = np.array(batch['mixup'])
        weights[0] = np.nan
        import jax

        batch = {**batch, 'mixup': jax.device_put(weights, batch['mixup'].sharding)}
      return batch

    def get_state(self):
      return self._it.get_state()

  monkeypatch.setattr(loop.pipeline, 'make_train_iterator', Poisoned)
  with pytest.raises(loop.TrainingError, match='NaN/Inf at step 7; stopped') as e:
    loop.train_and_evaluate(config, str(tmp_path))
  assert '\n' not in str(e.value)
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['4']

  config.skip_nonfinite = True
  capsys.readouterr()
  summary = loop.train_and_evaluate(config, str(tmp_path / 'skip'))
  assert summary['skipped_steps'] == 1 and summary['step'] == 12
  # The last line says what was skipped.
  done = capsys.readouterr().out.splitlines()[-1]
  assert done.startswith('Done: step 12, ') and ', 1 of 12 steps skipped (NaN/Inf); wrote ' in done


@pytest.mark.slow
def test_a_diverged_run_stops_and_every_line_it_logged_is_json(tmp_path, capsys):
  """With skip_nonfinite, a run at base_lr=1e4 would skip nearly every step and end `Done:` at
  chance: `max_nonfinite_in_a_row` skipped steps in a row stop it in one line; a run that
  skipped a few says how many in its `Done:` line; NaN is logged as null."""
  config = tiny_run_config(total_steps=12, warmup_steps=2, checkpoint_every=4, eval_every=100)
  config.update(base_lr=1e4, skip_nonfinite=True, max_nonfinite_in_a_row=3, progress_every=1)
  with pytest.raises(loop.TrainingError) as e:
    loop.train_and_evaluate(config, str(tmp_path / 'diverged'))
  assert re.fullmatch(
    r'steps (\d+) to (\d+) were all NaN/Inf and skipped: the run has diverged; stopped, the last '
    r'checkpoint is kept\. Lower --config\.base_lr or check the data \(--config\.'
    r'max_nonfinite_in_a_row sets how many in a row stop a run\)',
    str(e.value),
  ), str(e.value)
  first, last = map(int, re.match(r'steps (\d+) to (\d+)', str(e.value)).groups())
  assert last - first == 2 and last < 12
  assert not os.path.exists(tmp_path / 'diverged' / 'summary.json')

  def strict(text):
    raise AssertionError(f'not JSON: {text}')

  lines = open(tmp_path / 'diverged' / 'metrics.jsonl').read().splitlines()
  logged = [json.loads(line, parse_constant=strict) for line in lines]
  # Logged up to the step before the one that stopped the run.
  assert [r['grad_norm'] for r in logged if r['step'] >= first] == [None] * (last - first)
  assert logged[-1]['skipped_steps'] >= last - first


# Runs on other meshes or hosts are compared with one device over three steps
# of plain SGD (no momentum, no warm-up; clipping and dropout as in TINY_RUN), not
# at the end of the 24-step reference: their gradients differ only in the
# order of float32 sums, a few ulps, and 24 steps at an effective rate of 1
# (lr 0.1, momentum 0.9) amplify that into differences of 4e-5 in the
# position embeddings that depend on the CPU (AVX2 vs AVX-512). After three
# plain steps the parameters are the start minus lr times summed gradients.
SHORT = [
  '--config.total_steps=3',
  '--config.warmup_steps=0',
  '--config.momentum=0.0',
  '--config.progress_every=1',
  '--config.checkpoint_every=3',
]


@pytest.fixture(scope='module')
def short_reference(tmp_path_factory):
  """Three steps on one device: what the multi-device and multi-process runs must match."""
  workdir = str(tmp_path_factory.mktemp('short'))
  run(workdir, *SHORT)
  return workdir


def progress(workdir):
  """The logged (step, train_loss, grad_norm) of each step."""
  lines = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  return [(l['step'], l['train_loss'], l['grad_norm']) for l in lines if 'train_loss' in l]


def assert_same_run(workdir, reference, name):
  """Per-step loss and gradient norm, and the parameters after three steps, agree normwise
  within 1e-5: 170 float32 ulps, over 10x the largest spread measured with XLA's CPU code
  held to SSE4.2, AVX and AVX2, at optimisation levels 0 and 2
  (benchmarks/20261125T1527_equivalence_spread.json), while a wrong reduction or batch moves them by > 1e-3."""
  got, want = progress(workdir), progress(reference)
  assert [s for s, _, _ in got] == [s for s, _, _ in want] == [1, 2, 3]
  for (step, *a), (_, *b) in zip(got, want):
    errors = {name: abs(x - y) / abs(y) for name, x, y in zip(('loss', 'grad_norm'), a, b)}
    assert_close(errors, 1e-5, f'{name}: step {step}')
  assert_trees_close(final_params(workdir), final_params(reference), 1e-5, f'{name}: parameters')


@pytest.mark.slow
@pytest.mark.equivalence
def test_eight_devices_and_fsdp_match_one_device(short_reference, tmp_path):
  for name, overrides in [('dp8', []), ('fsdp', ['--config.mesh.fsdp=4'])]:
    workdir = str(tmp_path / name)
    run(workdir, *SHORT, '--config.mesh.fsdp=1', *overrides, devices=8)
    assert_same_run(workdir, short_reference, name)


@pytest.mark.slow
@pytest.mark.equivalence
def test_two_processes_match_one(short_reference, tmp_path):
  workdir = str(tmp_path / 'two')
  processes = start_ranks([f'--workdir={workdir}', *TINY, *SHORT], devices=2)
  outputs = [p.communicate(timeout=600) for p in processes]
  for p, (_, err) in zip(processes, outputs):
    assert p.returncode == 0, err[-3000:]
  # Only process 0 logs progress and writes results.
  assert 'step 3/3' in outputs[0][0] and 'step 3/3' not in outputs[1][0]
  assert_same_run(workdir, short_reference, 'two processes')


@pytest.mark.slow
def test_cli_errors_are_one_line(tmp_path):
  cases = [
    (['--config.bach=3'], "unknown config field 'bach'; did you mean batch?"),
    (['--config=configs/nope.py'], 'config file configs/nope.py not found'),
    (['--config.model=ViT-B16'], "unknown model 'ViT-B16': did you mean ViT-B_16"),
    (
      ['--config.accum_steps=4', '--config.batch=30'],
      'batch=30 must be a multiple of accum_steps (4)',
    ),
    (['--config.dataset=cifar11'], 'cifar11'),
    (
      ['--config.warmup_steps=20', '--config.total_steps=20'],
      'warmup_steps=20 must be in [0, total_steps=20): add --config.warmup_steps=2',
    ),
    (['--config.batch=0'], 'batch=0 must be at least 1'),
    (
      ['--config=configs/vit_b16.py:imagenet22k'],
      "config argument 'imagenet22k': use imagenet21k, jft or imagenet2012",
    ),
    (['--config.attention=flash'], "attention='flash': use one of auto, xla"),
    (['--config.attention=cudnn'], "attention='cudnn' needs a CUDA GPU"),
  ]
  # Each case is a separate process start (most of its time): two at a time.
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results = list(
      pool.map(lambda i: run(str(tmp_path / f'w{i}'), *cases[i][0], check=False), range(len(cases)))
    )
  for (_, message), result in zip(cases, results):
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr, result.stderr[-2000:]
    assert 'Traceback' not in result.stderr


@pytest.mark.slow
def test_bugs_keep_their_tracebacks(tmp_path):
  """Only errors raised on purpose become one line; a bug in a config file or the run does not."""
  cases = {
    # A bug inside the config file, not an unknown --config.FIELD.
    'attribute.py': ('return os.no_such_function()', "module 'os' has no attribute"),
    # A KeyError deep inside the run, not a config error.
    # (ml_collections may add a field of a similar name to its message.)
    'key.py': ("del config['attention']", r"KeyError: .*'attention'"),
  }
  for name, (line, message) in cases.items():
    (tmp_path / name).write_text(
      'import os\nfrom vit_jax.configs import demo\n\n\ndef get_config():\n'
      f'  config = demo.get_config()\n  {line}\n  return config\n'
    )
    result = subprocess.run(
      [
        sys.executable,
        '-m',
        'vit_jax.main',
        f'--config={tmp_path / name}',
        f'--workdir={tmp_path}',
      ],
      env=subprocess_env(),
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert result.returncode != 0
    assert 'Traceback' in result.stderr and re.search(message, result.stderr), result.stderr[-2000:]
    assert 'unknown config field' not in result.stderr


def test_the_readmes_demo_figures_are_records_and_hold_the_target(monkeypatch):
  """The demo's accuracy depends on the vector instructions XLA generates code for (AVX-512
  and AVX2 round float32 sums differently). Each figure is a record's sentence
  (`benchmarks/measure_demo.py`): the README's Set-up line, and docs/development.md's naming
  each CPU, its vector instructions and load; what is tested is the bound, the target of at
  least 97%."""
  from conftest import ROOT

  monkeypatch.syspath_prepend(str(ROOT / 'benchmarks'))
  import measure_demo

  def record(sentence):
    name = re.search(r'`benchmarks/([^`]+)`', sentence).group(1)
    record = json.loads((ROOT / 'benchmarks' / name).read_text(encoding='utf-8'))
    assert record['runs'][-1]['test_accuracy'] >= 0.97  # the bound; the time varies with load
    return record, name

  readme = (ROOT / 'README.md').read_text(encoding='utf-8')
  said = re.findall(r'\d+\.\d\d% test accuracy in .*?`benchmarks/[^`]+_demo\.json`\)', readme)
  assert len(said) == 1 and said[0] == measure_demo.setup_sentence(*record(said[0]))
  docs = (ROOT / 'docs' / 'development.md').read_text(encoding='utf-8')
  said = re.findall(r'\d+\.\d\d% test accuracy on a .*?`benchmarks/[^`]+_demo\.json`\)', docs)
  isas = set()
  for sentence in said:
    data, name = record(sentence)
    assert sentence == measure_demo.readme_sentence(data, name)
    isas.add(measure_demo.vector_isa(data['machine']))
  assert isas == {'AVX2', 'AVX-512'}, said
  assert 'the accuracy does not' not in readme + docs


@pytest.mark.slow
def test_a_short_demo_run_reads_cleanly(tmp_path):
  """The demo config for 2 steps: its warm-up is fitted, and the output is plain lines on stdout."""
  result = subprocess.run(
    [
      sys.executable,
      '-m',
      'vit_jax.main',
      f'--workdir={tmp_path}',
      '--config.model=testing',
      '--config.total_steps=2',
      '--config.batch=32',
      '--config.tensorboard=False',
    ],
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  lines = [line for line in result.stdout.splitlines() if not heartbeat_line(line)]
  assert lines[0].startswith('warmup_steps 200 -> 0: ') and 'total_steps=2' in lines[0]
  assert lines[1].startswith('preprocessing: train inception crop (area 0.5-1) to 16 px, no flip;')
  assert 'dataset defaults (built-in digits)' in lines[1] and '--config.pp.flip' in lines[1]
  assert lines[2].startswith('step 2/2  loss ')
  assert lines[-1].startswith('Done: step 2, test accuracy ') and lines[-1].endswith('summary.json')
  summary = json.load(open(tmp_path / 'summary.json'))
  assert f'test accuracy {summary["test_accuracy"]:.4f}' in lines[-1]
  # No log prefixes (`I1123 05:40:37.529582 139918316010368 run_log.py:56]`), no library noise
  # (but for the notice of a CUDA plugin where no GPU driver is, which JAX writes as it starts).
  log_prefix = re.compile(r'^[IWEF]\d{4} \d\d:\d\d:\d\d')
  assert not [l for l in lines if log_prefix.match(l)]
  stderr = [l for l in result.stderr.splitlines() if not gpu_plugin_notice(l)]
  assert stderr == [], result.stderr[-3000:]


@pytest.mark.slow
def test_mpp_pretraining_then_finetuning_from_its_workdir(tmp_path):
  """Paper B.1.2: self-supervised pre-training, then the normal fine-tune config."""
  mpp_dir, ft_dir = str(tmp_path / 'mpp'), str(tmp_path / 'finetune')
  demo_scale = [
    '--config.pp.crop=16',
    '--config.batch=32',
    '--config.batch_eval=64',
    '--config.total_steps=6',
    '--config.warmup_steps=2',
    '--config.progress_every=3',
    '--config.eval_every=100',
    '--config.checkpoint_every=100',
    '--config.tensorboard=False',
  ]
  subprocess.run(
    [
      sys.executable,
      '-m',
      'vit_jax.main',
      '--config=configs/mpp_demo.py',
      f'--workdir={mpp_dir}',
      *demo_scale,
    ],
    env=subprocess_env(),
    check=True,
    capture_output=True,
    text=True,
    timeout=600,
  )
  summary = json.load(open(os.path.join(mpp_dir, 'summary.json')))
  # Accuracy of the 3-bit colour of the corrupted patches of every test image.
  assert 0.0 < summary['test_accuracy'] <= 1.0
  assert 'mask_token' in checkpoint.load(mpp_dir)

  result = subprocess.run(
    [
      sys.executable,
      '-m',
      'vit_jax.main',
      '--config=configs/finetune.py:ViT-Demo_4,digits',
      f'--workdir={ft_dir}',
      f'--config.pretrained_path={mpp_dir}',
      '--config.dtype=float32',
      '--config.pp.train=train[:50%]',  # a None default, set from the command line
      *demo_scale,
    ],
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'dropped         mask_token (1, 1, 128)' in result.stdout
  finetuned = checkpoint.load(ft_dir)
  assert 'mask_token' not in finetuned and finetuned['head']['kernel'].shape == (128, 10)


def test_out_of_memory_suggests_accumulation(tmp_path, monkeypatch):
  config = tiny_run_config(total_steps=4, warmup_steps=1, accum_steps=2)

  def compile_that_fails(fn, *args):
    del fn, args

    def step(state, batch):
      raise jax.errors.JaxRuntimeError(
        'RESOURCE_EXHAUSTED: Out of memory while trying to allocate 80.00GiB'
      )

    return step, 0.0

  monkeypatch.setattr(loop, '_compile', compile_that_fails)
  with pytest.raises(loop.TrainingError) as e:
    loop.train_and_evaluate(config, str(tmp_path))
  message = str(e.value)
  assert message.startswith('out of device memory at batch 16 per step')
  assert '--config.accum_steps (now 2' in message and '\n' not in message


def test_the_variants_table_in_the_docs_is_its_records(monkeypatch):
  """docs/registers_flexi_naflex.md quotes the table `benchmarks/measure_variants.py --table`
  prints for the record it names (the demo each way)."""
  from conftest import ROOT

  monkeypatch.syspath_prepend(str(ROOT / 'benchmarks'))
  import measure_variants

  docs = (ROOT / 'docs' / 'registers_flexi_naflex.md').read_text(encoding='utf-8')
  (name,) = re.findall(r'`benchmarks/([^`]+_variants\.json)`', docs)
  record = json.loads((ROOT / 'benchmarks' / name).read_text(encoding='utf-8'))
  assert set(record['runs']) == set(measure_variants.VARIANTS)
  assert measure_variants.table(record) in docs
