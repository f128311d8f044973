"""Self-distillation (task='dino') as a run: its schedules against DINOv2's, whole runs of
`python -m vit_jax.main` (outputs, monitors, SIGTERM and a bitwise resume of student, teacher,
centres and data order, two processes against one), and one `error:` line for each config
value it cannot take."""

import json
import os
import signal
import subprocess
import sys

from conftest import MAIN
from conftest import ROOT
from conftest import assert_bitwise_equal
from conftest import final_params
from conftest import said
from conftest import start_ranks
from conftest import subprocess_env
from conftest import wait_for_child
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from vit_jax import checkpoint
from vit_jax.configs import ConfigError
from vit_jax.configs import dino_demo
from vit_jax.training import dino
from vit_jax.training import program

# The tests' tiny self-distillation run: the `testing` ViT (width 10, patch 16) at 32 px, global
# crops of 2 x 2 patches and local crops of one, tiny heads, the running centre (so that the
# checkpoints carry centres), six steps.
TINY_DINO = {
  'model': 'testing',
  'pp.crop': 32,
  'batch': 16,
  'batch_eval': 64,
  'total_steps': 6,
  'warmup_steps': 2,
  'progress_every': 1,
  'eval_every': 3,
  'checkpoint_every': 3,
  'tensorboard': False,
  'drop_path_rate': 0.1,
  'dino.local_crops': 2,
  'dino.local_crop': 16,
  'dino.prototypes': 64,
  'dino.head_hidden': 32,
  'dino.head_bottleneck': 16,
  'dino.teacher_temp_warmup_steps': 3,
  'dino.freeze_last_layer_steps': 2,
  'dino.centering': 'centre',
  'ibot.mask_probability': 1.0,
  'ibot.mask_ratio': (0.25, 0.5),
}


def tiny_dino_config(**overrides):
  config = dino_demo.get_config()
  for key, value in {**TINY_DINO, **overrides}.items():
    *parents, last = key.split('.')
    target = config
    for part in parents:
      target = target[part]
    target[last] = value
  return config


def command(workdir, *flags, extra=(), overrides=None):
  """`python -m vit_jax.main` of the tiny run with `overrides` of TINY_DINO's values, `flags`."""
  tiny = [f'--config.{k}={v}' for k, v in {**TINY_DINO, **(overrides or {})}.items()]
  return [
    *MAIN,
    '--config=configs/dino_demo.py',
    f'--workdir={workdir}',
    *tiny,
    *flags,
    *extra,
  ]


def run(workdir, *flags, devices=1, timeout=600, overrides=None):
  result = subprocess.run(
    command(workdir, *flags, overrides=overrides),
    env=subprocess_env(devices),
    capture_output=True,
    text=True,
    timeout=timeout,
    cwd=ROOT,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def final_state(workdir, step=6):
  """The train state of the checkpoint at `step`, flattened to {path: array}."""
  item = os.path.abspath(os.path.join(workdir, 'checkpoints', str(step), 'state'))
  checkpointer = ocp.StandardCheckpointer()
  # Onto this process's one device, whatever devices and processes wrote it.
  tree = checkpointer.metadata(item).item_metadata.tree
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)
  state = checkpointer.restore(item, target)
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  return {
    '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path): np.asarray(leaf)
    for path, leaf in leaves
  }


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """One uninterrupted tiny run that the others compare against."""
  workdir = str(tmp_path_factory.mktemp('dino'))
  return workdir, run(workdir)


