"""Users of the official vit_jax: its module paths, configs, checkpoints and notebook flows.

The flows of the official Colab (vit_jax.ipynb) run here with the renames of
docs/migrating.md, offline, on a TFDS dataset prepared in a temporary
directory: build a model by name, load a released checkpoint, evaluate,
fine-tune, evaluate again, predict from a re-loaded file.
"""

import copy
import subprocess
import sys

from conftest import assert_close
from conftest import assert_trees_close
from conftest import batch_sharding
from conftest import current_flax_names
from conftest import fake_image_dataset
from conftest import param_shapes
from conftest import random_like
from conftest import subprocess_env
import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from PIL import Image
import pytest

from vit_jax import checkpoint
from vit_jax import input_pipeline
from vit_jax import models
from vit_jax import train
from vit_jax.configs import common as common_config
from vit_jax.configs import models as models_config
from vit_jax.configs import official
from vit_jax.configs.model_spec import ModelSpec
from vit_jax.data import datasets
from vit_jax.evaluation import metrics
from vit_jax.training import loop
from vit_jax.training import optim
from vit_jax.training import program

# Class k: a solid image of colour _COLOURS[k].
_COLOURS = np.array([(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255)], np.uint8)


@pytest.fixture(scope='module')
def colours(tmp_path_factory):
  """The TFDS data_dir of a prepared dataset of solid images whose colour is the label (5
  classes): quick to learn."""
  data_dir = str(tmp_path_factory.mktemp('tfds'))
  fake_image_dataset(
    data_dir,
    'official_colours',
    (20, 20, 3),
    5,
    lambda split, i: {'image': np.tile(_COLOURS[i % 5], (20, 20, 1)), 'label': i % 5},
    {'train': 40, 'test': 10},
  )
  datasets.open_split.cache_clear()
  yield data_dir
  datasets.open_split.cache_clear()


def test_official_names_are_where_official_users_call_them():
  official_api = {
    models: ['VisionTransformer', 'get_model', 'AddPositionEmbs', 'Encoder', 'Encoder1DBlock'],
    checkpoint: ['load', 'load_pretrained', 'interpolate_posembed', 'recover_tree'],
    models_config: ['MODEL_CONFIGS', 'AUGREG_CONFIGS', 'get_b16_config', 'get_r_ti16_config'],
    common_config: ['get_config', 'with_dataset'],
    train: ['train_and_evaluate', 'make_update_fn'],
    input_pipeline: ['get_info', 'make_train_iterator', 'make_eval_iterator'],
  }
  missing = [
    f'{module.__name__}.{name}'
    for module, names in official_api.items()
    for name in names
    if not hasattr(module, name)
  ]
  assert not missing
  tree = checkpoint.recover_tree(['a/b', 'a/c', 'd'], [1, 2, 3])
  assert tree == {'a': {'b': 1, 'c': 2}, 'd': 3}


def test_official_blocks_take_their_official_keywords():
  """`models.Encoder(num_layers=, mlp_dim=, num_heads=, ...)` and `models.Encoder1DBlock(mlp_dim=,
  num_heads=, ...)` build what a VisionTransformer holds: the same parameter tree."""
  config = models_config.MODEL_CONFIGS['testing']
  t = config.transformer
  shape = lambda s: s.shape  # noqa: E731
  vit_params = jax.tree.map(shape, param_shapes(config, 10, 16)['Transformer'])
  tokens = jnp.zeros((1, (16 // config.patches.size[0]) ** 2 + 1, config.hidden_size))
  shapes = lambda module, **kw: jax.tree.map(  # noqa: E731
    shape, jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), tokens, **kw))['params']
  )
  encoder = models.Encoder(
    num_layers=t.num_layers, mlp_dim=t.mlp_dim, num_heads=t.num_heads, dropout_rate=0.0
  )
  assert shapes(encoder, train=False) == vit_params
  block = models.Encoder1DBlock(mlp_dim=t.mlp_dim, num_heads=t.num_heads, dtype=jnp.float32)
  assert shapes(block, deterministic=True) == vit_params['encoderblock_0']


