"""The data fields of an experiment config (those `configs.schema` marks `data`).

`add_data_config(config)` puts every field that `vit_jax.data.pipeline` reads
into `config` (keeping values already there). Field names follow the original vit_jax where it
had one (`dataset`, `tfds_data_dir`, `tfds_manual_dir`, `pp.train`, `pp.test`,
`pp.crop`, `pp.resize`, `batch`, `batch_eval`, `prefetch`).
"""

import ml_collections

from vit_jax.configs import schema


def data_config() -> ml_collections.ConfigDict:
  """A fresh ConfigDict holding only the data fields, at their defaults (`configs.schema`)."""
  return schema.defaults(data_only=True)


def add_data_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Adds the data fields to `config` where missing; returns `config`."""
  _merge_missing(config, data_config())
  return config


def _merge_missing(config, defaults):
  with config.unlocked():
    # Keep FieldReferences: a typed None placeholder stays settable.
    for key, value in defaults.items(preserve_field_references=True):
      if key not in config:
        config[key] = value
      elif isinstance(value, ml_collections.ConfigDict):
        _merge_missing(config[key], value)
