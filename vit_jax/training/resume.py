"""Running a command again on its workdir: the policy for the recorded config, a finished
run and a checkpoint that does not restore. The files are `vit_jax.workdir`'s.

A run records its config in the workdir. Running again resumes only when the
config agrees on what the run learns (`MAY_CHANGE` lists what may differ:
length, cadence, devices, evaluation, data location); otherwise one line says
what differs and what to type; the same folder spelled otherwise (a trailing
slash, a relative path, a symlink) is the same data. The run's record of its
data (dataset.json) tells data that changed (a class folder added) and arrays
registered in Python that this process lacks, each in one line, before a
checkpoint is read. A finished run (its summary at `total_steps`)
is reported, not run again. A checkpoint that does not restore (files
truncated or lost) is set aside and the run resumes from the newest one that
does; in a multi-host run a step counts only when every host restored it, so
all resume from the same step.
"""

import contextlib
import logging
import os
import shlex
from typing import Callable, Optional

import jax
from jax.experimental import multihost_utils
import numpy as np

from vit_jax import workdir as workdir_lib
from vit_jax.core import files
from vit_jax.data import datasets

# Config fields a resumed run may change: how long, on what and how fast it
# runs, what it reports and where the same data lives; not what it learns.
# Dotted names; a name covers its sub-fields.
MAY_CHANGE = (
  'total_steps',  # train longer (or stop sooner); the schedule follows the new length
  'accum_steps',  # same math in smaller micro-batches (the out-of-memory advice)
  'remat',
  'remat_policy',
  'scan_layers',  # checkpoints name encoderblock_{i} either way
  'attention',
  'mesh',  # another device layout; checkpoints reshard on restore
  'skip_nonfinite',  # the NaN advice
  'max_nonfinite_in_a_row',
  'pretrained_path',  # read only when a run starts
  'batch_eval',
  'prefetch',
  'eval_cache_mb',
  'pp.test',
  'pp.resize',
  'tfds_data_dir',
  'tfds_manual_dir',
  'corrupt_images',
  'progress_every',
  'eval_every',
  'checkpoint_every',
  'keep_checkpoints',
  'tensorboard',
  'peak_flops',
  'fewshot',
)


# Fields added since runs were first recorded that change what a run learns:
# (the value a run recorded without the field had, whether it matters given
# the recorded config). Such a run resumes as it was only with that value, so
# the one line below names it like any other difference.
ADDED = {
  # Before the official floor of 1e-5, the linear decay ended at 0.
  'linear_end': (0.0, lambda flat: flat.get('decay_type') == 'linear'),
}


class ResumeError(workdir_lib.WorkdirError):
  """The workdir holds a run this command cannot continue; one line with what to do."""


def _flat(tree: dict, prefix: str = '') -> dict:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flat(value, f'{prefix}{key}.'))
    else:
      flat[f'{prefix}{key}'] = value
  return flat


def _may_change(name: str) -> bool:
  return any(name == field or name.startswith(field + '.') for field in MAY_CHANGE)


def _flag(name: str, value) -> str:
  if isinstance(value, str):
    text = value
  elif isinstance(value, list):
    text = repr(tuple(value))
  else:
    text = repr(value)
  return shlex.quote(f'--config.{name}={text}')


def check_config(workdir: str, config) -> None:
  """Raises ResumeError when `workdir` holds a run whose config differs in what it learns.

  A run that stopped before its first checkpoint leaves nothing to lose; any
  config may start over there.
  """
  recorded = workdir_lib.read_config(workdir)
  if recorded is None:
    return
  if not workdir_lib.saved_steps(workdir) and workdir_lib.read_summary(workdir) is None:
    return
  before, now = _flat(recorded), _flat(workdir_lib.config_as_json(config))
  for name, (value, matters) in ADDED.items():
    if name not in before and matters(before):
      before[name] = value
  # Fields only one side knows (another version of the code) are not compared.
  differ = sorted(
    k for k in before.keys() & now.keys() if before[k] != now[k] and not _may_change(k)
  )
  if 'dataset' in differ and (
    same_data(workdir, before['dataset'], now['dataset'])  # a trailing slash, relative, a link
    or moved_here(workdir, now['dataset'])
  ):
    differ.remove('dataset')
  if not differ:
    return
  weights = '' if workdir_lib.has_params(workdir) else ', once that run has finished'
  raise ResumeError(
    f'{workdir} holds a run with '
    + ', '.join(f'{k}={before[k]!r}' for k in differ)
    + ' where this command has '
    + ', '.join(f'{k}={now[k]!r}' for k in differ)
    + '. To resume it, run with '
    + ' '.join(_flag(k, before[k]) for k in differ)
    + f'; to start afresh, use another --workdir (--config.pretrained_path={workdir} starts '
    f'from its weights{weights})'
  )


