"""The official vit_jax's training configs, read as this package's.

Configs written for google-research/vision_transformer (`common.with_dataset`,
`config.model = models.get_b16_config()`, `config.pretrained_dir`) train here
as they would there: `translate(config)`, which the command line calls first
(`vit_jax.core.cli`; and the official entry point `vit_jax.train.train_and_evaluate`),
maps their fields onto this package's, or refuses in one line naming ours. A
config with none of them passes through unchanged.
"""

import copy
import os
from typing import Mapping

import ml_collections

from vit_jax.configs import architectures
from vit_jax.configs import common
from vit_jax.configs import recipes

ConfigError = common.ConfigError

# Official fields that this package has no field for -> what to do here. The
# command line names these for `--config.FIELD` on configs that lack them.
OFFICIAL_ONLY = {
  'pretrained_dir': 'here: --config.pretrained_path=DIR/MODEL.npz (the file itself)',
  'model_or_filename': (
    'here: --config.model=NAME and --config.pretrained_path=gs://vit_models/augreg/FILE.npz'
  ),
  'shuffle_buffer': 'not needed here: every epoch reads a full permutation of the split',
  'trainer': 'here the trainer only trains; time inference with python -m vit_jax.benchmark',
  'model_type': 'here --config.model names a ViT or R+ViT (Mixer is not part of this package)',
}

# The architecture fields of a model config; the others are run-time choices.
_ARCHITECTURE = ('patches', 'hidden_size', 'transformer', 'resnet', 'classifier')
_TRANSFORMER_SHAPE = ('mlp_dim', 'num_heads', 'num_layers')


def hint(field: str) -> str:
  """What replaces an official-only `field` here, or '' for other names."""
  if field in OFFICIAL_ONLY:
    return f'the official vit_jax field; {OFFICIAL_ONLY[field]}'
  return ''


def _plain(value):
  """Config values as comparable plain data: mappings as dicts, sequences as tuples."""
  if isinstance(value, (Mapping, ml_collections.ConfigDict)):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return tuple(_plain(v) for v in value)
  return value


def _architecture(model) -> dict:
  model = _plain(model)
  arch = {key: model.get(key) for key in _ARCHITECTURE}
  arch['transformer'] = {k: (arch['transformer'] or {}).get(k) for k in _TRANSFORMER_SHAPE}
  return arch


def registry_name(model) -> str:
  """The MODEL_CONFIGS name of a model config dict with the same architecture.

  Its own `model_name` first; dropout, pre-logits and the name itself are not
  architecture. Raises ConfigError when no registry entry has its shape.
  """
  name = model.get('model_name')
  if isinstance(name, str) and name.startswith(('Mixer-', 'LiT-')):
    try:
      architectures.MODEL_CONFIGS[name]
    except KeyError as e:
      raise ConfigError(f'config.model: {e.args[0]}') from None
  wanted = _architecture(model)
  candidates = ([name] if name in architectures.MODEL_CONFIGS else []) + list(
    architectures.MODEL_CONFIGS
  )
  for candidate in candidates:
    if _architecture(architectures.MODEL_CONFIGS[candidate]) == wanted:
      return candidate
  if name in architectures.MODEL_CONFIGS:
    registered = _architecture(architectures.MODEL_CONFIGS[name])
    field = next(k for k in _ARCHITECTURE if registered[k] != wanted[k])
    raise ConfigError(
      f'config.model: {name} with {field}={wanted[field]} matches no MODEL_CONFIGS entry; '
      'this package trains registry architectures: set config.model to a registry name'
    )
  raise ConfigError(
    f'config.model: {name!r} matches no MODEL_CONFIGS entry in name or shape; set '
    'config.model to a registry name (vit_jax.configs.architectures.MODEL_CONFIGS)'
  )


def _is_official(config) -> bool:
  model = config.get('model')
  return (
    any(field in config for field in OFFICIAL_ONLY)
    or model is None
    or isinstance(model, (Mapping, ml_collections.ConfigDict))
    or config.get('accum_steps', 1) in (0, None)
    or config.get('total_steps', 1) is None
    or config.get('pp', {}) is None
  )


