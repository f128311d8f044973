"""The training loop: set up, train, evaluate, checkpoint, resume.

Every process runs this same function. Process 0 alone locks the workdir and
writes logs, TensorBoard events, `config.json`, `summary.json` and
`params.npz`; checkpoints are written collectively by orbax. Running it again
on the same workdir resumes from the newest checkpoint that restores
(parameters, optimizer state, step, RNG, the data iterator's position and the
run's totals) and, on CPU, ends with bitwise the parameters of an
uninterrupted run; on a finished run it reports the result and writes nothing
(`training.resume`).
"""

import dataclasses
import os
import signal
import time
from typing import Any, Callable, Optional

import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from vit_jax import checkpoint
from vit_jax import files
from vit_jax import hardware
from vit_jax import run_log
from vit_jax import sharding
from vit_jax import workdir as workdir_lib
from vit_jax.configs import ConfigError
from vit_jax.configs import official
from vit_jax.data import pipeline
from vit_jax.evaluation import fewshot
from vit_jax.models import vit
from vit_jax.training import guard
from vit_jax.training import hooks
from vit_jax.training import optim
from vit_jax.training import program
from vit_jax.training import resume
from vit_jax.training import steps


class TrainingError(RuntimeError):
  """A run that cannot go on; the message is one line saying what to do."""


def validate(config, num_devices: int) -> None:
  """Raises ConfigError (one line) for values that cannot run together."""
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
  if config.total_steps < 1:
    raise ConfigError(f'total_steps={config.total_steps} must be positive')
  if not 0 <= config.warmup_steps < config.total_steps:
    raise ConfigError(
      f'warmup_steps={config.warmup_steps} must be in [0, total_steps={config.total_steps}): '
      f'add --config.warmup_steps={config.total_steps // 10}'
    )
  choices = {
    'task': steps.TASKS,
    'loss': steps.LOSSES,
    'optimizer': optim.OPTIMIZERS,
    'decay_type': optim.DECAY_TYPES,
    'attention': vit.ATTENTION,
  }
  for field, allowed in choices.items():
    if config[field] not in allowed:
      raise ConfigError(f'{field}={config[field]!r}: use one of {", ".join(allowed)}')
  if config.attention == 'cudnn' and (
    config.dtype not in ('bfloat16', 'float16') or jax.default_backend() != 'gpu'
  ):
    raise ConfigError(
      "attention='cudnn' needs a CUDA GPU and --config.dtype=bfloat16; "
      "use attention='auto', which takes cuDNN where it applies"
    )
  if config.remat_policy not in vit.REMAT_POLICIES:
    raise ConfigError(
      f'remat_policy={config.remat_policy!r}: use one of {", ".join(vit.REMAT_POLICIES)}'
    )
  if config.mesh.model > 1:
    arch = steps.model_config(config)
    try:
      sharding.check_model_fits(
        arch.transformer.num_heads, arch.transformer.mlp_dim, config.mesh.model
      )
    except sharding.MeshError as e:
      raise ConfigError(f'{config.model}: {e}') from None


def make_mesh(config, devices=None):
  """The run's (slice, data, fsdp, model) mesh; a misfit is a one-line ConfigError."""
  try:
    return sharding.make_mesh(
      config.mesh.fsdp, devices, model=config.mesh.model, data=config.mesh.data
    )
  except sharding.MeshError as e:
    raise ConfigError(str(e)) from None


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


def _compile(fn, *args):
  """AOT-compiles `fn` for `args`; returns it and its FLOPs per device and call."""
  compiled = fn.lower(*args).compile()
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  return compiled, float((analysis or {}).get('flops', 0.0))


@dataclasses.dataclass(frozen=True)
class Run:
  """What every part of a run reads; built once by `set_up`."""

  config: Any
  workdir: str
  mesh: Any
  info: pipeline.DatasetInfo
  log: run_log.RunLog
  program: program.Program  # the jitted train and eval steps
  init: Callable  # rng -> TrainState
  state_shardings: Any
  batch_sharding: Any
  manager: ocp.CheckpointManager
  eval_fn: Callable  # (params, batch) -> counts, jitted over the mesh
  fewshot_model: Any  # the backbone as a plain ViT (also for MPP runs)
  fewshot_features: Callable  # its jitted pre-logits features
  peak_flops: Optional[float]
  lock: Optional[workdir_lib.Lock] = None  # process 0's hold on the workdir


