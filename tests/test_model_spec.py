"""The typed model description (`configs.model_spec`): every registry entry converts, options
that would contradict each other are refused or cannot be written, the model takes its
architecture and how it runs as two values, and the code reads fields rather than restating
defaults or telling families apart by name."""

import ast
import dataclasses
import pathlib

import pytest

import vit_jax
from vit_jax.configs import ConfigError
from vit_jax.configs import architectures
from vit_jax.configs import model_spec
from vit_jax.configs.model_spec import Architecture
from vit_jax.configs.model_spec import Block
from vit_jax.models import naflex
from vit_jax.models import vit

PACKAGE = pathlib.Path(vit_jax.__file__).parent


def test_every_registry_entry_converts_and_round_trips():
  for name in architectures.MODEL_CONFIGS:
    arch = model_spec.registered(name)
    assert arch.name == name
    assert Architecture.of(arch.as_config()) == arch, name


def test_the_model_is_its_architecture_and_how_it_runs():
  fields = lambda cls: [f.name for f in dataclasses.fields(cls) if f.name not in ('parent', 'name')]
  expected = ['num_classes', 'architecture', 'compute', 'head_bias_init']
  assert fields(vit.VisionTransformer) == fields(naflex.NaFlexViT) == expected


@pytest.mark.parametrize(
  'entry, message',
  [
    # What were flags that contradicted each other are one slot each: the old spellings are
    # refused by name, so a registry entry cannot set two of them.
    ({'swiglu': True}, 'unknown option(s) swiglu'),
    ({'activation': 'gelu'}, 'unknown option(s) activation'),
    ({'key_bias': False}, 'unknown option(s) key_bias'),
    ({'qkv_and_norm_biases': False}, 'unknown option(s) qkv_and_norm_biases'),
    ({'mlp': 'relu'}, "mlp='relu': use one of 'gelu_tanh', 'gelu', 'quick_gelu', 'swiglu'"),
    (
      {'biases': 'no_query'},
      "biases='no_query': use one of 'all', 'no_key', 'no_qkv', 'no_qkv_or_norm'",
    ),
  ],
)
def test_a_block_option_has_one_slot(entry, message):
  config = architectures.MODEL_CONFIGS['testing']
  config.transformer.update(entry)
  with pytest.raises(ConfigError) as e:
    Architecture.of(config)
  assert str(e.value).endswith(message)


@pytest.mark.parametrize(
  'changes, message',
  [
    ({'posemb': 'grid'}, "posemb='grid' with posemb_grid=None"),
    ({'posemb_grid': (4, 4)}, "posemb='tokens' with posemb_grid=(4, 4)"),
    ({'posemb_resample': 'bicubic_antialias'}, "posemb='tokens' has none"),
    ({'posemb': 'patches', 'classifier': 'gap'}, "posemb='patches' leaves the prefix tokens"),
    ({'final_norm': 'both'}, "final_norm='both': use one of 'tokens', 'pooled'"),
    ({'classifier': 'cls'}, "classifier='cls': use one of"),
  ],
)
def test_architecture_options_that_cannot_go_together_are_refused(changes, message):
  with pytest.raises(ConfigError, match=message.replace('(', r'\(').replace(')', r'\)')):
    model_spec.registered('testing').changed(**changes)


def test_unknown_entry_keys_are_named():
  config = architectures.MODEL_CONFIGS['testing']
  config.no_embed_class = True
  config.fc_norm = True
  with pytest.raises(ConfigError, match='unknown option.s. fc_norm, no_embed_class$'):
    Architecture.of(config)


def test_block_fields_are_the_configs_block_options():
  assert set(model_spec.BLOCK_OPTIONS) <= {f.name for f in dataclasses.fields(Block)}
  assert model_spec.BIASES == ('all', 'no_key', 'no_qkv', 'no_qkv_or_norm')


def _trees():
  return {p: ast.parse(p.read_text(encoding='utf-8')) for p in PACKAGE.rglob('*.py')}


def test_no_module_reads_an_architecture_option_by_get():
  """Architectures are read by field; a `.get('option', default)` would restate a default the
  declaration holds. Only the official-config translation reads ConfigDicts of that format."""
  options = {f.name for f in dataclasses.fields(Architecture)} | {
    f.name for f in dataclasses.fields(Block)
  }
  options |= {'transformer', 'patches', 'model_name', 'no_embed_class', 'fc_norm', 'swiglu'}
  options -= {'name', 'block'}  # words that other dicts have too
  reads = [
    f'{path.relative_to(PACKAGE)}:{n.lineno}'
    for path, tree in _trees().items()
    if path.name != 'official.py'
    for n in ast.walk(tree)
    if isinstance(n, ast.Call)
    and isinstance(n.func, ast.Attribute)
    and n.func.attr == 'get'
    and n.args
    and isinstance(n.args[0], ast.Constant)
    and n.args[0].value in options
  ]
  assert reads == []


def test_interop_tells_models_apart_by_their_fields_not_their_family():
  """The converters read what a model computes (rotary embeddings: timm's `Eva` layout); a
  family's name is timm's registered name and nothing else."""
  from vit_jax.configs import families

  named = set(families.FAMILIES)
  found = [
    f'{path.name}:{n.lineno}'
    for path, tree in _trees().items()
    if path.parent.name == 'interop'
    for n in ast.walk(tree)
    if (isinstance(n, ast.Constant) and n.value in named)
    or (isinstance(n, ast.Attribute) and n.attr == 'family_of')
  ]
  assert found == []
