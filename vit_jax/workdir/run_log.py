"""What a run writes into its workdir as it goes: TensorBoard events and metrics.jsonl.

Only process 0 writes; on other processes every method is a no-op. The lines
a person reads on the terminal are `core.console`'s.
"""

import json
import os
import socket
import time

from vit_jax.core import files
from vit_jax.workdir import layout


class EventFile:
  """TensorBoard scalars in an event file, written without TensorFlow.

  An event file is TFRecord-framed `Event` protos (TensorBoard's own, from the
  tensorboard package). Local files are appended to; an object store cannot
  append, so there the file is rewritten whole at each flush (scalars are a
  few KB per thousand steps).
  """

  def __init__(self, logdir: str):
    from tensorboard.compat.proto import event_pb2

    self._event_pb2 = event_pb2
    files.makedirs(logdir)
    name = f'events.out.tfevents.{time.time():.0f}.{socket.gethostname()}.{os.getpid()}.0'
    self._path = os.path.join(logdir, name)
    self._remote = files.is_remote(logdir)
    self._records = []
    self._file = None if self._remote else open(self._path, 'ab')
    self._write(event_pb2.Event(wall_time=time.time(), file_version='brain.Event:2'))

  def _write(self, event) -> None:
    data = files.tfrecord_frame(event.SerializeToString())
    if self._remote:
      self._records.append(data)
    else:
      self._file.write(data)

  def scalars(self, step: int, values: dict) -> None:
    from tensorboard.compat.proto import summary_pb2

    summary = summary_pb2.Summary(
      value=[summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()]
    )
    self._write(self._event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

  def flush(self) -> None:
    if self._remote:
      with files.open_file(self._path, 'wb') as f:
        f.write(b''.join(self._records))
    else:
      self._file.flush()

  def close(self) -> None:
    self.flush()
    if self._file is not None:
      self._file.close()


def record_fewshot(workdir: str, scalars: dict) -> str:
  """Few-shot `scalars` into `workdir`: `fewshot.json` (`workdir.add_fewshot`, other datasets'
  results kept) and TensorBoard under `tensorboard/fewshot`; the JSON's path."""
  path = layout.add_fewshot(workdir, scalars)
  write_scalars(os.path.join(workdir, layout.FEWSHOT_TENSORBOARD), 0, scalars)
  return path


def write_scalars(logdir: str, step: int, values: dict) -> None:
  """One event file in `logdir` holding `values` at `step`."""
  events = EventFile(logdir)
  events.scalars(step, values)
  events.close()


def _step_of(line: str) -> float:
  """The step of a metrics.jsonl line; a line that does not read as one is kept (-inf)."""
  try:
    return float(json.loads(line).get('step', float('-inf')))
  except (ValueError, AttributeError):
    return float('-inf')


class RunLog:
  """Scalars to TensorBoard (`workdir/tensorboard`) and `workdir/metrics.jsonl`.

  `metrics.jsonl` (one JSON object per line) is written for local workdirs
  only: object stores such as GCS cannot append. It is strict JSON: a NaN or
  infinite value (a skipped step's gradient norm) is `null` there.
  """

  def __init__(self, workdir: str, *, is_main: bool, tensorboard: bool = True):
    self._active = is_main
    self._workdir = workdir
    self._tb = None
    if not is_main:
      return
    files.makedirs(workdir)
    if tensorboard:
      self._tb = EventFile(os.path.join(workdir, layout.TENSORBOARD))
    self._jsonl = (
      None
      if files.is_remote(workdir)
      else open(os.path.join(workdir, layout.METRICS_FILE), 'a', encoding='utf-8')
    )

  def scalars(self, step: int, values: dict) -> None:
    if not self._active:
      return
    values = {k: float(v) for k, v in values.items()}
    if self._jsonl is not None:
      line = {'step': int(step), **layout.json_numbers(values)}
      self._jsonl.write(json.dumps(line, allow_nan=False) + '\n')
      self._jsonl.flush()
    if self._tb is not None:
      self._tb.scalars(step, values)
      self._tb.flush()

  def rewind(self, step: int) -> None:
    """Drops the metrics.jsonl lines past `step` (and a line cut short): a run resumed from
    its checkpoint at `step` logs those steps again, as an uninterrupted run logged them once."""
    if not self._active or self._jsonl is None:
      return
    path = os.path.join(self._workdir, layout.METRICS_FILE)
    self._jsonl.close()
    with open(path, encoding='utf-8') as f:
      text = f.read()
    lines = text.splitlines(keepends=True)
    kept = [line for line in lines if line.endswith('\n') and _step_of(line) <= step]
    if len(kept) != len(lines):
      with open(path + '.tmp', 'w', encoding='utf-8') as f:
        f.writelines(kept)
      os.replace(path + '.tmp', path)
    self._jsonl = open(path, 'a', encoding='utf-8')

  def info(self, message: str, *args) -> None:
    if self._active:
      print(message % args if args else message, flush=True)

  def write_json(self, name: str, data: dict) -> None:
    if not self._active:
      return
    path = os.path.join(self._workdir, name)
    with files.open_file(path + '.tmp', 'w') as f:
      json.dump(data, f, indent=2, sort_keys=True)
      f.write('\n')
    files.rename(path + '.tmp', path)

  def close(self) -> None:
    if self._active:
      if self._jsonl is not None:
        self._jsonl.close()
      if self._tb is not None:
        self._tb.close()
