r"""The whole training loop against the bare train step.

  python benchmarks/measure_loop.py [--cases=demo,s16]

For each case it runs `python -m vit_jax.main` (input pipeline, progress
logging, TensorBoard, checkpoint saves all on) and reads the loop's rate from
summary.json (`img_per_sec`: wall time after the first step, evaluations
excluded), then times the same model, batch, resolution and optimizer with
`vit_jax.benchmark` (the jitted train step on device-resident random data).
Writes `benchmarks/<time>_cpu_loop.json`. Target: the loop within 10% of the
bare step.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

from vit_jax.bench import speed
from vit_jax.core import hardware

# name -> (config overrides for vit_jax.main, benchmark options of the same step)
CASES = {
  # The README's demo: a tiny model, so the input pipeline has the most to keep up with.
  'demo': (
    ['--config=configs/demo.py', '--config.total_steps=600'],
    speed.Options(
      model='ViT-Demo_4',
      mode='train',
      batch=128,
      resolution=16,
      num_classes=10,
      warmup=3,
      steps=20,
      repeats=3,
    ),
  ),
  # A paper model at 224 px, compute-bound on a CPU.
  's16': (
    [
      '--config=configs/demo.py',
      '--config.model=ViT-S_16',
      '--config.pp.crop=224',
      '--config.batch=16',
      '--config.total_steps=24',
      '--config.warmup_steps=2',
      '--config.progress_every=4',
      '--config.checkpoint_every=12',
      '--config.eval_every=1000',
      '--config.batch_eval=64',
    ],
    speed.Options(
      model='ViT-S_16',
      mode='train',
      batch=16,
      resolution=224,
      num_classes=10,
      warmup=1,
      steps=4,
      repeats=3,
    ),
  ),
}


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_loop(flags) -> dict:
  with tempfile.TemporaryDirectory() as workdir:
    result = subprocess.run(
      [sys.executable, '-m', 'vit_jax.main', f'--workdir={workdir}', *flags],
      cwd=REPO,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
    )
    if result.returncode:
      lines = result.stderr.strip().splitlines() or ['(no output)']
      sys.exit(f'vit_jax.main {" ".join(flags)} failed: {lines[-1]}')
    with open(os.path.join(workdir, 'summary.json'), encoding='utf-8') as f:
      return json.load(f)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--cases', default=','.join(CASES))
  args = parser.parse_args()

  unknown = set(args.cases.split(',')) - set(CASES)
  if unknown:
    parser.error(f'unknown case(s) {", ".join(sorted(unknown))}; choose from {", ".join(CASES)}')
  results = {}
  for name in args.cases.split(','):
    flags, opts = CASES[name]
    loop = run_loop(flags)['img_per_sec']
    step = speed.run(opts)['vit_jax']['img_per_sec']
    results[name] = {
      'main_flags': flags,
      'loop_img_per_sec': loop,
      'step_img_per_sec': step,
      'loop_over_step': loop / step,
      'target_met': loop >= 0.9 * step,
    }
    print(
      f'{name}: loop {loop:.1f} img/s, bare step {step:.1f} img/s, loop/step = {loop / step:.3f}'
    )

  now = datetime.datetime.now(datetime.timezone.utc)
  record = {
    'benchmark': 'benchmarks/measure_loop.py',
    'time_utc': now.isoformat(timespec='seconds'),
    'machine': hardware.machine_info(),
    'cases': results,
  }
  platform = record['machine']['platform']
  path = os.path.join(REPO, 'benchmarks', now.strftime('%Y%m%dT%H%M') + f'_{platform}_loop.json')
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(record, f, indent=1)
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
