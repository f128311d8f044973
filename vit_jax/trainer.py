"""The training loop: set up, train, evaluate, checkpoint, resume.

Every process runs this same function. Process 0 alone writes logs,
TensorBoard events, `summary.json` and `params.npz`; checkpoints are written
collectively by orbax. Running it again on the same workdir resumes from the
latest checkpoint (parameters, optimizer state, step, RNG and the data
iterator's position) and, on CPU, ends with bitwise the parameters of an
uninterrupted run.
"""

import functools
import os
import signal
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from vit_jax import checkpoint
from vit_jax import fewshot
from vit_jax import hardware
from vit_jax import input_pipeline
from vit_jax import models_vit
from vit_jax import optim
from vit_jax import run_log
from vit_jax import sharding
from vit_jax import train


class TrainingError(RuntimeError):
  """A run that cannot go on; the message is one line saying what to do."""


class ConfigError(ValueError):
  """A config whose values do not fit together; one line."""


def validate(config, num_devices: int) -> None:
  per_step = config.accum_steps * num_devices
  if config.batch % per_step:
    raise ConfigError(
        f'batch={config.batch} must be a multiple of accum_steps ({config.accum_steps}) x '
        f'devices ({num_devices}) = {per_step}')
  if config.batch_eval % num_devices:
    raise ConfigError(f'batch_eval={config.batch_eval} must be a multiple of the number of '
                      f'devices ({num_devices})')
  if config.total_steps < 1:
    raise ConfigError(f'total_steps={config.total_steps} must be positive')
  if not 0 <= config.warmup_steps < config.total_steps:
    raise ConfigError(f'warmup_steps={config.warmup_steps} must be in [0, total_steps='
                      f'{config.total_steps})')
  choices = {'task': train.TASKS, 'loss': train.LOSSES, 'optimizer': optim.OPTIMIZERS,
             'decay_type': optim.DECAY_TYPES, 'attention': models_vit.ATTENTION}
  for field, allowed in choices.items():
    if config[field] not in allowed:
      raise ConfigError(f'{field}={config[field]!r}: use one of {", ".join(allowed)}')
  if config.attention == 'cudnn' and (config.dtype not in ('bfloat16', 'float16')
                                      or jax.default_backend() != 'gpu'):
    raise ConfigError("attention='cudnn' needs a CUDA GPU and --config.dtype=bfloat16; "
                      "use attention='auto', which takes cuDNN where it applies")


class _Preemption:
  """Preemption: checkpoint at a step boundary, then exit.

  One process: SIGTERM sets a flag that the loop reads after every step.
  Several: JAX's coordination service catches the signal, and every process
  asks `reached_preemption_sync_point` at the same (boundary) steps, so all
  agree on the step to stop at.
  """

  def __init__(self):
    self.requested = False
    self._single = jax.process_count() == 1
    self._previous = signal.signal(signal.SIGTERM, self._handle) if self._single else None

  def _handle(self, signum, frame):
    del signum, frame
    self.requested = True

  @property
  def pending(self) -> bool:
    """A stop is due now (single process only; hosts agree at boundaries)."""
    return self._single and self.requested

  def reached(self, step: int) -> bool:
    if self._single:
      return self.requested
    try:
      return multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError:  # no preemption service on this platform
      return False

  def restore(self):
    if self._single:
      signal.signal(signal.SIGTERM, self._previous)


def _host_tree(tree):
  """A (possibly sharded, multi-process) pytree as host numpy arrays."""
  if jax.process_count() > 1:
    return multihost_utils.process_allgather(tree, tiled=True)
  return jax.device_get(tree)


def _evaluate(eval_fn, params, config, batch_sharding) -> dict:
  """Exact top-1 (and top-5) accuracy over the whole test split."""
  return train.accuracy(eval_fn, params,
                        input_pipeline.make_eval_iterator(config, batch_sharding))


def _compile(fn, *args):
  """AOT-compiles `fn` for `args`; returns it and its FLOPs per device and call."""
  compiled = fn.lower(*args).compile()
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  return compiled, float((analysis or {}).get('flops', 0.0))


def _abstract_with_shardings(abstract, shardings):
  return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def _out_of_memory(error: Exception) -> bool:
  text = str(error)
  return 'RESOURCE_EXHAUSTED' in text or 'Out of memory' in text or 'out of memory' in text