def test_schedules_are_dinov2s():
  utils = pytest.importorskip('dinov2.utils.utils')
  config = tiny_dino_config(total_steps=40, warmup_steps=7, base_lr=0.01)
  config.dino.teacher_temp_warmup_steps = 12
  plan = dino.schedules(config)
  d = config.dino
  references = {
    'learning_rate': utils.CosineScheduler(0.01, d.min_lr, 40, warmup_iters=7),
    'weight_decay': utils.CosineScheduler(config.weight_decay, d.weight_decay_end, 40),
    'teacher_momentum': utils.CosineScheduler(d.teacher_momentum, 1.0, 40),
    'teacher_temp': utils.CosineScheduler(
      d.teacher_temp, d.teacher_temp, 12, warmup_iters=12, start_warmup_value=0.04
    ),
  }
  for name, reference in references.items():
    want = np.array([reference[i] for i in range(45)])
    got = np.array([float(plan[name](i)) for i in range(45)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9, err_msg=name)


def test_a_run_writes_its_teacher_monitors_and_knn(reference):
  workdir, result = reference
  summary = json.load(open(os.path.join(workdir, 'summary.json')))
  assert summary['step'] == 6 and summary['test_examples'] == 359
  assert 0.0 < summary['test_accuracy'] <= 1.0  # k-NN of the teacher on the digits
  assert 'Done: step 6, k-NN accuracy' in result.stdout
  lines = [json.loads(x) for x in open(os.path.join(workdir, 'metrics.jsonl'))]
  progress = [x for x in lines if 'train_loss' in x]
  assert [x['step'] for x in progress] == [1, 2, 3, 4, 5, 6]
  for key in ('dino_loss', 'ibot_loss', 'koleo_loss', 'teacher_entropy', 'prototype_usage'):
    assert all(np.isfinite(x[key]) for x in progress), key
  assert 'teacher_entropy' in result.stdout and 'feature_std' in result.stdout
  # The teacher's temperature warms up, its momentum rises to 1, the prototypes start frozen.
  temps = [x['teacher_temp'] for x in progress]
  assert temps[0] == pytest.approx(0.04) and temps[-1] == pytest.approx(0.07)
  # params.npz is the teacher's backbone and heads; as a ViT it loads without them.
  from vit_jax.evaluation import loader

  loaded = loader.load_model(workdir)
  assert set(loaded.params) == {'embedding', 'cls', 'Transformer'}
  teacher = final_state(workdir)
  saved = checkpoint.flatten(checkpoint.load(os.path.join(workdir, 'params.npz')))
  for key, value in saved.items():
    np.testing.assert_array_equal(value, teacher[f'ema_params/{key}'])
  assert not np.array_equal(teacher['params/cls'], teacher['ema_params/cls'])
  assert teacher['task_state/dino_centre'].shape == (64,)


def test_sigterm_and_resume_are_bitwise(reference, tmp_path):
  """Stopped by SIGTERM after step 3's checkpoint, resumed: the final state (student, teacher,
  optimizer, centres, step) and params.npz equal the uninterrupted run's bit for bit."""
  workdir = str(tmp_path / 'stopped')
  rare = '--config.checkpoint_every=1000'  # the stop writes the one checkpoint it resumes from
  process = subprocess.Popen(
    command(workdir, rare), env=subprocess_env(), stderr=subprocess.PIPE, text=True, cwd=ROOT
  )
  metrics = os.path.join(workdir, 'metrics.jsonl')
  wait_for_child(lambda: os.path.exists(metrics) and os.path.getsize(metrics) > 0, process)
  process.send_signal(signal.SIGTERM)
  stderr = process.communicate(timeout=300)[1]
  if process.returncode == 0:
    pytest.skip('the run finished before the signal arrived')
  assert process.returncode == 128 + signal.SIGTERM and 'preempted (SIGTERM)' in stderr
  steps = os.listdir(os.path.join(workdir, 'checkpoints'))
  assert len(steps) == 1 and 0 < int(steps[0]) < 6
  result = run(workdir, rare)
  assert 'Resuming from the checkpoint at step' in result.stdout
  assert_bitwise_equal(final_state(workdir), final_state(reference[0]))
  assert_bitwise_equal(final_params(workdir), final_params(reference[0]))


@pytest.mark.slow
def test_two_processes_equal_one_process_of_two_devices_bitwise(tmp_path):
  """The same mesh of two devices, in one process or one device in each of two: the run's
  final state is bit for bit the same (the batch, crops and masks are a function of the step,
  not of who reads them)."""
  three = ['--config.total_steps=3', '--config.eval_every=100']
  one = str(tmp_path / 'one')
  run(one, *three, devices=2)
  two = str(tmp_path / 'two')
  tail = command(two, *three)[len(MAIN) :]
  for p in start_ranks(tail, num_processes=2, devices=1):
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
  assert_bitwise_equal(final_state(two, 3), final_state(one, 3))
  assert_bitwise_equal(final_params(two), final_params(one))


@pytest.mark.parametrize(
  'overrides, line',
  [
    (
      {'accum_steps': 2},
      'accum_steps=2: task=dino normalises and compares over the whole batch',
    ),
    ({'ema_decay': 0.999}, 'ema_decay=0.999: task=dino already keeps its teacher'),
    ({'dino.local_scale': (0.4, 0.1)}, 'dino.local_scale=(0.4, 0.1): give (smallest, largest)'),
    ({'ibot.mask_ratio': (0.5,)}, 'ibot.mask_ratio=(0.5,): give (smallest, largest)'),
    ({'dino.centering': 'median'}, "dino.centering='median': use one of sinkhorn_knopp, centre"),
    ({'dino.teacher_temp': 0.0}, 'dino.teacher_temp=0.0 must be in (0, inf)'),
    ({'dino.teacher_momentum': 1.5}, 'dino.teacher_momentum=1.5 must be in [0, 1]'),
    ({'dino.local_crops': -1}, 'dino.local_crops=-1 must be at least 0'),
    ({'dino.global_scale': (0.0, 1.0)}, 'dino.global_scale=(0.0, 1.0): 0.0 is not a number'),
    ({'ibot.mask_probability': 1.5}, 'ibot.mask_probability=1.5 must be in [0, 1]'),
    ({'knn.k': 0}, 'knn.k=0 must be at least 1'),
    ({'drop_path_rate': 1.0}, 'drop_path_rate=1.0 must be in [0, 1)'),
    ({'batch': 1, 'batch_eval': 1}, 'batch=1: task=dino compares the images of a batch'),
    ({'dino.local_crop': 20}, 'dino.local_crop=20 is not a multiple of the patch size 16'),
    ({'model': 'ViT-S_16-gap'}, 'ViT-S_16-gap: task=dino trains a ViT that reads its class'),
    (
      {'model': 'eva02_tiny_patch14_224', 'pp.crop': 28, 'dino.local_crop': 14},
      "not one with classifier='token_gap'",
    ),
    ({'model': 'R+ViT-Ti_16'}, 'a ResNet stem (a hybrid)'),
    ({'flexi_patch_sizes': (8,)}, "flexi_patch_sizes trains classification only, not task='dino'"),
    ({'naflex_tokens': (16,)}, 'NaFlex trains classification with a plain ViT (token or gap'),
  ],
)
def test_a_config_value_the_task_cannot_take_is_one_line(overrides, line):
  config = tiny_dino_config(**overrides)
  with pytest.raises(ConfigError) as e:
    program.validate(config, 1)
  assert line in str(e.value) and '\n' not in str(e.value)


def test_a_folder_without_classes_is_read_and_one_too_small_is_one_line(tmp_path):
  """A folder of loose images is a train split without labels: self-distillation reads it
  (and refuses it, in one line, when it holds fewer images than a batch); classification
  refuses it in one line."""
  folder = tmp_path / 'photos'
  folder.mkdir()
  from PIL import Image

  for i in range(5):
    Image.fromarray(np.full((20, 20, 3), 40 * i, np.uint8)).save(folder / f'{i}.png')
  result = subprocess.run(
    command(str(tmp_path / 'w'), f'--config.dataset={folder}'),
    env=subprocess_env(),
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
  )
  lines = said(result.stderr)
  assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
  assert (
    lines[0].startswith(f'error: {folder}') and 'the train split has 5 images, fewer' in lines[0]
  )
  result = subprocess.run(
    [sys.executable, '-m', 'vit_jax.main', f'--workdir={tmp_path / "c"}',
     f'--config.dataset={folder}', '--config.model=testing', '--config.pp.crop=16'],
    env=subprocess_env(), capture_output=True, text=True, timeout=300, cwd=ROOT,
  )  # fmt: skip
  lines = said(result.stderr)
  assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
  assert lines[0] == (
    f'error: {folder}: its images are not in class folders (DIR/train/<class>/<image>), which '
    'classification needs; self-distillation (--config.task=dino) reads them as they are'
  )


@pytest.mark.slow
def test_continued_pretraining_of_a_dinov2_reg_timm_file_resumes_and_exports_back(tmp_path):
  """timm's `vit_small_patch14_reg4_dinov2` (random weights; full width, one block, a 2x2
  grid at 28 px) -> `export --format=npz` -> a self-distillation run from it
  (`pretrained_path`: student and teacher start as the file, heads fresh), stopped by SIGTERM
  and resumed to bitwise the uninterrupted run -> `export --format=timm`, which
  `timm.create_model` of the same name loads strictly and which gives the run's teacher's
  features."""
  torch = pytest.importorskip('torch')
  timm = pytest.importorskip('timm')
  safetensors_torch = pytest.importorskip('safetensors.torch')
  import safetensors

  from vit_jax.evaluation import loader
  from vit_jax.interop import export as export_lib

  name = 'vit_small_patch14_reg4_dinov2'
  model = timm.create_model(name, pretrained=False, img_size=28, num_classes=0, depth=1).eval()
  source = tmp_path / 'dinov2.safetensors'
  safetensors_torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, source)
  converted = tmp_path / 'dinov2.npz'
  result = subprocess.run(
    [sys.executable, '-m', 'vit_jax.export', f'--checkpoint={source}', '--format=npz',
     f'--output={converted}'],
    env=subprocess_env(), capture_output=True, text=True, timeout=300, cwd=ROOT,
  )  # fmt: skip
  assert result.returncode == 0, result.stderr[-3000:]
  overrides = {
    'model': name,
    'depth': 1,
    'pp.crop': 28,
    'dino.local_crop': 14,
    'batch': 8,
    'total_steps': 4,
    'checkpoint_every': 1000,
    'eval_every': 1000,
    'pretrained_path': str(converted),
  }
  reference = str(tmp_path / 'reference')
  said_first = run(reference, overrides=overrides).stdout
  assert 'load_pretrained' in said_first and 're-initialised  dino_head/' in said_first
  workdir = str(tmp_path / 'stopped')
  process = subprocess.Popen(
    command(workdir, overrides=overrides), env=subprocess_env(), stderr=subprocess.PIPE,
    text=True, cwd=ROOT,
  )  # fmt: skip
  metrics = os.path.join(workdir, 'metrics.jsonl')
  wait_for_child(lambda: os.path.exists(metrics) and os.path.getsize(metrics) > 0, process)
  process.send_signal(signal.SIGTERM)
  process.communicate(timeout=300)
  if process.returncode == 0:
    pytest.skip('the run finished before the signal arrived')
  assert process.returncode == 128 + signal.SIGTERM
  assert 'Resuming from the checkpoint at step' in run(workdir, overrides=overrides).stdout
  assert_bitwise_equal(final_state(workdir, 4), final_state(reference, 4))
  out = tmp_path / 'back.safetensors'
  notes = export_lib.export(workdir, 'timm', str(out))
  assert any(f"timm.create_model('{name}'" in note for note in notes), notes
  with safetensors.safe_open(str(out), 'pt') as f:
    meta = f.metadata()
  assert meta['timm_model'] == name
  again = timm.create_model(name, **json.loads(meta['timm_kwargs'])).eval()
  again.load_state_dict(safetensors_torch.load_file(str(out)), strict=True)
  x = np.random.default_rng(0).uniform(-1, 1, (2, 28, 28, 3)).astype(np.float32)
  teacher = loader.load_model(workdir)
  ours = np.asarray(teacher.model.apply({'params': teacher.params}, x, train=False))
  mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
  pixels = ((x + 1) / 2 - mean) / std  # timm's input: ImageNet-normalised [0, 1] pixels
  with torch.no_grad():
    theirs = again(torch.from_numpy(pixels.transpose(0, 3, 1, 2)).float()).numpy()
  assert theirs.shape == ours.shape == (2, 384)
  np.testing.assert_allclose(ours, theirs, atol=2e-5 * np.abs(theirs).max())
  # The file's backbone moved: continued pre-training trained it.
  start = checkpoint.flatten(checkpoint.load(str(converted)))
  assert not np.allclose(start['cls'], checkpoint.flatten(teacher.params)['cls'])


