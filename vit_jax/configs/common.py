"""The defaults of every experiment config (`configs/*.py`; each field is declared in
`configs.schema`), and the official fine-tuning preset (`with_dataset`).

Field names follow the original vit_jax where it had one (`dataset`, `batch`,
`batch_eval`, `total_steps`, `base_lr`, `warmup_steps`, `decay_type`,
`accum_steps`, `grad_norm_clip`, `eval_every`, `checkpoint_every`, `pp.crop`,
`tfds_data_dir`, `tfds_manual_dir`).
"""

import copy

import ml_collections

from vit_jax import configs
from vit_jax.configs import schema

# The config errors of this package, named here too for the official-style helpers.
ConfigError = configs.ConfigError


def get_config():
  """Every field of a run at its default (`configs.schema.FIELDS`)."""
  return schema.defaults()


# Fine-tuning steps per dataset (paper Table 4; VTAB-1k: 2,500, Appendix B.1.1).
_FINETUNE_STEPS = {
  'imagenet2012': 20_000,
  'cifar10': 10_000,
  'cifar100': 10_000,
  'oxford_iiit_pet': 500,
  'oxford_flowers102': 500,
}


def finetune_steps(dataset: str) -> int:
  """The paper's fine-tuning steps for `dataset`; 10k (its CIFAR figure) for others."""
  if dataset.startswith('vtab/'):
    return 2_500
  return _FINETUNE_STEPS.get(dataset, 10_000)


def with_dataset(config: ml_collections.ConfigDict, dataset: str) -> ml_collections.ConfigDict:
  """The official fine-tuning config for `dataset` (official `common.with_dataset`).

  A copy of `config` with the official `common.get_config()` fine-tuning
  choices where this package's defaults (pre-training ones) differ, and the
  official dataset preset: the paper's steps, 384 px, the preset's splits.
  Set fields after calling it. As in the official configs, `config.model` is
  then assigned an official model config (`models.get_b16_config()`) or a
  registry name, whose dropout the run trains with, and `pretrained_dir`
  (default '.') is where `{model_name}.npz` is read from; the trainer reads
  both (`official.translate`).
  """
  config = copy.deepcopy(config)
  config.unlock()
  # Official defaults: SGD with momentum 0.9 kept in bfloat16 (train.py),
  # float32 compute, no weight decay, cosine decay after 500 warm-up steps.
  config.update(
    optimizer='sgd',
    momentum=0.9,
    optim_dtype='bfloat16',
    dtype='float32',
    weight_decay=0.0,
    base_lr=0.03,
    decay_type='cosine',
    warmup_steps=500,
    grad_norm_clip=1.0,
    batch=512,
    batch_eval=512,
    eval_every=100,
    progress_every=10,
    checkpoint_every=1000,
    representation_size=None,
    dataset=dataset,
    total_steps=finetune_steps(dataset),
  )
  config.pp.update(crop=384, train=None, test=None)  # None: the preset's splits
  # The official trainer takes dropout from the model config, which the config
  # file assigns to `model` (the official configs have no other dropout field).
  for field in ('model', 'dropout_rate', 'attention_dropout_rate'):
    if field in config:
      del config[field]
  config.model = None
  # Where {model_name}.npz is read from, as the official train.py ('.' there too).
  config.pretrained_dir = '.'
  return config
