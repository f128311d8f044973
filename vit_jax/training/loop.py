"""The training loop: set up, train, evaluate, checkpoint, resume.

Every process runs this same function. Process 0 alone locks the workdir and
writes the run's config, logs, TensorBoard events, its summary and final
parameters (`vit_jax.workdir` names the files); checkpoints are written
collectively by orbax. Running it again on the same workdir resumes from the
newest checkpoint that restores (parameters, optimizer state, step, RNG, the
data iterator's position and the run's totals) and, on CPU, ends with bitwise
the parameters of an uninterrupted run; on a finished run it reports the
result and writes nothing (`training.resume`). A config written for the
official vit_jax is translated before it gets here (`vit_jax.core.cli`,
`vit_jax.train`).
"""

import contextlib
import dataclasses
import logging as py_logging
import time
from typing import Any, Optional
import warnings

import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from vit_jax import checkpoint
from vit_jax import workdir as workdir_lib
from vit_jax.configs import ConfigError
from vit_jax.configs import families
from vit_jax.configs import timm_weights
from vit_jax.core import console
from vit_jax.core import files
from vit_jax.core import hardware
from vit_jax.core.errors import UserError
from vit_jax.data import pipeline
from vit_jax.evaluation import loader
from vit_jax.models import fp8
from vit_jax.models import vit_checkpoint
from vit_jax.training import hooks
from vit_jax.training import program
from vit_jax.training import resume
from vit_jax.training import steps
from vit_jax.training import stopping
from vit_jax.workdir import run_log


class TrainingError(UserError, RuntimeError):
  """A run that cannot go on; the message is one line saying what to do."""


def train_and_evaluate(config, workdir: str) -> dict:
  """Trains and evaluates `config` in `workdir`; returns the summary dict."""
  clock = Clock()
  mesh = program.make_mesh(config)
  spec = program.validate(config, mesh.size)
  program.check_host_batch(config, jax.process_count(), hardware.host_memory())
  created = workdir_lib.first_missing(workdir)  # removed again if the run fails before a step
  failed = False
  # Our own one-line errors pass as they are; a failed write becomes one.
  with workdir_lib.storage_errors(workdir, keep=(UserError,)):
    workdir_lib.check_folder(workdir)
    resume.check_config(workdir, config)
    summary = resume.finished(workdir, config)
    if summary is not None:
      _report_finished(workdir, summary)
      return summary
    resume.check_dataset(workdir, config)
    if config.pretrained_path and not workdir_lib.saved_steps(workdir):
      _check_pretrained(config.pretrained_path)
    spec, transform = weights_of(config, spec, workdir)  # after: it reads the pretrained file
    stop, lock = stopping.Stop(workdir), None
    try:
      with stop.held():  # a stop raised halfway through taking the lock would leave it
        lock = stop.lock = workdir_lib.acquire(workdir)
      with jax.set_mesh(mesh):
        if jax.process_index() == 0:
          unknown = resume.unknown_fields(workdir, config)
          if unknown:
            print(
              f'{workdir_lib.CONFIG_FILE} of {workdir} records fields this version does not '
              f'read ({", ".join(sorted(unknown))}): resumed without them, kept in the file',
              flush=True,
            )
          workdir_lib.write_config(workdir, config, keep=unknown)
        # Orbax logs each unreadable checkpoint file it meets; resume says it in one line.
        with resume.without_orbax_errors():
          run = set_up(config, workdir, mesh, spec, lock=lock, transform=transform)
          stop.check()
          state, data_state, clock.prior = restore_or_initialize(run)
        stop.check()
        first_step = int(state.step)
        if first_step:  # resumed: the lines of steps it will take again go
          run.log.rewind(first_step)
        if data_state and resume.same_data(workdir, data_state.get('dataset'), config.dataset):
          data_state = {**data_state, 'dataset': config.dataset}  # the same data, spelled anew
        loop = Loop(
          state=state,
          train_iter=pipeline.make_train_iterator(
            config,
            run.program.batch_sharding,
            state=data_state,
            raw=True,
            model_spec=spec,
            pp=run.pp,
          ),
          progress=console.Progress(config.total_steps, first_step, config.batch),
          clock=clock,
          losses=Losses.resumed(clock.prior),
        )
        periodic = hooks.hooks(run)
        train(run, loop, periodic, stop)
        return finish(run, loop, periodic, first_step=first_step)
    except stopping.StopNow as e:
      _quiet_a_write_cut_short()
      failed = True
      raise stopping.Stopped(str(e), stop.signum) from None
    except UserError:
      failed = True
      raise
    finally:
      stop.restore()
      if lock is not None:
        # A run refused before its first step, in a workdir it made, leaves nothing behind.
        undo = failed and created is not None and not clock.stepped
        if undo:
          workdir_lib.remove_unstarted(workdir, created, lock_released=False)
        lock.release()
        if undo:
          workdir_lib.remove_unstarted(workdir, created, lock_released=True)


