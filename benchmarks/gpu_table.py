r"""Compiles the paper's runs and the giant ViTs for NVIDIA GPU boxes and clusters: the docs' GPU table.

  python benchmarks/gpu_table.py [--only=NAME] [--max_compiles=3] [--markdown]

Runs `python -m vit_jax.compile --fit` for each entry below, in order, and
writes `benchmarks/gpu/<name>.json` as each finishes (an entry whose record
exists is skipped, so the script resumes; one that fits nothing gets a record
with the error). Needs the GPU compiler (`pip install -e ".[gpu]"`), not a
GPU. Memory is the GPU compiler's estimate, the step time a roofline lower
bound: not measurements.
"""

import argparse
import json
import os

import tpu_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
I21K, FT = 'configs/{}.py:imagenet21k', 'configs/finetune.py:{},cifar10'
# (record name, config, GPUs, extra overrides), in priority order.
ENTRIES = [
  # The acceptance: one H100, and two boxes of 8 at the paper's batch.
  ('vit_b16_i21k_h100-1', I21K.format('vit_b16'), 'h100-1', []),
  ('vit_b16_i21k_h100-16', I21K.format('vit_b16'), 'h100-16', []),
  # Pre-training (paper Table 3, batch 4096 at 224 px) on one box of 8.
  *(
    (f'{m}_{d}_{g}-8', f'configs/{m}.py:{"jft" if m == "vit_h14" else "imagenet21k"}', f'{g}-8', [])
    for m, d in (('vit_b16', 'i21k'), ('vit_l16', 'i21k'), ('vit_h14', 'jft'))
    for g in ('h100', 'a100', 'a100_40g')
  ),
  # Fine-tuning (paper Table 4: 384 px, batch 512) on a box of 8 and on one GPU.
  *(
    (f'finetune_{m}_384_{g}', FT.format(model), g, [])
    for m, model in (('b16', 'ViT-B_16'), ('l16', 'ViT-L_16'))
    for g in ('h100-8', 'a100-8', 'a100_40g-8', 'h100-1')
  ),
  ('vit_b16_i21k_h200-8', I21K.format('vit_b16'), 'h200-8', []),
]
# Beyond the paper: the giant ViTs (configs/giant.py: scanned, rematerialised,
# bfloat16, Adam's first moment in bfloat16). FSDP within each box of 8, so
# that the weight gathers stay on NVLink and only the data-parallel gradient
# reduction crosses boxes; ViT-22B also splits heads and MLP over the 8 GPUs
# of a box (tensor parallelism) and shards the rest over 64 boxes, at the
# paper's 64 images per chip (65,536 on 1,024 GPUs).
GIANT_ENTRIES = [
  ('vit_g14_jft_h100-16', 'configs/giant.py:ViT-g_14', 'h100-16', ['--config.mesh.fsdp=8']),
  ('vit_G14_jft_h100-32', 'configs/giant.py:ViT-G_14', 'h100-32', ['--config.mesh.fsdp=8']),
  (
    'vit_22b_jft_h100-1024',
    'configs/giant.py:ViT-22B_14',
    'h100-1024',
    [
      '--config.batch=65536',
      '--config.batch_eval=4096',
      '--config.accum_steps=4',
      '--config.mesh.fsdp=64',
      '--config.mesh.model=8',
    ],
  ),
]


# Self-distillation as DINOv2 (configs/dinov2.py): its ViT-L/14 recipe at DINOv2's 32 images
# per GPU on one box, its ViT-g/14 at 12 per GPU on two boxes (FSDP within each box).
DINO_ENTRIES = [
  ('dinov2_vitl14_h100-8', 'configs/dinov2.py:ViT-L_14', 'h100-8', ['--config.batch=256']),
  (
    'dinov2_vitg14_h100-16',
    'configs/dinov2.py:ViT-g_14',
    'h100-16',
    ['--config.batch=192', '--config.mesh.fsdp=8'],
  ),
]


