"""What a run compiles: the train and eval steps of a config on a mesh, and their inputs.

`build` is the one path from a config to the jitted steps. The trainer
(`training.loop`) runs them on real arrays; `python -m vit_jax.compile`
compiles the very same functions ahead of time for a TPU topology from
`abstract_state` and `abstract_batch`, which describe exactly what the trainer
passes (shapes, dtypes, shardings; the state is donated).
"""

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np

from vit_jax import sharding
from vit_jax.data import spec
from vit_jax.training import optim
from vit_jax.training import steps

# An abstract raw PRNG key: shapes are derived without creating arrays, so the
# same code runs under a mesh of devices this machine does not have (a TPU slice).
_KEY = jax.ShapeDtypeStruct((2,), np.uint32)


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
