r"""Measures the README's main command: `python -m vit_jax.main` (the demo).

  python benchmarks/measure_demo.py [--runs=2] [--keep=workdirs/demo] [--flags='--config.fp8=True']

  python benchmarks/measure_demo.py --readme=benchmarks/<time>_demo.json

Runs the default command in a fresh workdir, times it end to end (process
start to exit, compilation and evaluation included), reads the run's summary,
and writes a record `benchmarks/<time>_demo.json`. Target: test
accuracy >= 97% within 10 minutes on a 2-core CPU. The README's demo line and
docs/development.md's sentences are printed from the record (`--readme` prints
them for an existing one): copy them, do not retype the numbers. `--flags` runs the demo with
other config values (the record names them): `--flags=--config.fp8=True` is the demo with FP8
products (docs/speed_and_scale.md).
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

from vit_jax import workdir as workdir_lib
from vit_jax.core import hardware


def vector_isa(machine: dict) -> str:
  """The widest vector instructions XLA generated CPU code for: 'AVX-512' or 'AVX2'. The demo's
  float32 sums round differently with each, so its accuracy depends on it (README)."""
  held = 'xla_cpu_max_isa=AVX2' in machine.get('xla_flags', '')
  return 'AVX-512' if 'avx512f' in machine.get('cpu_flags', []) and not held else 'AVX2'


def readme_sentence(record: dict, path: str) -> str:
  """The README's demo figures, from a record of this script (its last run): the accuracy with
  the CPU and vector instructions it was reached on, the time with the machine's load."""
  run, machine = record['runs'][-1], record['machine']
  return (
    f'{100 * run["test_accuracy"]:.2f}% test accuracy on a {machine["cpu_cores"]}-core '
    f'{machine["cpu"]} with {vector_isa(machine)}, in {run["end_to_end_s"]:.0f} s end to end '
    f'(compilation and evaluations included; training at {run["img_per_sec"]:,.0f} img/s, load '
    f'average {machine["load_average_1min"]:.1f}; `benchmarks/{os.path.basename(path)}`)'
  )


def setup_sentence(record: dict, path: str) -> str:
  """The README's Set-up line on the main job, from a record of this script (its last run)."""
  run, machine = record['runs'][-1], record['machine']
  return (
    f'{100 * run["test_accuracy"]:.2f}% test accuracy in {run["end_to_end_s"] / 60:.0f} minutes '
    f'end to end on a {machine["cpu_cores"]}-core CPU (`benchmarks/{os.path.basename(path)}`)'
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--runs', type=int, default=1)
  parser.add_argument(
    '--keep',
    help='keep the (last) run in this workdir, e.g. workdirs/demo; '
    'it must not exist yet, or the run would resume instead of train',
  )
  parser.add_argument(
    '--readme', help="print the README's and docs/development.md's sentences of this record"
  )
  parser.add_argument('--flags', default='', help="the main command's extra flags, space-separated")
  args = parser.parse_args()
  if args.readme:
    with open(args.readme, encoding='utf-8') as f:
      record = json.load(f)
    print(setup_sentence(record, args.readme))
    print(readme_sentence(record, args.readme))
    return
  if args.runs < 1:
    parser.error('--runs must be at least 1')
  if args.keep and os.path.exists(args.keep):
    parser.error(f'--keep={args.keep} exists; remove it or name another directory')

  runs = []
  for i in range(args.runs):
    with tempfile.TemporaryDirectory() as tmp:
      workdir = args.keep if args.keep and i == args.runs - 1 else tmp
      start = time.perf_counter()
      result = subprocess.run(
        [sys.executable, '-m', 'vit_jax.main', f'--workdir={workdir}', *args.flags.split()],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
      )
      if result.returncode:
        lines = result.stderr.strip().splitlines() or ['(no output)']
        sys.exit(f'python -m vit_jax.main failed: {lines[-1]}')
      elapsed = time.perf_counter() - start
      summary = workdir_lib.read_summary(workdir)
    runs.append({'end_to_end_s': round(elapsed, 1), **summary})
    print(
      f'test accuracy {summary["test_accuracy"]:.4f} in {elapsed:.0f} s end to end '
      f'(training loop {summary["img_per_sec"]:.0f} img/s)'
    )

  record = {
    'benchmark': 'demo: python -m vit_jax.main',
    'flags': args.flags.split(),
    'date': datetime.datetime.now().isoformat(timespec='seconds'),
    'machine': hardware.machine_info(),
    'runs': runs,
    'target_met': all(r['test_accuracy'] >= 0.97 and r['end_to_end_s'] <= 600 for r in runs),
  }
  suffix = '_demo_' + '_'.join(f.split('.')[-1].replace('=', '_') for f in args.flags.split())
  name = datetime.datetime.now().strftime('%Y-%m-%dT%H%M') + (suffix.rstrip('_') + '.json')
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(record, f, indent=2)
    f.write('\n')
  print(
    f'target (>= 97% in <= 600 s): {"met" if record["target_met"] else "NOT met"}; wrote {path}'
  )
  print(f'README: {setup_sentence(record, path)}')
  print(f'docs/development.md: {readme_sentence(record, path)}')


if __name__ == '__main__':
  main()