# ---------------------------------------------------------------------------
# Checkpoints written by the official train.py.


def _official_layout(params):
  """Our parameter tree under the names the official model gets from current Flax."""
  flat = current_flax_names(checkpoint.flatten(params))
  flat['pre_logits'] = {}  # the official IdentityLayer: a name without parameters
  return checkpoint.unflatten(flat)


@pytest.mark.parametrize('orbax', [False, True], ids=['msgpack', 'orbax'])
def test_official_train_checkpoint_is_a_starting_point(tmp_path, orbax):
  # Imported here: it imports TensorFlow (seconds), which no other test of this file needs.
  from flax.training import checkpoints as flax_checkpoints

  config = models_config.MODEL_CONFIGS['testing']
  params = random_like(param_shapes(config, 10, 32), seed=1)
  # As the official train.py: SGD, momentum in bfloat16, (params, opt_state, step).
  tx = optax.chain(
    optax.clip_by_global_norm(1.0), optax.sgd(0.03, momentum=0.9, accumulator_dtype='bfloat16')
  )
  official_params = _official_layout(params)
  opt_state = tx.init(jax.tree.map(jnp.asarray, params))
  # (flax.config.temp_flip_flag is newer than the oldest flax setup.py admits.)
  before = flax.config.flax_use_orbax_checkpointing
  flax.config.update('flax_use_orbax_checkpointing', orbax)
  try:
    for step in (5, 10):  # keep=2: two files, so that the workdir's latest is chosen
      flax_checkpoints.save_checkpoint(
        str(tmp_path), (official_params, opt_state, step), step, keep=2
      )
  finally:
    flax.config.update('flax_use_orbax_checkpointing', before)

  assert sorted(p.name for p in tmp_path.iterdir()) == ['checkpoint_10', 'checkpoint_5']
  assert (tmp_path / 'checkpoint_10').is_dir() == orbax
  for path in (tmp_path / 'checkpoint_10', tmp_path):  # the file, or the workdir (latest)
    loaded = checkpoint.load(path)
    assert sorted(checkpoint.flatten(loaded)) == sorted(checkpoint.flatten(params))
    jax.tree.map(np.testing.assert_array_equal, loaded, params)

  # As `pretrained_path`: fine-tune at 48 px on 3 classes.
  init = random_like(param_shapes(config, 3, 48), seed=2)
  tuned = checkpoint.load_pretrained(
    pretrained_path=str(tmp_path / 'checkpoint_10'),
    init_params=init,
    model_config=config,
    verbose=False,
  )
  np.testing.assert_array_equal(tuned['embedding']['kernel'], params['embedding']['kernel'])
  assert tuned['Transformer']['posembed_input']['pos_embedding'].shape == (1, 10, 10)


def test_unreadable_flax_checkpoint_is_one_line(tmp_path):
  (tmp_path / 'checkpoint_3').write_bytes(b'\x00not msgpack')
  with pytest.raises(checkpoint.CheckpointError, match='not a readable Flax checkpoint') as e:
    checkpoint.load(tmp_path)
  assert '\n' not in str(e.value)
  (tmp_path / 'empty').mkdir()
  with pytest.raises(checkpoint.CheckpointError, match='without params.npz or checkpoint_<step>'):
    checkpoint.load(tmp_path / 'empty')


# ---------------------------------------------------------------------------
# Official training configs.


def _official_config(dataset='cifar10'):
  """As the official configs/vit.py: with_dataset, then a model config by function."""
  config = common_config.with_dataset(common_config.get_config(), dataset)
  config.model = models_config.get_l16_config()
  return config


