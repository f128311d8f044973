"""The paper's training recipes (Appendix B.1): pre-training and fine-tuning.

`pretrain(model, arg)` returns paper Table 3's recipe for a model on
ImageNet-21k, JFT-style data or ImageNet; `finetune(arg)` returns Table 4's
recipe for `MODEL,DATASET`; `mpp(model, arg)` the masked patch prediction
recipe of B.1.2. The files in the repository's `configs/` call these.
`with_dataset(config, dataset)` is the official vit_jax's fine-tuning config
(`common.with_dataset`), for config files written for that code.
"""

import math
from typing import Optional

import ml_collections

from vit_jax.configs import ConfigError
from vit_jax.configs import common
from vit_jax.configs import families
from vit_jax.configs import model_spec
from vit_jax.configs import schema
from vit_jax.configs.common import finetune_steps
from vit_jax.configs.common import with_dataset  # noqa: F401  (recipes.with_dataset, as before)

# Training-set sizes the epochs of Table 3 refer to.
_DATASET_SIZES = {
  'imagenet21k': 14_197_122,
  'jft': 303_000_000,
  'imagenet2012': 1_281_167,
}

# Paper Table 3: (epochs, base LR, LR decay, weight decay, dropout).
_JFT = {
  'ViT-B_16': (7, 8e-4),
  'ViT-B_32': (7, 8e-4),
  'ViT-L_32': (7, 6e-4),
  'ViT-L_16': (7, 4e-4),  # 7 or 14 epochs in the paper: pass `:jft,14`
  'ViT-H_14': (14, 3e-4),
  'R50+ViT-B_16': (7, 8e-4),
  'R50+ViT-L_32': (7, 2e-4),
}


def _table3(model: str, dataset: str):
  if dataset == 'jft':
    if model not in _JFT:
      raise ConfigError(f'paper Table 3 has no JFT recipe for {model}; have: {sorted(_JFT)}')
    epochs, lr = _JFT[model]
    return epochs, lr, 'linear', 0.1, 0.0
  if dataset == 'imagenet21k':
    # B and L: 90 epochs (L also 30). H/14 and hybrids are not in Table 3 for
    # ImageNet-21k; they take the same recipe.
    return 90, 1e-3, 'linear', 0.03, 0.1
  if dataset == 'imagenet2012':
    return 300, 3e-3, 'cosine', 0.3, 0.1
  raise ConfigError(
    f'config argument {dataset!r}: use imagenet21k, jft or imagenet2012 '
    '(e.g. configs/vit_b16.py:imagenet21k, or :imagenet21k,30 for 30 epochs)'
  )


# Losses a pre-training recipe may name after its dataset (`:imagenet21k,sigmoid`).
PRETRAIN_LOSSES = schema.allowed('loss')


def _pretrain_arg(arg: str):
  """'DATASET[,EPOCHS][,LOSS]' -> (dataset, epochs or None, loss or None)."""
  dataset, *rest = arg.split(',')
  epochs = loss = None
  for part in rest:
    if part in PRETRAIN_LOSSES and loss is None:
      loss = part
    elif epochs is None and loss is None and part.isdigit() and int(part) >= 1:
      epochs = int(part)
    else:
      raise ConfigError(
        f'config argument {arg!r}: after the dataset, EPOCHS must be a positive integer and '
        f'LOSS one of {", ".join(PRETRAIN_LOSSES)} (DATASET[,EPOCHS][,LOSS])'
      )
  return dataset, epochs, loss


def pretrain(model: str, arg: str = 'imagenet21k') -> ml_collections.ConfigDict:
  """Pre-training (paper B.1, Table 3). `arg`: DATASET[,EPOCHS][,LOSS].

  LOSS chooses softmax or sigmoid cross-entropy; sigmoid comes with the head
  bias at -10 (paper B.1). Defaults: sigmoid for JFT (multi-label), softmax
  for ImageNet-21k and ImageNet (one label per image in TFDS); big_vision's
  ImageNet-21k recipe (AugReg) trains with sigmoid: `imagenet21k,sigmoid`.
  """
  dataset, epochs_arg, loss = _pretrain_arg(arg)
  epochs, base_lr, decay_type, weight_decay, dropout = _table3(model, dataset)
  if epochs_arg:
    epochs = epochs_arg
  hidden = model_spec.registered(model).hidden_size

  config = common.get_config()
  config.model = model
  config.dtype = 'bfloat16'
  config.representation_size = hidden  # B.1: pre-training head has one hidden layer
  config.dropout_rate = dropout
  config.pp.crop = 224
  config.batch = 4096
  config.batch_eval = 4096
  config.optimizer = 'adam'
  config.b1, config.b2 = 0.9, 0.999
  config.base_lr = base_lr
  config.decay_type = decay_type
  config.weight_decay = weight_decay
  config.warmup_steps = 10_000
  config.grad_norm_clip = 1.0
  config.total_steps = math.ceil(epochs * _DATASET_SIZES[dataset] / config.batch)
  config.progress_every = 100
  config.eval_every = 5000
  config.checkpoint_every = 2000
  if dataset == 'jft':
    # The data is the user's own shards: a directory with info.json (docs/data.md).
    config.dataset = ml_collections.config_dict.placeholder(str)
  else:
    config.dataset = dataset
  # JFT is multi-label: sigmoid cross-entropy, head bias -10 so that the
  # initial predictions are near 0 for each of its ~18k classes (B.1).
  config.loss = loss or ('sigmoid' if dataset == 'jft' else 'softmax')
  config.head_bias_init = -10.0 if config.loss == 'sigmoid' else 0.0
  return config