def _quiet_a_write_cut_short() -> None:
  """Drops what a checkpoint write that a stop at once cut short leaves: orbax's background
  threads log their failure, Python reports its coroutines at exit (the one line says it all;
  the half-written checkpoint is a temporary folder that the next run removes)."""
  warnings.filterwarnings('ignore', "coroutine '.*' was never awaited", RuntimeWarning)
  py_logging.getLogger('absl').addFilter(lambda record: 'orbax' not in record.pathname)


def _check_pretrained(path: str) -> None:
  """A pretrained checkpoint out of reach stops a new run before its set-up, in one line."""
  try:
    checkpoint.released_file(path)
    checkpoint.refuse_torch_file(path)
  except checkpoint.CheckpointError as e:  # no such file, or one to convert first
    raise ConfigError(f'--config.pretrained_path: {e}') from None
  except files.RemoteFilesError as e:
    raise ConfigError(
      f'--config.pretrained_path: {e} (--config.pretrained_path=LOCAL_COPY.npz)'
    ) from None


def weights_of(config, spec, workdir: str) -> tuple:
  """(`spec` with the input statistics of the weights it trains, their evaluation transform) for
  a family's model: the preprocessing the run recorded (a resumed run), else what its
  pretrained checkpoint records for its model, else timm's default weights' of the name
  (`loader.with_weights`); (spec, None) for the paper's models, which keep the official resize."""
  if families.family_of(spec.name or '') is None:
    return spec, None  # nothing to read: a pretrained gs:// file is not opened twice
  record = workdir_lib.read_preprocessing(workdir) if workdir_lib.is_workdir(workdir) else None
  if record is None and config.pretrained_path:
    metadata = checkpoint.read_metadata(config.pretrained_path)
    if metadata.get('model') in (None, config.model):
      record = metadata.get('preprocessing')
    if record is None and workdir_lib.is_workdir(config.pretrained_path):
      record = workdir_lib.read_preprocessing(config.pretrained_path)
  preprocessing = None if record is None else timm_weights.Preprocessing.from_json(record)
  return loader.with_weights(spec, preprocessing)


def _report_finished(workdir: str, summary: dict) -> None:
  if jax.process_index() == 0:
    print(
      f'{workdir} has finished: step {summary["step"]}, test accuracy '
      f'{summary.get("test_accuracy", float("nan")):.4f}, {summary.get("img_per_sec", 0.0):.0f} '
      f'img/s, {summary.get("wall_time_s", 0.0):.0f} s '
      f'({workdir_lib.summary_path(workdir)}). Nothing to do: raise '
      '--config.total_steps to train on, or use another --workdir',
      flush=True,
    )


@dataclasses.dataclass(frozen=True)
class Run:
  """What every part of a run reads; built once by `set_up`."""

  config: Any
  workdir: str
  mesh: Any
  info: pipeline.DatasetInfo
  log: run_log.RunLog
  program: program.Program  # the jitted steps, the state's init and layout, the batch layout
  manager: ocp.CheckpointManager
  peak_flops: Optional[float]
  lock: Optional[workdir_lib.Lock] = None  # process 0's hold on the workdir
  pp: Optional[pipeline.Preprocessing] = None  # the data's preprocessing, resolved once
  # A family's weights: their evaluation transform (`configs.timm_weights.Preprocessing`);
  # None: the official resize.
  transform: Any = None