def train_and_evaluate(config, workdir: str) -> dict:
  """Trains and evaluates `config` in `workdir`; returns the summary dict."""
  mesh = sharding.make_mesh(config.mesh.fsdp)
  with jax.set_mesh(mesh):
    return _train_and_evaluate(config, workdir, mesh)


def _train_and_evaluate(config, workdir: str, mesh) -> dict:
  wall_start = time.time()
  is_main = jax.process_index() == 0
  validate(config, mesh.size)
  info = input_pipeline.get_info(config)
  if info.multi_label and config.loss != 'sigmoid' and config.task == 'classification':
    raise ConfigError(f'{info.name} is multi-label: set --config.loss=sigmoid')
  log = run_log.RunLog(workdir, is_main=is_main, tensorboard=config.tensorboard)
  batch_sharding = sharding.batch_sharding(mesh)

  task = train.make_task(config, info.num_classes, info.multi_label)
  tx, schedule = optim.make_optimizer(config)
  init = functools.partial(train.init_state, model=task.model, tx=tx, image_size=config.pp.crop,
                           ema=bool(config.ema_decay))
  rng = jax.random.PRNGKey(config.seed)
  abstract = jax.eval_shape(init, rng)
  state_shardings = sharding.tree_shardings(abstract, mesh)

  manager = ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir) if '://' not in workdir else workdir, 'checkpoints'),
      options=ocp.CheckpointManagerOptions(
          max_to_keep=config.keep_checkpoints, create=True, cleanup_tmp_directories=True))
  latest = manager.latest_step()
  if latest is not None:
    restored = manager.restore(latest, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(_abstract_with_shardings(abstract, state_shardings)),
        data=ocp.args.JsonRestore()))
    state, data_state = restored['state'], restored['data']
    log.info('Resuming from the checkpoint at step %d in %s', latest, workdir)
  else:
    state = jax.jit(init, out_shardings=state_shardings)(rng)
    data_state = None
    if config.pretrained_path:
      params = checkpoint.load_pretrained(
          pretrained_path=config.pretrained_path, init_params=_host_tree(state.params),
          model_config=train.model_config(config), verbose=is_main)
      params = jax.device_put(params, state_shardings.params)
      state = state.replace(params=params,
                            ema_params=params if config.ema_decay else None)
  first_step = int(state.step)

  train_iter = input_pipeline.make_train_iterator(config, batch_sharding, state=data_state)
  eval_fn = train.jit_eval_step(task=task, params_shardings=state_shardings.params,
                                batch_sharding=batch_sharding)

  # Few-shot probes read the backbone as a plain ViT (also for MPP runs).
  fewshot_model = train.make_model(config, num_classes=None)
  fewshot_fn = fewshot.representation_fn(fewshot_model)

  def run_fewshot(step):
    scalars = fewshot.evaluate_datasets(config, fewshot_model, state.params, batch_sharding,
                                        features_fn=fewshot_fn)
    log.scalars(step, scalars)
    log.info('step %d: %s', step, ', '.join(
        f'{k} {v:.4f}' for k, v in scalars.items() if '-seed' not in k))
    return scalars

  def save(step):
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(train_iter.get_state())))

  peak = config.peak_flops or hardware.peak_flops()
  if peak is None and jax.default_backend() == 'cpu':
    peak = hardware.measure_matmul_flops() / max(1, jax.local_device_count())
  progress = run_log.Progress(config.total_steps, first_step, config.batch)
  preemption = _Preemption()
  train_loss, losses = float('nan'), []
  # The whole loop's rate (summary `img_per_sec`): wall time from the end of the
  # first step (after compilation) to the last, input pipeline, logging and
  # checkpoint saves included, evaluations and few-shot probes excluded.
  loop_start, eval_time, timed_steps = None, 0.0, 0
  step_fn, flops = None, 0.0
  try:
    pending = None  # (step, metrics) of the previous step, read while this one runs
    for step in range(first_step + 1, config.total_steps + 1):
      batch = next(train_iter)
      if step_fn is None:
        step_fn, flops = _compile(
            train.jit_train_step(task=task, tx=tx, schedule=schedule, config=config,
                                 state_shardings=state_shardings,
                                 batch_sharding=batch_sharding), state, batch)
        progress.restart_clock(step - 1)
      state, metrics = step_fn(state, batch)
      if loop_start is None:
        jax.block_until_ready(metrics)
        loop_start = time.perf_counter()
      else:
        timed_steps += 1

      if pending is not None:
        losses.append(_check_finite(config, *pending))
      pending = (step, metrics)

      fewshot_now = bool(config.fewshot.datasets and config.fewshot.every
                         and step % config.fewshot.every == 0 and step != config.total_steps)
      boundary = (step % config.progress_every == 0 or step == config.total_steps
                  or step % config.checkpoint_every == 0 or step % config.eval_every == 0
                  or fewshot_now)
      if not boundary and not preemption.pending:
        continue

      losses.append(_check_finite(config, *pending))
      pending = None
      if step % config.progress_every == 0 or step == config.total_steps:
        train_loss = float(np.mean([x for x in losses if np.isfinite(x)] or [np.nan]))
        losses = []
        rates = progress.update(step)
        scalars = {'train_loss': train_loss, 'learning_rate': float(metrics['learning_rate']),
                   'grad_norm': float(metrics['grad_norm']), **rates,
                   'skipped_steps': float(state.num_skipped)}
        if peak and flops and progress.step_time:
          scalars['mfu'] = flops / (progress.step_time * peak)
        log.scalars(step, scalars)
        log.info('%s', progress.line(step, train_loss, scalars['learning_rate']))
      eval_start = time.perf_counter()
      if step % config.eval_every == 0 and step != config.total_steps:
        result = _evaluate(eval_fn, state.params, config, batch_sharding)
        log.scalars(step, {'test_accuracy': result['accuracy']})
        log.info('step %d: test accuracy %.4f (%d examples)', step, result['accuracy'],
                 result['examples'])
      if fewshot_now:
        run_fewshot(step)
      eval_time += time.perf_counter() - eval_start
      if step % config.checkpoint_every == 0 or step == config.total_steps:
        save(step)
      if preemption.reached(step):
        save(step)
        manager.wait_until_finished()
        raise TrainingError(f'preempted (SIGTERM) at step {step}; checkpoint written to '
                            f'{workdir}; run the same command again to resume')
      progress.restart_clock(step)
    loop_time = time.perf_counter() - loop_start - eval_time if timed_steps else 0.0
  except jax.errors.JaxRuntimeError as e:
    if _out_of_memory(e):
      raise TrainingError(
          f'out of device memory at batch {config.batch // config.accum_steps} per step: raise '
          f'--config.accum_steps (now {config.accum_steps}; same math, smaller micro-batches), '
          'set --config.remat=True, or lower --config.batch') from None
    raise
  finally:
    preemption.restore()
    manager.wait_until_finished()

  final = _evaluate(eval_fn, state.params, config, batch_sharding)
  summary = {
      'step': int(state.step),
      'train_loss': train_loss if np.isfinite(train_loss) else None,  # None: no step ran
      'test_accuracy': final['accuracy'],
      'test_examples': final['examples'],
      **({'test_accuracy_top5': final['accuracy_top5']} if 'accuracy_top5' in final else {}),
      'wall_time_s': time.time() - wall_start,
      'img_per_sec': config.batch * timed_steps / loop_time if loop_time else 0.0,
      'skipped_steps': int(state.num_skipped),
      'resumed_from_step': first_step,
      'model': config.model,
      'dataset': info.name,
  }
  if config.ema_decay:
    summary['test_accuracy_ema'] = _evaluate(eval_fn, state.ema_params, config,
                                             batch_sharding)['accuracy']
  if config.fewshot.datasets:
    summary.update(run_fewshot(summary['step']))
  log.scalars(summary['step'], {'test_accuracy': summary['test_accuracy']})
  params = _host_tree(state.params)
  if is_main:
    checkpoint.save_npz(params, os.path.join(workdir, 'params.npz'))
    if config.ema_decay:
      checkpoint.save_npz(_host_tree(state.ema_params), os.path.join(workdir, 'params_ema.npz'))
  log.write_json('summary.json', summary)
  log.info('Done: step %d, test accuracy %.4f, %.0f img/s, %.0f s; wrote %s',
           summary['step'], summary['test_accuracy'], summary['img_per_sec'],
           summary['wall_time_s'], os.path.join(workdir, 'summary.json'))
  log.close()
  manager.close()
  return summary


def _check_finite(config, step, metrics) -> float:
  """The step's loss as a float; stops the run on NaN/Inf unless skipping is on."""
  loss = float(metrics['loss'])
  if not bool(metrics['finite']) and not config.skip_nonfinite:
    raise TrainingError(
        f'loss or gradient is NaN/Inf at step {step}; stopped without applying it, the last '
        'checkpoint is kept. Lower --config.base_lr, check the data, or set '
        '--config.skip_nonfinite=True to skip such steps')
  return loss