# A micro-batch per device at which ViT-B/16 fine-tuning (384 px, bf16, SGD)
# fits, per TPU generation as JAX names its devices: the answer of the TPU
# compiler's --fit search (`python benchmarks/tpu_table.py`, records
# benchmarks/tpu/finetune_b16_384_*.json; estimates, not runs on the chips).
B16_384_MICRO_BATCH_PER_DEVICE = {
  'TPU v2': 16,  # v2-8, the Colab TPU: 8 GiB per core
  'TPU v3': 32,
  'TPU v4': 64,
  'TPU v5 lite': 32,  # v5e
  'TPU v6 lite': 64,  # v6e
}


def finetune_accum_steps(device_kind: str, num_devices: int, batch: int = 512) -> Optional[int]:
  """accum_steps that fits ViT-B/16 fine-tuning at 384 px on these TPUs (None: not known)."""
  micro = B16_384_MICRO_BATCH_PER_DEVICE.get(device_kind)
  if micro is None:
    return None
  accum = 1
  while batch // accum > micro * num_devices and batch % (2 * accum) == 0:
    accum *= 2
  return accum


def finetune(arg: str) -> ml_collections.ConfigDict:
  """Fine-tuning (paper B.1.1, Table 4). `arg`: MODEL,DATASET."""
  model, _, dataset = arg.partition(',')
  if not model or not dataset:
    raise ConfigError(
      f'finetune config argument {arg!r}: use MODEL,DATASET '
      '(e.g. configs/finetune.py:ViT-B_16,cifar10)'
    )
  config = common.get_config()
  config.model = model
  config.dataset = dataset
  # The official fine-tuning trains with its model config's dropout: 0.1 for
  # ViT-L/16, ViT-H/14, R50+ViT-B/16 and R50+ViT-L/32, 0.0 for the others.
  config.dropout_rate = model_spec.registered(model).block.dropout_rate
  config.dtype = 'bfloat16'
  # Released ImageNet-21k weights; set --config.pretrained_path to another
  # .npz or to one of our workdirs.
  config.pretrained_path = f'gs://vit_models/imagenet21k/{model}.npz'
  # Paper B.1.1: fine-tune at 384 px; 392 for 14 px patches (384 would drop 6 px per side).
  patch = model_spec.registered(model).patch_size[0]
  config.pp.crop = -(-384 // patch) * patch
  config.batch = 512
  config.batch_eval = 512
  config.optimizer = 'sgd'
  config.momentum = 0.9
  config.decay_type = 'cosine'
  config.weight_decay = 0.0
  config.grad_norm_clip = 1.0
  config.warmup_steps = 500
  # Table 4: LR picked from {0.001, 0.003, 0.01, 0.03}; VTAB uses 0.01.
  config.base_lr = 0.01 if dataset.startswith('vtab/') else 0.03
  config.total_steps = finetune_steps(dataset)
  config.ema_decay = 0.0  # Polyak averaging: --config.ema_decay=0.9999
  if families.family_of(model) is not None:
    # A family's weights come from timm, whose fine-tunes resize the position table by
    # `resample_abs_pos_embed` (bicubic, antialiased); the paper's keep the official zoom.
    config.posemb_resize = 'bicubic_antialias'
  config.progress_every = 50
  config.eval_every = 1000
  config.checkpoint_every = 1000
  return config


def mpp(model: str, arg: str = 'jft') -> ml_collections.ConfigDict:
  """Masked patch prediction pre-training (paper B.1.2). `arg`: DATASET.

  B.1.2: ViT-B/16 on JFT, 1M steps (about 14 epochs) of batch 4096, Adam with
  base learning rate 2e-4, 10k warm-up steps and cosine decay. Weight decay
  and dropout are not given there; the supervised JFT values (0.1, none) are
  used. Labels are not read.
  """
  config = pretrain(model, 'jft' if arg == 'jft' else arg)
  config.task = 'mpp'
  config.representation_size = None  # the colour head reads patch tokens
  config.loss = 'softmax'
  config.head_bias_init = 0.0
  config.base_lr = 2e-4
  config.decay_type = 'cosine'
  config.weight_decay = 0.1
  config.dropout_rate = 0.0
  config.total_steps = 1_000_000
  return config