@dataclasses.dataclass
class Loop:
  """What changes as the loop runs.

  `prior` holds the totals of the sessions before this one (from the
  checkpoint resumed), so that `totals()` and the summary cover the whole run:
  wall time, and the steps timed for img/s with their time, up to the last
  checkpoint of each earlier session.
  """

  state: steps.TrainState
  train_iter: pipeline.TrainIterator
  progress: run_log.Progress
  metrics: Optional[dict] = None  # the latest step's, still on the devices
  losses: list = dataclasses.field(default_factory=list)  # since the last progress line
  train_loss: float = float('nan')
  flops: float = 0.0  # per device and step, from the compiled step
  prior: dict = dataclasses.field(default_factory=dict)
  wall_start: float = dataclasses.field(default_factory=time.time)
  loop_start: Optional[float] = None  # perf_counter at the end of this session's first step
  eval_time: float = 0.0  # in evaluation hooks since loop_start
  timed_steps: int = 0  # steps of this session after the first

  def totals(self) -> dict:
    """The run's totals so far, over every session (saved with each checkpoint)."""
    train_time = time.perf_counter() - self.loop_start - self.eval_time if self.loop_start else 0.0
    loss = self.train_loss if np.isfinite(self.train_loss) else self.prior.get('train_loss')
    return {
      'wall_time_s': self.prior.get('wall_time_s', 0.0) + time.time() - self.wall_start,
      'train_time_s': self.prior.get('train_time_s', 0.0) + train_time,
      'timed_steps': self.prior.get('timed_steps', 0) + self.timed_steps,
      'train_loss': loss,
    }


def train_and_evaluate(config, workdir: str) -> dict:
  """Trains and evaluates `config` in `workdir`; returns the summary dict."""
  wall_start = time.time()
  config = official.translate(config)  # configs written for the official vit_jax
  mesh = make_mesh(config)
  validate(config, mesh.size)
  # Our own one-line errors pass as they are; a failed write becomes one.
  keep = (TrainingError, ConfigError, checkpoint.CheckpointError, pipeline.DataError)
  with guard.storage_errors(workdir, keep=keep):
    resume.check_config(workdir, config)
    summary = resume.finished(workdir, config)
    if summary is not None:
      _report_finished(workdir, summary)
      return summary
    lock = guard.lock(workdir)
    try:
      with jax.set_mesh(mesh):
        if jax.process_index() == 0:
          resume.record_config(workdir, config)
        # Orbax logs each unreadable checkpoint file it meets; resume says it in one line.
        with resume.without_orbax_errors():
          run = set_up(config, workdir, mesh, lock=lock)
          state, data_state, prior = restore_or_initialize(run)
        first_step = int(state.step)
        loop = Loop(
          state=state,
          train_iter=pipeline.make_train_iterator(config, run.batch_sharding, state=data_state),
          progress=run_log.Progress(config.total_steps, first_step, config.batch),
          prior=prior,
          wall_start=wall_start,
        )
        train(run, loop, hooks.hooks(run))
        return finish(run, loop, first_step=first_step)
    finally:
      if lock is not None:
        lock.release()


def _report_finished(workdir: str, summary: dict) -> None:
  if jax.process_index() == 0:
    print(
      f'{workdir} has finished: step {summary["step"]}, test accuracy '
      f'{summary.get("test_accuracy", float("nan")):.4f}, {summary.get("img_per_sec", 0.0):.0f} '
      f'img/s, {summary.get("wall_time_s", 0.0):.0f} s '
      f'({os.path.join(workdir, resume.SUMMARY_FILE)}). Nothing to do: raise '
      '--config.total_steps to train on, or use another --workdir',
      flush=True,
    )


