r"""The demo trained four ways and evaluated at several patch sizes and resolutions.

  python benchmarks/measure_variants.py --root=/tmp/variants        # trains all four, then evaluates
  python benchmarks/measure_variants.py --root=/tmp/variants --table=benchmarks/<time>_variants.json

Trains `python -m vit_jax.main` (configs/demo.py: ViT-Demo_4 on the digits,
2000 steps) plain, with one register (--config.num_registers=1), with a random
patch size of 2, 4 or 8 per step (--config.flexi_patch_sizes) and NaFlex
(--config.naflex_tokens: each image at its crop's aspect ratio, 4 to 36
patches), each in ROOT/<variant> (a finished run there is read, not run
again), evaluates every run on the 359 test digits at the patch sizes or
resolutions it takes, times each variant's train step in this one process
(batch 128, six interleaved rounds, the best of each, so that the machine's load touches all alike;
the runs' own img/s depend on what else ran then), and writes a record
benchmarks/<time>_variants.json whose table docs/registers_flexi_naflex.md
quotes (`--table` prints it again).
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

from vit_jax.configs.data import data_config

VARIANTS = {
  'plain': [],
  'registers': ['--config.num_registers=1'],
  'flexi': ['--config.flexi_patch_sizes=(2,4,8)'],
  'naflex': ['--config.naflex_tokens=(4,9,16,25,36)'],
}
# What each run is evaluated at: (label, patch size or None, crop or None).
EVALS = {
  'plain': [('patch 2', 2, None), ('patch 4', None, None), ('patch 8', 8, None)],
  'registers': [('patch 4', None, None)],
  'flexi': [('patch 2', 2, None), ('patch 4', None, None), ('patch 8', 8, None)],
  'naflex': [('8 px', None, 8), ('16 px', None, 16), ('24 px', None, 24)],
}


def train(root: str, name: str) -> dict:
  from vit_jax import workdir as workdir_lib

  workdir = os.path.join(root, name)
  summary = workdir_lib.read_summary(workdir)
  if summary is None or summary.get('step', 0) < 2000:
    command = [sys.executable, '-m', 'vit_jax.main', f'--workdir={workdir}', *VARIANTS[name]]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    summary = workdir_lib.read_summary(workdir)
  return summary


def evaluate(workdir: str, patch_size, crop) -> float:
  from vit_jax.evaluation import classify
  from vit_jax.evaluation import loader

  loaded = loader.load_model(workdir, patch_size=patch_size)
  data = data_config()
  data.update(dataset='digits', batch_eval=359)
  data.pp.crop = loader.check_resolution(loaded, crop)
  return classify.evaluate_checkpoint(loaded, data, 'test')['top1']


def _config(name: str):
  """The demo's config with a variant's flags (as the command line sets them)."""
  from vit_jax.configs import demo

  config = demo.get_config()
  for flag in VARIANTS[name]:
    field, _, value = flag.removeprefix('--config.').partition('=')
    value = json.loads(value.replace('(', '[').replace(')', ']'))
    config[field] = tuple(value) if isinstance(value, list) else value
  return config


def step_speeds(rounds: int = 6, steps: int = 5) -> dict:
  """{variant: train img/s} of the demo's jitted step, timed in interleaved rounds."""
  import jax
  import numpy as np

  from vit_jax.core import sharding
  from vit_jax.data import spec
  from vit_jax.training import program

  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  runs, times = {}, {}
  for name in VARIANTS:
    config = _config(name)
    built = program.build(config, mesh, 10, multi_label=False)
    state = jax.jit(built.init, out_shardings=built.state_shardings)(jax.random.PRNGKey(0))
    shapes = spec.batch_spec(config, 10, False, train=True)
    rng = np.random.default_rng(0)
    batch = {'image': rng.uniform(-1, 1, shapes['image'].shape).astype(np.float32)}
    if name == 'naflex':  # real patches, grid positions of a full 6x6 grid
      batch['image'][..., -3:] = np.stack([*np.divmod(np.arange(36), 6), np.ones(36)], -1)
    batch['label'] = rng.integers(0, 10, config.batch).astype(np.int32)
    batch = jax.device_put(batch, built.batch_sharding)
    runs[name] = [built.train_step, state, batch, config.batch]
    times[name] = []
  for _ in range(rounds + 1):  # the first round compiles and warms up
    for name, run in runs.items():
      start = time.perf_counter()
      for _ in range(steps):
        run[1], metrics = run[0](run[1], run[2])
      jax.block_until_ready(metrics)
      times[name].append(time.perf_counter() - start)
  return {name: steps * runs[name][3] / min(t[1:]) for name, t in times.items()}


def table(record: dict) -> str:
  lines = [
    '| trained | flags | train step img/s (vs plain) | test accuracy, evaluated at |',
    '|---|---|---:|---|',
  ]
  base = record['runs']['plain']['step_img_per_sec']
  for name, run in record['runs'].items():
    flags = ' '.join(f'`{f}`' for f in VARIANTS[name]) or '(none)'
    results = ', '.join(f'{label}: {100 * acc:.2f}%' for label, acc in run['eval'].items())
    speed = run['step_img_per_sec']
    lines.append(f'| {name} | {flags} | {speed:.0f} ({speed / base:.2f}x) | {results} |')
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--root', default='workdirs/variants', help='one workdir per variant')
  parser.add_argument('--table', help='print the table of this record and stop')
  args = parser.parse_args()
  if args.table:
    with open(args.table, encoding='utf-8') as f:
      print(table(json.load(f)))
    return
  from vit_jax.core import hardware

  runs = {}
  speeds = step_speeds()
  for name in VARIANTS:
    summary = train(args.root, name)
    workdir = os.path.join(args.root, name)
    runs[name] = {
      'step_img_per_sec': speeds[name],
      'run_img_per_sec': summary['img_per_sec'],
      'run_wall_time_s': summary['wall_time_s'],
      'eval': {label: evaluate(workdir, patch, crop) for label, patch, crop in EVALS[name]},
    }
    print(name, runs[name], flush=True)
  record = {
    'benchmark': 'the demo trained plain, with registers, FlexiViT and NaFlex',
    'date': datetime.datetime.now().isoformat(timespec='seconds'),
    'machine': hardware.machine_info(),
    'runs': runs,
  }
  name = datetime.datetime.now().strftime('%Y-%m-%dT%H%M') + '_variants.json'
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(record, f, indent=2)
    f.write('\n')
  print(f'wrote {path}\n{table(record)}')


if __name__ == '__main__':
  main()
