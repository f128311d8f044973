"""The periodic work of a training run, declared as a list of hooks.

Each `Hook` names its work, how often it runs and whether it is an
evaluation (left out of the loop's img/s). `training.loop` runs the hooks
that are due after a step, in the order `hooks` lists them.
"""

import dataclasses
from typing import Callable

import orbax.checkpoint as ocp

from vit_jax.data import pipeline
from vit_jax.evaluation import fewshot
from vit_jax.evaluation import knn
from vit_jax.evaluation import metrics
from vit_jax.models import vit_checkpoint


@dataclasses.dataclass(frozen=True)
class Hook:
  """Periodic work: `fn(run, loop, step)` every `every` steps (0: never).

  `at_end` also runs it after the last step; `evaluation` time is left out of
  the loop's img/s.
  """

  name: str
  every: int
  fn: Callable
  at_end: bool = False
  evaluation: bool = False

  def due(self, step: int, total_steps: int) -> bool:
    if step == total_steps:
      return self.at_end
    return bool(self.every) and step % self.every == 0


def hooks(run) -> list:
  """The periodic work of a run, in the order it runs at a step where several are due."""
  config = run.config
  return [
    Hook('progress', config.progress_every, log_progress, at_end=True),
    Hook('evaluate', config.eval_every, evaluate, evaluation=True),
    Hook(
      'fewshot',
      config.fewshot.every if config.fewshot.datasets else 0,
      FeatureProbe(fewshot.evaluate_datasets),
      evaluation=True,
    ),
    Hook(
      'knn',
      config.knn.every if config.knn.datasets else 0,
      FeatureProbe(knn.evaluate_datasets),
      evaluation=True,
    ),
    Hook('checkpoint', config.checkpoint_every, save_checkpoint, at_end=True),
  ]


def named(periodic: list, name: str) -> Hook:
  """The hook of `periodic` called `name`."""
  return next(hook for hook in periodic if hook.name == name)


# What a step reports beside its loss and is said in the progress line (self-distillation's
# collapse monitors), with its format there.
MONITORS = {'teacher_entropy': '.3f', 'prototype_usage': '.3f', 'feature_std': '.3f'}


def log_progress(run, loop, step: int) -> None:
  """The progress line and the training scalars: mean loss since the last line, lr, img/s, MFU;
  and the latest step's other metrics (a task's loss parts and monitors)."""
  train_loss = loop.losses.close_window()
  rates = loop.progress.update(step)
  standard = ('loss', 'grad_norm', 'learning_rate', 'finite')
  extra = {k: float(v) for k, v in loop.metrics.items() if k not in standard}
  scalars = {
    'train_loss': train_loss,
    'learning_rate': float(loop.metrics['learning_rate']),
    'grad_norm': float(loop.metrics['grad_norm']),
    **rates,
    'skipped_steps': float(loop.state.num_skipped),
    **extra,
  }
  flops = loop.clock.flops
  if run.peak_flops and flops and loop.progress.step_time:
    scalars['mfu'] = flops / (loop.progress.step_time * run.peak_flops)
  run.log.scalars(step, scalars)
  line = loop.progress.line(step, train_loss, scalars['learning_rate'])
  said = [f'{k} {extra[k]:{f}}' for k, f in MONITORS.items() if k in extra]
  run.log.info('%s', line + ('  ' + '  '.join(said) if said else ''))


def evaluated(run, state):
  """The parameters a run evaluates and writes: its trained ones, or its task's (the teacher
  of self-distillation: `steps.Task.evaluated`)."""
  return getattr(state, run.program.task.evaluated)


def accuracy(run, params) -> dict:
  """Exact top-1 (and top-5) accuracy over the whole test split, or the task's own evaluation
  ({} when it has none)."""
  if run.program.task.evaluate is not None:
    return run.program.task.evaluate(run, params)
  return metrics.accuracy(
    run.program.eval_step,
    params,
    pipeline.make_eval_iterator(run.config, run.program.batch_sharding, raw=True, pp=run.pp),
  )


def evaluate(run, loop, step: int) -> None:
  result = accuracy(run, evaluated(run, loop.state))
  if not result:
    return
  run.log.scalars(step, {'test_accuracy': result['accuracy']})
  run.log.info(
    'step %d: %s %.4f (%d examples)',
    step,
    result.get('what', 'test accuracy'),
    result['accuracy'],
    result['examples'],
  )


class FeatureProbe:
  """A hook that probes the frozen backbone's features: few-shot linear probes (paper 4.1,
  `fewshot.evaluate_datasets`) or k-NN (DINO's evaluation, `knn.evaluate_datasets`). The
  backbone as a plain ViT (also for MPP and self-distillation runs) and its jitted pre-logits
  features are built on first use and kept for the run."""

  def __init__(self, evaluate_datasets):
    self._evaluate_datasets = evaluate_datasets
    self._model = self._features = None

  def __call__(self, run, loop, step: int) -> dict:
    """The probe's accuracies of the evaluated parameters, logged; returns them."""
    if self._model is None:
      self._model = run.program.task.features
      self._features = fewshot.representation_fn(self._model)
    scalars = self._evaluate_datasets(
      run.config,
      self._model,
      evaluated(run, loop.state),
      run.program.batch_sharding,
      features_fn=self._features,
      transform=run.transform,
    )
    run.log.scalars(step, scalars)
    run.log.info(
      'step %d: %s', step, ', '.join(f'{k} {v:.4f}' for k, v in scalars.items() if '-seed' not in k)
    )
    return scalars


def save_checkpoint(run, loop, step: int) -> None:
  """State, the data iterator's position and the run's totals; orbax writes in the background."""
  run.manager.save(
    step,
    args=ocp.args.Composite(
      # Encoder blocks as `encoderblock_{i}` whether or not the model scans them.
      state=ocp.args.StandardSave(vit_checkpoint.unstack_blocks(loop.state)),
      data=ocp.args.JsonSave(loop.train_iter.get_state()),
      run=ocp.args.JsonSave(loop.totals()),
    ),
  )
