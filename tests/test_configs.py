"""The experiment configs: paper numbers, every field settable from the command line, every
number bounded, and config values and files a run cannot take refused in one line."""

import glob
import importlib.util
import json
import os
import re

import pytest

from vit_jax.configs import ConfigError
from vit_jax.configs import demo
from vit_jax.configs import flag
from vit_jax.configs import recipes
from vit_jax.configs.model_spec import ModelSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Config files with the arguments they take.
CONFIGS = [
  ('demo.py', None),
  ('mpp_demo.py', None),
  ('finetune.py', 'ViT-B_16,cifar10'),
  ('finetune.py', 'R50+ViT-B_16,vtab/dtd'),
  ('mpp_b16.py', 'jft'),
  ('giant.py', 'ViT-22B_14'),
  ('giant.py', 'ViT-g_14'),
  ('giant.py', 'ViT-e_14-map'),
] + [
  (os.path.basename(p), arg)
  for p in sorted(glob.glob(os.path.join(REPO, 'configs', '*vit_*.py')))
  for arg in ('imagenet21k', 'jft', 'imagenet2012')
]


def load(name, arg=None):
  spec = importlib.util.spec_from_file_location('config', os.path.join(REPO, 'configs', name))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def none_fields(config, prefix=''):
  """(parent, key, path) of every field whose value is None."""
  for key in config:
    value = config[key]
    if hasattr(value, 'keys'):
      yield from none_fields(value, f'{prefix}{key}.')
    elif value is None:
      yield config, key, prefix + key


@pytest.mark.parametrize('name, arg', CONFIGS)
def test_none_fields_can_be_set_from_the_command_line(name, arg):
  # ml_collections refuses to override a plain None (its type is unknown); a
  # typed placeholder takes a value from --config.FIELD=...
  for parent, key, path in none_fields(load(name, arg)):
    try:
      field_type = parent.get_ref(key).get_type()
    except ValueError:
      pytest.fail(f'{name}:{arg}: {path} is a plain None; make it a typed placeholder')
    assert field_type is not type(None), path