def set_up(config, workdir: str, mesh, lock: Optional[workdir_lib.Lock] = None) -> Run:
  """Checks the config against the data and devices; builds the task, optimizer and manager."""
  validate(config, mesh.size)
  info = pipeline.get_info(config)
  if info.multi_label and config.loss != 'sigmoid' and config.task == 'classification':
    raise ConfigError(f'{info.name} is multi-label: set --config.loss=sigmoid')
  log = run_log.RunLog(workdir, is_main=jax.process_index() == 0, tensorboard=config.tensorboard)
  log.info(pipeline.describe_preprocessing(config))
  compiled = program.build(config, mesh, info.num_classes, info.multi_label)
  manager = ocp.CheckpointManager(
    os.path.join(files.absolute(workdir), 'checkpoints'),
    options=ocp.CheckpointManagerOptions(
      max_to_keep=config.keep_checkpoints, create=True, cleanup_tmp_directories=True
    ),
  )
  fewshot_model = steps.make_model(config, num_classes=None)
  # A peak that does not drop on a busy machine: MFU stays at most 1 (vit_jax.hardware).
  peak = config.peak_flops or hardware.stable_peak()[0]
  return Run(
    config=config,
    workdir=workdir,
    mesh=mesh,
    info=info,
    log=log,
    program=compiled,
    init=compiled.init,
    state_shardings=compiled.state_shardings,
    batch_sharding=compiled.batch_sharding,
    manager=manager,
    eval_fn=compiled.eval_step,
    fewshot_model=fewshot_model,
    fewshot_features=fewshot.representation_fn(fewshot_model),
    peak_flops=peak,
    lock=lock,
  )


def restore_or_initialize(run: Run):
  """(state, data iterator state, totals): the newest checkpoint's that restores, or fresh ones."""
  config = run.config
  # Checkpoints name encoderblock_{i}; a scanned model stacks them after restoring.
  abstract = checkpoint.unstack_blocks(run.program.abstract_state())
  checkpoints = os.path.join(files.absolute(run.workdir), resume.CHECKPOINTS)

  def args_for(step):
    items = {'state': ocp.args.StandardRestore(abstract), 'data': ocp.args.JsonRestore()}
    # Checkpoints written before the run's totals were saved have no 'run' item.
    if files.exists(os.path.join(checkpoints, str(step), 'run')):
      items['run'] = ocp.args.JsonRestore()
    return ocp.args.Composite(**items)

  found = resume.restore_newest(run.manager, run.workdir, args_for, run.log)
  if found is not None:
    step, restored = found
    run.log.info('Resuming from the checkpoint at step %d in %s', step, run.workdir)
    prior = restored['run'] if 'run' in restored else {}
    state = restored['state']
    if checkpoint.is_stacked(run.program.abstract_state()):
      state = jax.device_put(checkpoint.stack_blocks(state), run.state_shardings)
    return state, restored['data'], prior or {}
  state = jax.jit(run.init, out_shardings=run.state_shardings)(jax.random.PRNGKey(config.seed))
  if config.pretrained_path:
    params = checkpoint.load_pretrained(
      pretrained_path=config.pretrained_path,
      init_params=_host_tree(state.params),
      model_config=steps.model_config(config),
      verbose=jax.process_index() == 0,
    )
    params = jax.device_put(params, run.state_shardings.params)
    state = state.replace(params=params, ema_params=params if config.ema_decay else None)
  return state, None, {}