def _add_missing(config, defaults):
  """Fields of `defaults` that `config` lacks (recursively), keeping typed placeholders."""
  for key, value in defaults.items(preserve_field_references=True):
    if key not in config or (config[key] is None and isinstance(value, ml_collections.ConfigDict)):
      if key in config:
        del config[key]
      config[key] = value
    elif isinstance(value, ml_collections.ConfigDict) and isinstance(
      config[key], ml_collections.ConfigDict
    ):
      _add_missing(config[key], value)


def translate(config):
  """`config` with the official fields read as this package's; see the module docstring.

  - `model` as a config dict (`models.get_b16_config()`): its registry name,
    with its `transformer.dropout_rate`, `attention_dropout_rate` and
    `representation_size` as the run's (the official trainer uses the model
    config's); a name in a config without `dropout_rate` (official style)
    takes the registry entry's. Mixer and LiT are refused.
  - `pretrained_dir`: fine-tune from `{pretrained_dir}/{model_name}.npz`, as
    the official train.py, unless `pretrained_path` is set;
    `model_or_filename` with a full AugReg file name picks that file.
  - `accum_steps` 0 or None: no accumulation (1), as the official code.
  - `total_steps` None: the paper's steps for the dataset.
  - `shuffle_buffer`, `trainer='train'`, `model_type='ViT'`: nothing to do.
  - fields this package has and the config lacks: this package's defaults.
  """
  if not _is_official(config):
    return config
  official = config
  config = copy.deepcopy(config)
  config.unlock()
  name = _model_by_name(config)
  _add_missing(config, common.get_config())
  _refuse_what_has_no_counterpart(official)
  filename = official.get('model_or_filename')
  pretrained_dir = official.get('pretrained_dir')
  if config.pretrained_path is None and pretrained_dir:
    config.pretrained_path = os.path.join(pretrained_dir, f'{filename or name}.npz')
  if config.accum_steps in (0, None):
    config.accum_steps = 1
  if config.total_steps is None and config.get('dataset'):
    config.total_steps = recipes.finetune_steps(config.dataset)
  for field in OFFICIAL_ONLY:
    if field in config:
      del config[field]
  return config


def _model_by_name(config) -> str:
  """Sets `config.model` to its registry name (from an official model config dict, with its
  dropout and pre-logits as the run's); returns the name."""
  model = config.get('model')
  if model is None:
    raise ConfigError(
      'config.model is not set: give a MODEL_CONFIGS name or an official model config '
      '(config.model = models.get_b16_config())'
    )
  if isinstance(model, str) and 'dropout_rate' not in config:
    # An official-style config naming its model: the model config's dropout.
    model = architectures.MODEL_CONFIGS[model]
  if not isinstance(model, (Mapping, ml_collections.ConfigDict)):
    return model
  name = registry_name(model)
  transformer = model.get('transformer') or {}
  del config['model']
  config.model = name
  for field in ('dropout_rate', 'attention_dropout_rate'):
    config[field] = float(transformer.get(field, 0.0))
  config.representation_size = model.get('representation_size')
  return name


def _refuse_what_has_no_counterpart(official) -> None:
  """Mixer, the inference-time trainer and AugReg's index lookup: one line each."""
  if official.get('model_type', 'ViT') != 'ViT':
    raise ConfigError(
      f"model_type={official.model_type!r}: this package has ViT and R+ViT hybrids only; use 'ViT'"
    )
  if official.get('trainer', 'train') != 'train':
    raise ConfigError(f'trainer={official.trainer!r}: {OFFICIAL_ONLY["trainer"]}')
  filename = official.get('model_or_filename')
  if filename and '-' not in filename:
    raise ConfigError(
      f'model_or_filename={filename!r}: choosing the best AugReg file from index.csv is not '
      'done here; name the file (R_Ti_16-i21k-300ep-...) or set --config.pretrained_path'
    )
