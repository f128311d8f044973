r"""FP8 against bf16 on the same data: the demo's loss curves from the same parameters.

  python benchmarks/fp8_curves.py [--steps=200] [--json=PATH]

Trains the demo (`configs/demo.py`: ViT-Demo_4 on the built-in digits) for
--steps steps twice in one process, in bfloat16 and in bfloat16 with FP8
products (`--config.fp8=True`, vit_jax.models.fp8), from the same initial
parameters on the same batches, and records both loss curves and their
largest relative difference. On a CPU FP8 is emulated (the same roundings);
on an H100/H200 its products run on the FP8 tensor cores. The record's
`max_relative_difference` of a CPU run sets the bound that a card's run is
held to (tests/test_fp8.py).
"""

import argparse
import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # vit_jax from this checkout, installed or not (the GPU image has it not)


def curve(steps: int, fp8: bool, dtype: str = 'bfloat16') -> list:
  """The demo's training loss at each of its first `steps` steps (a run of `steps` steps)."""
  import jax

  from vit_jax.configs import demo
  from vit_jax.data import pipeline
  from vit_jax.training import program

  config = demo.get_config()
  config.update(dtype=dtype, fp8=fp8, total_steps=steps, warmup_steps=max(1, steps // 10))
  mesh = program.make_mesh(config)
  built = program.build(config, mesh, num_classes=10, multi_label=False)
  batches = pipeline.make_train_iterator(config, built.batch_sharding, raw=True)
  losses = []
  with jax.set_mesh(mesh):
    state = jax.jit(built.init, out_shardings=built.state_shardings)(
      jax.random.PRNGKey(config.seed)
    )
    for _ in range(steps):
      state, metrics = built.train_step(state, next(batches))
      losses.append(metrics['loss'])
  return [float(x) for x in jax.device_get(losses)]


def compare(steps: int) -> dict:
  """Both curves and how far apart they are: the largest |fp8 - bf16| / bf16 over the steps, and
  the mean loss of each over the last fifth of the run."""
  import numpy as np

  bf16, fp8 = np.array(curve(steps, False)), np.array(curve(steps, True))
  tail = max(1, steps // 5)
  return {
    'steps': steps,
    'bf16_loss': bf16.round(5).tolist(),
    'fp8_loss': fp8.round(5).tolist(),
    'max_relative_difference': float(np.max(np.abs(fp8 - bf16) / bf16)),
    'tail_mean_loss': {'bf16': float(bf16[-tail:].mean()), 'fp8': float(fp8[-tail:].mean())},
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=200)
  parser.add_argument('--json', help='write the record here (default: print it)')
  args = parser.parse_args()
  from vit_jax.core import hardware

  record = {
    'benchmark': 'python benchmarks/fp8_curves.py',
    'date': datetime.datetime.now().isoformat(timespec='seconds'),
    'machine': hardware.machine_info(),
    **compare(args.steps),
  }
  print(
    f'{args.steps} steps on {record["machine"]["device_kind"]}: largest relative difference '
    f'{record["max_relative_difference"]:.4f}; last fifth mean loss bf16 '
    f'{record["tail_mean_loss"]["bf16"]:.4f}, fp8 {record["tail_mean_loss"]["fp8"]:.4f}'
  )
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(record, f, indent=1)


if __name__ == '__main__':
  main()
