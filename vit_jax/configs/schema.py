"""The config fields that take one of a set of values, each declared once.

A `Choice` is a field's dotted name, its default, the values it may take and a
one-line doc. From this table come the defaults (`fill_defaults`, which
`common.get_config` and `data.data_config` call), the one check of those
values (`check`, which `training.program.validate` runs before anything
else), the tuples the code reads (`steps.TASKS`, `optim.OPTIMIZERS`,
`vit.ATTENTION`, `images.CROP_SAMPLERS`, ...) and the table in
docs/training.md (`python -m vit_jax.configs.schema` prints it;
tests/test_configs.py holds the two equal). Adding a field with choices is a
line here and the code that reads it.

The config files, the official-config translation and every
`--config.FIELD=...` flag see plain ConfigDict fields, as before.
"""

import dataclasses
from typing import Any, Tuple

from vit_jax.configs import ConfigError


@dataclasses.dataclass(frozen=True)
class Choice:
  field: str  # dotted: 'pp.crop_sampler'
  default: Any
  allowed: Tuple[str, ...]
  doc: str
  data: bool = False  # a data field (`configs.data.data_config`), read by the input pipeline too


CHOICES = (
  Choice(
    'task',
    'classification',
    ('classification', 'mpp'),
    'what is learnt: labels, or masked patch prediction (paper B.1.2, labels unused)',
  ),
  Choice('dtype', 'float32', ('float32', 'bfloat16', 'float16'), 'the compute dtype'),
  Choice(
    'remat_policy',
    'nothing_saveable',
    ('nothing_saveable', 'dots_saveable', 'dots_with_no_batch_dims_saveable'),
    'what `remat` keeps of a block for the backward pass: nothing, every matmul output, or '
    'those without a batch dimension (big_vision for ViT-22B)',
  ),
  Choice(
    'attention',
    'auto',
    ('auto', 'xla', 'cudnn', 'explicit'),
    "how attention is computed: 'auto' takes cuDNN's fused kernel where it applies "
    '(a CUDA GPU, bf16), else XLA; `explicit` keeps the weights (docs/speed_and_scale.md)',
  ),
  Choice(
    'optimizer',
    'adam',
    ('adam', 'sgd'),
    'Adam (pre-training) or SGD with momentum (fine-tuning), paper B.1',
  ),
  Choice(
    'optim_dtype',
    'float32',
    ('float32', 'bfloat16', 'float16'),
    "the dtype of Adam's first moment / SGD's momentum",
  ),
  Choice('decay_type', 'linear', ('linear', 'cosine'), 'the learning rate after warm-up'),
  Choice(
    'loss',
    'softmax',
    ('softmax', 'sigmoid'),
    'softmax cross-entropy, or sigmoid for multi-label data such as JFT (paper B.1)',
  ),
  Choice(
    'pp.crop_sampler',
    'tf',
    ('tf', 'log_ratio_10'),
    "inception crop boxes: 'tf' as `tf.image.sample_distorted_bounding_box` in the "
    "official pipeline, 'log_ratio_10' as runs before it (docs/data.md)",
    data=True,
  ),
  Choice(
    'corrupt_images',
    'skip',
    ('skip', 'fail'),
    'image folders and shards: an image that cannot be decoded is left out (logged and '
    'counted), or stops the run',
    data=True,
  ),
)
_BY_FIELD = {c.field: c for c in CHOICES}


def allowed(field: str) -> Tuple[str, ...]:
  """The values `field` may take."""
  return _BY_FIELD[field].allowed


def fill_defaults(config, *, data: bool) -> None:
  """Sets each choice field of the run (`data=False`) or of the data (`data=True`) that
  `config` does not have yet to its default."""
  with config.unlocked():
    for choice in CHOICES:
      if choice.data != data:
        continue
      *parents, name = choice.field.split('.')
      target = config
      for part in parents:
        target = target[part]
      if name not in target:
        target[name] = choice.default


def _value(config, field: str):
  for part in field.split('.'):
    if part not in config:
      return None
    config = config[part]
  return config


def check(config) -> None:
  """Raises ConfigError (one line) for the first field whose value is not among its choices."""
  for choice in CHOICES:
    value = _value(config, choice.field)
    if value is not None and value not in choice.allowed:
      raise ConfigError(f'{choice.field}={value!r}: use one of {", ".join(choice.allowed)}')


def markdown_table() -> str:
  """The docs' table of these fields."""
  rows = ['| field | default | values | what it chooses |', '|---|---|---|---|']
  for c in CHOICES:
    values = ', '.join(f'`{v}`' for v in c.allowed)
    rows.append(f'| `{c.field}` | `{c.default}` | {values} | {c.doc} |')
  return '\n'.join(rows)


if __name__ == '__main__':
  print(markdown_table())
