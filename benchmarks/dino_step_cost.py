r"""The self-distillation step's cost against a supervised step of the same backbone, on this CPU.

  python benchmarks/dino_step_cost.py [--recipe=ViT-S_14] [--batch=4] [--steps=4] [--record]

Builds the trainer's own programs (`training.program.build`) for DINOv2's recipe
(`configs/dinov2.py:RECIPE`: 2 global crops at 224 px, 8 local crops at 98 px, the recipe's
heads, iBOT masks) and for the same config with task='classification' (the same backbone at
224 px, one crop, a 1,000-class head, Adam), in float32 at the same batch. Times their steps
interleaved (one of each in turn, so that a busy machine slows both alike) and reports the
seconds per step, their ratio, each step's FLOPs (XLA's count of the compiled program, and
the closed forms of `vit_jax.bench.flops`: every crop of the student, the teacher's global
crops and the heads for self-distillation) and the MFU each reaches against this CPU's peak
(`core.hardware.stable_peak`). `--record` writes `benchmarks/<time>_dino_step_cost.json`.
"""

import argparse
import datetime
import json
import os
import time

import jax
import numpy as np


def _programs(recipe: str, batch: int):
  from vit_jax.configs import dinov2
  from vit_jax.core import sharding
  from vit_jax.training import program

  out = {}
  for task in ('dino', 'classification'):
    config = dinov2.get_config(recipe)
    config.update(task=task, batch=batch, dtype='float32', scan_layers=False, warmup_steps=1)
    config.drop_path_rate = 0.0  # the same model on both sides (the recipe's drop path costs ~0)
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    spec = program.validate(config, mesh.size)
    with jax.set_mesh(mesh):
      built = program.build(config, mesh, 1000, False, spec)
      state = jax.jit(built.init, out_shardings=built.state_shardings)(jax.random.PRNGKey(0))
    out[task] = (config, mesh, built, state)
  return out


def _batch(config, built, rng):
  spec = built.abstract_batch()
  batch = {}
  for key, s in spec.items():
    if s.dtype == np.uint8:
      batch[key] = rng.integers(0, 256, s.shape, dtype=np.uint8)
    elif s.dtype == np.bool_:
      batch[key] = rng.uniform(size=s.shape) < 0.15
    else:
      batch[key] = np.zeros(s.shape, s.dtype)
  return jax.device_put(batch, built.batch_sharding)


def measure(recipe: str, batch: int, steps: int) -> dict:
  from vit_jax.bench import flops as flops_lib
  from vit_jax.core import hardware

  rng = np.random.default_rng(0)
  programs = _programs(recipe, batch)
  compiled, states, batches, results = {}, {}, {}, {}
  for task, (config, mesh, built, state) in programs.items():
    with jax.set_mesh(mesh):
      data = _batch(config, built, rng)
      start = time.perf_counter()
      compiled[task] = built.train_step.lower(state, data).compile()
      cost = compiled[task].cost_analysis()
      cost = cost[0] if isinstance(cost, (list, tuple)) else cost
      arch = built.spec.architecture
      results[task] = {
        'compile_seconds': time.perf_counter() - start,
        'xla_flops_per_step': float(cost.get('flops', 0.0)),
        'closed_form_flops_per_step': flops_lib.run_flops_per_image(config, arch, 1000) * batch,
        'seconds': [],
      }
      states[task], batches[task] = state, data
  for task in compiled:  # one step each to warm up
    states[task], metrics = compiled[task](states[task], batches[task])
    jax.block_until_ready(metrics)
  for _ in range(steps):
    for task in compiled:
      start = time.perf_counter()
      states[task], metrics = compiled[task](states[task], batches[task])
      jax.block_until_ready(metrics)
      results[task]['seconds'].append(time.perf_counter() - start)
  peak, _ = hardware.stable_peak()
  for r in results.values():
    r['seconds_per_step'] = float(np.median(r['seconds']))
    r['mfu'] = r['closed_form_flops_per_step'] / (r['seconds_per_step'] * peak) if peak else None
  ssl, sup = results['dino'], results['classification']
  return {
    'recipe': f'configs/dinov2.py:{recipe}',
    'batch': batch,
    'dtype': 'float32',
    'cpu_peak_flops': peak,
    'self_distillation': ssl,
    'supervised': sup,
    'time_ratio': ssl['seconds_per_step'] / sup['seconds_per_step'],
    'closed_form_flops_ratio': ssl['closed_form_flops_per_step']
    / sup['closed_form_flops_per_step'],
    'xla_flops_ratio': ssl['xla_flops_per_step'] / sup['xla_flops_per_step'],
    'load_average_1min': os.getloadavg()[0],
    'cpu_cores': os.cpu_count(),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--recipe', default='ViT-S_14')
  parser.add_argument('--batch', type=int, default=4)
  parser.add_argument('--steps', type=int, default=4)
  parser.add_argument('--record', action='store_true')
  args = parser.parse_args()
  result = measure(args.recipe, args.batch, args.steps)
  for name in ('self_distillation', 'supervised'):
    r = result[name]
    print(
      f'{name:18s} {r["seconds_per_step"]:.2f} s/step  XLA {r["xla_flops_per_step"]:.3g} FLOPs  '
      f'closed form {r["closed_form_flops_per_step"]:.3g}  MFU {r["mfu"]:.3f}'
    )
  print(
    f'ratio: time {result["time_ratio"]:.2f}x, FLOPs {result["closed_form_flops_ratio"]:.2f}x '
    f'(closed form), {result["xla_flops_ratio"]:.2f}x (XLA)'
  )
  if args.record:
    stamp = datetime.datetime.now().strftime('%Y-%m-%dT%H%M')
    path = os.path.join(os.path.dirname(__file__), f'{stamp}_dino_step_cost.json')
    with open(path, 'w') as f:
      json.dump(result, f, indent=1)
    print(f'wrote {path}')


if __name__ == '__main__':
  main()