class Losses:
  """The step losses since the last progress line, and the mean of the last window.

  The window and the count of skipped steps are saved with each checkpoint (`totals`), so a
  resumed run's first progress line averages the same steps as an uninterrupted run's."""

  def __init__(self, last_mean: float = float('nan'), window=(), nonfinite_in_a_row: int = 0):
    self._window = [float(x) for x in window]
    self.last_mean = last_mean
    self.nonfinite_in_a_row = nonfinite_in_a_row  # skipped steps since the last finite one

  @classmethod
  def resumed(cls, prior: dict) -> 'Losses':
    """The losses a checkpoint's totals (`Clock.totals`) carry on; fresh ones for a new run
    (or a checkpoint written before they were saved)."""
    last = prior.get('train_loss')
    return cls(
      float('nan') if last is None else float(last),
      prior.get('loss_window') or (),
      int(prior.get('nonfinite_in_a_row') or 0),
    )

  @property
  def window(self) -> list:
    """The open window's finite losses (the only ones its mean reads)."""
    return [x for x in self._window if np.isfinite(x)]

  def add(self, loss: float) -> None:
    self._window.append(loss)

  def close_window(self) -> float:
    """The mean finite loss since the last call (NaN if none); starts a new window."""
    self.last_mean = float(np.mean([x for x in self._window if np.isfinite(x)] or [np.nan]))
    self._window = []
    return self.last_mean


@dataclasses.dataclass
class Clock:
  """The run's time and speed over every session, saved with each checkpoint.

  `prior` holds the totals of the sessions before this one (from the
  checkpoint resumed). The loop is timed for img/s from the end of this
  session's first step (after compilation) to the last, input pipeline,
  logging and checkpoint saves included, evaluation excluded.
  """

  prior: dict = dataclasses.field(default_factory=dict)
  wall_start: float = dataclasses.field(default_factory=time.time)
  flops: float = 0.0  # per device and step, from the compiled step
  _loop_start: Optional[float] = None  # perf_counter at the end of the first step
  _eval_time: float = 0.0  # in evaluation since _loop_start
  _timed_steps: int = 0  # steps of this session after the first

  @property
  def stepped(self) -> bool:
    """Whether this session has taken a step."""
    return self._loop_start is not None

  def step_done(self, metrics) -> None:
    if self._loop_start is None:
      jax.block_until_ready(metrics)
      self._loop_start = time.perf_counter()
    else:
      self._timed_steps += 1

  @contextlib.contextmanager
  def evaluation(self):
    """Time spent inside is left out of the loop's img/s."""
    start = time.perf_counter()
    try:
      yield
    finally:
      self._eval_time += time.perf_counter() - start

  def totals(self, train_loss: float) -> dict:
    """Wall time, the timed steps with their time, and the latest train loss, whole run."""
    now = time.perf_counter()
    train_time = now - self._loop_start - self._eval_time if self._loop_start else 0.0
    return {
      'wall_time_s': self.prior.get('wall_time_s', 0.0) + time.time() - self.wall_start,
      'train_time_s': self.prior.get('train_time_s', 0.0) + train_time,
      'timed_steps': self.prior.get('timed_steps', 0) + self._timed_steps,
      'train_loss': train_loss if np.isfinite(train_loss) else self.prior.get('train_loss'),
    }


@dataclasses.dataclass
class Loop:
  """What changes as the loop runs."""

  state: steps.TrainState
  train_iter: pipeline.TrainIterator
  progress: console.Progress
  clock: Clock
  losses: Losses = dataclasses.field(default_factory=Losses)
  metrics: Optional[dict] = None  # the latest step's, still on the devices

  def totals(self) -> dict:
    """The run's totals so far, over every session, and the losses of the open progress window
    (saved with each checkpoint)."""
    return {
      **self.clock.totals(self.losses.last_mean),
      # JSON keeps each float exactly (repr): the resumed mean is the uninterrupted run's.
      'loss_window': self.losses.window,
      'nonfinite_in_a_row': self.losses.nonfinite_in_a_row,
    }