@pytest.mark.slow
def test_the_demo_learns_features_without_labels(tmp_path):
  """A short version of the demo (configs/dino_demo.py, 200 steps of 128 digits, labels never
  read, a teacher of momentum 0.97 that follows the student within them): the teacher's frozen
  class tokens classify the test digits by k-NN better than the same ViT's at initialisation,
  by 5 points (measured: 78.0% against 71.0%), and the monitors show no collapse (targets
  neither uniform nor one-hot, features spread)."""
  from vit_jax.evaluation import knn
  from vit_jax.evaluation import loader
  from vit_jax.training import loop

  config = dino_demo.get_config()
  config.update(total_steps=200, warmup_steps=20, eval_every=1000, checkpoint_every=1000)
  config.update(progress_every=50, tensorboard=False)
  config.dino.teacher_temp_warmup_steps = 50
  config.dino.teacher_momentum = 0.97  # a teacher that follows within the short run
  workdir = str(tmp_path / 'demo')
  summary = loop.train_and_evaluate(config, workdir)
  trained = loader.load_model(workdir)
  fresh = trained.model.init(jax.random.key(config.seed), np.zeros((1, 16, 16, 3)), train=False)[
    'params'
  ]
  at_init = knn.evaluate_checkpoint(trained._replace(params=fresh), ['digits'])['knn/digits']
  learnt = knn.evaluate_checkpoint(trained, ['digits'])['knn/digits']
  assert learnt == pytest.approx(summary['test_accuracy'], abs=1.5 / 359)  # the run's own k-NN
  assert learnt >= at_init + 0.05, (learnt, at_init)
  lines = [json.loads(x) for x in open(os.path.join(workdir, 'metrics.jsonl'))]
  last = [x for x in lines if 'teacher_entropy' in x][-1]
  assert last['step'] == 200
  prototypes = config.dino.prototypes
  assert 0.5 < last['teacher_entropy'] < np.log(prototypes) - 0.2, last
  assert last['prototype_usage'] > 0.5 and last['feature_std'] > 0.5, last


