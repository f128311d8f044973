"""What a run writes as it goes: TensorBoard events, metrics.jsonl, progress lines.

Only process 0 writes; on other processes every method is a no-op.
"""

import json
import os
import time

from absl import logging

from vit_jax import files


def _format_duration(seconds: float) -> str:
  seconds = int(seconds)
  hours, rest = divmod(seconds, 3600)
  minutes, seconds = divmod(rest, 60)
  return f'{hours}h{minutes:02d}m' if hours else f'{minutes}m{seconds:02d}s'


class RunLog:
  """Scalars to TensorBoard (`workdir/tensorboard`) and `workdir/metrics.jsonl`.

  `metrics.jsonl` (one JSON object per line) is written for local workdirs
  only: object stores such as GCS cannot append.
  """

  def __init__(self, workdir: str, *, is_main: bool, tensorboard: bool = True):
    self._active = is_main
    self._workdir = workdir
    self._tb = None
    if not is_main:
      return
    files.makedirs(workdir)
    if tensorboard:
      import tensorflow as tf

      self._tb = tf.summary.create_file_writer(os.path.join(workdir, 'tensorboard'))
    self._jsonl = (
      None if files.is_remote(workdir) else open(os.path.join(workdir, 'metrics.jsonl'), 'a')
    )

  def scalars(self, step: int, values: dict) -> None:
    if not self._active:
      return
    values = {k: float(v) for k, v in values.items()}
    if self._jsonl is not None:
      self._jsonl.write(json.dumps({'step': int(step), **values}) + '\n')
      self._jsonl.flush()
    if self._tb is not None:
      import tensorflow as tf

      with self._tb.as_default(step=int(step)):
        for name, value in values.items():
          tf.summary.scalar(name, value)
      self._tb.flush()

  def info(self, message: str, *args) -> None:
    if self._active:
      logging.info(message, *args)

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


class Progress:
  """Throughput and ETA between progress lines."""

  def __init__(self, total_steps: int, first_step: int, batch_size: int):
    self.total_steps = total_steps
    self.batch_size = batch_size
    self._last_step, self._last_time = first_step, time.perf_counter()
    self.img_per_sec = 0.0
    self.step_time = 0.0

  def update(self, step: int) -> dict:
    """Call after `step`'s metrics are on the host; returns img/s and ETA."""
    now = time.perf_counter()
    steps = step - self._last_step
    if steps > 0:
      step_time = (now - self._last_time) / steps
      self.img_per_sec = self.batch_size / step_time
      self.step_time = step_time
    self._last_step, self._last_time = step, now
    return {'img_per_sec': self.img_per_sec}

  def restart_clock(self, step: int) -> None:
    """Excludes time spent outside training steps (evaluation, checkpoints)."""
    self._last_step, self._last_time = step, time.perf_counter()

  def line(self, step: int, loss: float, lr: float) -> str:
    eta = (self.total_steps - step) * self.step_time
    return (
      f'step {step}/{self.total_steps}  loss {loss:.4f}  lr {lr:.3g}  '
      f'{self.img_per_sec:,.0f} img/s  ETA {_format_duration(eta)}'
    )