def test_official_config_trains_as_the_official_fine_tuning():
  config = official.translate(_official_config())
  assert config.model == 'ViT-L_16' and config.dataset == 'cifar10'
  # The model config's dropout, as the official trainer; its pretrained file.
  assert (config.dropout_rate, config.attention_dropout_rate) == (0.1, 0.0)
  assert config.pretrained_path == './ViT-L_16.npz'
  # The official defaults and cifar10 preset.
  official_choices = (
    config.optimizer,
    config.momentum,
    config.optim_dtype,
    config.dtype,
    config.weight_decay,
    config.base_lr,
    config.decay_type,
    config.warmup_steps,
    config.grad_norm_clip,
    config.batch,
    config.total_steps,
    config.pp.crop,
    config.accum_steps,
  )
  assert official_choices == (
    'sgd',
    0.9,
    'bfloat16',
    'float32',
    0.0,
    0.03,
    'cosine',
    500,
    1.0,
    512,
    10_000,
    384,
    1,
  )
  assert (
    'pretrained_dir' not in config and ModelSpec.of(config).architecture.block.dropout_rate == 0.1
  )


def test_official_config_variants():
  # A model dict of another shape is found by shape; AugReg file names; accum_steps=0.
  config = _official_config()
  config.model = models_config.get_b16_config()
  config.model.classifier = 'gap'
  config.model.transformer.dropout_rate = 0.2
  config.update(pretrained_dir='gs://vit_models/augreg', accum_steps=0, total_steps=None)
  config.model_or_filename = 'B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0'
  config.shuffle_buffer = 50_000
  translated = official.translate(config)
  assert (translated.model, translated.dropout_rate) == ('ViT-B_16-gap', 0.2)
  assert translated.pretrained_path == (
    'gs://vit_models/augreg/B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0.npz'
  )
  assert (translated.accum_steps, translated.total_steps) == (1, 10_000)
  assert 'shuffle_buffer' not in translated and 'model_or_filename' not in translated
  # A name works as well as a dict; our own configs pass through untouched.
  config = common_config.with_dataset(common_config.get_config(), 'oxford_iiit_pet')
  config.model = 'R50+ViT-B_16'
  config.pretrained_dir = '/models'
  translated = official.translate(config)
  assert (translated.pretrained_path, translated.total_steps) == ('/models/R50+ViT-B_16.npz', 500)
  assert translated.dropout_rate == 0.1  # the model config's, as the official trainer
  ours = common_config.get_config()
  assert official.translate(ours) is ours


@pytest.mark.parametrize(
  'change, message',
  [
    (dict(model=None), 'config.model is not set'),
    (dict(model_name='Mixer-B_16'), 'config.model: Mixer-B_16: MLP-Mixer and LiT models are not'),
    (dict(hidden_size=100), 'config.model: ViT-L_16 with hidden_size=100 matches no MODEL_CONF'),
    (dict(model_or_filename='B_16'), "model_or_filename='B_16': choosing the best AugReg file"),
    (dict(trainer='inference_time'), 'time inference with python -m vit_jax.benchmark'),
    (dict(model_type='Mixer'), "model_type='Mixer': this package has ViT and R\\+ViT hybrids only"),
  ],
)
def test_official_config_refusals_are_one_line(change, message):
  config = _official_config()
  for key, value in change.items():
    if key in ('model_name', 'hidden_size'):
      config.model[key] = value
    elif key == 'model':
      config.model = value
    else:
      config[key] = value
  with pytest.raises(loop.ConfigError, match=message) as e:
    official.translate(config)
  assert '\n' not in str(e.value)


_OFFICIAL_STYLE_CONFIG = """
from vit_jax.configs import common
from vit_jax.configs import models


def get_config(model_dataset):  # as the official configs/vit.py
  model, dataset = model_dataset.split(',')
  config = common.with_dataset(common.get_config(), dataset)
  config.model = getattr(models, f'get_{model}_config')()
  return config
"""


