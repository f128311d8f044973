"""A `jax.profiler` trace of a few steps, and where the device's time went in it.

`python -m vit_jax.benchmark --profile=DIR` traces `--steps` more steps of ours
after the timed ones into DIR (TensorBoard's profile plugin or Perfetto read
it) and puts the kernels that took the most device time into the record, read
from the trace's Chrome-format copy (`*.trace.json.gz`), so that a lease's
profile is read without the plugin.
"""

import collections
import glob
import gzip
import json
import os

TOP = 25


def trace(directory, run, steps: int) -> dict:
  """Runs `run()` `steps` times under the profiler; the summary of `device_time`."""
  import jax

  with jax.profiler.trace(directory):
    for _ in range(steps):
      run()
  files = sorted(glob.glob(os.path.join(directory, '**', '*.trace.json.gz'), recursive=True))
  if not files:
    return {'directory': directory, 'trace': None}
  return {'directory': directory, 'trace': files[-1], 'steps': steps, **device_time(files[-1])}


def device_time(path) -> dict:
  """Complete events ('X') of the trace's device processes (`/device:GPU:0`, ...), summed by
  line (a stream, or XLA's op and module lines, which overlap the streams) and name: each
  line's busy microseconds, and the TOP (line, name) pairs with their microseconds, count
  and share of their line."""
  with gzip.open(path, 'rt', encoding='utf-8') as f:
    events = json.load(f)['traceEvents']
  names = {}  # (pid, tid or None) -> name, from the metadata events
  for e in events:
    if e.get('ph') == 'M' and e.get('name') in ('process_name', 'thread_name'):
      key = (e['pid'], e.get('tid') if e['name'] == 'thread_name' else None)
      names[key] = e.get('args', {}).get('name', '')
  by_name, count, lines = collections.Counter(), collections.Counter(), collections.Counter()
  for e in events:
    if e.get('ph') != 'X' or not names.get((e.get('pid'), None), '').startswith('/device:'):
      continue
    line = f'{names[(e["pid"], None)]} {names.get((e["pid"], e.get("tid")), e.get("tid"))}'
    duration = float(e.get('dur', 0.0))
    by_name[line, e['name']] += duration
    count[line, e['name']] += 1
    lines[line] += duration
  top = [
    {'line': line, 'name': name, 'us': round(us, 1), 'count': count[line, name],
     'share': round(us / lines[line], 4)}
    for (line, name), us in by_name.most_common(TOP)
  ]  # fmt: skip
  return {'lines_us': {k: round(v, 1) for k, v in lines.items()}, 'top': top}
