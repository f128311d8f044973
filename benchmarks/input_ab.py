r"""The host train pipeline of two checkouts, in alternating runs on the same data.

  python benchmarks/input_ab.py --before=/work/main --after=. [--folder=DIR] \
      [--datasets=folder,digits] [--threads=1,2] [--rounds=6]

Each run is a fresh process of one checkout (`PYTHONPATH`) timing host train
batches at 224 px (batch 128, 12 batches after the first; in-memory datasets
48) of each dataset at each thread count: img/s and the process's CPU
milliseconds per image, the figure a shared machine disturbs least. The
checkouts alternate, `--rounds` times, so both see the same load; the record
keeps each side's best and median. A checkout without `raw=` (before the
uint8 batches) delivers float batches: what its host did per image. Without
--folder it writes 1,000 ImageNet-like JPEGs (`vit_jax.bench.input_speed`).
Writes `benchmarks/<time>_cpu_input_ab.json`.
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_ONE_RUN = r"""
import inspect, json, sys, time
import ml_collections
from vit_jax.configs.data import add_data_config
from vit_jax.data import pipeline
print(repr(pipeline.__file__))
dataset, threads, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = add_data_config(ml_collections.ConfigDict())
config.dataset, config.batch, config.pp.crop, config.input_threads = dataset, 128, 224, threads
raw = 'raw' in inspect.signature(pipeline.make_train_iterator).parameters
it = pipeline.make_train_iterator(config, None, **({'raw': True} if raw else {}))
next(it)
cpu, wall = time.process_time(), time.perf_counter()
for _ in range(steps):
  next(it)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print('RESULT' + json.dumps({'img_per_sec': steps * 128 / wall, 'cpu_ms_per_img': cpu / steps / 128 * 1e3}))
"""


def one_run(tree, dataset, threads, steps) -> dict:
  tree = os.path.abspath(tree)
  env = {**os.environ, 'PYTHONPATH': tree, 'JAX_PLATFORMS': 'cpu'}
  result = subprocess.run(  # in the checkout: `python -c` puts its working directory first
    [sys.executable, '-c', _ONE_RUN, dataset, str(threads), str(steps)],
    env=env, cwd=tree, capture_output=True, text=True, check=True,
  )  # fmt: skip
  assert f"'{tree}/vit_jax" in result.stdout, result.stdout[-500:]
  return json.loads(result.stdout.split('RESULT', 1)[1])


def _commit(tree) -> str:
  """The checkout's commit, '+' when its files differ from it."""
  git = lambda *a: subprocess.run(['git', '-C', tree, *a], capture_output=True, text=True).stdout
  return git('rev-parse', '--short', 'HEAD').strip() + (
    '+' if git('status', '--porcelain', '-uno').strip() else ''
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--before', required=True, help='checkout of the code before')
  parser.add_argument('--after', default=REPO, help='checkout of the code after')
  parser.add_argument('--folder', help='image folder DIR/train/<class>/*.jpg (default: written)')
  parser.add_argument('--datasets', default='folder,digits')
  parser.add_argument('--threads', default='1,2')
  parser.add_argument('--rounds', type=int, default=6)
  args = parser.parse_args()

  sys.path.insert(0, REPO)
  from vit_jax.bench import input_speed
  from vit_jax.core import hardware

  folder = args.folder or os.path.join(tempfile.mkdtemp(prefix='vit_jax_ab_'), 'folder')
  if not args.folder:
    input_speed.write_photos(folder, 1000)
  names = {name: folder if name == 'folder' else name for name in args.datasets.split(',')}
  sides = {'before': args.before, 'after': args.after}
  runs = {
    f'{side}/{name}/{n}': [] for side in sides for name in names for n in args.threads.split(',')
  }
  load = [os.getloadavg()[0]]
  for _ in range(args.rounds):
    for key in runs:
      side, name, n = key.split('/')
      steps = 12 if name == 'folder' else 48
      runs[key].append(one_run(sides[side], names[name], int(n), steps))
    load.append(os.getloadavg()[0])
  summary = {}
  for key, values in runs.items():
    cpu = [v['cpu_ms_per_img'] for v in values]
    rate = [v['img_per_sec'] for v in values]
    summary[key] = {
      'cpu_ms_per_img_min': round(min(cpu), 3), 'cpu_ms_per_img_median': round(statistics.median(cpu), 3),
      'img_per_sec_max': round(max(rate)), 'img_per_sec_median': round(statistics.median(rate)),
    }  # fmt: skip
    print(key, summary[key])
  now = datetime.datetime.now(datetime.timezone.utc)
  record = {
    'benchmark': 'benchmarks/input_ab.py',
    'time_utc': now.isoformat(timespec='seconds'),
    'command': ' '.join(sys.argv),
    'machine': hardware.machine_info(),
    'cpu_topology': input_speed.topology(),
    'commits': {side: _commit(tree) for side, tree in sides.items()},
    'load_average_per_round': load,
    'summary': summary,
    'runs': runs,
  }
  path = os.path.join(REPO, 'benchmarks', now.strftime('%Y%m%dT%H%M') + '_cpu_input_ab.json')
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(record, f, indent=1)
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