@pytest.mark.slow
def test_official_style_config_file_on_the_command_line(tmp_path):
  path = tmp_path / 'vit.py'
  path.write_text(_OFFICIAL_STYLE_CONFIG)
  cases = [
    ([':mixer_b16,digits'], 'error: Mixer-B_16: MLP-Mixer and LiT models are not part of'),
    ([':b99,digits'], "error: config file: module 'vit_jax.configs.models' has no attribute"),
  ]
  for (arg, *flags), message in cases:
    result = subprocess.run(
      [sys.executable, '-m', 'vit_jax.main', f'--config={path}{arg}', *flags],
      cwd=tmp_path,
      env=subprocess_env(),
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert result.returncode == 2 and 'Traceback' not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(message), result.stderr[-2000:]


def test_accum_steps_zero_is_one_and_negative_is_refused():
  config = common_config.get_config()
  config.accum_steps = 0
  assert official.translate(config).accum_steps == 1
  config.accum_steps = -2
  with pytest.raises(loop.ConfigError, match='accum_steps=-2 must be at least 1'):
    program.validate(config, 1)


@pytest.mark.parametrize('decay_type', ['cosine', 'linear'])
def test_learning_rate_schedule_is_the_official_one(decay_type):
  config = common_config.get_config()
  config.update(total_steps=100, warmup_steps=10, base_lr=0.03, decay_type=decay_type)
  ours = np.asarray(optim.learning_rate_schedule(config)(jnp.arange(101)))
  # The official utils.create_learning_rate_schedule, as optax calls it (from 0).
  step = np.arange(101.0)
  progress = np.clip((step - 10) / 90, 0.0, 1.0)
  if decay_type == 'cosine':
    official = 0.03 * 0.5 * (1 + np.cos(np.pi * progress))
  else:
    official = 1e-5 + (0.03 - 1e-5) * (1 - progress)
  official = official * np.minimum(1.0, step / 10)
  np.testing.assert_allclose(ours, official, rtol=1e-6, atol=1e-9)
  if decay_type == 'linear':  # the official floor, not 0
    assert ours[-1] == pytest.approx(1e-5, rel=1e-6)


# ---------------------------------------------------------------------------
# The official notebook's flows.


@pytest.mark.slow
@pytest.mark.equivalence
def test_make_update_fn_with_accum_steps_zero_is_one_plain_step():
  config = models_config.MODEL_CONFIGS['testing']
  config.transformer.dropout_rate = 0.0
  model = models.VisionTransformer(num_classes=3, **config)
  batch = {
    'image': np.random.default_rng(0).uniform(-1, 1, (4, 16, 16, 3)).astype(np.float32),
    'label': np.array([0, 1, 2, 1], np.int32),
  }
  params = random_like(param_shapes(config, 3, 16), seed=2, scale=0.3)
  tx = optax.sgd(0.1)
  # accum_steps=0: no accumulation, as the official utils.accumulate_gradient.
  update_fn = train.make_update_fn(apply_fn=model.apply, accum_steps=0, tx=tx)
  p = jax.tree.map(jnp.array, params)
  new_params, _, new_loss, new_rng = update_fn(p, tx.init(p), batch, jax.random.PRNGKey(0))

  # One SGD step on the whole batch's softmax cross-entropy, computed here.
  def loss(p):
    log_p = jax.nn.log_softmax(model.apply({'params': p}, batch['image'], train=False))
    return -jnp.mean(jnp.take_along_axis(log_p, batch['label'][:, None], 1))

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  # The same loss and gradient computed twice (normwise within 1e-5, conftest.tree_errors).
  assert_close(abs(new_loss - value) / value, 1e-5, 'loss')
  assert_trees_close(
    new_params, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), 1e-5, 'SGD step'
  )
  assert new_rng.shape == (2,) and not np.array_equal(new_rng, jax.random.PRNGKey(0))


