"""The run directory (workdir): the names of its files, and their reading and writing.

  WORKDIR/
    config.json            the run's config; a run resumes only when it agrees (training.resume)
    dataset.json           its data: the path it names, its class names (for predict and export)
    preprocessing.json     a family model's weights: their statistics and evaluation transform
    checkpoints/<step>/    orbax checkpoints: train state, data iterator position, run totals
    corrupt_checkpoints/   checkpoints that did not restore, moved aside, never deleted
    summary.json           the finished run: step, accuracy, speed and its model's name
    params.npz             its final parameters in the public layout (params_ema.npz: EMA)
    fewshot.json           results of `python -m vit_jax.fewshot` (TensorBoard: tensorboard/fewshot)
    knn.json               results of `python -m vit_jax.knn`
    lock.json              held while a run writes (`workdir.lock`)
    metrics.jsonl, tensorboard/   what the run logs as it goes (`workdir.run_log`)

Every path here may be local or behind a scheme (`gs://`, `vit_jax.core.files`).
"""

import contextlib
import json
import math
import os
from typing import Optional

from vit_jax.core import files
from vit_jax.core.errors import UserError

__all__ = [  # `vit_jax.workdir`'s names for the files of a run
  'CONFIG_FILE',
  'DATASET_FILE',
  'PREPROCESSING_FILE',
  'CHECKPOINTS',
  'CORRUPT_CHECKPOINTS',
  'SUMMARY_FILE',
  'PARAMS_FILE',
  'PARAMS_EMA_FILE',
  'FEWSHOT_FILE',
  'KNN_FILE',
  'LOCK_FILE',
  'METRICS_FILE',
  'TENSORBOARD',
  'FEWSHOT_TENSORBOARD',
  'WorkdirError',
  'is_workdir',
  'check_folder',
  'check_output',
  'checkpoints_dir',
  'params_path',
  'summary_path',
  'has_params',
  'json_numbers',
  'read_summary',
  'write_summary',
  'recorded',
  'config_as_json',
  'read_config',
  'write_config',
  'read_dataset',
  'write_dataset',
  'read_preprocessing',
  'write_preprocessing',
  'saved_steps',
  'checkpoint_has_item',
  'set_aside',
  'corrupt_checkpoints_dir',
  'add_fewshot',
  'add_knn',
  'first_missing',
  'remove_unstarted',
]

CONFIG_FILE = 'config.json'
DATASET_FILE = 'dataset.json'
PREPROCESSING_FILE = 'preprocessing.json'
CHECKPOINTS = 'checkpoints'
CORRUPT_CHECKPOINTS = 'corrupt_checkpoints'
SUMMARY_FILE = 'summary.json'
PARAMS_FILE = 'params.npz'
PARAMS_EMA_FILE = 'params_ema.npz'
FEWSHOT_FILE = 'fewshot.json'
KNN_FILE = 'knn.json'
LOCK_FILE = 'lock.json'
METRICS_FILE = 'metrics.jsonl'  # written by workdir.run_log
TENSORBOARD = 'tensorboard'  # event files, by workdir.run_log
FEWSHOT_TENSORBOARD = os.path.join(TENSORBOARD, 'fewshot')


class WorkdirError(UserError, RuntimeError):
  """The workdir cannot be used as asked (in use, full, read-only, ...); one line."""


def is_workdir(path) -> bool:
  """Whether a checkpoint path names a directory (a workdir) rather than a file."""
  return files.isdir(path)


def check_folder(workdir: str) -> None:
  """WorkdirError when `workdir`, or a folder it would be made in, is an existing file."""
  if files.is_remote(workdir):
    return
  path = os.path.abspath(workdir)
  while not os.path.lexists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  if os.path.exists(path) and not os.path.isdir(path):
    where = 'is a file' if path == os.path.abspath(workdir) else f'is inside the file {path}'
    raise WorkdirError(
      f"{workdir} {where}: a workdir is a folder (made when missing) for the run's checkpoints "
      'and results; pass another --workdir'
    )


# What makes a folder a run's, for the commands that write elsewhere (`check_output`).
_RUN_WORK = (PARAMS_FILE, PARAMS_EMA_FILE, CHECKPOINTS, SUMMARY_FILE, LOCK_FILE)
_RUN_FILES = _RUN_WORK + (
  CONFIG_FILE,
  DATASET_FILE,
  PREPROCESSING_FILE,
  CORRUPT_CHECKPOINTS,
  FEWSHOT_FILE,
  KNN_FILE,
  METRICS_FILE,
  TENSORBOARD,
)


