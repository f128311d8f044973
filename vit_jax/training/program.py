"""What a run compiles: the train and eval steps of a config on a mesh, and their inputs.

`validate` checks that a config's values can run together on a number of
devices, `make_mesh` lays the devices out, and `build` is the one path from a
config to the jitted steps. The trainer (`training.loop`) runs them on real
arrays; `python -m vit_jax.compile` compiles the very same functions ahead of
time for a TPU topology from `abstract_state` and `abstract_batch`, which
describe exactly what the trainer passes (shapes, dtypes, shardings; the
state is donated).
"""

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np

from vit_jax.configs import ConfigError
from vit_jax.configs import architectures
from vit_jax.configs import schema
from vit_jax.core import sharding
from vit_jax.data import spec
from vit_jax.models import flexi
from vit_jax.models import naflex
from vit_jax.training import optim
from vit_jax.training import steps

# An abstract raw PRNG key: shapes are derived without creating arrays, so the
# same code runs under a mesh of devices this machine does not have (a TPU slice).
_KEY = jax.ShapeDtypeStruct((2,), np.uint32)


def validate(config, num_devices: int) -> None:
  """Raises ConfigError (one line) for values that cannot run together (first, a field's value
  outside its choices: `configs.schema.check`)."""
  schema.check(config)
  _validate_batches(config, num_devices)
  if config.total_steps < 1:
    raise ConfigError(f'total_steps={config.total_steps} must be positive')
  if not 0 <= config.warmup_steps < config.total_steps:
    raise ConfigError(
      f'warmup_steps={config.warmup_steps} must be in [0, total_steps={config.total_steps}): '
      f'add --config.warmup_steps={config.total_steps // 10}'
    )
  if config.attention == 'cudnn' and (
    config.dtype not in ('bfloat16', 'float16') or jax.default_backend() != 'gpu'
  ):
    raise ConfigError(
      "attention='cudnn' needs a CUDA GPU and --config.dtype=bfloat16; "
      "use attention='auto', which takes cuDNN where it applies"
    )
  _validate_resolution(config)
  _validate_tokens(config)
  if config.mesh.model > 1:
    arch = steps.model_config(config)
    try:
      sharding.check_model_fits(
        arch.transformer.num_heads, arch.transformer.mlp_dim, config.mesh.model
      )
    except sharding.MeshError as e:
      raise ConfigError(f'{config.model}: {e}') from None


def _validate_resolution(config) -> None:
  """pp.crop a multiple of the pixels one patch covers: the patch embedding (a strided conv)
  would drop the rest at the right and bottom edges, and predict would later resize to the
  size the position embeddings give, not to this one."""
  if config.model not in architectures.MODEL_CONFIGS:
    return  # said by the model's own check, with the closest names
  arch = architectures.MODEL_CONFIGS[config.model]
  stride = config.get('patch_size') or arch.patches.size[0]
  if arch.get('resnet') is not None:  # root /4, then /2 per stage after the first
    stride *= 4 * 2 ** max(len(arch.resnet.num_layers) - 1, 0)
  crop = config.pp.crop
  if crop % stride:
    lower, upper = crop - crop % stride, crop - crop % stride + stride
    raise ConfigError(
      f'pp.crop={crop} is not a multiple of the {stride} px that one patch of {config.model} '
      f'covers: the last {crop % stride} px of each row and column would be dropped; use '
      f'--config.pp.crop={upper}' + (f' or {lower}' if lower else '')
    )


def _validate_tokens(config) -> None:
  """Registers, FlexiViT's patch sizes (each must tile the images of a plain ViT), NaFlex."""
  if config.num_registers and config.task != 'classification':
    raise ConfigError(
      f'num_registers={config.num_registers}: masked patch prediction reads patch tokens at '
      'fixed positions; train it without registers'
    )
  if config.naflex_tokens:
    _validate_naflex(config)
  if config.patch_size is None and not config.flexi_patch_sizes:
    return
  if config.flexi_patch_sizes and config.task != 'classification':
    raise ConfigError(
      f'flexi_patch_sizes trains classification only, not task={config.task!r}; leave it empty'
    )
  arch = steps.model_config(config)
  try:
    flexi.check_patch_sizes(arch, config.pp.crop, [arch.patches.size[0], *config.flexi_patch_sizes])
  except flexi.PatchSizeError as e:
    raise ConfigError(f'pp.crop={config.pp.crop}: {e}') from None