def set_up(
  config, workdir: str, mesh, spec, lock: Optional[workdir_lib.Lock] = None, transform=None
) -> Run:
  """Checks the config against the data; builds the task of the model `spec` (which
  `program.validate` resolved, checking the config against the devices), the optimizer and the
  checkpoint manager. `transform`: the evaluation transform of a family's weights
  (`weights_of`), recorded in the workdir."""
  pp = pipeline.Preprocessing.of(config, transform)  # the data half, as `spec` is the model
  info = pipeline.get_info(config, pp)
  resume.check_classes(workdir, info)
  if jax.process_index() == 0:
    resume.record_dataset(workdir, info)
    if transform is not None:
      workdir_lib.write_preprocessing(workdir, transform.to_json())
  if info.num_classes < 1 and config.task == 'classification':
    raise ConfigError(
      f'{info.name}: its images are not in class folders (DIR/train/<class>/<image>), which '
      'classification needs; self-distillation (--config.task=dino) reads them as they are'
    )
  if info.multi_label and config.loss != 'sigmoid' and config.task == 'classification':
    raise ConfigError(f'{info.name} is multi-label: set --config.loss=sigmoid')
  log = run_log.RunLog(workdir, is_main=jax.process_index() == 0, tensorboard=config.tensorboard)
  log.info(pp.describe())
  device = mesh.devices.flat[0]
  if config.fp8 and not fp8.native(device):
    log.info(
      f'note: fp8 on {device.platform}: emulated (FP8 rounding, {config.dtype} products): the '
      'numbers of FP8, not its speed, which needs FP8 tensor cores (Hopper or Ada GPUs)'
    )
  built = program.build(config, mesh, info.num_classes, info.multi_label, spec)
  # Last: its background thread removes unfinished checkpoints, and must not be cut short
  # by an error in the config.
  manager = ocp.CheckpointManager(
    workdir_lib.checkpoints_dir(workdir, absolute=True),
    options=ocp.CheckpointManagerOptions(
      max_to_keep=config.keep_checkpoints, create=True, cleanup_tmp_directories=True
    ),
  )
  return Run(
    config=config,
    workdir=workdir,
    mesh=mesh,
    info=info,
    log=log,
    program=built,
    manager=manager,
    # A peak that does not drop on a busy machine: MFU stays at most 1 (vit_jax.core.hardware).
    peak_flops=config.peak_flops or hardware.stable_peak()[0],
    lock=lock,
    pp=pp,
    transform=transform,
  )


def restore_or_initialize(run: Run):
  """(state, data iterator state, totals): the newest checkpoint's that restores, or fresh ones."""
  config, built = run.config, run.program
  # Checkpoints name encoderblock_{i}; a scanned model stacks them after restoring.
  abstract = vit_checkpoint.unstack_blocks(built.abstract_state())

  def args_for(step):
    items = {'state': ocp.args.StandardRestore(abstract), 'data': ocp.args.JsonRestore()}
    # Checkpoints written before the run's totals were saved have no 'run' item.
    if workdir_lib.checkpoint_has_item(run.workdir, step, 'run'):
      items['run'] = ocp.args.JsonRestore()
    return ocp.args.Composite(**items)

  found = resume.restore_newest(run.manager, run.workdir, args_for, run.log)
  if found is not None:
    step, restored = found
    run.log.info('Resuming from the checkpoint at step %d in %s', step, run.workdir)
    prior = restored['run'] if 'run' in restored else {}
    state = restored['state']
    if vit_checkpoint.is_stacked(built.abstract_state()):
      state = jax.device_put(vit_checkpoint.stack_blocks(state), built.state_shardings)
    return state, restored['data'], prior or {}
  state = jax.jit(built.init, out_shardings=built.state_shardings)(jax.random.PRNGKey(config.seed))
  if config.pretrained_path:
    params = checkpoint.load_pretrained(
      pretrained_path=config.pretrained_path,
      init_params=_host_tree(state.params),
      model_config=built.spec.architecture,
      verbose=jax.process_index() == 0,
      posemb_resize=config.posemb_resize,
      patch_resize=config.patch_resize,
    )
    ema = None
    if state.ema_params is not None:  # an EMA (a self-distillation teacher) starts there too,
      ema = jax.device_put(params, built.state_shardings.ema_params)  # in buffers of its own
    params = jax.device_put(params, built.state_shardings.params)
    state = state.replace(params=params, ema_params=ema)
  return state, None, {}


