"""Training: the task, the train state, one train step, one eval step.

Each step is a pure function of (state, batch), jitted over a device mesh by
`vit_jax.training.loop`. Pre-training and fine-tuning differ only in their config
(paper Appendix B.1): the optimizer, the loss and whether a checkpoint seeds
the parameters. The task is supervised classification or masked patch
prediction (paper B.1.2).
"""

import functools
from typing import Any, Callable, NamedTuple, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from vit_jax import models
from vit_jax.configs.model_spec import Compute
from vit_jax.configs.model_spec import ModelSpec
from vit_jax.core import hardware
from vit_jax.core import sharding
from vit_jax.data import on_device
from vit_jax.evaluation import metrics
from vit_jax.models import flexi
from vit_jax.models import mpp
from vit_jax.models import vit


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any
  opt_state: Any
  ema_params: Any  # Polyak average of params, or None
  rng: jax.Array  # base PRNG key (raw uint32); step keys are folded from it
  num_skipped: jax.Array  # steps whose loss or gradient was not finite
  task_state: Any = None  # what a task carries from step to step (DINO's running centres)


class Task(NamedTuple):
  """What is trained: the model, its loss on a batch, its evaluation counts."""

  model: nn.Module
  loss_fn: Callable  # (params, batch, rng, train) -> scalar loss
  eval_fn: Callable  # (params, batch) -> {'correct', 'count', ...}: sums over real examples
  # A batch as it crosses to the devices (uint8 pixels, Mixup's weights) -> the batch
  # loss_fn and eval_fn take ([-1, 1] floats, soft labels): `on_device.prepare`.
  prepare: Callable
  # (params, batch, rng) -> (training loss, gradients); None: value_and_grad of loss_fn.
  grad_fn: Optional[Callable] = None
  # The backbone without a head (pre-logits features) on the same parameters: few-shot probes.
  features: Optional[nn.Module] = None
  # A task that trains more than one set of parameters (self-distillation) brings its own:
  # `init(rng, tx) -> TrainState`, `step` with `train_step`'s signature, `make_optimizer(config)
  # -> (tx, schedule)`; None: those of this module and `optim`.
  init: Optional[Callable] = None
  step: Optional[Callable] = None
  make_optimizer: Optional[Callable] = None
  # The TrainState field that evaluation, few-shot probes and a run's params.npz read: the
  # trained parameters, or (self-distillation) the EMA teacher's.
  evaluated: str = 'params'
  # `evaluate(run, params) -> {'accuracy', 'examples'}` instead of the eval step's accuracy on
  # the test split ({}: nothing to evaluate); None: `metrics.accuracy` of `eval_fn`.
  evaluate: Optional[Callable] = None


def make_task(
  config, num_classes: int, multi_label: bool, spec: Optional[ModelSpec] = None
) -> Task:
  """The task named by `config.task`: 'classification' or 'mpp', of the model `spec` (None:
  `ModelSpec.of(config)`).

  Its loss and evaluation take the float32 parameters and cast them to the
  compute dtype once, at the top (`vit.compute_params`): gradients flow back
  through that cast to float32, and no layer casts on every call.
  """
  spec = spec or ModelSpec.of(config)
  compute = Compute.of(config)
  # The classification loss, of labels or of Mixup's soft ones.
  objective = lambda logits, batch: cross_entropy(
    logits, batch['label'], loss=config.loss, label_smoothing=config.label_smoothing
  )
  cast = lambda params: vit.compute_params(params, config.dtype)
  features = models.build(spec, None, compute)

  if config.task == 'classification':
    model = models.build(spec, num_classes, compute, config.head_bias_init)

    def loss_fn(params, batch, rng, train):
      variables = {'params': cast(params)}
      logits = model.apply(variables, batch['image'], train=train, rngs={'dropout': rng})
      return objective(logits, batch)

    grad_fn = None
    if config.flexi_patch_sizes:  # FlexiViT: a random patch size per training step
      sizes = tuple(config.flexi_patch_sizes)
      grad_fn = flexi.random_patch_grad(
        model, sizes, spec.image_size, objective, cast, config.posemb_resize, config.patch_resize
      )

    def eval_fn(params, batch):
      logits = model.apply({'params': cast(params)}, batch['image'], train=False)
      return metrics.classification_counts(logits, batch['label'], batch['mask'], multi_label)

  else:
    assert config.task == 'mpp', config.task  # the schema's other choice
    model = mpp.MppViT(spec.architecture, compute)  # the colour head's bias starts at zero

    def loss_fn(params, batch, rng, train):
      return mpp.loss_fn(cast(params), batch['image'], rng, model=model, train=train)[0]

    def eval_fn(params, batch):
      return mpp.eval_counts(cast(params), batch['image'], batch['mask'], model=model)

    grad_fn = None

  prepare = functools.partial(on_device.prepare, num_classes=num_classes)
  return Task(model, loss_fn, eval_fn, prepare, grad_fn, features)


def init_state(rng, *, model, tx, image_size, ema: bool) -> TrainState:
  init_rng, state_rng = jax.random.split(rng)
  images = jnp.zeros((1, image_size, image_size, 3), jnp.float32)
  params = model.init(init_rng, images, train=False)['params']
  return TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=tx.init(params),
    ema_params=params if ema else None,
    rng=state_rng,
    num_skipped=jnp.zeros((), jnp.int32),
  )