def test_a_pretrained_file_of_another_model_is_one_line(tmp_path):
  """Continued pre-training from the weights of another architecture (width 12 where the run's
  model has 10) stops before its first step in one `error:` line that names the file."""
  from conftest import param_shapes
  from conftest import random_like

  from vit_jax.configs import architectures

  other = architectures.MODEL_CONFIGS['testing']
  other.hidden_size = 12
  path = tmp_path / 'other.npz'
  checkpoint.save_npz(random_like(param_shapes(other, None, 32), scale=0.02), path)
  result = subprocess.run(
    command(str(tmp_path / 'w'), f'--config.pretrained_path={path}'),
    env=subprocess_env(), capture_output=True, text=True, timeout=300, cwd=ROOT,
  )  # fmt: skip
  lines = said(result.stderr)
  assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
  assert lines[0].startswith(f'error: {path}: ') and 'the model expects (10,)' in lines[0], lines
  assert not os.path.exists(tmp_path / 'w' / 'checkpoints') or not os.listdir(
    tmp_path / 'w' / 'checkpoints'
  )


def test_the_closed_form_flops_count_every_crop_as_xla_does():
  """`bench.flops.self_distillation_flops_per_image` (the compile tool's MFU: the student on the
  global and local crops, forward and backward, the teacher on the global crops, the heads on
  the class tokens and masked slots) against XLA's count of the compiled step of a matmul-bound
  model (ViT-Ti, one block, the shared head and running centre): XLA adds the softmaxes, norms,
  losses and the optimizer, under 5% here; a crop left out would be 10% or more."""
  from vit_jax.bench import flops
  from vit_jax.core import sharding

  config = tiny_dino_config(model='ViT-Ti_16', depth=1, batch=8)
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  spec = program.validate(config, 1)
  with jax.set_mesh(mesh):
    built = program.build(config, mesh, 10, False, spec)
    compiled = built.train_step.lower(built.abstract_state(), built.abstract_batch()).compile()
  xla = compiled.cost_analysis()['flops']
  closed = flops.run_flops_per_image(config, spec.architecture, 10) * config.batch
  assert closed <= xla <= 1.05 * closed, (xla, closed)
  # One local crop of 2 x 2 patches (forward and backward) is this share of the closed form.
  one_local = 3 * flops.forward_flops_per_image(spec.architecture, 16, 0) * config.batch
  assert one_local > 0.1 * closed
