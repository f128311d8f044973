"""Defaults shared by every experiment config (`configs/*.py`).

Field names follow the original vit_jax where it had one (`dataset`, `batch`,
`batch_eval`, `total_steps`, `base_lr`, `warmup_steps`, `decay_type`,
`accum_steps`, `grad_norm_clip`, `eval_every`, `checkpoint_every`, `pp.crop`,
`tfds_data_dir`, `tfds_manual_dir`).
"""

import copy

import ml_collections

from vit_jax import configs
from vit_jax.configs import data
from vit_jax.configs import schema

# The config errors of this package, named here too for the official-style helpers.
ConfigError = configs.ConfigError


def get_config():
  """Every field of a run, each with its default; the sections below, in order, then the
  fields that take one of a set of values (task, dtype, remat_policy, attention, optimizer,
  optim_dtype, decay_type, loss: `configs.schema`)."""
  config = ml_collections.ConfigDict()
  config.seed = 0
  _add_model(config)
  data.add_data_config(config)  # dataset, splits, preprocessing (vit_jax/configs/data.py)
  _add_optimization(config)
  _add_fewshot_devices_and_loop(config)
  schema.fill_defaults(config, data=False)
  return config


def _add_model(config) -> None:
  # Model: a `vit_jax.configs.architectures.MODEL_CONFIGS` name plus run-time choices.
  config.model = 'ViT-B_16'
  config.remat = False  # recompute blocks in the backward pass
  # The encoder blocks as one nn.scan: compile time and program size flat in
  # depth; checkpoints and exports still name encoderblock_{i}.
  config.scan_layers = False
  # Encoder blocks, overriding the model's (None: the model's own), e.g. a
  # shallower copy of a giant model; the compile command's depth extrapolation.
  config.depth = ml_collections.config_dict.placeholder(int)
  # Block variants beyond the paper (ViT-22B), for any size; None keeps the
  # model's own (vit_jax.models.vit): attention and MLP in parallel, LayerNorm
  # of queries and keys, biases in the q/k/v projections and LayerNorms.
  config.block = ml_collections.ConfigDict(
    {
      'parallel_block': ml_collections.config_dict.placeholder(bool),
      'qk_norm': ml_collections.config_dict.placeholder(bool),
      'qkv_and_norm_biases': ml_collections.config_dict.placeholder(bool),
    }
  )
  # FlexiViT (Beyer et al. 2023; vit_jax.models.flexi): the patch size to train at,
  # overriding the model's (None: its own); a pretrained checkpoint's patch
  # embedding is PI-resized to it and its position embeddings to the new grid.
  config.patch_size = ml_collections.config_dict.placeholder(int)
  # Patch sizes to draw one from per training step, the model's kernel and
  # position embeddings resized to it on the fly (FlexiViT's recipe); () = off.
  # Evaluation runs at the model's own patch size.
  config.flexi_patch_sizes = ()
  # NaFlex (vit_jax.models.naflex): token budgets; each training image keeps its
  # (cropped) aspect ratio, resized to fit a budget drawn from these, and a
  # batch holds max(budgets) patches per image; () = off (square crops). The
  # model then takes images of any size the patch divides (evaluation at
  # pp.crop) and its position embeddings are a 2D grid of pp.crop / patch.
  config.naflex_tokens = ()
  # Register tokens (Darcet et al. 2023): learned tokens after the class token that
  # attention may use as scratch space, dropped before the head; 0 = none.
  config.num_registers = 0
  config.dropout_rate = 0.0
  config.attention_dropout_rate = 0.0
  config.representation_size = ml_collections.config_dict.placeholder(int)  # pre-logits
  config.head_bias_init = 0.0  # -10 with the sigmoid loss (paper B.1)
  config.pretrained_path = ml_collections.config_dict.placeholder(str)


def _add_optimization(config) -> None:
  # Optimisation (paper Appendix B.1).
  config.b1 = 0.9
  config.b2 = 0.999
  config.momentum = 0.9
  config.base_lr = 1e-3
  config.warmup_steps = 10_000
  config.linear_end = 1e-5  # where the linear decay ends (the official schedule's floor)
  config.weight_decay = 0.0  # decoupled, kernels only
  config.grad_norm_clip = 1.0
  config.label_smoothing = 0.0
  config.ema_decay = 0.0  # Polyak averaging factor; 0 = off
  config.total_steps = 10_000
  config.accum_steps = 1  # micro-batches per step (same math, less memory)
  config.skip_nonfinite = False  # skip NaN/Inf steps instead of stopping
  # With skip_nonfinite: this many skipped steps in a row stop the run (one error: line). A
  # diverged run skips every step from then on (297 of 300 at base_lr=1e4), a bad batch one.
  config.max_nonfinite_in_a_row = 10


def _add_fewshot_devices_and_loop(config) -> None:
  # Few-shot linear evaluation of the frozen pre-logits (paper 4.1), on the
  # train/test splits of other datasets, every `every` steps and at the end.
  config.fewshot = ml_collections.ConfigDict(
    {
      'datasets': (),  # e.g. ('cifar10', 'vtab/dtd'); empty = off
      'every': 0,  # steps between evaluations; 0 = only at the end
      'shots': (1, 5, 10, 25),
      'seeds': (0, 1, 2),
      'l2_reg': 2.0**10,
      'train_split': 'train',  # 'train' / 'test' = the dataset's own; or a split expression
      'test_split': 'test',
    }
  )

  # Devices: a (slice, data, fsdp, model) mesh over all devices (vit_jax.core.sharding);
  # slices come from the devices, fsdp > 1 shards params and optimizer state,
  # model > 1 splits heads and MLP units (tensor parallelism).
  config.mesh = ml_collections.ConfigDict(
    {
      'fsdp': 1,
      'model': 1,
      'data': ml_collections.config_dict.placeholder(int),  # None: the devices left over
    }
  )

  # Loop.
  config.progress_every = 100
  config.eval_every = 1000
  config.checkpoint_every = 1000
  config.keep_checkpoints = 3
  config.tensorboard = True
  config.peak_flops = ml_collections.config_dict.placeholder(float)  # per device, for MFU


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