def cross_entropy(logits, labels, *, loss: str, label_smoothing: float = 0.0):
  """Mean over the batch. `labels`: int [B] or (multi-hot / soft) float [B, K]; `loss`:
  'softmax' or 'sigmoid' (the schema's values)."""
  num_classes = logits.shape[-1]
  targets = jax.nn.one_hot(labels, num_classes) if labels.ndim == 1 else labels
  if label_smoothing:
    targets = targets * (1.0 - label_smoothing) + label_smoothing / num_classes
  if loss == 'sigmoid':
    # Paper B.1: sigmoid cross-entropy for multi-label JFT, summed over classes.
    return jnp.mean(jnp.sum(optax.sigmoid_binary_cross_entropy(logits, targets), axis=-1))
  return -jnp.mean(jnp.sum(targets * jax.nn.log_softmax(logits), axis=-1))  # 'softmax'


def _micro_batches(x, accum_steps):
  """[B, ...] -> [accum_steps, B / accum_steps, ...], keeping rows on their device.

  Micro-batch i takes rows i, i + accum_steps, ...; each device's contiguous
  block of the batch holds an equal share of every micro-batch, so no data
  moves between devices.
  """
  x = x.reshape((x.shape[0] // accum_steps, accum_steps) + x.shape[1:])
  x = jnp.moveaxis(x, 1, 0)
  if jax.sharding.get_abstract_mesh().empty:  # called outside `jax.set_mesh`
    return x
  return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(None, sharding.BATCH_AXES))


def accumulated_value_and_grad(grad_fn, params, batch, rng, accum_steps: int):
  """`grad_fn(params, batch, rng)` of the whole batch, as the mean over micro-batches.

  Micro-batch i gets the key fold_in(rng, i); one micro-batch uses `rng` itself.
  """
  if accum_steps == 1:
    return grad_fn(params, batch, rng)
  micro = jax.tree.map(lambda x: _micro_batches(x, accum_steps), batch)

  def accumulate(carry, i):
    loss_sum, grad_sum = carry
    loss, grads = grad_fn(params, jax.tree.map(lambda x: x[i], micro), jax.random.fold_in(rng, i))
    return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

  zeros = jax.tree.map(jnp.zeros_like, params)
  (loss, grads), _ = jax.lax.scan(accumulate, (0.0, zeros), jnp.arange(accum_steps))
  return loss / accum_steps, jax.tree.map(lambda g: g / accum_steps, grads)


def train_step(state: TrainState, batch, *, task: Task, tx, schedule, config):
  """One optimizer step over the global batch (accumulated over micro-batches).

  `batch` as it crosses to the devices: prepared here, once for the whole
  batch (Mixup pairs neighbours, which micro-batches would separate).
  """
  batch = task.prepare(batch)
  step_rng = jax.random.fold_in(state.rng, state.step)
  grad_fn = task.grad_fn or jax.value_and_grad(functools.partial(task.loss_fn, train=True))
  loss, grads = accumulated_value_and_grad(
    grad_fn, state.params, batch, step_rng, config.accum_steps
  )

  grad_norm = optax.global_norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  # A non-finite step changes nothing; the loop then stops or skips it.
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
  ema_params = state.ema_params
  if ema_params is not None:
    decay = config.ema_decay
    ema_params = keep(
      jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, ema_params, params), ema_params
    )
  new_state = state.replace(
    step=state.step + 1,
    params=params,
    opt_state=opt_state,
    ema_params=ema_params,
    num_skipped=state.num_skipped + jnp.where(finite, 0, 1),
  )
  metrics = {
    'loss': loss,
    'grad_norm': grad_norm,
    'learning_rate': schedule(state.step),
    'finite': finite,
  }
  return new_state, metrics


def jit_train_step(*, task, tx, schedule, config, state_shardings, batch_sharding):
  step_fn = task.step or train_step
  step = functools.partial(step_fn, task=task, tx=tx, schedule=schedule, config=config)
  metric_sharding = sharding.replicated(batch_sharding.mesh)
  return jax.jit(
    step,
    in_shardings=(state_shardings, batch_sharding),
    out_shardings=(state_shardings, metric_sharding),
    donate_argnums=0,
    compiler_options=hardware.compiler_options(batch_sharding.mesh.devices.flat),
  )


def jit_eval_step(*, task, params_shardings, batch_sharding):
  return jax.jit(
    lambda params, batch: task.eval_fn(params, task.prepare(batch)),
    in_shardings=(params_shardings, batch_sharding),
    out_shardings=sharding.replicated(batch_sharding.mesh),
    compiler_options=hardware.compiler_options(batch_sharding.mesh.devices.flat),
  )


def make_update_fn(*, apply_fn, accum_steps, tx):
  """The official `train.make_update_fn`, as one jit over global batches instead of pmap.

  `update_fn(params, opt_state, batch, rng) -> (params, opt_state, loss, rng)`
  with `batch = {'image': [B, H, W, 3], 'label': int [B] or one-hot [B, K]}`
  (whole batches, e.g. from `pipeline.make_train_iterator`, not per-device
  ones), softmax cross-entropy, dropout keys from `rng`, and `accum_steps`
  micro-batches (0 or None: none, as the official code). `params` is donated.
  """

  def loss_fn(params, batch, rng):
    logits = apply_fn({'params': params}, batch['image'], train=True, rngs={'dropout': rng})
    return cross_entropy(logits, batch['label'], loss='softmax')

  def update_fn(params, opt_state, batch, rng):
    rng, step_rng = jax.random.split(rng)
    loss, grads = accumulated_value_and_grad(
      jax.value_and_grad(loss_fn), params, batch, step_rng, accum_steps or 1
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, rng

  return jax.jit(
    update_fn, donate_argnums=0, compiler_options=hardware.compiler_options(jax.devices())
  )