def train(run: Run, loop: Loop, periodic: list) -> None:
  """Steps until `total_steps`, running `periodic` hooks as due.

  It times the loop for img/s (`loop.totals()`): wall time from the end of the
  first step (after compilation) to the last, input pipeline, logging and
  checkpoint saves included, evaluation hooks excluded. A step's loss is read
  while the next one runs, except at steps where hooks are due.
  """
  config = run.config
  preemption = _Preemption()
  step_fn = None
  try:
    pending = None  # (step, metrics) of the previous step
    for step in range(int(loop.state.step) + 1, config.total_steps + 1):
      batch = next(loop.train_iter)
      if step_fn is None:
        step_fn, loop.flops = _compile(run.program.train_step, loop.state, batch)
        loop.progress.restart_clock(step - 1)
      loop.state, loop.metrics = step_fn(loop.state, batch)
      if loop.loop_start is None:
        jax.block_until_ready(loop.metrics)
        loop.loop_start = time.perf_counter()
      else:
        loop.timed_steps += 1
      if pending is not None:
        loop.losses.append(_check_finite(config, *pending))
      pending = (step, loop.metrics)

      due = [hook for hook in periodic if hook.due(step, config.total_steps)]
      if not due and not preemption.pending:
        continue
      loop.losses.append(_check_finite(config, *pending))
      pending = None
      if run.lock is not None and run.lock.lost:
        raise TrainingError(
          f"another run took over {run.lock.path} (this run's heartbeat went stale); "
          'stopped without writing. Run one command per workdir'
        )
      for hook in due:
        start = time.perf_counter()
        hook.fn(run, loop, step)
        if hook.evaluation:
          loop.eval_time += time.perf_counter() - start
      if preemption.reached(step):
        hooks.save_checkpoint(run, loop, step)
        run.manager.wait_until_finished()
        raise TrainingError(
          f'preempted (SIGTERM) at step {step}; checkpoint written to '
          f'{run.workdir}; run the same command again to resume'
        )
      loop.progress.restart_clock(step)
  except jax.errors.JaxRuntimeError as e:
    if hardware.is_out_of_memory(e):
      raise TrainingError(
        f'out of device memory at batch {config.batch // config.accum_steps} per step: raise '
        f'--config.accum_steps (now {config.accum_steps}; same math, smaller micro-batches), '
        'set --config.remat=True, or lower --config.batch'
      ) from None
    raise
  finally:
    preemption.restore()
    run.manager.wait_until_finished()


def finish(run: Run, loop: Loop, *, first_step: int) -> dict:
  """Final evaluation, `summary.json` and `params.npz`; returns the summary.

  The summary covers the whole run, over every session: its wall time, img/s
  and the train loss of its last progress line.
  """
  config, workdir, state = run.config, run.workdir, loop.state
  totals = loop.totals()
  final = hooks.accuracy(run, state.params)
  summary = {
    'step': int(state.step),
    'train_loss': totals['train_loss'],
    'test_accuracy': final['accuracy'],
    'test_examples': final['examples'],
    **({'test_accuracy_top5': final['accuracy_top5']} if 'accuracy_top5' in final else {}),
    'img_per_sec': (
      config.batch * totals['timed_steps'] / totals['train_time_s']
      if totals['train_time_s']
      else 0.0
    ),
    'skipped_steps': int(state.num_skipped),
    'resumed_from_step': first_step,
    'model': config.model,
    'dataset': run.info.name,
  }
  if config.ema_decay:
    summary['test_accuracy_ema'] = hooks.accuracy(run, state.ema_params)['accuracy']
  if config.fewshot.datasets:
    summary.update(hooks.fewshot_probe(run, loop, summary['step']))
  run.log.scalars(summary['step'], {'test_accuracy': summary['test_accuracy']})
  params = _host_tree(state.params)
  if jax.process_index() == 0:
    checkpoint.save_npz(params, os.path.join(workdir, 'params.npz'))
    if config.ema_decay:
      checkpoint.save_npz(_host_tree(state.ema_params), os.path.join(workdir, 'params_ema.npz'))
  summary['wall_time_s'] = loop.totals()['wall_time_s']
  run.log.write_json(resume.SUMMARY_FILE, summary)
  run.log.info(
    'Done: step %d, test accuracy %.4f, %.0f img/s, %.0f s; wrote %s',
    summary['step'],
    summary['test_accuracy'],
    summary['img_per_sec'],
    summary['wall_time_s'],
    os.path.join(workdir, resume.SUMMARY_FILE),
  )
  run.log.close()
  run.manager.close()
  return summary


def _check_finite(config, step, metrics_) -> float:
  """The step's loss as a float; stops the run on NaN/Inf unless skipping is on."""
  loss = float(metrics_['loss'])
  if not bool(metrics_['finite']) and not config.skip_nonfinite:
    raise TrainingError(
      f'loss or gradient is NaN/Inf at step {step}; stopped without applying it, the last '
      'checkpoint is kept. Lower --config.base_lr, check the data, or set '
      '--config.skip_nonfinite=True to skip such steps'
    )
  return loss