def check_output(path, flag: str, *, folder: bool = False) -> None:
  """WorkdirError when a command's output `path` could replace a training run's work.

  `folder`: the command writes files into `path` (export to hf or savedmodel,
  analyze, jft, ...), refused when `path` holds a run's work (params.npz,
  params_ema.npz, checkpoints/, summary.json or lock.json); a file `path` is
  refused when it is one of a run's own files in such a folder. Files beside
  a run's (`--output=RUN/model.onnx`) and sub-folders (`RUN/export/`) are fine.
  """
  path = os.fspath(path)
  target = path if folder else os.path.dirname(path) or '.'
  if not folder and os.path.basename(path) not in _RUN_FILES:
    return
  held = [name for name in _RUN_WORK if files.exists(os.path.join(target, name))]
  if held:
    shown = ', '.join(f'{name}/' if name == CHECKPOINTS else name for name in held)
    if folder:
      what, instead = path, f'a new folder (such as {os.path.join(path, "export")})'
    else:
      what, instead = f'{path} is in {target}, which', 'another file name'
    raise WorkdirError(
      f"{flag} {what} holds a run's work ({shown}) that this would replace; pass {instead}"
    )


def first_missing(workdir: str) -> Optional[str]:
  """The outermost of `workdir` and its parents that does not exist yet: what a run there
  creates, and may remove again (`remove_unstarted`); None when `workdir` exists or is remote."""
  if files.is_remote(workdir):
    return None
  path, missing = os.path.abspath(workdir), None
  while not os.path.lexists(path) and os.path.dirname(path) != path:
    path, missing = os.path.dirname(path), path
  return missing


def remove_unstarted(workdir: str, created: str, lock_released: bool) -> None:
  """What a run that never took a step wrote in the `workdir` it created (`first_missing`):
  its config, data record, empty logs and checkpoints folder; once `lock_released`, the folders
  from `workdir` up to `created` left empty. A command that failed leaves nothing behind; a
  file of anyone else keeps its folder."""
  import shutil

  if not lock_released:
    if saved_steps(workdir):
      return
    for name in (CONFIG_FILE, DATASET_FILE, METRICS_FILE):
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(workdir, name))
    for name in (TENSORBOARD, CHECKPOINTS):
      shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
    return
  path = os.path.abspath(workdir)
  while True:
    try:
      os.rmdir(path)
    except OSError:  # not empty: someone else's file
      return
    if path == created or os.path.dirname(path) == path:
      return
    path = os.path.dirname(path)


def checkpoints_dir(workdir: str, absolute: bool = False) -> str:
  """Where orbax writes the run's checkpoints (`absolute`: as orbax needs the path, `_text_path`)."""
  if absolute:
    return _text_path(os.path.join(files.absolute(workdir), CHECKPOINTS))
  return os.path.join(workdir, CHECKPOINTS)


def _text_path(path: str) -> str:
  """`path`, or where a path that is not UTF-8 text can be reached under a name that is.

  TensorStore, which writes orbax's arrays, takes paths as UTF-8 text; a
  local name in bytes of another encoding (or with any non-ASCII letter in a
  C locale) reaches Python as surrogate escapes. Such a folder is reached
  through a symlink in the temporary folder, named by a hash of the path.
  """
  try:
    path.encode('utf-8')
    return path
  except UnicodeEncodeError:
    pass
  import hashlib
  import tempfile

  files.makedirs(path)
  digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:16]
  link = os.path.join(tempfile.gettempdir(), f'vit_jax-checkpoints-{digest}')
  if not (os.path.islink(link) and os.readlink(link) == path):
    temporary = f'{link}.{os.getpid()}'
    os.symlink(path, temporary)
    os.replace(temporary, link)
  return link


def params_path(workdir: str, ema: bool = False) -> str:
  return os.path.join(workdir, PARAMS_EMA_FILE if ema else PARAMS_FILE)


def summary_path(workdir: str) -> str:
  return os.path.join(workdir, SUMMARY_FILE)


def has_params(workdir: str) -> bool:
  """Whether `workdir` holds a finished run's parameters."""
  return files.exists(params_path(workdir))


def _read_json(path: str) -> Optional[dict]:
  if not files.exists(path):
    return None
  with files.open_file(path) as f:
    return json.load(f)


def json_numbers(data: dict) -> dict:
  """`data` with NaN and infinite floats as None: strict JSON (`null`), which every reader
  parses, where Python's json would write the bare `NaN` that most refuse."""
  return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in data.items()}


def _write_json(path: str, data: dict) -> None:
  text = json.dumps(json_numbers(data), indent=2, sort_keys=True, allow_nan=False)
  files.write_text(path, text + '\n')


def read_summary(workdir: str) -> Optional[dict]:
  """The finished run's summary, None when there is none."""
  return _read_json(summary_path(workdir))


