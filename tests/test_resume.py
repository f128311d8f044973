"""Running again on a workdir: the recorded config compared, a finished run, bad checkpoints set aside."""

import json
import os
import shutil

from conftest import CLASSES
from conftest import TESTING_SIZE
from conftest import assert_bitwise_equal
from conftest import dataset_record
from conftest import final_params
from conftest import tiny_params
import numpy as np
import orbax.checkpoint as ocp
import pytest

from vit_jax import workdir as workdir_lib
from vit_jax.configs import demo
from vit_jax.training import resume


def test_what_a_resumed_run_may_change_and_what_it_may_not(tmp_path):
  workdir = str(tmp_path)
  config = demo.get_config()
  workdir_lib.write_config(workdir, config)
  changed = demo.get_config()
  changed.model = 'ViT-B_16'
  resume.check_config(workdir, changed)  # nothing saved yet: nothing to lose
  os.makedirs(tmp_path / 'checkpoints' / '500')
  # Length, cadence, memory and evaluation may change.
  changed = demo.get_config()
  changed.update(total_steps=4000, accum_steps=4, eval_every=50, batch_eval=64)
  changed.fewshot.datasets = ('digits',)
  changed.mesh.fsdp = 2
  resume.check_config(workdir, changed)
  # What the run learns may not; the line says what differs and what to type.
  changed.update(model='ViT-B_16', batch=256)
  with pytest.raises(resume.ResumeError) as e:
    resume.check_config(workdir, changed)
  assert str(e.value) == (
    f"{workdir} holds a run with batch=128, model='ViT-Demo_4' where this command has "
    "batch=256, model='ViT-B_16'. To resume it, run with --config.batch=128 "
    '--config.model=ViT-Demo_4; to start afresh, use another --workdir '
    f'(--config.pretrained_path={workdir} starts from its weights, once that run has finished)'
  )
  # A field this version of the code does not know is not compared.
  recorded = json.load(open(tmp_path / workdir_lib.CONFIG_FILE))
  recorded['retired_field'] = 1
  json.dump(recorded, open(tmp_path / workdir_lib.CONFIG_FILE, 'w'))
  resume.check_config(workdir, config)


def test_a_run_recorded_before_a_recipe_changed_resumes_as_it_was_or_says_what_changed(tmp_path):
  """Runs recorded before linear_end existed decayed linearly to 0: the line names that
  value."""
  workdir = str(tmp_path)
  config = demo.get_config()
  config.decay_type = 'linear'
  workdir_lib.write_config(workdir, config)
  os.makedirs(tmp_path / 'checkpoints' / '500')
  recorded = json.load(open(tmp_path / workdir_lib.CONFIG_FILE))
  del recorded['linear_end']
  json.dump(recorded, open(tmp_path / workdir_lib.CONFIG_FILE, 'w'))
  with pytest.raises(resume.ResumeError) as e:
    resume.check_config(workdir, config)
  assert str(e.value).startswith(
    f'{workdir} holds a run with linear_end=0.0 where this command has linear_end=1e-05. '
    'To resume it, run with --config.linear_end=0.0; to start afresh'
  )
  config.update(linear_end=0.0)
  resume.check_config(workdir, config)
  # Where the field changes nothing (a cosine decay), any value resumes.
  recorded.update(decay_type='cosine')
  json.dump(recorded, open(tmp_path / workdir_lib.CONFIG_FILE, 'w'))
  resume.check_config(workdir, demo.get_config())


def test_the_recorded_config_is_rewritten_only_when_it_changes(tmp_path):
  config = demo.get_config()
  workdir_lib.write_config(str(tmp_path), config)
  path = tmp_path / workdir_lib.CONFIG_FILE
  before = os.stat(path).st_mtime_ns
  os.utime(path, ns=(before - 10**9, before - 10**9))
  workdir_lib.write_config(str(tmp_path), config)
  assert os.stat(path).st_mtime_ns == before - 10**9
  config.total_steps = 3000
  workdir_lib.write_config(str(tmp_path), config)
  assert json.load(open(path))['total_steps'] == 3000


def test_a_run_counts_as_finished_at_its_total_steps(tmp_path):
  config = demo.get_config()
  assert resume.finished(str(tmp_path), config) is None
  (tmp_path / workdir_lib.SUMMARY_FILE).write_text(json.dumps({'step': 2000, 'test_accuracy': 0.9}))
  assert resume.finished(str(tmp_path), config)['test_accuracy'] == 0.9
  config.total_steps = 3000  # train on
  assert resume.finished(str(tmp_path), config) is None