@pytest.mark.parametrize(
  'model, dataset, steps, lr, wd, dropout, decay',
  [
    ('vit_b16.py', 'jft', 7 * 303_000_000 // 4096 + 1, 8e-4, 0.1, 0.0, 'linear'),
    ('vit_l16.py', 'jft', 7 * 303_000_000 // 4096 + 1, 4e-4, 0.1, 0.0, 'linear'),
    ('vit_h14.py', 'jft', 14 * 303_000_000 // 4096 + 1, 3e-4, 0.1, 0.0, 'linear'),
    ('vit_l32.py', 'jft', 7 * 303_000_000 // 4096 + 1, 6e-4, 0.1, 0.0, 'linear'),
    ('vit_b32.py', 'imagenet21k', 90 * 14_197_122 // 4096 + 1, 1e-3, 0.03, 0.1, 'linear'),
    ('r50_vit_b16.py', 'jft', 7 * 303_000_000 // 4096 + 1, 8e-4, 0.1, 0.0, 'linear'),
    ('vit_b16.py', 'imagenet2012', 300 * 1_281_167 // 4096 + 1, 3e-3, 0.3, 0.1, 'cosine'),
  ],
)
def test_pretraining_recipes_are_paper_table_3(model, dataset, steps, lr, wd, dropout, decay):
  config = load(model, dataset)
  assert (
    config.total_steps,
    config.base_lr,
    config.weight_decay,
    config.dropout_rate,
    config.decay_type,
  ) == (steps, lr, wd, dropout, decay)
  assert (
    config.batch,
    config.warmup_steps,
    config.grad_norm_clip,
    config.optimizer,
    config.b1,
    config.b2,
    config.pp.crop,
  ) == (4096, 10_000, 1.0, 'adam', 0.9, 0.999, 224)
  assert config.representation_size == {
    'vit_l16.py': 1024,
    'vit_l32.py': 1024,
    'vit_h14.py': 1280,
  }.get(model, 768)
  if dataset == 'jft':
    assert (config.loss, config.head_bias_init, config.dataset) == ('sigmoid', -10.0, None)


@pytest.mark.parametrize(
  'dataset, steps, lr',
  [
    ('cifar10', 10_000, 0.03),
    ('cifar100', 10_000, 0.03),
    ('oxford_iiit_pet', 500, 0.03),
    ('oxford_flowers102', 500, 0.03),
    ('imagenet2012', 20_000, 0.03),
    ('vtab/dtd', 2500, 0.01),
  ],
)
def test_finetuning_recipes_are_paper_table_4(dataset, steps, lr):
  config = load('finetune.py', f'ViT-L_16,{dataset}')
  assert (config.total_steps, config.base_lr) == (steps, lr)
  assert (
    config.optimizer,
    config.momentum,
    config.batch,
    config.decay_type,
    config.weight_decay,
    config.grad_norm_clip,
    config.pp.crop,
  ) == ('sgd', 0.9, 512, 'cosine', 0.0, 1.0, 384)
  assert config.pretrained_path == 'gs://vit_models/imagenet21k/ViT-L_16.npz'
  assert config.representation_size is None


def test_epochs_argument_and_bad_arguments():
  assert load('vit_l16.py', 'jft,14').total_steps == 14 * 303_000_000 // 4096 + 1
  with pytest.raises(ConfigError, match='use MODEL,DATASET'):
    load('finetune.py', 'ViT-B_16')
  with pytest.raises(ConfigError, match='use imagenet21k, jft or imagenet2012'):
    load('vit_b16.py', 'imagenet')
  for bad in ('imagenet21k,ten', 'imagenet21k,sigmoid,90', 'imagenet21k,0'):
    with pytest.raises(ConfigError, match='EPOCHS must be a positive integer and LOSS one of'):
      load('vit_b16.py', bad)


def test_the_imagenet21k_loss_is_a_choice_with_big_visions_sigmoid_as_an_option():
  softmax = load('vit_b16.py', 'imagenet21k')
  assert (softmax.loss, softmax.head_bias_init) == ('softmax', 0.0)
  sigmoid = load('vit_b16.py', 'imagenet21k,30,sigmoid')
  assert (sigmoid.loss, sigmoid.head_bias_init, sigmoid.total_steps) == (
    'sigmoid',
    -10.0,
    30 * 14_197_122 // 4096 + 1,
  )
  assert (load('vit_b16.py', 'jft').loss, load('vit_b16.py', 'jft,softmax').loss) == (
    'sigmoid',
    'softmax',
  )


# The official model configs' transformer.dropout_rate, which the official
# fine-tuning (train.py: VisionTransformer(**config.model)) trains with.
OFFICIAL_FINETUNE_DROPOUT = {
  'ViT-Ti_16': 0.0,
  'ViT-S_16': 0.0,
  'ViT-S_32': 0.0,
  'ViT-B_8': 0.0,
  'ViT-B_16': 0.0,
  'ViT-B_32': 0.0,
  'ViT-L_16': 0.1,
  'ViT-L_32': 0.0,
  'ViT-H_14': 0.1,
  'ViT-S_16-gap-norep': 0.0,
  'ViT-B_16-gap-norep': 0.0,
  'ViT-S_32-gap-norep': 0.0,
  'ViT-B_32-gap-norep': 0.0,
  'R+ViT-Ti_16': 0.0,
  'R50+ViT-B_16': 0.1,
  'R26+ViT-B_32': 0.0,
  'R26+ViT-S_32': 0.0,
  'R50+ViT-L_32': 0.1,
}


@pytest.mark.parametrize('model, dropout', sorted(OFFICIAL_FINETUNE_DROPOUT.items()))
def test_finetuning_dropout_is_the_official_model_configs(model, dropout):
  config = load('finetune.py', f'{model},cifar10')
  assert config.dropout_rate == dropout
  # What the trainer builds: the model's own dropout, no attention dropout.
  block = ModelSpec.of(config).architecture.block
  assert (block.dropout_rate, block.attention_dropout_rate) == (dropout, 0.0)


def test_finetuning_accumulation_per_tpu_is_what_the_compiler_found():
  """The notebook's accum_steps per TPU equal the committed `--fit` records, slice by slice."""
  kinds = {
    'v2': 'TPU v2',
    'v3': 'TPU v3',
    'v4': 'TPU v4',
    'v5e': 'TPU v5 lite',
    'v6e': 'TPU v6 lite',
  }
  paths = sorted(glob.glob(os.path.join(REPO, 'benchmarks', 'tpu', 'finetune_b16_384_*.json')))
  assert len(paths) >= 4
  for path in paths:
    with open(path, encoding='utf-8') as f:
      record = json.load(f)
    assert record['fits'] and record['model'] == 'ViT-B_16' and record['image_size'] == 384
    kind = kinds[re.split('[-:]', record['topology'])[0]]
    steps = recipes.finetune_accum_steps(kind, record['devices'], record['batch'])
    assert steps == record['accum_steps'], path
  assert recipes.finetune_accum_steps('cpu', 1) is None


# ---------------------------------------------------------------------------
# Every field, declared once (configs/schema.py).


def _set(config, name, value):
  *sections, last = name.split('.')
  for section in sections:
    config = config[section]
  config[last] = value


def test_every_field_is_declared_once_and_the_configs_are_the_schemas():
  from vit_jax.configs import common
  from vit_jax.configs import data
  from vit_jax.configs import flag
  from vit_jax.configs import schema

  names = [f.name for f in schema.FIELDS]
  assert len(names) == len(set(names))
  run, data_only = common.get_config(), data.data_config()
  sections = ('pp', 'block', 'dino', 'ibot', 'fewshot', 'knn', 'mesh')
  assert sorted(n for n in flag._field_names(run) if n not in sections) == sorted(names)
  data_names = [n for n in flag._field_names(data_only) if n not in sections]
  assert sorted(data_names) == sorted(f.name for f in schema.FIELDS if f.data)
  assert sorted(flag._field_names(run)) == sorted(schema.names())
  for field in schema.FIELDS:
    value = run
    for part in field.name.split('.'):
      value = value[part]
    assert value == field.default, field.name
    if field.default is None:  # a typed placeholder: --config.NAME=VALUE reads it as its type
      with pytest.raises(TypeError):
        _set(run, field.name, object())


def test_every_choice_field_has_one_check_and_the_code_reads_its_values():
  from vit_jax.configs import common
  from vit_jax.configs import demo
  from vit_jax.configs import schema
  from vit_jax.models import attention

  config = demo.get_config()
  choices = [f for f in schema.FIELDS if f.allowed]
  assert {'task', 'attention', 'corrupt_images'} <= {f.name for f in choices}
  for field in choices:
    assert field.default is None or field.default in field.allowed, field
    bad = config.copy_and_resolve_references()
    _set(bad, field.name, 'nonsense')
    with pytest.raises(ConfigError) as e:
      schema.validate(bad, schema.Devices(1, 'cpu'))
    assert str(e.value) == f"{field.name}='nonsense': use one of {', '.join(field.allowed)}"
    if field.data:  # the input pipeline's check too
      with pytest.raises(ConfigError, match=f"{field.name}='nonsense'"):
        schema.validate_data(bad)
  schema.validate(config, schema.Devices(1, 'cpu'))  # the demo passes
  # The tuples the code reads are the schema's.
  assert attention.ATTENTION == schema.allowed('attention')
  assert recipes.PRETRAIN_LOSSES == schema.allowed('loss')
  # A new field with choices is one entry: it reaches the defaults, the check and the names.
  extra = schema.Field('colour', 'red', str, 'a field added for this test', ('red', 'blue'))
  fields = schema.FIELDS
  try:
    schema.FIELDS = (*fields, extra)
    assert common.get_config().colour == 'red' and 'colour' in schema.names()
    added = demo.get_config()
    assert added.colour == 'red'
    added.colour = 'green'
    with pytest.raises(ConfigError, match="colour='green': use one of red, blue"):
      schema.validate(added, schema.Devices(1, 'cpu'))
  finally:
    schema.FIELDS = fields


def test_the_warm_up_a_short_run_gets_is_the_one_the_check_suggests():
  from vit_jax.configs import common
  from vit_jax.configs import schema

  config = common.get_config()
  config.update(total_steps=20, warmup_steps=20)
  assert schema.fitted_warmup(config) == 2
  with pytest.raises(ConfigError, match=r'add --config.warmup_steps=2$'):
    schema.warmup_before_the_end(config)
  config.warmup_steps = 19
  assert schema.fitted_warmup(config) is None
  schema.warmup_before_the_end(config)


# ---------------------------------------------------------------------------
# Config values and files a run cannot take: one line each, before anything runs.


@pytest.mark.parametrize(
  'model, crop, line',
  [
    (
      'ViT-Demo_4',
      30,
      'the 4 px that one patch of ViT-Demo_4 covers: the last 2 px of each row '
      'and column would be dropped; use --config.pp.crop=32 or 28',
    ),
    (
      'R50+ViT-B_16',
      200,
      'the 16 px that one patch of R50+ViT-B_16 covers: the last 8 px of each '
      'row and column would be dropped; use --config.pp.crop=208 or 192',
    ),
  ],
)
def test_a_resolution_the_patches_do_not_tile_is_one_line(model, crop, line):
  """A pp.crop the patches do not tile (the demo at 30 px would drop 2 px of each image) is one
  line naming the sizes that tile; the fine-tuning recipe tiles: 392 px for 14 px patches."""
  from vit_jax.configs import ConfigError
  from vit_jax.configs import recipes
  from vit_jax.training import program

  config = demo.get_config()
  config.update(model=model)
  config.pp.crop = crop
  with pytest.raises(ConfigError) as e:
    program.validate(config, 1)
  assert str(e.value) == f'pp.crop={crop} is not a multiple of {line}'
  assert recipes.finetune('ViT-H_14,cifar10').pp.crop == 392
  program.validate(recipes.finetune('ViT-H_14,cifar10'), 8)


def test_a_misspelt_field_in_a_config_file_is_named_with_the_field_it_meant():
  config = demo.get_config()
  assert flag.unknown_fields(config) == ''
  config.total_step = 4
  assert flag.unknown_fields(config) == (
    "unknown config field 'total_step' (no run reads it); did you mean total_steps?"
  )
  config = demo.get_config()
  config.pp.crops = 8
  assert "'pp.crops' (no run reads it); did you mean pp.crop?" in flag.unknown_fields(config)
  config.fewshots = {'datasets': ('cifar10',)}  # one line: the first unknown field, by name
  assert "'fewshots' (no run reads it); did you mean fewshot?" in flag.unknown_fields(config)


@pytest.mark.parametrize(
  'name, text, line',
  [
    ('syntax.py', 'def get_config(:\n', 'line 1: SyntaxError: invalid syntax: def get_config(:;'),
    ('config.yaml', 'total_steps: 4\n', 'is not a Python file: a config is a .py file'),
    ('folder.py/', '', 'is not a Python file'),
    ('nul.py', 'x = 1\0\n', 'SyntaxError'),
  ],
)
def test_a_config_file_that_is_not_python_is_one_line(name, text, line, tmp_path, capsys):
  path = tmp_path / name.rstrip('/')
  if name.endswith('/'):
    path.mkdir()
  else:
    path.write_text(text)
  with pytest.raises(SystemExit) as e:
    flag.check_config_file(str(path), 'configs/demo.py')
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and err.startswith(f'error: config file {path}') and line in err, err


def _outside(bounds: str):
  """A value just outside an interval '[a, b)' of `schema.Field.bounds`."""
  low, high = (float(v) for v in bounds[1:-1].split(','))
  if low == float('-inf'):
    return float('nan')
  if high != float('inf'):
    return high if bounds[-1] == ')' else high + 1
  return low if bounds[0] == '(' else low - 1


def _numeric_fields():
  from vit_jax.configs import schema

  return [f for f in schema.FIELDS if f.type in (int, float) or getattr(f, 'bounds', None)]


@pytest.mark.parametrize('name', [f.name for f in _numeric_fields()])
def test_every_number_field_has_bounds_and_a_value_outside_is_one_line(name):
  """Every number of the schema has its interval, checked before anything runs: a value outside
  (`--config.num_registers=-1`, `--config.pp.crop=0`) is one line naming the field, never an
  error from a library."""
  from conftest import tiny_run_config

  from vit_jax.configs import ConfigError
  from vit_jax.configs import schema
  from vit_jax.training import program

  field = next(f for f in schema.FIELDS if f.name == name)
  assert field.bounds, f'{name}: a number without bounds'
  config = tiny_run_config()
  program.validate(config, 1)  # its value now passes
  value = _outside(field.bounds)
  value = int(value) if field.type is int and value == value else value
  *sections, last = name.split('.')
  target = config
  for section in sections:
    target = target[section]
  if field.type is tuple:
    target[last] = (value,)
  else:
    with target.ignore_type():
      target[last] = value
  with pytest.raises(ConfigError) as e:
    program.validate(config, 1)
  assert str(e.value).startswith(f'{name}=') and '\n' not in str(e.value), str(e.value)


def test_a_numeric_field_without_bounds_is_found():
  from vit_jax.configs import schema

  assert {f.name for f in _numeric_fields()} >= {'num_registers', 'pp.crop', 'seed', 'b2'}
  assert not [f.name for f in schema.FIELDS if f.type in (int, float) and not f.bounds]