def same_data(workdir: str, before: str, now: str) -> bool:
  """Whether `now` names the data the run recorded as `before`: the same folder or file,
  compared by its real path as the run recorded it (dataset.json) or as `before` names it."""
  if not isinstance(before, str) or not isinstance(now, str):
    return False
  path = (workdir_lib.read_dataset(workdir) or {}).get('path')
  return any(datasets.same_path(recorded, now) for recorded in (path, before) if recorded)


def moved_here(workdir: str, now) -> bool:
  """Whether `now` is a local folder or file holding the data the run in `workdir` recorded
  at another path (its fingerprint in dataset.json, `data.datasets.fingerprint`): a dataset
  moved, copied or renamed. Where the recorded path is gone, another `now` is a ResumeError
  saying how they differ (the run cannot be resumed on the old path either)."""
  recorded = workdir_lib.read_dataset(workdir) or {}
  old = recorded.get('path')
  if not old or not isinstance(now, str) or files.is_remote(now):
    return False
  gone = not os.path.exists(old)
  path = os.path.expanduser(now)
  then = recorded.get('fingerprint')
  if not os.path.exists(path) or not then:
    if gone:
      raise ResumeError(
        f'{workdir} holds a run on {old}, which is no longer there, and its dataset.json has no '
        f'fingerprint of that data (an older version wrote it) to check {now} against: put the '
        f'data back at {old} (a symlink there will do), or use another --workdir'
      )
    return False
  got = datasets.fingerprint(os.path.realpath(path))
  if got == then:
    return True
  if not gone:
    return False  # both exist and differ: the config's difference, said as any other
  if (got['files'], got['bytes']) != (then['files'], then['bytes']):
    how = (
      f"{got['files']:,} files of {got['bytes']:,} bytes where the run's data had "
      f'{then["files"]:,} of {then["bytes"]:,}'
    )
  else:
    how = 'as many files and bytes, but other names or contents'
  raise ResumeError(
    f'{now} is not the data the run in {workdir} was trained on ({old}, no longer there): '
    f'{how}. Pass the folder or file that data moved to (checked by its fingerprint in '
    f'{workdir_lib.DATASET_FILE}), or use another --workdir to train on this data'
  )


def _has_work(workdir: str) -> bool:
  """Whether `workdir` holds a checkpoint or a summary: something a wrong resume would lose."""
  return bool(workdir_lib.saved_steps(workdir)) or workdir_lib.read_summary(workdir) is not None


def check_dataset(workdir: str, config) -> None:
  """Before the data is opened: a run on arrays registered in Python that this process has not
  registered (resumed from the command line, or a new session) is one line saying how."""
  recorded = workdir_lib.read_dataset(workdir)
  if not recorded or not recorded.get('registered') or not _has_work(workdir):
    return
  name = config.dataset
  if name == recorded.get('dataset') and not datasets.is_registered(name):
    raise ResumeError(
      f'{workdir} holds a run on {name!r}, arrays registered in Python '
      f'(register_arrays), which this process has not registered: resume it from Python, '
      f'calling vit_jax.input_pipeline.register_arrays({name!r}, x_train=..., y_train=..., '
      '...) with the same arrays before train_and_evaluate'
    )