def train(run: Run, loop: Loop, periodic: list, stop: Optional[stopping.Stop] = None) -> None:
  """Steps until `total_steps`, running `periodic` hooks as due.

  A step's loss is read while the next one runs, except at steps where hooks
  are due; the loop's speed is timed by `loop.clock`. `stop` (SIGTERM, Ctrl-C)
  checkpoints and stops after the step it names (`Stop.due`, asked every step).
  """
  preemption = stop or stopping.Stop(run.workdir)
  try:
    with _out_of_memory_advice(run.config), _a_lost_process(preemption):
      step_fn, pending = None, None  # pending: (step, metrics) of the previous step
      for step in range(int(loop.state.step) + 1, run.config.total_steps + 1):
        batch = next(loop.train_iter)
        if step_fn is None:
          with console.heartbeat('compiling the train step', say=run.log.info):
            step_fn, loop.clock.flops = _compile(run.program.train_step, loop.state, batch)
          loop.progress.restart_clock(step - 1)
        loop.state, loop.metrics = step_fn(loop.state, batch)
        loop.clock.step_done(loop.metrics)
        preemption.check()
        preemption.stepping = True
        if pending is not None:
          loop.losses.add(_check_finite(run.config, loop.losses, *pending))
        pending = (step, loop.metrics)
        due = [hook for hook in periodic if hook.due(step, run.config.total_steps)]
        stop_here = preemption.due(step)
        if due or stop_here:
          loop.losses.add(_check_finite(run.config, loop.losses, *pending))
          pending = None
          _run_hooks(run, loop, step, due, preemption if stop_here else None)
  finally:
    preemption.stepping = False  # the last checkpoint is asked for: a signal now stops at once,
    if stop is None:
      preemption.restore()
    with preemption.held():  # once it is written (a second signal does not wait)
      run.manager.wait_until_finished()


def _run_hooks(run: Run, loop: Loop, step: int, due: list, stop) -> None:
  """The hooks due after `step`, then the stop when `stop` (a `Stopped` with its checkpoint)."""
  if run.lock is not None and run.lock.lost:
    raise TrainingError(
      f"another run took over {run.lock.path} (this run's heartbeat went stale); "
      'stopped without writing. Run one command per workdir'
    )
  for hook in due:
    with loop.clock.evaluation() if hook.evaluation else contextlib.nullcontext():
      with console.heartbeat(f'step {step}: {hook.name}', say=run.log.info):
        hook.fn(run, loop, step)
  if stop is not None:
    hooks.save_checkpoint(run, loop, step)  # a no-op where the checkpoint hook just wrote it
    run.manager.wait_until_finished()
    stop.stopped = True
    raise stopping.Stopped(stop.stopped_line(step), stop.stopping_signal())
  loop.progress.restart_clock(step)


@contextlib.contextmanager
def _a_lost_process(stop: stopping.Stop):
  """An error in a run of several processes may only be the sign that one of them is gone:
  then this process ends with the one line that names it (`Stop.roll_call`)."""
  try:
    yield
  except UserError:
    raise
  except Exception:
    stop.roll_call()
    raise


@contextlib.contextmanager
def _out_of_memory_advice(config):
  """Out of device memory: one line with the three ways out; out of host memory (numpy's
  MemoryError, assembling batches): one line too."""
  try:
    yield
  except MemoryError as e:
    raise TrainingError(
      f'out of host memory ({e}) at batch {config.batch:,} of {config.pp.crop} px images: '
      f'lower --config.batch, or --config.prefetch (now {config.prefetch}) and '
      '--config.eval_cache_mb, which hold batches in memory'
    ) from None
  except jax.errors.JaxRuntimeError as e:
    if hardware.is_out_of_memory(e):
      tokens = tuple(config.get('naflex_tokens') or ())
      if tokens:  # every image is padded to the largest budget: what sets the memory
        raise TrainingError(
          f'out of device memory at batch {config.batch // config.accum_steps} per step of up '
          f'to {max(tokens):,} tokens an image: lower the largest budget in '
          f'--config.naflex_tokens (now {tokens}), raise --config.accum_steps (now '
          f'{config.accum_steps}), or lower --config.batch'
        ) from None
      raise TrainingError(
        f'out of device memory at batch {config.batch // config.accum_steps} per step: raise '
        f'--config.accum_steps (now {config.accum_steps}; same math, smaller micro-batches), '
        'set --config.remat=True, or lower --config.batch'
      ) from None
    raise


