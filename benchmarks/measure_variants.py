r"""The demo trained four ways and evaluated at several patch sizes and resolutions.

  python benchmarks/measure_variants.py --root=/tmp/variants        # trains all four, then evaluates
  python benchmarks/measure_variants.py --root=/tmp/variants --table=benchmarks/<time>_variants.json

Trains `python -m vit_jax.main` (configs/demo.py: ViT-Demo_4 on the digits,
2000 steps) plain, with one register (--config.num_registers=1), with a random
patch size of 2, 4 or 8 per step (--config.flexi_patch_sizes) and NaFlex
(--config.naflex_tokens: each image at its crop's aspect ratio, 4 to 36
patches), each in ROOT/<variant> (a finished run there is read, not run
again), evaluates every run on the 359 test digits at the patch sizes or
resolutions it takes, and writes a record benchmarks/<time>_variants.json whose
table docs/registers_flexi_naflex.md quotes (`--table` prints it again).
"""

import argparse
import datetime
import json
import os
import subprocess
import sys

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
  from vit_jax.data import pipeline
  from vit_jax.evaluation import classify
  from vit_jax.evaluation import loader

  loaded = loader.load_model(workdir, patch_size=patch_size)
  data = pipeline.data_config()
  data.update(dataset='digits', batch_eval=359)
  data.pp.crop = loader.check_resolution(loaded, crop)
  return classify.evaluate_checkpoint(loaded, data, 'test')['top1']


def table(record: dict) -> str:
  lines = [
    '| trained | flags | train img/s | evaluated at: test accuracy |',
    '|---|---|---:|---|',
  ]
  for name, run in record['runs'].items():
    flags = ' '.join(f'`{f}`' for f in VARIANTS[name]) or '(none)'
    results = ', '.join(f'{label}: {100 * acc:.2f}%' for label, acc in run['eval'].items())
    lines.append(f'| {name} | {flags} | {run["img_per_sec"]:.0f} | {results} |')
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
  from vit_jax import hardware

  runs = {}
  for name in VARIANTS:
    summary = train(args.root, name)
    workdir = os.path.join(args.root, name)
    runs[name] = {
      'img_per_sec': summary['img_per_sec'],
      'wall_time_s': summary['wall_time_s'],
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