class Lines:
  def __init__(self):
    self.lines = []

  def info(self, message, *args):
    self.lines.append(message % args)


def _manager(workdir):
  return ocp.CheckpointManager(
    workdir_lib.checkpoints_dir(workdir, absolute=True),
    options=ocp.CheckpointManagerOptions(create=True),
  )


def _truncate(folder):
  for root, _, names in os.walk(folder):
    for name in names:
      path = os.path.join(root, name)
      os.truncate(path, os.path.getsize(path) // 2)


def test_bad_checkpoints_are_set_aside_and_the_newest_good_one_restored(tmp_path):
  workdir = str(tmp_path)
  manager = _manager(workdir)
  for step in (1, 2, 3):
    manager.save(step, args=ocp.args.StandardSave({'w': np.full(4, step, np.float32)}))
  manager.wait_until_finished()
  _truncate(tmp_path / 'checkpoints' / '3')
  _truncate(tmp_path / 'checkpoints' / '2')
  log = Lines()
  step, restored = resume.restore_newest(
    _manager(workdir), workdir, lambda step: ocp.args.StandardRestore(), log
  )
  assert step == 1 and restored['w'].tolist() == [1, 1, 1, 1]
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['1']
  assert sorted(os.listdir(tmp_path / 'corrupt_checkpoints')) == ['2', '3']
  [line] = log.lines
  assert line.startswith('checkpoints at step 3, 2 do not restore (')
  assert line.endswith(f'moved to {tmp_path}/corrupt_checkpoints; resuming from step 1')


def test_when_no_checkpoint_restores_nothing_is_moved(tmp_path):
  workdir = str(tmp_path)
  manager = _manager(workdir)
  manager.save(5, args=ocp.args.StandardSave({'w': np.zeros(4, np.float32)}))
  manager.wait_until_finished()
  _truncate(tmp_path / 'checkpoints' / '5')
  with pytest.raises(resume.ResumeError) as e:
    resume.restore_newest(_manager(workdir), workdir, lambda step: ocp.args.StandardRestore(), None)
  assert str(e.value).startswith(f'no checkpoint in {tmp_path}/checkpoints restores (step 5: ')
  assert '\n' not in str(e.value)
  assert os.listdir(tmp_path / 'checkpoints') == ['5']
  assert not os.path.exists(tmp_path / 'corrupt_checkpoints')


# ---------------------------------------------------------------------------
# Resuming a whole (tiny, in-process) run: the loss curve, and data that moved.


def _digits_npz(path, relabel=False):
  """The built-in digits as an .npz (`relabel`: one train label changed: other data)."""
  from vit_jax.data.readers import builtin

  pixels, labels = builtin.load_digits()
  train, test = builtin.digits_split_indices()
  y_train = labels[train].copy()
  if relabel:
    y_train[0] = (y_train[0] + 1) % 10
  np.savez(path, x_train=pixels[train], y_train=y_train, x_test=pixels[test], y_test=labels[test])
  return str(path)


def _tiny_config(dataset):
  from conftest import tiny_run_config

  # Progress every 4 steps, a checkpoint at 6: a resume from it starts inside a window.
  return tiny_run_config(dataset=dataset, total_steps=8, checkpoint_every=6, eval_every=100)


@pytest.fixture(scope='module')
def finished_run(tmp_path_factory):
  """(workdir, dataset) of one uninterrupted run of 8 steps on an .npz of the digits."""
  from vit_jax.training import loop

  root = tmp_path_factory.mktemp('resumed')
  dataset = _digits_npz(root / 'digits.npz')
  workdir = str(root / 'run')
  loop.train_and_evaluate(_tiny_config(dataset), workdir)
  return workdir, dataset


def _stopped_at_6(run, target):
  """A copy of the finished run as a kill after step 8's progress line, before its checkpoint,
  leaves it: the checkpoint at 6, the metrics of steps 7 and 8 already logged."""
  shutil.copytree(run, target)
  shutil.rmtree(os.path.join(target, 'checkpoints', '8'))
  for name in (workdir_lib.SUMMARY_FILE, workdir_lib.PARAMS_FILE):
    os.remove(os.path.join(target, name))
  return str(target)


def _metrics(workdir):
  with open(os.path.join(workdir, workdir_lib.METRICS_FILE)) as f:
    return [json.loads(line) for line in f]


def test_a_resumed_run_logs_the_loss_curve_of_an_uninterrupted_one(finished_run, tmp_path):
  """Resumed from step 6, the progress line at step 8 averages steps 5 to 8 as the
  uninterrupted run's did (the window's losses travel in the checkpoint), and metrics.jsonl
  holds each step's lines once: equal losses, rates aside."""
  from vit_jax.training import loop

  run, dataset = finished_run
  workdir = _stopped_at_6(run, tmp_path / 'run')
  loop.train_and_evaluate(_tiny_config(dataset), workdir)
  rates = ('img_per_sec', 'mfu')
  strip = lambda lines: [{k: v for k, v in line.items() if k not in rates} for line in lines]
  assert strip(_metrics(workdir)) == strip(_metrics(run))
  assert [line['step'] for line in _metrics(workdir) if 'train_loss' in line] == [4, 8]


def test_a_run_whose_data_moved_resumes_from_the_new_path_and_other_data_is_refused(
  finished_run, tmp_path
):
  """dataset.json's fingerprint of the data: the same file at another path resumes (bitwise
  the uninterrupted run's parameters); other data there is one line, the workdir untouched."""
  from vit_jax.training import loop

  run, dataset = finished_run
  workdir = _stopped_at_6(run, tmp_path / 'run')
  moved = str(tmp_path / 'elsewhere' / 'digits.npz')
  os.makedirs(os.path.dirname(moved))
  os.replace(_digits_npz(tmp_path / 'digits.npz', relabel=True), moved)  # other data first
  # The recorded path is gone as well: the copy's dataset.json names this test's old path.
  recorded = json.load(open(os.path.join(workdir, workdir_lib.DATASET_FILE)))
  recorded['path'] = str(tmp_path / 'gone' / 'digits.npz')
  json.dump(recorded, open(os.path.join(workdir, workdir_lib.DATASET_FILE), 'w'))
  before = {
    name: open(os.path.join(workdir, name), 'rb').read()
    for name in (workdir_lib.CONFIG_FILE, workdir_lib.DATASET_FILE, workdir_lib.METRICS_FILE)
  }
  with pytest.raises(resume.ResumeError) as e:
    loop.train_and_evaluate(_tiny_config(moved), workdir)
  assert str(e.value).startswith(
    f'{moved} is not the data the run in {workdir} was trained on '
    f'({tmp_path}/gone/digits.npz, no longer there): as many files and bytes, but other names '
    'or contents. Pass the folder or file that data moved to'
  )
  for name, data in before.items():
    assert open(os.path.join(workdir, name), 'rb').read() == data, name
  assert workdir_lib.saved_steps(workdir) == [6]

  shutil.copyfile(dataset, moved)  # the run's own file, copied (moved: the same)
  summary = loop.train_and_evaluate(_tiny_config(moved), workdir)
  assert summary['resumed_from_step'] == 6
  assert_bitwise_equal(final_params(workdir), final_params(run))
  assert json.load(open(os.path.join(workdir, workdir_lib.DATASET_FILE)))['path'] == moved


# ---------------------------------------------------------------------------
# What a resume says when the run's data or config changed, and what resumes as is.


def _handmade_run(path, config, *, step=4, dataset_record=None, checkpoint_step=None):
  """A workdir as a stopped run leaves it: config.json, dataset.json (when given), and a
  checkpoint (params only: what `vit_jax.evaluation.loader` reads) or a summary short of the
  end."""
  import orbax.checkpoint as ocp

  os.makedirs(path)
  workdir_lib.write_config(str(path), config)
  if dataset_record is not None:
    (path / 'dataset.json').write_text(json.dumps(dataset_record))
  if checkpoint_step is None:
    workdir_lib.write_summary(str(path), {'step': step, 'model': config.model})
    return str(path)
  manager = ocp.CheckpointManager(workdir_lib.checkpoints_dir(str(path), absolute=True))
  state = {'params': tiny_params(3), 'step': np.asarray(checkpoint_step, np.int32)}
  manager.save(checkpoint_step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
  manager.wait_until_finished()
  manager.close()
  return str(path)


def test_a_run_on_arrays_registered_in_python_resumed_without_them_says_how(tmp_path):
  """A run on arrays registered in Python, resumed where they are not registered, says to resume
  it from Python with the same arrays, never to download the name from TFDS."""
  from conftest import tiny_run_config

  from vit_jax.training import loop
  from vit_jax.training import resume

  config = tiny_run_config(dataset='myarrays')
  run = _handmade_run(
    tmp_path / 'run', config, dataset_record=dataset_record('myarrays', 10, registered=True)
  )
  with pytest.raises(resume.ResumeError) as e:
    loop.train_and_evaluate(config, run)
  assert str(e.value) == (
    f"{run} holds a run on 'myarrays', arrays registered in Python (register_arrays), which "
    'this process has not registered: resume it from Python, calling '
    "vit_jax.input_pipeline.register_arrays('myarrays', x_train=..., y_train=..., ...) with the "
    'same arrays before train_and_evaluate'
  )


def test_a_class_folder_added_between_runs_is_said_as_the_data_changing(tmp_path, digit_folder):
  """A class folder added between runs is said as the data changing, not the config, with how to
  resume and how to train on the new classes."""
  import shutil

  from conftest import tiny_run_config

  from vit_jax.training import loop
  from vit_jax.training import resume

  data = shutil.copytree(digit_folder, tmp_path / 'data')
  config = tiny_run_config(dataset=str(data), **{'pp.crop': TESTING_SIZE})
  run = _handmade_run(
    tmp_path / 'run', config, dataset_record=dataset_record(str(data), CLASSES), checkpoint_step=4
  )
  for split in ('train', 'test'):
    shutil.copytree(data / split / CLASSES[0], data / split / 'new')
  with pytest.raises(resume.ResumeError) as e:
    loop.train_and_evaluate(config, run)
  assert str(e.value) == (
    f"{data} has 4 classes now, the run in {run} was trained on 3 (added 'new'): the data "
    'changed since the run started. To resume it, restore the data as it was; to train on the '
    f'new classes, use another --workdir (--config.pretrained_path={run} starts from its '
    'weights)'
  )


@pytest.mark.parametrize('spelling', ['trailing slash', 'relative', 'symlink'])
def test_the_same_data_spelled_otherwise_resumes(
  spelling, tmp_path, digit_folder, monkeypatch, capsys
):
  """The same dataset spelled with a trailing slash, a relative path or a symlink resumes the
  run."""
  import shutil

  from conftest import tiny_run_config

  from vit_jax.training import loop

  data = shutil.copytree(digit_folder, tmp_path / 'data')
  config = tiny_run_config(dataset=str(data))
  run = _handmade_run(
    tmp_path / 'run', config, step=24, dataset_record=dataset_record(str(data), CLASSES)
  )
  monkeypatch.chdir(tmp_path)
  os.symlink(data, tmp_path / 'link')
  config.dataset = {'trailing slash': f'{data}/', 'relative': 'data', 'symlink': 'link'}[spelling]
  capsys.readouterr()
  assert loop.train_and_evaluate(config, run) == {'step': 24, 'model': 'testing'}
  assert f'{run} has finished: step 24' in capsys.readouterr().out


def test_fields_a_run_recorded_that_this_version_does_not_read_are_said_and_kept(
  tmp_path, monkeypatch, capsys
):
  """Fields of another version in a run's config.json are named in one line on resume and kept in
  the file."""
  from conftest import tiny_run_config

  from vit_jax.training import loop

  config = tiny_run_config()
  run = _handmade_run(tmp_path / 'run', config, step=4)
  recorded = json.loads((tmp_path / 'run' / 'config.json').read_text())
  recorded.update(old_field=7, pp={**recorded['pp'], 'old_crop': 3})
  (tmp_path / 'run' / 'config.json').write_text(json.dumps(recorded))

  class Stop(Exception):
    pass

  def stop(*args, **kwargs):
    raise Stop

  monkeypatch.setattr(loop, 'set_up', stop)
  capsys.readouterr()
  with pytest.raises(Stop):
    loop.train_and_evaluate(config, run)
  assert capsys.readouterr().out == (
    f'config.json of {run} records fields this version does not read (old_field, pp.old_crop): '
    'resumed without them, kept in the file\n'
  )
  kept = json.loads((tmp_path / 'run' / 'config.json').read_text())
  assert kept['old_field'] == 7 and kept['pp']['old_crop'] == 3
