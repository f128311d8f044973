"""Data fields of an experiment config, with their defaults, in one place.

`add_data_config(config)` puts every field that `vit_jax.data.pipeline` reads
into `config` (keeping values already there), so experiment configs and tests
share one source of defaults. Field names follow the original vit_jax where it
had one (`dataset`, `tfds_data_dir`, `tfds_manual_dir`, `pp.train`, `pp.test`,
`pp.crop`, `pp.resize`, `batch`, `batch_eval`, `prefetch`).
"""

import ml_collections
from ml_collections.config_dict import placeholder

from vit_jax.configs import schema


def data_config() -> ml_collections.ConfigDict:
  """A fresh ConfigDict holding only the data fields, at their defaults.

  Fields that default to None are typed placeholders, so they can still be
  set from the command line (`--config.pp.train=train[:10%]`).
  """
  config = ml_collections.ConfigDict(
    {
      # What to read (docs/data.md): a TFDS name or preset
      # ('cifar10', 'imagenet2012', 'vtab/dtd'), the built-in 'digits', a
      # folder DIR/{train,test}/<class>/*, or a shard directory with info.json.
      'dataset': 'digits',
      # Where prepared TFDS datasets are; None = $TFDS_DATA_DIR or TFDS's default (data/readers/tfds.py).
      'tfds_data_dir': placeholder(str),
      'tfds_manual_dir': placeholder(str),  # manual downloads (ImageNet tars, ImageNet-21k folders)
      'pp': {
        'train': placeholder(str),  # train split, e.g. 'train[:98%]'; None = the dataset's preset
        'test': placeholder(str),  # test split; None = the dataset's preset
        'crop': 224,  # train and eval resolution (paper B.1.1: 224 pre-train, 384 fine-tune)
        'resize': placeholder(
          int
        ),  # eval: resize to this, then centre crop to `crop`; None = resize to crop
        # None below = the dataset's choice (vit_jax.data.presets; digits: no flip, area_min 0.5).
        'inception_crop': placeholder(
          bool
        ),  # train: random area/aspect crop; False = resize like eval
        'area_min': placeholder(float),  # inception crop: smallest crop area (default 0.05)
        'flip': placeholder(bool),  # train: random horizontal flip (default True)
        'randaug_layers': 0,  # RandAugment ops per image (AugReg: 2); 0 = off
        'randaug_magnitude': 10,  # RandAugment magnitude, 10 = the ops' full range
        'mixup': 0.0,  # Mixup Beta(alpha, alpha) alpha; 0 = off
      },
      'batch': 512,  # global train batch, split evenly over processes
      'batch_eval': 512,  # global eval batch
      'prefetch': 2,  # batches transferred to the devices ahead of use
      'input_threads': 0,  # decode threads of the input pipeline; 0 = every core this process may use
      'seed': 0,  # data order and augmentation are a pure function of (seed, step)
      # Image folders: True lets a class folder be absent from a split (else a one-line error).
      'allow_missing_classes': False,
      'eval_cache_mb': 1024,  # keep preprocessed eval data in host memory when below this
    }
  )
  # pp.crop_sampler and corrupt_images: the fields with choices (`configs.schema`).
  schema.fill_defaults(config, data=True)
  return config


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