def _validate_naflex(config) -> None:
  """NaFlex trains classification of a plain ViT with token or mean pooling, nothing else."""
  arch = steps.model_config(config)
  unsupported = [
    (config.task != 'classification', f'task={config.task!r}'),
    (arch.classifier not in naflex.CLASSIFIERS, f'classifier={arch.classifier!r}'),
    (arch.get('resnet') is not None, 'a hybrid'),
    (bool(config.flexi_patch_sizes), 'flexi_patch_sizes'),
    (bool(config.pp.randaug_layers or config.pp.mixup), 'RandAugment or Mixup'),
    (config.attention_dropout_rate > 0, 'attention dropout'),
    (any(config.block.values()), 'ViT-22B blocks'),
    (min(config.naflex_tokens) < 1, 'a budget below 1 token'),
  ]
  for bad, what in unsupported:
    if bad:
      raise ConfigError(
        f'naflex_tokens={tuple(config.naflex_tokens)}: NaFlex trains classification with a '
        f'plain ViT (token or gap pooling), not with {what}; change it or leave naflex_tokens empty'
      )


def _validate_batches(config, num_devices: int) -> None:
  for field in ('batch', 'batch_eval'):
    if config[field] < 1:
      raise ConfigError(f'{field}={config[field]} must be at least 1')
  if not isinstance(config.accum_steps, int) or config.accum_steps < 1:
    raise ConfigError(
      f'accum_steps={config.accum_steps!r} must be a positive number of micro-batches '
      '(1: no accumulation)'
    )
  per_step = config.accum_steps * num_devices
  if config.batch % per_step:
    raise ConfigError(
      f'batch={config.batch} must be a multiple of accum_steps ({config.accum_steps}) x '
      f'devices ({num_devices}) = {per_step}'
    )
  if config.batch_eval % num_devices:
    raise ConfigError(
      f'batch_eval={config.batch_eval} must be a multiple of the number of devices ({num_devices})'
    )


def make_mesh(config, devices=None):
  """The run's (slice, data, fsdp, model) mesh; a misfit is a one-line ConfigError."""
  try:
    return sharding.make_mesh(
      config.mesh.fsdp, devices, model=config.mesh.model, data=config.mesh.data
    )
  except sharding.MeshError as e:
    raise ConfigError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class Program:
  config: Any
  num_classes: int
  multi_label: bool
  task: steps.Task
  tx: Any
  schedule: Any
  init: Callable  # rng -> TrainState
  state_shardings: Any
  batch_sharding: Any
  train_step: Callable  # jitted (state, batch) -> (state, metrics); donates the state
  eval_step: Callable  # jitted (params, batch) -> counts

  def abstract_state(self):
    """The train state as shape structs carrying their shardings."""
    return _with_shardings(jax.eval_shape(self.init, _KEY), self.state_shardings)

  def abstract_batch(self, train: bool = True) -> dict:
    """A global batch as the input pipeline delivers it, laid out over the mesh."""
    batch = spec.batch_spec(self.config, self.num_classes, self.multi_label, train=train)
    return _with_shardings(batch, {key: self.batch_sharding for key in batch})


def build(config, mesh, num_classes: int, multi_label: bool) -> Program:
  """The task, optimizer, state layout and jitted steps of `config` on `mesh`."""
  batch_sharding = sharding.batch_sharding(mesh)
  task = steps.make_task(config, num_classes, multi_label)
  tx, schedule = optim.make_optimizer(config)
  init = functools.partial(
    steps.init_state, model=task.model, tx=tx, image_size=config.pp.crop, ema=bool(config.ema_decay)
  )
  state_shardings = sharding.tree_shardings(jax.eval_shape(init, _KEY), mesh)
  return Program(
    config=config,
    num_classes=num_classes,
    multi_label=multi_label,
    task=task,
    tx=tx,
    schedule=schedule,
    init=init,
    state_shardings=state_shardings,
    batch_sharding=batch_sharding,
    train_step=steps.jit_train_step(
      task=task,
      tx=tx,
      schedule=schedule,
      config=config,
      state_shardings=state_shardings,
      batch_sharding=batch_sharding,
    ),
    eval_step=steps.jit_eval_step(
      task=task, params_shardings=state_shardings.params, batch_sharding=batch_sharding
    ),
  )


def _with_shardings(abstract, shardings):
  return jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
  )
