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
      FewShotProbe(),
      evaluation=True,
    ),
    Hook('checkpoint', config.checkpoint_every, save_checkpoint, at_end=True),
  ]


def named(periodic: list, name: str) -> Hook:
  """The hook of `periodic` called `name`."""
  return next(hook for hook in periodic if hook.name == name)


def log_progress(run, loop, step: int) -> None:
  """The progress line and the training scalars: mean loss since the last line, lr, img/s, MFU."""
  train_loss = loop.losses.close_window()
  rates = loop.progress.update(step)
  scalars = {
    'train_loss': train_loss,
    'learning_rate': float(loop.metrics['learning_rate']),
    'grad_norm': float(loop.metrics['grad_norm']),
    **rates,
    'skipped_steps': float(loop.state.num_skipped),
  }
  flops = loop.clock.flops
  if run.peak_flops and flops and loop.progress.step_time:
    scalars['mfu'] = flops / (loop.progress.step_time * run.peak_flops)
  run.log.scalars(step, scalars)
  run.log.info('%s', loop.progress.line(step, train_loss, scalars['learning_rate']))


def accuracy(run, params) -> dict:
  """Exact top-1 (and top-5) accuracy over the whole test split."""
  return metrics.accuracy(
    run.program.eval_step,
    params,
    pipeline.make_eval_iterator(run.config, run.program.batch_sharding, raw=True, pp=run.pp),
  )


def evaluate(run, loop, step: int) -> None:
  result = accuracy(run, loop.state.params)
  run.log.scalars(step, {'test_accuracy': result['accuracy']})
  run.log.info(
    'step %d: test accuracy %.4f (%d examples)', step, result['accuracy'], result['examples']
  )


class FewShotProbe:
  """The few-shot hook (paper 4.1): its state, the backbone as a plain ViT (also for MPP runs)
  and its jitted pre-logits features, built on first use and kept for the run."""

  def __init__(self):
    self._model = self._features = None

  def __call__(self, run, loop, step: int) -> dict:
    """Few-shot accuracies of the current parameters, logged; returns them."""
    if self._model is None:
      self._model = run.program.task.features
      self._features = fewshot.representation_fn(self._model)
    scalars = fewshot.evaluate_datasets(
      run.config,
      self._model,
      loop.state.params,
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
