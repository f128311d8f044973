"""What a run compiles: the train and eval steps of a config on a mesh, and their inputs.

`validate` checks that a config's values can run together on a number of
devices (the schema's rules, then the model's) and resolves its model (a
`ModelSpec`), `make_mesh` lays the devices out, and `build` is the one path
from a config to the jitted steps. The trainer (`training.loop`) runs them on
real arrays; `python -m vit_jax.compile` compiles the very same functions ahead
of time for a TPU topology from `abstract_state` and `abstract_batch`, which
describe exactly what the trainer passes (shapes, dtypes, shardings; the state
is donated).
"""

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import numpy as np

from vit_jax.configs import ConfigError
from vit_jax.configs import schema
from vit_jax.configs.model_spec import ModelSpec
from vit_jax.core import sharding
from vit_jax.data import spec as data_spec
from vit_jax.models import flexi
from vit_jax.training import dino
from vit_jax.training import optim
from vit_jax.training import steps

# An abstract raw PRNG key: shapes are derived without creating arrays, so the
# same code runs under a mesh of devices this machine does not have (a TPU slice).
_KEY = jax.ShapeDtypeStruct((2,), np.uint32)


def validate(config, num_devices: int) -> ModelSpec:
  """The config's model (`ModelSpec.of`), once its values are checked to run together on
  `num_devices`: the schema's rules (`configs.schema.RULES`), then what the model itself can
  take (its crop and patch sizes, NaFlex's pooling, heads split over the mesh). A misfit is a
  one-line ConfigError."""
  schema.validate(config, schema.Devices(num_devices, jax.default_backend()))
  spec = ModelSpec.of(config)
  if config.patch_size is not None or config.flexi_patch_sizes:
    try:
      flexi.check_patch_sizes(spec, [spec.patch_size, *config.flexi_patch_sizes])
    except flexi.PatchSizeError as e:
      raise ConfigError(f'pp.crop={config.pp.crop}: {e}') from None
  if config.task == 'dino':
    dino.check_model(spec, config)
  if config.mesh.model > 1:
    block = spec.architecture.block
    try:
      sharding.check_model_fits(block.num_heads, block.mlp_dim, config.mesh.model)
    except sharding.MeshError as e:
      raise ConfigError(f'{config.model}: {e}') from None
  return spec


def check_host_batch(config, process_count: int, memory: Optional[int]) -> None:
  """ConfigError when one batch of a process, as the uint8 pixels the input pipeline assembles,
  is larger than this machine's `memory` (bytes): a batch that could never be read (a digit
  too many in --config.batch) is one line before the run starts, not an allocation failure."""
  if not memory:
    return
  side = int(config.pp.crop)
  for name in ('batch', 'batch_eval'):
    need = config[name] // max(process_count, 1) * side * side * 3
    if need > memory:
      per = ' in each of the processes' if process_count > 1 else ''
      raise ConfigError(
        f'{name}={config[name]:,}: one batch of {side} px images takes {need / 2**30:,.0f} GiB '
        f"of host memory{per}, more than this machine's {memory / 2**30:,.0f} GiB; lower "
        f'--config.{name}'
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
  spec: ModelSpec  # the model of the config
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
    batch = data_spec.batch_spec(
      self.config, self.num_classes, self.multi_label, train=train, model_spec=self.spec
    )
    return _with_shardings(batch, {key: self.batch_sharding for key in batch})


def build(
  config, mesh, num_classes: int, multi_label: bool, spec: Optional[ModelSpec] = None
) -> Program:
  """The task, optimizer, state layout and jitted steps of `config` on `mesh`, of the model
  `spec` (None: `ModelSpec.of(config)`; the trainer passes `validate`'s)."""
  spec = spec or ModelSpec.of(config)
  batch_sharding = sharding.batch_sharding(mesh)
  make_task = dino.make_task if config.task == 'dino' else steps.make_task
  task = make_task(config, num_classes, multi_label, spec)
  tx, schedule = (task.make_optimizer or optim.make_optimizer)(config)
  if task.init is not None:
    init = functools.partial(task.init, tx=tx)
  else:
    init = functools.partial(
      steps.init_state,
      model=task.model,
      tx=tx,
      image_size=spec.image_size,
      ema=bool(config.ema_decay),
    )
  state_shardings = sharding.tree_shardings(jax.eval_shape(init, _KEY), mesh)
  return Program(
    config=config,
    spec=spec,
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