def finish(run: Run, loop: Loop, periodic: list, *, first_step: int) -> dict:
  """Final evaluation, the summary and the final parameters; returns the summary.

  The summary covers the whole run, over every session: its wall time, img/s
  and the train loss of its last progress line.
  """
  config, workdir, state = run.config, run.workdir, loop.state
  totals = loop.totals()
  with console.heartbeat(f'step {int(state.step)}: final evaluation', say=run.log.info):
    final = hooks.accuracy(run, hooks.evaluated(run, state))
  what = final.pop('what', 'test accuracy')
  summary = {
    'step': int(state.step),
    'train_loss': totals['train_loss'],
    # A run with nothing to evaluate (self-distillation on unlabelled images) has no accuracy.
    'test_accuracy': final.get('accuracy', float('nan')),
    'test_examples': final.get('examples', 0),
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
    summary.update(hooks.named(periodic, 'fewshot').fn(run, loop, summary['step']))
  if config.knn.datasets:
    summary.update(hooks.named(periodic, 'knn').fn(run, loop, summary['step']))
  if final:
    run.log.scalars(summary['step'], {'test_accuracy': summary['test_accuracy']})
  _write_results(run, loop, summary)
  skipped = summary['skipped_steps']
  run.log.info(
    'Done: step %d, %s %.4f, %.0f img/s, %.0f s%s; wrote %s',
    summary['step'],
    what,
    summary['test_accuracy'],
    summary['img_per_sec'],
    summary['wall_time_s'],
    f', {skipped} of {summary["step"]} steps skipped (NaN/Inf)' if skipped else '',
    workdir_lib.summary_path(workdir),
  )
  run.log.close()
  run.manager.close()
  return summary


def _write_results(run: Run, loop: Loop, summary: dict) -> None:
  """The final parameters (and EMA's), then the summary with the whole run's wall time."""
  # Gathered on every process (a collective in multi-host runs); written by process 0.
  params = _host_tree(hooks.evaluated(run, loop.state))
  ema = _host_tree(loop.state.ema_params) if run.config.ema_decay else None
  if jax.process_index() == 0:
    # The file names its model and classes itself: a copy taken out of the workdir predicts;
    # and a family's weights' preprocessing, which predict and evaluate apply.
    record = {
      'model': run.config.model,
      'class_names': list(run.info.class_names) if run.info.class_names else None,
      'dataset': run.info.name,
      'preprocessing': run.transform.to_json() if run.transform is not None else None,
    }
    checkpoint.save_npz(params, workdir_lib.params_path(run.workdir), metadata=record)
    if ema is not None:
      checkpoint.save_npz(ema, workdir_lib.params_path(run.workdir, ema=True), metadata=record)
  summary['wall_time_s'] = loop.totals()['wall_time_s']
  if jax.process_index() == 0:
    workdir_lib.write_summary(run.workdir, summary)


def _check_finite(config, losses: Losses, step, metrics_) -> float:
  """The step's loss as a float; stops the run on NaN/Inf unless skipping is on, and when
  skipping, after `max_nonfinite_in_a_row` skipped steps in a row (the run has diverged)."""
  loss = float(metrics_['loss'])
  finite = bool(metrics_['finite'])
  if not finite and not config.skip_nonfinite:
    raise TrainingError(
      f'loss or gradient is NaN/Inf at step {step}; stopped without applying it, the last '
      'checkpoint is kept. Lower --config.base_lr, check the data, or set '
      '--config.skip_nonfinite=True to skip such steps'
    )
  losses.nonfinite_in_a_row = 0 if finite else losses.nonfinite_in_a_row + 1
  if losses.nonfinite_in_a_row >= config.max_nonfinite_in_a_row:
    raise TrainingError(
      f'steps {step - losses.nonfinite_in_a_row + 1} to {step} were all NaN/Inf and skipped: '
      'the run has diverged; stopped, the last checkpoint is kept. Lower --config.base_lr or '
      'check the data (--config.max_nonfinite_in_a_row sets how many in a row stop a run)'
    )
  return loss


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
