r"""The step costs that CI holds (tests/test_step_cost.py), compiled by the command users run.

  python benchmarks/step_cost.py [--only=NAME] [--reason='why the record moved']

Each entry is `python -m vit_jax.compile` of one of the paper's steps at a size CI
can afford: the recipe's model, batch per core and classes, one encoder block
deep on TPU (a block's cost is the same at any depth; the full depth compiles for
tens of minutes on a 2-core machine, one block in 4) and its evaluation step at
one image per core (the evaluation compiles apart; the record's memory is the
train step's). The record is the command's own JSON
(`--json`) with what made it: the command, the commit, the library versions and
the reason it was (re)made. A change to the step that moves a figure beyond the
test's tolerance fails CI until the record is made again by this script, with
the reason in the commit. The figures are the compilers' estimates: on TPU the step
time, FLOPs and memory; on GPU the memory (its compiler gives no step time on a CPU
machine; tests/test_compile_gpu.py holds its kernels and bytes written per block).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(ROOT, 'benchmarks', 'step_cost')
# name: the compile command's arguments. ViT-B/16's ImageNet-21k recipe (Table 3: batch 4,096
# on 32 TPUv3 cores, 128 per core) on one v3-8 host: 8 cores x 128; on one H100 the recipe's
# micro-batch there (4,096 in 8 accumulation steps: benchmarks/gpu/vit_b16_i21k_h100-1.json).
ENTRIES = {
  'vit_b16_i21k_v3-8_depth1': [
    '--config=configs/vit_b16.py:imagenet21k',
    '--topology=v3-8',
    '--config.batch=1024',
    '--config.depth=1',
    '--config.batch_eval=8',
  ],
  'vit_b16_i21k_h100-1_depth2': [
    '--config=configs/vit_b16.py:imagenet21k',
    '--topology=h100-1',
    '--config.batch=512',
    '--config.depth=2',
  ],
}


def compile_record(args, env=None) -> dict:
  """`python -m vit_jax.compile ARGS --json=...`'s record (raises with its stderr if it fails)."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, 'record.json')
    result = subprocess.run(
      [sys.executable, '-m', 'vit_jax.compile', *args, f'--json={path}'],
      cwd=ROOT,
      capture_output=True,
      text=True,
      env=env,
    )
    if result.returncode:
      raise RuntimeError(f'vit_jax.compile {" ".join(args)}: {result.stderr[-3000:]}')
    with open(path, encoding='utf-8') as f:
      return json.load(f)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--only', help='one entry: ' + ', '.join(ENTRIES))
  parser.add_argument('--reason', default='', help='why the record is made again')
  args = parser.parse_args()
  os.makedirs(RECORDS, exist_ok=True)
  for name, command in ENTRIES.items():
    if args.only and name != args.only:
      continue
    record = compile_record(command)
    # The compile command's own `made` (command, date, commit, versions), the --json path left out.
    record['made'].update(
      command='python -m vit_jax.compile ' + ' '.join(command),
      by='python benchmarks/step_cost.py',
      reason=args.reason,
    )
    path = os.path.join(RECORDS, f'{name}.json')
    with open(path, 'w', encoding='utf-8') as f:
      json.dump(record, f, indent=1)
    step = record.get('step_seconds_estimate')
    cost = (
      f'step >= {step:.4g} s, {record["flops_per_step_per_device"]:.4g} FLOPs, ' if step else ''
    )
    print(
      f'{name}: {cost}{record["hbm_bytes_per_device"] / 2**30:.2f} GiB per device; wrote {path}'
    )


if __name__ == '__main__':
  main()
