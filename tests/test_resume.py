"""Running again on a workdir: the recorded config compared, a finished run, bad checkpoints set aside."""

import json
import os

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