def write_summary(workdir: str, summary: dict) -> None:
  _write_json(summary_path(workdir), summary)


def recorded(path, field: str):
  """`field` (`model`, `dataset`, ...) of a workdir's summary, else of its config (a run not
  finished); None for files and unreadable runs."""
  path = os.fspath(path)
  try:
    if not is_workdir(path):
      return None
    return next(
      (r[field] for r in (read_summary(path), read_config(path)) if r and field in r), None
    )
  except (OSError, ValueError):
    return None


def config_as_json(config) -> dict:
  """A ConfigDict as the plain data `config.json` holds."""
  return json.loads(config.to_json_best_effort())


def read_config(workdir: str) -> Optional[dict]:
  """The config the run in `workdir` recorded, None when there is none."""
  return _read_json(os.path.join(workdir, CONFIG_FILE))


def write_config(workdir: str, config, keep: Optional[dict] = None) -> None:
  """Records `config` in `workdir`, with the fields of `keep` ({dotted name: value}: fields
  the recorded config has that this version does not read) kept as they were; an unchanged
  one is not rewritten."""
  data = config_as_json(config)
  for name, value in (keep or {}).items():
    *sections, last = name.split('.')
    target = data
    for section in sections:
      target = target.setdefault(section, {})
    target[last] = value
  text = json.dumps(data, indent=2, sort_keys=True) + '\n'
  path = os.path.join(workdir, CONFIG_FILE)
  if files.exists(path):
    with files.open_file(path) as f:
      if f.read() == text:
        return
  files.write_text(path, text)


def read_dataset(workdir: str) -> Optional[dict]:
  """What the run in `workdir` recorded of its data (`data.datasets.record`), None when it
  recorded nothing (a run of an older version) or the file does not read."""
  try:
    return _read_json(os.path.join(workdir, DATASET_FILE))
  except (OSError, ValueError):
    return None


def write_dataset(workdir: str, record: dict) -> None:
  """Records the run's data; an unchanged record is not rewritten."""
  if read_dataset(workdir) != record:
    _write_json(os.path.join(workdir, DATASET_FILE), record)


def read_preprocessing(workdir: str) -> Optional[dict]:
  """The preprocessing of the weights the run in `workdir` trains (a family model's:
  `configs.timm_weights.Preprocessing.to_json`), None when it recorded none."""
  try:
    return _read_json(os.path.join(workdir, PREPROCESSING_FILE))
  except (OSError, ValueError):
    return None


def write_preprocessing(workdir: str, record: dict) -> None:
  """Records the weights' preprocessing; an unchanged record is not rewritten."""
  if read_preprocessing(workdir) != record:
    _write_json(os.path.join(workdir, PREPROCESSING_FILE), record)


def saved_steps(workdir: str) -> list:
  """Steps of the complete checkpoints (unfinished ones carry a suffix), oldest first."""
  names = files.listdir(checkpoints_dir(workdir))
  return sorted(int(name) for name in names if name.isdigit())


def checkpoint_has_item(workdir: str, step: int, item: str) -> bool:
  """Whether the checkpoint at `step` holds the orbax item `item`."""
  return files.exists(os.path.join(workdir, CHECKPOINTS, str(step), item))


def set_aside(workdir: str, step: int) -> str:
  """Moves checkpoint `step` into `corrupt_checkpoints/` (never deleted); its new path."""
  folder = corrupt_checkpoints_dir(workdir)
  files.makedirs(folder)
  target, n = os.path.join(folder, str(step)), 1
  while files.exists(target):
    target, n = os.path.join(folder, f'{step}-{n}'), n + 1
  files.rename(os.path.join(checkpoints_dir(workdir), str(step)), target)
  return target


def corrupt_checkpoints_dir(workdir: str) -> str:
  return os.path.join(workdir, CORRUPT_CHECKPOINTS)


def add_fewshot(workdir: str, scalars: dict) -> str:
  """Adds few-shot `scalars` to `fewshot.json` (other datasets' results kept); its path. A
  training run's own files (summary, metrics) stay as the run wrote them; the TensorBoard
  copy is `run_log.record_fewshot`'s."""
  return _add_results(workdir, FEWSHOT_FILE, scalars)


def add_knn(workdir: str, scalars: dict) -> str:
  """Adds k-NN `scalars` to `knn.json` (other datasets' and settings' results kept); its
  path."""
  return _add_results(workdir, KNN_FILE, scalars)


def _add_results(workdir: str, name: str, scalars: dict) -> str:
  path = os.path.join(workdir, name)
  results = _read_json(path) or {}
  results.update(scalars)
  files.makedirs(workdir)
  _write_json(path, results)
  return path