def check_classes(workdir: str, info) -> None:
  """After the data is opened: classes added to or taken from it since the run started (a new
  class folder) would give the head another size, and the checkpoint would not restore."""
  recorded = workdir_lib.read_dataset(workdir)
  if not recorded or not _has_work(workdir):
    return
  then, now = recorded.get('class_names'), list(info.class_names or [])
  if recorded.get('num_classes') == info.num_classes and (not then or not now or then == now):
    return
  added = [n for n in now if n not in (then or [])]
  gone = [n for n in (then or []) if n not in now]
  change = '; '.join(
    part
    for part in (
      f'added {", ".join(map(repr, added[:5]))}' if added and then else '',
      f'without {", ".join(map(repr, gone[:5]))}' if gone else '',
    )
    if part
  )
  raise ResumeError(
    f'{info.name} has {info.num_classes} classes now, the run in {workdir} was trained on '
    f'{recorded.get("num_classes")}' + (f' ({change})' if change else '') + ': the data '
    'changed since the run started. To resume it, restore the data as it was; to train on the '
    f'new classes, use another --workdir (--config.pretrained_path={workdir} starts from its '
    'weights)'
  )


def record_dataset(workdir: str, info) -> None:
  """Records the run's data in `workdir` (dataset.json, `data.datasets.record`)."""
  previous = workdir_lib.read_dataset(workdir)
  workdir_lib.write_dataset(
    workdir, datasets.record(info.name, info.num_classes, info.class_names, previous)
  )


def unknown_fields(workdir: str, config) -> dict:
  """{dotted name: value} of the fields the run in `workdir` recorded that `config` does not
  have: written by another version of the code, which this one neither reads nor compares."""
  recorded = _flat(workdir_lib.read_config(workdir) or {})
  known = _flat(workdir_lib.config_as_json(config))
  return {k: v for k, v in recorded.items() if k not in known}


def finished(workdir: str, config) -> Optional[dict]:
  """The summary of a run in `workdir` that has reached `config.total_steps`, else None."""
  summary = workdir_lib.read_summary(workdir)
  if summary is not None and summary.get('step', -1) >= config.total_steps:
    return summary
  return None


def _everywhere(ok: bool) -> bool:
  """True on every host when `ok` is True on every host."""
  if jax.process_count() == 1:
    return ok
  return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


@contextlib.contextmanager
def without_orbax_errors():
  """Orbax logs each failed read at ERROR; `restore_newest` says what it means in one line."""
  logger = logging.getLogger('absl')
  drop = lambda record: 'orbax' not in record.pathname
  logger.addFilter(drop)
  try:
    yield
  finally:
    logger.removeFilter(drop)


def _first_line(error: BaseException, limit: int = 160) -> str:
  text = (str(error).strip().splitlines() or [''])[0]
  text = text if len(text) <= limit else text[: limit - 3] + '...'
  return f'{type(error).__name__}: {text}'


def restore_newest(manager, workdir: str, args_for: Callable, log) -> Optional[tuple]:
  """(step, restored items) of the newest checkpoint that restores; None when there is none.

  `args_for(step)` gives the orbax restore arguments. Newer checkpoints that do
  not restore are moved aside (by process 0) and named in one line; when none
  restores, nothing is moved and ResumeError says so.
  """
  # Every host reads the files it needs: all of them in data-parallel runs, so
  # all fail alike on a damaged file. With FSDP a damaged shard may fail on
  # some hosts only while the others wait in orbax's restore barrier; such a
  # run fails there (a traceback or the coordination timeout), not falling back.
  failed = []
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      with without_orbax_errors():
        restored = manager.restore(step, args=args_for(step))
      error = None
    except Exception as e:  # noqa: BLE001  unreadable files surface as many error types
      restored, error = None, e
    if _everywhere(error is None):
      break
    failed.append((step, error))
  else:
    if failed:
      step, error = failed[0]
      raise ResumeError(
        f'no checkpoint in {workdir_lib.checkpoints_dir(workdir)} restores (step {step}: '
        f'{_first_line(error) if error else "another host failed"}); if the config or the data '
        'changed since the run started, run it with the original ones, or use another --workdir'
      )
    return None
  if failed:
    if jax.process_index() == 0:
      for bad, _ in failed:
        workdir_lib.set_aside(workdir, bad)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices('vit_jax.resume: bad checkpoints set aside')
    manager.reload()
    bad, error = failed[0]
    log.info(
      'checkpoint%s at step %s do%s not restore (%s); moved to %s; resuming from step %d',
      's' if len(failed) > 1 else '',
      ', '.join(str(s) for s, _ in failed),
      '' if len(failed) > 1 else 'es',
      _first_line(error) if error else 'another host failed',
      workdir_lib.corrupt_checkpoints_dir(workdir),
      step,
    )
  return step, restored