def _record(name):
  path = os.path.join(ROOT, 'benchmarks', 'gpu', f'{name}.json')
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def _row(config, extra, topology, r) -> str:
  run = f'`{config}`' + ''.join(f' `{x}`' for x in extra)
  if 'error' in r:
    return f'| {run} | {topology} | does not fit: {r["error"]} | | | | | | | | {tpu_table._compiled(r)} |'
  m = r['mesh']
  mesh = f'{m["slice"] * m["data"]} x {m["fsdp"]} x {m["model"]}'
  attention = 'cuDNN' if r['attention']['custom_calls'] else 'XLA'
  seconds, hours = r['step_seconds_lower_bound'], r['gpu_hours_lower_bound']
  boxes = f'{r["boxes"]} box' + ('es' if r['boxes'] > 1 else '')
  return (
    f'| {run} | {topology} ({boxes}) | {" ".join(r.get("overrides") or []) or "none"} '
    f'| {mesh} | {r["hbm_bytes_per_device"] / 2**30:.1f} of {r["usable_bytes"] / 2**30:.1f} GiB '
    f'| {attention} | {r["compute_seconds_at_peak"]:.3f} s | {r["comm_seconds_lower_bound"]:.3f} s '
    f'| {seconds:.3f} s | {r["img_per_sec_upper_bound"]:,.0f} '
    f'| {_hours(hours, extra)} | {tpu_table._compiled(r)} |'
  )


def _hours(hours, extra) -> str:
  # A config's total_steps are those of its own batch: with another batch the
  # run would see other numbers of epochs, so no run cost is given.
  if any(x.startswith('--config.batch=') for x in extra):
    return '-'
  return f'{hours:,.{1 if hours < 100 else 0}f}'


def markdown() -> str:
  """The docs' GPU table, from the records written so far."""
  rows = [
    '| run | GPUs | fitting overrides | mesh (data x fsdp x model) | memory per GPU (of usable) '
    '| attention | compute at peak | communication (lower bound) | step time (lower bound) '
    '| img/s (upper bound) | GPU-hours for the run (lower bound) | compiled |',
    '|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---|',
  ]
  for name, config, topology, extra in ENTRIES + GIANT_ENTRIES:
    r = _record(name)
    if r is not None:
      rows.append(_row(config, extra, topology, r))
  return '\n'.join(rows)


def compile_entry(name, config, topology, extra, max_compiles) -> None:
  """Runs the compile command for one entry; a run that fits nothing gets a record of its error."""
  path, returncode, errors = tpu_table.compile_entry(
    name, config, topology, extra, max_compiles, folder='gpu'
  )
  if returncode == 2 and errors and not os.path.exists(path):
    with open(path, 'w', encoding='utf-8') as f:
      json.dump({'topology': topology, 'fits': False, 'error': errors[-1][7:]}, f, indent=1)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--only', help='run this entry only')
  parser.add_argument('--max_compiles', type=int, default=3)
  parser.add_argument('--markdown', action='store_true', help='print the table of the records')
  parser.add_argument(
    '--again', action='store_true', help='compile entries whose record exists too (a new step)'
  )
  parser.add_argument(
    '--stamp', action='store_true', help="give records compiled without 'made' their commit"
  )
  args = parser.parse_args()
  if args.markdown:
    print(markdown())
    return
  for name, config, topology, extra in ENTRIES + GIANT_ENTRIES + DINO_ENTRIES:
    if args.only and name != args.only:
      continue
    path = os.path.join(ROOT, 'benchmarks', 'gpu', f'{name}.json')
    if args.stamp:
      command = f'python -m vit_jax.compile --config={config} --topology={topology} --fit'
      if os.path.exists(path) and tpu_table.stamp(path, ' '.join([command, *extra])):
        print('stamped', path)
      continue
    if os.path.exists(path) and not args.again:
      continue
    compile_entry(name, config, topology, extra, args.max_compiles)


if __name__ == '__main__':
  main()