@pytest.mark.slow
def test_official_notebook_flows(colours, tmp_path, capsys):
  sharding = batch_sharding()
  # Load dataset (official: with_dataset, get_data_from_tfds, get_dataset_info).
  dataset = 'official_colours'
  config = common_config.with_dataset(common_config.get_config(), dataset)
  config.update(batch=8, batch_eval=5, tfds_data_dir=colours)
  config.pp.crop = 32
  num_classes = input_pipeline.get_info(config).num_classes
  ds_train = input_pipeline.make_train_iterator(config, sharding)
  batch = next(ds_train)
  assert (num_classes, batch['image'].shape) == (5, (8, 32, 32, 3))

  # Load pre-trained (official: MODEL_CONFIGS[name], VisionTransformer, load_pretrained).
  model_name = 'testing'
  model_config = models_config.MODEL_CONFIGS[model_name]
  model = models.VisionTransformer(num_classes=num_classes, **model_config)
  variables = jax.jit(
    lambda: model.init(jax.random.PRNGKey(0), batch['image'][:1], train=False), backend='cpu'
  )()
  # A file in the released layout: an ImageNet-21k head at 64 px (4x4 patches).
  rng = np.random.default_rng(1)
  pretrained = checkpoint.flatten(jax.tree.map(np.asarray, variables['params']))
  pretrained['head/kernel'] = np.zeros((10, 21843), np.float32)
  pretrained['head/bias'] = np.zeros((21843,), np.float32)
  posemb = 'Transformer/posembed_input/pos_embedding'
  pretrained[posemb] = rng.normal(0, 0.02, (1, 17, 10)).astype(np.float32)
  released = checkpoint.save_npz(
    checkpoint.unflatten(pretrained), tmp_path / 'released' / 'testing.npz'
  )
  params = checkpoint.load_pretrained(
    pretrained_path=released, init_params=variables['params'], model_config=model_config
  )
  assert '(1, 17, 10) -> (1, 5, 10) (zoom)' in capsys.readouterr().out

  # Evaluate (official: get_accuracy over the test split).
  @jax.jit
  def counts(params, batch):
    logits = model.apply({'params': params}, batch['image'], train=False)
    return metrics.classification_counts(logits, batch['label'], batch['mask'], False)

  def get_accuracy(params):
    return metrics.accuracy(counts, params, input_pipeline.make_eval_iterator(config, sharding))

  before = get_accuracy(params)
  assert before['examples'] == 10 and before['accuracy'] == 0.2  # zero head: class 0

  # Fine-tune (official: create_learning_rate_schedule, optax.chain, make_update_fn).
  config.update(total_steps=20, warmup_steps=2, base_lr=0.1, decay_type='cosine')
  lr_fn = optim.learning_rate_schedule(config)
  tx = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.sgd(learning_rate=lr_fn, momentum=0.9, accumulator_dtype='bfloat16'),
  )
  update_fn = train.make_update_fn(apply_fn=model.apply, accum_steps=2, tx=tx)
  opt_state = tx.init(params)
  update_rng = jax.random.PRNGKey(0)
  losses = []
  for _, batch in zip(range(1, config.total_steps + 1), ds_train):
    params, opt_state, loss, update_rng = update_fn(params, opt_state, batch, update_rng)
    losses.append(float(loss))
  assert np.mean(losses[-5:]) < 0.25 * np.mean(losses[:5]), losses
  assert get_accuracy(params)['accuracy'] == 1.0

  # Inference (official: checkpoint.load, params['pre_logits'] = {}, apply on one image).
  path = checkpoint.save_npz(params, tmp_path / f'{model_name}_tuned.npz')
  params = checkpoint.load(path)
  params['pre_logits'] = {}  # the official notebook's line; harmless here
  img = Image.fromarray(np.tile(_COLOURS[3], (32, 32, 1)))
  (logits,) = model.apply(dict(params=params), (np.array(img) / 128 - 1)[None, ...], train=False)
  preds = np.array(jax.nn.softmax(logits))
  assert preds.argsort()[::-1][0] == 3

  # The official trainer entry point, with an official-style config, fine-tuning
  # again from the file just written (re-initialised head).
  checkpoint.save_npz(params, tmp_path / 'tuned' / 'testing.npz')
  run = copy.deepcopy(config)
  run.update(
    total_steps=6,
    warmup_steps=1,
    accum_steps=0,
    eval_every=100,
    checkpoint_every=100,
    progress_every=100,
    tensorboard=False,
    peak_flops=1e12,
  )
  run.model = models_config.get_testing_config()
  run.pretrained_dir = str(tmp_path / 'tuned')
  summary = train.train_and_evaluate(run, str(tmp_path / 'workdir'))
  assert f'load_pretrained {tmp_path}/tuned/testing.npz' in capsys.readouterr().out
  assert (summary['model'], summary['step'], summary['test_examples']) == ('testing', 6, 10)
  assert summary['test_accuracy'] >= 0.8, summary
